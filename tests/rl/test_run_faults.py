"""Faults against one run, tried as a hostile user would: kills at every write boundary of a checkpoint, damaged
and hostile checkpoint files, concurrent runs, every resume variant, torn metric lines, bad paths.

Each case asserts that nothing finished is lost and the resumed run is bit-identical to an uninterrupted one
(metrics apart from timings, and the final weights), or that it is refused with one clear message.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import interrupt_trainer_at
from rich.console import Console
from test_sweep_faults import FAST, _cli_error
from test_trainer import EXPERIMENT, _short

from tools.studies.same_runs import same_run
from vexact.cli import EXIT_ENVIRONMENT, main
from vexact.records import runlog
from vexact.records.atomic import WriteFailed
from vexact.records.runlog import (
    RunLocked,
    checkpoint_dirs,
    discard_if_interrupted_early,
    latest_checkpoint,
    read_metrics,
    run_lock,
)
from vexact.rl.config import ConfigError, load_config
from vexact.rl.objective import RunStopped
from vexact.rl.trainer import Trainer

BOUNDARIES = ("checkpoint.safetensors", "optimizer.pt", "trainer_state.json", "manifest.json", "publish")


class Killed(BaseException):
    """Stands for SIGKILL in-process: not an Exception, so nothing in the trainer catches and handles it."""


def _run(cfg, resume: bool = False, allow: tuple[str, ...] = (), console: Console | None = None) -> dict:
    return Trainer(cfg, console or Console(quiet=True)).run(resume=resume, allow_changes=allow)


def _same_run(a: Path, b: Path) -> None:
    """Bit-identical runs: every metric but timings, and the final weights (``tools.studies.same_runs``)."""
    same, why = same_run(a, b)
    assert same, why


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every faulty one is compared with (6 steps, checkpoints after steps 1, 3, 5)."""
    root = tmp_path_factory.mktemp("reference")
    _run(_short(root, "full"))
    return root / "full"


def _cfg(tmp_path: Path, reference: Path, name: str, *overrides: str):
    """The reference's config in a new directory, sharing its warm-start cache, the pytest run's (so no warm start is
    redone)."""
    return _short(tmp_path, name, *overrides)


# --------------------------------------------------------------------------- kills during a checkpoint
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_kill_at_every_checkpoint_write_boundary_loses_nothing(tmp_path, reference, monkeypatch, boundary):
    """Killed after one file of the step-4 checkpoint: resume uses the step-2 one (or step 4 once published)."""
    cfg = _cfg(tmp_path, reference, "cut")
    calls = []

    def kill_at(name: str) -> None:
        calls.append(name)
        published = calls.count("publish") - (name == "publish")  # checkpoints complete before this one
        if name == boundary and published == 1:  # during the second checkpoint
            raise Killed(name)

    monkeypatch.setattr(runlog, "_write_boundary", kill_at)
    with pytest.raises(Killed):
        _run(cfg)
    published = [d.name for d in checkpoint_dirs(tmp_path / "cut")]
    assert published == (["step-00000004", "step-00000002"] if boundary == "publish" else ["step-00000002"])
    monkeypatch.setattr(runlog, "_write_boundary", lambda name: None)
    assert _run(cfg, resume=True)["status"] == "completed"
    _same_run(tmp_path / "cut", reference)
    assert not list((tmp_path / "cut" / "checkpoints").glob(".partial-*"))


@pytest.mark.slow
def test_sigkill_between_weights_and_trainer_state_resumes_bit_identically(tmp_path, reference):
    """The reported failure, for real: a process killed (os._exit) after the new weights landed but before the
    trainer state. Resume must not mix the new weights with the old state."""
    cfg_file = tmp_path / "cut.yaml"
    cfg = _cfg(tmp_path, reference, "cut")
    cfg_file.write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
    script = ("import os, sys\nfrom vexact.records import runlog\nfrom vexact.cli import main\n"
              "count = []\n"
              "def boundary(name):\n"
              "    count.append(name)\n"
              "    if name == 'optimizer.pt' and count.count('publish') == 1:\n"
              "        os._exit(137)\n"
              "runlog._write_boundary = boundary\n"
              f"sys.exit(main(['run', {str(cfg_file)!r}]))\n")
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert main(["run", str(cfg_file), "--resume"]) == 0
    _same_run(tmp_path / "cut", reference)


