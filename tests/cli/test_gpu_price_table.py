"""``benchmarks.gpu_real.price_table``: the benchmarks page's GPU table from a device run's JSON, on synthetic
records (no GPU): ratios against ``GPU_TARGETS``, the graphed decode rows where the ``graphed`` part ran, a step
that could not be captured said as such, and launches with the GPU-busy fraction."""

from __future__ import annotations

from benchmarks.gpu_real import GPU_TARGETS, price_table

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
