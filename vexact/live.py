"""``vexact.live``: watch training-inference mismatch inside your own trainer, one call per step.

``vexact compare`` reads dumps after the fact; ``LiveMonitor`` takes the same two sides while the run goes on:

    from vexact.live import Gates, LiveMonitor

    monitor = LiveMonitor("runs/my_grpo/vexact", gates=Gates(max_k3=1e-3), backends=("jsonl", "tensorboard"))
    for step, batch in enumerate(loader):
        ...  # your rollout engine samples, your trainer recomputes the log-probs of the same tokens
        row = monitor.step(step, batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    monitor.close()

Each call computes exactly ``compare``'s report (``measure.mismatch_report``: every ``rollout_corr/*``,
``training/*`` and ``mismatch/*`` key of ``vexact.rl.metrics.mismatch_metrics``, plus |Δlogp| by response
position), applies ``compare``'s gates (``compare.check_gates``: ``--fail-on-mismatch``, ``--max-k3``,
``--max-abs-dlogp``), appends one row to ``OUT_DIR/metrics.jsonl`` (flushed and fsynced, through the run log's
``MetricsWriter``) and copies its numbers to the live views of ``vexact.rl.log_backends`` (TensorBoard, W&B).
Nothing here feeds back into training unless you ask: a failed gate is recorded in the row; with
``on_gate_failure="raise"`` the row is written and then ``GateFailed`` is raised, for a run that should stop.

Inputs (per step): padded ``[B, T]`` floating-point tensors on any device (or numpy arrays), rollout side first,
with a ``[B, T]`` mask of the positions that hold response tokens (bool or 0/1, a tensor or a numpy array;
``None``: every position), or two equal-length sequences of 1-D tensors or arrays (one per response, no mask). Only
masked positions are read, so padding may hold anything. Each side is widened exactly to float64 and the two are
compared as values (as ``compare`` reads tensor files): a bf16 rollout side against a float32 trainer is fine, and
equal means equal values.

What is an error and what is an outcome:

* a caller mistake -- not tensors or arrays, an integer dtype, shapes or lengths that differ, a mask of another
  shape or with values other than 0/1, a step that does not increase, a log-prob above
  ``POSITIVE_LOGPROB_TOLERANCE`` (a probability above 1: logits or probabilities were passed), an ``extra`` key
  that is not a string or whose value JSON cannot hold (or holds a string spelling NaN/Inf, which the log would
  read back as that number) -- is one ``ValueError`` naming the side, the sequence and the position (or the key);
* what a training run can do -- NaN or ±Inf log-probs at masked positions, a step where every response is
  masked out -- is recorded: the row's ``outcome`` is ``"non-finite"`` or ``"no tokens"``, with the counts, no
  metrics, and every requested gate failed ("not computed").

Row keys: ``step``, ``outcome`` (``"ok"``), the metric keys above, ``live/sequences`` (rows of the batch),
``live/mean_response_length`` (tokens / sequences: the horizon T, as ``compare --map`` takes it),
``live/gates_failed``, ``gates`` (``check_gates``' dicts), ``by_position``, and ``map`` when a scaling map was given.

The map verdict: ``scaling_map`` (a map dict as ``vexact.map.verdict.load_map`` returns it, a path it reads, or
``"default"`` for the shipped map) makes every ok row carry ``map`` -- the keys ``vexact compare --map`` writes,
from ``vexact.map.verdict.place_on_map(map, k3, horizon, correction)`` with this step's ``rollout_corr/k3_kl`` and
``live/mean_response_length``: where this level of mismatch sits against the collapse thresholds measured at
that horizon, on the curve of ``correction`` -- the correction your trainer runs, as ``compare --correction``
takes it: a name (``bypass``, ``recompute``, ``token_tis``, ...; ``vexact.map.naming.correction_names()``), a
config file, verl's ``algorithm.rollout_correction`` block as a mapping, or a TRL ``GRPOConfig``. Without it the
``bypass`` curve is assumed and every verdict says so; a correction the map has no curve for gets one sentence
saying so as its verdict (never another correction's curve); an unknown name is refused at construction. ``source``
picks the curves of another mismatch source the map carries (``vexact.map.verdict.map_sources``: e.g.
``routing_flip:near_tie`` for MoE routing mismatch); without it, the map's default source. ``vocab`` (your model's
vocabulary size) with ``"default"`` picks the shipped map nearest it (``vexact.map.verdict.shipped_map_for``: the
tail map, 1,024 tokens, for any real LLM vocabulary; without it, the main map's 22 tokens). Without ``scaling_map``
(the default) rows have no ``map`` key and ``correction``, ``source``, ``vocab`` and a ``policy_lag`` above 0 are
refused. A map dict is checked at construction too (the keys ``load_map`` requires, and one placement at the map's
first horizon): one ``ValueError`` there, not a ``map_error`` on every row.

Policy lag (asynchronous RL: the rollout policy some optimizer steps behind the trained one): ``policy_lag=K``
takes the verdict from the map's curve measured at lag K, as ``vexact compare --map --policy-lag K`` does (a lag the
map has no curve for is refused at construction, one ``ValueError`` saying so, as is a lag without a map; 0, the
default, is on-policy). The k3 your trainer logs then holds two things: the lag's off-policy drift and the
training-inference mismatch (TIM).
Pass ``behaviour_logprobs`` to ``step`` -- your trainer's log-probs of the same tokens under the behaviour policy
(the weights that sampled them), with ``train_logprobs`` the current policy's -- and the row carries them apart
(``vexact.rl.metrics.lag_split_metrics``): ``mismatch/lag_k3_kl`` (behaviour vs current, both your trainer's)
and ``mismatch/tim_k3_kl`` (the rollout's recorded log-probs vs the behaviour policy's), beside the total
``rollout_corr/k3_kl`` (rollout vs current). ``behaviour_logprobs`` has the form of ``train_logprobs`` (and the same
mask); a NaN in it is a non-finite step like one in the other sides.

Bypass and async mode (the old log-probs come from the rollout, so your trainer computes no log-probs of its own
before the update, and there is nothing to compare with): ``LiveMonitor(..., sample_fraction=0.1, every=1)`` and
``step_sampled`` pay for a sample only::

    monitor = LiveMonitor("runs/my_grpo/vexact", sample_fraction=0.1, every=1, seed=0)
    row = monitor.step_sampled(step, batch["rollout_log_probs"], lambda rows: my_logprobs(batch, rows),
                               batch["response_mask"])

``step_sampled`` draws the step's rows (``sample(step, n_sequences)``: whole responses, ``sample_fraction`` of them
rounded to the nearest and at least one, ascending, a function of ``seed`` and ``step`` alone, so every process and
a restarted run draw the same), calls ``score_fn(rows)`` for your trainer's log-probs of those rows only -- in the
form of ``rollout_logprobs[rows]``: a ``[len(rows), T]`` tensor, or one 1-D tensor per row -- and writes the row of
``step`` on them, with ``live/sampled_sequences`` (rows scored) and ``live/sample_fraction`` (of the step's
responses). On a step that is not a multiple of ``every`` it calls nothing, writes nothing and returns None: no
metric is written for a step that was not measured. ``sample`` is there for a trainer that scores the rows in its
own way and passes both sides to ``step``. The cost is your trainer's forward over ``len(rows)`` responses instead of
all of them; the metrics are those of ``step`` over the same responses, bit for bit, when your trainer's scoring is
batch-invariant (the same log-probs for a response whatever else is in the forward), and a sample's otherwise.
``vexact run``'s ``monitor.sample_fraction`` / ``monitor.every`` use the same rule (``vexact.rl.monitor``).

Restarts: a directory whose metrics.jsonl already holds rows is refused unless ``resume=True``; then the first
``step(s)`` drops the rows of steps >= s (your trainer recomputes them), keeps the rest, and rebuilds the live
views from them (``log_backends``' rule), so metrics.jsonl never holds a step twice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from .engine.inputs import tensor_from_numpy
from .metric_keys import (
    K3_KL,
    LIVE_GATES_FAILED,
    LIVE_MEAN_RESPONSE_LENGTH,
    LIVE_NONFINITE,
    LIVE_SAMPLE_FRACTION,
    LIVE_SAMPLED_SEQUENCES,
    LIVE_SEQUENCES,
    MISMATCH_TOKENS,
    with_deprecated_names,
)
from .real.compare import DEFAULT_MAP, check_gates  # DEFAULT_MAP: the shipped map's name, as for --map
from .real.measure import check_report_methods, mismatch_report
from .records import METRICS_FILE
from .records.atomic import write_text_atomic
from .records.metrics_log import non_finite_string
from .records.runlog import MetricsWriter, json_safe, read_metrics
from .rl.config import ConfigError
from .rl.config_schema import LoggingSection
from .rl.log_backends import LOG_BACKENDS, WANDB_MODES, WandbMode, live_views, missing_package
from .rl.metrics import lag_split_metrics, require_log_prob_tensor
from .rl.monitor import check_sampling, sample_rows

__all__ = ["POSITIVE_LOGPROB_TOLERANCE", "GateFailed", "Gates", "LiveMonitor", "METRICS_FILE"]

POSITIVE_LOGPROB_TOLERANCE = 1e-6
"""A log-prob above this is refused: log p <= 0 for any probability, and a log_softmax computed in float32 or
bf16 never rounds above 0 by more than a few ulps of 0 (far below this); a value like +0.7 means logits or
probabilities were passed."""

RESERVED_KEYS = ("step", "outcome", "gates", "by_position", "map", "map_error")
RESERVED_PREFIXES = ("rollout_corr/", "training/", "mismatch/", "live/")  # mismatch_metrics' families and ours


OnGateFailure = Literal["record", "raise"]
ON_GATE_FAILURE = ("record", "raise")


@dataclass(frozen=True)
class Gates:
    """``vexact compare``'s gates, same names and meaning: ``fail_on_mismatch`` (every token bitwise equal),
    ``max_k3`` (``rollout_corr/k3_kl`` <= it), ``max_abs_dlogp`` (``mismatch/abs_dlogp_max`` <= it). None: off."""

    fail_on_mismatch: bool = False
    max_k3: float | None = None
    max_abs_dlogp: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fail_on_mismatch, bool):
            raise ValueError(f"Gates.fail_on_mismatch must be True or False, got {self.fail_on_mismatch!r}")
        for name in ("max_k3", "max_abs_dlogp"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Gates.{name} must be a finite number >= 0 or None, got {value!r}")

    def check(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """``compare.check_gates`` on a ``mismatch_report``."""
        return check_gates(report, self.fail_on_mismatch, self.max_k3, self.max_abs_dlogp)

    def not_computed(self, why: str) -> list[dict[str, Any]]:
        """Every requested gate, failed because the step has no metrics (``why``)."""
        names = [("--fail-on-mismatch", 0 if self.fail_on_mismatch else None), ("--max-k3", self.max_k3),
                 ("--max-abs-dlogp", self.max_abs_dlogp)]
        return [{"gate": gate, "limit": limit, "value": None, "passed": False, "message": f"not computed: {why}"}
                for gate, limit in names if limit is not None]


class GateFailed(RuntimeError):
    """A gate failed at a step (``on_gate_failure="raise"``); ``row`` is the step's row, already written."""

    def __init__(self, row: dict[str, Any]):
        self.row = row
        failed = "; ".join(f"{g['gate']}: {g['message']}" for g in row["gates"] if not g["passed"])
        super().__init__(f"vexact.live: step {row['step']}: gate failed: {failed}")


