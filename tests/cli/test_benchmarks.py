"""Smoke test of the benchmarks (``benchmarks/``, ``vexact bench``): tiny shapes, one repetition.

Checks that every benchmark runs, that its JSON record has the documented schema and that every
ratio is finite and positive. No timing is asserted: speed is what the benchmarks measure, on
whatever machine runs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a source-checkout package, not installed
    sys.path.insert(0, str(ROOT))


import vexact_kernels  # noqa: E402
from benchmarks import (  # noqa: E402
    bits_digest,
    end_to_end,
    guard_modes,
    host_guard,
    kernels,
    op_count,
    op_swap,
    tables,
    tile_heights,
)
from benchmarks.common import parse_list, profile_top, set_malloc, shapes  # noqa: E402
from vexact.cli import main as vexact_main  # noqa: E402
from vexact_kernels import TRITON_PIP, cpu_exact, native  # noqa: E402

RATIO_KEYS = ("ratio_median", "ratio_min", "ratio_max", "exact_s_median", "native_s_median", "repetitions")
MACHINE_KEYS = ("cpu_model", "logical_cpus", "torch_threads", "torch_version", "load_average_start", "device",
                "malloc", "vexact_version", "git_commit")
TINY_RL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=10",
           "task.eval_prompts=2", "warm_start.steps=0"]


def _check_ratios(row: dict) -> None:
    for key in RATIO_KEYS:
        assert key in row, key
    assert row["repetitions"] == len(row["exact_s"]) == len(row["native_s"])
    for key in ("ratio_median", "ratio_min", "ratio_max", "exact_s_median", "native_s_median"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]


def test_kernel_benchmark_schema(tmp_path):
    record = kernels.run(["tiny"], ["float32", "bfloat16"], list(kernels.OPS), list(kernels.MODES), reps=1,
                         device=torch.device("cpu"), threads=1)
    assert record["benchmark"] == "kernels"
    assert all(key in record["machine"] for key in MACHINE_KEYS)
    seen = {(r["op"], r["dtype"], r["mode"]) for r in record["results"]}
    for op in kernels.OPS:
        for dtype in ("float32", "bfloat16"):
            assert (op, dtype, "fwd") in seen
            assert ((op, dtype, "fwd+bwd") in seen) == (op not in kernels.NO_BACKWARD)
            for mode in kernels.GRADIENT_MODES:
                assert ((op, dtype, mode) in seen) == (op in kernels.LINEAR_OPS), (op, mode)
    for row in record["results"]:
        _check_ratios(row)
    assert {r["matmul"] for r in record["matmul"]} == {"q_proj", "k_proj", "mlp_up", "mlp_down", "lm_head"}
    for row in record["matmul"]:
        _check_ratios(row)
        assert row["exact_gflops"] > 0 and row["torch_mm_gflops"] > 0 and row["fraction_of_torch_mm"] > 0
    kernels.print_results(record)


@pytest.mark.parametrize("backend", ["native", "exact"])
def test_kernel_benchmark_gradient_modes_time_one_gradient_each(backend):
    """``grad_input`` / ``grad_weight``: each call runs the forward with only that tensor requiring a gradient (the
    other product is never asked for) and returns that gradient: the same bits as a full backward of the op gives."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ops = vexact_kernels.get_ops(backend, torch.device("cpu"))
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    out = ops.linear(*leaves)
    full = torch.autograd.grad(out, leaves, kernels._upstream(out))
    differentiable: list[list[bool]] = []

    def watched_linear(*tensors: torch.Tensor) -> torch.Tensor:
        differentiable.append([t.requires_grad for t in tensors])
        return ops.linear(*tensors)
    for wanted, mode in enumerate(kernels.GRADIENT_MODES):
        one_gradient = kernels._gradient_runner(watched_linear, [x, w], (), mode)
        differentiable.clear()
        first, again = one_gradient(), one_gradient()
        assert differentiable == [[i == wanted for i in range(2)]] * 2, mode
        assert first.shape == (x, w)[wanted].shape, mode
        assert torch.equal(first, full[wanted]) and torch.equal(again, full[wanted]), mode


def test_end_to_end_benchmark_schema():
    record = end_to_end.run(["tiny"], ["float32"], list(end_to_end.ITEMS), reps=1, device=torch.device("cpu"),
                            threads=1, rl_overrides=TINY_RL, warm=False)
    assert record["benchmark"] == "end_to_end" and not record["skipped"]
    assert [r["item"] for r in record["results"]] == list(end_to_end.ITEMS)
    for row in record["results"]:
        _check_ratios(row)
        assert row["tokens"] > 0 and row["exact_tokens_per_s"] > 0 and row["native_tokens_per_s"] > 0
    rollout = record["results"][0]
    assert rollout["tokens"] == shapes()["tiny"].e2e_batch * shapes()["tiny"].new_tokens
    end_to_end.print_results(record)


