"""The device script's CPU rehearsal: every real-size part of ``benchmarks.gpu_real`` runs at tiny sizes on the CPU,
its JSON is written after each part, what only a GPU has is skipped with its reason, and ``benchmarks/gpu_check.sh``
records a part that ran out of its time limit. Quick: about two minutes on a loaded 2-core host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_real
from vexact_kernels import TRITON_PIP

pytestmark = pytest.mark.slow  # the device script's parts and the script itself: about two minutes

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()


def _rehearse(part: str, out: Path) -> int:
    return gpu_real.main(["--part", part, "--out", str(out), "--rehearse", "--device", "cpu"])


def test_rehearsal_runs_every_part_and_records_each(tmp_path):
    out = tmp_path / "gpu_real.json"
    done = []
    for part in gpu_real.PARTS:
        assert _rehearse(part, out) == 0, part
        done.append(part)
        assert list(json.loads(out.read_text())["parts"]) == done  # written after each part, earlier ones kept
    parts = json.loads(out.read_text())["parts"]
    assert all(p["machine"]["rehearsal"] and p["machine"]["device"] == "cpu" for p in parts.values())

    exactness = {r["backend"]: r for r in parts["exactness"]["rows"]}
    assert parts["exactness"]["status"] == "passed"
    assert exactness["exact"]["tokens"] > 0
    assert exactness["exact"]["generation_batch_invariant"] == {"batches_of_3": True, "alone_first_2": True}
    assert exactness["exact"]["mismatched_by_micro_batch"] == {"8": 0, "3": 0}
    assert all(isinstance(n, int) for n in exactness["native"]["mismatched_by_micro_batch"].values())  # recorded

    memory = parts["train_memory"]
    assert memory["status"] == "passed" and memory["gradients_finite"] and memory["tokens"] == 4 * (4 + 6)
    assert memory["peak_allocated_bytes"] is None and "GPU" in memory["peak_memory_skipped"]  # not faked

    speed = parts["speed"]
    assert speed["status"] == "passed" and "GPU" in speed["peak_memory_skipped"]
    for row in speed["rows"]:
        assert set(row["decode"]) == {"0", "8", "15"}
        for measured in (row["prefill"], row["train_fwd_bwd"], *row["decode"].values()):
            assert measured["tokens_per_s"] > 0 and measured["peak_bytes"] is None  # not faked on the CPU

    assert parts["launches"]["status"] == "skipped" and "CUDA" in parts["launches"]["reason"]
    assert parts["graphed"]["status"] == "skipped" and "CUDA graphs" in parts["graphed"]["reason"]  # not faked
    assert parts["tiles"]["status"] == "skipped" and "--triton-interpreter" in parts["tiles"]["reason"]
    rollout = parts["rollout"]  # eager generation measured; the graphed one said to need a GPU, never faked
    assert rollout["status"] == "passed" and "needs a GPU" in rollout["graphed_skipped"]
    assert all(r["eager"]["tokens"] > 0 and "graphed" not in r for r in rollout["rows"])
    profiles = parts["profiles"]  # on the CPU: the host's operators, said so, never called kernels
    assert profiles["status"] == "passed" and "not kernels" in profiles["events"]
    for row in profiles["rows"]:
        for item in (row["decode_step"], row["train_fwd_bwd"]):
            assert item["launches"] > 0 and item["wall_us"] > 0 and 0 < len(item["top"]) <= 12

    rl = parts["rl_run"]
    assert rl["status"] == "passed" and rl["exit_code"] == 0 and "--device cpu" in rl["command"]
    assert rl["steps"] == 2 and rl["bitwise_equal_frac_by_step"] == [1.0, 1.0] and rl["k3_kl_by_step"] == [0.0, 0.0]

    moe = {r["backend"]: r for r in parts["moe"]["rows"]}
    assert parts["moe"]["status"] == "passed" and moe["exact"]["mismatched"] == 0
    assert moe["exact"]["routing_flip_rate"] == 0.0


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_without_a_gpu_only_the_rehearsal_runs(tmp_path, capsys):
    assert gpu_real.main(["--part", "exactness", "--out", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
    assert gpu_real.main(["--part", "exactness", "--out", str(tmp_path / "x.json")]) == 2  # default cuda
    err = capsys.readouterr().err
    assert "--rehearse" in err and "CUDA" in err
    assert not (tmp_path / "x.json").exists()


def _tree_link_exists() -> bool:
    link = ROOT / "vexact_kernels"
    return link.exists() or link.is_symlink()


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
@pytest.mark.needs_package("triton", TRITON_PIP)  # the script checks that torch and triton import before any part
def test_gpu_check_script_records_a_part_cut_off_by_its_limit(tmp_path):
    """The script's own plumbing, rehearsed: a part over its limit (1 s: less than Python's start) is recorded as
    timed out and fails the script; a part that cannot run on the CPU is skipped with its reason; the tables are
    printed and written at the end; GPU_CHECK_PACK gathers the records and a tarball of the logs."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "VEXACT_GPU_CHECK_REHEARSE": "1", "GPU_CHECK_ONLY": "real",
           "GPU_CHECK_REAL_PARTS": "launches exactness", "GPU_CHECK_EXACTNESS_S": "1", "TMPDIR": str(scratch),
           "GPU_CHECK_PACK": str(tmp_path / "packed")}
    linked_before = _tree_link_exists()
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    # the vexact_kernels link lived in the script's scratch directory, which it removed, and never in the tree,
    # where CI's other test process would import through it and lose the files when it went
    assert list(scratch.iterdir()) == []
    assert _tree_link_exists() == linked_before
    parts = json.loads((tmp_path / "gpu_real.json").read_text())["parts"]
    assert parts["exactness"] == {"status": "timed out", "limit_s": 1}
    # GPU_CHECK_PACK: the records copied out and the other files in one tarball, after a part that timed out too
    packed = sorted(p.name for p in (tmp_path / "packed").iterdir())
    assert packed == ["env.txt", "gpu_check_logs.tar.gz", "gpu_real.json", "summary.txt", "tables.md"]
    # the page's tables at the end, in the console and tables.md: here no part that gives one ran
    tables = (tmp_path / "tables.md").read_text()
    assert tables.startswith("no table for: speed not run, profiles not run, tiles not run, rollout not run")
    assert tables in done.stdout
    with tarfile.open(tmp_path / "packed" / "gpu_check_logs.tar.gz") as logs:
        assert {"./gpu_real_launches.log", "./gpu_real_exactness.log"} <= set(logs.getnames())
    assert parts["launches"]["status"] == "skipped"
    summary = (tmp_path / "summary.txt").read_text()
    assert "gpu_real exactness: exit 124 (timed out after 1s)" in summary and "gpu_real launches: exit 0" in summary


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
@pytest.mark.needs_package("triton", TRITON_PIP)
def test_gpu_check_lease_mode_runs_the_tests_and_the_chosen_parts_without_the_small_benchmark(tmp_path):
    """``GPU_CHECK_ONLY=lease``: the kernels' tests (here the rehearsal's few, in the interpreter), then the real-size
    parts, and not the small-shape benchmark; a mode it does not know is one error line."""
    env = {**os.environ, "OUT": str(tmp_path), "VEXACT_GPU_CHECK_REHEARSE": "1", "GPU_CHECK_ONLY": "lease",
           "GPU_CHECK_REAL_PARTS": "graphed launches"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    wrong = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
                           env={**env, "GPU_CHECK_ONLY": "fast"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("pytest: exit 0") and "gpu_triton" not in summary
    assert "gpu_real graphed: exit 0" in summary and "gpu_real launches: exit 0" in summary
    assert not (tmp_path / "gpu_triton.log").exists()
    assert wrong.returncode == 2 and "GPU_CHECK_ONLY must be all, small, real or lease" in wrong.stdout


@pytest.mark.needs_package("triton", TRITON_PIP)
def test_triton_interpreter_rehearsal_runs_the_triton_kernels_in_the_exact_rows(tmp_path):
    """``--triton-interpreter``: the exact rows are the Triton kernels (the code a GPU compiles), interpreted on the
    CPU; they must be exact as the compiled ones are; then the tile survey's code path. About 35 s."""
    out = tmp_path / "gpu_real.json"
    argv = ["--part", "exactness", "--out", str(out), "--rehearse", "--device", "cpu", "--triton-interpreter"]
    assert gpu_real.main(argv) == 0
    rows = json.loads(out.read_text())["parts"]["exactness"]["rows"]
    assert [r["backend"] for r in rows] == ["triton", "native"]
    assert all(rows[0]["generation_batch_invariant"].values()) and rows[0]["mismatched_by_micro_batch"] == {"8": 0,
                                                                                                         "3": 0}
    assert gpu_real.main([a for a in argv if a != "--rehearse"]) == 2  # a rehearsal mode only
    tiles_argv = ["--part", "tiles", "--out", str(out), "--rehearse", "--device", "cpu", "--triton-interpreter"]
    assert gpu_real.main(tiles_argv) == 0  # the tile survey's code path, with the interpreter's tiles
    tiles = json.loads(out.read_text())["parts"]["tiles"]
    assert set(tiles["candidates"]) == set(gpu_real.REHEARSAL_TILES)
    for candidate in tiles["candidates"].values():  # BLOCK_K kept: in the interpreter every tile sums alike
        assert all(w["same_bits_as_current"] and w["rows_invariant"] for w in candidate["weights"].values())
        assert candidate["summed_us_3_rows"] > 0 and candidate["summed_us_8_rows"] > 0
