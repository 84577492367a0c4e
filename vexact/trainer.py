"""The RL loop: config -> rollout -> scoring -> metrics -> loss -> update -> logs.

One step of ``Trainer.step``:
1. sample ``prompts_per_step`` problems and roll out ``samples_per_prompt`` responses each
   (rollout path: KV-cache ``generate``, log-probs recorded while sampling);
2. score them: rewards from the task's verifier, group advantages, old log-probs from the
   rollout or recomputed by the training path;
3. mismatch metrics between the rollout log-probs and the training path's log-probs of the
   same tokens under the same weights;
4. PPO epochs over mini-batches: training-path log-probs with grad, clipped surrogate,
   AdamW step (fp32 master weights);
5. one JSON line in metrics.jsonl; periodic clean evaluation and checkpoints.
Everything random is keyed by (seed, step), so the same config gives bit-identical metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

import vexact_kernels

from .collapse import detect_collapse
from .config import RunConfig, save_config
from .corrections import rollout_correction
from .inject import Calibration, Injector, RolloutPlan, calibrate, precision_ops
from .loss import aggregate, compute_advantages, k3_penalty, ppo_token_loss
from .metrics import mismatch_metrics, ratio_stats, sequence_stats
from .model import ModelConfig, Transformer, resolve_dtype
from .rollout import generate
from .runlog import MetricsWriter, load_checkpoint, read_metrics, save_checkpoint, write_json_atomic
from .schedules import LRSchedule
from .scoring import score_tokens
from .tasks import (
    EOS_ID,
    CharTokenizer,
    Problem,
    encode_prompt,
    held_out_problems,
    make_task,
    max_answer_tokens,
    max_prompt_tokens,
    training_problems,
)
from .warmstart import warm_start

CALIBRATION_SEED_OFFSET = 2_000_003  # calibration prompts are not training prompts


class RunStopped(Exception):
    """A clean, recorded end of a run (non-finite values, exactness violation)."""


class CollapseConfirmed(Exception):
    """Collapse confirmed and ``collapse.stop_on_collapse`` set: end the run early."""


@dataclass
class Rollouts:
    problems: list[Problem]
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[Tensor]  # as recorded by the rollout path
    finished: list[bool]
    rewards: Tensor


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir) if cfg.output_dir else Path("runs") / cfg.name


class Trainer:
    """Owns the policy, optimizer and run directory of one experiment."""

    def __init__(self, cfg: RunConfig, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = run_dir_for(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer = CharTokenizer()
        self.task = make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len, cfg.task.partial_credit)
        self._check_lengths()
        m = cfg.model
        self.model_config = ModelConfig(
            vocab_size=self.tokenizer.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
            max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
            tie_embeddings=m.tie_embeddings, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm)
        # fp32 master weights; a bf16 compute copy only when asked for.
        self.master = Transformer(self.model_config, backend=cfg.backend, dtype=torch.float32,
                                  init_seed=cfg.policy_seed)
        self.compute_dtype = resolve_dtype(cfg.dtype)
        self.compute = self.master if self.compute_dtype == torch.float32 else self._copy_of(self.master,
                                                                                            self.compute_dtype)
        self.rollout_backend = cfg.rollout.backend or cfg.backend
        self.rollout_dtype = resolve_dtype(cfg.rollout.dtype or cfg.dtype)
        self.reference: Transformer | None = None
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=cfg.optimizer.lr,
                                           betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,
                                           weight_decay=cfg.optimizer.weight_decay)
        self.schedule = LRSchedule(cfg.optimizer, cfg.lr_schedule, total_steps=cfg.steps)
        self.eval_problems = held_out_problems(self.task, cfg.task.eval_prompts)
        self.injector = Injector(cfg.inject, cfg.seed)
        self.calibration: Calibration | None = None

    # ------------------------------------------------------------------ setup helpers
    def _check_lengths(self) -> None:
        cfg = self.cfg
        need = max_prompt_tokens(self.task) + cfg.rollout.max_new_tokens
        if need > cfg.model.max_seq_len:
            raise ValueError(f"config error at 'model.max_seq_len': {cfg.model.max_seq_len} is too short for the "
                             f"longest prompt ({max_prompt_tokens(self.task)}) + rollout.max_new_tokens "
                             f"({cfg.rollout.max_new_tokens}) = {need}")
        if cfg.rollout.max_new_tokens < max_answer_tokens(self.task):
            raise ValueError(f"config error at 'rollout.max_new_tokens': {cfg.rollout.max_new_tokens} cannot hold "
                             f"the longest answer + EOS ({max_answer_tokens(self.task)} tokens)")

    def _copy_of(self, model: Transformer, dtype: torch.dtype, backend: str | None = None) -> Transformer:
        copy = Transformer(self.model_config, backend=backend or model.backend, dtype=dtype, init_seed=None)
        with torch.no_grad():
            for dst, src in zip(copy.parameters(), model.parameters()):
                dst.copy_(src)
        return copy

    def _sync_compute(self) -> None:
        if self.compute is not self.master:
            with torch.no_grad():
                for dst, src in zip(self.compute.parameters(), self.master.parameters()):
                    dst.copy_(src)

    def _rollout_model(self, plan: RolloutPlan) -> Transformer:
        """The model the rollout path samples with: the compute model (its backend switched when
        the rollout runs another one), or a synced copy in another dtype."""
        backend = plan.backend or self.rollout_backend
        dtype = resolve_dtype(plan.dtype) if plan.dtype else (self.compute_dtype if plan.backend
                                                               else self.rollout_dtype)
        if dtype == self.compute_dtype:
            model = self.compute
            model.backend = backend
        else:
            model = self._copy_of(self.master, dtype, backend)
        if plan.ops_override is not None:
            _, fmt, sites = plan.ops_override
            model.ops_override = precision_ops(vexact_kernels.get_ops(backend, model.device), fmt, sites)
        return model

    def _restore_compute(self) -> None:
        self.compute.backend = self.cfg.backend
        self.compute.ops_override = None

    def _log(self, text: str) -> None:
        self.console.print(text)

    # ------------------------------------------------------------------ one step
    def rollout(self, step: int, problems: list[Problem] | None = None, plan: RolloutPlan | None = None
                ) -> Rollouts:
        """Sample ``samples_per_prompt`` responses per problem with the (possibly perturbed) rollout path."""
        cfg = self.cfg
        if problems is None:
            problems = training_problems(self.task, cfg.rollout.prompts_per_step, cfg.seed, step)
        plan = plan if plan is not None else self.injector.plan(step)
        group = cfg.rollout.samples_per_prompt
        problems = [p for p in problems for _ in range(group)]
        prompts = [encode_prompt(self.tokenizer, p) for p in problems]
        model = self._rollout_model(plan)
        try:
            out = generate(model, prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                           temperature=cfg.rollout.temperature, seed=_step_seed(cfg.seed, step),
                           batch_size=cfg.rollout.batch_size, eos_token_id=EOS_ID, logits_hook=plan.logits_hook)
        finally:
            model.ops_override = None
            self._restore_compute()
        rewards = torch.tensor([self.task.reward(p, r) for p, r in zip(problems, out.tokens)], dtype=torch.float32)
        return Rollouts(problems, prompts, out.tokens, out.logprobs, out.finished, rewards)

    def step(self, step: int) -> dict:
        cfg, alg = self.cfg, self.cfg.algorithm
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        plan = self.injector.plan(step)
        batch = self.rollout(step, plan=plan)
        timings["timing/rollout"] = time.perf_counter() - t0
        if not all(torch.isfinite(lp).all() for lp in batch.logprobs):
            raise RunStopped(f"non-finite rollout log-probs (logits) at step {step}")

        advantages = compute_advantages(batch.rewards, cfg.rollout.samples_per_prompt, alg.advantage,
                                        alg.std_normalize)
        lengths = [len(r) for r in batch.responses]
        t1 = time.perf_counter()
        one_pass = alg.mini_batches == 1 and alg.ppo_epochs == 1
        train_logp: list[Tensor] | None = None
        if alg.old_logprobs == "recompute" or not one_pass:  # else the single update pass scores at θ_old
            with torch.no_grad():
                train_logp, _ = score_tokens(self.compute, batch.prompts, batch.responses, cfg.rollout.temperature,
                                             alg.micro_batch_size)
        old_logp = train_logp if alg.old_logprobs == "recompute" else batch.logprobs
        ref_logp = None
        if alg.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _ = score_tokens(self._reference(), batch.prompts, batch.responses,
                                           cfg.rollout.temperature, alg.micro_batch_size)
        timings["timing/old_logprobs"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        lr = self.schedule.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        update = self._update(step, batch, advantages, old_logp, ref_logp, train_logp, injected=plan.active)
        if train_logp is None:
            train_logp = update.pop("_first_pass_logp")
        update.pop("_first_pass_logp", None)
        timings["timing/update"] = time.perf_counter() - t2

        metrics: dict = {"step": step}
        metrics.update(sequence_stats(batch.rewards, "reward"))
        metrics["reward/accuracy"] = float((batch.rewards == 1.0).float().mean())
        metrics.update(sequence_stats(torch.tensor(lengths, dtype=torch.float32), "response_length"))
        metrics["response_length/clip_ratio"] = sum(not f for f in batch.finished) / len(batch.finished)
        metrics.update(mismatch_metrics(train_logp, batch.logprobs))
        metrics["actor/lr"] = lr
        if self.injector.enabled:
            metrics["inject/value"] = plan.value
            metrics["inject/active"] = float(plan.active)
        metrics.update(update)
        timings["timing/step"] = time.perf_counter() - t0
        metrics.update(timings)
        return metrics

    def _reference(self) -> Transformer:
        if self.reference is None:  # frozen copy of the starting policy
            self.reference = self._copy_of(self.compute, self.compute_dtype, self.cfg.backend)
        return self.reference

    def _update(self, step: int, batch: Rollouts, advantages: Tensor, old_logp: list[Tensor],
                ref_logp: list[Tensor] | None, pre_update_logp: list[Tensor] | None, injected: bool = False) -> dict:
        cfg, alg = self.cfg, self.cfg.algorithm
        n = len(batch.responses)
        per_mini = n // alg.mini_batches
        sums: dict[str, list[float]] = {}
        first_pass_logp: list[Tensor | None] = [None] * n
        # The first mini-batch's ratio must be exactly 1 whenever the old log-probs came from the
        # exact training path: recomputed, or recorded by an identical, uninjected rollout path.
        same_rollout_path = (self.rollout_backend == cfg.backend and self.rollout_dtype == self.compute_dtype
                             and not injected)
        expect_exact = (cfg.backend in vexact_kernels.EXACT_BACKENDS
                        and (alg.old_logprobs == "recompute" or same_rollout_path))
        for epoch in range(alg.ppo_epochs):
            gen = torch.Generator().manual_seed(_step_seed(cfg.seed, step) * 31 + epoch)
            order = torch.randperm(n, generator=gen).tolist() if alg.mini_batches > 1 else list(range(n))
            for mb in range(alg.mini_batches):
                idx = order[mb * per_mini : (mb + 1) * per_mini]
                stats = self._minibatch(batch, idx, advantages, old_logp, ref_logp, pre_update_logp, first_pass_logp,
                                        check_exact=expect_exact and epoch == 0 and mb == 0)
                for k, v in stats.items():
                    sums.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in sums.items()}
        out["actor/grad_norm_max"] = max(sums["actor/grad_norm"])
        out["_first_pass_logp"] = first_pass_logp
        return out

    def _minibatch(self, batch: Rollouts, idx: list[int], advantages: Tensor, old_logp: list[Tensor],
                   ref_logp: list[Tensor] | None, pre_update_logp: list[Tensor] | None, first_pass_logp: list,
                   check_exact: bool) -> dict:
        cfg, alg = self.cfg, self.cfg.algorithm
        prompts = [batch.prompts[i] for i in idx]
        responses = [batch.responses[i] for i in idx]
        lengths = [len(r) for r in responses]
        logp_list, entropy_list = score_tokens(self.compute, prompts, responses, cfg.rollout.temperature,
                                               alg.micro_batch_size, with_entropy=True)
        logp = torch.cat(logp_list)
        old = torch.cat([old_logp[i] for i in idx]).to(logp.device)
        adv = torch.cat([advantages[i].expand(length) for i, length in zip(idx, lengths)])
        for i, lp in zip(idx, logp_list):
            if first_pass_logp[i] is None:
                first_pass_logp[i] = lp.detach()
        if not torch.isfinite(logp).all():
            raise RunStopped("non-finite training log-probs (logits)")
        stats: dict[str, float] = {}
        if check_exact:
            exact = torch.equal(logp.detach(), old)
            stats["mismatch/first_minibatch_ratio_exact"] = float(exact)
            if not exact:
                raise RunStopped("exactness violated: first mini-batch ratio != 1 although the old log-probs "
                                 "come from the exact training path")
        correction = None
        if cfg.correction.method != "none":
            # ρ compares the training path at the pre-update weights with the rollout path. Without a
            # separate scoring pass (one bypass pass), this pass *is* at the pre-update weights.
            pre = logp.detach() if pre_update_logp is None else torch.cat([pre_update_logp[i] for i in idx])
            roll = torch.cat([batch.logprobs[i] for i in idx]).to(logp.device)
            correction = rollout_correction(pre, roll, lengths, cfg.correction)
            stats.update(correction.metrics)
        reweight = correction is not None and correction.reweights
        if reweight and alg.old_logprobs == "rollout":  # bypass: the weight replaces the ratio's ρ factor
            per_token, ratio = ppo_token_loss(logp, pre, adv, alg.clip_low, alg.clip_high,
                                              ratio_weight=correction.weights)
        else:
            per_token, ratio = ppo_token_loss(logp, old, adv, alg.clip_low, alg.clip_high)
            if reweight:  # decoupled: the weight scales the clipped loss from outside
                per_token = per_token * correction.weights
        if alg.kl_coef > 0 and ref_logp is not None:
            ref = torch.cat([ref_logp[i] for i in idx])
            kl = k3_penalty(logp, ref)
            per_token = per_token + alg.kl_coef * kl
            stats["actor/kl_loss"] = float(kl.detach().mean())
        if correction is not None and correction.rejects_any:  # rejected tokens leave numerator and denominator
            keep = correction.keep
            lengths = [int(k.sum()) for k in keep.split(lengths)]
            per_token, ratio, adv = per_token[keep], ratio[keep], adv[keep]
        pg_loss = aggregate(per_token, lengths, alg.loss_agg)
        entropy = torch.cat(entropy_list)
        loss = pg_loss - alg.entropy_coef * entropy.mean() if alg.entropy_coef > 0 else pg_loss
        if not torch.isfinite(loss):
            raise RunStopped(f"non-finite loss ({float(loss)})")

        self.compute.zero_grad(set_to_none=True)
        self.master.zero_grad(set_to_none=True)
        loss.backward()
        if self.compute is not self.master:
            for dst, src in zip(self.master.parameters(), self.compute.parameters()):
                dst.grad = None if src.grad is None else src.grad.float()
        params = [p for p in self.master.parameters() if p.grad is not None]
        max_norm = cfg.optimizer.grad_clip if cfg.optimizer.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(grad_norm):
            raise RunStopped(f"non-finite gradient norm ({grad_norm})")
        self.optimizer.step()
        self._sync_compute()

        stats["actor/pg_loss"] = float(pg_loss.detach())
        stats["actor/entropy"] = float(entropy.detach().mean())
        stats["actor/grad_norm"] = grad_norm
        if ratio.numel():
            stats.update(ratio_stats(ratio.detach(), alg.clip_low, alg.clip_high, adv))
        return stats

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Clean evaluation of the policy itself: fixed held-out prompts, exact path, no injection."""
        cfg = self.cfg
        model = self.compute
        model.backend = cfg.backend
        prompts = [encode_prompt(self.tokenizer, p) for p in self.eval_problems]
        sampled = generate(model, prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                           temperature=cfg.rollout.temperature, seed=_step_seed(cfg.seed, 10**9 + step),
                           batch_size=cfg.rollout.batch_size, eos_token_id=EOS_ID)
        greedy = generate(model, prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                          batch_size=cfg.rollout.batch_size, eos_token_id=EOS_ID)
        sampled_r = [self.task.reward(p, r) for p, r in zip(self.eval_problems, sampled.tokens)]
        greedy_r = [self.task.reward(p, r) for p, r in zip(self.eval_problems, greedy.tokens)]
        return {
            "eval/reward_mean": sum(sampled_r) / len(sampled_r),
            "eval/accuracy": sum(r == 1.0 for r in sampled_r) / len(sampled_r),
            "eval/greedy_reward_mean": sum(greedy_r) / len(greedy_r),
            "eval/greedy_accuracy": sum(r == 1.0 for r in greedy_r) / len(greedy_r),
            "eval/response_length_mean": sum(map(len, sampled.tokens)) / len(sampled.tokens),
        }

    # ------------------------------------------------------------------ the run
    def run(self, resume: bool = False) -> dict:
        """Run (or resume) the experiment; returns the summary also written to summary.json."""
        cfg = self.cfg
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        start_step = 0
        state = None
        if resume:
            state = load_checkpoint(run_dir, self.master, self.optimizer)
            if state is None:
                self._log(f"[yellow]no checkpoint in {run_dir}; starting from scratch[/]")
        elif (run_dir / "metrics.jsonl").exists():
            raise ValueError(f"{run_dir} already holds a run; use --resume to continue it or choose another "
                             "output_dir / name")
        if state is None:
            warm_start(self.master, cfg, self.task, log=self._log)
            save_config(cfg, run_dir / "config.yaml")
        else:
            start_step = state["next_step"]
            self.schedule.load_state_dict(state.get("schedule", {}))
            self._log(f"resuming {run_dir} at step {start_step}")
        self._sync_compute()
        self._calibrate(state)
        if cfg.algorithm.kl_coef > 0:
            self.reference = self._reference_from_start(run_dir)

        writer = MetricsWriter(run_dir / "metrics.jsonl", keep_steps_below=start_step)
        summary = {"name": cfg.name, "status": "running", "reason": None, "steps_planned": cfg.steps}
        started = time.perf_counter()
        last = {}
        step = start_step
        try:
            with _progress(self.console, cfg, start_step) as progress:
                for step in range(start_step, cfg.steps):
                    metrics = self.step(step)
                    if step % cfg.logging.eval_every == 0 or step == cfg.steps - 1:
                        t = time.perf_counter()
                        metrics.update(self.evaluate(step))
                        metrics["timing/eval"] = time.perf_counter() - t
                    metrics.update(self.schedule.observe(step, metrics))
                    if self.schedule.trigger_step == step:
                        self._log(f"[yellow]LR decay triggered at step {step}:[/] {self.schedule.trigger_reason}; "
                                  f"halving every {self.schedule.decay_period} steps")
                    writer.write(metrics)
                    last = metrics
                    progress(step, metrics)
                    if cfg.collapse.stop_on_collapse and "eval/reward_mean" in metrics:
                        if detect_collapse(read_metrics(run_dir / "metrics.jsonl"), cfg.collapse)["collapsed"]:
                            save_checkpoint(run_dir, self.master, self.optimizer,
                                            {"next_step": step + 1, "schedule": self.schedule.state_dict(),
                                             "inject_value": self.injector.value})
                            raise CollapseConfirmed(step)
                    if (step + 1) % cfg.logging.checkpoint_every == 0 or step == cfg.steps - 1:
                        save_checkpoint(run_dir, self.master, self.optimizer,
                                        {"next_step": step + 1, "schedule": self.schedule.state_dict(),
                                         "inject_value": self.injector.value})
            summary["status"] = "completed"
        except CollapseConfirmed:
            summary["status"] = "completed"
            summary["reason"] = f"collapse confirmed at step {step}; stopped early (collapse.stop_on_collapse)"
        except RunStopped as stop:
            summary["status"] = "stopped"
            summary["reason"] = str(stop)
            self._log(f"[red]run stopped at step {step}:[/] {stop}")
        except KeyboardInterrupt:
            summary["status"] = "interrupted"
            summary["reason"] = f"interrupted during step {step}; resume with --resume"
            self._log("[yellow]interrupted[/] -- finished steps are in metrics.jsonl; continue with --resume")
        finally:
            writer.close()
        history = read_metrics(run_dir / "metrics.jsonl")
        summary.update(_summarize(history))
        summary["collapse"] = detect_collapse(history, cfg.collapse,
                                              stopped_reason=summary["reason"] if summary["status"] == "stopped"
                                              else None, stopped_step=step)
        summary["stopped_at_step"] = step if summary["status"] != "completed" else None
        summary["wall_seconds_this_session"] = round(time.perf_counter() - started, 3)
        summary["lr_schedule"] = self.schedule.summary()
        summary["last_step_metrics"] = {k: v for k, v in last.items() if not k.startswith("timing/")}
        if self.injector.enabled:
            summary["inject"] = {"mode": cfg.inject.mode, "value": self.injector.value}
            if self.calibration is not None:
                summary["inject"].update(calibrated_value=self.calibration.value,
                                         calibration_metric=cfg.inject.target.metric,
                                         calibration_target=self.calibration.target,
                                         calibration_achieved=self.calibration.achieved,
                                         calibration_evaluations=len(self.calibration.evaluations))
        write_json_atomic(run_dir / "summary.json", summary)
        return summary

    def _calibrate(self, state: dict | None) -> None:
        """Set the injector's knob from ``inject.target`` (restored from the checkpoint on resume)."""
        target = self.cfg.inject.target
        if target is None:
            return
        if state is not None and "inject_value" in state:
            self.injector.value = state["inject_value"]
            return
        c = self.cfg.inject
        problems = training_problems(self.task, c.calibration_prompts, self.cfg.seed + CALIBRATION_SEED_OFFSET, 0)
        key = "rollout_corr/k3_kl" if target.metric == "k3_kl" else "mismatch/abs_dlogp_mean"

        def measure(value: float) -> float:
            plan = RolloutPlan(value, logits_hook=self.injector.logits_hook(value, step=0))
            batch = self.rollout(0, problems=problems, plan=plan)
            with torch.no_grad():
                train_logp, _ = score_tokens(self.compute, batch.prompts, batch.responses,
                                             self.cfg.rollout.temperature, self.cfg.algorithm.micro_batch_size)
            return mismatch_metrics(train_logp, batch.logprobs)[key]

        self.calibration = calibrate(measure, c.mode, target.value, c.calibration_tolerance,
                                     sign=-1.0 if c.value < 0 else 1.0, vocab_size=self.tokenizer.vocab_size)
        self.injector.value = self.calibration.value
        self._log(f"calibrated inject.value = {self.calibration.value:.6g} for {target.metric} = "
                  f"{self.calibration.achieved:.4g} (target {target.value:g}, "
                  f"{len(self.calibration.evaluations)} calibration batches)")

    def _reference_from_start(self, run_dir: Path) -> Transformer:
        """The KL reference is the policy at step 0 (warm start), rebuilt identically on resume."""
        start = Transformer(self.model_config, backend=self.cfg.backend, dtype=torch.float32,
                            init_seed=self.cfg.policy_seed)
        warm_start(start, self.cfg, self.task, log=lambda _: None)
        return self._copy_of(start, self.compute_dtype, self.cfg.backend)


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) & 0x7FFFFFFFFFFF