@dataclass
class _LogConfig:
    """What ``log_backends.live_views`` reads of a run's config (``name``, ``logging``, ``to_dict``): here the
    monitor's own settings, so a W&B run records these and not a vexact training config."""

    name: str
    logging: LoggingSection
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.settings)


class LiveMonitor:
    """One row of ``compare``'s metrics and gates per training step, into ``out_dir/metrics.jsonl`` and the live
    views (see the module docstring for inputs, outcomes, row keys, the map verdict and restarts)."""

    def __init__(self, out_dir: str | Path, gates: Gates | None = None, backends: Sequence[str] = ("jsonl",),
                 on_gate_failure: OnGateFailure = "record", resume: bool = False,
                 scaling_map: dict[str, Any] | str | Path | None = None, name: str | None = None,
                 wandb_project: str = "vexact", wandb_mode: WandbMode = "offline",
                 correction: Any = None, source: str | None = None, vocab: int | None = None,
                 policy_lag: int = 0, sample_fraction: float = 1.0, every: int = 1, seed: int = 0):
        self.out_dir = Path(out_dir)
        check_sampling(sample_fraction, every)
        check_report_methods()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer (it keys the sampled rows with the step), got {seed!r}")
        self.sample_fraction, self.every, self.seed = sample_fraction, every, seed
        if isinstance(policy_lag, bool) or not isinstance(policy_lag, int) or policy_lag < 0:
            raise ValueError(f"policy_lag must be an integer >= 0 (optimizer steps the rollout policy is behind the "
                             f"trained one), got {policy_lag!r}")
        self.policy_lag = policy_lag
        self.gates = Gates() if gates is None else gates
        if not isinstance(self.gates, Gates):
            raise ValueError(f"gates must be a vexact.live.Gates, got {type(self.gates).__name__}")
        if on_gate_failure not in ON_GATE_FAILURE:
            raise ValueError(f"on_gate_failure must be one of {ON_GATE_FAILURE}, got {on_gate_failure!r}")
        self.on_gate_failure = on_gate_failure
        if isinstance(backends, str):  # list("tensorboard") would be the names 't', 'e', ...
            raise ValueError(f"backends must be a sequence of names, e.g. ('jsonl', {backends!r}), got the string "
                             f"{backends!r}")
        self._log_config = _log_config(self.out_dir, list(backends), name, wandb_project, wandb_mode, self.gates,
                                       on_gate_failure)
        if self.sampling:  # a W&B run records what its rows were computed on
            self._log_config.settings["live"].update(sample_fraction=sample_fraction, every=every, seed=seed)
        self._map = _load_scaling_map(scaling_map, correction, source, vocab, policy_lag)
        self.metrics_path = self.out_dir / METRICS_FILE
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"{self.out_dir} exists and is not a directory")
        kept = read_metrics(self.metrics_path)
        if kept and not resume:
            raise ValueError(f"{self.metrics_path} already holds {len(kept)} steps (last step "
                             f"{kept[-1].get('step')}): pass resume=True to continue it, or choose another out_dir")
        self._writer: MetricsWriter | None = None  # opened at the first step (a resume truncates there first)
        self._last_step: int | None = None

    # ----------------------------------------------------------------------------------------------- per step
    def step(self, step: int, rollout_logprobs: Tensor | Sequence[Tensor], train_logprobs: Tensor | Sequence[Tensor],
             mask: Tensor | None = None, extra: dict[str, Any] | None = None,
             behaviour_logprobs: Tensor | Sequence[Tensor] | None = None) -> dict[str, Any]:
        """Compare one step's rollout-side and training-side log-probs of the same tokens; write and return the
        row (``extra``: more keys for it, e.g. the trainer's own step counter; they may not shadow the row's).
        ``behaviour_logprobs``: the trainer's log-probs under the policy that sampled the tokens (policy lag), in the
        form of ``train_logprobs``: the row then carries the lag's drift and the TIM apart (module docstring).
        Raises ValueError on a caller mistake (nothing written), ``GateFailed`` after writing a row whose gate
        failed when ``on_gate_failure="raise"``."""
        self._check_step(step)
        _check_extra(extra)
        return self._step(step, rollout_logprobs, train_logprobs, mask, extra, behaviour_logprobs)

    @property
    def sampling(self) -> bool:
        """Whether ``step_sampled`` compares less than every response of every step."""
        return self.sample_fraction < 1 or self.every > 1

    def sample(self, step: int, n_sequences: int) -> list[int] | None:
        """The rows of a step of ``n_sequences`` responses whose training-side log-probs to compute (ascending,
        ``sample_fraction`` of them rounded, at least one; deterministic in ``seed`` and ``step``), or None when
        ``step`` is not a multiple of ``every`` (skip the step: nothing to compute, no row)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if isinstance(n_sequences, bool) or not isinstance(n_sequences, int) or n_sequences < 1:
            raise ValueError(f"n_sequences must be an integer >= 1 (the step's responses), got {n_sequences!r}")
        return sample_rows(n_sequences, self.sample_fraction, self.every, self.seed, step)

    def step_sampled(self, step: int, rollout_logprobs: Tensor | Sequence[Tensor],
                     score_fn: Callable[[list[int]], Tensor | Sequence[Tensor]], mask: Tensor | None = None,
                     extra: dict[str, Any] | None = None, train_side: str = "score_fn(rows)"
                     ) -> dict[str, Any] | None:
        """``step`` on a sample of the step's responses, for a trainer that does not compute its own log-probs of
        them (bypass / async mode): ``score_fn(rows)`` returns the training side of those rows only (``sample``'s
        list), in the form of ``rollout_logprobs[rows]`` (a ``[len(rows), T]`` tensor, or one 1-D tensor per row).
        Returns the row written (its metrics are the sample's; ``live/sampled_sequences``, ``live/sample_fraction``
        say how many), or None on a step ``every`` skips (``score_fn`` is not called, nothing is written). A step of
        no responses is recorded as ``step``'s is (``no tokens``; ``score_fn`` is not called). ``train_side``: the
        training side's name in errors (an integration names its trainer's tensor); errors name the caller's rows,
        not the sample's."""
        self._check_step(step)
        _check_extra(extra)
        if not callable(score_fn):
            raise ValueError(f"score_fn must be a function rows -> training log-probs, got {type(score_fn).__name__}")
        rollout_logprobs, mask = _from_numpy(rollout_logprobs, "rollout_logprobs"), _from_numpy(mask, "mask")
        if isinstance(rollout_logprobs, Tensor):
            if rollout_logprobs.dim() != 2:
                raise ValueError(f"rollout_logprobs must be a [B, T] tensor, got shape {list(rollout_logprobs.shape)}")
            n = int(rollout_logprobs.shape[0])
        elif isinstance(rollout_logprobs, (list, tuple)):
            n = len(rollout_logprobs)
        else:
            raise _not_a_side("rollout_logprobs", rollout_logprobs)
        rows = self.sample(step, max(n, 1))
        if rows is None:
            self._last_step = step  # skipped, but seen: a later step must still follow it
            return None
        if n == 0:  # nothing to sample: the empty step's row, as step() writes it
            return self._step(step, rollout_logprobs, rollout_logprobs, mask, extra, None, (0, 0))
        if isinstance(rollout_logprobs, Tensor):
            index = torch.tensor(rows, device=rollout_logprobs.device)
            rollout_rows = rollout_logprobs.index_select(0, index)
            if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == n:
                mask = mask.index_select(0, index.to(mask.device))
            elif mask is not None:  # the shape error, named as step names it
                _padded_rows(rollout_logprobs, rollout_logprobs, mask)
        else:
            rollout_rows = [rollout_logprobs[i] for i in rows]
        train = _from_numpy(score_fn(list(rows)), train_side)
        return self._step(step, rollout_rows, train, mask, extra, None, (len(rows), n), train_side, rows)

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not follow step {self._last_step}: steps must increase")

    def _step(self, step: int, rollout_logprobs: Tensor | Sequence[Tensor], train_logprobs: Tensor | Sequence[Tensor],
              mask: Tensor | None, extra: dict[str, Any] | None,
              behaviour_logprobs: Tensor | Sequence[Tensor] | None, sampled: tuple[int, int] | None = None,
              train_side: str = "train_logprobs", rows: list[int] | None = None) -> dict[str, Any]:
        """``step`` after the checks of the step and ``extra``; ``sampled``: (rows scored, responses of the step);
        ``rows``: the caller's row of each row given (a sample's), for errors."""
        train, roll, lengths, nonfinite = _flat_sides(rollout_logprobs, train_logprobs, mask, train_side, rows)
        behaviour = None
        if behaviour_logprobs is not None:
            behaviour, _, behaviour_lengths, behaviour_nonfinite = _flat_sides(rollout_logprobs, behaviour_logprobs,
                                                                               mask, "behaviour_logprobs")
            if behaviour_lengths != lengths:
                raise ValueError("behaviour_logprobs and train_logprobs hold different response lengths")
            nonfinite = max(nonfinite, behaviour_nonfinite)
        row = self._row(step, train, roll, lengths, nonfinite, behaviour)
        if sampled is not None:
            row[LIVE_SAMPLED_SEQUENCES] = sampled[0]
            row[LIVE_SAMPLE_FRACTION] = sampled[0] / sampled[1] if sampled[1] else 0.0  # no responses: none sampled
        if extra:
            row.update(extra)
        self._write(step, row)
        if self.on_gate_failure == "raise" and row[LIVE_GATES_FAILED]:
            raise GateFailed(row)
        return row

    def _row(self, step: int, train: Tensor, roll: Tensor, lengths: list[int], nonfinite: int,
             behaviour: Tensor | None = None) -> dict[str, Any]:
        tokens = sum(lengths)
        head = {"step": step, LIVE_SEQUENCES: len(lengths), MISMATCH_TOKENS: tokens,  # horizon as compare --map
                LIVE_MEAN_RESPONSE_LENGTH: tokens / len(lengths) if lengths else 0.0}
        if nonfinite or not tokens:
            outcome = "non-finite" if nonfinite else "no tokens"
            why = f"{nonfinite} of {tokens} log-probs are NaN or infinite" if nonfinite else "every response is masked"
            gates = self.gates.not_computed(why)
            return {**head, "outcome": outcome, LIVE_NONFINITE: nonfinite, LIVE_GATES_FAILED: len(gates),
                    "gates": gates}
        report = mismatch_report(train, roll, lengths, max(lengths))
        gates = self.gates.check(report)
        row = {**head, "outcome": "ok", **report["metrics"], LIVE_GATES_FAILED: sum(not g["passed"] for g in gates),
               "gates": gates, "by_position": report["by_position"]}
        if behaviour is not None:  # the lag's drift and the TIM apart; the total is report's k3
            row.update(lag_split_metrics([train], [behaviour], [roll]))
        if self._map is not None:
            try:
                row["map"] = self._map(report["metrics"][K3_KL], row[LIVE_MEAN_RESPONSE_LENGTH])
            except ValueError as err:  # the map cannot place this point: say so, keep training
                row["map_error"] = str(err)
        return row

    def _write(self, step: int, row: dict[str, Any]) -> None:
        if self._writer is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            _keep_steps_below(self.metrics_path, step)  # fresh: only a torn fragment can be there; resume: the tail
            try:
                self._writer = MetricsWriter(self.metrics_path,
                                             live_views=live_views(self.out_dir, self._log_config))
            except ConfigError as err:
                raise ValueError(f"vexact.live: {err.problem}") from None
        self._writer.write(row)
        self._last_step = step

    # ---------------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close metrics.jsonl and the live views (a monitor that never stepped has nothing open)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> LiveMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------- settings
