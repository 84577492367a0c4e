"""Faults against a sweep, tried as a hostile user would: duplicate and colliding points, malformed or missing
files, output paths that are files, a killed main process (its workers must die with it), a point whose run
directory another process holds, a worker that dies in the middle of a point.

Each bad input is refused before any work with one clear line naming the file; each runtime fault is recorded
against its point and the sweep goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from test_trainer import EXPERIMENT

from vexact.cli import main
from vexact.records.runlog import RunLocked, run_lock
from vexact.reports.sweep_report import read_sweep_results
from vexact.rl.config import ConfigError
from vexact.sweeps import sweep as sweep_module
from vexact.sweeps.sweep import load_sweep_spec, run_sweep, sweep_lock

ROOT = Path(__file__).resolve().parents[2]
_REAL_RUN_POINT = sweep_module._run_point


FAST = {"steps": 2, "warm_start.steps": 0, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "task.eval_prompts": 4, "logging.eval_every": 1000, "logging.checkpoint_every": 1000}


def _sweep_file(tmp_path: Path, name: str, grid: dict, steps: int = 2, **extra) -> Path:
    """A sweep of tiny runs (no warm start, a few seconds a point)."""
    spec = {"name": name, "base": str(EXPERIMENT), "output_dir": str(tmp_path / name),
            "set": {**FAST, "steps": steps}, "grid": grid, **extra}
    return _write(tmp_path / f"{name}.yaml", yaml.safe_dump(spec))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _cli_error(capsys, monkeypatch, *argv: str) -> str:
    """Run ``vexact ARGV``; it must exit 2 with exactly one line on stderr. Returns that line."""
    monkeypatch.setenv("COLUMNS", "10000")  # rich wraps at 80 columns when stderr is not a terminal
    capsys.readouterr()
    assert main(list(argv)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0]
    return lines[0]


# --- duplicates: two points must never share a run directory ---------------------------------------------------

def test_duplicate_grid_values_are_rejected_naming_the_key(tmp_path, capsys, monkeypatch):
    path = _sweep_file(tmp_path, "dup", grid={"inject.value": [0.0, -0.5], "seed": [0, 0]})
    with pytest.raises(ConfigError, match=r"config error at 'grid.seed': duplicate value 0 in sweep file '.*dup.yaml' "
                                          r"\(each point needs its own run directory\)"):
        load_sweep_spec(path)
    # 0 and 0.0 are one value too (two folders, one run); 1 and true are not.
    with pytest.raises(ConfigError, match="'grid.inject.value': duplicate value 0.0"):
        load_sweep_spec(_sweep_file(tmp_path, "dup2", grid={"inject.value": [0, 0.0]}))
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert "'grid.seed': duplicate value 0" in line and str(path) in line
    assert not (tmp_path / "dup").exists()  # refused before any work


def test_points_with_the_same_run_config_are_rejected_naming_both(tmp_path, capsys, monkeypatch):
    """Distinct grid values, one config: 1e-3 (a string to YAML 1.1) and 0.001 are one learning rate, fp32 and
    float32 one dtype, two empty variants one run; each pair would run the same experiment twice."""
    path = _sweep_file(tmp_path, "same_lr", grid={"optimizer.lr": ["1e-3", 0.001]})
    with pytest.raises(ConfigError, match=r"^config error: sweep file '.*same_lr.yaml': points optimizer.lr=1e-3 and "
                                          r"optimizer.lr=0.001 are the same run config \(one value spelled two ways, "
                                          r"or variants that set the same keys\), so they would run the same "
                                          r"experiment twice; remove one$"):
        load_sweep_spec(path)
    with pytest.raises(ConfigError, match="points dtype=fp32 and dtype=float32 are the same run config"):
        load_sweep_spec(_sweep_file(tmp_path, "same_dtype", grid={"dtype": ["fp32", "float32"]}))
    with pytest.raises(ConfigError, match="points variant=a,seed=0 and variant=b,seed=0 are the same run config"):
        load_sweep_spec(_sweep_file(tmp_path, "same_variant", grid={"seed": [0]}, variants={"a": {}, "b": {}}))
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert "points optimizer.lr=1e-3 and optimizer.lr=0.001 are the same run config" in line and str(path) in line
    assert not (tmp_path / "same_lr").exists()  # refused before any work
    # counter-case: values that differ, and variants that set different keys, are distinct runs
    spec = load_sweep_spec(_sweep_file(tmp_path, "distinct", grid={"optimizer.lr": ["1e-3", 0.002]},
                                       variants={"a": {}, "b": {"correction.method": "token_tis"}}))
    assert len(spec.points) == 4


def test_a_key_given_twice_in_the_sweep_file_is_rejected(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path / "twice.yaml", f"base: {EXPERIMENT}\ngrid:\n  seed: [0]\n  seed: [1]\n")
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert f"invalid YAML in sweep file '{path}': found duplicate key 'seed' (line 4, column 3)" in line


def test_points_that_would_share_a_run_directory_are_rejected_naming_both(tmp_path, capsys, monkeypatch):
    grid = {"warm_start.cache_dir": ["c/d", "c_d"]}  # a free-form string key: both values are valid configs
    path = _sweep_file(tmp_path, "clash", grid=grid)
    with pytest.raises(ConfigError, match=r"points warm_start.cache_dir=c/d and warm_start.cache_dir=c_d would share "
                                          r"the run directory .*points/warm_start.cache_dir=c_d"):
        load_sweep_spec(path)
    assert str(path) in _cli_error(capsys, monkeypatch, "sweep", str(path))
    variants = {"tis/decay": {}, "tis_decay": {"correction.method": "token_tis"}}
    with pytest.raises(ConfigError, match="points variant=tis/decay,seed=0 and variant=tis_decay,seed=0 would share"):
        load_sweep_spec(_sweep_file(tmp_path, "vclash", grid={"seed": [0]}, variants=variants))


# --- malformed, missing and hostile input: one line naming the file ---------------------------------------------

def _bad_sweeps(tmp_path: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (sweep file, the file the message must name, what it must say)."""
    good_grid = "grid: {seed: [0]}\n"
    bad_base = _write(tmp_path / "bad_base.yaml", "steps: 2\nmodel: {hidden_size: 16\n")
    list_base = _write(tmp_path / "list_base.yaml", "- 1\n- 2\n")
    (tmp_path / "a_dir.yaml").mkdir()
    cases = {
        "malformed YAML": ("malformed.yaml", "grid: {seed: [0, 1\n", "malformed.yaml",
                           "invalid YAML in sweep file"),
        "tab indentation": ("tabs.yaml", "grid:\n\tseed: [0]\n", "tabs.yaml", "(line 2, column 1)"),
        "not a mapping": ("list.yaml", "- seed\n- 0\n", "list.yaml", "must contain a mapping with keys"),
        "empty file": ("empty.yaml", "", "empty.yaml", "must contain a mapping with keys"),
        "not UTF-8": ("binary.yaml", None, "binary.yaml", "is not a UTF-8 text file"),
        "a directory": ("a_dir.yaml", None, "a_dir.yaml", "is a directory, not a file"),
        "missing": ("missing.yaml", None, "missing.yaml", "does not exist"),
        "malformed base": ("mb.yaml", f"base: {bad_base.name}\n{good_grid}", str(bad_base),
                           "invalid YAML in base config"),
        "base not a mapping": ("lb.yaml", f"base: {list_base.name}\n{good_grid}", str(list_base),
                               "must contain a mapping of config keys"),
        "missing base": ("nb.yaml", f"base: nowhere.yaml\n{good_grid}", str(tmp_path / "nowhere.yaml"),
                         "does not exist"),
        "base a number": ("b3.yaml", f"base: 3\n{good_grid}", "b3.yaml", "config error at 'base'"),
        "grid not a mapping": ("g1.yaml", "grid: [seed, 0]\n", "g1.yaml", "config error at 'grid': expected a mapping"),
        "grid value not a list": ("g2.yaml", "grid: {seed: 0}\n", "g2.yaml",
                                  "config error at 'grid.seed': expected a list of values, got 0"),
        "empty grid list": ("g3.yaml", "grid: {seed: []}\n", "g3.yaml", "'grid.seed': expected a non-empty list"),
        "no grid": ("g4.yaml", "name: x\n", "g4.yaml", "config error at 'grid'"),
        "grid key not a string": ("g5.yaml", "grid: {1: [0]}\n", "g5.yaml", "expected dotted config keys"),
        "grid value a date": ("g6.yaml", "grid: {seed: [2024-01-01]}\n", "g6.yaml", "only numbers, strings"),
        "grid key not a config key": ("g7.yaml", "grid: {seed: [0], optimizer.l: [1]}\n", "g7.yaml",
                                      "config error at 'optimizer.l': unknown key"),
        "grid sets output_dir": ("g8.yaml", "grid: {output_dir: [a, b]}\n", "g8.yaml",
                                 "'output_dir' is set by the sweep for every point"),
        "set not a mapping": ("s1.yaml", f"set: [steps]\n{good_grid}", "s1.yaml", "config error at 'set'"),
        "set sets name": ("s2.yaml", f"set: {{name: x}}\n{good_grid}", "s2.yaml", "config error at 'set.name'"),
        "variants not a mapping": ("v1.yaml", f"variants: [a, b]\n{good_grid}", "v1.yaml",
                                   "config error at 'variants'"),
        "variant not a mapping": ("v2.yaml", f"variants: {{a: 3}}\n{good_grid}", "v2.yaml",
                                  "config error at 'variants.a'"),
        "variant name not a string": ("v3.yaml", f"variants: {{1: {{}}}}\n{good_grid}", "v3.yaml",
                                      "variant names must be non-empty strings"),
        "unknown sweep key": ("k.yaml", f"grdi: {{seed: [0]}}\n{good_grid}", "k.yaml", "'grdi': unknown key"),
        "name with a slash": ("n.yaml", f"name: ../../elsewhere\n{good_grid}", "n.yaml",
                              "config error at 'name': expected a plain name"),
        "output_dir not a path": ("o.yaml", f"output_dir: [a]\n{good_grid}", "o.yaml", "'output_dir'"),
        "a huge grid": ("h.yaml", "grid: {seed: [" + ", ".join(map(str, range(200))) + "], optimizer.lr: ["
                        + ", ".join(f"{i}e-5" for i in range(1, 101)) + "]}\n", "h.yaml", "20000 points"),
    }
    out = {}
    for case, (name, text, names, says) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        elif case == "not UTF-8":
            path.write_bytes(b"grid: \xff\xfe\n")
        out[case] = (path, str(tmp_path / names) if "/" not in names else names, says)
    return out


