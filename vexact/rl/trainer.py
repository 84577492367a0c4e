"""The RL loop: config -> rollout (+ injector) -> score -> advantages -> loss -> update -> metrics -> logs.

``Trainer.step`` reads as that data flow, one module per stage, each visited once:
1. ``inject``: the step's ``RolloutPlan`` (the ops, weight dtype and logits hook of the rollout path);
   ``collect`` / ``rollout_engines``: ``prompts_per_step`` problems x ``samples_per_prompt`` responses on that
   path, and rewards;
2. ``scoring``: what the training path scores before the update (``Scorer.before_update``): the anchors of the PPO
   ratio (old log-probs recomputed by the training path, or the rollout's), the KL reference, the lagged policy,
   the monitor's sample, MoE routing;
3. ``advantages``: one advantage per sequence;
4. ``objective``: per mini-batch the loss (rollout correction, clipped surrogate, KL, entropy); the update, here:
   backward, fp32 master gradients, clipping and AdamW (``optim``) at the ``schedules`` LR;
5. ``step_metrics``: one JSON line in metrics.jsonl (``vexact.records.runlog``); periodic clean evaluation and
   checkpoints.
Everything random is keyed by (seed, step), so the same config gives bit-identical metrics.

Policy lag (``rollout.policy_lag`` = k > 0, asynchronous RL): step s samples from the weights the policy had at the
start of step s - k (the starting weights while s < k), kept in a ring of the last k steps' weights that the
checkpoint saves, so a resumed run is the uninterrupted one bit for bit. The rollout records the lagged policy's
log-probs; bypass anchors the ratio on them (current / rollout-recorded, verl's bypass); recompute anchors it on the
current policy before the update, as verl's decoupled mode and AReaL's proximal policy do (neither trainer keeps old
weights), so a correction's weight π_old / μ sees the lag's drift as well as the mismatch. The lagged policy is also
scored on the training path, for the metrics that split the total k3: ``mismatch/lag_k3_kl`` (lagged vs
current, both training path) and ``mismatch/tim_k3_kl`` (rollout vs lagged on the training path).

With several ranks (``data_parallel``), each rank rolls out, scores (the run's scorer is a ``ShardedScorer``) and
evaluates a share of the sequences, the shares are gathered, and each mini-batch's gradient is the fixed-tree sum
of ``distributed.leaves`` leaves, so the run is bitwise the same for any number of ranks. Rank 0 writes the run
directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import Tensor

import vexact_kernels
from vexact_kernels.host_guard import host_cpu

from ..cli_base import print_error_line, stop_signal
from ..engine.devices import device_kind, rank_device
from ..engine.model import Transformer, resolve_dtype
from ..metric_keys import (
    BITWISE_EQUAL_FRAC,
    EVAL_GREEDY_ACCURACY,
    EVAL_REWARD_MEAN,
    GRAD_NORM,
    K3_KL,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    TIMING_EVAL,
    TIMING_GRAD_REDUCE,
    TIMING_ROLLOUT,
    TIMING_STEP,
    TIMING_UPDATE,
)
from ..records import CONFIG_FILE, FINISHED_STATUSES, METRICS_FILE, SUMMARY_FILE
from ..records.metrics_log import check_finished, decode_non_finite
from ..records.runlog import (
    UNFINISHED,
    MetricsWriter,
    checkpoint_dirs,
    discard_if_interrupted_early,
    load_checkpoint,
    read_metrics,
    run_lock,
    save_checkpoint,
    write_json_atomic,
)
from ..registry import PluginCodeError
from ..version import __version__
from .advantages import compute_advantages
from .collapse import detect_collapse
from .collect import RolloutBatch, eval_metrics, eval_records, step_problems
from .config import config_changes, save_config
from .config_schema import MEMORY_KEYS, RunConfig, knob_key
from .data_parallel import DataParallel, check_leaves
from .inject import Calibration, Injector, RolloutPlan, calibrate
from .log_backends import live_views
from .metrics import mismatch_metrics
from .objective import MinibatchLoss, Objective, RunStopped
from .optim import ExactAdamW, clip_flat_gradient_
from .registries import ROLLOUT_ENGINES
from .rollout_engines import RolloutSession
from .schedules import LRSchedule, steps_change_problem
from .scoring import Anchors, Scorer
from .step_metrics import UpdateRecord, step_metrics
from .tasks import check_lengths, held_out_problems, task_of, training_problems
from .triton_guard import check_interpreted_triton
from .validate import ConfigError
from .warmstart import warm_start, warm_start_key

__all__ = ["CollapseConfirmed", "RunStopped", "Trainer", "run_dir_for"]

CALIBRATION_SEED_OFFSET = 2_000_003  # calibration prompts are not training prompts


class CollapseConfirmed(Exception):
    """Collapse confirmed and ``collapse.stop_on_collapse`` set: end the run early."""


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir) if cfg.output_dir else Path("runs") / cfg.name


def holds_results(run_dir: Path) -> bool:
    """Whether a run has written results to ``run_dir`` (a metric line, a checkpoint, or the summary of a run that
    finished before its first line): a new run there is refused, since it would mix with them. A run that failed
    before any of that (an error in its first step) leaves its config.yaml and an empty metrics.jsonl: nothing a
    new run would mix with, so it may start there afresh."""
    if not run_dir.is_dir():  # absent, or a file in its place (refused where the run makes it)
        return False
    metrics = run_dir / METRICS_FILE
    return (metrics.exists() and metrics.stat().st_size > 0 or bool(checkpoint_dirs(run_dir))
            or _read_summary(run_dir) is not None)


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run to resume: its config.yaml (written once the warm start is done) or results.
    A directory a run was killed in before that holds nothing to resume (a fresh start there is allowed)."""
    return (run_dir / CONFIG_FILE).exists() or holds_results(run_dir)


