"""The injection modes: one small class per ``inject.mode``, registered in ``INJECT_MODES``.

A mode says everything about itself in one place: its name, its knob (what it is, and the ``inject.*`` key that sets
it: ``knob_name``, e.g. ``inject.sigma``) or which keys choose its mismatch instead, its own settings (a dataclass
whose fields become ``inject.*`` keys: ``vexact.registry``), the checks on its settings, what it does to the
rollout path, and how ``inject.target`` searches its knob. The config (``inject.mode`` choices, its knob's key,
"needs a value" / "value unused" checks, value ranges), the injector (``vexact.rl.inject``), the calibration and
the documentation's table all read the registry, so a new mode is one class here -- or, from outside the
package, one class and ``vexact.register_inject_mode(MyMode())`` -- plus its tests.

What a mode changes reaches the rollout as pieces the injector assembles into a ``RolloutPlan``:

* a **knob mode** (``knob`` set) returns a logits hook from ``logits_hook(injector, value, step)``: ``hook(z, seq,
  pos) -> (sample_from, record)``, the logits the sampler draws from and the logits whose log-softmax is recorded.
  None when the value changes nothing: no hook is what makes magnitude 0 a bitwise no-op. Random draws are keyed
  by (seed, sequence, position) (``counter_normal`` / ``counter_uniform``), never from a global generator;
* a **path mode** (no knob) returns a ``RolloutPath`` from ``rollout_path(injector)``: other kernel ops, another
  weight dtype, an optional hook (``kernel``, ``precision``), applied from ``inject.onset_step`` on;
* a **routing mode** (a knob mode for mixture-of-experts models: ``routing_flip``) returns a route hook from
  ``routing_hook(injector, value, step)`` (``vexact.engine.model.RouteHook``): it changes which experts the rollout's
  router uses, keyed by (seed, sequence, position, layer); ``model_problem`` refuses a model it cannot act on.

Above the config in the import order: the config validates ``inject.mode`` against the registry
(``vexact.rl.registries``), never importing this module; the ``vexact.rl`` package imports it, which registers the
built-in modes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch
from torch import Tensor

from vexact_kernels import OP_NAMES, get_ops

from ..engine.generation import LogitsHook
from ..engine.model import KernelOps, ModelConfig, RouteHook, resolve_dtype
from ..engine.sampling import counter_normal, counter_uniform
from .config_schema import Backend, DType
from .registries import INJECT_MODES, register_run_check
from .tasks import task_of
from .validate import ConfigError

if TYPE_CHECKING:
    from .config_schema import InjectSection, RunConfig

__all__ = ["FLIP_KINDS", "INJECT_MODES", "PRECISION_FORMATS", "PRECISION_SITES", "InjectMode", "InjectorView",
           "KernelSettings", "KnobSearch", "PrecisionSettings", "RolloutPath", "RoutingFlipSettings", "flip_hook",
           "precision_ops", "register_inject_mode", "round_to"]


class InjectorView(Protocol):
    """What a mode reads of the run's injector (``vexact.rl.inject.Injector``, which imports this module: named here
    by its shape, not its class, so no import of any kind runs back to it)."""

    cfg: InjectSection
    seed: int
    device: torch.device
    training_dtype: torch.dtype
    rollout_dtype: torch.dtype
    rollout_ops: KernelOps

    def scoped(self, clean: Tensor, changed: Tensor, seq: Tensor, pos: Tensor, step: int) -> Tensor: ...


_NOISE_SALT = 0x6A09E667
_ROUTING_SALT = 0x510E527F


@dataclass(frozen=True)
class RolloutPath:
    """What a path mode runs the rollout with: kernel ops, the weights' dtype, and an optional logits hook."""

    ops: KernelOps
    dtype: torch.dtype
    logits_hook: LogitsHook | None = None


@dataclass(frozen=True)
class KnobSearch:
    """How ``calibrate`` searches a knob. ``integer``: bisection over whole knobs in ``[low, high]`` (the metric is
    largest at ``low``); otherwise a doubling-then-bisection search over a magnitude u in ``[0, upper]``, tried as
    knob ``to_knob(u)``; the metric is assumed to grow with u."""

    integer: bool = False
    low: int = 1
    high: int = 2
    to_knob: Callable[[float], float] = float
    upper: float = 1e3


