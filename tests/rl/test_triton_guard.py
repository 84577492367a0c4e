"""The Triton-interpreter guard (``vexact.rl.triton_guard``): a run on the Triton backend in the interpreter that would
take too long is refused before any file is written, naming the estimate; an override and small runs warn."""

from __future__ import annotations

import pytest
from rich.console import Console
from test_trainer import EXPERIMENT

from vexact.cli import main
from vexact.rl import triton_guard
from vexact.rl.config import load_config
from vexact.rl.tasks import make_task
from vexact.rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture
def interpreted(monkeypatch):
    """As on a machine without CUDA (and with the triton extra), whatever this one has."""
    monkeypatch.setattr(triton_guard, "interpreting", lambda: True)
    monkeypatch.setattr(triton_guard, "triton_installed", lambda: True)  # the estimate needs no triton
    monkeypatch.delenv(triton_guard.ALLOW_ENV, raising=False)


def _task(cfg):
    return make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len, cfg.task.partial_credit)


def test_triton_run_too_long_for_the_interpreter_is_refused_before_any_file(tmp_path, interpreted):
    cfg = load_config(EXPERIMENT, ["backend=triton", f"output_dir={tmp_path / 'run'}",
                                   f"warm_start.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match=r"config error at 'backend': .* roughly \d+\.\d h \(warm start "
                                         r".*VEXACT_ALLOW_SLOW_TRITON=1") as info:
        Trainer(cfg, Console(quiet=True))
    assert "backend: exact" in str(info.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("overrides, key", [(["rollout.backend=triton"], "rollout.backend"),
                                            (["inject.mode=kernel", "inject.kernel_backend=triton"],
                                             "inject.kernel_backend")])
def test_the_refusal_names_the_key_that_asks_for_triton(tmp_path, interpreted, overrides, key):
    """It named 'backend', already exact, and advised setting it to exact: a change that changes nothing."""
    cfg = load_config(EXPERIMENT, [*overrides, f"output_dir={tmp_path / 'run'}",
                                   f"warm_start.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match=rf"^config error at '{key}': .* Use {key}: exact "):
        Trainer(cfg, Console(quiet=True))


def test_triton_override_and_small_runs_warn_with_the_estimate(tmp_path, interpreted, monkeypatch):
    cfg = load_config(EXPERIMENT, ["backend=triton", f"warm_start.cache_dir={tmp_path}"])
    monkeypatch.setenv(triton_guard.ALLOW_ENV, "1")
    console = Console(record=True, width=300)
    cost = triton_guard.check_interpreted_triton(cfg, _task(cfg), console)
    assert cost.total > triton_guard.REFUSE_ABOVE_S and cost.warm_start > 0
    text = console.export_text()
    assert "warning: Triton kernels run in the Triton interpreter" in text and "roughly" in text
    monkeypatch.delenv(triton_guard.ALLOW_ENV)
    tiny = load_config(EXPERIMENT, ["backend=triton", "steps=1", "warm_start.steps=0", "model.hidden_size=16",
                                    "model.num_layers=1", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2",
                                    "task.eval_prompts=1", "distributed.leaves=1"])
    cost = triton_guard.check_interpreted_triton(tiny, _task(tiny), console)
    assert 0 < cost.total <= triton_guard.REFUSE_ABOVE_S and cost.warm_start == 0


def test_only_interpreted_triton_paths_are_counted(interpreted, monkeypatch):
    exact = load_config(EXPERIMENT)
    assert triton_guard.check_interpreted_triton(exact, _task(exact)) is None
    rollout_only = load_config(EXPERIMENT, ["rollout.backend=triton", "steps=1"])
    cost = triton_guard.estimate(rollout_only, _task(rollout_only))
    assert cost.warm_start == 0 and cost.rl > 0  # the warm start trains on the exact backend
    monkeypatch.setattr(triton_guard, "interpreting", lambda: False)  # a GPU compiles the kernels
    triton = load_config(EXPERIMENT, ["backend=triton"])
    assert triton_guard.check_interpreted_triton(triton, _task(triton)) is None


def test_cli_refuses_a_long_interpreted_triton_run(tmp_path, interpreted, capsys):
    assert main(["run", str(EXPERIMENT), "--set", "backend=triton", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "VEXACT_ALLOW_SLOW_TRITON" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
