"""The raw importance ratios before any clamp or mask (``mismatch/ratio_*``, ``vexact.rl.raw_ratios``).

What must hold: the quantiles, min and max equal numpy's on the same ratios; each correction's affected fraction is
the hand count on a constructed batch (token TIS at C = 2 truncates exactly the tokens with ratio > 2, not the one at
2); the keys reach ``vexact compare`` (JSON and printed table), a ``LiveMonitor`` row and a run's metrics.jsonl,
each registered once in ``vexact.metric_keys``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from vexact import metric_keys
from vexact.cli import main
from vexact.live import LiveMonitor
from vexact.metric_keys import RAW_RATIO_MAX, RAW_RATIO_MIN, RAW_RATIO_QUANTILES, raw_ratio_affected_key
from vexact.metric_keys import raw_ratio_quantile_key as qkey
from vexact.records.runlog import read_metrics
from vexact.rl.raw_ratios import raw_ratio_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Two sequences of raw ratios, set through log-probs (so each comes back within a few ulps): 1.99 sits just under TIS's
# C = 2, 0.51 and 4.99 just inside IcePop's [0.5, 5] -- near the boundaries, but not on them, where an ulp decides.
RATIOS = [[1.0, 3.0, 0.25, 1.99], [2.5, 1.0, 6.0, 0.51, 4.99]]
LENGTHS = [4, 5]
HAND = {  # tokens each method truncates, zeroes or rejects, counted by hand at its default setting
    "token_tis": 4,  # ratio > 2: 3.0, 2.5, 6.0, 4.99 (1.99 is not truncated)
    "token_mis": 4,  # rejects the same tokens
    "seq_tis": 5,    # sequence ratios 3·0.25·1.99 = 1.49 (kept) and 2.5·6·0.51·4.99 = 38.2 > 2: the second's 5 tokens
    "seq_mis": 5,
    "icepop": 2,     # outside [0.5, 5]: 0.25, 6.0
    "geo_rs": 9,     # geometric means 1.49^(1/4) and 38.2^(1/5), both outside [0.999, 1.001]: every token
}


def _logps() -> tuple[torch.Tensor, torch.Tensor]:
    ratios = torch.tensor([r for row in RATIOS for r in row], dtype=torch.float64)
    roll = -torch.linspace(2.0, 4.0, ratios.numel(), dtype=torch.float64)  # below -log 6: train stays <= 0
    return roll + torch.log(ratios), roll  # training, rollout


def test_raw_quantiles_equal_numpy_on_random_ratios():
    gen = torch.Generator().manual_seed(0)
    roll = -torch.rand(1000, generator=gen, dtype=torch.float64) * 5
    train = roll + torch.randn(1000, generator=gen, dtype=torch.float64) * 0.3
    m = raw_ratio_metrics(train, roll, [400, 600])
    ratio = np.exp(train.numpy() - roll.numpy())
    tol = dict(rtol=1e-12, atol=0)  # the same float64 ratios; only the interpolation's rounding may differ
    for q in RAW_RATIO_QUANTILES:
        np.testing.assert_allclose(m[qkey(q)], np.quantile(ratio, q), **tol)
    np.testing.assert_allclose(m[RAW_RATIO_MIN], ratio.min(), **tol)
    np.testing.assert_allclose(m[RAW_RATIO_MAX], ratio.max(), **tol)
    assert [qkey(q) for q in RAW_RATIO_QUANTILES] == ["mismatch/ratio_p01", "mismatch/ratio_p50", "mismatch/ratio_p99"]


def test_raw_ratios_are_not_clamped():
    """verl clamps log ρ at ±20; the raw max is e^30 here, not e^20."""
    roll = torch.tensor([-40.0, -1.0], dtype=torch.float64)
    train = torch.tensor([-10.0, -1.0], dtype=torch.float64)
    np.testing.assert_allclose(raw_ratio_metrics(train, roll, [2])[RAW_RATIO_MAX], math.exp(30), rtol=1e-12)


def test_affected_fraction_per_correction_is_the_hand_count():
    train, roll = _logps()
    m = raw_ratio_metrics(train, roll, LENGTHS)
    n = sum(LENGTHS)
    assert {k.removeprefix(raw_ratio_affected_key("")): v for k, v in m.items()
            if k.startswith(raw_ratio_affected_key(""))} == {name: count / n for name, count in HAND.items()}
    ratio = torch.exp(train - roll)
    assert m[raw_ratio_affected_key("token_tis")] == int((ratio > 2).sum()) / n  # TIS at C = 2: exactly ratio > 2


def test_zero_mismatch_gives_ratio_one_and_nothing_affected():
    roll = -torch.linspace(0.1, 2.0, 7)
    m = raw_ratio_metrics(roll.clone(), roll, [3, 4])
    assert all(m[k] == 1.0 for k in (RAW_RATIO_MIN, RAW_RATIO_MAX, *map(qkey, RAW_RATIO_QUANTILES)))
    assert all(v == 0.0 for k, v in m.items() if k.startswith(raw_ratio_affected_key("")))


def test_every_written_key_is_registered_once():
    train, roll = _logps()
    written = raw_ratio_metrics(train, roll, LENGTHS)
    assert metric_keys.unregistered(written) == []
    entries = [metric_keys.find(k).name for k in written]
    assert all(sum(e.name == name for e in metric_keys.KEYS) == 1 for name in entries)


def _dump(path, sides):
    path.write_text("".join(json.dumps({"id": i, "logprobs": v}) + "\n" for i, v in enumerate(sides)))
    return path


def test_compare_reports_raw_ratios_in_json_and_table(tmp_path, capsys):
    train, roll = _logps()
    split = lambda t: [t[:4].tolist(), t[4:].tolist()]  # noqa: E731
    rollout = _dump(tmp_path / "r.jsonl", split(roll))
    trained = _dump(tmp_path / "t.jsonl", split(train))
    assert main(["compare", str(rollout), str(trained), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    m = json.loads((tmp_path / "out.json").read_text())["metrics"]
    assert m[raw_ratio_affected_key("token_tis")] == 4 / 9 and m[raw_ratio_affected_key("icepop")] == 2 / 9
    np.testing.assert_allclose(m[RAW_RATIO_MAX], 6.0, rtol=1e-12)
    assert "raw ratio" in out and "token_tis: tokens truncated or masked" in out and "44.44%" in out


def test_live_monitor_row_has_raw_ratios(tmp_path):
    train, roll = _logps()
    with LiveMonitor(tmp_path / "live") as monitor:
        row = monitor.step(0, [roll[:4], roll[4:]], [train[:4], train[4:]])
    assert row[raw_ratio_affected_key("token_tis")] == 4 / 9
    np.testing.assert_allclose(row[qkey(0.5)], 1.99, rtol=1e-12)  # the median of the nine ratios


def test_run_metrics_have_raw_ratios(tmp_path):
    """A short run on the exact backend: every ratio exactly 1, nothing truncated or masked."""
    from pathlib import Path

    from rich.console import Console

    from vexact.rl.config import load_config
    from vexact.rl.trainer import Trainer

    experiment = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
    cfg = load_config(experiment, [f"output_dir={tmp_path / 'run'}", f"warm_start.cache_dir={tmp_path / 'cache'}",
                                   "warm_start.steps=5", "steps=1", "rollout.prompts_per_step=2",
                                   "rollout.samples_per_prompt=2", "task.eval_prompts=4", "logging.eval_every=1",
                                   "logging.checkpoint_every=1", "logging.live=false"])
    assert Trainer(cfg, Console(quiet=True)).run()["status"] == "completed"
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row[RAW_RATIO_MIN] == row[RAW_RATIO_MAX] == 1.0
    assert all(row[raw_ratio_affected_key(name)] == 0.0 for name in HAND)