class InjectMode:
    """One ``inject.mode``. Subclass it, set the class attributes, override what the mode does, and register an
    instance (``register_inject_mode``).

    ``knob``: what the mode's magnitude is (None: the mode has none, and ``source_keys`` name the keys that choose
    its mismatch: by default the keys of its ``settings``); ``knob_name``: the config key that sets it,
    ``inject.<knob_name>`` (``sigma``, ``epsilon``, ...; None: ``inject.value``, the spelling every knob mode had
    before modes named their knobs, still read for them with a FutureWarning); the config stores it there and the
    injector reads it as ``InjectSection.value``; ``settings``: a dataclass of the mode's own
    options, mounted as ``inject.<field>`` keys while the mode is registered; ``calibratable``: ``inject.target``
    may search the knob (``knob_search``); ``reads_scope``: the mode's hook applies ``injector.scoped`` (else a
    config whose ``inject.scope`` is not ``all`` is refused: the scope would be ignored); ``injects``: False only for
    ``none``, the mode that leaves the rollout path as configured."""

    name: ClassVar[str] = ""
    injects: ClassVar[bool] = True
    knob: ClassVar[str | None] = None
    knob_name: ClassVar[str | None] = None
    settings: ClassVar[type | None] = None
    source_keys: ClassVar[tuple[str, ...]] = ()
    calibratable: ClassVar[bool] = False
    reads_scope: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # a path mode's mismatch is chosen by its settings: one list of the keys, theirs
        if cls.knob is None and cls.settings is not None and "source_keys" not in cls.__dict__:
            cls.source_keys = tuple(f"inject.{f.name}" for f in dataclasses.fields(cls.settings))

    def check(self, cfg: InjectSection) -> None:
        """Raise ``ConfigError(problem, key)`` (key relative to ``inject``) for settings this mode cannot run."""
        problem = self.value_problem(cfg.value)
        if problem:
            raise ConfigError(problem, self.knob_key)

    @property
    def knob_key(self) -> str:
        """The key of this mode's knob relative to ``inject``: ``knob_name``, else ``value``."""
        return self.knob_name or "value"

    def value_problem(self, value: float) -> str | None:
        """Why ``value`` is out of this mode's range (None when it is fine)."""
        return None

    def ramped(self, value: float, fraction: float) -> float:
        """The knob ``fraction`` (0 < fraction <= 1) of the way up ``inject.ramp_steps``' ramp to ``value``: from the
        knob that changes nothing toward ``value``. Default: a magnitude, linear from 0."""
        return value * fraction

    def rollout_path(self, injector: InjectorView) -> RolloutPath | None:
        """A path mode's rollout (built once per injector); None for knob modes."""
        return None

    def logits_hook(self, injector: InjectorView, value: float, step: int) -> LogitsHook | None:
        """A knob mode's hook at knob ``value`` and ``step``; None when it would change nothing."""
        return None

    def routing_hook(self, injector: InjectorView, value: float, step: int) -> RouteHook | None:
        """A routing mode's route hook at knob ``value`` and ``step``; None when it would change nothing."""
        return None

    def model_problem(self, model: ModelConfig) -> str | None:
        """Why this mode cannot act on a policy of shape ``model`` (None when it can; the config reports it at
        ``inject.mode``)."""
        return None

    def knob_search(self, sign: float, vocab_size: int) -> KnobSearch:
        """How calibration searches the knob (``sign``: the direction of a signed knob, from ``inject.value``)."""
        return KnobSearch()

    def backends(self, cfg: InjectSection) -> tuple[str, ...]:
        """Kernel backends the mode runs the rollout on besides the configured ones (the Triton guard asks)."""
        return ()


