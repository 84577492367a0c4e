"""triton is an optional extra (``pip install "vexact[triton]"``, ~290 MB): without it the package, the CLI and the
tests work on a CPU, and asking for the Triton kernels is one clear error naming that pip line.

"Without triton" is made real, not simulated by a flag: ``sys.modules["triton"] = None`` makes every import of triton
fail in that process, as on a machine where it is not installed, whatever this one has. The subprocess checks run a
fresh interpreter so that nothing imported earlier in this session hides an import of triton."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import all_test_files

import vexact_kernels
from vexact.rl import triton_guard
from vexact.rl.config import config_from_dict
from vexact.rl.tasks import make_task
from vexact_kernels import TRITON_PIP

ROOT = Path(__file__).resolve().parents[2]
BLOCK = "import sys; sys.modules['triton'] = None; "  # every `import triton` now raises ImportError
TRITON_TESTS = [  # every test that needs triton: whole modules, and single tests (with their parameter counts)
    ("tests/kernels/test_triton_kernels.py", 0),
    ("tests/kernels/test_triton_audit.py", 0),
    ("tests/kernels/test_triton_inputs.py", 0),
    ("tests/kernels/test_kernel_contract.py::test_backend_satisfies_the_kernel_ops_contract[triton_exact]", 1),
    ("tests/engine/test_exactness.py::test_triton_backend_end_to_end", 2),
    ("tests/cli/test_benchmarks.py::test_triton_exact_backend_runs_both_benchmarks", 1),
]


def _python(code: str, ci: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_get_ops_names_the_extra_when_triton_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    assert not vexact_kernels.triton_installed()
    for backend, device in (("triton", "cpu"), ("exact", "cuda")):  # exact on a CUDA device is the Triton kernels
        with pytest.raises(ValueError, match=re.escape(f"need the triton package, which is not installed: "
                                                       f"{TRITON_PIP}")):
            vexact_kernels.get_ops(backend, device)
    assert vexact_kernels.get_ops("exact", "cpu") is vexact_kernels.cpu_exact  # the CPU kernels need no triton
    assert TRITON_PIP == 'pip install "vexact[triton]"'


@pytest.mark.parametrize("overrides, key", [
    ({"backend": "triton"}, "backend"),
    ({"rollout": {"backend": "triton"}}, "rollout.backend"),
    ({"inject": {"mode": "kernel", "kernel_backend": "triton"}}, "inject.kernel_backend"),
])
def test_a_run_on_triton_without_triton_is_refused_before_the_estimate(monkeypatch, overrides, key):
    """The guard every run passes before it writes anything: without the package the run is refused naming the
    config key and the pip line (it used to estimate hours in the interpreter, for kernels that cannot load)."""
    monkeypatch.setattr(triton_guard, "triton_installed", lambda: False)
    monkeypatch.setattr(triton_guard, "interpreting", lambda: False)  # refused on a GPU host too
    cfg = config_from_dict({"steps": 1, "warm_start": {"steps": 0}, **overrides})
    task = make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    with pytest.raises(ValueError, match=rf"config error at '{re.escape(key)}': .* not installed here: "
                                         rf"{re.escape(TRITON_PIP)}"):
        triton_guard.check_interpreted_triton(cfg, task)
    native = config_from_dict({"steps": 1, "warm_start": {"steps": 0}})
    assert triton_guard.check_interpreted_triton(native, task) is None  # exact/native: triton never asked for


@pytest.mark.slow
def test_the_package_and_the_cli_work_without_triton(tmp_path):
    """In a fresh interpreter where triton cannot be imported: vexact and every module the CLI names import,
    ``vexact check`` passes on the exact CPU kernels, and ``--backend triton`` / the Triton audit are one error naming
    the pip line (exit 2)."""
    code = ("import importlib, json\n"
            "from vexact.cli import main\n"
            "mods = ['vexact', 'vexact.cli', 'vexact.live', 'vexact.testing', 'vexact.real.compare', "
            "'vexact.integrations.trl', 'vexact.rl.trainer', 'vexact_kernels', 'vexact_kernels.triton_audit']\n"
            "for m in mods: importlib.import_module(m)\n"
            "tiny = ['--dtype', 'fp32', '--num-prompts', '2', '--max-new-tokens', '2', '--hidden-size', '32', "
            "'--num-layers', '1', '--batch-sizes', 'all,1', '--micro-batch-sizes', 'all', '--threads', '1']\n"
            "codes = [main(['check', *tiny]), main(['check', '--backend', 'triton', *tiny])]\n"
            "from vexact_kernels import triton_audit\n"
            "codes.append(triton_audit.main([]))\n"
            "print(json.dumps(codes))\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[0, 2, 2]", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: rollout log-probs == training log-probs bit for bit on exact/float32" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the Triton kernels (backend 'triton', or 'exact' on a CUDA device) need the triton package, which is "
        f"not installed: {TRITON_PIP}",
        f"error: the Triton audit needs the triton package, which is not installed: {TRITON_PIP}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_tests_that_need_triton_skip_without_it_and_fail_under_ci():
    """Each test that needs triton goes through ``conftest.require_optional``: without triton (imports really failing)
    it is skipped naming the pip line -- no collection error from a module-level ``import triton`` -- and under
    ``CI=true`` it fails (a module: a collection error), so CI, which installs the triton extra, never passes by
    skipping them."""
    modules = sum(1 for _, n in TRITON_TESTS if n == 0)
    single = sum(n for _, n in TRITON_TESTS)
    files_with_single = sum(1 for _, n in TRITON_TESTS if n > 0)  # outside CI one skip stands for a file's tests
    args = [path for path, _ in TRITON_TESTS] + ["-q", "-rs", "-p", "no:cacheprovider"]
    skipped = _python(f"import pytest; sys.exit(pytest.main({args!r}))")
    summary = skipped.stdout.strip().splitlines()[-1]
    assert skipped.returncode == 0 and re.match(rf"{modules + files_with_single} skipped in ", summary), \
        skipped.stdout[-3000:]
    assert f"triton is not installed: {TRITON_PIP}" in skipped.stdout, skipped.stdout

    failed = _python(f"import pytest; sys.exit(pytest.main({args + ['--continue-on-collection-errors']!r}))", ci=True)
    summary = failed.stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|skipped|errors?)\b", summary)}
    assert failed.returncode == 1, failed.stdout[-3000:]  # failed in the test, its setup (marker) or collection
    assert counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0) == modules + single, summary
    assert "passed" not in counts and "skipped" not in counts, summary
    assert f"triton is not installed: {TRITON_PIP} (CI=true" in failed.stdout


def test_every_module_level_import_of_triton_in_the_tests_is_guarded():
    """A test module that imports triton at its top calls ``require_optional("triton", ...)`` before it (else the
    module cannot even be collected without triton); a test that uses the Triton kernels is listed above."""
    unguarded = []
    for path in all_test_files():
        text = path.read_text()
        first_import = re.search(r"^(import triton|from triton)\b", text, flags=re.M)
        if first_import is None:
            continue
        guard = re.search(r'^require_optional\("triton", TRITON_PIP\)', text, flags=re.M)
        if guard is None or guard.start() > first_import.start():
            unguarded.append(path.name)
        if not any(p == path.relative_to(ROOT).as_posix() for p, _ in TRITON_TESTS):
            unguarded.append(f"{path.name} (not in TRITON_TESTS)")
    assert unguarded == []