def test_end_to_end_at_other_prompt_lengths(capsys, monkeypatch):
    """``--prompt-len``: one row per length, named for it; the decode step's cache prefilled in calls of
    ``PREFILL_CHUNK`` positions is the one a single call fills (the exact decode step's log-probs, bitwise); bad
    lengths and the default shape are one clear error."""
    from vexact import Transformer

    shape = end_to_end.at_prompt_lengths(shapes()["tiny"], [10])[0]
    model = Transformer(shape.model, backend="exact", init_seed=0)
    prompts = end_to_end.prompts_of(shape)
    assert {len(p) for p in prompts} == {10}
    one_call = end_to_end.decode_step_call(model, prompts, torch.device("cpu"))()
    monkeypatch.setattr(end_to_end, "PREFILL_CHUNK", 4)  # 10 positions in calls of 4, 4 and 2
    assert torch.equal(end_to_end.decode_step_call(model, prompts, torch.device("cpu"))(), one_call)
    record = end_to_end.run(["tiny"], ["float32"], ["decode_step"], reps=1, device=torch.device("cpu"), threads=1,
                            prompt_lengths=[2, 10])
    assert [r["shape"] for r in record["results"]] == ["tiny, 2-token prompts", "tiny, 10-token prompts"]
    assert record["settings"]["prompt_lengths"] == [2, 10]
    for row in record["results"]:
        _check_ratios(row)
    end_to_end.print_results(record)
    assert "tiny, 10-token prompts: decode step" in capsys.readouterr().out
    longest = shapes()["tiny"].model.max_seq_len - shapes()["tiny"].new_tokens - 1
    for argv, message in ((["--shape", "default", "--prompt-len", "8"], "applies to the shapes with random prompts"),
                          (["--shape", "tiny", "--prompt-len", "0"], f"tiny's prompts take 1 to {longest} tokens"),
                          (["--shape", "tiny", "--prompt-len", "4,x"], "comma list of token counts, got '4,x'")):
        assert end_to_end.main([*argv, "--items", "decode_step", "--reps", "1"]) == 2
        assert message in capsys.readouterr().err


def test_end_to_end_profile_records_top_ops():
    record = end_to_end.run(["tiny"], ["float32"], ["decode_step"], reps=1, device=torch.device("cpu"), threads=1,
                            profile=3)
    row = record["results"][0]
    for side in ("exact", "native"):
        prof = row["profile"][side]
        assert 0 < len(prof["ops"]) <= 3 and all(0 < op["share"] <= 1 for op in prof["ops"])
        assert prof["aten_calls_per_run"] > 0 and prof["total_self_ms_per_run"] > 0
        if side == "exact" and cpu_exact.HOST.mode == "fixed-order":  # its GEMM: products and tree sums, no matmul
            assert prof["matmul_self_ms_per_run"] == 0
        else:
            assert 0 < prof["matmul_self_ms_per_run"] < prof["aten_self_ms_per_run"]
        assert prof["aten_self_ms_per_run"] <= prof["total_self_ms_per_run"] * (1 + 1e-9)  # two summation orders
    end_to_end.print_results(record)


def test_profile_counts_onednn_linear_as_a_matrix_product():
    """The exact path's linear layers on x86 call oneDNN's op (``mkldnn::_linear_pointwise``), not an aten GEMM: a
    profile's split counts it with the matrix products and the library ops, not with the autograd nodes."""
    from vexact_kernels.host_guard import onednn_available, onednn_linear

    if not onednn_available():
        pytest.skip("no oneDNN linear op in this torch build")
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    prof = profile_top(lambda: onednn_linear(x, w), top=3)
    assert [op["op"] for op in prof["ops"]][0] == "mkldnn::_linear_pointwise"
    assert 0 < prof["matmul_self_ms_per_run"] <= prof["aten_self_ms_per_run"]
    assert prof["aten_calls_per_run"] >= 1


@pytest.mark.needs_package("triton", TRITON_PIP)
def test_triton_exact_backend_runs_both_benchmarks(capsys):
    """``--exact-backend triton`` (the GPU path's kernels) runs every op and item; on CPU the interpreter
    makes it a functional check, which the table title says."""
    ops = ["linear", "attention_prefill", "attention_decode", "token_logprobs"]
    record = kernels.run(["tiny"], ["float32"], ops, list(kernels.MODES), reps=1, device=torch.device("cpu"),
                         threads=1, matmul=False, exact_backend="triton")
    assert record["settings"]["exact_backend"] == "triton"
    assert [r["op"] for r in record["results"] if r["mode"] == "fwd"] == ops
    for row in record["results"]:
        _check_ratios(row)
        assert row["inner_calls"] == 1  # interpreted: not grouped into ~20 ms samples
    kernels.print_results(record)
    e2e = end_to_end.run(["tiny"], ["float32"], list(end_to_end.ITEMS), reps=1, device=torch.device("cpu"),
                         threads=1, exact_backend="triton")
    assert [r["item"] for r in e2e["results"]] == ["rollout", "decode_step", "train_fwd_bwd"]
    assert [s["item"] for s in e2e["skipped"]] == ["rl_step"]
    for row in e2e["results"]:
        _check_ratios(row)
    end_to_end.print_results(e2e)
    assert "NOT a speed" in " ".join(capsys.readouterr().out.split())  # the table may wrap its title anywhere


