"""The run config's schema: ``RunConfig`` and its sections, the dataclasses whose fields are the config keys of
``vexact run CONFIG.yaml`` (``config`` reads a file or a mapping into them).

Every field has a default, so ``{}`` is a valid config (an empty file is refused: more likely a wrong or truncated
file than a choice).
Validation is generic: each value is checked against its field's type hint (``int``, ``float``, ``bool``, ``str``,
``X | None``, ``Literal[...]``, a registry's names (``TaskName``, ``InjectModeName``, ...: checked against the registry
when the config is validated, so entries registered later count), ``list[T]``, ``tuple[T, T]``, ``dict[str, Any]``,
nested dataclasses) and against the numeric bounds declared in ``field(metadata=...)`` (``min``, ``gt``, ``max``,
``lt``). Checks that involve several fields live in a section's ``check()`` method, which raises ``ConfigError`` with
a key relative to the section. Every problem is reported as one ``ConfigError`` naming the full key path, before any
work starts.

Adding a section: write a dataclass (defaults for every field, optional ``check()``) and add a field of that type
to ``RunConfig``. Loading, overrides, ``to_dict`` and ``save_config`` pick it up from the type hints.

Extensions own their settings: this module imports none of them. A section marked ``@extensible("inject")`` holds
the options every mode shares; a registered injection mode, task, LR schedule, correction method, advantage
estimator or log backend adds its own keys to it from a settings dataclass next to its code (``vexact.registry``:
``inject.sites`` is the ``precision`` mode's), and checks that need an extension's code run as registered run checks
(``vexact.rl.registries``). The built-ins register when the ``vexact.rl`` package is imported, a plugin when the
config's ``plugins`` are loaded (``vexact.rl.plugins``), both before the config is validated.

Constructing the dataclasses directly in Python skips validation; go through ``config.config_from_dict`` to
validate.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

import vexact_kernels

from ..engine.devices import DEFAULT_DEVICE, DeviceError, check_device_name
from ..engine.inputs import MIN_TEMPERATURE
from ..engine.model import MOE_FIELDS, ModelConfig, ModelConfigError
from ..engine.presets import PresetName, preset_values
from ..metric_keys import ABS_DLOGP_MEAN, EVAL_REWARD_MEAN, K3_KL, RENAMED_METRICS, REWARD_MEAN, find
from ..registry import PluginCodeError, call_entry, entry_code, extensible, type_hints
from .metrics import LOG_RATIO_BOUND
from .registries import (
    ADVANTAGE_ESTIMATORS,
    BYPASS_LOSSES,
    CORRECTION_METHODS,
    INJECT_MODES,
    LOG_BACKENDS,
    LOSS_AGGREGATIONS,
    LR_SCHEDULES,
    ROLLOUT_ENGINES,
    TASKS,
    check_run,
)
from .validate import ConfigError, plain, show_repr, show_value
from .validate import bounds as _bounds
from .vocab import MAX_DISTRACTORS

# Both seeds' one range: what torch.manual_seed accepts (negative ones too; they always ran as the run's seed, which
# is the policy's seed when warm_start.seed is None). Beyond it the model init failed with "Overflow when unpacking
# long long", naming no key.
SEED_BOUNDS = _bounds(min=-(2**63), max=2**64 - 1)

Backend = Literal[vexact_kernels.BACKENDS]  # the kernel library's backend names
# Names from a registry: checked against it when a config is validated (validate.py), so an entry registered after
# import (vexact.register_task, vexact.register_inject_mode, ...) is accepted like a built-in.
TaskName = TASKS.name_type
InjectModeName = INJECT_MODES.name_type
CorrectionMethodName = CORRECTION_METHODS.name_type
BypassLossName = BYPASS_LOSSES.name_type
LRScheduleKind = LR_SCHEDULES.name_type
AdvantageEstimatorName = ADVANTAGE_ESTIMATORS.name_type
LossAggregationName = LOSS_AGGREGATIONS.name_type
LogBackendName = LOG_BACKENDS.name_type
RolloutEngineName = ROLLOUT_ENGINES.name_type
DType = Literal["float32", "bfloat16"]  # also spelled fp32 / bf16 (config_spellings' VALUE_ALIASES); stored as these

MAX_POLICY_LAG = 1024
"""Upper bound of ``rollout.policy_lag``: the trainer holds that many copies of the weights; a larger lag is more
likely a typo than a plan."""

MIN_ADAM_EPS = torch.finfo(torch.float32).tiny
"""Lower bound of ``optimizer.eps``: float32's smallest normal number (the master weights and moments are float32)."""