def register_inject_mode(mode: InjectMode, replace: bool = False) -> InjectMode:
    """Register an injection mode (an ``InjectMode`` instance) under its ``name``: ``inject.mode: NAME`` selects it
    in configs, sweeps and ``--set``. A name already taken is an error unless ``replace``."""
    if not isinstance(mode, InjectMode):
        raise TypeError(f"register_inject_mode needs an InjectMode instance, got {mode!r}")
    if mode.knob is None and mode.calibratable:
        raise ValueError(f"injection mode {mode.name!r} is calibratable but has no knob")
    if mode.knob_name is not None:
        taken = {f.name for f in dataclasses.fields(mode.settings)} if mode.settings is not None else set()
        if mode.knob is None or not mode.knob_name.isidentifier() or mode.knob_name == "value" or \
                mode.knob_name in taken:
            raise ValueError(f"injection mode {mode.name!r}: knob_name {mode.knob_name!r} must name the mode's knob "
                             "(knob set) as a new identifier, not 'value' nor one of its settings")
    return INJECT_MODES.add(mode.name, mode, replace=replace)


# --- the built-in modes ---------------------------------------------------------------------------------------


class NoInjection(InjectMode):
    """``none``: the rollout path as configured (``rollout`` section), nothing injected."""

    name = "none"
    injects = False


class _Perturb(InjectMode):
    """A knob mode that changes the logits where ``inject.scope`` says: ``changed(z, value, noise_seed, seq, pos)``
    gives the perturbed logits; value 0 installs no hook."""

    calibratable = True
    reads_scope = True

    def changed(self, z: Tensor, value: float, noise_seed: int, seq: Tensor, pos: Tensor) -> Tensor:
        raise NotImplementedError

    def logits_hook(self, injector: InjectorView, value: float, step: int) -> LogitsHook | None:
        if value == 0.0:
            return None
        noise_seed = (injector.seed * 1_000_003 + step) ^ _NOISE_SALT

        def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
            changed = injector.scoped(z, self.changed(z, value, noise_seed, seq, pos), seq, pos, step)
            return changed, changed

        return hook


def _noise(z: Tensor, value: float, noise_seed: int, seq: Tensor, pos: Tensor) -> Tensor:
    return (z.double() + value * counter_normal(noise_seed, seq, pos, z.shape[-1])).float()


def _sigma_problem(mode: str, value: float) -> str | None:
    return f"{mode} needs sigma >= 0, got {value}" if value < 0 else None


class LogitNoise(_Perturb):
    """``logit_noise``: rollout logits z + σ·N(0, 1) (unbiased drift)."""

    name = "logit_noise"
    knob = "sigma of the noise added to the logits"
    knob_name = "sigma"

    def changed(self, z: Tensor, value: float, noise_seed: int, seq: Tensor, pos: Tensor) -> Tensor:
        return _noise(z, value, noise_seed, seq, pos)

    def value_problem(self, value: float) -> str | None:
        return _sigma_problem(self.name, value)


class LogitScale(_Perturb):
    """``logit_scale``: z · (1 + ε): sharper for ε > 0, flatter for ε < 0 (systematic bias)."""

    name = "logit_scale"
    knob = "epsilon: logits x (1 + epsilon)"
    knob_name = "epsilon"

    def changed(self, z: Tensor, value: float, noise_seed: int, seq: Tensor, pos: Tensor) -> Tensor:
        return z * (1.0 + value)

    def value_problem(self, value: float) -> str | None:
        return f"logit_scale needs epsilon > -1 (logits x (1 + epsilon)), got {value}" if value <= -1 else None

    def knob_search(self, sign: float, vocab_size: int) -> KnobSearch:
        return KnobSearch(to_knob=lambda u: sign * u, upper=0.999 if sign < 0 else 1e3)


class LogprobOnly(LogitNoise):
    """``logprob_only``: sampling stays exact, the *recorded* log-probs come from z + σ·N: isolates the
    importance-ratio channel from the sampling-distribution channel."""

    name = "logprob_only"
    knob = "sigma of the noise added to the rollout's log-probs"
    knob_name = "sigma"

    def logits_hook(self, injector: InjectorView, value: float, step: int) -> LogitsHook | None:
        both = super().logits_hook(injector, value, step)
        if both is None:
            return None
        return lambda z, seq, pos: (z, both(z, seq, pos)[1])