def foreign_entries(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` that no vexact run writes before its results (``UNFINISHED``), sorted; [] for a
    directory that is absent, empty, or holds a run. A new run there would mix its files with someone else's."""
    if not run_dir.is_dir() or holds_run(run_dir):
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in UNFINISHED)


class Trainer:
    """Owns the policy, optimizer and run directory of one experiment.

    ``ranks``: this process's place among data-parallel ranks (default: the only one); see ``data_parallel``."""

    def __init__(self, cfg: RunConfig, console: Console | None = None, ranks: DataParallel | None = None):
        self.cfg = cfg
        self.ranks = ranks or DataParallel(reduce=cfg.distributed.reduce)
        # `vexact run --nproc` checked its count before starting the ranks: one refused here is torchrun's
        check_leaves(cfg.distributed.leaves, self.ranks.world_size, nproc=False)
        self._my_leaves = self.ranks.block(cfg.distributed.leaves)  # of each mini-batch's gradient leaves
        self.console = (console or Console()) if self.ranks.is_main else Console(quiet=True)
        self.run_dir = run_dir_for(cfg)
        torch.set_num_threads(cfg.threads or default_threads(cfg))
        self.task = task_of(cfg)
        self.tokenizer = self.task.tokenizer  # the characters, and a vocabulary tail when task.distractors > 0
        check_lengths(cfg)  # a ConfigError, also for a RunConfig built in Python (load_config checked it already)
        check_interpreted_triton(cfg, self.task, self.console)  # refuse hours in the Triton interpreter up front
        self.model_config = cfg.model.to_model_config(self.tokenizer.vocab_size)
        # the run's device (``device``; under --nproc each rank its own GPU): policy, reference, optimizer state,
        # injector and rollouts live there
        self.device = rank_device(cfg.device)
        if cfg.rollout.cuda_graphs and self.device.type != "cuda":  # device auto found no GPU
            raise ConfigError(f"records the decode step in a CUDA graph: device {cfg.device!r} resolved to "
                              f"{self.device} here, and it needs a CUDA device", "rollout.cuda_graphs")
        # fp32 master weights; a compute copy in the training dtype only when that is not fp32.
        self.master = Transformer(self.model_config, backend=cfg.backend, dtype=torch.float32, device=self.device,
                                  init_seed=cfg.policy_seed)
        self.compute_dtype = resolve_dtype(cfg.dtype)
        self.compute = self.master if self.compute_dtype == torch.float32 else self._copy_of(self.master,
                                                                                            self.compute_dtype)
        self.reference: Transformer | None = None
        self.optimizer = ExactAdamW(self.master.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas),
                                    eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
        self.schedule = LRSchedule(cfg.optimizer, cfg.lr_schedule, total_steps=cfg.steps,
                                   collapse=cfg.collapse)
        self.eval_problems = held_out_problems(self.task, cfg.task.eval_prompts)
        self.injector = Injector.for_run(cfg, self.master.device)
        self.objective = Objective(cfg.algorithm, cfg.correction, cfg.rollout.temperature,
                                   exact_training=cfg.backend in vexact_kernels.EXACT_BACKENDS)
        # the training path's scoring before the update: on several ranks, each scores a block of the sequences
        self.scorer = Scorer.for_run(cfg, self.ranks)
        self.calibration: Calibration | None = None
        # who samples (rollout.engine); its session opens at the first rollout and closes when the run ends
        self.engine = ROLLOUT_ENGINES[cfg.rollout.engine]
        self.engine.check(self.ranks.world_size)  # e.g. its package missing: one error now, not after the warm start
        self._session: RolloutSession | None = None
        self._view_failure: PluginCodeError | None = None  # a live view's close failed: raised after the run's end
        # rollout.policy_lag = k: the master weights at the start of the last k steps, oldest first (the behaviour
        # policy is the oldest), and an fp32 model the behaviour weights are loaded into
        self._snapshots: deque[list[Tensor]] = deque(maxlen=cfg.rollout.policy_lag or None)
        self._behaviour: Transformer | None = None

    # ------------------------------------------------------------------ setup helpers
    def _copy_of(self, model: Transformer, dtype: torch.dtype) -> Transformer:
        copy = Transformer(self.model_config, backend=self.cfg.backend, dtype=dtype, device=self.device,
                           init_seed=None)
        with torch.no_grad():
            for dst, src in zip(copy.parameters(), model.parameters()):
                dst.copy_(src)
        return copy

    def _copy_master_to_compute(self) -> None:
        if self.compute is not self.master:
            with torch.no_grad():
                for dst, src in zip(self.compute.parameters(), self.master.parameters()):
                    dst.copy_(src)

    def load_policy(self, weights: dict[str, Tensor], optimizer_state: dict | None = None) -> None:
        """Set the policy's fp32 master weights (and optimizer state); the compute copy follows."""
        self.master.load_state_dict(weights)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        self._copy_master_to_compute()

    def _weights_in(self, dtype: torch.dtype, master: Transformer | None = None) -> Transformer:
        """The policy's weights in ``dtype``: the compute model, or a fresh copy of the master. ``master``: other fp32
        weights (the lagged behaviour policy) instead of the current ones."""
        if master is None or master is self.master:
            return self.compute if dtype == self.compute_dtype else self._copy_of(self.master, dtype)
        return master if dtype == torch.float32 else self._copy_of(master, dtype)

    def _behaviour_policy(self) -> Transformer:
        """The fp32 weights this step's rollouts are sampled from, and the step's snapshot taken.

        On-policy (``rollout.policy_lag`` 0): the master itself. With lag k: the master as it was k steps ago (the
        starting policy during the first k steps), from the ring of the last k steps' weights, which then takes
        this step's (pre-update) weights."""
        if not self.cfg.rollout.policy_lag:
            return self.master
        behaviour = self.master
        if self._snapshots:
            if self._behaviour is None:
                self._behaviour = Transformer(self.model_config, backend=self.cfg.backend, dtype=torch.float32,
                                              device=self.device, init_seed=None)
            with torch.no_grad():
                for dst, src in zip(self._behaviour.parameters(), self._snapshots[0]):
                    dst.copy_(src)
            behaviour = self._behaviour
        self._snapshots.append([p.detach().clone() for p in self.master.parameters()])
        return behaviour

    def _snapshot_tensors(self) -> dict[str, Tensor]:
        """The policy-lag ring as named tensors (``<i>.<parameter>``, 0 oldest) for the checkpoint."""
        names = [name for name, _ in self.master.named_parameters()]
        return {f"{i}.{name}": t for i, snap in enumerate(self._snapshots) for name, t in zip(names, snap)}

    def _restore_snapshots(self, tensors: dict[str, Tensor]) -> None:
        """The policy-lag ring from a checkpoint's tensors (``_snapshot_tensors``)."""
        names = [name for name, _ in self.master.named_parameters()]
        count = len({key.split(".", 1)[0] for key in tensors})
        self._snapshots.clear()
        for i in range(count):
            self._snapshots.append([tensors[f"{i}.{name}"].to(self.master.device) for name in names])

    def _reference(self) -> Transformer:
        if self.reference is None:  # frozen copy of the starting policy
            self.reference = self._copy_of(self.compute, self.compute_dtype)
        return self.reference

    def _log(self, text: str) -> None:
        self.console.print(text)

    # ------------------------------------------------------------------ one step
    def rollout(self, step: int, plan: RolloutPlan, problems: list | None = None,
                policy: Transformer | None = None) -> RolloutBatch:
        """The rollout batch of ``step`` (its training problems unless ``problems`` is given) on ``plan``'s path;
        each rank samples its share of the problems, and every rank gets the whole batch. ``policy``: the fp32
        weights to sample from (the lagged behaviour policy; None: the current one)."""
        cfg = self.cfg
        if problems is None:
            problems = step_problems(self.task, cfg.rollout, cfg.seed, step)
        mine = self.ranks.block(len(problems))
        if self._session is None:
            self._session = self.engine.session(cfg, self.run_dir, self.ranks.world_size)
        if self.ranks.world_size > 1 and not mine:  # fewer problems than ranks: nothing to sample, only to gather
            return RolloutBatch.concat(self.ranks.gather([]))
        local = self._session.collect(self._weights_in(plan.dtype, policy), plan, self.task, self.tokenizer,
                                      problems[mine.start : mine.stop], cfg.rollout, _step_seed(cfg.seed, step),
                                      first_problem=mine.start)
        return local if self.ranks.world_size == 1 else RolloutBatch.concat(self.ranks.gather([local]))

    def close(self) -> None:
        """Close the rollout engine's session (an outside engine's process); ``run`` does it when it ends."""
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def step(self, step: int) -> dict:
        """One step, in the order its data flows, each stage's module visited once:

        1. rollout (``inject``, ``rollout_engines``): the step's plan, the behaviour policy (``rollout.policy_lag``),
           the batch and its rewards;
        2. score (``scoring``): what the training path scores at the pre-update weights -- the ratio's anchors, the
           KL reference, the lagged policy, the monitor's sample, MoE routing -- by ``self.scorer``, the run's
           scorer, data-parallel or not;
        3. advantages (``advantages``);
        4. loss (``objective``), per PPO mini-batch, and the update (``schedules``' LR; ``optim``: clip, AdamW);
        5. metrics (``step_metrics``): the step's line."""
        cfg, alg = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        plan = self.injector.plan(step)
        injected = plan if self.injector.enabled else None
        if not self.engine.runs_training_path:  # an outside engine's rollout is never the training path's bits
            plan = dataclasses.replace(plan, matches_training=False)
        behaviour = self._behaviour_policy()
        lagged = behaviour is not self.master
        batch = self.rollout(step, plan, policy=behaviour)
        timings[TIMING_ROLLOUT] = time.perf_counter() - t0
        timings.update(batch.timings)  # the engine's own stages (an outside engine's weight sync)
        if not all(torch.isfinite(lp).all() for lp in batch.logprobs):
            raise RunStopped(f"non-finite rollout log-probs (logits) at step {step}")

        scored = self.scorer.before_update(self.compute, batch, self._reference() if alg.kl_coef > 0 else None,
                                           self._weights_in(self.compute_dtype, behaviour) if lagged else None, step)
        timings.update(scored.timings)

        t2 = time.perf_counter()
        advantages = compute_advantages(batch.rewards, cfg.rollout.samples_per_prompt, alg.advantage,
                                        alg.std_normalize, alg)
        lr = self.schedule.lr(step)
        update, first_pass_logp = self._update(step, batch, advantages, scored.anchors,
                                               self.objective.expects_exact(plan, lagged), lr)
        timings[TIMING_UPDATE] = time.perf_counter() - t2
        timings[TIMING_GRAD_REDUCE] = update.grad_reduce_seconds

        metrics = step_metrics(step, batch, scored, first_pass_logp, update, lr=lr, injected=injected,
                               policy_lag=cfg.rollout.policy_lag, correction=cfg.correction)
        timings[TIMING_STEP] = time.perf_counter() - t0
        metrics.update(timings)
        return metrics

    def _update(self, step: int, batch: RolloutBatch, advantages: Tensor, anchors: Anchors, expect_exact: bool,
                lr: float) -> tuple[UpdateRecord, list[Tensor]]:
        """PPO epochs over mini-batches; returns each mini-batch's stats (reduced to the step's by the metrics
        stage, ``step_metrics``) and each sequence's first-pass log-probs."""
        alg = self.cfg.algorithm
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = len(batch.responses)
        per_mini = n // alg.mini_batches
        record = UpdateRecord(stats=[], counts=[], corrections=[], grad_reduce_seconds=0.0)
        first_pass_logp: list[Tensor | None] = [None] * n
        reduce_seconds = 0.0
        for epoch in range(alg.ppo_epochs):
            gen = torch.Generator().manual_seed(_step_seed(self.cfg.seed, step) * 31 + epoch)
            order = torch.randperm(n, generator=gen).tolist() if alg.mini_batches > 1 else list(range(n))
            for mb in range(alg.mini_batches):
                idx = order[mb * per_mini : (mb + 1) * per_mini]
                # The first mini-batch's ratio is checked before any update changed the weights.
                part, leaf_grads, used = self._minibatch_gradients(batch, idx, advantages, anchors,
                                                                   check_exact=expect_exact and epoch == 0 and mb == 0)
                for i, lp in zip(idx, part.logprobs):
                    if first_pass_logp[i] is None:
                        first_pass_logp[i] = lp
                t = time.perf_counter()
                gradient = self.ranks.sum_gradients(leaf_grads)
                reduce_seconds += time.perf_counter() - t
                part.stats[GRAD_NORM] = self._apply_gradients(gradient, used)
                record.stats.append(part.stats)
                record.counts.append(part.counts)
                if epoch == 0 and part.correction is not None:  # the first epoch's: each sequence once
                    record.corrections.append((idx, part.correction))
        record.grad_reduce_seconds = reduce_seconds
        return record, first_pass_logp

    def _minibatch_gradients(self, batch: RolloutBatch, idx: list[int], advantages: Tensor, anchors: Anchors,
                             check_exact: bool) -> tuple[MinibatchLoss, list[Tensor], list[bool]]:
        """The mini-batch's loss stats, this rank's leaf gradients (flat fp32, in leaf order) and which
        parameters have a gradient.

        The mini-batch is cut into ``distributed.leaves`` equal leaves, and each leaf into units of
        ``algorithm.grad_unit`` sequences (unset: one unit, the leaf, forwarded in micro-batches). This rank runs
        the forward of its leaves' units; the detached log-probs of all units are gathered, so the loss (and its
        stats) is evaluated on the whole mini-batch, with this rank's log-probs carrying grad. Its gradient with
        respect to them is elementwise up to their concatenation, so a unit's share is the same bits whichever
        other units carry grad (on this rank or another); each unit's backward from its share is the unit's
        gradient, and a leaf's gradient is the fixed-tree sum (``tree_sum``) of its units'. With ``grad_unit`` set,
        no bit depends on the micro-batching; unset, the bits are those of one backward per leaf."""
        size = len(idx) // self.cfg.distributed.leaves
        unit = self.objective.unit_size(size)
        units = [[slice(start, start + unit) for start in range(k * size, (k + 1) * size, unit)]
                 for k in self._my_leaves]
        positions = [u for leaf in units for u in leaf]  # of this rank's units in ``idx``, in order
        checkpointed = self.cfg.algorithm.activation_checkpointing

        def forward(u: slice) -> tuple[list[Tensor], list[Tensor]]:
            return self.objective.policy_forward(self.compute, batch, idx[u], self.objective.gradient_micro_batch)

        if checkpointed:  # no graph kept: the loss's inputs become leaves, each unit forwards again in its backward
            with torch.no_grad():
                values = [forward(u) for u in positions]
            forwards = [([t.requires_grad_(True) for t in lp], [t.requires_grad_(True) for t in ent])
                        for lp, ent in values]
        else:
            forwards = [forward(u) for u in positions]
        gathered = self.ranks.gather([([t.detach() for t in lp], [t.detach() for t in ent]) for lp, ent in forwards])
        logp_list = [t for lp, _ in gathered for t in lp]
        entropy_list = [t for _, ent in gathered for t in ent]
        for u, (logp, entropy) in zip(positions, forwards):
            logp_list[u], entropy_list[u] = logp, entropy
        part = self.objective.loss_of(batch, idx, logp_list, entropy_list, advantages, anchors, check_exact)
        outputs = [[t for t in (*logp, *entropy) if t.requires_grad] for logp, entropy in forwards]
        upstream = iter(torch.autograd.grad(part.loss, [t for out in outputs for t in out], allow_unused=True))
        shares = [[next(upstream) for _ in out] for out in outputs]  # None: an output the loss does not use
        params = list(self.compute.parameters())
        experts = [".experts." in name for name, _ in self.compute.named_parameters()]
        used: list[bool] = []

        def unit_gradient(u: int) -> Tensor:
            """Unit ``u``'s backward from its share: flat fp32 over the parameters that have a gradient. An MoE
            expert no token of the unit was routed to has none here but may in another unit (or on another rank):
            its gradient is zeros, so every unit's flat layout is the same (a dense model uses every parameter in
            every unit, so its layout and bits are unchanged)."""
            nonlocal used
            sources = outputs[u]  # what the loss's gradient (``shares``) flows into
            if checkpointed:  # the unit's graph, made now: its outputs must be the loss's leaves, bit for bit
                logp, entropy = forward(positions[u])
                sources = [t for t in (*logp, *entropy) if t.requires_grad]
                if len(sources) != len(outputs[u]) or not all(torch.equal(a.detach(), b.detach())
                                                              for a, b in zip(sources, outputs[u])):
                    raise RunStopped("exactness violated: with algorithm.activation_checkpointing, a unit's second "
                                     "forward differs from its first, so its gradient would not be the loss's")
            roots = [(t, g) for t, g in zip(sources, shares[u]) if g is not None]
            grads = torch.autograd.grad([t for t, _ in roots], params, [g for _, g in roots], allow_unused=True)
            grads = [torch.zeros_like(p) if g is None and expert else g for g, p, expert in zip(grads, params, experts)]
            used = [g is not None for g in grads]
            return torch.cat([g.float().reshape(-1) for g in grads if g is not None])

        counts = [len(leaf) for leaf in units]
        firsts = [sum(counts[:k]) for k in range(len(counts))]
        leaf_grads = [_tree_sum_of(n, unit_gradient, first) for n, first in zip(counts, firsts)]
        return part, leaf_grads, used

    def _apply_gradients(self, gradient: Tensor, used: list[bool]) -> float:
        """The summed flat gradient onto the fp32 master, clip, AdamW step, refresh the compute copy; the norm."""
        self.master.zero_grad(set_to_none=True)
        max_norm = self.cfg.optimizer.grad_clip if self.cfg.optimizer.grad_clip is not None else math.inf
        grad_norm = clip_flat_gradient_(gradient, max_norm)  # thread-invariant (vexact.rl.optim)
        if not math.isfinite(grad_norm):
            raise RunStopped(f"non-finite gradient norm ({grad_norm})")
        offset = 0
        for param, has_grad in zip(self.master.parameters(), used):
            if has_grad:
                param.grad = gradient[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
        self.optimizer.step()
        self._copy_master_to_compute()
        return grad_norm

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict:
        """Clean evaluation of the policy itself: fixed held-out prompts, training path, no injection (each rank
        evaluates its share of the prompts). Non-finite log-probs stop the run, as a rollout's do in ``step``: after
        a run's last update no rollout follows that would catch them."""
        mine = self.ranks.block(len(self.eval_problems))
        # fewer held-out problems than ranks: a rank without one evaluates nothing and still joins the gather
        records = eval_records(self.compute, self.task, self.tokenizer, self.eval_problems[mine.start : mine.stop],
                               self.cfg.rollout, _step_seed(self.cfg.seed, 10**9 + step),
                               first_index=mine.start) if mine else []
        records = self.ranks.gather(records)  # every rank judges all of them, so all stop together
        if not all(r.finite for r in records):
            raise RunStopped(f"non-finite eval log-probs (logits) at step {step}")
        return eval_metrics(records)

    # ------------------------------------------------------------------ the run
    def run(self, resume: bool = False, allow_changes: tuple[str, ...] = ()) -> dict:
        """Run (or resume) the experiment; returns the summary also written to summary.json.

        The run directory is locked for the whole call (a second process gets ``RunLocked``). ``resume``: continue
        from the newest intact checkpoint, with the config the run was started with -- a different config is
        refused with the changed keys, unless each is in ``allow_changes`` and in ``RESUME_SAFE_KEYS``; allowed
        changes are recorded in config_changes.jsonl. Resuming a finished run does nothing (and says so) unless
        ``steps`` grew: then it is extended. With several ranks, rank 0 holds the lock and writes; every rank
        returns rank 0's summary.

        A log backend (a live view: ``logging.backends``) that fails to close does not cost the run its end: every
        view is closed and summary.json written first, and then its failure is raised (a ``PluginCodeError`` naming
        the backend: the CLI's one error line and exit code 2, bad input, as for any plugin's error), since a view
        the config asked for may have lost its last steps. After an interrupt the failure is only printed: the exit
        code stays the interrupt's, which a job scheduler acts on. So with the rollout engine's ``close``: its failure
        (a ``PluginCodeError`` naming the engine) is raised after a run that ended otherwise, and only printed (one
        stderr line) after an interrupt, or while another error is on its way out."""
        self._view_failure = None
        summary = None
        try:
            if not self.ranks.is_main:
                summary = self._run(resume, tuple(allow_changes))
            else:
                with discard_if_interrupted_early(self.run_dir, log=self._log), run_lock(self.run_dir):
                    summary = self._run(resume, tuple(allow_changes))
        finally:
            try:
                self.close()
            except PluginCodeError as failure:
                if summary is not None and summary["status"] != "interrupted":
                    raise
                print_error_line(str(failure))  # not raised over the interrupt (its exit code) or the error
        # said only now: an interrupt before any step finished removed the directory (and said so), and then
        # there is nothing to resume
        if summary["status"] == "interrupted" and holds_run(self.run_dir):
            self._log("[yellow]interrupted[/] -- finished steps are in metrics.jsonl; continue with --resume")
        if self._view_failure is not None:
            failure, self._view_failure = self._view_failure, None
            if summary["status"] != "interrupted":
                raise failure
            self._log(f"[red]error:[/] {failure}")
        return summary

    def _run(self, resume: bool, allow_changes: tuple[str, ...]) -> dict:
        """The run in three stages: prepare (resume or warm start, calibration), the step loop, and the end (the
        summary, agreed by every rank)."""
        prepared = self._prepare(resume, allow_changes)
        if isinstance(prepared, dict):  # a finished run, resumed with nothing to add: its summary
            return prepared
        start, changes = prepared
        summary, step, started, last = self._loop(start, changes)
        return self._end(summary, step, started, last)

    def _prepare(self, resume: bool, allow_changes: tuple[str, ...]) -> tuple[int, dict] | dict:
        """Everything before the first step: check (or resume) the run directory, warm start or restore the
        checkpoint, calibrate the injector, build the KL reference. Returns the step to start from and the allowed
        config changes of a resume (recorded by ``_loop`` once the run's logs have opened), or -- when resuming a
        finished run that ``steps`` does not extend -- its summary (nothing to do)."""
        cfg = self.cfg
        run_dir = self.run_dir
        start_step = 0
        state = None
        changes: dict = {}
        self._retracted_eval = None
        if resume:
            changes = self._resume_changes(allow_changes)
            _check_steps_change(cfg, changes)
            state = load_checkpoint(run_dir, self.master, self.optimizer, log=self._log)
            finished = _read_summary(run_dir)
            if finished is not None and isinstance(finished.get("steps_completed"), int):
                # its log is final: a torn or short one is damage (else "nothing to do", and a report without the
                # steps lost)
                metrics_path = run_dir / METRICS_FILE
                check_finished(metrics_path, len(read_metrics(metrics_path)), finished["steps_completed"])
            # a run that stopped itself is finished even without a checkpoint (it stopped before the first one)
            if finished is not None and (_ended_itself(finished) or state is not None
                                         and not _extends(finished, state, cfg)):
                why = f": {finished['reason']}" if finished.get("reason") else ""
                steps = finished.get("steps_completed", "?")
                self._log(f"{run_dir} already finished ({finished['status']} after {steps} steps{why}); nothing to do. "
                          "To extend a completed run: --set steps=N --allow-change steps")
                return finished
            if finished is not None and state is not None:  # a completed run, extended (maybe resumed again)
                self._retracted_eval = _off_schedule_final_eval(finished["steps_completed"] - 1, cfg, changes)
            if state is not None:
                _check_resumed_steps(cfg.steps, state["next_step"], "steps" in changes)
                _check_resumed_kernel_bits(run_dir, state, self._kernel_bits())
            if state is None:
                self._log(f"[yellow]no checkpoint in {run_dir}; starting from scratch[/]")
        elif holds_results(run_dir):
            raise ValueError(f"{run_dir} already holds a run; continue it with vexact run {run_dir} --resume, or "
                             "choose another output_dir / name")
        self.ranks.barrier()  # every rank has read the run directory before rank 0 writes to it
        if state is None:
            # rank 0 trains and caches the warm start; then the other ranks load it from the cache
            if self.ranks.is_main:
                warm_start(self.master, cfg, self.task, log=self._log)
                if not changes:  # a resume's allowed changes: written by _loop once the logs opened with them
                    save_config(cfg, run_dir / CONFIG_FILE)
            self.ranks.barrier()
            if not self.ranks.is_main:
                warm_start(self.master, cfg, self.task, log=self._log)
        else:
            start_step = state["next_step"]
            self.schedule.load_state_dict(state.get("schedule", {}))
            if self._retracted_eval == start_step - 1:  # the shorter run's own last checkpoint (a later one, of an
                # extension killed since, holds the state already taken back)
                row = read_metrics(run_dir / METRICS_FILE)[start_step - 1] if self.ranks.is_main else {}
                self.schedule.retract(start_step - 1, self.ranks.broadcast(row), _is_eval_key)
            if cfg.rollout.policy_lag:
                if "snapshots" not in state and start_step > 0:
                    raise ValueError(f"cannot resume {run_dir} with rollout.policy_lag {cfg.rollout.policy_lag}: its "
                                     "checkpoint holds no policy-lag weight snapshots (snapshots.safetensors)")
                self._restore_snapshots(state.get("snapshots", {}))
            self._log(f"resuming {run_dir} at step {start_step}")
        self._copy_master_to_compute()
        self._calibrate(state)
        if cfg.algorithm.kl_coef > 0:
            self.reference = self._reference_from_start(run_dir)
        return start_step, changes

    def _loop(self, start_step: int, changes: dict) -> tuple[dict, int, float, dict]:
        """The steps from ``start_step``: step, evaluate, LR schedule, log, collapse stop, checkpoint. Returns the
        summary so far (its status: how the loop ended), the last step reached, the start time and the last
        step's metrics. Ctrl-C, a stopped run and a confirmed collapse end the loop here, as an outcome."""
        cfg, run_dir = self.cfg, self.run_dir
        writer = (MetricsWriter(run_dir / METRICS_FILE, keep_steps_below=start_step,
                                live_views=live_views(run_dir, cfg), amend=_without_eval_at(self._retracted_eval))
                  if self.ranks.is_main else _NoWriter())
        if changes and self.ranks.is_main:  # a resume's allowed changes, kept once its logs opened with them (a
            _record_changes(run_dir, start_step, changes)  # refused W&B project leaves config.yaml as it was)
            save_config(cfg, run_dir / CONFIG_FILE)
        summary = {"name": cfg.name, "status": "running", "reason": None, "steps_planned": cfg.steps}
        started = time.perf_counter()
        last = {}
        step = start_step
        try:
            with _progress(self.console, cfg, start_step) as progress:
                if self._stopped_on_collapse_at(start_step - 1):  # before its summary.json was written
                    step = start_step - 1
                    raise CollapseConfirmed(step)
                for step in range(start_step, cfg.steps):
                    metrics = self.step(step)
                    if step % cfg.logging.eval_every == 0 or step == cfg.steps - 1:
                        t = time.perf_counter()
                        try:
                            metrics.update(self.evaluate(step))
                        except RunStopped:
                            # the step's training numbers (the update that broke the logits) are recorded as on
                            # a step without evaluation, whose blow-up the next rollout finds; no eval keys
                            writer.write(metrics)
                            last = metrics
                            raise
                        metrics[TIMING_EVAL] = time.perf_counter() - t
                    metrics.update(self.schedule.observe(step, metrics))
                    if self.schedule.trigger_step == step:
                        self._log(f"[yellow]LR decay triggered at step {step}:[/] {self.schedule.trigger_reason}; "
                                  f"halving every {self.schedule.decay_period} steps")
                    writer.write(metrics)
                    last = metrics
                    progress(step, metrics)
                    if cfg.collapse.stop_on_collapse and EVAL_REWARD_MEAN in metrics and self._collapse_confirmed():
                        self._save_checkpoint(step)
                        raise CollapseConfirmed(step)
                    if (step + 1) % cfg.logging.checkpoint_every == 0 or step == cfg.steps - 1:
                        self._save_checkpoint(step)
            summary["status"] = "completed"
        except CollapseConfirmed:
            summary["status"] = "completed"
            summary["reason"] = f"collapse confirmed at step {step}; stopped early (collapse.stop_on_collapse)"
        except RunStopped as stop:
            summary["status"] = "stopped"
            summary["reason"] = str(stop)
            self._log(f"[red]run stopped at step {step}:[/] {stop}")
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (cli_base.Terminated): recorded, for the exit code
            summary["status"] = "interrupted"
            summary["signal"] = stop_signal(stop).name
            summary["reason"] = f"interrupted by {summary['signal']} during step {step}; resume with --resume"
        finally:
            try:
                writer.close()
            except PluginCodeError as failure:  # a live view's: the run still writes its end (run raises it after)
                self._view_failure = failure
        return summary, step, started, last

    def _collapse_confirmed(self) -> bool:
        """Whether the log so far confirms a collapse (rank 0 reads it; every rank gets the answer)."""
        collapsed = self.ranks.is_main and detect_collapse(read_metrics(self.run_dir / METRICS_FILE),
                                                           self.cfg.collapse)["collapsed"]
        return self.ranks.broadcast(collapsed)

    def _stopped_on_collapse_at(self, step: int) -> bool:
        """Resuming at ``step + 1``: whether the run stopped on a collapse at ``step`` -- the check the loop made
        there, made again on the same log (a kill after the stop's checkpoint and before its summary would else
        train on past the collapse)."""
        if step < 0 or not self.cfg.collapse.stop_on_collapse:
            return False
        rows = read_metrics(self.run_dir / METRICS_FILE) if self.ranks.is_main else []
        evaluated = bool(rows) and EVAL_REWARD_MEAN in rows[-1]  # the loop checks at evaluated steps only
        return self.ranks.broadcast(evaluated) and self._collapse_confirmed()

    def _end(self, summary: dict, step: int, started: float, last: dict) -> dict:
        """Rank 0 completes and writes the summary (``_finish``) and every rank returns it. After Ctrl-C the ranks
        stop at different points, so no collective may follow: each returns its own."""
        interrupted = summary["status"] == "interrupted"
        if not self.ranks.is_main:
            return summary if interrupted else self.ranks.broadcast(None)
        summary = self._finish(summary, step, started, last)
        return summary if interrupted else self.ranks.broadcast(summary)

    def _finish(self, summary: dict, step: int, started: float, last: dict) -> dict:
        """Complete the summary from metrics.jsonl and write summary.json (rank 0)."""
        cfg, run_dir = self.cfg, self.run_dir
        history = read_metrics(run_dir / METRICS_FILE)
        if not last and history:  # no step ran in this session (resumed at its final checkpoint): the log's last
            last = history[-1]    # step, so that the summary is the uninterrupted run's
        summary.update(_summarize(history))
        summary["collapse"] = detect_collapse(history, cfg.collapse,
                                              stopped_reason=summary["reason"] if summary["status"] == "stopped"
                                              else None, stopped_step=step)
        summary["stopped_at_step"] = step if summary["status"] != "completed" else None
        summary["wall_seconds_this_session"] = round(time.perf_counter() - started, 3)
        summary["lr_schedule"] = self.schedule.summary()
        summary["host_cpu"] = host_cpu()  # which kind of host the bits came from (hosts of one kind differ)
        summary.update(_provenance(cfg))
        summary["last_step_metrics"] = {k: v for k, v in last.items() if not k.startswith("timing/")}
        if self.injector.enabled:
            summary["inject"] = {"mode": cfg.inject.mode, "value": self.injector.value}
            if self.calibration is not None:
                summary["inject"].update(calibrated_value=self.calibration.value,
                                         calibration_metric=cfg.inject.target.metric,
                                         calibration_target=self.calibration.target,
                                         calibration_achieved=self.calibration.achieved,
                                         calibration_evaluations=len(self.calibration.evaluations))
        write_json_atomic(run_dir / SUMMARY_FILE, summary)
        return summary

    def _resume_changes(self, allow_changes: tuple[str, ...]) -> dict[str, list]:
        """Keys whose value differs from the config the run was started with: {key: [old, new]}.

        Raises ValueError naming them unless every one is allowed (``allow_changes``) and safe."""
        unsafe = [k for k in allow_changes if k not in RESUME_SAFE_KEYS]
        if unsafe:
            raise ValueError(f"--allow-change {', '.join(unsafe)}: only {', '.join(RESUME_SAFE_KEYS)} may change on "
                             "resume (the others change what a step computes)")
        saved_path = self.run_dir / CONFIG_FILE
        if not saved_path.exists():
            if checkpoint_dirs(self.run_dir):
                raise ValueError(f"cannot resume {self.run_dir}: {saved_path} is missing, so the config the run was "
                                 "started with cannot be checked; restore it or start a new run")
            return {}
        changes = config_changes(saved_path, self.cfg)
        refused = {k: v for k, v in changes.items() if k not in allow_changes}
        if refused:
            diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
            hint = (f" (to allow: --allow-change {' --allow-change '.join(refused)})"
                    if all(k in RESUME_SAFE_KEYS for k in refused) else "")
            raise ValueError(f"cannot resume {self.run_dir} with a different config: {diff}; it was started with "
                             f"{saved_path}{hint}")
        return changes

    def _save_checkpoint(self, step: int) -> None:
        """Everything a resume needs after ``step``: weights, optimizer, LR-schedule state, the injector's knob and
        its calibration record (``inject.target``: for the resumed run's summary). Rank 0 writes it (every rank
        holds the same state)."""
        if not self.ranks.is_main:
            return
        state = {"next_step": step + 1, "schedule": self.schedule.state_dict(), "inject_value": self.injector.value,
                 "kernel_bits": self._kernel_bits()}
        if self.calibration is not None:
            state["calibration"] = dataclasses.asdict(self.calibration)
        save_checkpoint(self.run_dir, self.master, self.optimizer, state,
                        snapshots=self._snapshot_tensors() if self.cfg.rollout.policy_lag else None)

    def _kernel_bits(self) -> dict[str, str]:
        """The kernel settings this process computes other bits under (``vexact_kernels.bit_settings``; {} for the
        defaults): a checkpoint records them, and a resume under others is refused."""
        return vexact_kernels.bit_settings(self.cfg.backend, device_kind(self.cfg.device))

    def _calibrate(self, state: dict | None) -> None:
        """Set the injector's knob from ``inject.target`` (restored from the checkpoint on resume)."""
        target = self.cfg.inject.target
        if target is None:
            return
        if state is not None and "inject_value" in state:
            self.injector.value = state["inject_value"]
            # a checkpoint written before the record was kept has none: the summary then gives the knob alone
            self.calibration = _restored_calibration(state.get("calibration"))
            return
        c = self.cfg.inject
        problems = training_problems(self.task, c.calibration_prompts, self.cfg.seed + CALIBRATION_SEED_OFFSET, 0)
        key = target.metric  # a full metric key of mismatch_metrics

        def measure(value: float) -> float:
            # the source's mismatch, before any remedy: without router replay, which would remove a routing flip's
            batch = self.rollout(0, self.injector.plan_for_value(value, step=0), problems)
            return mismatch_metrics(self.scorer(self.compute, batch, replay=False), batch.logprobs)[key]

        self.calibration = calibrate(measure, c.mode, target.value, c.calibration_tolerance,
                                     sign=-1.0 if c.value < 0 else 1.0, vocab_size=self.tokenizer.vocab_size)
        if not self.calibration.reached:
            tried = len(self.calibration.evaluations)
            raise ValueError(f"inject.target: mode {c.mode!r} does not reach {target.metric} = {target.value:g} "
                             f"within inject.calibration_tolerance {c.calibration_tolerance:g} on this run's "
                             f"calibration batch: the closest of {tried} knobs tried, inject.{knob_key(c.mode)} = "
                             f"{self.calibration.value:.6g}, gave {self.calibration.achieved:.4g}; choose a target "
                             "the mode can reach, or set the knob itself")
        self.injector.value = self.calibration.value
        self._log(f"calibrated inject.{knob_key(self.cfg.inject.mode)} = {self.calibration.value:.6g} for "
                  f"{target.metric} = {self.calibration.achieved:.4g} (target {target.value:g}, "
                  f"{len(self.calibration.evaluations)} calibration batches)")

    def _reference_from_start(self, run_dir: Path) -> Transformer:
        """The KL reference is the policy at step 0 (warm start), rebuilt identically on resume."""
        start = Transformer(self.model_config, backend=self.cfg.backend, dtype=torch.float32, device=self.device,
                            init_seed=self.cfg.policy_seed)
        warm_start(start, self.cfg, self.task, log=lambda _: None)
        return self._copy_of(start, self.compute_dtype)


SMALL_MODEL_WIDTH = 512  # hidden sizes below this run on 1 thread unless ``threads`` says otherwise
_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before any run in this process changed it


def default_threads(cfg: RunConfig) -> int:
    """Torch threads for a run whose config leaves ``threads`` unset: 1 for the small RL testbeds (hidden size below
    ``SMALL_MODEL_WIDTH``), else torch's own default (the machine's cores).

    Why: the testbeds' ops are tiny (a 64-wide model's GEMMs take microseconds), so a second thread buys little and
    OpenMP's spin-waits between ops burn a core (measured on a loaded 2-core host: 6-9x the CPU per step at 2
    threads). With the exact backend this choice changes no bit (forward, backward and update are thread-count
    invariant), so it is purely a matter of speed and of leaving cores to other runs."""
    return 1 if cfg.model.hidden_size < SMALL_MODEL_WIDTH else _TORCH_DEFAULT_THREADS


RESUME_SAFE_KEYS = ("steps", "threads", "logging.live", "logging.eval_every", "logging.checkpoint_every",
                    "logging.backends", "logging.wandb_project", "logging.wandb_mode", *MEMORY_KEYS)
"""Config keys ``--resume --allow-change KEY`` may change: none of them changes a step's numbers; ``steps`` extends
or shortens the run (refused where the LR schedule spans the run's steps: ``steps_change_problem``). ``threads`` is
one since the exact backward and the update are thread-count invariant too (``tests/kernels/test_backward_threads.py``
runs a whole run at 1 and 2 threads). With the ``native`` backend it still changes bits, as native's results depend
on the batch and thread count anyway."""


class _NoWriter:
    """The metrics writer of ranks other than 0: rank 0 writes metrics.jsonl."""

    def write(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _read_summary(run_dir: Path) -> dict | None:
    """The run's summary.json when it says the run finished (completed or stopped), else None."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) and summary.get("status") in FINISHED_STATUSES else None


def _ended_itself(finished: dict) -> bool:
    """Whether a finished run ended before its last step on its own account (stopped, or a collapse stop)."""
    return finished["status"] == "stopped" or "stop_on_collapse" in (finished.get("reason") or "")


def _extends(finished: dict, state: dict, cfg: RunConfig) -> bool:
    """Whether resuming a finished run continues it: it completed all its steps and ``steps`` has grown since."""
    return not _ended_itself(finished) and state["next_step"] < cfg.steps


def _off_schedule_final_eval(last_step: int, cfg: RunConfig, changes: dict) -> int | None:
    """A completed run extended after ``last_step``: ``last_step`` when the run evaluated it only for being its last
    (off the ``logging.eval_every`` it ran under), else None. A run of the new length from the start makes no such
    evaluation, so the extension takes it back (``_without_eval_at``, ``LRSchedule.retract``) to log the same rows."""
    every = changes.get("logging.eval_every", [cfg.logging.eval_every])[0]
    return last_step if last_step % every else None


def _is_eval_key(key: str) -> bool:
    """A key a step's evaluation adds to its metrics (``Trainer.evaluate``'s ``eval/*`` and its timing)."""
    return key.startswith("eval/") or key == TIMING_EVAL


def _without_eval_at(step: int | None) -> Callable[[dict], dict] | None:
    """For ``MetricsWriter(amend=...)``: the row of ``step`` without its evaluation's keys (None: no row changes)."""
    if step is None:
        return None
    return lambda row: ({k: v for k, v in row.items() if not _is_eval_key(k)} if row.get("step") == step else row)


def _restored_calibration(record: object) -> Calibration | None:
    """The ``Calibration`` a checkpoint's state holds (``_save_checkpoint``), or None where it holds none."""
    if not isinstance(record, dict):
        return None
    record = decode_non_finite(record)  # json_safe wrote a non-finite metric as a string: a float again
    return Calibration(value=record["value"], achieved=record["achieved"], target=record["target"],
                       evaluations=[tuple(pair) for pair in record["evaluations"]],
                       tolerance=record.get("tolerance", 0.0))


def _check_resumed_steps(steps: int, next_step: int, steps_changed: bool) -> None:
    """Refuse ``steps`` that end a resumed run at or before its checkpoint: no step would run, and the run would end
    "completed" with more steps than planned, or (steps equal to the checkpoint's next step) without the evaluation
    of its final step. Unchanged steps equal to it are a run killed after its final checkpoint: its summary is all
    that is left to write."""
    if steps < next_step or steps == next_step and steps_changed:
        raise ConfigError(f"{steps} ends the run at or before its checkpoint (after step {next_step - 1}; the run "
                          f"resumes at step {next_step}): give steps of at least {next_step + 1}", "steps")


def _check_steps_change(cfg: RunConfig, changes: dict) -> None:
    """Refuse a resume that changes ``steps`` of a run whose LR schedule spans its steps (``steps_change_problem``):
    the run would match no run from the start."""
    problem = "steps" in changes and steps_change_problem(cfg.lr_schedule, *changes["steps"])
    if problem:
        raise ConfigError(f"{problem}; start a new run with steps {changes['steps'][1]} (or set "
                          "lr_schedule.total_steps from the start)", "steps")


def _record_changes(run_dir: Path, step: int, changes: dict) -> None:
    with open(run_dir / "config_changes.jsonl", "a") as f:
        f.write(json.dumps({"resumed_at_step": step, "changes": changes}, sort_keys=True) + "\n")


def _tree_sum_of(count: int, part: Callable[[int], Tensor], start: int = 0) -> Tensor:
    """``tree_sum([part(i) for i in range(start, start + count)])``, the same additions in the same order, with the
    parts made one at a time (left to right) so that at most one per tree level is held, not ``count``."""
    if count == 1:
        return part(start)
    mid = count // 2
    return _tree_sum_of(mid, part, start) + _tree_sum_of(count - mid, part, start + mid)


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) & 0x7FFFFFFFFFFF


def _summarize(history: list[dict]) -> dict:
    """The clean-eval curve ends and run-wide numbers, from the metrics written so far. The reward at start/end
    (of the judged metric, ``collapse.metric``) and the mean k3 KL are the collapse summary's
    (``collapse.initial_reward`` / ``final_reward`` / ``mean_k3_kl``: one definition, ``collapse.detect_collapse``)."""
    if not history:
        return {"steps_completed": 0}
    evals = [m for m in history if EVAL_REWARD_MEAN in m]
    out = {
        "steps_completed": len(history),
        "mean_step_seconds": sum(m.get(TIMING_STEP, 0.0) for m in history) / len(history),
    }
    measured = [m[BITWISE_EQUAL_FRAC] for m in history if BITWISE_EQUAL_FRAC in m]  # monitor.every skips some
    if measured:
        out["min_bitwise_equal_frac"] = min(measured)
    if evals:
        out["eval_reward_first"] = evals[0][EVAL_REWARD_MEAN]
        out["eval_reward_last"] = evals[-1][EVAL_REWARD_MEAN]
        out["eval_greedy_accuracy_first"] = evals[0][EVAL_GREEDY_ACCURACY]
        out["eval_greedy_accuracy_last"] = evals[-1][EVAL_GREEDY_ACCURACY]
        out["eval_reward_peak"] = max(m[EVAL_REWARD_MEAN] for m in evals)
    return out


class _progress:
    """Rich progress bar with ETA and the numbers that matter, or a plain line per step."""

    def __init__(self, console: Console, cfg: RunConfig, start_step: int):
        self.console, self.cfg, self.start = console, cfg, start_step
        self.live = cfg.logging.live and console.is_terminal

    def __enter__(self):
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                                "{task.total}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                TextColumn("{task.fields[info]}"), console=self.console)
            self.bar.__enter__()
            self.task_id = self.bar.add_task(self.cfg.name, total=self.cfg.steps, completed=self.start, info="")
        return self._update

    def _update(self, step: int, m: dict) -> None:
        info = f"reward {m[REWARD_MEAN]:.3f}  len {m[RESPONSE_LENGTH_MEAN]:.1f}"
        if K3_KL in m:  # a step monitor.every skips has no mismatch metric
            info += f"  k3 {m[K3_KL]:.2e}  bitwise {m[BITWISE_EQUAL_FRAC]:.3f}"
        if EVAL_REWARD_MEAN in m:
            info += f"  eval {m[EVAL_REWARD_MEAN]:.3f}"
        if self.live:
            self.bar.update(self.task_id, completed=step + 1, info=info)
        elif step % 10 == 0 or step == self.cfg.steps - 1 or EVAL_REWARD_MEAN in m:
            self.console.print(f"step {step + 1}/{self.cfg.steps}  {info}  ({m[TIMING_STEP]:.2f}s)")

    def __exit__(self, *exc):
        if self.live:
            self.bar.__exit__(*exc)
        return False


def _provenance(cfg: RunConfig) -> dict[str, Any]:
    """What besides the config and the host gives a run its bits, for ``summary.json``: the versions, the kernels'
    process settings (``vexact_kernels.kernel_settings``: the environment variables a rerun must repeat) and the
    warm-start key the run started from (None without a warm start)."""
    return {"versions": {"vexact": __version__, "torch": torch.__version__},
            "kernel_settings": vexact_kernels.kernel_settings(),
            "warm_start_key": warm_start_key(cfg) if cfg.warm_start.steps else None}


def _check_resumed_kernel_bits(run_dir: Path, state: dict, now: dict[str, str]) -> None:
    """A ValueError unless this process computes with the kernel settings the checkpoint's steps were computed with
    (``kernel_bits``: ``VEXACT_CPU_EXACT_PATH=fixed-order``, ``VEXACT_CPU_ONEDNN=off``): resumed under others, the run
    would continue with other bits than either setting's uninterrupted run, and its record would name only the
    last. A checkpoint from before they were recorded is taken as it is."""
    if "kernel_bits" not in state or state["kernel_bits"] == now:
        return
    def spell(settings: dict[str, str]) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "the defaults (none of them set)"
    raise ValueError(f"cannot resume {run_dir} under other kernel settings: its steps were computed with "
                     f"{spell(state['kernel_bits'])}, this process has {spell(now)}; resume it with the same "
                     "environment variables, which give other bits (vexact_kernels.bit_settings)")