MAX_THREADS = 4096
"""Upper bound of ``threads``: more than any machine's cores, and within what ``torch.set_num_threads`` takes (its
int32 overflowed at 2**31, after the run had started, naming no key)."""


# --- schema ------------------------------------------------------------------------------------------------


DEFAULT_PRESET = "testbed"
MODEL_DEFAULTS = preset_values(DEFAULT_PRESET)
"""The default policy: the ``testbed`` preset, a tiny decoder that learns the synthetic tasks in minutes on a CPU."""


def _model_section() -> type:
    """``ModelSection``: ``preset`` (a name in ``vexact.engine.presets.MODEL_PRESETS``) and the fields of
    ``ModelConfig`` (types, bounds, meaning) except ``vocab_size``, which the task sets, with ``MODEL_DEFAULTS``.
    One source: a field added to ModelConfig is a config key here too. A preset's values are filled in where the
    file and ``--set`` give none (``vexact.rl.config``'s ``_expand_preset``): explicit model keys win over the
    preset."""
    hints = type_hints(ModelConfig)
    specs = [("preset", PresetName | None, field(default=None))]
    for f in dataclasses.fields(ModelConfig):
        if f.name == "vocab_size":
            continue
        default = MODEL_DEFAULTS.get(f.name, f.default)
        specs.append((f.name, hints[f.name], field(default=default, metadata=f.metadata)))

    def check(self) -> None:
        try:
            self.to_model_config(vocab_size=1)
        except ModelConfigError as e:
            raise ConfigError(e.problem, e.field) from None
        _check_dense_has_no_moe_keys(self)

    def to_model_config(self, vocab_size: int) -> ModelConfig:
        """The engine's ModelConfig of this section for a vocabulary of ``vocab_size`` tokens."""
        return ModelConfig(vocab_size=vocab_size, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                                      if f.name != "preset"})

    section = dataclasses.make_dataclass("ModelSection", specs, namespace={
        "__doc__": "Shape of the policy Transformer: ``ModelConfig``'s fields (the vocabulary comes from the task).",
        "__module__": __name__, "check": check, "to_model_config": to_model_config})
    return section


ModelSection = _model_section()


def _check_dense_has_no_moe_keys(model: Any) -> None:
    """A dense model (``num_experts`` 0) with an MoE key away from its default (the preset's, when one is named): the
    key is unused, silently (``vexact check`` refuses its flags alike). Here, not in ``ModelConfig``: the engine's own
    callers build a dense twin of an MoE shape by setting num_experts 0 alone."""
    if model.num_experts:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(model)}
    if model.preset is not None:
        defaults.update(preset_values(model.preset))
    for name in (n for n in MOE_FIELDS if n != "num_experts"):
        value = getattr(model, name)
        if plain(value) != plain(defaults[name]):
            raise ConfigError(f"{show_value(plain(value))} sets the mixture of experts, but the model has none "
                              f"(num_experts is 0), so it would be unused: set model.num_experts > 0 too, or leave "
                              f"{name} at {show_value(plain(defaults[name]))}", name)


@extensible("task")
@dataclass
class TaskSection:
    """The synthetic task the policy is trained on."""

    name: TaskName = "reverse"  # a name in the task registry (tasks.TASKS; vexact.register_task adds one)
    min_len: int = field(default=4, metadata=_bounds(min=1))
    max_len: int = field(default=8, metadata=_bounds(min=1))
    partial_credit: bool = False
    eval_prompts: int = field(default=64, metadata=_bounds(min=1))  # size of the fixed held-out prompt set
    # A vocabulary tail: this many distractor tokens after the 22 characters, in no prompt or target, so the warm
    # start teaches the policy to avoid them; a response using one earns 0 (vexact.rl.vocab_tail). 0 = none.
    distractors: int = field(default=0, metadata=_bounds(min=0, max=MAX_DISTRACTORS))

    def check(self) -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"expected max_len >= min_len ({self.min_len}), got {self.max_len}", "max_len")


