"""Sampled rescoring in bypass mode (``monitor.sample_fraction`` / ``monitor.every``): the default's bits, the sampled
metrics against the full ones over the same sequences, skipped steps, what is refused, and the sample itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import recorded_returns, warm_start_cache
from rich.console import Console
from safetensors.torch import load_file

from vexact.metric_keys import (
    K3_KL,
    LAG_K3_KL,
    MONITOR_SAMPLE_FRACTION,
    MONITOR_SAMPLED_SEQUENCES,
    TIMING_MONITOR,
    find,
)
from vexact.records.runlog import latest_checkpoint, read_metrics
from vexact.rl.config import ConfigError, load_config
from vexact.rl.metrics import lag_split_metrics, mismatch_metrics
from vexact.rl.monitor import sample_rows, sample_size
from vexact.rl.raw_ratios import raw_ratio_metrics
from vexact.rl.scoring import Scorer
from vexact.rl.trainer import Trainer

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
NOISE = ("inject.mode=logit_noise", "inject.sigma=0.05")  # a mismatch to measure
MISMATCH_PREFIXES = ("rollout_corr/", "training/", "mismatch/")


def _cfg(tmp_path: Path, name: str, *overrides: str):
    base = [f"output_dir={tmp_path / name}", f"warm_start.cache_dir={warm_start_cache(tmp_path)}",
            "warm_start.steps=20", "steps=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "task.eval_prompts=8", "logging.eval_every=2", "logging.checkpoint_every=4", "logging.live=false",
            "optimizer.lr=2e-3", "optimizer.warmup_steps=0", "task.partial_credit=true", "algorithm.mini_batches=2",
            "distributed.leaves=2", *NOISE]
    return load_config(EXPERIMENT, base + list(overrides))


def _rows(tmp_path: Path, name: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")}
            for r in read_metrics(tmp_path / name / "metrics.jsonl")]


def _weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(tmp_path / name) / "checkpoint.safetensors"))


def test_default_monitor_is_todays_run_bit_for_bit(tmp_path):
    """Bypass with two mini-batches (the path that rescored the whole batch): an explicit sample_fraction 1.0 and
    every 1 is the run without the section, every metric and weight; and neither writes a monitor key."""
    Trainer(_cfg(tmp_path, "plain"), Console(quiet=True)).run()
    Trainer(_cfg(tmp_path, "explicit", "monitor.sample_fraction=1.0", "monitor.every=1"), Console(quiet=True)).run()
    plain, explicit = _rows(tmp_path, "plain"), _rows(tmp_path, "explicit")
    assert plain == explicit and K3_KL in plain[0]
    assert not any(key.startswith("monitor/") for row in plain for key in row)
    a, b = _weights(tmp_path, "plain"), _weights(tmp_path, "explicit")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra", [(), ("rollout.policy_lag=1",)], ids=["on_policy", "lag1"])
def test_sampled_metrics_are_the_full_metrics_of_the_same_sequences(tmp_path, monkeypatch, extra):
    """The sampled run trains the same bits as the full one, and each step's mismatch metrics are exactly the full
    run's pre-update log-probs' metrics over the sampled rows (scoring is batch-invariant, so no tolerance)."""
    anchors = recorded_returns(monkeypatch, Scorer, "anchors")
    batches = recorded_returns(monkeypatch, Trainer, "rollout")
    full = Trainer(_cfg(tmp_path, "full", *extra), Console(quiet=True))
    full.run()
    fraction = 0.25
    Trainer(_cfg(tmp_path, "sampled", f"monitor.sample_fraction={fraction}", *extra), Console(quiet=True)).run()
    full_rows, sampled_rows = _rows(tmp_path, "full"), _rows(tmp_path, "sampled")
    a, b = _weights(tmp_path, "full"), _weights(tmp_path, "sampled")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the monitor changes no training bit
    steps = len(full_rows)
    assert steps == 4 and len(batches) == 2 * steps
    n = len(batches[0].responses)
    for step, (full_row, row) in enumerate(zip(full_rows, sampled_rows)):
        full_batch, sampled_batch = batches[step], batches[steps + step]
        assert all(torch.equal(x, y) for x, y in zip(full_batch.logprobs, sampled_batch.logprobs))
        rows = sample_rows(n, fraction, 1, 0, step)
        assert len(rows) == sample_size(n, fraction) == 4
        pre = anchors[step].pre_update
        train = [pre[i] for i in rows]
        roll = [full_batch.logprobs[i] for i in rows]
        expected = {**mismatch_metrics(train, roll), **raw_ratio_metrics(torch.cat(train), torch.cat(roll),
                                                                         [len(t) for t in train])}
        lag_keys = set(lag_split_metrics(train, train, roll)) if extra else set()  # checked in the next test
        assert lag_keys <= set(row)
        assert {k: v for k, v in row.items() if k.startswith(MISMATCH_PREFIXES) and k not in lag_keys} == {
            k: v for k, v in expected.items() if k.startswith(MISMATCH_PREFIXES)}
        assert row[MONITOR_SAMPLED_SEQUENCES] == 4 and row[MONITOR_SAMPLE_FRACTION] == 4 / n
        assert row[K3_KL] != full_row[K3_KL]  # a sample, not the batch
        others = {k: v for k, v in row.items() if not k.startswith((*MISMATCH_PREFIXES, "monitor/"))}
        assert others == {k: v for k, v in full_row.items() if not k.startswith(MISMATCH_PREFIXES)}
    if extra:  # policy lag: the behaviour policy's log-probs scored for the sample only, and the split from them
        assert all(LAG_K3_KL in r for r in sampled_rows)
    timings = read_metrics(tmp_path / "sampled" / "metrics.jsonl")
    assert all(r[TIMING_MONITOR] > 0 for r in timings) and find(TIMING_MONITOR) is not None


def test_sampled_lag_split_is_the_full_lag_split_of_the_same_sequences(tmp_path, monkeypatch):
    """Under policy lag the behaviour policy is scored for the sample only: its split equals the full scoring's."""
    scored = []
    real = Scorer.__call__

    def recording(self, model, batch, replay=True):
        out = real(self, model, batch, replay)
        scored.append((model, len(batch.responses), out))
        return out

    monkeypatch.setattr(Scorer, "__call__", recording)
    full = Trainer(_cfg(tmp_path, "full", "rollout.policy_lag=1", "steps=3"), Console(quiet=True))
    full.run()
    full_scored = [(model is full.compute, size, out) for model, size, out in scored]
    scored.clear()
    sampled = Trainer(_cfg(tmp_path, "sampled", "rollout.policy_lag=1", "steps=3", "monitor.sample_fraction=0.5"),
                      Console(quiet=True))
    sampled.run()
    sampled_scored = [(model is sampled.compute, size, out) for model, size, out in scored]
    n = 16
    # full run: per step the current policy's whole batch, then the behaviour policy's (a copy, not the compute model)
    full_behaviour = [out for current, size, out in full_scored if not current and size == n]
    sampled_behaviour = [(size, out) for current, size, out in sampled_scored if not current]
    assert [size for size, _ in sampled_behaviour] == [8, 8] and len(full_behaviour) == 2  # step 0 is not lagged
    for step, (behaviour_full, (_, behaviour_sample)) in enumerate(zip(full_behaviour, sampled_behaviour), start=1):
        rows = sample_rows(n, 0.5, 1, 0, step)
        assert all(torch.equal(behaviour_full[i], got) for i, got in zip(rows, behaviour_sample))
    full_rows, sampled_rows = _rows(tmp_path, "full"), _rows(tmp_path, "sampled")
    assert all(LAG_K3_KL in r for r in full_rows + sampled_rows)


