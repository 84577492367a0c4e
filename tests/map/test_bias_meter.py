"""The gradient-bias meter: zero mismatch gives zero bias bit for bit; mismatch gives a bias; the growth
fit recovers a known exponent; bad meter files are one clear error."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from vexact.rl.config import config_from_dict, config_hash
from vexact.rl.horizon_task import horizon_overrides
from vexact.sweeps.bias_meter import (
    bias_statistics,
    cell_config,
    exact_gradients,
    fit_growth,
    load_meter_spec,
    measure_bias,
    meter_table,
    noise_bias_split,
    plot_meter,
    run_meter,
    split_cell,
)

TINY = {"threads": 1, "seed": 0, "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                            "intermediate_size": 64},
        "task": {"name": "horizon", "eval_prompts": 4, "partial_credit": True},
        "warm_start": {"steps": 40, "lr": 1e-2, "batch_size": 16},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4},
        "algorithm": {"old_logprobs": "rollout"}}


def _cfg(tmp_path, *inject: str):
    overrides = [f"{k}={v}" for k, v in horizon_overrides(4).items()] + [f"warm_start.cache_dir={tmp_path}", *inject]
    return config_from_dict(json.loads(json.dumps(TINY)), overrides)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    path = tmp_path_factory.mktemp("meter")
    return path, exact_gradients(_cfg(path), batches=2)


def test_zero_mismatch_zero_bias_bitwise(exact):
    path, grads = exact
    cell = measure_bias(_cfg(path), batches=2)  # its own exact gradients: a second, independent computation
    assert cell["exactly_zero"] is True and cell["grad_norm"] > 0  # a real gradient, not an all-zero one
    assert cell["bias_abs"] == 0.0 and cell["bias_ratio"] == 0.0 and cell["k3_kl"] == 0.0
    assert cell["cosine"] == pytest.approx(1.0, abs=1e-12)
    again = exact_gradients(_cfg(path), batches=2)
    assert all(torch.equal(a, b) for a, b in zip(grads.grads, again.grads))  # the same bits, run to run


def test_mismatch_gives_a_bias(exact):
    """Counter-case: logit noise on the rollout moves the gradient (the zero above is not vacuous)."""
    path, grads = exact
    cell = measure_bias(_cfg(path, "inject.mode=logit_noise", "inject.sigma=1.0"), batches=2, exact=grads)
    assert cell["exactly_zero"] is False and cell["bias_ratio"] > 0 and cell["k3_kl"] > 0
    lo, hi = cell["bias_ratio_ci"]
    assert lo is None or lo <= hi


def test_statistics_on_known_vectors():
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    d = torch.tensor([[0.0, 0.5], [0.0, 0.5], [0.0, 0.5]], dtype=torch.float64)
    s = bias_statistics(g, d, bootstrap=20)
    assert s["bias_ratio"] == pytest.approx(0.5) and s["bias_ratio_debiased"] == pytest.approx(0.5)
    assert s["cosine"] == pytest.approx(1 / math.sqrt(1.25))
    assert s["bias_ratio_ci"] == [pytest.approx(0.5), pytest.approx(0.5)]


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_growth_fit_recovers_exponent(beta):
    cells = [{"horizon_mean": t, "bias_ratio": 0.01 * t**beta, "bias_ratio_ci": [0.009 * t**beta, 0.011 * t**beta]}
             for t in (8.0, 16.0, 32.0, 64.0)]
    fit = fit_growth(cells)
    assert fit["status"] == "fitted" and fit["exponent"] == pytest.approx(beta)
    assert fit["ci_low"] <= beta <= fit["ci_high"] and f"T^{beta:g}" in fit["holds"]
    assert fit_growth(cells[:1])["status"] == "insufficient"


def test_bad_meter_files(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps(TINY))
    cases = {
        "horizons: []\n": "horizons",
        "horizons: [4]\nbatches: 1\n": "batches",
        "horizons: [4]\nsources: {x: {inject.mode: nonsense}}\n": "source 'x'",
        "horizons: [4]\nsources: {x: {}}\nextra: 1\n": "unknown key",
        "horizons: [4, 1, 4]\n": r"m4.yaml: 'horizons' must not repeat a horizon, got 4 more than once in \[4, 1, 4\]$",
    }
    for i, (body, words) in enumerate(cases.items()):
        spec = tmp_path / f"m{i}.yaml"
        text = "name: m\nbase: base.yaml\n" + body
        if "sources" not in body:
            text += "sources: {none: {}}\n"
        spec.write_text(text)
        with pytest.raises(ValueError, match=words):
            load_meter_spec(spec)
    with pytest.raises(ValueError, match="does not exist"):
        load_meter_spec(tmp_path / "missing.yaml")


def _finished_cell(**changes) -> dict:
    """A cell as meter.json holds it (horizon 1, 2 batches), with ``changes``: for re-runs that measure nothing."""
    return {"abs_dlogp_mean": 0.22, "batches": 2, "bias_abs": 0.16, "bias_abs_noise": 0.16, "bias_ratio": 1.0,
            "bias_ratio_ci": [None, None], "bias_ratio_debiased": 1.0, "cosine": 0.5, "cosine_ci": [None, None],
            "exactly_zero": False, "grad_norm": 0.16, "grad_norm_noise": 0.16, "horizon": 1, "horizon_mean": 7.8,
            "horizon_mean_exact": 7.8, "inject_mode": "logit_noise", "inject_value": 0.3, "k3_kl": 0.037,
            "old_logprobs": "rollout", "resolved": False, "responses_per_batch": 16, "reward_mean_exact": 0.0,
            "seconds": 0.1, **changes}


def test_a_rerun_reads_non_finite_values_of_finished_cells(tmp_path):
    """A finished cell whose exact gradient was zero has a NaN cosine, written to meter.json as "nan"; re-running the
    meter (finished cells are kept) printed nothing but "error: Unknown format code 'f' for object of type 'str'"."""
    (tmp_path / "base.yaml").write_text(json.dumps(TINY))
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text("name: m\nbase: base.yaml\nhorizons: [1]\nbatches: 2\nsources: {nan: {inject.mode: "
                         "logit_noise, inject.sigma: 0.3}}\n")
    spec = load_meter_spec(spec_path, tmp_path / "out")
    cell = _finished_cell(cosine="nan", source="nan")  # a source may be named like a non-finite number: a name
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "meter.json").write_text(json.dumps({"cells": [cell]}))
    result = run_meter(spec, log=lambda _: None)  # nothing left to measure
    (read,) = result["cells"]
    assert math.isnan(read["cosine"]) and read["source"] == "nan" and read["bias_ratio"] == 1.0
    assert "| 1 | 7.8 | nan | 3.70e-02 | 1 [?] | 1 | no | nan | 0.00 |" in meter_table(result).splitlines()
    assert json.loads((tmp_path / "out" / "meter.json").read_text())["cells"][0]["cosine"] == "nan"


def test_the_plot_takes_an_interval_beside_its_estimate(tmp_path):
    """Seen in a real meter (L = 1, logit scale -0.1: ratio 0.0462, bootstrap interval [0.0467, 0.102]): a percentile
    interval of a biased estimator need not contain the estimate; the plot must still be drawn."""
    cell = {"source": "s", "horizon": 1, "horizon_mean": 4.8, "bias_ratio": 0.0462, "bias_ratio_ci": [0.0467, 0.102],
            "cosine": 0.99, "cosine_ci": [0.98, 0.995], "bias_abs": 1.0, "bias_abs_noise": 0.1, "grad_norm": 2.0,
            "grad_norm_noise": 0.1}
    result = {"name": "m", "batches": 120, "sources": ["s"], "cells": [cell],
              "growth": {"s": {"bias_ratio": {"status": "insufficient"}}}}
    path = plot_meter(result, tmp_path / "meter.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- noise against bias

def _deviations(bias_norm: float, sigma: float, k: int = 400, p: int = 50) -> torch.Tensor:
    """K per-batch deviations d_k = b + σ z_k: known bias ‖b‖ and noise tr Σ = p σ²."""
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(p, generator=gen, dtype=torch.float64)
    b = b / b.norm() * bias_norm
    return b + sigma * torch.randn(k, p, generator=gen, dtype=torch.float64)


def test_noise_bias_split_recovers_known_parts():
    """‖b‖² = 1, tr Σ = 50 · 0.1² = 0.5, K = 400. Standard errors (Gaussian rows): bias_sq sqrt(4σ²‖b‖²/K +
    2pσ⁴/K²) ≈ 0.010, noise_sq tr Σ · sqrt(2/(p(K−1))) ≈ 0.0050: tolerances of 5 standard errors."""
    split = noise_bias_split(_deviations(1.0, 0.1))
    assert split["bias_sq"] == pytest.approx(1.0, abs=0.05)
    assert split["noise_sq"] == pytest.approx(0.5, abs=0.025)
    assert split["crossover_batches"] == pytest.approx(0.5, abs=0.05)
    fit = split["by_count_fit"]  # the 1/N check over block means: noisier, but the same two terms
    assert [n for n, _ in split["by_count"]] == [1, 2, 4, 8]
    assert fit["bias_sq"] == pytest.approx(1.0, abs=0.1) and fit["noise_sq"] == pytest.approx(0.5, abs=0.15)


def test_noise_bias_split_tells_noise_from_bias():
    """Counter-cases: pure noise has no bias (within 5 standard errors: sqrt(2pσ⁴/K²) = 0.0025 at σ = 0.1), a pure
    bias has no noise at all, and the two are not swapped."""
    noise = noise_bias_split(_deviations(0.0, 0.1))
    assert abs(noise["bias_sq"]) < 0.0125 and noise["noise_sq"] == pytest.approx(0.5, abs=0.025)
    bias = noise_bias_split(_deviations(1.0, 0.0))
    assert bias["noise_sq"] == pytest.approx(0.0, abs=1e-12) and bias["bias_sq"] == pytest.approx(1.0, rel=1e-9)
    assert bias["crossover_batches"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="K >= 2 batches"):
        noise_bias_split(_deviations(1.0, 0.1)[:1])


def test_split_cell_reads_the_same_split_from_a_cells_norms():
    """meter.json keeps norms, not the deviations: the split from them equals the split from the deviations."""
    d, g = _deviations(1.0, 0.1), _deviations(2.0, 0.1)
    stats = {**bias_statistics(g, d, bootstrap=1), "batches": d.shape[0]}
    cell, direct = split_cell(stats), noise_bias_split(d)
    assert cell["bias_sq"] == pytest.approx(direct["bias_sq"], rel=1e-9)
    assert cell["noise_sq"] == pytest.approx(direct["noise_sq"], rel=1e-9)
    assert cell["bias_ratio_debiased"] == pytest.approx(stats["bias_ratio_debiased"], rel=1e-9)
    assert cell["noise_ratio"] == pytest.approx(math.sqrt(0.5 / 4.0), rel=0.1)  # sqrt(tr Σ / ‖E g‖²)


def _meter_with_one_noise_cell(tmp_path, batches: int):
    """A one-cell meter file (L = 1, source ``noise``: logit_noise 0.3) over ``TINY`` at ``batches``, its spec and
    that cell finished as the config would measure it (its config hash); the output directory made, still empty."""
    (tmp_path / "base.yaml").write_text(json.dumps(TINY))
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nbase: base.yaml\nhorizons: [1]\nbatches: {batches}\nsources: {{noise: "
                         "{inject.mode: logit_noise, inject.sigma: 0.3}}\n")
    spec = load_meter_spec(spec_path, tmp_path / "out")
    cell = _finished_cell(source="noise", config_hash=config_hash(cell_config(spec, 1, "noise").to_dict()))
    (tmp_path / "out").mkdir()
    return spec_path, spec, cell


def test_a_rerun_after_the_meter_file_changed_is_refused(tmp_path):
    """A finished cell is skipped on a re-run; edited since (another sigma, say), the meter reported the old cell's
    numbers under the new settings. Each cell keeps its config's hash: a cell of another config is one error."""
    spec_path, spec, cell = _meter_with_one_noise_cell(tmp_path, 2)
    (tmp_path / "out" / "meter.json").write_text(json.dumps({"cells": [cell]}))
    assert run_meter(spec, log=lambda _: None)["cells"][0]["k3_kl"] == 0.037  # the same config: kept, not measured
    spec_path.write_text(spec_path.read_text().replace("0.3", "0.01"))
    with pytest.raises(ValueError, match=r"meter 'm': .*meter.json holds the cell L = 1, source 'noise' measured "
                                         r"with another config \(the meter file or its base config changed since\)"):
        run_meter(load_meter_spec(spec_path, tmp_path / "out"), log=lambda _: None)
    del cell["config_hash"]  # a cell written before the hash: its source's settings, as meter.json records them
    (tmp_path / "out" / "meter.json").write_text(json.dumps({"cells": [cell], "sources": spec.sources}))
    with pytest.raises(ValueError, match="measured with another config"):
        run_meter(load_meter_spec(spec_path, tmp_path / "out"), log=lambda _: None)