@extensible("warm_start")
@dataclass
class WarmStartSection:
    """Supervised warm start before RL (cached by config hash)."""

    steps: int = field(default=180, metadata=_bounds(min=0))  # 0 = no warm start
    lr: float = field(default=1e-2, metadata=_bounds(gt=0))
    batch_size: int = field(default=64, metadata=_bounds(min=1))
    cache_dir: str | None = None  # None = runs/.warmstart_cache; shared by runs, so no run directory may be it
    # Seed of the starting policy (model init + warm-start data); None = the run's seed. Fix it to compare
    # RL seeds (rollout sampling, mini-batch order) from one starting policy.
    seed: int | None = field(default=None, metadata=SEED_BOUNDS)
    # Total loss weight of a target's free tokens (the span the reward does not read, Task.free_span: the horizon
    # task's scratchpad), shared equally among them; None = every target token weighs 1 (a plain token mean).
    # 1.0 makes the answer's share of the loss the same at every scratchpad length.
    free_weight: float | None = field(default=None, metadata=_bounds(min=0))


@extensible("rollout")
@dataclass
class RolloutSection:
    """Sampling of the rollout batch. backend/dtype None = same as the training path."""

    prompts_per_step: int = field(default=16, metadata=_bounds(min=1))
    samples_per_prompt: int = field(default=8, metadata=_bounds(min=1))
    # > 0: greedy rollouts (0) give every sample of a prompt the same response, hence the same reward: no advantage;
    # at least the sampler's MIN_TEMPERATURE (vexact.engine.inputs): logits divided by less can overflow float32
    temperature: float = field(default=1.0, metadata=_bounds(min=MIN_TEMPERATURE))
    max_new_tokens: int = field(default=20, metadata=_bounds(min=1))
    batch_size: int | None = field(default=None, metadata=_bounds(min=1))
    backend: Backend | None = None
    dtype: DType | None = None
    # who samples: vexact's own rollout path (the default), or a registered outside engine such as vllm
    # (vexact.rl.rollout_engines); an engine's own settings are rollout.* keys too
    engine: RolloutEngineName = "vexact"
    # policy lag (asynchronous RL: verl's async mode, AReaL, prime-rl): step s's rollouts are sampled from the
    # policy as it was at the start of RL step s - k (the first steps: the starting policy): k RL steps behind, which
    # is k x algorithm.mini_batches x ppo_epochs optimizer steps. 0 = on-policy. The trainer keeps the last k weight
    # snapshots (checkpointed); old log-probs recomputed (algorithm.old_logprobs: recompute) are the current
    # policy's, as verl's and AReaL's proximal policy
    policy_lag: int = field(default=0, metadata=_bounds(min=0, max=MAX_POLICY_LAG))
    # on a GPU: the decode step recorded once in a CUDA graph and replayed each step (generate's cuda_graphs): the same
    # bits, without the launch overhead; vexact's own rollout path, a dense model and a CUDA device only
    cuda_graphs: bool = False


@extensible("algorithm")
@dataclass
class AlgorithmSection:
    """The policy-gradient objective (PPO-style clipped surrogate)."""

    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    advantage: AdvantageEstimatorName = "grpo"
    std_normalize: bool = True
    # the ratio is clipped to [1 - clip_low, 1 + clip_high]; clip_low >= 1 puts the lower bound at or below 0, which no
    # ratio is under: it could never clip
    clip_low: float = field(default=0.2, metadata=_bounds(min=0, lt=1))
    clip_high: float = field(default=0.28, metadata=_bounds(min=0))
    loss_agg: LossAggregationName = "token_mean"
    kl_coef: float = field(default=0.0, metadata=_bounds(min=0))
    entropy_coef: float = field(default=0.0, metadata=_bounds(min=0))
    mini_batches: int = field(default=1, metadata=_bounds(min=1))
    ppo_epochs: int = field(default=1, metadata=_bounds(min=1))
    micro_batch_size: int | None = field(default=None, metadata=_bounds(min=1))
    # sequences per gradient graph (null = off: a leaf's micro-batches, whose grouping shows in the gradient's bits);
    # set, each unit is one forward and backward and a leaf's gradient is their fixed-tree sum, so
    # micro_batch_size changes no bit (it then only batches the no-grad scoring); must divide a leaf
    grad_unit: int | None = field(default=None, metadata=_bounds(min=1))
    # activation checkpointing per gradient unit: the gradient pass forwards every unit without a graph first (for
    # the loss), then each unit again, with grad, right before its own backward. Memory holds one unit's graph
    # instead of all of them (a long-horizon mini-batch's attention is what fills it); one more forward per unit;
    # no bit changes (the exact forward is deterministic, and the second forward is checked against the first)
    activation_checkpointing: bool = False
    # router replay (R3, MoE models): the training path uses the experts the rollout's router chose at every
    # position and layer (the weights stay the training router's probabilities of them)
    router_replay: bool = False


