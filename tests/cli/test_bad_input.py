"""What a new user hits on long work and bad input: progress (a bar on a terminal, ``[k/N]`` lines otherwise, nothing
under ``--quiet``), ``vexact sweep --set``, absurd model sizes, a full disk or a file-size limit (exit code 3, the file
named, no partial checkpoint), run names that leave ``runs/``, settings that can never learn or never inject, a sweep
without ``base:``, a directory that is not a run, an empty log reported as completed, two sweeps of one file at once,
and a torn metrics line under ``--allow-change``. Tiny runs (no warm start, 2 steps) so that each case takes seconds.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from test_sweep_faults import FAST, _cli_error, _sweep_file
from test_trainer import EXPERIMENT

from vexact.cli import EXIT_ENVIRONMENT, main
from vexact.engine import model as model_module
from vexact.engine.model import ModelConfig, ModelTooLarge, Transformer, parameter_count
from vexact.progress import Progress
from vexact.real.check import CheckSettings, check_units, run_check
from vexact.records.runlog import RunLocked, checkpoint_dirs, read_metrics
from vexact.reports.sweep_report import read_sweep_results
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.trainer import Trainer
from vexact.sweeps import sweep as sweep_module
from vexact.sweeps.sweep import load_sweep_spec, run_sweep, sweep_lock

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = [f"{k}={v}" for k, v in FAST.items()] + ["threads=1", "logging.live=false", "logging.checkpoint_every=1"]


def _tiny(tmp_path: Path, name: str, *overrides: str):
    return load_config(EXPERIMENT, [*TINY_RUN, f"output_dir={tmp_path / name}", *overrides])


def _write_config(tmp_path: Path, name: str, *overrides: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_tiny(tmp_path, name, *overrides).to_dict()))
    return path


class _Clock:
    """time.monotonic for vexact.progress, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- progress
