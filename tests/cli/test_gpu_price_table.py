"""``benchmarks.gpu_real.price_table``: the benchmarks page's GPU table from a device run's JSON, on synthetic
records (no GPU): ratios against ``GPU_TARGETS``, the graphed decode rows where the ``graphed`` part ran, a step
that could not be captured said as such, and launches with the GPU-busy fraction; ``profile_table`` and
``kernel_table`` (the ``profiles`` part) on synthetic events and kernel names a run on an H200 recorded."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.gpu_real import GPU_TARGETS, kernel_table, price_table, profile_table

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
