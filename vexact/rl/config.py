"""Run configuration for ``vexact run CONFIG.yaml``: a dataclass schema, a loader/validator and ``--set`` overrides.

The schema is the dataclasses below; every field has a default, so ``{}`` is a valid config (an empty file is refused:
more likely a wrong or truncated file than a choice).
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

Constructing the dataclasses directly in Python skips validation; go through ``config_from_dict`` to validate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types
import typing
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

import vexact_kernels

from ..engine.devices import DEFAULT_DEVICE, DeviceError, check_device_name
from ..engine.model import DTYPE_ALIASES, ModelConfig, ModelConfigError
from ..engine.presets import MODEL_PRESETS, PRESET_NAMES, PresetName, preset_values
from ..metric_keys import ABS_DLOGP_MEAN, EVAL_REWARD_MEAN, K3_KL, RENAMED_METRICS
from ..records.atomic import write_text_atomic
from ..registry import extensible
from .metrics import LOG_RATIO_BOUND
from .plugins import load_plugins
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
from .validate import ConfigError, build, describe, parse_yaml, plain, read_yaml, show_value, yaml_problem
from .validate import bounds as _bounds
from .vocab import MAX_DISTRACTORS

__all__ = [
    "AlgorithmSection",
    "CollapseSection",
    "ConfigError",
    "CorrectionSection",
    "InjectSection",
    "LRScheduleSection",
    "LoggingSection",
    "ModelSection",
    "MonitorSection",
    "OptimizerSection",
    "RolloutSection",
    "RunConfig",
    "TaskSection",
    "WarmStartSection",
    "DEPRECATED_SPELLINGS",
    "config_from_dict",
    "config_hash",
    "knob_key",
    "knob_keys",
    "load_config",
    "move_renamed_keys",
    "save_config",
]

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
DType = Literal["float32", "bfloat16"]  # also spelled fp32 / bf16 (VALUE_ALIASES); stored with these names

MAX_POLICY_LAG = 1024
"""Upper bound of ``rollout.policy_lag``: the trainer holds that many copies of the weights; a larger lag is more
likely a typo than a plan."""

VALUE_ALIASES: dict[str, str] = {
    **DTYPE_ALIASES,  # bf16 -> bfloat16, fp32 -> float32, fp16 -> float16 (the engine's one table)
    "token-mean": "token_mean",  # verl's loss_agg_mode spellings of vexact's algorithm.loss_agg
    "seq-mean-token-mean": "seq_mean",
}
"""Other spellings of ``Literal`` values: a string here is accepted by any Literal field that allows the value it
maps to, and is stored (and saved to config.yaml) as that value, so a config written either way resumes as one."""


# --- schema ------------------------------------------------------------------------------------------------


DEFAULT_PRESET = "testbed"
MODEL_DEFAULTS = preset_values(DEFAULT_PRESET)
"""The default policy: the ``testbed`` preset, a tiny decoder that learns the synthetic tasks in minutes on a CPU."""


def _model_section() -> type:
    """``ModelSection``: ``preset`` (a name in ``vexact.engine.presets.MODEL_PRESETS``) and the fields of
    ``ModelConfig`` (types, bounds, meaning) except ``vocab_size``, which the task sets, with ``MODEL_DEFAULTS``.
    One source: a field added to ModelConfig is a config key here too. A preset's values are filled in where the
    file and ``--set`` give none (``_expand_preset``): explicit model keys win over the preset."""
    hints = typing.get_type_hints(ModelConfig)
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

    def to_model_config(self, vocab_size: int) -> ModelConfig:
        """The engine's ModelConfig of this section for a vocabulary of ``vocab_size`` tokens."""
        return ModelConfig(vocab_size=vocab_size, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                                      if f.name != "preset"})

    section = dataclasses.make_dataclass("ModelSection", specs, namespace={
        "__doc__": "Shape of the policy Transformer: ``ModelConfig``'s fields (the vocabulary comes from the task).",
        "__module__": __name__, "check": check, "to_model_config": to_model_config})
    return section