MEMORY_KEYS = ("algorithm.activation_checkpointing",)
"""Config keys that trade memory for time and change no bit: a run may resume with them changed, and runs that
differ only in them are one testbed (``build-map``)."""


@extensible("correction")
@dataclass
class CorrectionSection:
    """Rollout correction on ρ_t = π_old/μ (importance weights / rejection); see ``vexact/rl/corrections.py``.

    Two vocabularies for one implementation: vexact's shorthand ``method`` (with ``threshold``, ``band``,
    ``batch_normalize``), or verl 0.9.1's ``algorithm.rollout_correction`` keys (``preset`` and the ``rollout_*``
    keys, ``loss_type``; null = not given, so a preset's value or verl's default applies). verl's ``bypass_mode``
    is ``algorithm.old_logprobs`` here (``config_spellings.RENAMED_KEYS``): the one key for where the old log-probs
    come from."""

    method: CorrectionMethodName = "none"  # a name in registries.CORRECTION_METHODS
    batch_normalize: bool = False  # divide the weights by their mean -> mean 1 (verl's rollout_is_batch_normalize)
    # clamp of |log ρ| in the IS weights, the χ² metrics, the PPO ratio and actor/ppo_kl (verl's 20)
    log_ratio_bound: float = field(default=LOG_RATIO_BOUND, metadata=_bounds(gt=0))
    # verl's vocabulary (algorithm.rollout_correction in verl 0.9.1)
    preset: str | None = None  # a RolloutCorrectionConfig factory name, e.g. decoupled_token_is, bypass_pg_is
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float | str | None = None  # C (TIS) or "lower_upper" (IcePop); verl's default 2.0
    rollout_is_batch_normalize: bool | None = None
    rollout_rs: str | None = None  # comma list: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3
    rollout_rs_threshold: float | str | None = None  # one per option or one shared; k1: "lower_upper" ratios
    loss_type: BypassLossName | None = None  # bypass mode's loss


@extensible("lr_schedule")
@dataclass
class LRScheduleSection:
    """Learning-rate schedule on top of ``optimizer.lr`` and its warmup; see ``vexact/rl/schedules.py``.

    ``length_triggered`` fires at the length surge defined once, in ``collapse.length_surge_window`` /
    ``collapse.length_surge_ratio`` (the collapse detector's early warning)."""

    kind: LRScheduleKind = "constant"  # a name in registries.LR_SCHEDULES
    min_lr_ratio: float = field(default=0.1, metadata=_bounds(min=0, max=1))  # floor = ratio x optimizer.lr


@dataclass
class OptimizerSection:
    """AdamW on float32 master weights, with linear warmup."""

    lr: float = field(default=2e-4, metadata=_bounds(gt=0))
    betas: tuple[float, float] = field(default=(0.9, 0.99), metadata=_bounds(min=0, lt=1))
    # at least float32's smallest normal: the update adds eps to float32 tensors, where a smaller one is 0 (or a
    # subnormal, which flush-to-zero arithmetic makes 0), and a zero second moment then divides 0 by 0 (NaN weights)
    eps: float = field(default=1e-8, metadata=_bounds(min=MIN_ADAM_EPS))
    weight_decay: float = field(default=0.0, metadata=_bounds(min=0))
    grad_clip: float | None = field(default=1.0, metadata=_bounds(gt=0))  # None = no clipping
    warmup_steps: int = field(default=10, metadata=_bounds(min=0))
    master_dtype: Literal["float32"] = "float32"


@extensible("logging")
@dataclass
class LoggingSection:
    """Where a run's metrics go. ``backends``: metrics.jsonl (``jsonl``, required: resume and report read it) plus
    optional live views with the same keys and steps, such as ``tensorboard`` and ``wandb`` (extras; see
    log_backends)."""

    checkpoint_every: int = field(default=20, metadata=_bounds(min=1))
    live: bool = True
    eval_every: int = field(default=10, metadata=_bounds(min=1))
    backends: list[LogBackendName] = field(default_factory=lambda: ["jsonl"])

    def check(self) -> None:
        # Whether a backend's package is installed is checked when the run opens its log, not here: a config stays
        # valid on any machine (a report may read a run's config.yaml where the extras are not installed).
        if "jsonl" not in self.backends:
            raise ConfigError(f"must include 'jsonl' (metrics.jsonl is what resume and report read), got "
                              f"{self.backends}; e.g. [jsonl, tensorboard]", "backends")
        for i, name in enumerate(self.backends):
            if name in self.backends[:i]:
                raise ConfigError(f"{name!r} is listed twice", f"backends[{i}]")