def test_every_skips_steps_and_their_metrics(tmp_path):
    """monitor.every 2: steps 1 and 3 rescore nothing and log no mismatch metric (absent, not 0)."""
    Trainer(_cfg(tmp_path, "every", "monitor.every=2"), Console(quiet=True)).run()
    Trainer(_cfg(tmp_path, "full"), Console(quiet=True)).run()
    rows, full = _rows(tmp_path, "every"), _rows(tmp_path, "full")
    for step, (row, full_row) in enumerate(zip(rows, full)):
        mismatch = {k: v for k, v in row.items() if k.startswith(MISMATCH_PREFIXES)}
        if step % 2:
            assert mismatch == {} and row[MONITOR_SAMPLED_SEQUENCES] == 0 and row[MONITOR_SAMPLE_FRACTION] == 0.0
        else:  # every sequence: the full run's metrics, bit for bit
            assert mismatch == {k: v for k, v in full_row.items() if k.startswith(MISMATCH_PREFIXES)}
            assert row[MONITOR_SAMPLED_SEQUENCES] == 16 and row[MONITOR_SAMPLE_FRACTION] == 1.0


def test_one_pass_bypass_samples_from_the_free_first_pass(tmp_path):
    """One mini-batch: the update's first pass is at the pre-update weights, so nothing is scored for the sample and
    its metrics are the full run's over the sampled rows."""
    Trainer(_cfg(tmp_path, "one", "algorithm.mini_batches=1", "monitor.sample_fraction=0.5", "steps=2"),
            Console(quiet=True)).run()
    rows = _rows(tmp_path, "one")
    assert all(r[MONITOR_SAMPLED_SEQUENCES] == 8 and K3_KL in r for r in rows)