ModelSection = _model_section()


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
    # > 0: greedy rollouts (0) give every sample of a prompt the same response, hence the same reward: no advantage
    temperature: float = field(default=1.0, metadata=_bounds(gt=0))
    max_new_tokens: int = field(default=20, metadata=_bounds(min=1))
    batch_size: int | None = field(default=None, metadata=_bounds(min=1))
    backend: Backend | None = None
    dtype: DType | None = None
    # who samples: vexact's own rollout path (the default), or a registered outside engine such as vllm
    # (vexact.rl.rollout_engines); an engine's own settings are rollout.* keys too
    engine: RolloutEngineName = "vexact"
    # policy lag (asynchronous RL: verl's async mode, AReaL, prime-rl): the step's rollouts are sampled from the
    # policy as it was this many optimizer steps before the trained one (the first steps: the starting policy).
    # 0 = on-policy. The trainer keeps the last k weight snapshots (checkpointed); old log-probs recomputed
    # (algorithm.old_logprobs: recompute) are the current policy's, as verl's and AReaL's proximal policy
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
    is ``algorithm.old_logprobs`` here (``RENAMED_KEYS``): the one key for where the old log-probs come from."""

    method: CorrectionMethodName = "none"  # a name in registries.CORRECTION_METHODS
    batch_normalize: bool = False  # divide the weights by their mean -> mean 1 (verl's rollout_is_batch_normalize)
    # clamp of |log ρ| in the IS weights, the χ² metrics and actor/ppo_kl (verl's SAFETY_BOUND: 20)
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
    eps: float = field(default=1e-8, metadata=_bounds(gt=0))
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


@dataclass
class RunConfig:
    """One RL run. ``output_dir`` None = runs/<name>."""

    name: str = "run"
    seed: int = field(default=0, metadata=SEED_BOUNDS)
    steps: int = field(default=100, metadata=_bounds(min=1))
    output_dir: str | None = None
    backend: Backend = "exact"  # training-path backend
    dtype: DType = "float32"  # compute dtype of the model
    threads: int | None = field(default=None, metadata=_bounds(min=1))
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
        estimator = ADVANTAGE_ESTIMATORS[self.algorithm.advantage]  # each estimator knows what it cannot learn from
        problem = estimator.signal_problem(self.rollout.samples_per_prompt, self.rollout.prompts_per_step)
        if problem is not None:
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


# --- renamed keys ------------------------------------------------------------------------------------------

_DROP = object()
"""What a renamed key's ``null`` becomes when its values are translated: nothing (the key was not given)."""


@dataclass(frozen=True)
class Renamed:
    """A deprecated config key: the key that replaced it, why (said in the FutureWarning), and, when the old key
    spelled its values otherwise too, ``values``: {old value: new value}; its ``null`` then means "not given"."""

    new: str
    why: str
    values: dict[Any, Any] | None = None

    def translate(self, old: str, value: Any) -> Any:
        """``value`` of key ``old`` as the new key's value (``_DROP`` for a translated key's null)."""
        if self.values is None:
            return value
        if value is None:
            return _DROP
        for was, now in self.values.items():
            if type(value) is type(was) and value == was:  # True is not 1: a typed match
                return now
        raise ConfigError(f"expected {' or '.join(show_value(v) for v in self.values)} (or null), got "
                          f"{show_value(value)}", old)


_LENGTH_SURGE = "the length-triggered LR decay and the collapse detector share one length-surge rule"
RENAMED_KEYS: dict[str, Renamed] = {
    "lr_schedule.length_window": Renamed("collapse.length_surge_window", _LENGTH_SURGE),
    "lr_schedule.length_ratio": Renamed("collapse.length_surge_ratio", _LENGTH_SURGE),
    # verl's algorithm.rollout_correction.bypass_mode: where the old log-probs come from, said once
    "correction.bypass_mode": Renamed("algorithm.old_logprobs", "verl's bypass_mode: true is old_logprobs rollout "
                                      "(verl's bypass mode), false is recompute (verl's decoupled mode)",
                                      values={True: "rollout", False: "recompute"}),
}
"""Deprecated key -> how it is read now (``Renamed``). The old spelling still works, with a FutureWarning; the
config stores the new key. The one registry of renamed keys: files, ``--set``, sweep grids and the config
reference read it."""


def _warn_deprecated(key: str, message: str, quiet: Collection[str], stacklevel: int) -> None:
    """The FutureWarning for a deprecated spelling of ``key`` (its old name or an old value), unless the reader
    passed ``key`` in ``quiet`` (a record vexact wrote itself, or a sweep file's ``inject.value``)."""
    if key not in quiet:
        warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