def test_progress_prints_plain_lines_with_k_of_n_elapsed_and_eta_when_not_a_terminal(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("vexact.progress.time.monotonic", clock)
    out = io.StringIO()
    with Progress(Console(file=out, width=200), "sweep s", total=4, done=1) as progress:
        assert progress.mode == "plain"
        clock.now += 30
        progress.advance("a: completed")
        clock.now += 30
        progress.advance("b: completed")
        clock.now += 5
        progress.advance("c: completed")
    lines = out.getvalue().splitlines()
    # one point done before (a resume) is not counted in the rate: 30 s a point here
    assert lines == ["[2/4] sweep s: a: completed (30s elapsed, ETA 1m00s)",
                     "[3/4] sweep s: b: completed (1m00s elapsed, ETA 30s)",
                     "[4/4] sweep s: c: completed (done in 1m05s)"]


def test_progress_throttles_silent_items_and_is_quiet_under_quiet(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("vexact.progress.time.monotonic", clock)
    out = io.StringIO()
    with Progress(Console(file=out, width=200), "check", total=5, min_interval=10) as progress:
        for step in range(5):
            progress.running(f"unit {step}")
            clock.now += 4
            progress.advance()
    # 4 s an item, a line at most every 10 s, and the last one always
    assert out.getvalue().splitlines() == ["[3/5] check: unit 2 (12s elapsed, ETA 8s)", "[5/5] check (done in 20s)"]
    quiet = io.StringIO()
    with Progress(Console(file=quiet), "check", total=2, quiet=True) as progress:
        progress.advance()
        progress.advance("failed point", always=True)
    assert quiet.getvalue() == "failed point\n"  # only what must always be said


def test_progress_draws_a_rich_bar_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with Progress(console, "sweep s", total=2) as progress:
        assert progress.mode == "rich"
        progress.running("seed=0")
        progress.advance("seed=0: completed")
        progress.advance("seed=1: completed")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "seed=0: completed" in text and "2/2" in text and "ETA" in text and "━" in text


def test_sweep_prints_progress_lines_and_a_points_warm_start_before_its_outcome(tmp_path, monkeypatch):
    def fake_point(config: dict, resume: bool, threads: int | None) -> dict:
        return {"status": "completed", "error": None, "warm_start": [f"warm start: loaded cache {config['seed']}"]}

    monkeypatch.setattr(sweep_module, "_run_point", fake_point)
    spec = load_sweep_spec(_sweep_file(tmp_path, "p", grid={"seed": [0, 1]}))
    out = io.StringIO()
    run_sweep(spec, console=Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert lines[0] == "  seed=0 warm start: loaded cache 0"
    assert re.fullmatch(r"\[1/2\] sweep p: seed=0: completed \(\d+s elapsed, ETA \d+s\)", lines[1]), lines
    assert lines[2] == "  seed=1 warm start: loaded cache 1"
    assert re.fullmatch(r"\[2/2\] sweep p: seed=1: completed \(done in \d+s\)", lines[3]), lines
    quiet = io.StringIO()
    spec = load_sweep_spec(_sweep_file(tmp_path, "q", grid={"seed": [0, 1]}))
    run_sweep(spec, console=Console(file=quiet), quiet=True)
    assert quiet.getvalue() == ""


def test_check_reports_progress_on_stderr_keeps_the_verdict_last_and_probe_detail_behind_verbose(capsys,
                                                                                                monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    small = ["--num-prompts", "3", "--max-new-tokens", "4", "--max-prompt-len", "5", "--hidden-size", "32",
             "--intermediate-size", "64", "--backend", "exact"]
    assert main(["check", *small]) == 0
    captured = capsys.readouterr()
    out = [line for line in captured.out.splitlines() if line.strip()]
    assert out[-1].startswith("PASS: rollout log-probs == training log-probs bit for bit on exact/float32")
    assert out[-2].startswith("exact backend (cpu_exact): ops by path: ") and "(per op: --verbose)" in out[-2]
    assert "path per op" not in captured.out  # the per-op table is --verbose's
    assert re.search(r"^\[12/12\] vexact check \(done in \d+s\)$", captured.err, re.M), captured.err
    assert "1 / 1" in captured.out  # generation and scoring at 1 thread by default
    assert main(["check", *small, "--quiet", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "path per op" in captured.out
    assert [line for line in captured.out.splitlines() if line.strip()][-1].startswith("PASS: ")


def test_check_generates_at_one_thread_by_default_and_its_probes_still_cover_the_machines_threads():
    from vexact.cli import build_parser
    from vexact_kernels.host_guard import MACHINE_THREADS

    assert build_parser().parse_args(["check"]).threads == 1
    settings = CheckSettings(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, num_prompts=2, max_prompt_len=4, max_new_tokens=3, threads=1)
    seen = []

    class Recorder:
        def running(self, text: str) -> None:
            seen.append(text)

        def advance(self, said: str | None = None, always: bool = False) -> None:
            seen.append("done")

    before = torch.get_num_threads()
    try:
        (row,) = run_check(settings, ("exact",), progress=Recorder())
    finally:
        torch.set_num_threads(before)
    assert seen.count("done") == check_units(settings) == 3 + 9
    assert seen[0] == "exact/fp32: generating all at once"
    assert row["threads"] == 1
    # Every probe that passed (so its faster path is in use) was checked at the machine's thread count too. The
    # report lists every class this process probed, also those earlier tests probed at another count and the check
    # never used, so "checked at 1 thread" holds only for the classes probed first here.
    # A class that calls the library with 1 thread by construction (bf16 weight gradients: "one-thread") is probed at
    # 1 thread only: no other count ever runs it.
    passed = [p for p in row["kernel_paths"]["probes"] if p["passed"] and not p["shape_class"].endswith("one-thread")]
    assert all(MACHINE_THREADS in p["threads_checked"] for p in passed)  # (fixed-order mode probes nothing)


# --------------------------------------------------------------------------- vexact sweep --set
def test_sweep_set_changes_every_point_and_is_recorded_and_checked_on_a_rerun(tmp_path, capsys, monkeypatch):
    path = _sweep_file(tmp_path, "s", grid={"seed": [0, 1]})
    spec = load_sweep_spec(path, overrides=["optimizer.lr=1e-3", "algorithm.clip_ratio_low=0.1"])
    assert [p.config.optimizer.lr for p in spec.points] == [1e-3, 1e-3]
    assert [p.config.algorithm.clip_low for p in spec.points] == [0.1, 0.1]
    assert [p.config.seed for p in spec.points] == [0, 1]  # the grid still sets each point
    with pytest.raises(ConfigError, match="'seed' is a grid key"):
        load_sweep_spec(path, overrides=["seed=3"])
    with pytest.raises(ConfigError, match="'output_dir' is set by the sweep for every point"):
        load_sweep_spec(path, overrides=["output_dir=x"])
    with pytest.raises(ConfigError, match=r"expected a number > 0, got -1 \(from --set optimizer.lr=-1\)"):
        load_sweep_spec(path, overrides=["optimizer.lr=-1"])

    monkeypatch.setattr(sweep_module, "_run_point", lambda config, resume, threads: {
        "status": "completed", "error": None})
    assert main(["sweep", str(path), "--set", "optimizer.lr=1e-3", "--no-report", "--quiet"]) == 0
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["set"] == ["optimizer.lr=1e-3"]
    for point in spec.points:  # (the fake run leaves only the folder a real run would have)
        point.run_dir.mkdir(parents=True, exist_ok=True)
    line = _cli_error(capsys, monkeypatch, "sweep", str(path), "--set", "optimizer.lr=2e-3")
    assert "was started with --set optimizer.lr=1e-3, and is now given --set optimizer.lr=2e-3" in line
    assert main(["sweep", str(path), "--set", "optimizer.lr=0.001", "--no-report", "--quiet"]) == 0  # same value
    # steps may grow (the sweep extends its finished points)
    assert main(["sweep", str(path), "--set", "optimizer.lr=1e-3", "--set", "steps=3", "--no-report",
                 "--quiet"]) == 0


def test_sweep_help_names_no_resume_flag_it_does_not_have(capsys):
    for command in ("sweep", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--resume" not in text, command
        assert "re-running" in text and "--quiet" in text
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "--set KEY=VALUE" in capsys.readouterr().out


# --------------------------------------------------------------------------- model sizes, full disks
@pytest.mark.parametrize("sizes", [{"hidden_size": 10**6, "num_heads": 4}, {"num_layers": 10**5},
                                   {"vocab_size": 10**9}])
def test_absurd_model_sizes_are_refused_before_allocating(sizes, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(model_module, "available_memory", lambda: 16 << 30)  # a laptop's 16 GiB, on any machine

    config = ModelConfig(**{"vocab_size": 97, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                            "intermediate_size": 176, **sizes})
    monkeypatch.setattr(torch.nn.Embedding, "__init__", no_allocation)
    with pytest.raises(ModelTooLarge) as err:
        Transformer(config)
    message = str(err.value)
    for name, value in sizes.items():
        assert f"ModelConfig.{name}={value:,}" in message
    assert f"{parameter_count(config):,} parameters" in message and "of memory available" in message


def test_a_model_that_does_not_fit_the_available_memory_is_one_error_naming_the_sizes(tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.setattr(model_module, "available_memory", lambda: 64 << 10)  # a machine with 64 KiB free
    with pytest.raises(ModelTooLarge, match=r"need about \d+ KiB, but this machine has 64 KiB of memory available"):
        Transformer(ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=176))
    line = _cli_error(capsys, monkeypatch, "run", str(_write_config(tmp_path, "big")))
    assert "model.hidden_size=64" in line and "the vocabulary of task reverse=" in line
    assert "AdamW moments need about" in line
    assert not (tmp_path / "big").exists()  # refused before anything was written
    line = _cli_error(capsys, monkeypatch, "sweep", str(_sweep_file(tmp_path, "sbig", grid={"seed": [0]})))
    assert "model.hidden_size=64" in line and not (tmp_path / "sbig").exists()


def _fail_fsync_of(monkeypatch, name: str, code: int) -> None:
    """os.fsync fails with ``code`` for a file called ``name`` (as it does on a full disk): the data did not fit."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + name):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


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


# --------------------------------------------------------------------------- run names
@pytest.mark.parametrize("name,problem", [("../elsewhere", "leaves the runs directory"), ("a/b", "a path separator"),
                                          ("/tmp/abs", "an absolute path"), ("a\\b", "a backslash"),
                                          ("..", "leaves the runs directory"), ("", "an empty name")])
def test_run_names_that_leave_the_runs_directory_are_refused(name, problem):
    with pytest.raises(ConfigError, match=f"config error at 'name': expected a plain folder name .*: .*{problem}"):
        config_from_dict({"name": name})


def test_a_name_is_a_label_when_output_dir_is_set_but_never_leaves_with_dot_dot(tmp_path):
    assert config_from_dict({"name": "sweep/point", "output_dir": str(tmp_path)}).name == "sweep/point"
    with pytest.raises(ConfigError, match="config error at 'name': expected a relative label"):
        config_from_dict({"name": "../x", "output_dir": str(tmp_path)})


def test_a_run_name_with_dot_dot_is_one_cli_error_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("name: ../outside\nsteps: 1\n")
    line = _cli_error(capsys, monkeypatch, "run", str(config))
    assert "config error at 'name'" in line and "'../outside'" in line
    assert not (tmp_path / "outside").exists() and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- settings that cannot learn or inject
@pytest.mark.parametrize("raw,key,says", [
    ({"algorithm": {"clip_low": 1.0}}, "algorithm.clip_low", "expected a number >= 0 and < 1, got 1.0"),
    ({"algorithm": {"clip_ratio_low": 1.5}}, "algorithm.clip_low", "< 1, got 1.5 (written as"),
    ({"algorithm": {"clip_high": -0.1}}, "algorithm.clip_high", "expected a number >= 0"),
    ({"rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt", "'grpo' compares the samples"),
    ({"rollout": {"samples_per_prompt": 1}, "algorithm": {"advantage": "rloo"}}, "rollout.samples_per_prompt",
     "a group of 1 sample has advantage 0"),
    ({"rollout": {"samples_per_prompt": 1, "prompts_per_step": 1}, "algorithm": {"advantage": "reinforce"},
      "distributed": {"leaves": 1}}, "rollout.prompts_per_step", "a batch of 1 sample has advantage 0"),
    ({"rollout": {"temperature": 0}}, "rollout.temperature", "expected a number > 0, got 0"),
    ({"steps": 10, "inject": {"mode": "logit_noise", "value": 0.5, "onset_step": 10}}, "inject.onset_step",
     "would inject nothing"),
    ({"steps": 10, "inject": {"mode": "precision", "onset_step": 12}}, "inject.onset_step", "would inject nothing"),
])
def test_settings_that_can_never_learn_or_inject_are_refused_naming_the_key(raw, key, says):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(f"config error at '{key}': ") and says in str(err.value)


def test_the_meaningful_neighbours_are_accepted():
    config_from_dict({"rollout": {"samples_per_prompt": 1}, "algorithm": {"advantage": "reinforce"}})
    config_from_dict({"algorithm": {"clip_low": 0.0, "clip_high": 0.0}})
    config_from_dict({"steps": 10, "inject": {"mode": "logit_noise", "value": 0.0, "onset_step": 50}})  # a baseline
    config_from_dict({"steps": 10, "inject": {"mode": "logit_noise", "value": 0.5, "onset_step": 9}})


# --------------------------------------------------------------------------- sweeps, run directories, reports
def test_a_sweep_file_without_base_is_refused(tmp_path, capsys, monkeypatch):
    path = tmp_path / "nobase.yaml"
    path.write_text("grid: {seed: [0, 1]}\n")
    line = _cli_error(capsys, monkeypatch, "sweep", str(path), "--output-dir", str(tmp_path / "out"))
    assert "config error at 'base': no base config" in line and str(path) in line
    assert not (tmp_path / "out").exists()
    path.write_text("base: {}\ngrid: {seed: [0, 1]}\n")  # every default, said explicitly
    assert len(load_sweep_spec(path).points) == 2


def test_vexact_run_on_a_directory_that_holds_no_run_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes").mkdir()
    line = _cli_error(capsys, monkeypatch, "run", str(tmp_path / "notes"))
    assert "is a directory but not a vexact run: it holds no config.yaml, metrics.jsonl or checkpoints/" in line


def test_report_on_a_finished_run_whose_log_is_empty_says_it_has_no_steps(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": 4,
                                                      "steps_planned": 4}))
    line = _cli_error(capsys, monkeypatch, "report", str(run_dir))
    assert "metrics.jsonl holds no steps, but summary.json says 4 were completed" in line


def test_a_second_sweep_of_one_directory_is_refused_and_lock_failures_do_not_stay_failed(tmp_path, capsys,
                                                                                        monkeypatch):
    path = _sweep_file(tmp_path, "twice", grid={"seed": [0, 1]})
    spec = load_sweep_spec(path)
    with sweep_lock(spec):  # stands for the same sweep running in another process
        line = _cli_error(capsys, monkeypatch, "sweep", str(path))
        with pytest.raises(RunLocked):
            run_sweep(spec, console=Console(quiet=True))
    assert "sweep twice:" in line and "is in use by another vexact process" in line
    assert not any(p.run_dir.exists() for p in spec.points)  # neither point was touched

    # An older sweep.json recorded a point as failed only because another process held it; that process completed
    # the point since: the report counts its outcome, not the lost lock.
    spec.output_dir.mkdir(exist_ok=True)
    done = spec.points[1].run_dir
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": 1}))
    (done / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (spec.output_dir / "sweep.json").write_text(json.dumps({"name": "twice", "grid": {"seed": [0, 1]}, "points": [
        {"name": "seed=0", "dir": "points/seed=0", "overrides": {"seed": 0}, "status": "pending", "error": None},
        {"name": "seed=1", "dir": "points/seed=1", "overrides": {"seed": 1}, "status": "failed",
         "error": "RunLocked: ... is in use by another vexact process (pid 1)"}]}))
    points = read_sweep_results(spec.output_dir).points
    assert [(p.status, p.error) for p in points] == [("pending", None), ("completed", None)]


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


# --------------------------------------------------------------------------- what a newcomer's bad input met
@pytest.mark.parametrize("model, key", [({"num_experts": 4, "decoder_sparse_step": 5}, "decoder_sparse_step"),
                                        ({"num_experts": 4, "mlp_only_layers": [0, 1]}, "mlp_only_layers")])
def test_experts_with_no_moe_layer_are_one_error_not_a_silent_dense_run(model, key):
    """``num_experts: 4`` on the 2-layer testbed with ``decoder_sparse_step: 5`` made no layer MoE: a dense run
    that looked like an MoE one. routing_flip on it said "set num_experts > 0", which it was."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": model})
    assert e.value.key == f"model.{key}" and "no layer is a mixture of experts" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": model, "inject": {"mode": "routing_flip", "value": 0.1}})
    assert e.value.key == f"model.{key}" and "set model.num_experts > 0" not in str(e.value)
    assert config_from_dict({"model": {"num_experts": 4, "decoder_sparse_step": 2}}).model.num_experts == 4


@pytest.mark.parametrize("flag", ["--num-experts-per-tok", "--moe-intermediate-size"])
def test_check_expert_flags_without_experts_are_one_error_before_the_check(flag, capsys, monkeypatch):
    def no_check(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr("vexact.real.check.run_check", no_check)
    line = _cli_error(capsys, monkeypatch, "check", flag, "2")
    assert f"{flag} sets the mixture of experts, but the model has none: give --num-experts" in line


def test_check_json_to_an_unwritable_path_fails_before_the_check(tmp_path, capsys, monkeypatch):
    def no_check(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr("vexact.real.check.run_check", no_check)
    (tmp_path / "a_file").write_text("")
    line = _cli_error(capsys, monkeypatch, "check", "--json", str(tmp_path / "a_file" / "check.json"))
    assert f"--json: cannot write {tmp_path / 'a_file' / 'check.json'}" in line


def test_the_memory_error_of_an_expert_count_names_num_experts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(model_module, "available_memory", lambda: 16 << 30)  # a laptop's 16 GiB, on any machine
    line = _cli_error(capsys, monkeypatch, "run", str(_write_config(tmp_path, "moe")), "--set",
                      "model.num_experts=100000")
    assert "model.num_experts=100,000" in line and "model.hidden_size=64" in line
    assert not (tmp_path / "moe").exists()


def test_a_run_named_like_the_warm_start_cache_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"name": ".warmstart_cache"})
    assert e.value.key == "name" and "the warm-start cache" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"output_dir": str(tmp_path / "c"), "warm_start": {"cache_dir": str(tmp_path / "c")}})
    assert e.value.key == "output_dir"
    assert config_from_dict({"name": "warmstart_cache"}).name == "warmstart_cache"


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


def test_rollout_engine_vllm_says_vllm_is_missing_before_what_it_could_not_run(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    odd_heads = {"rollout": {"engine": "vllm"}, "model": {"hidden_size": 72, "num_heads": 4, "num_kv_heads": 2}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(odd_heads)
    assert e.value.key == "rollout.engine" and "needs the 'vllm' package, which is not installed" in e.value.problem
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as e:  # installed: the head size is the problem
        config_from_dict(odd_heads)
    assert e.value.key == "model.head_dim"


def test_a_sweep_points_bad_value_names_the_variant_grid_or_set_it_came_from(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("base: {steps: 2}\ngrid: {seed: [0]}\nvariants: {good: {optimizer.lr: 0.001}, bad: "
                    "{optimizer.lr: -1}}\n")
    with pytest.raises(ConfigError, match=r"got -1 \(from variants\.bad\.optimizer\.lr\)") as e:
        load_sweep_spec(path)
    assert "--set" not in str(e.value)
    path.write_text("base: {steps: 2}\ngrid: {optimizer.lr: [-1]}\n")
    with pytest.raises(ConfigError, match=r"got -1 \(from the grid's optimizer\.lr\)"):
        load_sweep_spec(path)
    path.write_text("base: {steps: 2}\ngrid: {seed: [0]}\nset: {optimizer.eps: 0}\n")
    with pytest.raises(ConfigError, match=r"got 0 \(from set\.optimizer\.eps\)"):
        load_sweep_spec(path)
    path.write_text("base: {steps: 2}\ngrid: {seed: [0]}\n")
    with pytest.raises(ConfigError, match=r"got 0 \(from --set optimizer\.eps=0\)"):  # the command line's own
        load_sweep_spec(path, overrides=["optimizer.eps=0"])