def _log_config(out_dir: Path, backends: list[str], name: str | None, wandb_project: str, wandb_mode: str,
                gates: Gates, on_gate_failure: str) -> _LogConfig:
    """The backends checked now (names, duplicates, installed packages), so a bad choice fails before step 0."""
    for backend in backends:
        if backend not in LOG_BACKENDS:  # read now: a backend registered after import counts too
            raise ValueError(f"unknown backend {backend!r}; expected some of {list(LOG_BACKENDS.names())}")
    if "jsonl" not in backends:
        backends = ["jsonl", *backends]  # metrics.jsonl is the record; the others are copies of it
    if len(set(backends)) != len(backends):
        raise ValueError(f"backends lists a name twice: {backends}")
    for backend in backends:
        problem = missing_package(backend)
        if problem:
            raise ValueError(f"vexact.live: {problem}")
    if wandb_mode not in WANDB_MODES:
        raise ValueError(f"wandb_mode must be {' or '.join(map(repr, WANDB_MODES))}, got {wandb_mode!r}")
    settings = {"live": {"gates": asdict(gates), "on_gate_failure": on_gate_failure}}
    return _LogConfig(name or out_dir.resolve().name, LoggingSection(backends=backends, wandb_project=wandb_project,
                                                                     wandb_mode=wandb_mode), settings)