def _renamed(key: str, quiet: Collection[str] = ()) -> str:
    """The current spelling of a dotted key (warning when ``key`` is a deprecated one not in ``quiet``)."""
    renamed = RENAMED_KEYS.get(key)
    if renamed is None:
        return key
    _warn_deprecated(key, f"config key '{key}' is deprecated; use '{renamed.new}' ({renamed.why})", quiet, 4)
    return renamed.new


def move_renamed_keys(data: dict, quiet: Collection[str] = ()) -> None:
    """Move deprecated keys of a raw mapping to their new place, in place; both set differently is an error.
    ``quiet``: deprecated keys read without their FutureWarning (``config_from_dict``)."""
    for old, renamed in RENAMED_KEYS.items():
        old_section, old_name = old.split(".")
        section = data.get(old_section)
        if not isinstance(section, dict) or old_name not in section:
            continue
        value = renamed.translate(old, section.pop(old_name))
        if value is _DROP:  # a translated key's null: not given (what configs saved before the rename hold)
            continue
        _renamed(old, quiet)
        new_section, new_name = renamed.new.split(".")
        target = data.get(new_section)
        if target is None:
            target = data[new_section] = {}
        if not isinstance(target, dict):
            continue  # the section's own type error is reported when it is built
        if new_name in target and target[new_name] != value:
            raise ConfigError(f"deprecated key set to {show_value(value)} while '{renamed.new}' is "
                              f"{show_value(target[new_name])}; keep only '{renamed.new}'", old)
        target[new_name] = value


DEPRECATED_VALUES: dict[str, dict[str, str]] = {
    "inject.target.metric": {"k3_kl": K3_KL, "abs_dlogp_mean": ABS_DLOGP_MEAN},
    "collapse.metric": dict(RENAMED_METRICS),  # any key: one renamed since (metric_keys.RENAMED_METRICS)
}
"""Config key -> {old spelling of a value: the value}. Keys that name a metric take its full key (as
``lr_schedule.mismatch_metric`` and ``collapse.metric`` do); the short names still work, with a FutureWarning, and
the config stores the full key. So do renamed metric keys, where a key can name one."""


def _modernize_values(data: dict, quiet: Collection[str] = ()) -> None:
    """Replace deprecated spellings of values in the raw mapping, in place, warning once per replaced value (not for
    the keys in ``quiet``)."""
    for key, spellings in DEPRECATED_VALUES.items():
        *path, name = key.split(".")
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        old = node.get(name)
        if isinstance(old, str) and old in spellings:
            node[name] = spellings[old]
            _warn_deprecated(key, f"{key}: {old!r} is deprecated; use the full metric key {spellings[old]!r}",
                             quiet, 3)


# --- verl's spellings -------------------------------------------------------------------------------------

KEY_ALIASES = {
    "rollout.n": "rollout.samples_per_prompt",  # verl: actor_rollout_ref.rollout.n
    "rollout.response_length": "rollout.max_new_tokens",  # verl: data.max_response_length
    "algorithm.adv_estimator": "algorithm.advantage",  # verl: algorithm.adv_estimator
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.std_normalize",  # verl: algorithm.norm_adv_by_std_in_grpo
    "algorithm.clip_ratio_low": "algorithm.clip_low",  # verl: actor_rollout_ref.actor.clip_ratio_low
    "algorithm.clip_ratio_high": "algorithm.clip_high",  # verl: actor_rollout_ref.actor.clip_ratio_high
    "algorithm.loss_agg_mode": "algorithm.loss_agg",  # verl: actor.loss_agg_mode (token-mean, seq-mean-token-mean)
    "algorithm.kl_loss_coef": "algorithm.kl_coef",  # verl: actor.kl_loss_coef (with kl_loss_type low_var_kl = k3)
    "algorithm.entropy_coeff": "algorithm.entropy_coef",  # verl: actor.entropy_coeff
    "algorithm.ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",  # verl: actor.ppo_micro_batch_size_per_gpu
    "optimizer.lr_warmup_steps": "optimizer.warmup_steps",  # verl: actor.optim.lr_warmup_steps
}
"""verl's name of a key, placed in vexact's section -> vexact's key. Either spelling works (config files, ``--set``,
sweep grids) and the config is stored under vexact's; giving both is an error. Only keys whose meaning is the
same are here; the README's "verl and TRL names" table maps the rest of the vocabulary."""