def test_bad_sweep_files_give_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    for case, (path, names, says) in _bad_sweeps(tmp_path).items():
        line = _cli_error(capsys, monkeypatch, "sweep", str(path), "--output-dir", str(tmp_path / "out"))
        assert names in line, (case, line)
        assert says in line, (case, line)
    assert not (tmp_path / "out").exists()


def test_output_paths_that_are_files_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    blocker = _write(tmp_path / "taken", "not a folder")
    path = _sweep_file(tmp_path, "o1", grid={"seed": [0]}, output_dir=str(blocker))
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert f"{blocker} exists and is not a directory" in line
    spec = load_sweep_spec(_sweep_file(tmp_path, "o2", grid={"seed": [0, 1]}))
    spec.output_dir.mkdir()
    _write(spec.output_dir / "points", "")
    with pytest.raises(ValueError, match=f"{spec.output_dir / 'points'} exists and is not a directory"):
        run_sweep(spec, console=Console(quiet=True))
    (spec.output_dir / "points").unlink()
    spec.points[1].run_dir.parent.mkdir()
    _write(spec.points[1].run_dir, "")
    with pytest.raises(ValueError, match=f"{spec.points[1].run_dir} exists and is not a directory"):
        run_sweep(spec, console=Console(quiet=True))
    assert not spec.points[0].run_dir.exists()  # nothing ran