# --------------------------------------------------------------------------- damaged and hostile checkpoints
def _cut_after_step(tmp_path: Path, reference: Path, monkeypatch, name: str = "cut", step: int = 5):
    """A run interrupted during ``step`` (Ctrl-C): checkpoints after steps 1 and 3 exist."""
    cfg = _cfg(tmp_path, reference, name)
    real_step = interrupt_trainer_at(monkeypatch, step)
    assert _run(cfg)["status"] == "interrupted"
    monkeypatch.setattr(Trainer, "step", real_step)
    return cfg


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, monkeypatch, capsys):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    newest = latest_checkpoint(tmp_path / "cut")
    weights = newest / "checkpoint.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit-pattern in a tensor: only the hash can tell
    weights.write_bytes(bytes(data))
    assert _run(cfg, resume=True, console=Console(file=sys.stdout, width=1000))["status"] == "completed"
    assert "does not match its hash" in capsys.readouterr().out
    _same_run(tmp_path / "cut", reference)


@pytest.mark.parametrize("damage", ["missing_file", "missing_manifest", "garbage_manifest"])
def test_incomplete_checkpoints_are_skipped(tmp_path, reference, monkeypatch, damage):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    newest = latest_checkpoint(tmp_path / "cut")
    if damage == "missing_file":
        (newest / "trainer_state.json").unlink()
    elif damage == "missing_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    assert _run(cfg, resume=True)["status"] == "completed"
    _same_run(tmp_path / "cut", reference)


def test_no_intact_checkpoint_is_a_clear_error(tmp_path, reference, monkeypatch, capsys):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    for directory in checkpoint_dirs(tmp_path / "cut"):
        (directory / "checkpoint.safetensors").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"cannot resume .*cut: no intact checkpoint .*step-00000004: checkpoint"):
        _run(cfg, resume=True)


def test_a_hostile_optimizer_pickle_is_refused_not_run(tmp_path, reference, monkeypatch):
    """An optimizer.pt that would run code, with a manifest forged to match: refused by name, payload not run,
    and the message never suggests loading it unsafely."""
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    newest = latest_checkpoint(tmp_path / "cut")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": Payload()}, newest / "optimizer.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["sha256"]["optimizer.pt"] = runlog.file_sha256(newest / "optimizer.pt")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as error:
        _run(cfg, resume=True)
    assert str(error.value) == (f"refusing to unpickle {newest / 'optimizer.pt'}: not a plain tensor file (it names "
                                f"{os.system.__module__}.system)")
    assert not marker.exists()


# --------------------------------------------------------------------------- concurrent use
def test_a_locked_run_directory_is_refused_with_the_holders_pid(tmp_path, reference):
    cfg = _cfg(tmp_path, reference, "busy")
    with run_lock(tmp_path / "busy"):
        with pytest.raises(RunLocked, match=rf"busy is in use by another vexact process \(pid {os.getpid()}\)"):
            _run(cfg)
        with pytest.raises(RunLocked):
            _run(cfg, resume=True)
    assert not (tmp_path / "busy" / "metrics.jsonl").exists()  # the refused run wrote nothing


@pytest.mark.slow
def test_only_rank_0_probes_the_run_lock(tmp_path, reference, monkeypatch):
    """Every rank of ``vexact run --nproc`` / torchrun checks the run directory before it starts; if each also probed
    the lock, two ranks probing at once would refuse each other (seen in CI). A rank other than 0 leaves the lock to
    rank 0: here it passes the check while the directory is held, where rank 0 is refused."""

    from vexact.rl.run_launch import check_run_dir

    cfg = _cfg(tmp_path, reference, "ranks")
    args = argparse.Namespace(resume=False, config=tmp_path / "ranks.yaml", overrides=[])
    with run_lock(tmp_path / "ranks"):
        monkeypatch.setenv("RANK", "1")
        check_run_dir(args, cfg)
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(RunLocked):
            check_run_dir(args, cfg)


@pytest.mark.slow
def test_two_processes_into_one_run_directory(tmp_path, reference):
    """Two ``vexact run`` at once: one runs, the other exits 2 naming the holder; the run is not mixed. The first
    process waits inside its first step until the second has been refused, so the two really overlap."""
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, reference, "two").to_dict()))
    go = tmp_path / "go"
    script = ("import sys, time\nfrom pathlib import Path\nfrom vexact.cli import main\n"
              "from vexact.rl.trainer import Trainer\nreal = Trainer.step\n"
              "def step(self, s):\n"
              f"    while not Path({str(go)!r}).exists():\n"
              "        time.sleep(0.05)\n"
              "    return real(self, s)\n"
              f"Trainer.step = step\nsys.exit(main(['run', {str(cfg_file)!r}]))\n")
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    lock = tmp_path / "two" / ".lock"
    deadline = time.time() + 120
    while not (lock.exists() and lock.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-m", "vexact.cli", "run", str(cfg_file)], capture_output=True,
                            text=True, timeout=300)
    go.touch()
    first_err = first.communicate(timeout=300)[1]
    assert first.returncode == 0, first_err[-2000:]
    assert second.returncode == 2 and f"(pid {first.pid})" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1
    _same_run(tmp_path / "two", reference)