@dataclass(kw_only=True)
class TargetSection:
    """Calibrate the mode's knob (``inject.sigma``, ...) so that a mismatch metric on a calibration batch hits
    ``value``.

    ``value`` has no default: a target is a magnitude the user chooses, so a ``target`` without it is an error."""

    metric: Literal[K3_KL, ABS_DLOGP_MEAN] = K3_KL  # a full metric key (k3_kl, abs_dlogp_mean: deprecated)
    value: float = field(metadata=_bounds(gt=0))


@extensible("inject")
@dataclass
class InjectSection:
    """Controlled mismatch, applied to the rollout path only (the training path stays exact).

    The knob is set by the key its mode names (``inject_modes``: ``knob_name``): ``inject.sigma`` for logit_noise /
    logprob_only, ``inject.epsilon`` for logit_scale (logits × (1+ε)), ``inject.top_p``, ``inject.top_k``,
    ``inject.flip_rate`` for routing_flip; precision and kernel have none, their settings (``precision``, ``sites``;
    ``kernel_backend``, ``kernel_dtype``) choose their mismatch. ``value`` is the knob whatever the mode calls it
    (what the injector reads; ``inject.value`` in a file or ``--set`` is the old spelling, read with a FutureWarning
    naming the mode's key). A knob of 0 (or mode none) is a bitwise no-op.
    """

    mode: InjectModeName = "none"
    value: float = 0.0
    scope: Literal["all", "low_prob", "fraction"] = "all"
    prob_threshold: float = field(default=0.1, metadata=_bounds(gt=0, max=1))  # scope low_prob
    fraction: float = field(default=0.5, metadata=_bounds(min=0, max=1))  # scope fraction
    onset_step: int = field(default=0, metadata=_bounds(min=0))  # no injection before this step
    ramp_steps: int = field(default=0, metadata=_bounds(min=0))  # linear ramp from 0 to value after onset
    target: TargetSection | None = None  # calibrate value instead of using it as given
    calibration_prompts: int = field(default=32, metadata=_bounds(min=1))
    calibration_tolerance: float = field(default=0.05, metadata=_bounds(gt=0, lt=1))  # relative

    def check(self) -> None:
        mode = INJECT_MODES[self.mode]
        mode.check(self)  # the mode's own settings (value range, ...)
        if self.scope != "all" and not mode.reads_scope:  # silently unscoped otherwise
            readers = ", ".join(name for name, m in INJECT_MODES.items() if m.reads_scope)
            raise ConfigError(f"mode {self.mode!r} does not read inject.scope, got {self.scope!r}: it would not "
                              f"be scoped; scopes apply to {readers}; remove inject.scope", "scope")
        if self.target is not None and not mode.calibratable:
            raise ConfigError(f"mode {self.mode!r} has no continuous knob to calibrate; remove inject.target",
                              "target")


@dataclass
class DistributedSection:
    """Data-parallel training (``vexact run --nproc N``); see ``vexact/rl/data_parallel.py``.

    ``leaves``: each PPO mini-batch's gradient is the fixed-tree sum of this many equal leaves, each from its own
    backward. It fixes the numbers, so a run is bitwise the same for every N that is a power of two dividing it;
    1 = one backward per mini-batch. The default, 4, lets every shipped config run under ``--nproc`` 1, 2 and 4 as
    it is (a mini-batch must then hold a multiple of 4 sequences). ``reduce``: ``tree`` (that guarantee) or
    ``allreduce`` (the collective's own summation order: results depend on N; for measuring the difference)."""

    leaves: int = field(default=4, metadata=_bounds(min=1))
    reduce: Literal["tree", "allreduce"] = "tree"