def test_a_single_runs_directory_is_refused_as_a_sweeps_output(tmp_path, capsys, monkeypatch):
    """vexact sweep / demo into a run's folder (metrics.jsonl or summary.json, no sweep.json) mixed a sweep into it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir / "metrics.jsonl", '{"step": 0}\n')
    path = _sweep_file(tmp_path, "into_run", grid={"seed": [0]}, output_dir=str(run_dir))
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert line == f"error: sweep into_run: {run_dir} is a run's directory (it holds metrics.jsonl); choose another " \
                   "output_dir"
    _write(run_dir / "summary.json", "{}")
    line = _cli_error(capsys, monkeypatch, "demo", "--output-dir", str(run_dir))
    assert f"{run_dir} is a run's directory (it holds metrics.jsonl and summary.json)" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "summary.json"]  # nothing written


def test_another_sweeps_directory_is_refused_as_a_sweeps_output(tmp_path, capsys, monkeypatch):
    """vexact sweep / demo into the output directory of a sweep of another name took it over: its sweep.json was
    replaced and its points left unlisted. Now one error naming both sweeps and the directory; the sweep of the same
    name still resumes there (an edited one: test_an_edited_sweep_file_is_refused_where_its_points_have_run)."""
    first = _sweep_file(tmp_path, "first", grid={"seed": [0]})
    spec = load_sweep_spec(first)
    assert run_sweep(spec, console=Console(quiet=True)) == {"seed=0": "completed"}
    index = (spec.output_dir / "sweep.json").read_bytes()
    other = _sweep_file(tmp_path, "other", grid={"seed": [3]}, output_dir=str(spec.output_dir))
    line = _cli_error(capsys, monkeypatch, "sweep", str(other), "--no-report")
    assert line == f"error: sweep other: {spec.output_dir} holds sweep first (its sweep.json); choose another " \
                   "--output-dir for this sweep"
    line = _cli_error(capsys, monkeypatch, "demo", "--output-dir", str(spec.output_dir))
    assert line.endswith(f": {spec.output_dir} holds sweep first (its sweep.json); choose another --output-dir for "
                         "this sweep")
    assert (spec.output_dir / "sweep.json").read_bytes() == index  # nothing written
    assert sorted(p.name for p in (spec.output_dir / "points").iterdir()) == ["seed=0"]
    assert main(["sweep", str(first), "--no-report"]) == 0  # the same sweep: its finished point skipped


def test_a_huge_jobs_is_one_parse_error_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """--jobs 99999999999 overflowed the process pool's semaphore: a traceback, exit 1, and a sweep.json left behind.
    Now argparse's one error naming --jobs and its bound (MAX_JOBS), exit 2, for sweep and demo alike."""
    path = _sweep_file(tmp_path, "many", grid={"seed": [0]})
    for argv in (["sweep", str(path)], ["demo", "--output-dir", str(tmp_path / "demo")]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main([*argv, "--jobs", "99999999999"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument --jobs: at most 1024 worker processes, got 99999999999" in err
        assert "Traceback" not in err
    assert not (tmp_path / "many").exists() and not (tmp_path / "demo").exists()
    from vexact.sweeps import MAX_JOBS  # and run_sweep itself

    with pytest.raises(ValueError, match=f"--jobs {MAX_JOBS + 1}: expected 1 to {MAX_JOBS} worker processes"):
        run_sweep(load_sweep_spec(path), jobs=MAX_JOBS + 1, console=Console(quiet=True))


def test_the_sweep_headline_prints_names_and_paths_as_text(tmp_path, capsys, monkeypatch):
    """An output directory ".../a[/b]" ended vexact sweep with a MarkupError before any point ran."""
    path = _sweep_file(tmp_path, "marked", grid={"seed": [0]}, output_dir=str(tmp_path / "a[" / "b]"))
    spec = load_sweep_spec(path)
    spec.points[0].run_dir.mkdir(parents=True)  # finished before: the sweep has nothing to run
    _write(spec.points[0].run_dir / "summary.json", json.dumps({"status": "completed", "steps_planned": 2,
                                                                "steps_completed": 2}))
    monkeypatch.setenv("COLUMNS", "10000")
    assert main(["sweep", str(path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert f"vexact sweep marked: 1 points -> {spec.output_dir}" in out
    assert "sweep marked: 1 of 1 points already finished, skipped" in out


def test_a_damaged_point_summary_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    path = _sweep_file(tmp_path, "dmg", grid={"seed": [0]})
    summary = load_sweep_spec(path).points[0].run_dir / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text('{"status": "compl')
    line = _cli_error(capsys, monkeypatch, "sweep", str(path))
    assert f"{summary} is not a readable run summary" in line


# --- a locked point: recorded as failed, the sweep goes on ------------------------------------------------------

@pytest.mark.slow
def test_a_point_whose_run_directory_is_locked_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec = load_sweep_spec(_sweep_file(tmp_path, "lock", grid={"seed": [0, 1, 2]}))
    held = spec.points[1].run_dir
    with run_lock(held):  # stands for another vexact process running that point
        statuses = run_sweep(spec, jobs=1, console=Console(quiet=True))
    assert statuses == {"seed=0": "completed", "seed=1": "failed", "seed=2": "completed"}
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    error = index["points"][1]["error"]
    assert error.startswith("RunLocked: ") and "in use by another vexact process" in error
    assert f"pid {os.getpid()}" in error and "\n" not in error  # the message, no traceback
    assert not (held / "error.txt").exists()  # nothing written into the other process's directory
    assert not (held / "metrics.jsonl").exists()
    # Once the other process is gone, a re-run runs the point.
    statuses = run_sweep(load_sweep_spec(_sweep_file(tmp_path, "lock", grid={"seed": [0, 1, 2]})),
                         console=Console(quiet=True))
    assert list(statuses.values()) == ["completed"] * 3


# --- worker processes: die with the parent; a dying worker fails only its points --------------------------------

def _die_on_seed_1(config: dict, resume: bool, threads: int | None) -> dict:
    """Runs in a worker: SIGKILLs itself on seed 1 (the OOM killer, say), else runs the point."""
    if config["seed"] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _REAL_RUN_POINT(config, resume, threads)


@pytest.mark.slow
def test_a_dying_worker_fails_its_points_and_the_sweep_goes_on_in_fresh_workers(tmp_path, monkeypatch):
    spec = load_sweep_spec(_sweep_file(tmp_path, "die", grid={"seed": [0, 1, 2, 3]}))
    monkeypatch.setattr(sweep_module, "_run_point", _die_on_seed_1)  # pickled by reference: workers run it
    with run_lock(spec.points[0].run_dir):  # and a locked point in parallel mode
        statuses = run_sweep(spec, jobs=2, console=Console(quiet=True))
    assert statuses["seed=0"] == "failed" and statuses["seed=1"] == "failed"
    assert statuses["seed=2"] in ("failed", "completed")  # running when seed 1's worker died: terminated with it
    assert statuses["seed=3"] == "completed"  # after the breakage, in a fresh pool
    index = {p["name"]: p for p in json.loads((spec.output_dir / "sweep.json").read_text())["points"]}
    assert "in use by another vexact process" in index["seed=0"]["error"]
    assert index["seed=1"]["error"].startswith("a worker process died abruptly")
    assert "worker process died" in (spec.points[1].run_dir / "error.txt").read_text()


_INIT_PROBE = """
import ctypes, sys
from vexact.sweeps.sweep import _worker_init
_worker_init(int(sys.argv[1]))
signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signal))  # PR_GET_PDEATHSIG
print("alive", signal.value)
"""


@pytest.mark.slow
def test_worker_init_sets_the_parent_death_signal_and_exits_if_the_parent_is_gone():
    alive = subprocess.run([sys.executable, "-c", _INIT_PROBE, str(os.getpid())], capture_output=True, text=True,
                           timeout=120)
    assert alive.returncode == 0 and alive.stdout.split() == ["alive", str(int(signal.SIGKILL))], alive.stderr
    orphan = subprocess.run([sys.executable, "-c", _INIT_PROBE, str(os.getpid() + 1_000_000)], capture_output=True,
                            text=True, timeout=120)  # "the parent died before prctl": ppid is not the one passed
    assert orphan.returncode == 1 and "alive" not in orphan.stdout


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has finished; reaping it is init's business


@pytest.mark.slow
def test_sigkilled_sweep_takes_its_workers_with_it(tmp_path):
    path = _sweep_file(tmp_path, "kill", grid={"seed": [0, 1]}, steps=10_000)
    metrics = [tmp_path / "kill" / "points" / f"seed={s}" / "metrics.jsonl" for s in (0, 1)]
    proc = subprocess.Popen([sys.executable, "-m", "vexact.cli", "sweep", str(path), "--jobs", "2", "--no-report"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not all(m.exists() and m.stat().st_size for m in metrics):  # both workers are training
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the workers did not start training within 120 s"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "worker processes outlived the killed sweep"
        sizes = [m.stat().st_size for m in metrics]
        time.sleep(1.0)
        assert [m.stat().st_size for m in metrics] == sizes  # nothing writes into the run directories any more
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in workers:  # only if the test failed: never leave a worker burning the shared CPU
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stderr.close()


def test_a_sweep_file_without_base_is_refused(tmp_path, capsys, monkeypatch):
    path = tmp_path / "nobase.yaml"
    path.write_text("grid: {seed: [0, 1]}\n")
    line = _cli_error(capsys, monkeypatch, "sweep", str(path), "--output-dir", str(tmp_path / "out"))
    assert "config error at 'base': no base config" in line and str(path) in line
    assert not (tmp_path / "out").exists()
    path.write_text("base: {}\ngrid: {seed: [0, 1]}\n")  # every default, said explicitly
    assert len(load_sweep_spec(path).points) == 2


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


def test_a_sweep_directory_removed_during_the_sweep_stops_it_with_one_line(tmp_path, capsys, monkeypatch):
    """rm -rf of a running sweep's directory: the sweep went on, made the directory again point by point, and wrote
    a sweep.json listing as completed the points whose results had gone with it (exit 1, for the one point that
    failed as its log was deleted under it)."""
    path = _sweep_file(tmp_path, "gone", {"seed": [0, 1, 2]})

    def run_then_remove(config, resume, threads):
        result = _REAL_RUN_POINT(config, resume, threads)
        subprocess.run(["rm", "-rf", str(tmp_path / "gone")], check=True)
        return result

    monkeypatch.setattr(sweep_module, "_run_point", run_then_remove)
    line = _cli_error(capsys, monkeypatch, "sweep", str(path), "--no-report")
    assert line == (f"error: sweep gone: {tmp_path / 'gone'} was removed during the sweep, and the results in it with "
                    "it; re-running the sweep runs its points again")
    assert not (tmp_path / "gone").exists()  # not made again


def test_an_edited_sweep_file_is_refused_where_its_points_have_run(tmp_path, capsys, monkeypatch):
    """A sweep file (or its base) edited after its points ran, rerun into the same directory: the finished points were
    skipped and the report labelled their old results with the new settings; a started one failed at its resume.
    Now one error naming the point and the keys, before anything runs; more steps still extend the points."""
    path = _sweep_file(tmp_path, "edited", {"seed": [0, 1]})
    spec = load_sweep_spec(path)
    assert run_sweep(spec, console=Console(quiet=True)) == {"seed=0": "completed", "seed=1": "completed"}
    finished = (spec.points[0].run_dir / "metrics.jsonl").read_bytes()
    data = yaml.safe_load(path.read_text())
    lr = load_sweep_spec(path).points[0].config.optimizer.lr
    data["set"]["optimizer.lr"] = lr * 2
    path.write_text(yaml.safe_dump(data))
    err = _cli_error(capsys, monkeypatch, "sweep", str(path), "--no-report")
    assert err.startswith(f"error: sweep edited in {spec.output_dir}: point seed=0 was started with another config "
                          f"(optimizer.lr: {lr!r} -> {lr * 2!r}; its run's {spec.points[0].run_dir / 'config.yaml'})")
    assert (spec.points[0].run_dir / "metrics.jsonl").read_bytes() == finished  # nothing ran
    data["set"]["optimizer.lr"] = lr  # restored, and one step more: the points are extended, as before
    data["set"]["steps"] += 1
    path.write_text(yaml.safe_dump(data))
    assert run_sweep(load_sweep_spec(path), console=Console(quiet=True)) == {"seed=0": "completed",
                                                                              "seed=1": "completed"}
