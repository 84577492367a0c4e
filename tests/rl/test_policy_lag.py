"""Policy lag (``rollout.policy_lag``): rollouts from the policy k optimizer steps behind the trained one, the lag's
drift and the training-inference mismatch logged apart, resume, and the default's bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import interrupt_trainer_at, recorded_returns, warm_start_cache
from rich.console import Console
from safetensors.torch import load_file

from vexact.metric_keys import K3_KL, LAG_K3_KL, TIM_K3_KL
from vexact.records.runlog import latest_checkpoint, read_metrics
from vexact.rl.config import ConfigError, load_config
from vexact.rl.metrics import lag_split_metrics, mismatch_metrics
from vexact.rl.trainer import Trainer

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"


def _cfg(tmp_path: Path, name: str, *overrides: str):
    base = [f"output_dir={tmp_path / name}", f"warm_start.cache_dir={warm_start_cache(tmp_path)}",
            "warm_start.steps=30", "steps=6", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "task.eval_prompts=16", "logging.eval_every=3", "logging.checkpoint_every=2", "logging.live=false",
            "optimizer.lr=2e-3", "optimizer.warmup_steps=0", "task.partial_credit=true"]
    return load_config(EXPERIMENT, base + list(overrides))


def _run(cfg, resume: bool = False) -> dict:
    return Trainer(cfg, Console(quiet=True)).run(resume=resume)


def _rows(tmp_path: Path, name: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")}
            for r in read_metrics(tmp_path / name / "metrics.jsonl")]


def test_lag_zero_is_the_on_policy_run_bit_for_bit(tmp_path):
    _run(_cfg(tmp_path, "plain"))
    _run(_cfg(tmp_path, "zero", "rollout.policy_lag=0"))
    assert _rows(tmp_path, "zero") == _rows(tmp_path, "plain")
    assert not any(LAG_K3_KL in r or TIM_K3_KL in r for r in _rows(tmp_path, "plain"))
    a = load_file(str(latest_checkpoint(tmp_path / "plain") / "checkpoint.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "zero") / "checkpoint.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (latest_checkpoint(tmp_path / "zero") / "snapshots.safetensors").exists()


@pytest.mark.parametrize("lag", [1, 2])
def test_rollouts_come_from_the_policy_k_steps_back(tmp_path, monkeypatch, lag):
    """Each step's batch is bitwise the batch an on-policy trainer samples from the weights of k steps before (the
    starting weights during the first k steps)."""
    lagged = Trainer(_cfg(tmp_path, "lagged", f"rollout.policy_lag={lag}", "steps=5"), Console(quiet=True))
    assert lagged._prepare(False, ()) == (0, {})  # step 0, no resume changes
    real_rollout = Trainer.rollout  # restored below, for the on-policy reference
    weights, batches = [], recorded_returns(monkeypatch, Trainer, "rollout")
    for step in range(5):
        weights.append({k: v.clone() for k, v in lagged.master.state_dict().items()})
        lagged.step(step)
    monkeypatch.setattr(Trainer, "rollout", real_rollout)
    on_policy = Trainer(_cfg(tmp_path, "ref"), Console(quiet=True))
    for step, batch in enumerate(batches):
        on_policy.load_policy(weights[max(0, step - lag)])
        expected = on_policy.rollout(step, on_policy.injector.plan(step))
        assert batch.responses == expected.responses
        assert all(torch.equal(a, b) for a, b in zip(batch.logprobs, expected.logprobs))
    # and the trained weights moved, so the lagged batches are not the current policy's
    on_policy.load_policy(weights[4])
    current = on_policy.rollout(4, on_policy.injector.plan(4))
    assert not all(torch.equal(a, b) for a, b in zip(batches[4].logprobs, current.logprobs)) or \
        batches[4].responses != current.responses


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_exact_path_lag_alone_is_pure_drift_with_zero_tim(tmp_path, old_logprobs):
    _run(_cfg(tmp_path, "lag", "rollout.policy_lag=2", f"algorithm.old_logprobs={old_logprobs}"))
    rows = _rows(tmp_path, "lag")
    assert len(rows) == 6
    for r in rows:
        assert r[TIM_K3_KL] == 0.0  # the rollout is the behaviour policy's training path, bit for bit
        assert r[K3_KL] == r[LAG_K3_KL]  # so the total the user logs is the lag's drift exactly
        if old_logprobs == "recompute":  # the anchor is recomputed at the current weights: ratio exactly 1
            assert r["mismatch/first_minibatch_ratio_exact"] == 1.0
    assert rows[0][LAG_K3_KL] == 0.0  # step 0 samples the starting policy, which is the trained one
    assert rows[0]["mismatch/bitwise_equal_frac"] == 1.0
    assert all(r[LAG_K3_KL] > 0 for r in rows[1:])
    assert all(r["mismatch/bitwise_equal_frac"] < 1.0 for r in rows[1:])


def test_lag_composes_with_injection(tmp_path):
    """Injection stays on the rollout path: with lag and an injected mismatch both parts are nonzero, and the TIM
    at step 0 (no lag yet) is the total."""
    _run(_cfg(tmp_path, "both", "rollout.policy_lag=1", "inject.mode=logit_scale", "inject.epsilon=-0.3", "steps=4"))
    rows = _rows(tmp_path, "both")
    assert rows[0][LAG_K3_KL] == 0.0 and rows[0][TIM_K3_KL] == rows[0][K3_KL] > 0
    for r in rows[1:]:
        assert r[LAG_K3_KL] > 0 and r[TIM_K3_KL] > 0 and r[K3_KL] > 0


def test_resume_keeps_the_lag_snapshots(tmp_path, monkeypatch):
    _run(_cfg(tmp_path, "full", "rollout.policy_lag=2"))
    reference = _rows(tmp_path, "full")
    cfg = _cfg(tmp_path, "cut", "rollout.policy_lag=2")
    real_step = interrupt_trainer_at(monkeypatch, 5)
    assert _run(cfg)["status"] == "interrupted"
    monkeypatch.setattr(Trainer, "step", real_step)
    snapshots = load_file(str(latest_checkpoint(tmp_path / "cut") / "snapshots.safetensors"))
    assert len({k.split(".", 1)[0] for k in snapshots}) == 2  # the ring: the last two steps' weights
    assert _run(cfg, resume=True)["status"] == "completed"  # from the checkpoint after step 3; steps 4, 5 again
    assert _rows(tmp_path, "cut") == reference
    a = load_file(str(latest_checkpoint(tmp_path / "full") / "checkpoint.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "cut") / "checkpoint.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_lag_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="rollout.policy_lag"):
        _cfg(tmp_path, "bad", "rollout.policy_lag=-1")
    with pytest.raises(ConfigError, match="rollout.policy_lag"):
        _cfg(tmp_path, "bad", "rollout.policy_lag=1.5")


def test_total_k3_is_the_sum_when_drift_and_mismatch_are_uncorrelated():
    """k3 ≈ r²/2 for small r, so with r_total = a + b the total is lag + TIM + mean(a·b): the sum where the two are
    uncorrelated (tolerance: the cross term's sampling error, a few % at 200k tokens), twice the sum where each
    token's drift and mismatch are equal."""
    gen = torch.Generator().manual_seed(0)
    roll = -torch.rand(200_000, generator=gen, dtype=torch.float64) * 3
    a = torch.randn(200_000, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(200_000, generator=gen, dtype=torch.float64) * 0.03
    behaviour = roll + b
    split = lag_split_metrics([behaviour + a], [behaviour], [roll])
    total = mismatch_metrics([behaviour + a], [roll])[K3_KL]
    assert split[LAG_K3_KL] == pytest.approx(0.05**2 / 2, rel=0.03)
    assert split[TIM_K3_KL] == pytest.approx(0.03**2 / 2, rel=0.03)
    assert total == pytest.approx(split[LAG_K3_KL] + split[TIM_K3_KL], rel=0.03)
    same = lag_split_metrics([roll + 2 * b], [roll + b], [roll])
    assert mismatch_metrics([roll + 2 * b], [roll])[K3_KL] == pytest.approx(2 * (same[LAG_K3_KL] + same[TIM_K3_KL]),
                                                                            rel=0.03)


# ------------------------------------------------------------------------------------- the live monitor's split
def _sides():
    gen = torch.Generator().manual_seed(1)
    roll = [-torch.rand(n, generator=gen, dtype=torch.float64) * 2 for n in (5, 3, 7)]
    behaviour = [r + torch.randn(r.shape, generator=gen, dtype=torch.float64) * 0.01 for r in roll]
    current = [b + torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.05 for b in behaviour]
    return roll, behaviour, current


def test_live_monitor_reports_lag_drift_and_tim_apart(tmp_path):
    from vexact.live import LiveMonitor

    roll, behaviour, current = _sides()
    with LiveMonitor(tmp_path / "live") as monitor:  # the split needs no lag (that chooses a map's curve)
        row = monitor.step(0, roll, current, behaviour_logprobs=behaviour)
        plain = monitor.step(1, roll, current)
        exact = monitor.step(2, behaviour, current, behaviour_logprobs=behaviour)  # a rollout equal to its trainer
    assert row[LAG_K3_KL] == mismatch_metrics(current, behaviour)[K3_KL] > 0
    assert row[TIM_K3_KL] == mismatch_metrics(behaviour, roll)[K3_KL] > 0
    assert row[K3_KL] == mismatch_metrics(current, roll)[K3_KL]
    assert LAG_K3_KL not in plain and TIM_K3_KL not in plain and plain[K3_KL] == row[K3_KL]
    assert exact[TIM_K3_KL] == 0.0 and exact[LAG_K3_KL] == exact[K3_KL] == row[LAG_K3_KL]
    written = read_metrics(tmp_path / "live" / "metrics.jsonl")
    assert written[0][LAG_K3_KL] == row[LAG_K3_KL] and written[0][TIM_K3_KL] == row[TIM_K3_KL]


def test_live_monitor_split_with_padded_tensors_and_a_mask(tmp_path):
    from vexact.live import LiveMonitor

    roll, behaviour, current = _sides()

    def padded(rows):
        out = torch.full((3, 7), float("nan"), dtype=torch.float64)
        for b, r in enumerate(rows):
            out[b, : len(r)] = r
        return out

    mask = padded([torch.ones(len(r)) for r in roll]).isfinite()
    with LiveMonitor(tmp_path / "live") as monitor:  # the split needs no lag (that chooses a map's curve)
        row = monitor.step(0, padded(roll), padded(current), mask, behaviour_logprobs=padded(behaviour))
        with pytest.raises(ValueError, match="behaviour_logprobs"):
            monitor.step(1, padded(roll), padded(current), mask, behaviour_logprobs=padded(behaviour)[:, :5])
    assert row[LAG_K3_KL] == mismatch_metrics(current, behaviour)[K3_KL]
    assert row[TIM_K3_KL] == mismatch_metrics(behaviour, roll)[K3_KL]


@pytest.mark.parametrize("lag, message", [
    (-1, "policy_lag must be an integer >= 0"), (1.5, "policy_lag must be an integer"),
    (True, "policy_lag must be an integer"),
    (2, "policy_lag chooses a curve of scaling_map: give scaling_map too"),  # nothing else reads it: not ignored
])
def test_live_monitor_refuses_a_bad_lag(tmp_path, lag, message):
    from vexact.live import LiveMonitor

    with pytest.raises(ValueError, match=message):
        LiveMonitor(tmp_path / "live", policy_lag=lag)
    LiveMonitor(tmp_path / "live", policy_lag=0).close()  # on-policy, the default: nothing to choose


# --------------------------------------------------------------------------------------------- the map's lag axis
def _lag_sweep(tmp: Path):
    """Two curves of one correction and source, at policy lag 0 (threshold 0.1 at T 8, alpha 1) and lag 4 (a tenth
    of it), the lag read from each point's config (here: its overrides, as a sweep grid sets it)."""
    from vexact.sweeps.sweep_data import PointData, SweepData

    points = []
    for lag, thr8 in ((0, 1e-1), (4, 1e-2)):
        for length in (8, 16, 32, 64):
            thr = thr8 * (length / 8.0) ** -1.0
            for seed in range(4):
                for f in (0.25, 0.5, 2.0, 4.0):
                    overrides = {"task.max_len": length, "seed": seed, "inject.value": f, "rollout.policy_lag": lag}
                    name = ",".join(f"{k}={v}" for k, v in overrides.items())
                    collapse = {"collapsed": f > 1, "mean_k3_kl_before_collapse": thr * f * (1 + 0.01 * seed)}
                    points.append(PointData(name, tmp / name, overrides, "completed",
                                            summary={"status": "completed", "collapse": collapse},
                                            metrics=[{"step": s, "response_length/mean": float(length)}
                                                     for s in range(3)]))
    keys = ["task.max_len", "inject.value", "rollout.policy_lag"]
    return SweepData(tmp, "synthetic", {k: [] for k in keys + ["seed"]}, keys, points)


def test_map_curves_carry_their_lag_and_a_verdict_takes_the_users(tmp_path):
    from vexact.map.fit import scaling
    from vexact.map.verdict import MAP_KEYS, load_map, place_on_map

    result = scaling(_lag_sweep(tmp_path))
    lags = {c["policy_lag"]: c for c in result["curves"]}
    assert set(lags) == {0, 4} and all(c["status"] == "fitted" for c in lags.values())
    assert lags[4]["log10_prefactor"] < lags[0]["log10_prefactor"] - 0.5  # a tenth of the threshold
    on_policy = place_on_map(result, 1e-3, 32.0)
    lagged = place_on_map(result, 1e-3, 32.0, policy_lag=4)
    assert list(on_policy) == list(MAP_KEYS)
    assert on_policy["policy_lag"] == 0 and lagged["policy_lag"] == 4
    assert lagged["threshold_50"] < on_policy["threshold_50"] / 3
    with pytest.raises(ValueError, match="no curve at policy lag 1 .*lag 0, 4"):
        place_on_map(result, 1e-3, 32.0, policy_lag=1)
    shipped = load_map()  # on-policy curves; bypass and recompute at lags 1, 4, 8 (policy_lag_sweep.yaml, T ~ 8)
    assert {c["policy_lag"] for c in shipped["curves"]} == {0, 1, 4, 8}
    assert place_on_map(shipped, 1e-3, 100.0)["policy_lag"] == 0
    lagged = place_on_map(shipped, 0.1, 8.0, policy_lag=4)
    assert lagged["policy_lag"] == 4 and lagged["correction"] == "bypass" and lagged["threshold_50"] is None
    assert "no collapse measured up to k3 0.43" in lagged["verdict"]  # a bound: no lagged run collapsed
    assert "has no curve for your correction" in place_on_map(shipped, 0.1, 8.0, "token_tis", policy_lag=4)["verdict"]
    with pytest.raises(ValueError, match="no curve at policy lag 2"):
        place_on_map(shipped, 1e-3, 100.0, policy_lag=2)


def test_compare_map_policy_lag_flag(tmp_path, capsys):
    import json

    from vexact.cli import main
    from vexact.map.scaling_report import write_scaling

    m = tmp_path / "m"
    m.mkdir()
    map_file = write_scaling(_lag_sweep(m), m)[0][0]
    roll, train = tmp_path / "roll.jsonl", tmp_path / "train.jsonl"
    roll.write_text("".join(json.dumps({"id": i, "logprobs": [-1.0] * 30}) + "\n" for i in range(4)))
    train.write_text("".join(json.dumps({"id": i, "logprobs": [-0.99] * 30}) + "\n" for i in range(4)))
    verdicts = {}
    for lag in (None, 0, 4):
        out = tmp_path / f"out{lag}.json"
        flag = [] if lag is None else ["--policy-lag", str(lag)]
        assert main(["compare", str(roll), str(train), f"--map={map_file}", *flag, "--json", str(out)]) == 0
        verdicts[lag] = json.loads(out.read_text())["map"]
    assert verdicts[None] == verdicts[0] and verdicts[0]["policy_lag"] == 0
    assert verdicts[4]["policy_lag"] == 4 and verdicts[4]["threshold_50"] < verdicts[0]["threshold_50"]
    capsys.readouterr()
    assert main(["compare", str(roll), str(train), f"--map={map_file}", "--policy-lag", "8"]) == 2
    err = capsys.readouterr().err
    assert "no curve at policy lag 8" in err and "Traceback" not in err
    assert main(["compare", str(roll), str(train), "--policy-lag", "4"]) == 2
    assert "--policy-lag chooses a curve of the collapse map: give --map too" in capsys.readouterr().err


def test_live_monitor_verdict_at_the_users_lag(tmp_path):
    from vexact.live import LiveMonitor
    from vexact.map.fit import scaling

    result = scaling(_lag_sweep(tmp_path / "sweep"))
    roll, behaviour, current = _sides()
    with LiveMonitor(tmp_path / "a", scaling_map=result, policy_lag=4) as monitor:
        lagged = monitor.step(0, roll, current, behaviour_logprobs=behaviour)["map"]
    with LiveMonitor(tmp_path / "b", scaling_map=result) as monitor:
        on_policy = monitor.step(0, roll, current)["map"]
    assert lagged["policy_lag"] == 4 and on_policy["policy_lag"] == 0
    assert lagged["threshold_50"] < on_policy["threshold_50"]
    with pytest.raises(ValueError, match="no curve at policy lag 2"):
        LiveMonitor(tmp_path / "c", scaling_map="default", policy_lag=2)
    LiveMonitor(tmp_path / "d", scaling_map="default", policy_lag=4).close()  # the shipped map has lag 4 curves


def test_build_map_names_a_lagged_curve_by_its_lag(tmp_path, capsys):
    from vexact.map.build import main as map_main
    from vexact.map.scaling_report import write_scaling

    m = tmp_path / "m"
    m.mkdir()
    scaling_file = write_scaling(_lag_sweep(m), m)[0][0]
    assert map_main(["build-map", str(tmp_path / "map.json"), str(scaling_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("bypass / policy lag 4 (fitted") for line in lines)
    assert any(line.startswith("bypass (fitted") for line in lines)  # lag 0: no lag named
