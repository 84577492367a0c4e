"""``benchmarks.gpu_real.price_table``: the benchmarks page's GPU table from a device run's JSON, on synthetic
records (no GPU): ratios against ``GPU_TARGETS``, the graphed decode rows where the ``graphed`` part ran, a step
that could not be captured said as such, and launches with the GPU-busy fraction; ``profile_table`` and
``kernel_table`` (the ``profiles`` part) on synthetic events and kernel names a run on an H200 recorded;
``tiles_table`` and ``rollout_table`` (the ``tiles`` and ``rollout`` parts) on records of their shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks.gpu_real import (
    GPU_TARGETS,
    kernel_table,
    main,
    price_table,
    profile_table,
    rollout_table,
    tables,
    tiles_table,
)

SIZES = {"prefill_batch": 64, "prefill_len": 1024, "decode_batch": 64, "train_batch": 8, "train_prompt_len": 512,
         "train_response_len": 512}


def _speed(exact_tps: float, native_tps: float) -> dict:
    def row(backend: str, tps: float) -> dict:
        return {"backend": backend, "prefill": {"tokens_per_s": tps}, "decode": {"0": {"tokens_per_s": tps}},
                "train_fwd_bwd": {"tokens_per_s": tps}}
    return {"rows": [row("exact", exact_tps), row("native", native_tps)], "sizes": SIZES}


def test_eager_ratios_are_native_rate_over_exact_rate_against_the_targets():
    table = price_table(_speed(100.0, 110.0))  # exact takes 1.10x native's time: within 1.2, within 1.25
    assert table.count("| 1.10× ✓ |") == 3 and "CUDA graph" in table and "yes" not in table
    slow = price_table(_speed(100.0, 130.0))  # 1.30x: over every GPU target
    assert slow.count("| 1.30× ✗ |") == 3 and max(GPU_TARGETS.values()) < 1.30
    assert "launches" not in slow


def test_graphed_rows_and_launches_where_the_record_has_them():
    graphed = {"status": "failed", "sizes": {"decode_batch": 64}, "rows": [
        {"backend": "exact", "decode": {"0": {"graphed_tokens_per_s": 200.0, "graphed_equals_eager": True},
                                        "512": {"not_captured": "RuntimeError: operation not permitted"}}},
        {"backend": "native", "decode": {"0": {"graphed_tokens_per_s": 300.0}, "512": {"graphed_tokens_per_s": 1.0}}}]}
    launches = {"status": "passed", "rows": [
        {"backend": "exact", "kernel_launches_per_decode_step": 540, "gpu_busy_fraction": 0.25},
        {"backend": "native", "kernel_launches_per_decode_step": 2201}]}
    table = price_table(_speed(100.0, 100.0), graphed, launches)
    assert "| decode step at position 0 | 64 | yes | 1.50× ✗ |" in table
    assert "| decode step at position 512 | 64 | yes | not captured: RuntimeError: operation not permitted |" in table
    assert table.endswith("exact 540 (GPU busy 25% of the step's wall time), native 2,201")
    skipped = price_table(_speed(100.0, 100.0), {"status": "skipped", "reason": "no CUDA"}, {"status": "skipped"})
    assert "yes" not in skipped and "launches" not in skipped


def _event(name: str, us: float, device: str = "cuda") -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_table_sums_each_kernel_once_over_the_chosen_device_and_ranks_by_time():
    events = [_event("_linear_kernel", 3.0), _event("_attention_kernel", 4.0), _event("_linear_kernel", 2.0),
              _event("aten::mm", 100.0, device="cpu")]  # a host event: not a kernel, not counted
    table = kernel_table(events, "cuda", top=1)
    assert table == {"launches": 3, "busy_us": 9.0, "top": [{"kernel": "_linear_kernel", "calls": 2, "us": 5.0,
                                                             "share": round(5 / 9, 4)}]}
    assert kernel_table([], "cuda", top=3) == {"launches": 0, "busy_us": 0.0, "top": []}


COPY = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_"
        "kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}")
MUL = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::"
       "binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int")
GEMM = "void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(cutlass_80_simt_sgemm_256x128_8x4_nt_align1"


def test_profile_table_names_what_each_kernel_does_and_says_an_item_that_failed():
    def item(top: list) -> dict:
        return {"wall_us": 2000.0, "busy_us": 1000.0, "busy_fraction": 0.5, "launches": 1234, "top": top}

    kernels = [{"kernel": k, "calls": 2, "us": 250.0, "share": 0.25} for k in (COPY, MUL, GEMM, "_linear_kernel")]
    profiles = {"rows": [{"backend": "exact", "decode_step": item(kernels), "train_fwd_bwd": {"error": "E: boom"}}]}
    table = profile_table(profiles, top=3)
    assert "| exact | decode_step | 2.0 | 1.0 | 50% | 1,234 |" in table
    assert ("`elementwise_kernel: direct_copy_kernel_cuda` 2, 0.2, 25%<br>`vectorized_elementwise_kernel: "
            "MulFunctor<float>` 2, 0.2, 25%<br>`cutlass_80_simt_sgemm_256x128_8x4_nt_align1` 2, 0.2, 25% |") in table
    assert "_linear_kernel" not in table  # only the top 3
    assert "| exact | train_fwd_bwd | E: boom |" in table


def _tile_entry(same: bool, us_small: float, us_large: float) -> dict:
    return {"same_bits_as_current": same, "rows_invariant": True, "us": {"64": us_small, "8192": us_large}}


def test_tiles_table_gives_each_candidates_bits_and_summed_time_over_natives_and_the_decode_choice():
    tiles = {
        "sizes": {"rows": [64, 8192]},
        "native_summed_us": {"64": 100.0, "8192": 1000.0},
        "candidates": {
            "current": {"tiles": None, "weights": {"q_o": _tile_entry(True, 1, 1)},
                        "summed_us_64_rows": 150.0, "summed_us_8192_rows": 1100.0},
            "n32": {"tiles": [64, 32, 64, 4, 4], "weights": {"q_o": _tile_entry(True, 1, 1)},
                    "summed_us_64_rows": 105.0, "summed_us_8192_rows": 1300.0},
            "m16_n64": {"tiles": [16, 64, 64, 4, 3], "weights": {"q_o": _tile_entry(False, 1, 1)},
                        "summed_us_64_rows": 90.0, "summed_us_8192_rows": 1500.0},
            "n256_w8": {"tiles": [64, 256, 64, 8, 3], "weights": {"q_o": {"error": "OutOfResources: shared memory"}}},
        },
        "linear_tiles_at_decode": {"q_o": [64, 32, 64, 4, 4], "head": [64, 128, 64, 4, 3]},
    }
    table = tiles_table(tiles)
    assert "| current (the dtype's `_MATMUL_TILES`) | yes | yes | 1.50× | 1.10× |" in table
    assert "| n32 (64 x 32 x 64, 4 warps, 4 stages) | yes | yes | 1.05× | 1.30× |" in table
    assert "| m16_n64 (16 x 64 x 64, 4 warps, 3 stages) | NO | yes | 0.90× | 1.50× |" in table
    assert "| n256_w8 (64 x 256 x 64, 8 warps, 3 stages) | did not run: OutOfResources: shared memory |" in table
    assert table.endswith("linear's tiles at 64 rows: q_o 64 x 32 x 64, head 64 x 128 x 64")


def test_rollout_table_gives_tokens_per_s_the_graphs_speedup_its_bits_and_exact_over_native():
    rollout = {"rows": [
        {"backend": "exact", "eager": {"tokens_per_s": 1000.0}, "graphed": {"tokens_per_s": 3000.0},
         "graphed_equals_eager": True},
        {"backend": "native", "eager": {"tokens_per_s": 1200.0}, "graphed": {"error": "RuntimeError: capture"}}]}
    table = rollout_table(rollout)
    assert "| exact | 1,000 | 3,000 | 3.00× | yes, bit for bit |" in table
    assert "| native | 1,200 | RuntimeError: capture | - | - |" in table
    assert table.endswith("exact / native time per token: eager 1.20×")  # graphed: native has no rate
    cpu = rollout_table({"rows": [{"backend": "triton", "eager": {"tokens_per_s": 10.0}},
                                  {"backend": "native", "eager": {"tokens_per_s": 20.0}}]})
    assert "| triton | 10 | - | - | - |" in cpu and cpu.endswith("eager 2.00×")
    mismatched = dict(rollout["rows"][0], graphed_equals_eager=False)
    assert "| 3.00× | NO |" in rollout_table({"rows": [mismatched, rollout["rows"][1]]})


def test_tables_gives_each_part_that_ran_and_names_the_rest_and_the_cli_prints_them(tmp_path, capsys):
    rollout = {"status": "passed", "rows": [{"backend": "exact", "eager": {"tokens_per_s": 10.0}},
                                            {"backend": "native", "eager": {"tokens_per_s": 10.0}}]}
    parts = {"speed": {"status": "passed", **_speed(100.0, 100.0)}, "rollout": rollout,
             "tiles": {"status": "timed out", "limit_s": 60}}
    shown = tables(parts)
    assert shown.index("| prefill |") < shown.index("rollout:\n\n| backend | eager tokens/s")
    assert shown.endswith("no table for: profiles not run, tiles timed out")
    record = tmp_path / "gpu_real.json"
    record.write_text(json.dumps({"parts": parts}))
    assert main(["--tables", "--out", str(record)]) == 0
    assert capsys.readouterr().out.strip() == shown
    record.write_text("{}")
    assert main(["--tables", "--out", str(record)]) == 2
    assert "not a gpu_real record" in capsys.readouterr().err