def _exact_probs(logits: Tensor) -> Tensor:
    """Row-wise softmax through the exact kernels, so masks never depend on the batch."""
    return get_ops("exact", logits.device).log_softmax(logits).exp()


def _truncate_hook(top_p: float | None = None, top_k: int | None = None) -> LogitsHook:
    """Sample from (and record) the truncated distribution: the top ``top_k`` tokens and/or the smallest prefix
    reaching mass ``top_p`` (top-1 always kept); ties broken by a stable sort."""

    def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.sort(z, dim=-1, descending=True, stable=True)
        keep_sorted = torch.ones_like(z, dtype=torch.bool)
        if top_k is not None:
            keep_sorted[:, top_k:] = False
        if top_p is not None:
            probs = _exact_probs(order.values).double()
            mass_before = torch.cumsum(probs, dim=-1) - probs
            keep_sorted &= mass_before < top_p  # the smallest prefix reaching top_p (top-1 always kept)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order.indices, keep_sorted)
        truncated = z.masked_fill(~keep, -math.inf)
        return truncated, truncated

    return hook


class TopP(InjectMode):
    """``top_p``: the rollout samples from the nucleus of mass p (and records its log-probs); training scores the
    full distribution. Value 1 is no truncation."""

    name = "top_p"
    knob = "the nucleus p"
    knob_name = "top_p"
    calibratable = True

    def check(self, cfg: InjectSection) -> None:
        if not 0 < cfg.value <= 1 and cfg.target is None:
            raise ConfigError(f"top_p needs 0 < p <= 1, got {cfg.value}", self.knob_key)

    def logits_hook(self, injector: InjectorView, value: float, step: int) -> LogitsHook | None:
        return None if value >= 1.0 else _truncate_hook(top_p=value)

    def knob_search(self, sign: float, vocab_size: int) -> KnobSearch:
        return KnobSearch(to_knob=lambda u: 1.0 - u, upper=1.0 - 1e-6)

    def ramped(self, value: float, fraction: float) -> float:
        return 1.0 - (1.0 - value) * fraction  # p from 1 (nothing cut) down to value


class TopK(InjectMode):
    """``top_k``: the rollout samples from the k most likely tokens (and records their log-probs); 0 is off, else k
    is below the vocabulary size (``check_top_k_cuts``)."""

    name = "top_k"
    knob = "k"
    knob_name = "top_k"
    calibratable = True

    def value_problem(self, value: float) -> str | None:
        return f"top_k needs a whole number >= 0 (0 = off), got {value}" if value < 0 or value != int(value) else None

    def logits_hook(self, injector: InjectorView, value: float, step: int) -> LogitsHook | None:
        return None if value <= 0 else _truncate_hook(top_k=int(round(value)))

    def knob_search(self, sign: float, vocab_size: int) -> KnobSearch:
        return KnobSearch(integer=True, low=1, high=vocab_size)  # metric(low) is the largest, metric(high) == 0

    def ramped(self, value: float, fraction: float) -> float:
        if value <= 0:  # off
            return value
        return float(round(value / fraction))  # k from large (little cut) down to value: linear in 1/k