def _load_scaling_map(scaling_map: dict[str, Any] | str | Path | None, correction: Any = None,
                      source: str | None = None, vocab: int | None = None, policy_lag: int = 0) -> Any:
    """``(k3, horizon) -> the map key`` as ``vexact compare --map --correction --source --vocab`` writes it
    (``verdict.MAP_KEYS``), or None without a map. ``"default"``, as for ``compare --map``, is the map shipped with
    vexact for ``vocab`` (``verdict.shipped_map_for``: the tail map for a real vocabulary; None: the main map). The
    correction and source are resolved and checked against the map here, once."""
    if scaling_map is None:
        # policy_lag too: without a map nothing reads it (behaviour_logprobs splits a row at any lag)
        given = [name for name, value in (("correction", correction), ("source", source), ("vocab", vocab),
                                          ("policy_lag", policy_lag or None)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} chooses a curve of scaling_map: give scaling_map too, or leave {given[0]} "
                             "out")
        return None
    from .map import verdict
    if vocab is not None and scaling_map != DEFAULT_MAP:  # load_map ignored it for a file, and a dict has no choice
        raise ValueError(f"vocab picks one of the maps shipped with vexact (scaling_map={DEFAULT_MAP!r}), and a "
                         "scaling_map given as a dict or a file is its own map: give one of them")
    if isinstance(scaling_map, dict):
        data = scaling_map
    elif isinstance(scaling_map, (str, Path)):
        data = verdict.load_map(None if scaling_map == DEFAULT_MAP else Path(scaling_map), vocab)
    else:
        raise ValueError(f"scaling_map must be a map dict, the path of a scaling.json or {DEFAULT_MAP!r}, got "
                         f"{type(scaling_map).__name__}")
    _check_map_keys(data)
    try:
        name = verdict.choose_correction(data, correction, source, policy_lag)  # an unknown name, source or lag
    except (KeyError, TypeError, IndexError, AttributeError) as err:  # a malformed map dict
        raise ValueError(f"scaling_map cannot place a step: {_problem(err)}") from None

    def place(k3: float, horizon: float) -> dict[str, Any]:
        placed = verdict.place_on_map(data, k3, horizon, name, source, policy_lag)
        return {key: placed[key] for key in verdict.MAP_KEYS}

    _check_map(data, place)
    return place


