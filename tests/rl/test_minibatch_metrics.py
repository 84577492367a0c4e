"""A step's metrics when its update has several PPO mini-batches or epochs: each key reduced as the metric registry
says (``MetricKey.minibatches``), the rollout correction's statistics over the step's whole batch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import warm_start_cache
from rich.console import Console

from vexact.metric_keys import KEYS, MINIBATCH_REDUCTIONS, find
from vexact.records.runlog import read_metrics
from vexact.rl.config import load_config
from vexact.rl.metrics import reduce_minibatch_stats
from vexact.rl.trainer import Trainer

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
REL = 1e-12  # float64 means of the same values summed in another order


def _step0(tmp_path: Path, name: str, *overrides: str, parts: list | None = None) -> dict:
    """Step 0's metrics of the zero-mismatch experiment under a logit-scale injection (a real mismatch), decoupled,
    IcePop with a band wide enough that every weight is the raw ratio; ``parts``: receives each mini-batch's
    ``MinibatchLoss``."""
    cfg = load_config(EXPERIMENT, [
        f"output_dir={tmp_path / name}", f"warm_start.cache_dir={warm_start_cache(tmp_path)}", "warm_start.steps=30",
        "steps=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "task.eval_prompts=16",
        "logging.eval_every=3", "logging.live=false", "threads=1", "inject.mode=logit_scale", "inject.epsilon=-0.5",
        "algorithm.old_logprobs=recompute", "correction.method=icepop", "correction.band=[0.001,1000.0]",
        *overrides])
    trainer = Trainer(cfg, Console(quiet=True))
    if parts is not None:
        loss_of = trainer.objective.loss_of

        def recording(*args, **kwargs):
            out = loss_of(*args, **kwargs)
            parts.append(out)
            return out

        trainer.objective.loss_of = recording
    assert trainer.run()["status"] == "completed"
    return read_metrics(tmp_path / name / "metrics.jsonl")[0]


def test_several_minibatches_and_epochs_reduce_each_key_by_its_kind(tmp_path):
    parts: list = []
    row = _step0(tmp_path, "mb", "algorithm.mini_batches=2", "algorithm.ppo_epochs=2", parts=parts)
    assert len(parts) == 4  # 2 mini-batches x 2 epochs: the step's actor/* are over all four
    # the largest IS weight is the largest raw ratio of the step (every weight is the raw ratio in this band)
    assert row["rollout_corr/rollout_is_max"] == row["correction/weight_max"] == row["mismatch/ratio_max"]
    assert row["rollout_corr/rollout_is_min"] == row["correction/weight_min"] == row["mismatch/ratio_min"]
    stats = [p.stats for p in parts]
    assert row["actor/ratio_max"] == max(s["actor/ratio_max"] for s in stats)
    assert row["actor/ratio_min"] == min(s["actor/ratio_min"] for s in stats)
    for key in ("actor/ratio_mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        tokens = [p.counts[key] for p in parts]
        expected = sum(s[key] * n for s, n in zip(stats, tokens)) / sum(tokens)
        assert math.isclose(row[key], expected, rel_tol=REL, abs_tol=1e-15), key
    assert row["actor/pg_loss"] == sum(s["actor/pg_loss"] for s in stats) / 4
    assert row["actor/grad_norm_max"] == max(s["actor/grad_norm"] for s in stats)

    # the correction's statistics are the step's whole batch's: those of the same step with one mini-batch (same
    # rollout, same pre-update scoring), up to the order of float64 sums
    one = _step0(tmp_path, "one", "algorithm.mini_batches=1")
    corr = [k for k in one if k.startswith(("rollout_corr/rollout_is", "correction/"))]
    assert "rollout_corr/rollout_is_std" in corr and "correction/weight_mean" in corr
    for key in corr:
        assert math.isclose(row[key], one[key], rel_tol=REL, abs_tol=1e-15), key


def test_one_minibatch_keeps_every_value_bit_for_bit():
    # token means: 0.1 x 3 / 3 is not 0.1 in float64, so one part must be taken as it is, not re-weighted
    stats = {"actor/ratio_mean": 0.1, "actor/ratio_max": 1.7, "actor/pg_loss": 0.3, "actor/entropy": 0.1,
             "rollout_corr/rollout_is_mean": 0.7, "correction/weight_max": 1.2}
    counts = {"actor/ratio_mean": 3, "actor/entropy": 3}
    assert 0.1 * 3 / 3 != 0.1
    out = reduce_minibatch_stats([stats], [counts])
    assert out == stats and list(out) == list(stats)


def test_reductions_by_kind():
    a = {"actor/ratio_max": 2.0, "actor/ratio_min": 0.5, "actor/ratio_mean": 1.0, "actor/pg_loss": 1.0,
         "rollout_corr/rollout_is_max": 3.0, "mismatch/first_minibatch_ratio_exact": 1.0}
    b = {"actor/ratio_max": 1.5, "actor/ratio_min": 0.25, "actor/ratio_mean": 2.0, "actor/pg_loss": 3.0,
         "rollout_corr/rollout_is_max": 5.0}
    out = reduce_minibatch_stats([a, b], [{"actor/ratio_mean": 1}, {"actor/ratio_mean": 3}])
    assert out == {"actor/ratio_max": 2.0, "actor/ratio_min": 0.25, "actor/ratio_mean": 1.75, "actor/pg_loss": 2.0,
                   "rollout_corr/rollout_is_max": 3.0,  # "step": the caller's whole-batch value replaces it
                   "mismatch/first_minibatch_ratio_exact": 1.0}
    with pytest.raises(ValueError, match="token counts"):
        reduce_minibatch_stats([a, b], [{}, {}])
    with pytest.raises(ValueError, match="no reduction"):
        reduce_minibatch_stats([{"reward/mean": 1.0}, {"reward/mean": 2.0}], [{}, {}])


def test_every_key_the_update_writes_has_a_reduction():
    assert {k.minibatches for k in KEYS} <= {None, *MINIBATCH_REDUCTIONS}
    for key in ("actor/entropy", "actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/pg_clipfrac_low",
                "actor/pg_clipfrac_high", "actor/ratio_mean", "actor/ratio_max", "actor/ratio_min", "actor/ppo_kl",
                "actor/kl_loss", "mismatch/first_minibatch_ratio_exact", "rollout_corr/rollout_rs_seq_sum_k1_max",
                "rollout_corr/rollout_is_eff_sample_size", "correction/rejected_seq_frac"):
        assert find(key).minibatches is not None, key