PRECISION_FORMATS: dict[str, tuple[torch.dtype, float | None]] = {
    "bfloat16": (torch.bfloat16, None),
    "float16": (torch.float16, 65504.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
"""``inject.precision`` -> the dtype the rollout rounds to and its largest finite value (saturated to; None: the
format has float32's range)."""

PRECISION_SITES: dict[str, str | None] = {"linear": "linear", "attention": "attention", "norm": "rms_norm",
                                          "logits": None}
"""``inject.sites`` -> the kernel op whose output is rounded there (``logits``: the logits hook rounds them)."""


def round_to(x: Tensor, fmt: str) -> Tensor:
    """Round to a lower-precision format and back (emulation), saturating instead of overflowing."""
    if fmt not in PRECISION_FORMATS:
        raise ValueError(f"unknown precision format {fmt!r}")
    dtype, largest = PRECISION_FORMATS[fmt]
    if largest is not None:
        x = x.clamp(-largest, largest)
    return x.to(dtype).to(x.dtype)


def precision_ops(base: KernelOps, fmt: str, sites: list[str]) -> SimpleNamespace:
    """Kernel ops whose outputs at the chosen sites are rounded to ``fmt`` (rollout only)."""

    def rounded(fn: Callable) -> Callable:
        return lambda *args, **kwargs: round_to(fn(*args, **kwargs), fmt)

    ops = {name: getattr(base, name) for name in OP_NAMES}
    for site, op in PRECISION_SITES.items():
        if op is not None and site in sites:
            ops[op] = rounded(ops[op])
    return SimpleNamespace(**ops)


@dataclass
class PrecisionSettings:
    """The ``precision`` mode's settings (``inject`` section)."""

    precision: Literal[tuple(PRECISION_FORMATS)] = "bfloat16"  # precision mode: rounding format
    # precision mode: where the rollout rounds: linear, attention, norm outputs, logits
    sites: list[Literal[tuple(PRECISION_SITES)]] = field(default_factory=lambda: ["logits"])


class Precision(InjectMode):
    """``precision``: the rollout forward rounds chosen activations (``inject.sites``: linear outputs, attention
    outputs, norm outputs, logits) to ``inject.precision`` (bf16 / fp16 / fp8-e4m3), like a low-precision engine."""

    name = "precision"
    settings = PrecisionSettings

    def rollout_path(self, injector: InjectorView) -> RolloutPath:
        fmt = injector.cfg.precision
        ops = precision_ops(injector.rollout_ops, fmt, list(injector.cfg.sites))
        hook = None
        if "logits" in injector.cfg.sites:
            def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
                rounded = round_to(z, fmt)
                return rounded, rounded
        return RolloutPath(ops, injector.rollout_dtype, hook)


@dataclass
class KernelSettings:
    """The ``kernel`` mode's settings (``inject`` section)."""

    kernel_backend: Backend = "native"  # kernel mode: the rollout path's backend ...
    kernel_dtype: DType | None = None  # ... and dtype (None = training dtype)


class Kernel(InjectMode):
    """``kernel``: the rollout path runs another backend / dtype (e.g. native ops, bf16): natural mismatch."""

    name = "kernel"
    settings = KernelSettings

    def backends(self, cfg: InjectSection) -> tuple[str, ...]:
        return (cfg.kernel_backend,)

    def rollout_path(self, injector: InjectorView) -> RolloutPath:
        dtype = resolve_dtype(injector.cfg.kernel_dtype or injector.training_dtype)
        return RolloutPath(get_ops(injector.cfg.kernel_backend, injector.device), dtype)


FLIP_KINDS = ("near_tie", "random")
"""``inject.flip_kind``: which expert a flipped router decision takes (``flip_hook``)."""


def flip_hook(rate: float, kind: str, seed: int) -> RouteHook:
    """A route hook that changes each (token, MoE layer) router decision with probability ``rate``, keyed by (seed,
    sequence, position, layer) -- batch-invariant, like sampling:

    * ``near_tie``: the k-th expert is swapped for the (k+1)-th, the flip a rounding difference between two
      nearly tied router scores causes;
    * ``random``: a random one of the k chosen experts is replaced by a random unchosen one."""
    if kind not in FLIP_KINDS:
        raise ValueError(f"unknown flip kind {kind!r}; expected one of {', '.join(FLIP_KINDS)}")

    def hook(ranked: Tensor, k: int, seq: Tensor, pos: Tensor, layer: int) -> Tensor:
        batch, length, experts = ranked.shape
        if experts <= k:
            raise ValueError(f"routing_flip needs more experts ({experts}) than experts per token ({k})")
        rows = ranked.reshape(-1, experts)
        draws = counter_uniform((seed + 0x2545F491 * (layer + 1)) & 0x7FFFFFFFFFFF,
                                seq[:, None].expand(batch, length).reshape(-1), pos.reshape(-1), 3)
        flip = draws[:, 0] < rate
        chosen = rows[:, :k].clone()
        if kind == "near_tie":
            slot = torch.full_like(flip, k - 1, dtype=torch.long)
            replacement = rows[:, k]
        else:
            slot = (draws[:, 1] * k).long().clamp_(max=k - 1)
            pick = k + (draws[:, 2] * (experts - k)).long().clamp_(max=experts - k - 1)
            replacement = rows.gather(1, pick[:, None]).squeeze(1)
        current = chosen.gather(1, slot[:, None]).squeeze(1)
        chosen.scatter_(1, slot[:, None], torch.where(flip, replacement, current)[:, None])
        return chosen.view(batch, length, k)

    return hook


@dataclass
class RoutingFlipSettings:
    """The ``routing_flip`` mode's settings (``inject`` section)."""

    flip_kind: Literal[FLIP_KINDS] = "near_tie"  # routing_flip: swap the k-th expert for the (k+1)-th, or random


class RoutingFlip(InjectMode):
    """``routing_flip`` (MoE models): the rollout's router decisions differ from the trainer's at rate
    ``inject.flip_rate`` (in [0, 1]): per token and MoE layer, with that probability, the rollout uses another
    expert set (``inject.flip_kind``: ``near_tie`` swaps the k-th expert for the (k+1)-th, ``random`` replaces a
    random chosen expert by a random unchosen one); everything else exact. ``routing/flip_rate`` records the realised
    rate."""

    name = "routing_flip"
    settings = RoutingFlipSettings
    knob = "the flip rate: the fraction of the rollout's router decisions (token x MoE layer) changed, in [0, 1]"
    knob_name = "flip_rate"
    calibratable = True

    def value_problem(self, value: float) -> str | None:
        return None if 0 <= value <= 1 else f"routing_flip needs flip_rate in [0, 1], got {value}"

    def routing_hook(self, injector: InjectorView, value: float, step: int) -> RouteHook | None:
        if value == 0.0:
            return None
        return flip_hook(value, injector.cfg.flip_kind, (injector.seed * 1_000_003 + step) ^ _ROUTING_SALT)

    def model_problem(self, model: ModelConfig) -> str | None:
        if not model.moe_layers:
            return ("routing_flip changes an MoE model's routing, but the model is dense (no MoE layer): set "
                    "model.num_experts > 0")
        if model.num_experts <= model.num_experts_per_tok:
            return (f"routing_flip needs an unchosen expert to flip to: model.num_experts ({model.num_experts}) must "
                    f"exceed model.num_experts_per_tok ({model.num_experts_per_tok})")
        return None

    def knob_search(self, sign: float, vocab_size: int) -> KnobSearch:
        return KnobSearch(upper=1.0)


for _mode in (NoInjection(), LogitNoise(), LogitScale(), Precision(), Kernel(), LogprobOnly(), TopP(), TopK(),
              RoutingFlip()):
    register_inject_mode(_mode)


@register_run_check
def check_top_k_cuts(cfg: RunConfig) -> None:
    """``inject.top_k`` cuts something: a k that keeps the whole vocabulary samples the full distribution, a silent
    no-op injection. The final knob only: a ramp's k starts above it on purpose, and ``inject.target`` searches
    1 .. vocabulary size itself."""
    if cfg.inject.mode != TopK.name or cfg.inject.target is not None or cfg.inject.value <= 0:  # 0: off
        return
    vocab_size = task_of(cfg).tokenizer.vocab_size
    if cfg.inject.value >= vocab_size:
        raise ConfigError(f"top_k {cfg.inject.value:g} keeps the whole vocabulary of {vocab_size} tokens (task "
                          f"{cfg.task.name!r} with task.distractors {cfg.task.distractors}), so nothing would be cut; "
                          f"give 0 < top_k < {vocab_size} (0 = off)", f"inject.{TopK.knob_name}")


@register_run_check
def check_mode_fits_model(cfg: RunConfig) -> None:
    """The selected mode can act on the run's policy (``InjectMode.model_problem``): routing_flip needs an MoE model."""
    problem = INJECT_MODES[cfg.inject.mode].model_problem(cfg.model.to_model_config(vocab_size=1))
    if problem:
        raise ConfigError(problem, "inject.mode")