def _check_map_keys(data: dict[str, Any]) -> None:
    """The keys ``verdict.load_map`` requires of a map file, required of a map dict too."""
    missing = [key for key in ("status", "horizon_range") if key not in data]
    if missing:
        raise ValueError(f"scaling_map is not a map: no {' or '.join(map(repr, missing))} key (a map is what "
                         "vexact.map.verdict.load_map returns for a scaling.json)")


def _check_map(data: dict[str, Any], place: Any) -> None:
    """Refuse a map that no step could be placed on, now rather than as a ``map_error`` on every row: one placement
    (k3 = 0 at the map's first measured horizon) reads every field a placement needs."""
    horizons = data["horizon_range"]
    first = horizons[0] if isinstance(horizons, list) and horizons else None
    probe = first if isinstance(first, (int, float)) and not isinstance(first, bool) and first > 0 else 1.0
    try:  # a bad horizon_range is the placement's own error (not one about the probe's horizon)
        place(0.0, probe)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError) as err:
        raise ValueError(f"scaling_map cannot place a step: {_problem(err)}") from None


def _problem(err: Exception) -> str:
    return f"no {err}" if isinstance(err, KeyError) else str(err)


def _keep_steps_below(path: Path, step: int) -> None:
    """Resuming at ``step``: drop the rows of steps >= ``step`` (a torn last line goes too) and keep the rest."""
    rows = read_metrics(path)
    kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] < step]
    if len(kept) == len(rows) and (not path.exists() or path.read_bytes().endswith(b"\n")):
        return
    # rewritten as MetricsWriter wrote them: a renamed key under its old name too (metric_keys.RENAMED_METRICS)
    write_text_atomic(path, "".join(json.dumps(json_safe(with_deprecated_names(row)), sort_keys=True) + "\n"
                                    for row in kept))


