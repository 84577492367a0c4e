"""`.ci/clean_tmp`: a CI run removes what earlier CI runs of this project left in the temporary directory (and nothing
else), then fails in one line when the disk has no room for the run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs .ci/clean_tmp in subprocesses

ROOT = Path(__file__).resolve().parents[2]
FOUR_HOURS = 4 * 3600


def _directory(tmp: Path, name: str, files: tuple[str, ...], age_s: float) -> Path:
    directory = tmp / name
    for file in files:
        path = directory / file
        if file.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("<title>vexact</title>" if file == "index.html" else "")
    directory.mkdir(exist_ok=True)
    then = time.time() - age_s
    os.utime(directory, (then, then))
    return directory


def _clean_tmp(tmp: Path, need_gib: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "VEXACT_CI_NEED_GIB": str(need_gib)}
    return subprocess.run(["bash", str(ROOT / ".ci" / "clean_tmp")], env=env, capture_output=True, text=True)


def test_clean_tmp_removes_only_old_ci_scratch_of_this_project(tmp_path):
    vllm_files = ("editable.lock", "vllm_tests.log", "venv/")
    site_files = ("404.html", "index.html", "results/horizon/index.html")
    removed = [
        _directory(tmp_path, "vexact-ci.AAAA", ("vllm/venv/",), FOUR_HOURS),
        _directory(tmp_path, "tmp.vllmOld", vllm_files, FOUR_HOURS),
        _directory(tmp_path, "tmp.siteOld", site_files, FOUR_HOURS),
    ]
    kept = [
        _directory(tmp_path, "vexact-ci.BBBB", ("vllm/venv/",), 60),  # a CI run beside this one
        _directory(tmp_path, "tmp.vllmYoung", vllm_files, 60),
        _directory(tmp_path, "tmp.someoneElses", ("venv/", "vllm_tests.log"), FOUR_HOURS),  # no lock: not ours
        _directory(tmp_path, "tmp.anotherSite", ("404.html", "index.html"), FOUR_HOURS),  # not this project's site
        _directory(tmp_path, "mine", vllm_files, FOUR_HOURS),  # not a mktemp name
    ]
    result = _clean_tmp(tmp_path, need_gib=0)
    assert result.returncode == 0, result.stderr
    assert [d.name for d in removed if d.exists()] == []
    assert [d.name for d in kept if not d.exists()] == []
    assert f"clean_tmp: removed 3 directories earlier CI runs left in {tmp_path}" in result.stdout


def test_clean_tmp_fails_in_one_line_when_the_disk_has_no_room(tmp_path):
    result = _clean_tmp(tmp_path, need_gib=10**9)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: CI needs about {10**9} GiB free in {tmp_path}")