def _summarize(history: list[dict]) -> dict:
    """Reward at start/end and the clean-eval curve ends, from the metrics written so far."""
    if not history:
        return {"steps_completed": 0}
    evals = [m for m in history if "eval/reward_mean" in m]
    out = {
        "steps_completed": len(history),
        "reward_first": history[0]["reward/mean"],
        "reward_last": history[-1]["reward/mean"],
        "mean_step_seconds": sum(m.get("timing/step", 0.0) for m in history) / len(history),
        "mean_k3_kl": sum(m["rollout_corr/k3_kl"] for m in history) / len(history),
        "min_bitwise_equal_frac": min(m["mismatch/bitwise_equal_frac"] for m in history),
    }
    if evals:
        out["eval_reward_first"] = evals[0]["eval/reward_mean"]
        out["eval_reward_last"] = evals[-1]["eval/reward_mean"]
        out["eval_greedy_accuracy_first"] = evals[0]["eval/greedy_accuracy"]
        out["eval_greedy_accuracy_last"] = evals[-1]["eval/greedy_accuracy"]
        out["eval_reward_peak"] = max(m["eval/reward_mean"] for m in evals)
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
        info = (f"reward {m['reward/mean']:.3f}  len {m['response_length/mean']:.1f}  "
                f"k3 {m['rollout_corr/k3_kl']:.2e}  bitwise {m['mismatch/bitwise_equal_frac']:.3f}")
        if "eval/reward_mean" in m:
            info += f"  eval {m['eval/reward_mean']:.3f}"
        if self.live:
            self.bar.update(self.task_id, completed=step + 1, info=info)
        elif step % 10 == 0 or step == self.cfg.steps - 1 or "eval/reward_mean" in m:
            self.console.print(f"step {step + 1}/{self.cfg.steps}  {info}  ({m['timing/step']:.2f}s)")

    def __exit__(self, *exc):
        if self.live:
            self.bar.__exit__(*exc)
        return False