def _move_aliases(data: dict) -> dict[str, str]:
    """Move verl-spelled keys of a raw mapping to vexact's spelling, in place; both given is an error.

    Returns {vexact key: the spelling the file used}, so an error about the value can name what was written."""
    moved = {}
    for alias, key in KEY_ALIASES.items():
        alias_section, alias_name = alias.split(".")
        section = data.get(alias_section)
        if not isinstance(section, dict) or alias_name not in section:
            continue
        new_section, new_name = key.split(".")
        target = section if new_section == alias_section else data.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the section's own type error is reported when it is built
        if new_name in target:
            raise ConfigError(f"'{alias}' is verl's spelling of '{key}', which is given too; keep only one", alias)
        target[new_name] = section.pop(alias_name)
        moved[key] = alias
    return moved


# --- overrides ---------------------------------------------------------------------------------------------


def _apply_override(data: dict, item: str, origin: str | None = None, quiet: Collection[str] = ()) -> str:
    """Apply one ``a.b.c=value`` override to the raw mapping ``data`` in place; returns the dotted key. ``origin``:
    where the item came from, for errors (default ``--set ITEM``); ``quiet``: as ``config_from_dict``'s."""
    origin = origin or f"--set {item}"
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"malformed override {item!r}: expected KEY=VALUE, e.g. --set optimizer.lr=1e-4")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"malformed override {item!r}: empty key segment in {key!r}")
    renamed = RENAMED_KEYS.get(key)
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {raw!r} as YAML (from {origin}): {yaml_problem(e)}", key) from None
    if renamed is not None:
        try:
            value = renamed.translate(key, value)
        except ConfigError as e:
            raise ConfigError(f"{e.problem} (from {origin})", e.key) from None
        if value is _DROP:
            return renamed.new
    key = _renamed(key, quiet)
    key = KEY_ALIASES.get(key, key)
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == "inject" and parts[1] in knob_keys():  # a mode's knob: _resolve_knob's
        if not isinstance(data.setdefault("inject", {}), dict):
            raise ConfigError(f"expected a mapping, got {show_value(data['inject'])}", "inject")
        data["inject"][parts[1]] = value
        return key

    # Walk the schema, not the data, so a typo is caught even when the YAML file never mentions the section.
    tp: Any = RunConfig
    meta: dict = {}  # the field's bounds, for messages
    node = data
    for depth, part in enumerate(parts):
        path = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                known = ", ".join(f.name for f in dataclasses.fields(tp))
                raise ConfigError(f"unknown key (known keys: {known}) (from {origin})", path)
            meta = next(dict(f.metadata) for f in dataclasses.fields(tp) if f.name == part)
            tp = hints[part]
        elif typing.get_origin(tp) is dict or tp is dict:  # free-form mapping: any key below it
            tp = Any
        elif tp is not Any:
            raise ConfigError(f"'{'.'.join(parts[:depth])}' is not a section; cannot set {key!r}", path)
        if not last:
            tp = _section_type(tp)  # an optional section (inject.target: null by default) is a section too
            if not (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict or tp in (dict, Any)):
                raise ConfigError(f"'{path}' is not a section (it takes {describe(tp, meta)}), so {key!r} does not "
                                  f"exist; set it with --set {path}=VALUE (from {origin})",
                                  ".".join(parts[: depth + 2]))
        if last:
            node[part] = value
        else:
            if node.get(part) is None:  # absent, or left empty in YAML
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigError(f"expected {describe(tp, {})}, got {show_value(node[part])}", path)
            node = node[part]
    return key