def test_host_guard_benchmark_schema(tmp_path, capsys):
    """fixed-order / fast for every op and the model's rollout and scoring, plus the probes' cost."""
    out = tmp_path / "g.json"
    assert vexact_main(["bench", "host_guard", "--shape", "tiny", "--dtype", "fp32", "--reps", "1", "--threads", "1",
                        "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "host_guard"
    assert [r["item"] for r in record["results"]] == [*kernels.OPS, *host_guard.MODEL_ITEMS]
    for row in record["results"]:
        assert row["repetitions"] == 1 and row["ratio_median"] > 0 and row["fixed_order_s_median"] > 0
    (cost,) = record["probe_cost"]
    assert cost["shape_classes"] > 0 and cost["probe_s"] > 0 and cost["first_call_s"] >= cost["probe_s"]
    assert record["host_report"]["mode"] == record["settings"]["fast_guard_mode"]
    assert "fixed-order / fast" in capsys.readouterr().out
    assert tables.main([str(out)]) == 0
    assert "| linear | tiny |" in capsys.readouterr().out
    assert host_guard.main(["--device", "cpu", "--exact-backend", "triton"]) == 2
    assert "exact CPU kernels" in capsys.readouterr().err


def test_guard_modes_benchmark_times_canonical_against_auto_in_one_process(tmp_path, capsys):
    """canonical / auto per item, both modes' times in one record; the canonical guard takes no faster arrangement,
    and the table marks each cell against the bound."""
    out = tmp_path / "m.json"
    assert vexact_main(["bench", "guard_modes", "--shape", "tiny", "--dtype", "bf16", "--reps", "1", "--threads",
                        "1", "--profile", "3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "guard_modes" and record["settings"]["modes"] == list(guard_modes.MODES)
    assert [r["item"] for r in record["results"]] == list(guard_modes.ITEMS)
    for row in record["results"]:
        assert row["repetitions"] == 1 and len(row["canonical_s"]) == len(row["auto_s"]) == 1
        assert math.isfinite(row["ratio_median"]) and row["ratio_median"] > 0
        assert row["canonical_s_median"] > 0 and row["auto_s_median"] > 0
        assert row["faster_arrangements"]["canonical"] == 0
        assert isinstance(row["refused_arrangements"], list)  # this host's failed same_bits probes (often none)
        *top, products, every_op = row["profile"]
        assert len(top) == 3 and (products["op"], every_op["op"]) == guard_modes.SPLIT_TOTALS
        for mode in guard_modes.MODES:
            assert every_op[mode] >= max(products[mode], *(p[mode] for p in top)) > 0
    assert "canonical / auto" in capsys.readouterr().out
    assert tables.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "| tiny: decode step |" in text and "| ≤ 1.05× |" in text and "canonical within 1.05× auto in" in text
    binding = [r for r in record["results"]
               if r["item"] in guard_modes.BOUND_ITEMS and r["faster_arrangements"]["auto"] > 0]
    assert f"of the {len(binding)} cells where auto takes a faster arrangement" in text
    assert "| tiny: linear layers of a training pass |" in text  # the diagnostic item: no mark, no bound
    assert next(line for line in text.splitlines() if "linear layers" in line).rstrip().endswith("| — |")
    over = [r for r in record["results"]
            if r["item"] in guard_modes.BOUND_ITEMS and r["ratio_median"] > guard_modes.GAP_LIMIT]
    assert len(guard_modes.over_bound_lines(record["results"])) == len(over)
    assert ("of which matrix products and copies" in text) == bool(over)
    assert guard_modes.main(["--device", "cuda"] if not torch.cuda.is_available() else ["--shape", "huge"]) == 2
    assert guard_modes.main(["--items", "rollout"]) == 2
    assert "unknown item 'rollout'" in capsys.readouterr().err


def test_guard_modes_at_another_batch(tmp_path, capsys):
    """``--batch N``: the shapes with N random prompts (a decode step of N rows), named for it; the default shape,
    whose prompts are its task's, and a batch under one are refused with one line."""
    out = tmp_path / "b.json"
    assert guard_modes.main(["--shape", "tiny", "--dtype", "fp32", "--reps", "1", "--threads", "1", "--items",
                             "decode_step", "--batch", "5", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["batch"] == 5
    assert [r["shape"] for r in record["results"]] == ["tiny, 5 prompts"]
    assert len(end_to_end.prompts_of(end_to_end.at_batch(end_to_end.shapes()["tiny"], 5))) == 5
    capsys.readouterr()
    assert guard_modes.main(["--shape", "default", "--batch", "5", "--items", "decode_step"]) == 2
    assert "--batch applies to the shapes with random prompts" in capsys.readouterr().err
    assert guard_modes.main(["--shape", "tiny", "--batch", "0", "--items", "decode_step"]) == 2
    assert "--batch 0" in capsys.readouterr().err


def test_tile_heights_times_the_tiles_and_finds_a_gemm_that_accumulates_by_the_rows_in_a_call(tmp_path, capsys,
                                                                                              monkeypatch):
    """Every weight shape at every row count, a ratio per arrangement (taller tiles only where the rows hold one); on
    a GEMM whose rows in a call of more than 64 come out otherwise (the emulated host), every row of the stacked call
    and of each taller tile is counted as differing from its 64-row tile's bits."""
    from test_host_guard import rows_in_call_mm

    out = tmp_path / "t.json"
    assert vexact_main(["bench", "tile_heights", "--shape", "tiny", "--dtype", "fp32", "--reps", "1", "--threads",
                        "1", "--rows", "70,300", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    weights = tile_heights.weight_shapes(shapes()["tiny"].model)
    assert [(r["weight"], r["rows"]) for r in record["results"]] == [
        (f"N={n} K={k}", rows) for n, k in weights for rows in (70, 300)]
    for r in record["results"]:
        heights = [tile_heights.TILE, *(h for h in tile_heights.TALL_HEIGHTS if h <= r["rows"])]
        assert {key for key in r if key.startswith("tiles_")} == {f"tiles_{h}" for h in heights}
        for h in heights:
            ratio = r[f"tiles_{h}"]
            assert math.isfinite(ratio["ratio_median"]) and ratio["ratio_median"] > 0
            assert ratio["repetitions"] == len(ratio["tiles_s"]) == len(ratio["one_call_s"]) == 1
    assert "64-row tiles / one call" in capsys.readouterr().out
    assert tables.main([str(out)]) == 0
    assert "| 256-row call: 64-row bits |" in capsys.readouterr().out

    monkeypatch.setattr(torch, "mm", rows_in_call_mm)
    record = tile_heights.run("tiny", ["float32"], [1], [300], reps=1)
    for r in record["results"]:
        assert r["rows_differing_one_call"] == 300
        assert all(r[f"rows_differing_{h}"] == h for h in tile_heights.TALL_HEIGHTS)
    assert all(row[-3:] == ["no (300 of 300 rows)", "no (128 of 128 rows)", "no (256 of 256 rows)"]
               for row in tile_heights.table(record)[1])


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows must be a comma list of positive integers"),
    (["--rows", "64,x"], "--rows must be a comma list of positive integers"),
    (["--shape", "tiny,default"], "--shape: one shape"),
    (["--device", "meta"], "--device: expected one of cpu, cuda, cuda:N, auto, got 'meta'"),
])
def test_tile_heights_bad_input_is_one_clear_error(argv, message, capsys):
    assert tile_heights.main(["--shape", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err


def test_op_swap_times_each_exact_op_swapped_for_natives(tmp_path, capsys):
    """Per item: exact, exact with each op it calls swapped for native's, native, every variant timed; the table
    gives per swapped op what the swap saves. The ops a variant swaps are the ones the item calls (a decode step's
    and a training pass's differ in none here, but both call linear and attention), and a swapped namespace takes
    linear's recomputing backward from native with linear."""
    out = tmp_path / "s.json"
    assert vexact_main(["bench", "op_swap", "--shape", "tiny", "--reps", "2", "--threads", "1", "--out",
                        str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "op_swap" and [r["item"] for r in record["results"]] == list(op_swap.ITEMS)
    for row in record["results"]:
        names = set(row["variants"]) - {op_swap.EXACT, op_swap.NATIVE}
        assert len(names) == len(row["variants"]) - 2  # both ends are variants
        swapped_ops = [name.removeprefix(op_swap.NATIVE + " ") for name in names]
        assert {"linear", "attention", "rms_norm"} <= set(swapped_ops) <= set(op_swap.OPS)
        assert "entropy" not in swapped_ops  # neither item calls it
        for variant in row["variants"].values():
            assert len(variant["samples_s"]) == 2 and variant["median_s"] > 0
    ops = op_swap.swapped(cpu_exact.with_host(cpu_exact.HOST), "linear")
    assert ops.linear is native.linear and ops.linear_backward is native.linear_backward
    assert ops.attention.func is cpu_exact.attention  # the others stay exact
    assert "what swapping each op for native's saves" in capsys.readouterr().out
    assert tables.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "| exact / native |" in text and "| native linear: saves |" in text
    assert "| exact's samples: max - min |" in text
    assert op_swap.main(["--items", "rollout"]) == 2
    assert "unknown item 'rollout'" in capsys.readouterr().err


def test_guard_modes_names_the_cells_where_auto_kept_the_canonical_arrangement():
    """A cell whose ``auto`` guard refused a ``same_bits`` arrangement (the Intel Xeon's bf16 training: linear tiles
    stacked in one GEMM gave other bits) is named with its count; a record with none says nothing of it."""
    def row(item: str, refused: list[str]) -> dict:
        return {"item": item, "shape": "llama100m", "dtype": "bfloat16", "threads": 2, "ratio_median": 1.0,
                "ratio_min": 1.0, "ratio_max": 1.0, "faster_arrangements": {"auto": 1, "canonical": 0},
                "refused_arrangements": refused}

    results = [row("decode_step", []), row("train_fwd_bwd", ["linear tiles stacked in one GEMM: 5x64 rows", "b"])]
    *_, summary = guard_modes.modes_matrix(results)
    assert summary.endswith("probe failed in llama100m training fwd+bwd bf16, 2 threads (2)")
    *_, summary = guard_modes.modes_matrix(results[:1])
    assert "kept the canonical" not in summary


def test_linear_layers_item_replays_the_training_pass_s_linear_calls():
    """``linear_layers`` makes the training pass's linear calls -- the same functions, input shapes and weights, in
    order -- and calls no other op of the namespace (counter-check: the pass itself calls others)."""
    from types import SimpleNamespace

    from benchmarks.end_to_end import prompts_of, train_call
    from vexact import Transformer, generate
    from vexact_kernels import cpu_exact

    shape = shapes()["tiny"]
    model = Transformer(shape.model, backend="exact", dtype=torch.float32, init_seed=0)
    prompts = prompts_of(shape)
    responses = generate(model, prompts, max_new_tokens=shape.new_tokens, temperature=1.0, seed=0).tokens
    base = cpu_exact.ops_in_mode("auto")

    def logging(log: list) -> SimpleNamespace:
        def logged(name, fn):
            def call(*args, **kwargs):
                if name in ("linear", "linear_backward"):
                    log.append((name, tuple(args[0].shape), id(args[1])))
                else:
                    log.append((name,))
                return fn(*args, **kwargs)
            return call
        return SimpleNamespace(**{name: logged(name, fn) if callable(fn) else fn for name, fn in vars(base).items()})

    in_training, in_replay = [], []
    train_call(model, prompts, responses, logging(in_training))()
    replay = guard_modes.linear_layers_call(model, prompts, responses, logging(in_replay))
    in_replay.clear()  # (the item records the pass once through the namespace it is given)
    replay()
    linear_calls = [entry for entry in in_training if len(entry) == 3]
    assert linear_calls and len(linear_calls) < len(in_training)
    assert in_replay == linear_calls


def test_vexact_bench_command_writes_json(tmp_path):
    out = tmp_path / "k.json"
    code = vexact_main(["bench", "kernels", "--shape", "tiny", "--dtype", "fp32", "--ops", "linear,attention_decode",
                        "--modes", "fwd", "--reps", "1", "--no-matmul", "--device", "cpu", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert [r["op"] for r in record["results"]] == ["linear", "attention_decode"]
    assert record["machine"]["load_average_end"] is not None or sys.platform == "win32"
    tiny = shapes()["tiny"]
    assert record["results"][0]["size"].startswith(f"[{tiny.train_batch * tiny.train_len}x")
    assert vexact_main(["bench", "kernels", "--shape", "tiny", "--dtype", "fp32", "--ops", "linear", "--modes", "fwd",
                        "--reps", "1", "--no-matmul", "--device", "cpu", "--train-len", "5", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["train_len"] == 5 and record["results"][0]["size"].startswith(f"[{tiny.train_batch * 5}x")
    assert vexact_main(["bench", "kernels", "--shape", "tiny", "--train-len", "0", "--device", "cpu"]) == 2


def test_op_count_charges_every_call_to_a_function(tmp_path, capsys):
    """Both backends' aten calls of one RL step, by function: the per-function counts add up to the total, the
    exact backend's GEMM tiles issue some of them, and native runs no GEMM tile."""
    out = tmp_path / "ops.json"
    assert vexact_main(["bench", "op_count", "--top", "3", "--out", str(out),
                        *[a for kv in TINY_RL for a in ("--rl-set", kv)]]) == 0
    results = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    for r in results.values():
        assert r["aten_calls"] > 0
        assert sum(r["by_function"].values()) == sum(r["by_op"].values()) == r["aten_calls"]
    # the linear tiles' functions: making a plan, and each arrangement's run (gemm_linear.TiledPlan)
    tiles = {f"kernels/gemm_linear.py:{name}" for name in ("_tiled_plan", "_stacked_mm", "stacked_as_given",
                                                                  "stacked", "laid_out", "compiled_tiles", "tiles")}
    assert sum(results["exact"]["by_function"].get(name, 0) for name in tiles) > 0
    assert not tiles & set(results["native"]["by_function"])
    assert "aten calls in one RL step" in capsys.readouterr().out
    assert op_count.main(["--top", "0"]) == 2


def test_op_count_charges_an_installed_kernel_library_under_the_labels_of_the_checkout(monkeypatch, tmp_path):
    """Installed, the kernels live in site-packages/vexact_kernels/, not beside vexact/ in a checkout: op_count
    found its own code relative to the repository, so every kernel function fell under ``other``. Functions in
    both installed packages are charged to them, labelled as in the checkout."""
    import vexact

    site = tmp_path / "site-packages"
    monkeypatch.setattr(vexact, "__file__", str(site / "vexact" / "__init__.py"))
    monkeypatch.setattr(vexact_kernels, "__file__", str(site / "vexact_kernels" / "__init__.py"))
    functions = {}
    for file, name in (("vexact_kernels/gemm_linear.py", "tiles"), ("vexact/rl/trainer.py", "step")):
        exec(compile(f"def {name}(x):\n    return x + 1\n", str(site / file), "exec"), functions)
    counter, x = op_count._CountCalls(), torch.ones(2)
    with counter:
        functions["tiles"](x)
        functions["step"](x)
    assert counter.counts()["by_function"] == {"kernels/gemm_linear.py:tiles": 1, "vexact/rl/trainer.py:step": 1}


@pytest.mark.parametrize("argv, message", [
    (["--shape", "huge"], "unknown shape 'huge'"),
    (["--dtype", "float16"], "unknown dtype 'float16'"),
    (["--ops", "conv"], "unknown op 'conv'"),
    (["--reps", "0"], "reps must be >= 1"),
    (["--exact-backend", "cuda"], "unknown exact backend 'cuda'"),
    (["--threads", "0"], "threads must be >= 1, got 0"),
    (["--threads", "-2"], "threads must be >= 1, got -2"),
])
def test_bad_input_is_one_clear_error(argv, message, capsys):
    assert kernels.main(["--shape", "tiny", *argv] if argv[0] != "--shape" else argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err


def test_an_unwritable_out_is_refused_before_the_benchmark_runs(tmp_path, capsys, monkeypatch):
    """--out under a file: one error before any timing (measure is never called), not a traceback after it."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "run", lambda *a, **k: pytest.fail("the benchmark ran before --out was checked"))
    assert vexact_main(["bench", "kernels", "--shape", "tiny", "--device", "cpu", "--out",
                        str(blocker / "k.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out: cannot write {blocker / 'k.json'}") and err.count("\n") == 1, err


def test_markdown_tables_from_json(tmp_path, capsys):
    k = kernels.run(["tiny"], ["float32", "bfloat16"], ["linear", "attention_decode"], list(kernels.MODES), reps=1,
                    device=torch.device("cpu"), threads=1)
    e = end_to_end.run(["tiny"], ["float32"], ["decode_step"], reps=1, device=torch.device("cpu"), threads=1,
                       profile=2)
    paths = []
    for name, record in (("k.json", k), ("e.json", e)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(record))
    assert tables.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "| tiny | q_proj | 27 × 32 × 32 |" in out  # matmul table
    assert "| attention_decode | tiny |" in out and "| — |" in out  # no backward for decode
    assert "| tiny: decode step |" in out and "| ≤ 1.00× |" in out and "- decode_step tiny fp32, 1 thread: exact" in out
    assert vexact_main(["bench", "tables", str(paths[0])]) == 0
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "other"}))
    assert tables.main([str(tmp_path / "bad.json")]) == 2
    assert "not a benchmark record" in capsys.readouterr().err


def test_malloc_modes():
    assert set_malloc("default") == "default"
    steady = set_malloc("steady")  # glibc: thresholds set; elsewhere: says it could not
    assert steady.startswith("steady (glibc") or steady.startswith("default (")
    with pytest.raises(ValueError, match="unknown malloc mode 'huge'"):
        set_malloc("huge")


def test_parse_list():
    assert parse_list("all", ["a", "b"], "x") == ["a", "b"]
    assert parse_list("bf16,fp32", ["float32", "bfloat16"], "dtype") == ["bfloat16", "float32"]
    with pytest.raises(ValueError, match="unknown item 'c'"):
        parse_list("a,c", ["a", "b"], "item")
    assert end_to_end.main(["--items", "nope"]) == 2


@pytest.mark.slow
def test_data_parallel_benchmark_schema(tmp_path, capsys):
    from benchmarks import data_parallel

    out = tmp_path / "dp.json"
    assert data_parallel.main(["--nproc", "2", "--numel", "1000", "--reps", "2", "--no-steps", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (reduce,) = record["reduce"]
    assert reduce["nproc"] == 2 and reduce["tree_s"] > 0 and reduce["allreduce_s"] > 0
    assert reduce["ratio"] == reduce["tree_s"] / reduce["allreduce_s"] and record["steps"] == []
    assert data_parallel.main(["--nproc", "3", "--no-steps", "--out", str(out)]) == 2
    assert "powers of two" in capsys.readouterr().err


def test_compare_benchmark_writes_dumps_that_compare_accepts(tmp_path, capsys):
    """``python -m benchmarks.compare`` (named in the own-engine tutorial): its synthetic training log-probs are
    log-probs (the noise on a near-certain token used to push some above 0, which compare refuses), and a small
    run counts every token right."""
    from benchmarks import compare

    data = compare.synthetic(2000, 20, 0.3, seed=0)
    assert data["roll"].max() <= 0 and data["train"].max() <= 0
    assert 0 < int(data["equal"]) < int(data["lengths"].sum())  # the perturbed share differs, the rest is equal
    out = tmp_path / "compare.json"
    assert compare.main(["--sequences", "300", "--max-len", "20", "--formats", "two-files", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["exit_code"] == 0 and row["correct"] and row["report_tokens"] == row["tokens"]
    assert "counts right" in capsys.readouterr().out


def test_a_kernel_library_from_another_checkout_is_refused(monkeypatch, tmp_path):
    """A benchmark records where vexact was imported from, and refuses a vexact_kernels imported from elsewhere
    (a second editable install shadowing it: old kernels timed under the new harness's commit)."""
    import vexact_kernels
    from benchmarks.common import code_locations, machine_info

    assert machine_info()["vexact_path"] == str(Path(vexact_kernels.__file__).resolve().parent.parent)
    monkeypatch.setattr(vexact_kernels, "__file__", str(tmp_path / "elsewhere" / "kernels" / "__init__.py"))
    with pytest.raises(ValueError, match="come from different checkouts"):
        code_locations()


def test_a_record_names_vexact_s_version_and_a_commit_only_from_vexact_s_own_checkout(monkeypatch, tmp_path):
    """Installed in a venv inside someone's git project, a record took that project's commit for vexact's (git ran
    in the installed package's folder) and named no vexact version. Now: the version always; the commit only where
    vexact's folder is the top of the git checkout git names."""
    import vexact
    from benchmarks import common
    from vexact.version import __version__

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    machine = common.machine_info()
    assert machine["vexact_version"] == __version__ and machine["git_commit"] == head.stdout.strip()
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "site-packages"
    for package in ("vexact", "vexact_benchmarks"):
        (site / package).mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "theirs"]):
        subprocess.run([*git, *args], cwd=project, check=True, capture_output=True)
    monkeypatch.setattr(vexact, "__file__", str(site / "vexact" / "__init__.py"))
    monkeypatch.setattr(common, "__file__", str(site / "vexact_benchmarks" / "common.py"))
    assert common._git_commit() is None


def test_a_record_names_the_onednn_choice_and_its_measured_on_line_says_when_it_is_off(monkeypatch):
    """``VEXACT_CPU_ONEDNN`` changes which GEMM large fp32 layers run, so every record keeps it; the tables' "Measured
    on" line says so where it was ``off`` (the default ``auto`` goes unsaid, as in records from before it)."""
    from benchmarks.common import machine_info

    monkeypatch.setenv("VEXACT_CPU_ONEDNN", "off")
    machine = machine_info()
    assert machine["exact_onednn"] == "off"
    record = {"machine": {**machine, "load_average_end": None}, "results": [{"threads": 2}], "settings": {}}
    assert ", VEXACT_CPU_ONEDNN=off, " in tables._machine(record)
    monkeypatch.delenv("VEXACT_CPU_ONEDNN")
    record["machine"]["exact_onednn"] = machine_info()["exact_onednn"]
    assert record["machine"]["exact_onednn"] == "auto" and "ONEDNN" not in tables._machine(record)


def test_the_measured_on_line_names_the_commit_else_the_installed_version():
    """A record from a checkout names its commit; one from an installed vexact (no commit) names vexact's version
    rather than "commit None"; a record from before ``vexact_version`` keeps its old line."""
    machine = {"cpu_model": "cpu", "logical_cpus": 2, "torch_version": "2.13.0", "load_average_start": 0.1,
               "load_average_end": 0.2}
    record = {"machine": machine, "results": [{"threads": 1}], "settings": {"threads": [1]}}
    machine.update(git_commit="abc1234", vexact_version="0.1.0")
    assert ", commit abc1234, " in tables._machine(record)
    machine["git_commit"] = None
    assert ", vexact 0.1.0, " in tables._machine(record) and "commit" not in tables._machine(record)
    del machine["vexact_version"]
    assert ", commit None, " in tables._machine(record)


def test_vexact_bench_imports_the_installed_benchmarks_from_any_folder(tmp_path):
    """``vexact bench`` needs no checkout: it imports ``vexact_benchmarks`` (installed, as the kernels are), here
    from a folder outside the repository with the repository's root off ``sys.path`` (``python -I``), and puts
    nothing on ``sys.path``."""
    code = ("import sys; before = list(sys.path); from vexact.cli import _benchmarks_module; "
            "m = _benchmarks_module('tables'); import vexact_benchmarks.common as c; "
            "print(m.__name__, 'benchmarks' in sys.modules, sys.path == before, c.EXPERIMENT.is_file())")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["vexact_benchmarks.tables", "False", "True", "True"]


def test_gpu_real_s_rl_run_finds_its_experiment_in_an_installed_package(tmp_path):
    """``vexact bench gpu_real --part rl_run`` read experiments/gpu_qwen3_0_6b.yaml beside the installed package,
    which a wheel has no copy of. Here the package as a wheel lays it out (its modules and package-data, links
    followed) is imported from a folder of its own; its rl_run part runs a config that is there."""
    import shutil

    from setuptools.config.pyprojecttoml import read_configuration

    installed = tmp_path / "site-packages" / "vexact_benchmarks"
    installed.mkdir(parents=True)
    shipped = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]["vexact_benchmarks"]
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(f for p in shipped for f in (ROOT / "benchmarks").glob(p))]:
        shutil.copyfile(path, installed / path.name)
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import vexact.cli; from pathlib import Path\n"
            "vexact.cli.main = lambda argv: print(Path(argv[1]).is_file(), Path(argv[1]).parent) or 1\n"
            "import vexact_benchmarks.gpu_real as g\n"
            "g.part_rl_run(torch.device('cpu'), True, {'steps': 1, 'exact_backend': 'exact'}, Path(sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(installed.parent), str(tmp_path / "out")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(installed)]


def test_bench_choices_are_the_benchmark_modules():
    import inspect

    from vexact.cli import BENCHMARKS, _benchmarks_module, build_parser

    assert {"data_parallel", "compare"} <= set(BENCHMARKS)
    for name in BENCHMARKS:
        assert "prog" in inspect.signature(_benchmarks_module(name).main).parameters, name
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions if a.dest == "which")
    assert tuple(bench.choices) == tuple(BENCHMARKS)
    assert all(f"{name}:" in bench.help for name in BENCHMARKS)


def test_op_count_of_a_decode_step_separates_the_compiled_loops_calls(tmp_path, capsys):
    """``--decode-shape``: one decode step per backend; the calls issued inside the compiled loops are counted apart
    (native runs none), and the two parts add up to the total."""
    out = tmp_path / "decode_ops.json"
    assert op_count.main(["--decode-shape", "tiny", "--top", "2", "--out", str(out)]) == 0
    results = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    for r in results.values():
        assert r["from_python"] + r["from_compiled_calls"] == r["aten_calls"] == sum(r["by_op"].values()) > 0
    assert results["native"]["from_compiled_calls"] == 0
    assert "aten calls in one decode step (tiny, float32)" in capsys.readouterr().out
    assert op_count.main(["--decode-shape", "huge"]) == 2


def test_bits_digest_finds_the_same_bits_and_a_changed_one(tmp_path, capsys, monkeypatch):
    """Two runs of one commit give the same digests (``--against`` exits 0); a change in one gradient bit -- the
    sign of a zero, which ``torch.equal`` would not see -- is found (exit 1, naming the case and the part); bad input
    is one clear error."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--shape", "tiny", "--dtype", "float32", "--threads", "1"]
    assert bits_digest.main([*args, "--out", str(first)]) == 0
    assert bits_digest.main([*args, "--out", str(second), "--against", str(first)]) == 0
    assert "the same bits" in capsys.readouterr().out
    real = bits_digest.raw_bits

    def one_bit_off(t):
        raw = bytearray(real(t))
        if t.dtype == torch.float32 and t.dim() == 2:  # a weight's gradient: flip the sign bit of its first element
            raw[3] ^= 0x80
        return bytes(raw)
    monkeypatch.setattr(bits_digest, "raw_bits", one_bit_off)
    assert bits_digest.main([*args, "--out", str(second), "--against", str(first)]) == 1
    out = capsys.readouterr().out
    assert "gradients differ" in out and "tokens differ" not in out and "logprobs differ" not in out
    assert bits_digest.main([*args, "--against", str(tmp_path / "missing.json")]) == 2
    assert bits_digest.main([*args, "--layers", "0"]) == 2


@pytest.mark.parametrize("against", ["binary", "folder", "list"])
def test_bits_digest_against_a_file_that_is_no_record_is_one_error_naming_it(tmp_path, capsys, against):
    """A binary --against file was a UnicodeDecodeError traceback, and a JSON list an AttributeError one."""
    path = tmp_path / "against"
    if against == "folder":
        path.mkdir()
    else:
        path.write_bytes(bytes(range(128, 256)) if against == "binary" else b"[1]")
    assert bits_digest.main(["--shape", "tiny", "--dtype", "float32", "--threads", "1", "--against", str(path)]) == 2
    assert capsys.readouterr().err == {
        "binary": f"error: --against file '{path}' is not a UTF-8 text file\n",
        "folder": f"error: --against file '{path}' is a directory, not a file\n",
        "list": f"error: --against {path}: not a bits_digest record\n"}[against]


@pytest.mark.parametrize("argv, message", [
    (["decode_profile", "--shape", "tiny", "--reps", "0"], "argument --reps: expected a positive integer"),  # was
    # Infinity seconds and exit 0
    (["decode_profile", "--shape", "tiny", "--out", "/proc/no/such.json"], "--out: cannot write /proc/no/such.json"),
    (["data_parallel", "--nproc", "a"], "--nproc takes powers of two >= 2"),  # was int()'s message, no flag named
    (["data_parallel", "--out", "/proc/no/such.json"], "--out: cannot write /proc/no/such.json"),
    (["end_to_end", "--shape", "tiny", "--items", "decode_step,rl_step", "--rl-config", "nope.yaml"],
     "--rl-config nope.yaml / --rl-set: config error: config file not found"),  # was after the other items
    (["end_to_end", "--shape", "tiny", "--profile", "-1"], "argument --profile: expected 0 or a positive integer"),
    (["end_to_end", "--shape", "tiny", "--items", "decode_step", "--rl-set", "steps=2"], "--rl-set: it sets the RL "
     "step, and --items decode_step holds no rl_step: it would change nothing"),  # accepted, recorded nowhere
    (["op_count", "--decode-shape", "tiny", "--rl-set", "nonsense"], "--rl-set: it sets the RL step, and "
     "--decode-shape tiny counts a decode step"),
    (["decode_profile", "--shape", "tiny", "--dtype", "all"], "--dtype: one dtype, got 'all'"),  # was
    # "too many values to unpack", naming no flag
    (["kernels", "--device", "cuda:x"], "--device: expected one of cpu, cuda, cuda:N, auto, got 'cuda:x'"),
])
def test_benchmark_bad_input_is_refused_before_the_work(argv, message, capsys):
    """Each refused with one error line naming the flag, before any measurement (each ran its whole benchmark
    first, or took a bad value silently)."""
    try:
        code = vexact_main(["bench", *argv])
    except SystemExit as stop:  # argparse's own refusal (usage, then the error line)
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_bench_device_auto_runs_where_the_help_says_it_does(tmp_path, capsys):
    assert vexact_main(["bench", "--device", "auto", "kernels", "--shape", "tiny", "--ops", "rms_norm", "--reps", "1",
                        "--dtype", "fp32", "--out", str(tmp_path / "k.json")]) == 0
    assert json.loads((tmp_path / "k.json").read_text())["results"]
