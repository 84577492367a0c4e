"""``vexact check`` end to end through the console entry point."""

from __future__ import annotations

import json

from vexact.cli import main


def test_check_reports_zero_exact_mismatch_and_native_mismatch(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--num-prompts", "16", "--max-new-tokens", "24", "--hidden-size", "64",
                 "--intermediate-size", "160", "--dtype", "all", "--json", str(out), "--verbose"])
    assert code == 0
    rows = json.loads(out.read_text())
    assert {(r["backend"], r["dtype"]) for r in rows} == {(b, d) for b in ("exact", "native")
                                                          for d in ("float32", "bfloat16")}
    for r in rows:  # the keys of measure's and compare's --json reports
        assert r["tokens"] > 0
        if r["backend"] == "exact":
            assert r["bitwise_equal"] == r["tokens"] and r["metrics"]["mismatch/abs_dlogp_max"] == 0.0
            assert r["metrics"]["rollout_corr/k3_kl"] == 0.0
    assert sum(r["tokens"] - r["bitwise_equal"] for r in rows if r["backend"] == "native") > 0
    exact_paths = next(r["kernel_paths"] for r in rows if r["backend"] == "exact")
    # every exact op says which path it took; probed ops name their probes, by-construction ops need none
    assert exact_paths["ops"]["embedding"]["path"] == "by construction"
    for op in ("linear", "attention", "rms_norm", "silu_mul", "token_logprobs", "sampling"):
        assert exact_paths["ops"][op]["path"] in ("fast", "fixed-order", "mixed"), op
        assert exact_paths["ops"][op]["shape_classes"], op
    if exact_paths["mode"] == "auto":  # (VEXACT_CPU_EXACT_PATH=fixed-order: nothing is probed)
        assert all(p["passed"] is not None and p["threads_checked"] for p in exact_paths["probes"])
    out = capsys.readouterr().out
    assert "vexact check" in out and "path per op" in out and "gemm_rows" in out


def test_check_scores_at_other_thread_counts(tmp_path):
    """Rollout at 1 thread, every rollout rescored at 2 and at 3: still 0 mismatched exact tokens."""
    out = tmp_path / "check.json"
    assert main(["check", "--num-prompts", "6", "--max-new-tokens", "8", "--hidden-size", "64", "--intermediate-size",
                 "160", "--backend", "exact", "--threads", "1", "--scoring-threads", "2,3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["threads"] == 1 and row["scoring_threads"] == [2, 3]
    assert row["tokens"] == row["bitwise_equal"] == 6 * 8 * 3 * 3 * 2


def test_check_bad_dtype_is_one_clear_error(capsys):
    assert main(["check", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "unsupported dtype 'fp8'" in err and "Traceback" not in err