def _section_type(tp: Any) -> Any:
    """The section behind an optional one: ``TargetSection | None`` -> ``TargetSection`` (also for free-form
    mappings, ``dict[str, Any] | None``); any other type hint unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and (dataclasses.is_dataclass(arms[0]) or typing.get_origin(arms[0]) is dict
                               or arms[0] is dict):
            return arms[0]
    return tp


# --- public API --------------------------------------------------------------------------------------------


def config_from_dict(d: dict, overrides: Iterable[str] = (), origins: Iterable[str] | None = None,
                     quiet: Collection[str] = ()) -> RunConfig:
    """Validate a raw mapping (as read from YAML), apply ``--set`` overrides, and build the RunConfig.

    ``origins``: where each override came from, in the same order, for errors about its value (default ``--set
    ITEM``; a sweep names its ``set``, grid or variant). ``quiet``: config keys whose deprecated spelling is read
    without its FutureWarning, which is for the files users write: ``DEPRECATED_SPELLINGS`` for a record vexact
    wrote itself (``load_config(saved=True)``), ``{"inject.value"}`` for a sweep's points."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping of config keys, got {type(d).__name__}")
    data = plain(d)  # deep copy: overrides must not mutate the caller's dict
    move_renamed_keys(data, quiet)
    written = _move_aliases(data)
    overrides = list(overrides)
    labels = [f"--set {item}" for item in overrides] if origins is None else list(origins)
    if len(labels) != len(overrides):
        raise TypeError(f"config_from_dict: {len(labels)} origins for {len(overrides)} overrides")
    applied: dict[str, tuple[str, str]] = {}  # dotted key -> (the item that set it last, where that came from)
    # The plugins first (--set plugins=..., else the file's key): the other overrides may name keys they register.
    plugin_sets = [i for i, item in enumerate(overrides) if item.partition("=")[0].strip() == "plugins"]
    for i in plugin_sets:
        applied[_apply_override(data, overrides[i], labels[i], quiet)] = overrides[i], labels[i]
    try:  # the entry points' plugins too; a plugins value of another type is build()'s error to report
        load_plugins(data["plugins"] if isinstance(data.get("plugins"), list) else [])
    except ConfigError as e:
        if not plugin_sets:
            raise
        raise ConfigError(f"{e.problem} (from {labels[plugin_sets[-1]]})", e.key) from None
    for i, item in enumerate(overrides):
        if i in plugin_sets:
            continue
        key = _apply_override(data, item, labels[i], quiet)
        earlier, earlier_label = applied.get(key, (None, None))
        spellings = {earlier.partition("=")[0].strip() if earlier else key, item.partition("=")[0].strip()}
        if earlier is not None and len(spellings) > 1 and spellings & {*KEY_ALIASES, *RENAMED_KEYS}:
            which = "verl's and vexact's spelling" if spellings & set(KEY_ALIASES) else "a deprecated spelling"
            raise ConfigError(f"{earlier_label} and {labels[i]} set the same key ({which}); keep only one", key)
        applied[key] = item, labels[i]
    _modernize_values(data, quiet)
    knob = None
    try:
        _expand_preset(data.get("model"))
        knob = _resolve_knob(data.get("inject"), quiet)
        _check_inject_knob(data.get("inject"))
        return build(RunConfig, data, "", VALUE_ALIASES)
    except ConfigError as err:
        e = err  # a knob is named as given (inject.sigma, ...), not where it is read (inject.value)
        if knob is not None and err.key == "inject.value":
            e = ConfigError(err.problem, f"inject.{knob}")
        # Point at the --set that produced the bad value, if any, or at the verl spelling the file used.
        for key, (_, label) in applied.items():
            if e.key and (e.key == key or e.key.startswith((key + ".", key + "["))):
                raise ConfigError(f"{e.problem} (from {label})", e.key) from None
        if e.key in written:
            raise ConfigError(f"{e.problem} (written as '{written[e.key]}')", e.key) from None
        raise e from None


def _expand_preset(model: Any) -> None:
    """Fill ``model.preset``'s values into the raw model mapping where no key is given, in place: keys the file or
    ``--set`` give explicitly win over the preset. An unknown name is one config error listing the presets. The
    preset's ``vocab_size`` (if any) is not used: the task sets the vocabulary."""
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    name = model["preset"]
    if not isinstance(name, str) or name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {show_value(name)}; expected one of {', '.join(PRESET_NAMES)}",
                          "model.preset")
    for key, value in preset_values(name).items():
        if key != "vocab_size":
            model.setdefault(key, value)


INJECT_VALUE_DEPRECATED = "config key 'inject.value' is deprecated"
"""How the FutureWarning for ``inject.value`` in a run config begins (a sweep file, where ``inject.value`` names
the mode's knob and its points' folders, reads it without the warning: ``vexact.sweeps.sweep`` passes the key in
``config_from_dict``'s ``quiet``)."""

DEPRECATED_SPELLINGS: tuple[str, ...] = (*RENAMED_KEYS, *DEPRECATED_VALUES, "inject.value")
"""Every config key with a deprecated spelling (an old name, old values, the knob's old name): what a record vexact
wrote itself is read with, quietly (``load_config(saved=True)``)."""