# ----------------------------------------------------------------------------------------------------- inputs
def _not_a_side(side: str, value: Any) -> ValueError:
    """The error for a side of a step that is neither form ``step`` takes."""
    return ValueError(f"{side} must be a [B, T] tensor (or numpy array) or a sequence of 1-D tensors, got "
                      f"{type(value).__name__}")


def _flat_sides(rollout: Tensor | Sequence[Tensor], train: Tensor | Sequence[Tensor], mask: Tensor | None,
                train_side: str = "train_logprobs", rows: list[int] | None = None
                ) -> tuple[Tensor, Tensor, list[int], int]:
    """(training, rollout) masked values flattened as float64, the tokens per sequence, and how many positions are
    non-finite on either side. Refuses what cannot be compared (see the module docstring). ``train_side``: the
    training side's name in errors (``behaviour_logprobs`` for the behaviour policy's); ``rows``: the caller's row
    of each row given (a sample of its batch), which errors name."""
    rollout, train = _from_numpy(rollout, "rollout_logprobs"), _from_numpy(train, train_side)
    mask = _from_numpy(mask, "mask")
    if isinstance(rollout, Tensor) != isinstance(train, Tensor):
        raise ValueError(f"rollout_logprobs and {train_side} must both be [B, T] tensors (or numpy arrays) or both "
                         f"sequences of 1-D tensors, got {type(rollout).__name__} and {type(train).__name__}")
    if isinstance(rollout, Tensor):
        rows_roll, rows_train = _padded_rows(rollout, train, mask, train_side, rows)
    else:
        for side, value in (("rollout_logprobs", rollout), (train_side, train)):
            if not isinstance(value, (list, tuple)):
                raise _not_a_side(side, value)
        if mask is not None:
            raise ValueError("mask is for padded [B, T] tensors; sequences of 1-D tensors hold only response tokens")
        rows_roll, rows_train = _sequence_rows(rollout, train, train_side, rows)
    lengths = [int(r.numel()) for r in rows_roll]
    roll = torch.cat(rows_roll) if rows_roll else torch.zeros(0, dtype=torch.float64)
    flat_train = torch.cat(rows_train) if rows_train else torch.zeros(0, dtype=torch.float64)
    nonfinite = int((~(torch.isfinite(roll) & torch.isfinite(flat_train))).sum())
    return flat_train, roll, lengths, nonfinite


