"""vexact.live.LiveMonitor: compare's metrics and gates, one row per step of the user's own trainer.

The reference is ``vexact compare`` itself: the same tensors dumped to a file and run through ``run_compare`` /
``check_gates`` must give the same numbers, bit for bit, as the live row."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import require_optional
from safetensors.torch import save_file

from vexact import metric_keys
from vexact.live import POSITIVE_LOGPROB_TOLERANCE, GateFailed, Gates, LiveMonitor
from vexact.real.compare import CompareSettings, check_gates, run_compare
from vexact.records.metrics_log import scalars
from vexact.records.runlog import read_metrics


def _batch(seed: int = 0, b: int = 6, t: int = 12, noise: float = 1e-3) -> tuple[torch.Tensor, ...]:
    """A padded batch as verl/TRL hold it: rollout and training log-probs [B, T] (float32) and a 0/1 int mask with
    responses of different lengths; padding holds junk (positive values and NaN) that must never be read."""
    g = torch.Generator().manual_seed(seed)
    train = torch.log_softmax(torch.randn(b, t, 50, generator=g), -1)[..., 0]
    roll = (train + noise * torch.randn(b, t, generator=g)).clamp(max=0.0)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).int()
    roll = roll.masked_fill(mask == 0, 5.0)
    train = train.masked_fill(mask == 0, float("nan"))
    return roll, train, mask


def _with(values: torch.Tensor, b: int, t: int, value: float) -> torch.Tensor:
    out = values.clone()
    out[b, t] = value
    return out


def _dump(tmp_path, roll, train, mask):
    path = tmp_path / "batch.safetensors"
    save_file({"rollout_log_probs": roll.contiguous(), "old_log_probs": train.contiguous(),
               "response_mask": mask.contiguous()}, str(path))
    return run_compare(CompareSettings(rollout=path)).summary


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_row_equals_compare_on_the_same_tensors(tmp_path):
    roll, train, mask = _batch()
    gates = Gates(fail_on_mismatch=True, max_k3=1e-7, max_abs_dlogp=1.0)
    with LiveMonitor(tmp_path / "live", gates=gates) as monitor:
        row = monitor.step(0, roll, train, mask)
    summary = _dump(tmp_path, roll, train, mask)
    metrics = summary["metrics"]
    assert set(metrics) <= set(row)
    differ = {k: (row[k], metrics[k]) for k in metrics if not _same(row[k], metrics[k])}
    assert not differ  # exact equality, key by key
    assert row["by_position"] == summary["by_position"]
    assert row["gates"] == check_gates(summary, True, 1e-7, 1.0)
    assert [g["passed"] for g in row["gates"]] == [False, False, True]  # noise 1e-3: not equal, k3 above 1e-7
    assert row["live/gates_failed"] == 2 and row["outcome"] == "ok"
    assert row["live/sequences"] == 6 and row["mismatch/tokens"] == int(mask.sum())
    assert row["live/mean_response_length"] == int(mask.sum()) / 6  # tokens / sequences, as compare --map
    assert "map" not in row  # no scaling_map given: no verdict key
    # every number is a registered key (vexact.metric_keys): compare's, and the live/* bookkeeping (writer "live")
    assert metric_keys.unregistered(scalars(row)) == []
    assert {"live/gates_failed", "live/mean_response_length", "live/sequences"} <= set(scalars(row))

    # what was written is the row (NaN-safe JSON), one line
    written = read_metrics(tmp_path / "live" / "metrics.jsonl")
    assert len(written) == 1 and written[0]["step"] == 0
    assert written[0]["rollout_corr/k3_kl"] == row["rollout_corr/k3_kl"]


def test_counter_case_the_padding_is_never_read(tmp_path):
    """If the mask were ignored, the junk in the padding would reach the metrics: with mask=None the same call is
    refused (the padding's +5.0 is a positive log-prob) -- so the equality above is not vacuous."""
    roll, train, mask = _batch()
    with pytest.raises(ValueError, match=r"rollout_logprobs\[0, \d+\] is 5: a log-prob above 0"):
        LiveMonitor(tmp_path / "a").step(0, roll, train, None)


def test_zero_mismatch_is_exactly_zero_and_passes_every_gate(tmp_path):
    _, train, mask = _batch(noise=0.0)
    train = train.nan_to_num(0.0)
    monitor = LiveMonitor(tmp_path, gates=Gates(fail_on_mismatch=True, max_k3=0.0, max_abs_dlogp=0.0))
    row = monitor.step(3, train.clone(), train, mask)
    monitor.close()
    assert row["mismatch/bitwise_equal_frac"] == 1.0
    for key in ("rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/chi2_token", "mismatch/abs_dlogp_max"):
        assert row[key] == 0.0, key
    assert row["live/gates_failed"] == 0 and all(g["passed"] for g in row["gates"])


def test_mixed_dtypes_compare_values_and_sequences_match_padded(tmp_path):
    """bf16 rollout vs float32 trainer: values widened exactly, as compare reads tensor files; a list of 1-D
    tensors gives the same row as the padded form."""
    roll, train, mask = _batch(seed=1)
    roll16 = roll.to(torch.bfloat16)
    padded = LiveMonitor(tmp_path / "p").step(0, roll16, train, mask)
    seqs_roll = [roll16[b][mask[b].bool()] for b in range(len(mask))]
    seqs_train = [train[b][mask[b].bool()] for b in range(len(mask))]
    listed = LiveMonitor(tmp_path / "l").step(0, seqs_roll, seqs_train)
    assert padded["rollout_corr/k3_kl"] == listed["rollout_corr/k3_kl"]
    assert padded["mismatch/bitwise_equal_frac"] == listed["mismatch/bitwise_equal_frac"]
    summary = _dump(tmp_path, roll16, train, mask)
    assert padded["rollout_corr/k3_kl"] == summary["metrics"]["rollout_corr/k3_kl"]


@pytest.mark.parametrize("call, message", [
    (lambda r, t, m: (r, t[:, :-1], m), r"must be \[B, T\] tensors of one shape"),
    (lambda r, t, m: (r, t, m[:, :-1]), r"mask has shape \[6, 11\] but the log-probs have \[6, 12\]"),
    (lambda r, t, m: (r.long(), t, m), r"rollout_logprobs must be a floating-point torch tensor of log-probs, got "
                                       r"torch.int64"),
    (lambda r, t, m: (r, t, m * 2), "mask holds values other than 0 and 1"),
    (lambda r, t, m: (r.tolist(), t, m), "must both be"),
    (lambda r, t, m: (r, _with(t, 2, 0, 0.7), m), r"train_logprobs\[2, 0\] is 0\.7: a log-prob above 0"),
    (lambda r, t, m: ([r[0]], [t[0], t[1]], None), "got 1 rollout sequences but 2 sequences in train_logprobs"),
    (lambda r, t, m: ([r[0]], [t[0]], m), "mask is for padded"),
    (lambda r, t, m: ([r[0]], 3, None), r"train_logprobs must be a \[B, T\] tensor \(or numpy array\) or a sequence of "
                                        r"1-D tensors, got int"),  # was a TypeError from len(3)
    (lambda r, t, m: (None, None, None), "rollout_logprobs must be a .* got NoneType"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, call, message):
    roll, train, mask = _batch()
    monitor = LiveMonitor(tmp_path)
    with pytest.raises(ValueError, match=message):
        monitor.step(0, *call(roll, train, mask))
    assert not (tmp_path / "metrics.jsonl").exists()


def _random_side(rng: random.Random):
    """One side of a step as a caller might pass it, right or wrong: a [B, T] tensor of log-probs (B, T from 0),
    or it in another dtype or rank, with a NaN, inf or positive value, as numpy, ragged lists, nested lists, with
    grad, non-contiguous, or not a tensor at all."""
    values = -torch.rand(rng.randint(0, 4), rng.randint(0, 5), dtype=torch.float64) * 3
    kind = rng.choice(["as is", "as is", "dtype", "rank", "non-finite", "positive", "numpy", "ragged", "nested",
                       "grad", "strided", "number", "none"])
    if kind == "dtype":
        return values.to(rng.choice([torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool]))
    if kind == "rank":
        return values.reshape(-1) if rng.random() < 0.5 else values[None]
    if kind in ("non-finite", "positive") and values.numel():
        values.view(-1)[0] = 0.5 if kind == "positive" else rng.choice([math.nan, math.inf, -math.inf])
    return {"numpy": lambda: values.numpy(), "ragged": lambda: [row[: rng.randint(0, len(row))] for row in values],
            "nested": lambda: [[row.tolist()] for row in values], "grad": lambda: values.float().requires_grad_(),
            "strided": lambda: torch.cat([values, values], 1)[:, ::2], "number": lambda: 3,
            "none": lambda: None}.get(kind, lambda: values)()


@pytest.mark.parametrize("seed", range(4))
def test_random_inputs_are_a_row_or_one_value_error(tmp_path, seed):
    """A seeded fuzz of ``step``'s inputs (``_random_side`` for each side, the training side half the time a copy of
    the rollout's; a mask of another shape, dtype or values, or none): each call writes a row or raises one
    ValueError -- never another exception from inside (a sequence beside a number was a TypeError)."""
    rng = random.Random(seed)
    masks = [None, None, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([[1, 0, 2]])]
    for trial in range(50):
        rollout = _random_side(rng)
        train = rollout.clone() if isinstance(rollout, torch.Tensor) and rng.random() < 0.5 else _random_side(rng)
        try:
            LiveMonitor(tmp_path / str(trial)).step(0, rollout, train, rng.choice(masks))
        except ValueError as refused:
            assert "\n" not in str(refused)


@pytest.mark.parametrize("extra", [{"mismatch/tokens": 1}, {"live/x": 1}, {"step": 3}, {"map": {}}])
def test_extra_keys_may_not_shadow_the_rows_own(tmp_path, extra):
    roll, train, mask = _batch()
    monitor = LiveMonitor(tmp_path)
    with pytest.raises(ValueError, match="would shadow the row's own"):
        monitor.step(0, roll, train, mask, extra=extra)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert monitor.step(0, roll, train, mask, extra={"my/epoch": 2})["my/epoch"] == 2


@pytest.mark.parametrize("extra, message", [
    ({"loss": torch.tensor(0.5)}, r"extra\['loss'\] \(Tensor\) is not JSON"),
    ({"lr": np.float32(1e-3)}, r"extra\['lr'\] \(float32\) is not JSON"),
    ({"nested": [1, {"a": object()}]}, r"extra\['nested'\] \(list\) is not JSON"),
    ({3: 1}, r"extra keys must be strings, got 3 \(int\)"),
    ([("epoch", 1)], "extra must be a dict, got list"),
    ({"note": "inf"}, r"^extra\['note'\] holds the string 'inf', which metrics.jsonl reads back as a number"),
    ({"tags": ["ok", {"why": " NaN "}]}, r"^extra\['tags'\] holds the string ' NaN ', which metrics.jsonl reads"),
])
def test_extra_that_json_cannot_hold_is_a_value_error(tmp_path, extra, message):
    """The docstring promises ValueError for a caller mistake: a tensor, a numpy scalar or any other non-JSON value in
    ``extra`` is one (it was json's TypeError, from inside the writer), and nothing is written. So is a string that
    spells NaN/Inf: the log's own spelling of those numbers, it read back as a float (and a live view plotted it)."""
    roll, train, mask = _batch()
    monitor = LiveMonitor(tmp_path)
    with pytest.raises(ValueError, match=message):
        monitor.step(0, roll, train, mask, extra=extra)
    assert not (tmp_path / "metrics.jsonl").exists()
    row = monitor.step(0, roll, train, mask, extra={"my/lr": float(np.float32(1e-3)), "my/nan": float("nan"),
                                                    "my/tags": ["a", None, True], "my/note": "infinite"})
    monitor.close()
    assert row["my/tags"] == ["a", None, True]
    written = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert written["my/lr"] == row["my/lr"] and written["my/tags"] == ["a", None, True]
    assert written["my/note"] == "infinite"


def test_numpy_arrays_are_read_as_tensors_of_their_dtype(tmp_path):
    """numpy arrays (padded, with a numpy or torch mask, or as per-sequence items) give exactly the row of the same
    values as tensors; an array that holds no numbers is one error naming the side."""
    roll, train, mask = _batch(seed=2)
    as_tensors = LiveMonitor(tmp_path / "t").step(0, roll, train, mask)
    for r, t, m, where in ((roll.numpy(), train.numpy(), mask.numpy(), "np"),
                           (roll.numpy(), train, mask.numpy().astype(bool), "mixed"),
                           (roll.numpy(), train.numpy(), mask, "np_torch_mask")):
        row = LiveMonitor(tmp_path / where).step(0, r, t, m)
        differ = [k for k in as_tensors if not _same(row[k], as_tensors[k])]
        assert differ == [], where
    keep = mask.bool()
    seqs = LiveMonitor(tmp_path / "seq").step(0, [roll[b][keep[b]].numpy() for b in range(len(mask))],
                                              [train[b][keep[b]].numpy() for b in range(len(mask))])
    assert seqs["rollout_corr/k3_kl"] == as_tensors["rollout_corr/k3_kl"]
    with pytest.raises(ValueError, match=r"rollout_logprobs is a numpy array of dtype object, not numbers"):
        LiveMonitor(tmp_path / "o").step(0, roll.numpy().astype(object), train, mask)
    with pytest.raises(ValueError, match=r"train_logprobs must be a floating-point torch tensor of log-probs, got "
                                         r"torch.int64"):
        LiveMonitor(tmp_path / "i").step(0, roll, train.nan_to_num(0).numpy().astype(np.int64), mask)


def test_positive_tolerance_is_the_boundary(tmp_path):
    roll, train, mask = _batch()
    train = train.nan_to_num(0.0).double()
    roll = roll.double().masked_fill(mask == 0, 0.0)
    train[0, 0] = POSITIVE_LOGPROB_TOLERANCE  # at the tolerance: accepted
    LiveMonitor(tmp_path / "ok").step(0, roll, train, mask)
    train[0, 0] = 2 * POSITIVE_LOGPROB_TOLERANCE
    with pytest.raises(ValueError, match=r"train_logprobs\[0, 0\] is 2e-06"):
        LiveMonitor(tmp_path / "bad").step(0, roll, train, mask)


def test_non_finite_and_empty_steps_are_recorded_outcomes(tmp_path):
    roll, train, mask = _batch()
    roll = roll.masked_fill(mask == 0, 0.0)
    roll[1, 0] = float("nan")
    roll[2, 0] = float("inf")
    monitor = LiveMonitor(tmp_path, gates=Gates(max_k3=1e-3))
    row = monitor.step(0, roll, train, mask)
    assert row["outcome"] == "non-finite" and row["live/nonfinite"] == 2
    assert "rollout_corr/k3_kl" not in row
    assert row["live/gates_failed"] == 1 and row["gates"][0]["message"].startswith("not computed: 2 of")
    empty = monitor.step(1, roll, train, torch.zeros_like(mask))
    assert empty["outcome"] == "no tokens" and empty["mismatch/tokens"] == 0
    fine = monitor.step(2, *_batch()[:2], mask)
    monitor.close()
    assert fine["outcome"] == "ok"
    assert [r["outcome"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["non-finite", "no tokens", "ok"]


def test_raise_mode_writes_the_row_then_raises(tmp_path):
    roll, train, mask = _batch()
    monitor = LiveMonitor(tmp_path, gates=Gates(max_k3=0.0), on_gate_failure="raise")
    with pytest.raises(GateFailed, match=r"step 0: gate failed: --max-k3: rollout_corr/k3_kl = .* > 0") as err:
        monitor.step(0, roll, train, mask)
    monitor.close()
    assert err.value.row["live/gates_failed"] == 1
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1
    # the same step in record mode (the default) raises nothing
    assert LiveMonitor(tmp_path / "r", gates=Gates(max_k3=0.0)).step(0, roll, train, mask)["live/gates_failed"] == 1


def test_steps_must_increase_and_restarts_need_resume(tmp_path):
    roll, train, mask = _batch()
    monitor = LiveMonitor(tmp_path)
    for step in (1, 2, 3):
        monitor.step(step, roll, train, mask)
    with pytest.raises(ValueError, match="step 3 does not follow step 3"):
        monitor.step(3, roll, train, mask)
    with pytest.raises(ValueError, match="non-negative integer"):
        monitor.step(-1, roll, train, mask)
    monitor.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "torn')  # a kill mid-write
    with pytest.raises(ValueError, match=r"already holds 3 steps \(last step 3\): pass resume=True"):
        LiveMonitor(tmp_path)
    resumed = LiveMonitor(tmp_path, resume=True)
    resumed.step(3, roll, train, mask)  # the trainer restarts from its step-3 checkpoint
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")


@pytest.mark.parametrize("kwargs, message", [
    ({"backends": ("jsonl", "csv")}, "unknown backend 'csv'"),
    ({"backends": ("tensorboard", "tensorboard")}, "lists a name twice"),
    ({"on_gate_failure": "stop"}, "on_gate_failure must be one of"),
    ({"wandb_mode": "cloud"}, r"^wandb_mode must be 'offline' or 'online', got 'cloud'$"),
    ({"gates": Gates}, "gates must be a vexact.live.Gates"),
    # one name as a string was read letter by letter: "unknown backend 't'"
    ({"backends": "tensorboard"}, r"^backends must be a sequence of names, e.g. \('jsonl', 'tensorboard'\), got the "
                                  r"string 'tensorboard'$"),
])
def test_bad_settings(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LiveMonitor(tmp_path, **kwargs)


def test_the_monitor_takes_the_wandb_modes_a_run_config_takes():
    """LiveMonitor's wandb_mode and a run's logging.wandb_mode are one Literal: a mode added is taken by both."""
    import typing

    from vexact.rl.log_backends import WANDB_MODES, WandbSettings

    monitor = typing.get_args(typing.get_type_hints(LiveMonitor.__init__)["wandb_mode"])
    assert monitor == WANDB_MODES == typing.get_args(typing.get_type_hints(WandbSettings)["wandb_mode"])


@pytest.mark.parametrize("kwargs, message", [
    ({"max_k3": -1.0}, "max_k3 must be a finite number >= 0"),
    ({"max_abs_dlogp": float("nan")}, "max_abs_dlogp must be a finite number"),
    ({"fail_on_mismatch": 1}, "fail_on_mismatch must be True or False"),
])
def test_bad_gates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Gates(**kwargs)


def test_tensorboard_view_holds_the_rows(tmp_path):
    require_optional("tensorboard", "pip install 'vexact[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    roll, train, mask = _batch()
    with LiveMonitor(tmp_path, backends=("jsonl", "tensorboard")) as monitor:
        rows = [monitor.step(step, roll, train, mask) for step in (0, 5)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("rollout_corr/k3_kl")
    assert [e.step for e in scalars] == [0, 5]
    assert scalars[0].value == pytest.approx(rows[0]["rollout_corr/k3_kl"], rel=1e-6)  # stored as float32


@pytest.mark.parametrize("scaling_map, message", [
    ({"status": "fitted"}, r"scaling_map is not a map: no 'horizon_range' key"),
    ({"horizon_range": [8.0, 128.0]}, r"scaling_map is not a map: no 'status' key"),
    ({"status": "fitted", "horizon_range": [8.0, 128.0]}, r"scaling_map cannot place a step: no 'log10_prefactor'"),
    ({"status": "fitted", "horizon_range": [0, 128.0], "log10_prefactor": -1.0, "alpha": 0.5},
     r"scaling_map cannot place a step: .*horizon"),
    ({"status": "fitted", "horizon_range": "8..128"},
     r"scaling_map cannot place a step: the map's bypass curve has no measured horizons \(horizon_range\)"),
    (42, r"scaling_map must be a map dict, the path of a scaling.json or 'default', got int"),
])
def test_a_malformed_scaling_map_is_refused_at_construction(tmp_path, scaling_map, message):
    """A map dict no step could be placed on is one ValueError when the monitor is built, not a ``map_error`` on
    every row of the run."""
    with pytest.raises(ValueError, match=message):
        LiveMonitor(tmp_path, scaling_map=scaling_map)
    assert not tmp_path.joinpath("metrics.jsonl").exists()


FITTED_MAP = {"status": "fitted", "horizon_range": [8.0, 128.0], "log10_prefactor": -1.0, "alpha": 0.5,
              "replicates": [[-1.2, 0.4], [-1.0, 0.5], [-0.8, 0.6]], "horizons": [], "note": "synthetic, for the test"}
"""A scaling.json with a fitted law threshold = 10^-1 * T^-0.5 (made up here: the test checks the plumbing)."""


def test_scaling_map_verdict_or_clear_refusal(tmp_path):
    """Every ok row carries its ``place_on_map`` verdict (``vexact.map.verdict``) for the step's k3 and mean
    response length. Rows never carry ``map`` unless a map was given (test_row_equals_compare_on_the_same_tensors)."""
    roll, train, mask = _batch()
    map_file = tmp_path / "scaling.json"
    map_file.write_text(json.dumps(FITTED_MAP))
    from vexact.map import verdict

    summary = _dump(tmp_path, roll, train, mask)
    expected, _ = verdict.compare_map(summary, map_file)  # what `vexact compare BATCH --map FILE --json` writes
    assert summary["tokens"] / summary["sequences"] == int(mask.sum()) / len(mask)
    for given in (map_file, verdict.load_map(map_file)):  # a path (read with load_map) or a loaded map
        with LiveMonitor(tmp_path / f"live_{type(given).__name__}", scaling_map=given) as monitor:
            row = monitor.step(0, roll, train, mask)
        assert row["map"] == expected and row["map"]["verdict"]
        assert row["map"]["horizon"] == row["live/mean_response_length"]
    with pytest.raises(ValueError, match="map file not found"):
        LiveMonitor(tmp_path / "live_missing", scaling_map=tmp_path / "absent.json")
    # a step the map cannot place (no tokens: horizon 0) is an outcome without metrics, so no map either
    with LiveMonitor(tmp_path / "live_empty", scaling_map=map_file) as monitor:
        empty = monitor.step(0, roll, train, torch.zeros_like(mask))
    assert "map" not in empty and empty["outcome"] == "no tokens"


# --------------------------------------------------------------------------------------------------- verl recipe
def _verl_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch as verl 0.9.1's driver holds it after _compute_old_log_prob: float32 log-probs, an int64 mask."""
    roll, train, mask = _batch(seed)
    return {"rollout_log_probs": roll, "old_log_probs": train.nan_to_num(0.0), "response_mask": mask.long(),
            "responses": torch.zeros_like(mask, dtype=torch.long)}


def test_verl_batch_row_equals_compare_on_its_dump(tmp_path):
    from types import SimpleNamespace

    from vexact.integrations.verl import observe_batch

    batch = _verl_batch()
    path = tmp_path / "verl_batch.safetensors"  # the batch dumped as the README's verl recipe does
    save_file({k: v.contiguous() for k, v in batch.items()}, str(path))
    summary = run_compare(CompareSettings(rollout=path)).summary  # compare's defaults are verl's keys
    with LiveMonitor(tmp_path / "live") as monitor:
        row = observe_batch(monitor, SimpleNamespace(batch=batch), 1)  # DataProto-like: tensors in .batch
        # old_log_prob as _compute_old_log_prob returns it (its own DataProto), the batch without the key yet
        without = {k: v for k, v in batch.items() if k != "old_log_probs"}
        row2 = observe_batch(monitor, without, 2, old_log_prob=SimpleNamespace(batch={"old_log_probs":
                                                                                     batch["old_log_probs"]}))
    for r in (row, row2):
        assert all(_same(r[k], v) for k, v in summary["metrics"].items())


def test_verl_batch_refusals(tmp_path):
    from vexact.integrations.verl import observe_batch

    batch = _verl_batch()
    monitor = LiveMonitor(tmp_path)
    with pytest.raises(ValueError, match=r"calculate_log_probs=True"):
        observe_batch(monitor, {k: v for k, v in batch.items() if k != "rollout_log_probs"}, 1)
    with pytest.raises(ValueError, match=r"call after _compute_old_log_prob"):
        observe_batch(monitor, {k: v for k, v in batch.items() if k != "old_log_probs"}, 1)
    bypass = {**batch, "old_log_probs": batch["rollout_log_probs"]}  # what verl's apply_bypass_mode does
    with pytest.raises(ValueError, match=r"bypass mode"):
        observe_batch(monitor, bypass, 1)
    with pytest.raises(ValueError, match=r"neither 'response_mask' nor 'attention_mask'"):
        observe_batch(monitor, {k: v for k, v in batch.items() if k != "response_mask"}, 1)
    # verl's compute_response_mask: the last T columns of attention_mask (prompt + response)
    prompt = torch.ones(len(batch["response_mask"]), 3, dtype=torch.long)
    derived = {k: v for k, v in batch.items() if k != "response_mask"}
    derived["attention_mask"] = torch.cat([prompt, batch["response_mask"]], 1)
    a = observe_batch(monitor, derived, 1)
    b = observe_batch(monitor, batch, 2)
    assert a["rollout_corr/k3_kl"] == b["rollout_corr/k3_kl"] and a["mismatch/tokens"] == b["mismatch/tokens"]


def test_verl_batch_of_numpy_arrays_or_other_values(tmp_path):
    """A plain dict of numpy arrays gives the row of the same tensors (it was an AttributeError: 'numpy.ndarray' object
    has no attribute 'data_ptr'); bypass mode's one array is still refused; a value that is no [B, T] tensor or array,
    or no monitor, is one ValueError naming it."""
    from vexact.integrations.verl import observe_batch

    batch = _verl_batch()
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    a = observe_batch(LiveMonitor(tmp_path / "t"), batch, 1)
    b = observe_batch(LiveMonitor(tmp_path / "n"), as_numpy, 1)
    assert all(_same(a[k], b[k]) for k in a)
    monitor = LiveMonitor(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"bypass mode"):
        observe_batch(monitor, {**as_numpy, "old_log_probs": as_numpy["rollout_log_probs"]}, 1)
    with pytest.raises(ValueError, match=r"^batch\['rollout_log_probs'\] must be a \[B, T\] tensor \(or numpy "
                                         r"array\), as in verl's batch; got list$"):
        observe_batch(monitor, {**batch, "rollout_log_probs": batch["rollout_log_probs"].tolist()}, 1)
    derived = {"rollout_log_probs": batch["rollout_log_probs"][0], "old_log_probs": batch["old_log_probs"][0],
               "attention_mask": batch["response_mask"]}
    with pytest.raises(ValueError, match=r"^batch\['rollout_log_probs'\] must be .*; got shape \[\d+\]$"):
        observe_batch(monitor, derived, 1)
    with pytest.raises(ValueError, match=r"^monitor must be a vexact.live.LiveMonitor, got NoneType$"):
        observe_batch(None, batch, 1)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_verl_names_are_verl_0_9_1s():
    """The keys and the hook point of the recipe, read from verl's own source (found, not imported)."""
    import importlib.util
    from pathlib import Path

    require_optional("verl", "pip install --no-deps verl==0.9.1")
    from vexact.integrations.verl import ROLLOUT_KEY, TRAIN_KEY

    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    source = (root / "trainer" / "ppo" / "ray_trainer.py").read_text()
    assert "def _compute_old_log_prob(self, batch: DataProto):" in source
    assert "return old_log_prob, old_log_prob_mfu" in source
    assert 'old_log_prob, old_log_prob_mfu = self._compute_old_log_prob(batch)' in source
    for key in (ROLLOUT_KEY, TRAIN_KEY, "response_mask"):
        assert f'batch.batch["{key}"]' in source or f'"{key}"' in source, key
    bypass = (root / "trainer" / "ppo" / "rollout_corr_helper.py").read_text()
    assert 'batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]' in bypass


def test_wandb_offline_view_holds_every_row_scalar(tmp_path):
    """W&B (offline: no network, no account) gets each row's numbers under the row's keys and step, exactly as
    metrics.jsonl holds them (the reader of tests/integrations/test_log_backends.py)."""
    require_optional("wandb", "pip install 'vexact[wandb]'")
    from test_log_backends import _assert_wandb_matches_jsonl

    roll, train, mask = _batch()
    with LiveMonitor(tmp_path, backends=("jsonl", "wandb"), gates=Gates(max_k3=1.0)) as monitor:
        for step in (0, 4):
            monitor.step(step, roll, train, mask, extra={"trainer/global_step": step})
    _assert_wandb_matches_jsonl(tmp_path)


def test_the_docs_first_example_runs_as_written(tmp_path, monkeypatch):
    """docs/live_and_recipes.md's first example is complete and needs no optional package (no tensorboard view)."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "live_and_recipes.md"
    code = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[0]
    assert "LiveMonitor(" in code and "tensorboard" not in code and "wandb" not in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(page), "exec"), {"__name__": "__docs__"})
    rows = read_metrics(tmp_path / "runs" / "my_grpo" / "vexact" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["outcome"] == "ok" and r["live/gates_failed"] == 0 and r["mismatch/tokens"] == 22 for r in rows)


# --------------------------------------------------------------------------- sampled rescoring (bypass / async)
def _metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(("rollout_corr/", "training/", "mismatch/"))}


def test_step_sampled_is_step_on_the_sampled_rows(tmp_path):
    roll, train, mask = _batch(b=10)
    calls = []

    def score(rows):
        calls.append(rows)
        return train[rows]

    with LiveMonitor(tmp_path / "sampled", sample_fraction=0.3, seed=5) as monitor:
        row = monitor.step_sampled(0, roll, score, mask)
        rows = monitor.sample(0, 10)
    assert calls == [rows] and len(rows) == 3 and rows == sorted(rows)
    with LiveMonitor(tmp_path / "plain") as plain:
        expected = plain.step(0, roll[rows], train[rows], mask[rows])
    assert _metrics(row) and all(_same(row[k], v) for k, v in _metrics(expected).items())
    assert _metrics(row).keys() == _metrics(expected).keys()
    assert row[metric_keys.LIVE_SAMPLED_SEQUENCES] == 3 and row[metric_keys.LIVE_SAMPLE_FRACTION] == 0.3
    assert row[metric_keys.LIVE_SEQUENCES] == 3
    assert metric_keys.LIVE_SAMPLED_SEQUENCES not in expected  # a plain step is not a sampled one
    written = read_metrics(tmp_path / "sampled" / "metrics.jsonl")
    assert [r["step"] for r in written] == [0]
    # the sample is the run's rule (vexact.rl.monitor.sample_rows), keyed by seed and step
    from vexact.rl.monitor import sample_rows
    assert rows == sample_rows(10, 0.3, 1, 5, 0) and LiveMonitor(tmp_path / "x", sample_fraction=0.3,
                                                                   seed=6).sample(0, 10) != rows


def test_step_sampled_sequences_and_skipped_steps(tmp_path):
    roll, train, mask = _batch(b=8)
    roll_seqs = [roll[i, mask[i].bool()] for i in range(8)]
    train_seqs = [train[i, mask[i].bool()] for i in range(8)]
    calls = []

    def score(rows):
        calls.append(rows)
        return [train_seqs[i] for i in rows]

    with LiveMonitor(tmp_path / "live", sample_fraction=0.5, every=2) as monitor:
        assert monitor.step_sampled(1, roll_seqs, score) is None and calls == []  # skipped: nothing scored
        row = monitor.step_sampled(2, roll_seqs, score)
        assert monitor.sample(3, 8) is None
    assert len(calls) == 1 and row[metric_keys.LIVE_SAMPLED_SEQUENCES] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "live" / "metrics.jsonl")] == [2]
    with LiveMonitor(tmp_path / "full") as full:  # the defaults: every row, every step
        everything = full.step_sampled(0, roll, lambda rows: train[rows], mask)
        same = full.step(1, roll, train, mask)
    assert everything[metric_keys.LIVE_SAMPLE_FRACTION] == 1.0
    assert all(_same(everything[k], v) for k, v in _metrics(same).items())


@pytest.mark.parametrize("kwargs,match", [
    ({"sample_fraction": 0.0}, "sample_fraction must be a number in"),
    ({"sample_fraction": 1.5}, "sample_fraction must be a number in"),
    ({"sample_fraction": "0.1"}, "sample_fraction must be a number in"),
    ({"every": 0}, "every must be an integer >= 1"),
    ({"every": 1.5}, "every must be an integer >= 1"),
    ({"seed": "x"}, "seed must be an integer"),
])
def test_sampling_settings_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LiveMonitor(tmp_path, **kwargs)


def test_step_sampled_refusals(tmp_path):
    roll, train, mask = _batch(b=6)
    monitor = LiveMonitor(tmp_path, sample_fraction=0.5)
    with pytest.raises(ValueError, match="score_fn must be a function"):
        monitor.step_sampled(0, roll, "not a function", mask)
    with pytest.raises(ValueError, match=r"score_fn\(rows\) has shape \[6, 12\], but the 3 sampled rows"):
        monitor.step_sampled(0, roll, lambda rows: train, mask)  # every row returned, not the sample's
    with pytest.raises(ValueError, match="mask has shape"):
        monitor.step_sampled(0, roll, lambda rows: train[rows], mask[:, :3])
    with pytest.raises(ValueError, match="n_sequences must be an integer >= 1"):
        monitor.sample(0, 0)
    with pytest.raises(ValueError, match="rollout_logprobs must be a"):
        monitor.step_sampled(0, roll[0], lambda rows: train[rows])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_step_sampled_errors_name_the_callers_rows_and_side(tmp_path):
    """A bad value in a sample's row was named by its place in the sample ([1, 3] for the batch's row 2) and, from
    verl's observe_batch, as score_fn(rows), which that user never passed; the list form's behaviour_logprobs
    errors called that side the training side."""
    from vexact.integrations.verl import observe_batch

    roll = torch.log_softmax(torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(0)), -1)[..., 0]
    monitor = LiveMonitor(tmp_path / "s", sample_fraction=0.5)
    rows = monitor.sample(1, 4)
    bad = _with(roll, rows[1], 3, 0.7)
    with pytest.raises(ValueError, match=rf"^score_fn\(rows\)\[{rows[1]}, 3\] is 0.7"):
        monitor.step_sampled(1, roll, lambda r: bad[r])
    with pytest.raises(ValueError, match=rf"^rollout_logprobs\[{rows[1]}\]\[3\] is 0.7"):
        monitor.step_sampled(1, list(bad), lambda r: [roll[i] for i in r])
    batch = {"rollout_log_probs": roll, "old_log_probs": bad, "response_mask": torch.ones(4, 5)}
    with pytest.raises(ValueError, match=rf"^old_log_probs\[{rows[1]}, 3\] is 0.7"):
        observe_batch(monitor, batch, 1)
    plain = LiveMonitor(tmp_path / "p")
    with pytest.raises(ValueError, match=r"^sequence 0: rollout_logprobs \[5\] and behaviour_logprobs \[3\]"):
        plain.step(0, list(roll[:2]), list(roll[:2]), behaviour_logprobs=[roll[0][:3], roll[1]])
    with pytest.raises(ValueError, match=r"^got 2 rollout sequences but 1 sequences in behaviour_logprobs"):
        plain.step(0, list(roll[:2]), list(roll[:2]), behaviour_logprobs=[roll[0]])
    assert not (tmp_path / "s" / "metrics.jsonl").exists() and not (tmp_path / "p" / "metrics.jsonl").exists()


def test_an_empty_sampled_step_is_recorded_and_a_skipped_step_is_seen(tmp_path):
    """An empty batch was 'no tokens' under step() but a ValueError under step_sampled(), even on a step every
    skips; a skipped step did not count, so a later call with a smaller step was accepted."""
    never = []
    with LiveMonitor(tmp_path / "e", every=2) as monitor:
        row = monitor.step_sampled(0, torch.zeros(0, 5), never.append, torch.zeros(0, 5))
        assert monitor.step_sampled(1, torch.zeros(0, 5), never.append) is None
        empty_list = monitor.step_sampled(2, [], never.append)
        assert monitor.step_sampled(3, torch.zeros(0, 5), never.append) is None
        with pytest.raises(ValueError, match="step 2 does not follow step 3"):
            monitor.step_sampled(2, torch.zeros(0, 5), never.append)
    assert never == []  # nothing to score: score_fn not called
    assert row["outcome"] == empty_list["outcome"] == "no tokens"
    assert row[metric_keys.LIVE_SAMPLED_SEQUENCES] == 0 and row[metric_keys.LIVE_SAMPLE_FRACTION] == 0.0
    assert [r["step"] for r in read_metrics(tmp_path / "e" / "metrics.jsonl")] == [0, 2]


def test_verl_bypass_of_one_non_contiguous_numpy_array_is_refused(tmp_path):
    """Each key's array was copied to a contiguous tensor of its own, so the one-array test never matched and the
    row said 'bitwise equal'."""
    from vexact.integrations.verl import observe_batch

    one = -np.random.default_rng(0).random((5, 4)).astype(np.float32).T
    assert not one.flags.c_contiguous
    with pytest.raises(ValueError, match=r"bypass mode"):
        observe_batch(LiveMonitor(tmp_path), {"rollout_log_probs": one, "old_log_probs": one,
                                              "response_mask": np.ones((4, 5))}, 1)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_verl_old_log_prob_batch_keeps_the_monitors_sampling(tmp_path):
    """observe_batch with old_log_prob (verl's recompute of every row) and a sampling monitor: every=2 writes every
    second step, and the row is the sample's, read from the recompute (it was every row, every step: every ignored)."""
    from vexact.integrations.verl import observe_batch

    batch = _verl_batch()
    rollout = {k: v for k, v in batch.items() if k != "old_log_probs"}
    old_log_prob = {"old_log_probs": batch["old_log_probs"]}
    with LiveMonitor(tmp_path / "live", sample_fraction=0.5, every=2, seed=1) as monitor:
        rows = monitor.sample(2, 6)
        skipped = observe_batch(monitor, rollout, 1, old_log_prob=old_log_prob)
        row = observe_batch(monitor, rollout, 2, old_log_prob=old_log_prob)
    with LiveMonitor(tmp_path / "plain") as plain:
        expected = plain.step(0, batch["rollout_log_probs"][rows], batch["old_log_probs"][rows],
                              batch["response_mask"][rows])
    assert skipped is None and [r["step"] for r in read_metrics(tmp_path / "live" / "metrics.jsonl")] == [2]
    assert all(_same(row[k], v) for k, v in _metrics(expected).items()) and row[metric_keys.LIVE_SAMPLED_SEQUENCES] == 3


def test_verl_bypass_batch_sampled(tmp_path, monkeypatch):
    """verl's bypass mode: the batch's old_log_probs are the rollout's; observe_batch with a score_fn rescores the
    sampled rows only, and actor_logprobs runs verl's recompute on them (select_idxs, padded to the world size)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from vexact.integrations.verl import actor_logprobs, observe_batch

    batch = _verl_batch()
    actor = batch["old_log_probs"]
    bypass = {**batch, "old_log_probs": batch["rollout_log_probs"]}  # apply_bypass_mode

    class FakeDataProto:  # what actor_logprobs reads of verl's DataProto
        def __init__(self, tensors):
            self.batch = tensors

        def select_idxs(self, rows):
            return FakeDataProto({k: v[rows] for k, v in self.batch.items()})

    protocol = ModuleType("verl.protocol")

    def pad(data, divisor):
        n = len(data.batch["responses"])
        extra = -n % divisor
        return FakeDataProto({k: torch.cat([v, v[:extra]]) for k, v in data.batch.items()}), extra

    protocol.pad_dataproto_to_divisor = pad
    protocol.unpad_dataproto = lambda data, extra: FakeDataProto(
        {k: v[: len(v) - extra] for k, v in data.batch.items()})
    monkeypatch.setitem(sys.modules, "verl", ModuleType("verl"))
    monkeypatch.setitem(sys.modules, "verl.protocol", protocol)
    scored = []

    def compute_old_log_prob(data):  # the actor: the rows' own log-probs (the fake batch keeps the row order)
        scored.append(len(data.batch["responses"]))
        index = [next(i for i in range(len(actor)) if torch.equal(r, batch["rollout_log_probs"][i]))
                 for r in data.batch["rollout_log_probs"]]
        return FakeDataProto({"old_log_probs": actor[index]}), 0.0

    trainer = SimpleNamespace(actor_rollout_wg=SimpleNamespace(world_size=4),
                              _compute_old_log_prob=compute_old_log_prob)
    data = FakeDataProto(bypass)
    with LiveMonitor(tmp_path / "live", sample_fraction=0.5, seed=1) as monitor:
        rows = monitor.sample(3, 6)
        row = observe_batch(monitor, data, 3, score_fn=actor_logprobs(trainer, data))
        with pytest.raises(ValueError, match="not both"):
            observe_batch(monitor, data, 4, old_log_prob=SimpleNamespace(batch={"old_log_probs": actor}),
                          score_fn=actor_logprobs(trainer, data))
    assert scored == [4] and len(rows) == 3  # 3 rows padded to the world size, not the batch of 6
    with LiveMonitor(tmp_path / "plain") as plain:
        expected = plain.step(0, batch["rollout_log_probs"][rows], actor[rows], batch["response_mask"][rows])
    assert all(_same(row[k], v) for k, v in _metrics(expected).items()) and row[metric_keys.LIVE_SAMPLED_SEQUENCES] == 3