def _resolve_knob(inject: Any, quiet: Collection[str] = ()) -> str | None:
    """Read the injection knob of a raw ``inject`` mapping into ``value``, in place: the mode's own key
    (``inject.sigma``, ...) is the spelling, ``inject.value`` the old one (a FutureWarning naming the mode's key).
    A knob key of another mode, or both spellings, is one config error. Returns the key moved into ``value``
    (``sigma``, ...; None when none was), which errors about the value name."""
    if not isinstance(inject, dict):
        return None
    mode = inject.get("mode", "none")
    names = knob_keys()
    given = [name for name in names if name in inject]
    if not isinstance(mode, str) or mode not in INJECT_MODES:
        return None  # an unknown or mistyped mode is build()'s error (the knob key then is one too)
    own = INJECT_MODES[mode].knob_name
    for name in given:
        if name != own:
            takes = (f"its knob is inject.{own}" if own else "its knob is inject.value" if INJECT_MODES[mode].knob
                     else "it has no knob")
            raise ConfigError(f"is the knob of mode {' / '.join(names[name])}, not of inject.mode {mode!r} ({takes})",
                              f"inject.{name}")
    if own is None:
        return None
    if "value" in inject:
        if own in inject:
            raise ConfigError(f"is the old spelling of inject.{own}, which is given too; keep only inject.{own}",
                              "inject.value")
        _warn_deprecated("inject.value", f"{INJECT_VALUE_DEPRECATED} for inject.mode {mode!r}; use 'inject.{own}' "
                         f"({INJECT_MODES[mode].knob})", quiet, 3)
    elif own in inject:
        inject["value"] = inject.pop(own)
        return own
    return None


def _check_inject_knob(inject: Any) -> None:
    """No silent no-op injection: a knob mode needs ``inject.value`` given (0 included: an explicit baseline) or
    ``inject.target``; a non-zero value needs a knob mode. Checked on the raw mapping, where "not given" differs
    from the default 0 (a saved config.yaml always gives both). Types are ``validate.build``'s to check."""
    if not isinstance(inject, dict):
        return
    mode, value = inject.get("mode", "none"), inject.get("value")
    if not isinstance(mode, str) or isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
        return
    spec = INJECT_MODES[mode] if mode in INJECT_MODES else None  # an unknown name is build()'s error
    knobs = " | ".join(name for name, m in INJECT_MODES.items() if m.knob is not None)
    if spec is not None and spec.knob is not None and value is None and inject.get("target") is None:
        key = f"inject.{spec.knob_key}"
        raise ConfigError(f"mode {mode!r} needs {key} ({spec.knob}), which is not given: nothing would "
                          f"be injected; set it (e.g. --set {key}=...), or inject.target to calibrate it",
                          "inject.mode")
    if spec is not None and spec.source_keys and value:
        raise ConfigError(f"{show_value(value)} is not used by mode {mode!r}, whose mismatch is set by "
                          f"{' and '.join(spec.source_keys)}; remove inject.value", "inject.value")
    if mode == "none" and value:
        raise ConfigError(f"{show_value(value)} would inject nothing: no inject.mode is set; set inject.mode to one of "
                          f"{knobs}, or remove inject.value", "inject.value")


def load_config(path: str | Path, overrides: Iterable[str] = (), saved: bool = False) -> RunConfig:
    """Read a YAML config file, apply ``--set`` overrides (``a.b.c=value``) and validate it.

    ``saved``: the file is a run's own config.yaml, a record the run wrote (resume, reports): the old spellings one
    written before a rename holds are read without their FutureWarning, which is for the files users write."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: '{path}'")
    data = read_yaml(path, "config file")
    if data is None:  # nothing but whitespace and comments: a wrong or truncated file, not a choice
        raise ConfigError(f"config file '{path}' is empty; write the keys to change (e.g. name: my_run), or {{}} "
                          "for a run with every default")
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must contain a mapping of config keys at top level, "
                          f"got {type(data).__name__}: {show_value(data)}")
    return config_from_dict(data, overrides, quiet=DEPRECATED_SPELLINGS if saved else ())


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the fully resolved config (every field, defaults included) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # a torn config.yaml blocks resume


def dotted_items(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}`` (the spelling of ``--set`` keys); empty sub-mappings add nothing."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted_items(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_hash(section_or_dict: Any) -> str:
    """Stable sha256 hex digest of a dataclass or dict (canonical JSON: sorted keys, tuples as lists)."""
    canonical = json.dumps(plain(section_or_dict), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