def test_a_rerun_with_other_batches_is_refused_and_keeps_the_finished_cells(tmp_path):
    """Re-run with another ``batches``, the meter dropped every finished cell of the old count from meter.json (and
    measured them again), without a word. Now one error naming batches (old -> new); meter.json is left as it is."""
    spec_path, spec, cell = _meter_with_one_noise_cell(tmp_path, 3)
    written = json.dumps({"batches": 2, "cells": [cell]})  # measured with 2 batches
    (tmp_path / "out" / "meter.json").write_text(written)
    with pytest.raises(ValueError, match=r"^meter 'm': batches 2 -> 3: .*meter\.json holds cells measured with "
                                         r"batches 2, which do not mix with cells of 3; move .*meter\.json away"):
        run_meter(spec, log=lambda _: None)
    assert (tmp_path / "out" / "meter.json").read_text() == written


def test_a_second_meter_in_one_directory_is_refused_naming_the_holder(tmp_path, capsys, monkeypatch):
    """Two meters into one output directory each rewrote meter.json from their own cells, losing the other's. The
    meter now holds the directory's lock (as a sweep does): the second is one error line naming the holder's pid."""
    from vexact.cli import main
    from vexact.records.runlog import RunLocked, run_lock

    (tmp_path / "base.yaml").write_text(json.dumps(TINY))
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text("name: m\nbase: base.yaml\nhorizons: [1]\nbatches: 2\nsources: {noise: {inject.mode: "
                         "logit_noise, inject.sigma: 0.3}}\n")
    spec = load_meter_spec(spec_path, tmp_path / "out")
    cell = _finished_cell(source="noise", config_hash=config_hash(cell_config(spec, 1, "noise").to_dict()))
    (tmp_path / "out").mkdir()
    written = json.dumps({"batches": 2, "cells": [cell]})  # nothing left to measure: only the lock is in question
    (tmp_path / "out" / "meter.json").write_text(written)
    with run_lock(tmp_path / "out"):  # another meter (or sweep) working there
        with pytest.raises(RunLocked, match=rf"^meter 'm': {tmp_path / 'out'} is in use by another vexact process "
                                            rf"\(pid {os.getpid()}\)"):
            run_meter(spec, log=lambda _: None)
        capsys.readouterr()
        monkeypatch.setenv("COLUMNS", "10000")  # the error line unwrapped
        assert main(["meter", str(spec_path), "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: meter 'm': ") and f"(pid {os.getpid()})" in err
    assert (tmp_path / "out" / "meter.json").read_text() == written
    assert run_meter(spec, log=lambda _: None)["cells"][0]["k3_kl"] == 0.037  # released: the meter runs


def test_noise_bias_cli(tmp_path, capsys):
    from vexact.sweeps.bias_meter import _main

    d, g = _deviations(1.0, 0.1, k=16), _deviations(2.0, 0.1, k=16)
    cells = [{**bias_statistics(g, d * scale, bootstrap=1), "batches": 16, "horizon": h, "source": "s",
              "horizon_mean": float(h), "k3_kl": 0.01, "noise_bias": noise_bias_split(d * scale)}
             for h, scale in ((4, 1.0), (16, 2.0))]
    (tmp_path / "meter.json").write_text(json.dumps({"cells": cells}))
    assert _main(["noise-bias", str(tmp_path / "meter.json")]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 4.0 | s | 1.00e-02 |" in out and "- s: bias ∝ T^0.50, noise ∝ T^0.50" in out  # both doubled
    (tmp_path / "bad.json").write_text(json.dumps({"cells": [{"horizon": 4}]}))
    assert _main(["noise-bias", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a vexact meter result" in err and len(err.strip().splitlines()) == 1


def test_a_meter_file_that_is_a_directory_or_binary_is_one_error_naming_it(tmp_path, capsys, monkeypatch):
    """A directory was "meter file not found" (vexact meter and noise-bias alike), and a binary meter.json an error
    naming no file: each is now read by the reader of run and sweep files (``validate.read_text_file``)."""
    from vexact.cli import main
    from vexact.sweeps.bias_meter import _main

    folder, binary = tmp_path / "d", tmp_path / "bin.json"
    folder.mkdir()
    binary.write_bytes(bytes(range(128, 256)))
    monkeypatch.setenv("COLUMNS", "10000")  # the error line unwrapped
    capsys.readouterr()
    assert main(["meter", str(folder)]) == 2
    assert capsys.readouterr().err == f"error: config error: meter file '{folder}' is a directory, not a file\n"
    assert _main(["noise-bias", str(folder)]) == 2
    assert capsys.readouterr().err == f"error: meter file '{folder}' is a directory, not a file\n"
    assert _main(["noise-bias", str(binary)]) == 2
    assert capsys.readouterr().err == f"error: meter file '{binary}' is not a UTF-8 text file\n"


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not "
                                                "enough memory: you tried to allocate 320204832768 bytes."),
                                   MemoryError()])
def test_out_of_memory_is_one_error_line_and_exit_3(tmp_path, capsys, monkeypatch, error):
    """A horizon of 100,000 tokens asked the allocator for 320 GB: a traceback, exit 1. Now one line, exit 3 (the
    machine could not hold the work), from any command."""
    from vexact.cli import main
    from vexact.sweeps import bias_meter

    (tmp_path / "base.yaml").write_text(json.dumps(TINY))
    (tmp_path / "m.yaml").write_text("name: m\nbase: base.yaml\nhorizons: [100000]\nsources: {noise: {inject.mode: "
                                     "logit_noise, inject.sigma: 0.3}}\n")

    def allocate(*args, **kwargs):
        raise error

    monkeypatch.setattr(bias_meter, "run_meter", allocate)
    monkeypatch.setenv("COLUMNS", "10000")
    assert main(["meter", str(tmp_path / "m.yaml"), "--output-dir", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: out of memory: ") and err.endswith(
        "choose smaller sizes (model, batch, lengths) or run on a machine with more memory"), err
    monkeypatch.setattr(bias_meter, "run_meter", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError stays a traceback: a bug to see
        main(["meter", str(tmp_path / "m.yaml"), "--output-dir", str(tmp_path / "out")])


def test_a_cell_on_a_device_this_machine_lacks_is_refused_before_any_file(tmp_path, monkeypatch):
    """A meter file's ``set: {device: cuda}`` (or one source's) was refused only at its cell's work: after the first
    progress line, with the output folder made."""
    from vexact.engine import devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)  # a machine without CUDA, whatever this one has
    (tmp_path / "base.yaml").write_text(json.dumps(TINY))
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text("name: m\nbase: base.yaml\nhorizons: [1, 2]\nbatches: 2\nsources: {noise: {inject.mode: "
                         "logit_noise, inject.sigma: 0.3}, gpu: {inject.mode: logit_noise, inject.sigma: 0.3, device: "
                         "cuda}}\n")
    logged = []
    with pytest.raises(ValueError, match=r"^meter 'm', horizon 1, source 'gpu': config error at 'device': 'cuda' "
                                         r"needs CUDA"):
        run_meter(load_meter_spec(spec_path, tmp_path / "out"), log=logged.append)
    assert logged == [] and not (tmp_path / "out").exists()