@dataclass
class MonitorSection:
    """Mismatch metrics in bypass mode (``algorithm.old_logprobs: rollout``) at a chosen cost; see
    ``vexact/rl/monitor.py``.

    Bypass anchors the ratio on the rollout's log-probs, so the training path's pre-update log-probs serve only the
    ``rollout_corr/*``, ``training/*`` and ``mismatch/*`` metrics: with one pass (one mini-batch, one epoch) the
    update's first pass gives them for free; with several, the whole batch is scored once more before the update.
    ``sample_fraction`` < 1 rescores only that fraction of each step's sequences (whole sequences, at least one, a
    deterministic sample keyed by the run's seed and the step) and the mismatch metrics come from them; ``every``
    rescores on every that many steps only (other steps log no mismatch metric). The defaults rescore every
    sequence every step (the run's bits do not depend on this section: only which metrics are written). Recompute
    mode scores every sequence anyway (its anchors), so it refuses other values, and a bypass correction with several
    mini-batches or epochs needs every token's pre-update log-prob, so it refuses them too."""

    # fraction of each step's sequences rescored for the mismatch metrics (bypass); 1.0 = all
    sample_fraction: float = field(default=1.0, metadata=_bounds(gt=0, max=1))
    # rescore on every this many steps (0, k, 2k, ...); the others log no mismatch metric
    every: int = field(default=1, metadata=_bounds(min=1))

    @property
    def sampling(self) -> bool:
        """Whether a step rescores less than its whole batch (a fraction, or not every step)."""
        return self.sample_fraction < 1 or self.every > 1


@dataclass
class CollapseSection:
    """Collapse detection on a (smoothed) reward series; see ``vexact/rl/collapse.py``."""

    metric: str = EVAL_REWARD_MEAN  # judged on the clean evaluation by default
    smoothing: int = field(default=3, metadata=_bounds(min=1))  # trailing moving average, in points
    drop: float = field(default=0.5, metadata=_bounds(gt=0, lt=1))  # fall below (1 - drop) x running peak
    min_peak: float = field(default=0.1, metadata=_bounds(min=0))  # ... after the peak exceeded this
    patience: int = field(default=20, metadata=_bounds(min=0))  # steps without recovering above the threshold
    grad_norm_max: float | None = field(default=None, metadata=_bounds(gt=0))  # optional extra trigger
    k3_kl_max: float | None = field(default=None, metadata=_bounds(gt=0))  # optional extra trigger
    # The length surge (trailing-mean response length > ratio x the mean of the first N steps): the detector's early
    # warning and the trigger of lr_schedule.kind length_triggered -- one rule, set here only.
    length_surge_window: int = field(default=10, metadata=_bounds(min=1))  # N: baseline = first N steps
    length_surge_ratio: float = field(default=1.5, metadata=_bounds(gt=1))  # surge: trailing mean > ratio x base
    stop_on_collapse: bool = False  # end the run once collapse is confirmed (saves sweep time)

    def check(self) -> None:
        # a key no run writes is never in the history: the detector would silently never judge
        entry = find(RENAMED_METRICS.get(self.metric, self.metric))
        if entry is None or "run" not in entry.writers:
            raise ConfigError(f"{self.metric!r} is not a metric key vexact run writes (docs/reference/metrics.md "
                              f"lists them), so collapse would never be judged; e.g. {EVAL_REWARD_MEAN!r} (the "
                              f"default) or {REWARD_MEAN!r}", "metric")