def _check_extra(extra: dict[str, Any] | None) -> None:
    """``extra``: a dict of string keys that do not shadow the row's own, whose values JSON can hold and that hold
    no string the log reads back as NaN/Inf."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict, got {type(extra).__name__}")
    for key, value in extra.items():
        if not isinstance(key, str):
            raise ValueError(f"extra keys must be strings, got {key!r} ({type(key).__name__})")
        try:
            json.dumps(json_safe(value), allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            raise ValueError(f"extra[{key!r}] ({type(value).__name__}) is not JSON, so a metrics.jsonl row cannot "
                             "hold it: pass numbers, strings, bools, None, or lists and dicts of them (e.g. float(x) "
                             "for a tensor or numpy scalar)") from None
        # the log spells NaN/Inf as strings: such text would read back (and be plotted) as a number
        if (text := non_finite_string(value)) is not None:
            raise ValueError(f"extra[{key!r}] holds the string {text!r}, which metrics.jsonl reads back as a number "
                             f"(its spelling of NaN/Inf): pass float({text!r}) for that number, or other text")
    clash = sorted(key for key in extra if key in RESERVED_KEYS or key.startswith(RESERVED_PREFIXES))
    if clash:
        raise ValueError(f"extra keys {clash} would shadow the row's own ({', '.join(RESERVED_PREFIXES)}*, "
                         f"{', '.join(RESERVED_KEYS)})")


def _from_numpy(value: Any, side: str) -> Any:
    """A numpy array as a tensor of its own dtype (a sequence: each item); anything else as it is."""
    if isinstance(value, np.ndarray):
        return tensor_from_numpy(value, side)
    if isinstance(value, (list, tuple)) and any(isinstance(item, np.ndarray) for item in value):
        return [_from_numpy(item, f"{side}[{i}]") for i, item in enumerate(value)]
    return value


def _check_tensor(side: str, value: Any) -> Tensor:
    """``value`` widened to float64 on the CPU, or one ValueError naming ``side`` (numpy arrays arrive converted)."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{side} must be a torch tensor or numpy array, got {type(value).__name__}")
    require_log_prob_tensor(side, value)
    return value.detach().to("cpu", torch.float64)  # exact widening (float16/bf16/float32 -> float64)