# --------------------------------------------------------------------------- resume variants
def test_resume_with_a_different_config_is_refused_with_the_diff(tmp_path, reference, monkeypatch):
    _cut_after_step(tmp_path, reference, monkeypatch)
    other = _cfg(tmp_path, reference, "cut", "seed=3", "optimizer.lr=1e-3")
    with pytest.raises(ValueError, match=r"different config: optimizer\.lr: 0\.0002 -> 0\.001; seed: 0 -> 3"):
        _run(other, resume=True)
    with pytest.raises(ValueError, match=r"--allow-change seed: only steps, threads, logging.live"):
        _run(other, resume=True, allow=("seed",))


def test_resume_of_a_finished_run_is_a_no_op_and_more_steps_extend_it(tmp_path, reference, capsys):
    cfg = _cfg(tmp_path, reference, "done")
    _run(cfg)
    run_dir = tmp_path / "done"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    summary = _run(cfg, resume=True, console=Console(file=sys.stdout, width=1000))
    assert "nothing to do" in capsys.readouterr().out and summary["status"] == "completed"
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # summary.json and its last-step metrics untouched

    longer = _cfg(tmp_path, reference, "done", "steps=8")
    with pytest.raises(ValueError, match=r"steps: 6 -> 8.*--allow-change steps"):
        _run(longer, resume=True)
    assert _run(longer, resume=True, allow=("steps",))["steps_completed"] == 8
    change = json.loads((run_dir / "config_changes.jsonl").read_text())
    assert change == {"resumed_at_step": 6, "changes": {"steps": [6, 8]}}
    assert "steps: 8" in (run_dir / "config.yaml").read_text()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(8))


def test_resume_with_other_steps_is_refused_where_the_lr_schedule_spans_them(tmp_path, reference):
    """--allow-change steps on a cosine run whose horizon is its steps: the steps already taken followed the old
    horizon, so the extended run matched no run from the start. Refused naming steps and the schedule; nothing
    written."""
    cfg = _cfg(tmp_path, reference, "cos", "lr_schedule.kind=cosine")
    _run(cfg)
    run_dir = tmp_path / "cos"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    longer = _cfg(tmp_path, reference, "cos", "lr_schedule.kind=cosine", "steps=8")
    with pytest.raises(ConfigError, match=r"^config error at 'steps': 6 -> 8, but lr_schedule\.kind cosine spans the "
                       r"run's steps \(lr_schedule\.total_steps is unset\).*start a new run with steps 8"):
        _run(longer, resume=True, allow=("steps",))
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before


@pytest.mark.parametrize("steps", [3, 4])
def test_resume_with_steps_at_or_below_the_checkpoint_is_refused_naming_steps(tmp_path, reference, monkeypatch, steps):
    """Interrupted with its checkpoint after step 3, resumed with --allow-change steps: steps=3 ended "completed"
    with 5 steps of 3 planned, steps=4 "completed" without the evaluation of its final step (step 3)."""
    _cut_after_step(tmp_path, reference, monkeypatch)
    run_dir = tmp_path / "cut"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    shorter = _cfg(tmp_path, reference, "cut", f"steps={steps}")
    with pytest.raises(ConfigError, match=rf"^config error at 'steps': {steps} ends the run at or before its "
                       r"checkpoint \(after step 3; the run resumes at step 4\): give steps of at least 5$"):
        _run(shorter, resume=True, allow=("steps",))
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # no config change recorded, no summary
    longer = _cfg(tmp_path, reference, "cut", "steps=5")
    summary = _run(longer, resume=True, allow=("steps",))
    assert summary["status"] == "completed" and summary["steps_completed"] == 5
    assert "eval/reward_mean" in read_metrics(run_dir / "metrics.jsonl")[-1]