@dataclass
class RunConfig:
    """One RL run. ``output_dir`` None = runs/<name>."""

    name: str = "run"
    seed: int = field(default=0, metadata=SEED_BOUNDS)
    steps: int = field(default=100, metadata=_bounds(min=1))
    output_dir: str | None = None
    backend: Backend = "exact"  # training-path backend
    dtype: DType = "float32"  # compute dtype of the model
    threads: int | None = field(default=None, metadata=_bounds(min=1, max=MAX_THREADS))
    # where the policy, reference, optimizer state and rollouts live: cpu, cuda, cuda:N or auto (CUDA when available)
    device: str = DEFAULT_DEVICE
    # modules imported before the config is validated: outside extensions (vexact.rl.plugins)
    plugins: list[str] = field(default_factory=list)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    inject: InjectSection = field(default_factory=InjectSection)
    collapse: CollapseSection = field(default_factory=CollapseSection)
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    lr_schedule: LRScheduleSection = field(default_factory=LRScheduleSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)

    def check(self) -> None:
        check_run_name(self.name, self.output_dir)
        self._check_not_in_cache()
        try:  # the spelling only: whether this machine has the device is checked when the run starts
            check_device_name(self.device)
        except DeviceError as e:
            raise ConfigError(e.problem, "device") from None
        self._check_cuda_graphs()
        if self.algorithm.router_replay and not self.model.to_model_config(vocab_size=1).moe_layers:
            raise ConfigError("router replay reuses the rollout's MoE routing, and a dense model records none: set "
                              "model.num_experts > 0, or router_replay: false", "algorithm.router_replay")
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if batch % self.algorithm.mini_batches:
            raise ConfigError(f"the rollout batch of {batch} samples (rollout.prompts_per_step x "
                              f"rollout.samples_per_prompt) must be divisible by mini_batches, "
                              f"got {self.algorithm.mini_batches}", "algorithm.mini_batches")
        per_minibatch = batch // self.algorithm.mini_batches
        if per_minibatch % self.distributed.leaves:
            raise ConfigError(f"a mini-batch of {per_minibatch} sequences (rollout batch {batch} / "
                              f"algorithm.mini_batches {self.algorithm.mini_batches}) cannot be cut into "
                              f"{self.distributed.leaves} equal leaves; set distributed.leaves to a divisor of "
                              f"{per_minibatch} (each --nproc must divide it too)", "distributed.leaves")
        per_leaf = per_minibatch // self.distributed.leaves
        if self.algorithm.grad_unit is not None and per_leaf % self.algorithm.grad_unit:
            raise ConfigError(f"a leaf of {per_leaf} sequences (a mini-batch of {per_minibatch} / distributed.leaves "
                              f"{self.distributed.leaves}) cannot be cut into units of {self.algorithm.grad_unit}; "
                              f"set algorithm.grad_unit to a divisor of {per_leaf}, or null", "algorithm.grad_unit")
        self._check_learning_signal()
        if self.monitor.sampling and self.algorithm.old_logprobs == "recompute":
            key = "monitor.sample_fraction" if self.monitor.sample_fraction < 1 else "monitor.every"
            raise ConfigError("algorithm.old_logprobs: recompute scores every sequence before the update (the ratio's "
                              "anchor), so its mismatch metrics cost no extra pass and there is nothing to sample: "
                              "sampled rescoring is for bypass (algorithm.old_logprobs: rollout); leave "
                              "monitor.sample_fraction at 1.0 and monitor.every at 1", key)
        check_run(self)  # what the extensions check: the task's lengths, the correction's plan, ...

    def _check_cuda_graphs(self) -> None:
        """``rollout.cuda_graphs`` where it can run: vexact's own rollout path, a dense model, a device that is not
        the CPU (``auto`` is judged when the run starts, where the device is resolved)."""
        if not self.rollout.cuda_graphs:
            return
        if self.rollout.engine != "vexact":
            raise ConfigError(f"records vexact's own decode step in a CUDA graph, and rollout.engine is "
                              f"{self.rollout.engine!r} (its own engine); leave it false", "rollout.cuda_graphs")
        if self.model.to_model_config(vocab_size=1).moe_layers:
            raise ConfigError("an MoE model's decode step records its routing on the host each step, which a CUDA "
                              "graph cannot replay; leave it false for an MoE model", "rollout.cuda_graphs")
        if self.device == "cpu":
            raise ConfigError("records the decode step in a CUDA graph: it needs device cuda (or cuda:N, or auto on "
                              "a machine with a GPU), not cpu", "rollout.cuda_graphs")

    def _check_not_in_cache(self) -> None:
        """The run directory (``output_dir``, else runs/<name>) is not the warm-start cache folder: a run's files
        would mix with every run's cached warm starts."""
        run_dir = Path(os.path.abspath(self.output_dir or Path("runs") / self.name))
        cache = Path(os.path.abspath(self.warm_start.cache_dir or DEFAULT_WARMSTART_CACHE))
        if run_dir == cache:
            key = "output_dir" if self.output_dir else "name"
            raise ConfigError(f"the run would write into the warm-start cache {cache} (warm_start.cache_dir, default "
                              f"{DEFAULT_WARMSTART_CACHE}), which every run shares; choose another {key}", key)

    def _check_learning_signal(self) -> None:
        """Settings each valid alone whose combination can never learn or never inject: refused, naming the key."""
        name = self.algorithm.advantage  # each estimator knows what it cannot learn from
        code = entry_code(ADVANTAGE_ESTIMATORS.what, name, "signal_problem")
        try:
            problem = call_entry(ADVANTAGE_ESTIMATORS.what, name, "signal_problem",
                                 ADVANTAGE_ESTIMATORS[name].signal_problem, self.rollout.samples_per_prompt,
                                 self.rollout.prompts_per_step)
        except PluginCodeError as e:
            raise ConfigError(str(e), "algorithm.advantage") from None
        if problem is not None:
            if not (isinstance(problem, tuple) and len(problem) == 2
                    and all(isinstance(p, str) and p for p in problem)):
                raise ConfigError(f"{code} returned {show_repr(problem)}: expected None or a tuple (the problem, the "
                                  "config key to change) of two non-empty strings", "algorithm.advantage")
            raise ConfigError(*problem)
        inject = self.inject
        mode = INJECT_MODES[inject.mode]
        baseline = mode.knob is not None and inject.value == 0 and inject.target is None  # explicitly nothing
        if mode.injects and not baseline and inject.onset_step >= self.steps:
            raise ConfigError(f"{inject.onset_step} is not before the last step ({self.steps - 1}: steps is "
                              f"{self.steps}), so mode {inject.mode!r} would inject nothing; lower it or raise steps",
                              "inject.onset_step")

    @property
    def policy_seed(self) -> int:
        """Seed of the starting policy: ``warm_start.seed`` when set, else ``seed``."""
        return self.seed if self.warm_start.seed is None else self.warm_start.seed

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists, not tuples): YAML-serializable, round-trips through ``config_from_dict``. The
        injection knob is stored under its mode's name for it (``inject.sigma``, ...: ``knob_key``)."""
        out = plain(self)
        out["inject"] = _named_knob(out["inject"])
        return out