def _padded_rows(rollout: Tensor, train: Tensor, mask: Tensor | None, train_side: str = "train_logprobs",
                 rows: list[int] | None = None) -> tuple[list[Tensor], list[Tensor]]:
    roll, tr = _check_tensor("rollout_logprobs", rollout), _check_tensor(train_side, train)
    if roll.dim() != 2 or roll.shape != tr.shape:
        if rows is not None:  # a sample: the caller passed the whole batch
            raise ValueError(f"{train_side} has shape {list(tr.shape)}, but the {len(rows)} sampled rows {rows} of "
                             f"rollout_logprobs are {list(roll.shape)}: it must return those rows only")
        raise ValueError(f"rollout_logprobs {list(roll.shape)} and {train_side} {list(tr.shape)} must be [B, T] "
                         "tensors of one shape")
    if mask is None:
        keep = torch.ones(roll.shape, dtype=torch.bool)
    else:
        if not isinstance(mask, Tensor):
            raise ValueError(f"mask must be a torch tensor or numpy array, got {type(mask).__name__}")
        if mask.shape != roll.shape:
            raise ValueError(f"mask has shape {list(mask.shape)} but the log-probs have {list(roll.shape)}")
        mask = mask.detach().cpu()
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask holds values other than 0 and 1")
        keep = mask.bool()
    rows_roll, rows_train = [], []
    for b in range(roll.shape[0]):
        columns = keep[b].nonzero().flatten()
        for side, values, out in (("rollout_logprobs", roll, rows_roll), (train_side, tr, rows_train)):
            row = values[b, columns]
            j = _first_positive(row)
            if j is not None:
                raise _positive_error(f"{side}[{b if rows is None else rows[b]}, {int(columns[j])}]", row)
            out.append(row)
    return rows_roll, rows_train


def _sequence_rows(rollout: Sequence[Tensor], train: Sequence[Tensor], train_side: str = "train_logprobs",
                   rows: list[int] | None = None) -> tuple[list[Tensor], list[Tensor]]:
    if len(rollout) != len(train):
        what = f"the {len(rollout)} sampled rows {rows}" if rows is not None else f"{len(rollout)} rollout sequences"
        raise ValueError(f"got {what} but {len(train)} sequences in {train_side}")
    rows_roll, rows_train = [], []
    for i, (r, t) in enumerate(zip(rollout, train)):
        n = i if rows is None else rows[i]  # the caller's sequence
        r, t = _check_tensor(f"rollout_logprobs[{n}]", r), _check_tensor(f"{train_side}[{n}]", t)
        if r.dim() != 1 or r.shape != t.shape:
            raise ValueError(f"sequence {n}: rollout_logprobs {list(r.shape)} and {train_side} {list(t.shape)} "
                             "must be 1-D of one length")
        for side, row, out in (("rollout_logprobs", r, rows_roll), (train_side, t, rows_train)):
            j = _first_positive(row)
            if j is not None:
                raise _positive_error(f"{side}[{n}][{j}]", row)
            out.append(row)
    return rows_roll, rows_train


def _first_positive(row: Tensor) -> int | None:
    """The index of the first finite value above ``POSITIVE_LOGPROB_TOLERANCE`` (+inf is an outcome, non-finite)."""
    above = ((row > POSITIVE_LOGPROB_TOLERANCE) & torch.isfinite(row)).nonzero()
    return int(above[0, 0]) if above.numel() else None


def _positive_error(where: str, row: Tensor) -> ValueError:
    count = int(((row > POSITIVE_LOGPROB_TOLERANCE) & torch.isfinite(row)).sum())
    value = float(row[_first_positive(row)])
    return ValueError(f"{where} is {value:.6g}: a log-prob above 0 (a probability above 1; tolerance "
                      f"{POSITIVE_LOGPROB_TOLERANCE:g}, {count} such values in the row): were logits or probabilities "
                      "passed?")
