"""The optional-package rule: a test that needs verl, openrlhf, ray, tensorboard, wandb or the smollm2 extra is
skipped with the pip line when the package is absent, and fails when it is absent under CI (``CI=true``), so that the
README's ``pip install -e ".[dev]"`` then ``python -m pytest -q`` passes on a fresh machine while CI can never pass by
skipping the verl or OpenRLHF parity test. Every such test goes through ``conftest.require_optional`` (or the
``needs_package`` marker, which calls it); the end-to-end cases run real test files with the package hidden
(``VEXACT_TEST_ABSENT``).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import ABSENT_ENV, CI_SECOND_VENV, TESTS, all_test_files, require_optional, run_pytest

ROOT = TESTS.parent
ABSENT = "vexact_no_such_package_xyz"


def test_absent_is_a_skip_naming_the_pip_line(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=rf"{ABSENT} is not installed: pip install thing==1\.0"):
        require_optional(ABSENT, "pip install thing==1.0")


@pytest.mark.parametrize("value", ["true", "1", "TRUE"])
def test_absent_under_ci_is_a_failure(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match=rf"{ABSENT} is not installed: pip install thing.*CI=true"):
        require_optional(ABSENT, "pip install thing")


def test_present_passes_under_ci_and_hidden_counts_as_absent(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require_optional("yaml", "pip install pyyaml")  # installed: nothing happens
    monkeypatch.setenv(ABSENT_ENV, "json,yaml")
    with pytest.raises(pytest.fail.Exception, match="yaml is not installed"):
        require_optional("yaml", "pip install pyyaml")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        require_optional("yaml", "pip install pyyaml")


def _pytest(*args: str, ci: bool, hidden: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env[ABSENT_ENV] = hidden
    if ci:
        env["CI"] = "true"
    return run_pytest("-rs", *args, cwd=ROOT, env=env)


# (test file, one cheap test in it, the module it needs, the pip line its skip names)
REAL_FILES = [
    ("tests/integrations/test_verl_parity.py", "test_presets_match_verls_factories and disabled", "verl",
     "pip install --no-deps verl==0.9.1"),  # a fixture calls require_optional
    ("tests/integrations/test_openrlhf_parity.py", "test_every_check_has_a_changed_source", "openrlhf",
     "pip install --no-deps openrlhf==0.11.2"),  # the needs_package marker on the module
    ("tests/integrations/test_log_backends.py", "test_wandb_offline_run_holds_every_jsonl_scalar", "wandb",
     "pip install 'vexact[wandb]'"),  # the needs_package marker on a test
]


@pytest.mark.slow
@pytest.mark.parametrize("path,selection,module,pip_line", REAL_FILES)
def test_a_real_test_file_skips_without_the_package_and_fails_under_ci(path, selection, module, pip_line):
    skipped = _pytest(path, "-k", selection, ci=False, hidden=module)
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert re.search(r"\b1 skipped\b", skipped.stdout) and " passed" not in skipped.stdout, skipped.stdout[-3000:]
    assert f"{module} is not installed: {pip_line}" in skipped.stdout, skipped.stdout[-3000:]

    failed = _pytest(path, "-k", selection, ci=True, hidden=module)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert f"{module} is not installed: {pip_line}" in failed.stdout and "CI=true" in failed.stdout
    assert "skipped" not in failed.stdout.splitlines()[-1], failed.stdout[-3000:]


@pytest.mark.parametrize("pip_line", [line for *_, line in REAL_FILES if "--no-deps" in line])
def test_a_pinned_release_a_test_names_is_the_one_ci_installs(pip_line):
    """The parity tests read one release's source; .ci/run must install that release (the subprocess test above
    checks that the test file's skip names this pip line)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^python3 -m pip install --quiet {re.escape(pip_line.removeprefix('pip install '))}$", ci,
                     re.M), pip_line


def test_no_test_skips_on_a_missing_package_by_itself():
    """The rule has one home: no test module tests for a package with its own skip (importorskip, or a skipif on
    find_spec), which would skip under CI too."""
    own = []
    for path in all_test_files():
        text = path.read_text()
        for pattern in (r"(?<!``)pytest\.importorskip\(", r"skipif\([^)]*find_spec"):  # code, not prose
            own += [f"{path.name}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert own == [], own


@pytest.mark.slow
def test_a_file_whose_every_test_needs_the_package_is_one_skip():
    """Without verl the parity file is one skip naming the pip line, not one per parametrised case (there were 1017,
    which buried every other skip reason); under CI each case still fails (above)."""
    skipped = _pytest("tests/integrations/test_verl_parity.py", ci=False, hidden="verl")
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert skipped.stdout.splitlines()[-1].startswith("1 skipped"), skipped.stdout[-3000:]
    assert "verl is not installed: pip install --no-deps verl==0.9.1" in skipped.stdout


def test_a_package_ci_installs_in_a_second_venv_skips_in_the_main_one_naming_it(monkeypatch):
    (module, script), *_ = CI_SECOND_VENV.items()
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv(ABSENT_ENV, module)
    with pytest.raises(pytest.skip.Exception, match=rf"{module} is not installed: pip x \(CI runs this test in a "
                                                    rf"second venv: \.ci/run starts {re.escape(script)}\)"):
        require_optional(module, "pip x")


def _files_needing(module: str) -> list[str]:
    pattern = rf"(?:require_optional|needs_package)\(\s*[\"']{re.escape(module)}[\"']"
    return sorted(p.relative_to(ROOT).as_posix() for p in all_test_files() if re.search(pattern, p.read_text()))


@pytest.mark.parametrize("module", sorted(CI_SECOND_VENV))
def test_every_file_needing_a_second_venv_package_runs_there_and_ci_starts_it(module):
    """The main venv skips these files under CI=true; the second venv's script must run each of them, and .ci/run must
    start that script, or CI would pass without ever running them."""
    script = CI_SECOND_VENV[module]
    text = (ROOT / script).read_text()
    run_line = re.split(r'"\$py" (?:-P )?-m pytest', text, maxsplit=1)[1].split("\n\n", 1)[0]
    named = sorted(set(re.findall(r"tests/\w+/test_\w+\.py", run_line)))
    assert _files_needing(module) and named == _files_needing(module), (named, _files_needing(module))
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf'^setsid (?:"\$\{{low_priority\[@\]\}}" )?bash {re.escape(script)} .*&$', ci, re.M)
    assert 'wait "$vllm_pid"' in ci