def knob_key(mode: str) -> str:
    """The config key (relative to ``inject``) of injection mode ``mode``'s knob: the name the mode declares
    (``knob_name``: ``sigma``, ``epsilon``, ``top_p``, ``top_k``, ``flip_rate``), else ``value``."""
    return INJECT_MODES[mode].knob_key if mode in INJECT_MODES else "value"


def knob_keys() -> dict[str, tuple[str, ...]]:
    """{knob name: the modes that declare it}, read from the registry ``INJECT_MODES`` now."""
    names: dict[str, tuple[str, ...]] = {}
    for name, mode in INJECT_MODES.items():
        if mode.knob_name is not None:
            names[mode.knob_name] = (*names.get(mode.knob_name, ()), name)
    return names


def _named_knob(inject: dict[str, Any]) -> dict[str, Any]:
    """A plain ``inject`` mapping with ``value`` stored as its mode's knob key (in place of ``value``, same order); a
    mode without a knob stores none (its value is 0: the config refuses another)."""
    mode = INJECT_MODES[inject["mode"]] if inject.get("mode") in INJECT_MODES else None
    if mode is None or mode.knob_key == "value" and mode.knob is not None:
        return inject
    if mode.knob is None and inject.get("value") != 0:
        return inject  # built in Python without validation: kept as given, for config_from_dict to judge
    return {(mode.knob_key if k == "value" else k): v for k, v in inject.items()
            if k != "value" or mode.knob is not None}


DEFAULT_WARMSTART_CACHE = Path("runs") / ".warmstart_cache"
"""Where warm starts are cached unless ``warm_start.cache_dir`` says otherwise: shared by every run."""


def check_run_name(name: str, output_dir: str | None) -> None:
    """``name`` picks the run directory runs/<name> unless ``output_dir`` is given: then it must be one plain folder
    name (no separator, not ``.`` or ``..``), so that a run cannot land outside runs/. With ``output_dir`` it is a
    label (a sweep point's is ``<sweep>/<point>``), still a relative path without ``..``. A ConfigError at ``name``."""
    expected = ("a relative label (output_dir is set, so the name names no folder)" if output_dir else
                "a plain folder name (the run goes to runs/<name>; to write elsewhere, set output_dir)")
    parts = name.replace("\\", "/").split("/")
    if not name or not name.strip():
        problem = "an empty name"
    elif "\0" in name or any(ord(c) < 32 for c in name):
        problem = "a control character"
    elif "\\" in name:
        problem = "a backslash (a path separator on Windows)"
    elif name.startswith("/"):
        problem = "an absolute path"
    elif any(part in ("", ".", "..") for part in parts):
        problem = "a path that leaves the runs directory" if ".." in parts else "an empty or '.' path segment"
    elif not output_dir and len(parts) > 1:
        problem = "a path separator"
    else:
        return
    raise ConfigError(f"expected {expected}, got {show_value(name)}: {problem}", "name")