@pytest.mark.parametrize("overrides,key,words", [
    (("algorithm.old_logprobs=recompute", "monitor.sample_fraction=0.5"), "monitor.sample_fraction",
     "recompute scores every sequence"),
    (("algorithm.old_logprobs=recompute", "monitor.every=3"), "monitor.every", "recompute scores every sequence"),
    (("correction.method=token_tis", "monitor.sample_fraction=0.5"), "monitor.sample_fraction",
     "correction.method 'token_tis'"),
    (("correction.method=icepop", "algorithm.mini_batches=1", "algorithm.ppo_epochs=2", "monitor.every=2"),
     "monitor.every", "correction.method 'icepop'"),
    (("monitor.sample_fraction=0",), "monitor.sample_fraction", "> 0"),
    (("monitor.sample_fraction=1.5",), "monitor.sample_fraction", "<= 1"),
    (("monitor.every=0",), "monitor.every", ">= 1"),
])
def test_refused(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, "bad", *overrides)
    assert err.value.key == key and words in str(err.value)
    if "correction" in words:
        assert "correction.method: none" in str(err.value) and "monitor.sample_fraction" in str(err.value)


def test_a_bypass_correction_with_one_pass_may_sample(tmp_path):
    """One pass: the correction's pre-update log-probs are the update's own first pass, whatever is sampled."""
    cfg = _cfg(tmp_path, "ok", "correction.method=token_tis", "algorithm.mini_batches=1",
               "monitor.sample_fraction=0.5")
    assert cfg.monitor.sampling


def test_sample_rows():
    assert sample_rows(16, 1.0, 1, 0, 5) == list(range(16))
    assert sample_rows(16, 0.25, 1, 3, 7) == sample_rows(16, 0.25, 1, 3, 7)  # deterministic
    assert sample_rows(16, 0.25, 1, 3, 7) != sample_rows(16, 0.25, 1, 3, 8)  # keyed by the step
    assert sample_rows(16, 0.25, 1, 3, 7) != sample_rows(16, 0.25, 1, 4, 7)  # and the seed
    rows = sample_rows(16, 0.25, 1, 3, 7)
    assert rows == sorted(set(rows)) and len(rows) == 4 and all(0 <= i < 16 for i in rows)
    assert sample_rows(10, 0.01, 1, 0, 0) is not None and len(sample_rows(10, 0.01, 1, 0, 0)) == 1  # at least one
    assert sample_rows(10, 0.5, 3, 0, 4) is None and sample_rows(10, 0.5, 3, 0, 6) is not None
    for bad, name in ((0.0, "sample_fraction"), (1.01, "sample_fraction"), (True, "sample_fraction")):
        with pytest.raises(ValueError, match=name):
            sample_rows(10, bad, 1, 0, 0)
    with pytest.raises(ValueError, match="every"):
        sample_rows(10, 0.5, 0, 0, 0)