def test_resume_of_a_finished_run_whose_last_line_is_torn_is_refused_naming_the_line(tmp_path, reference):
    """A completed run whose last metrics line was torn by hand (a kill cannot: the summary follows the closed log)
    resumed as "already finished; nothing to do", the step silently gone from its log. Now it is MetricsDamaged,
    naming the file and line; nothing is written."""
    cfg = _cfg(tmp_path, reference, "torn")
    _run(cfg)
    path = tmp_path / "torn" / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-10])
    before = {p.name: p.read_bytes() for p in path.parent.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(runlog.MetricsDamaged, match=rf"^{path}:6: a torn last line \(no newline\), 5 steps logged, "
                                                    r"but summary.json says the run finished after 6; the metrics "
                                                    r"log is damaged$"):
        _run(cfg, resume=True)
    after = {p.name: p.read_bytes() for p in path.parent.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before


CALIBRATED = ("inject.mode=logit_scale", "inject.epsilon=-0.25", "inject.target.value=0.02",
              "inject.calibration_prompts=4")


def test_a_resumed_calibrated_run_keeps_its_calibration_in_the_summary(tmp_path, reference, monkeypatch):
    """A run with ``inject.target``, interrupted and resumed: the resume restored only the knob, so its summary's
    ``inject`` lost calibrated_value, calibration_metric, calibration_target, calibration_achieved and
    calibration_evaluations. The checkpoint now holds the calibration record; a checkpoint without it (written
    before) resumes all the same, its summary giving the knob alone."""
    full = _run(_cfg(tmp_path, reference, "cal_full", *CALIBRATED))
    assert "calibrated_value" in full["inject"]
    cfg = _cfg(tmp_path, reference, "cal_cut", *CALIBRATED)
    real_step = interrupt_trainer_at(monkeypatch, 5)
    assert _run(cfg)["status"] == "interrupted"
    monkeypatch.setattr(Trainer, "step", real_step)
    resumed = _run(cfg, resume=True)
    assert resumed["inject"] == full["inject"]
    _same_run(tmp_path / "cal_cut", tmp_path / "cal_full")

    import vexact.rl.trainer as trainer_module  # a checkpoint as written before the record was kept

    real_save = trainer_module.save_checkpoint
    monkeypatch.setattr(trainer_module, "save_checkpoint", lambda run_dir, model, optimizer, state, **kw: real_save(
        run_dir, model, optimizer, {k: v for k, v in state.items() if k != "calibration"}, **kw))
    old = _cfg(tmp_path, reference, "cal_old", *CALIBRATED)
    real_step = interrupt_trainer_at(monkeypatch, 5)
    assert _run(old)["status"] == "interrupted"
    monkeypatch.setattr(Trainer, "step", real_step)
    monkeypatch.setattr(trainer_module, "save_checkpoint", real_save)
    summary = _run(old, resume=True)
    assert summary["status"] == "completed"
    assert summary["inject"] == {"mode": "logit_scale", "value": full["inject"]["value"]}


def test_resume_with_no_checkpoint_starts_over(tmp_path, reference, monkeypatch):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch, step=1)  # killed before the first checkpoint
    assert not checkpoint_dirs(tmp_path / "cut")
    assert _run(cfg, resume=True)["status"] == "completed"
    _same_run(tmp_path / "cut", reference)


# --------------------------------------------------------------------------- torn metric lines
def test_a_torn_line_after_the_checkpoint_is_dropped(tmp_path, reference, monkeypatch):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # the crash came mid-write
    assert len(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == 5  # readers skip the torn tail too
    assert _run(cfg, resume=True)["status"] == "completed"
    _same_run(tmp_path / "cut", reference)


def test_a_damaged_line_before_the_checkpoint_is_an_error_naming_file_and_line(tmp_path, reference, monkeypatch):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    path = tmp_path / "cut" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:40]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:3: not a JSON line"):
        _run(cfg, resume=True)


# --------------------------------------------------------------------------- bad paths and the CLI
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, reference, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, reference, "afile").to_dict()))
    assert main(["run", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert "afile exists and is not a directory" in err and "Traceback" not in err

    run_dir = tmp_path / "ok"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, reference, "ok", "steps=1").to_dict()))
    assert main(["run", str(cfg_file)]) == 0
    (run_dir / "config.yaml").write_text("seed: [unclosed")
    assert main(["run", str(cfg_file), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / 'config.yaml'}" in err and "line 1" in err and "Traceback" not in err

    # --allow-change without --resume would be ignored: refused before the config is read
    assert main(["run", str(tmp_path / "missing.yaml"), "--allow-change", "steps"]) == 2
    assert capsys.readouterr().err == ("error: --allow-change steps: lets a key differ from the config.yaml of a run "
                                       "being resumed; give it with --resume\n")


def test_a_run_from_before_checkpoint_directories_still_resumes(tmp_path, reference, monkeypatch):
    """Old layout: checkpoint.safetensors, optimizer.pt and trainer_state.json in the run directory itself."""
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    run_dir = tmp_path / "cut"
    newest = latest_checkpoint(run_dir)
    for name in ("checkpoint.safetensors", "optimizer.pt", "trainer_state.json"):
        (newest / name).rename(run_dir / name)
    for directory in checkpoint_dirs(run_dir):
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    assert _run(cfg, resume=True)["status"] == "completed"
    _same_run(run_dir, reference)


def test_resume_without_the_runs_config_is_refused(tmp_path, reference, monkeypatch):
    cfg = _cut_after_step(tmp_path, reference, monkeypatch)
    (tmp_path / "cut" / "config.yaml").unlink()
    with pytest.raises(ValueError, match=r"config\.yaml is missing, so the config the run was started with"):
        _run(cfg, resume=True)


def test_an_unwritable_output_dir_is_one_line(tmp_path, reference, capsys):
    if os.geteuid() == 0:  # root writes anywhere; use a path below a file instead: the same OSError class
        target = tmp_path / "afile2" / "run"
        (tmp_path / "afile2").write_text("x")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        target = tmp_path / "ro" / "run"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, reference, "x", f"output_dir={target}").to_dict()))
    assert main(["run", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --------------------------------------------------------------------------- same_runs: a repeat, compared
def test_same_runs_finds_a_repeat_identical_and_another_seed_different(tmp_path, reference, capsys):
    """``python -m tools.studies.same_runs``: the reference run repeated is identical (exit 0); a run with another
    seed differs (exit 1, naming the first differing line); an odd number of runs or a non-run is a clear error."""
    from tools.studies.same_runs import main, same_run

    _run(_cfg(tmp_path, reference, "again"))
    _run(_cfg(tmp_path, reference, "other", "seed=1"))
    assert same_run(reference, tmp_path / "again")[0]
    assert main([str(reference), str(tmp_path / "again")]) == 0
    assert main([str(reference), str(tmp_path / "again"), str(reference), str(tmp_path / "other")]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "metric line" in out and out.strip().endswith("1 of 2 pairs identical")
    assert main([str(reference), str(tmp_path / "nothing")]) == 2
    with pytest.raises(SystemExit):
        main([str(reference)])


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_interrupt_during_warm_start_removes_the_new_run_dir(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("vexact.rl.trainer.warm_start", interrupted)
    cfg = _short(tmp_path, "run")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, Console(quiet=True)).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_interrupt_in_the_first_step_removes_it_too_but_a_finished_step_is_kept(tmp_path, monkeypatch):
    real_step = Trainer.step
    calls = []

    def step(self, number):
        calls.append(number)
        if len(calls) > stop_after:
            raise KeyboardInterrupt
        return real_step(self, number)

    monkeypatch.setattr(Trainer, "step", step)
    stop_after = 0
    summary = Trainer(_short(tmp_path, "none", "warm_start.steps=0"), Console(quiet=True)).run()
    assert summary["status"] == "interrupted" and not (tmp_path / "none").exists()
    stop_after, calls[:] = 1, []
    summary = Trainer(_short(tmp_path, "one", "warm_start.steps=0"), Console(quiet=True)).run()
    assert summary["status"] == "interrupted" and summary["steps_completed"] == 1
    assert len(runlog.read_metrics(tmp_path / "one" / "metrics.jsonl")) == 1  # finished: kept for --resume


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_discard_keeps_existing_dirs_and_anything_finished(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(KeyboardInterrupt), discard_if_interrupted_early(existing, log=lambda _: None):
        raise KeyboardInterrupt
    assert existing.is_dir()  # not created by this run
    for name, content in (("metrics.jsonl", '{"step": 0}\n'), ("notes.txt", "mine")):
        run = tmp_path / name
        with pytest.raises(KeyboardInterrupt), discard_if_interrupted_early(run, log=lambda _: None):
            run.mkdir()
            (run / "config.yaml").write_text("{}")
            (run / name).write_text(content)
            raise KeyboardInterrupt
        assert (run / name).read_text() == content
    fresh = tmp_path / "fresh"
    with discard_if_interrupted_early(fresh, log=lambda _: None):  # no interrupt: nothing is removed
        fresh.mkdir()
    assert fresh.is_dir()


ROOT = Path(__file__).resolve().parents[2]


TINY_RUN = [f"{k}={v}" for k, v in FAST.items()] + ["threads=1", "logging.live=false", "logging.checkpoint_every=1"]


def _tiny(tmp_path: Path, name: str, *overrides: str):
    return load_config(EXPERIMENT, [*TINY_RUN, f"output_dir={tmp_path / name}", *overrides])


def _write_config(tmp_path: Path, name: str, *overrides: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_tiny(tmp_path, name, *overrides).to_dict()))
    return path


def _fail_fsync_of(monkeypatch, name: str, code: int) -> None:
    """os.fsync fails with ``code`` for a file called ``name`` (as it does on a full disk): the data did not fit."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + name):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGINT, 130, id="SIGINT"),
                                      pytest.param(signal.SIGTERM, 143, id="SIGTERM")])
def test_a_signal_mid_run_records_interrupted_says_resume_and_the_resume_is_bit_identical(tmp_path, sig, code):
    """``kill -INT`` or ``kill -TERM`` (a job scheduler's stop: scancel, a time limit, pod deletion, ``timeout``) of
    a single-process ``vexact run`` mid-run. SIGTERM ended the process at once (exit -15): no interrupted summary,
    no resume hint. Both now stop the run alike; only the exit code (128 + the signal) tells them apart."""
    config = _write_config(tmp_path, "cut", "steps=1000")  # never finishes before the signal
    run_dir = tmp_path / "cut"
    # SIGINT's default disposition, as a terminal gives it (a background job inherits SIGINT ignored)
    run = subprocess.Popen([sys.executable, "-m", "vexact", "run", str(config)], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "10000"},
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir / "metrics.jsonl")) < 2:
            assert run.poll() is None and time.monotonic() < deadline, "the run never got going"
            time.sleep(0.1)
        os.kill(run.pid, sig)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == code, out[-2000:] + err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == sig.name, summary
    assert "interrupted -- finished steps are in metrics.jsonl; continue with --resume" in out, out[-2000:]
    assert "Traceback" not in out + err, err[-2000:]

    steps = len(read_metrics(run_dir / "metrics.jsonl")) + 1  # one step past what finished (and its checkpoint)
    resumed = subprocess.run([sys.executable, "-m", "vexact", "run", str(run_dir), "--resume", f"--set=steps={steps}",
                              "--allow-change=steps"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    _run(_tiny(tmp_path, "full", f"steps={steps}"))  # the same run, never interrupted
    _same_run(run_dir, tmp_path / "full")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
@pytest.mark.parametrize("name,says", [("metrics.jsonl", "metrics.jsonl: No space left on device"),
                                       ("checkpoint.safetensors", "step-00000001/checkpoint.safetensors: No space "
                                                                  "left on device; the checkpoint is not published")])
def test_a_full_disk_is_one_line_naming_the_file_exit_code_3_and_no_partial_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                       name, says):
    config = _write_config(tmp_path, "full")
    _fail_fsync_of(monkeypatch, name, errno.ENOSPC)
    monkeypatch.setenv("COLUMNS", "10000")
    assert main(["run", str(config)]) == EXIT_ENVIRONMENT == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: cannot write ") and says in err[0], err
    checkpoints = tmp_path / "full" / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []  # nothing partial, nothing published
    monkeypatch.undo()  # room again: the same run resumes
    monkeypatch.setenv("COLUMNS", "10000")
    assert main(["run", str(tmp_path / "full"), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")] == [0, 1]


@pytest.mark.slow
def test_a_file_size_limit_names_the_file_with_exit_code_3(tmp_path):
    """A real RLIMIT_FSIZE (ulimit -f) in a child process: writing the checkpoint exceeds it."""
    config = _write_config(tmp_path, "limited")
    limit = 48 * 1024  # above config.yaml and a metrics line, below the model's weights (about 360 KB)

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "vexact", "run", str(config)], cwd=ROOT, preexec_fn=set_limit,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "10000"})
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, done.stderr[-2000:]
    assert len(err) == 1 and "Traceback" not in done.stderr
    assert err[0].startswith(f"error: cannot write {tmp_path / 'limited' / 'checkpoints' / 'step-00000001'}"
                             "/checkpoint.safetensors: File too large (the file-size limit: ulimit -f)")
    assert list((tmp_path / "limited" / "checkpoints").iterdir()) == []


def test_vexact_run_on_a_directory_that_holds_no_run_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes").mkdir()
    line = _cli_error(capsys, monkeypatch, "run", str(tmp_path / "notes"))
    assert "is a directory but not a vexact run: it holds no config.yaml, metrics.jsonl or checkpoints/" in line


def test_a_torn_last_metrics_line_does_not_block_a_resume_that_changes_an_allowed_key(tmp_path):
    cfg = _tiny(tmp_path, "torn", "steps=3")
    real_step = Trainer.step

    def interrupted(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(self, step)

    Trainer.step = interrupted
    try:
        assert Trainer(cfg, Console(quiet=True)).run()["status"] == "interrupted"
    finally:
        Trainer.step = real_step
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/me')  # the kill came mid-write
    assert [d.name for d in checkpoint_dirs(tmp_path / "torn")] == ["step-00000002", "step-00000001"]
    longer = _tiny(tmp_path, "torn", "steps=4", "logging.eval_every=2")
    summary = Trainer(longer, Console(quiet=True)).run(resume=True, allow_changes=("steps", "logging.eval_every"))
    assert summary["status"] == "completed" and summary["steps_completed"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "torn" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_an_output_dir_of_the_users_own_files_is_refused_and_left_as_it_was(tmp_path, capsys, monkeypatch):
    config = _write_config(tmp_path, "x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    line = _cli_error(capsys, monkeypatch, "run", str(config), "--set", f"output_dir={mine}")
    assert f"{mine} is not empty and not a vexact run directory (it holds notes.txt)" in line
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # no .lock, no run file
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _cli_error(capsys, monkeypatch, "run", str(config), "--set", f"output_dir={empty}", "--resume")
    assert "there is no run there" in line and list(empty.iterdir()) == []  # a refusal leaves no .lock behind


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_ctrl_c_in_the_first_step_says_nothing_is_left_to_resume_and_a_resume_says_why(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the first step of a new run removes its directory. The CLI said "finished steps are in
    metrics.jsonl; continue with --resume", then "removed DIR", then printed a summary table titled with the removed
    DIR/summary.json; the --resume it advised then failed with "config error: config file not found: 'DIR'"."""
    config = _write_config(tmp_path, "first", "warm_start.steps=0")
    interrupt_trainer_at(monkeypatch, 0)
    monkeypatch.setenv("COLUMNS", "10000")
    capsys.readouterr()
    assert main(["run", str(config)]) == 130
    out = capsys.readouterr().out
    assert not (tmp_path / "first").exists()
    assert "--resume" not in out and "summary.json" not in out, out
    assert f"nothing to resume; to start it: vexact run {config}" in out, out
    line = _cli_error(capsys, monkeypatch, "run", str(tmp_path / "first"), "--resume")
    assert line == (f"error: cannot resume {tmp_path / 'first'}: no such run directory (a run interrupted before its "
                    "first step finished leaves none: start it again from its experiment YAML)")


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_a_run_directory_removed_during_the_run_is_one_error_and_not_made_again(tmp_path, capsys, monkeypatch):
    """rm -rf of a running run's directory: the run went on appending to its deleted metrics.jsonl, made the
    directory again for its checkpoints, and ended "completed" (exit 0) with a summary of 0 steps beside
    checkpoints and no log or config."""
    config = _write_config(tmp_path, "gone", "warm_start.steps=0", "steps=4", "logging.checkpoint_every=3")
    real_step = Trainer.step

    def step(self, number):
        if number == 2:
            shutil.rmtree(tmp_path / "gone")
        return real_step(self, number)

    monkeypatch.setattr(Trainer, "step", step)
    line = _cli_error(capsys, monkeypatch, "run", str(config))
    assert line == (f"error: cannot write {tmp_path / 'gone' / 'metrics.jsonl'}: it was deleted while the run wrote "
                    "it; the run directory was removed or its log deleted; the run cannot keep its results")
    assert not (tmp_path / "gone").exists()
    # removed between the step's log line and its checkpoint: the checkpoint does not make the directory again
    with pytest.raises(WriteFailed, match=r"checkpoints: No such file or directory"):
        runlog.save_checkpoint(tmp_path / "gone", torch.nn.Linear(2, 2), None, {"next_step": 3})
    assert not (tmp_path / "gone").exists()


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_resume_of_a_run_that_stopped_before_its_first_checkpoint_is_a_no_op(tmp_path, monkeypatch):
    """A run that stopped itself (non-finite log-probs, say) before its first checkpoint was, on --resume, run
    again from scratch ("no checkpoint ...; starting from scratch"), its log rewritten, instead of being left as the
    finished run it is."""
    real_step = Trainer.step

    def step(self, number):
        if number == 1:
            raise RunStopped("non-finite rollout log-probs (logits) at step 1")
        return real_step(self, number)

    monkeypatch.setattr(Trainer, "step", step)
    cfg = _tiny(tmp_path, "stopped", "logging.checkpoint_every=100")
    assert _run(cfg)["status"] == "stopped" and not checkpoint_dirs(tmp_path / "stopped")
    log = (tmp_path / "stopped" / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(Trainer, "step", lambda self, number: pytest.fail("a finished run was run again"))
    console = Console(record=True, width=400)
    summary = _run(cfg, resume=True, console=console)
    assert summary["status"] == "stopped" and (tmp_path / "stopped" / "metrics.jsonl").read_bytes() == log
    assert (f"{tmp_path / 'stopped'} already finished (stopped after 1 steps: non-finite rollout log-probs (logits) "
            "at step 1); nothing to do") in console.export_text()


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_a_run_that_failed_in_its_first_step_leaves_a_directory_a_new_run_may_start_in(tmp_path, capsys, monkeypatch):
    """An error in the first step (a rollout setting the sampler refused) left config.yaml and an empty
    metrics.jsonl, which counted as results: the corrected command was refused ("already holds a run") and so was a
    --resume with the corrected config (a different config), so the directory had to be removed by hand."""
    config = _write_config(tmp_path, "failed", "warm_start.steps=0", "steps=1")

    def step(self, number):
        raise ValueError("the sampler refused a setting")

    real_step = Trainer.step
    monkeypatch.setattr(Trainer, "step", step)
    assert _cli_error(capsys, monkeypatch, "run", str(config)) == "error: the sampler refused a setting"
    run_dir = tmp_path / "failed"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").read_text() == ""
    monkeypatch.setattr(Trainer, "step", real_step)
    assert main(["run", str(config)]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0]
    # a finished run there is still refused, also one that stopped itself before its first line
    assert "already holds a run" in _cli_error(capsys, monkeypatch, "run", str(config))
    stopped = _write_config(tmp_path, "stopped", "warm_start.steps=0", "steps=1")

    def stopped_step(self, number):
        raise RunStopped("non-finite rollout log-probs (logits) at step 0")

    monkeypatch.setattr(Trainer, "step", stopped_step)
    assert main(["run", str(stopped)]) == 1
    assert (tmp_path / "stopped" / "metrics.jsonl").read_text() == ""
    assert "already holds a run" in _cli_error(capsys, monkeypatch, "run", str(stopped))


def test_a_kill_after_the_final_checkpoint_resumes_to_the_uninterrupted_runs_summary(tmp_path, reference, monkeypatch):
    """Killed after the last step's checkpoint but before summary.json: the resume runs no step, and its summary
    had "last_step_metrics": {} where the uninterrupted run's holds the last step's metrics."""
    def killed(self, *args):
        raise Killed

    monkeypatch.setattr(Trainer, "_finish", killed)
    cfg = _cfg(tmp_path, reference, "late")
    with pytest.raises(Killed):
        _run(cfg)
    monkeypatch.undo()
    assert not (tmp_path / "late" / "summary.json").exists() and latest_checkpoint(tmp_path / "late").name == (
        "step-00000006")
    _run(cfg, resume=True)
    _same_run(reference, tmp_path / "late")

    def summary(run: Path) -> dict:
        return {k: v for k, v in json.loads((run / "summary.json").read_text()).items() if "seconds" not in k}

    assert summary(tmp_path / "late") == summary(reference)


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_a_kill_after_a_collapse_stops_checkpoint_resumes_to_the_same_stop(tmp_path, monkeypatch):
    """collapse.stop_on_collapse: killed after the stop's checkpoint but before summary.json, the resume went on
    training past the collapse (to the next evaluation, where it stopped again): more metric lines and another
    stopping step than the uninterrupted run's."""
    def detect(history, criteria, **kwargs):  # a collapse confirmed from step 2 on (stands for a real one)
        return {"collapsed": history[-1]["step"] >= 2}

    monkeypatch.setattr("vexact.rl.trainer.detect_collapse", detect)
    common = ("collapse.stop_on_collapse=true", "logging.eval_every=1", "steps=6", "logging.checkpoint_every=4")
    reference = _run(_tiny(tmp_path, "whole", *common))
    assert reference["reason"].startswith("collapse confirmed at step 2")
    real_finish = Trainer._finish

    def killed(self, *args):
        raise Killed

    monkeypatch.setattr(Trainer, "_finish", killed)
    cfg = _tiny(tmp_path, "cut", *common)
    with pytest.raises(Killed):
        _run(cfg)
    monkeypatch.setattr(Trainer, "_finish", real_finish)
    assert latest_checkpoint(tmp_path / "cut").name == "step-00000003"
    resumed = _run(cfg, resume=True)
    assert (resumed["reason"], resumed["steps_completed"]) == (reference["reason"], reference["steps_completed"])
    _same_run(tmp_path / "whole", tmp_path / "cut")


def test_an_extended_run_logs_what_a_run_of_its_new_length_from_the_start_logs(tmp_path):
    """A completed run of 2 steps evaluated step 1 for being its last (off logging.eval_every 2); extended to 3 steps it
    kept that evaluation in step 1's row, which a run of 3 steps from the start does not make (and stop_on_collapse
    read it). The extension takes it back: the rows, eval keys included, and the weights are the fresh run's."""
    Trainer(_tiny(tmp_path, "fresh", "steps=3", "logging.eval_every=2"), Console(quiet=True)).run()
    Trainer(_tiny(tmp_path, "ext", "steps=2", "logging.eval_every=2"), Console(quiet=True)).run()
    assert "eval/reward_mean" in read_metrics(tmp_path / "ext" / "metrics.jsonl")[1]
    longer = _tiny(tmp_path, "ext", "steps=3", "logging.eval_every=2")
    assert Trainer(longer, Console(quiet=True)).run(resume=True, allow_changes=("steps",))["steps_completed"] == 3
    rows = read_metrics(tmp_path / "ext" / "metrics.jsonl")
    assert [sorted(k for k in r if k.startswith(("eval/", "timing/eval"))) != [] for r in rows] == [True, False, True]
    _same_run(tmp_path / "ext", tmp_path / "fresh")
