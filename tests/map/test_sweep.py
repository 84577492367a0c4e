"""Sweeps: grid expansion, validation, resume after an interrupt, failing points, workers, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import warm_start_cache
from rich.console import Console
from test_sweep_faults import _cli_error
from test_sweep_faults import _sweep_file as _fast_sweep_file  # tiny runs, no warm start
from test_trainer import EXPERIMENT, _without_timing

from vexact.cli import main
from vexact.cli_base import Terminated
from vexact.records.runlog import read_metrics
from vexact.rl.config import ConfigError
from vexact.rl.trainer import Trainer
from vexact.sweeps import sweep as sweep_module
from vexact.sweeps.sweep import load_sweep_spec, run_sweep, select_points


def _sweep_file(tmp_path: Path, name: str = "s", grid: dict | None = None, **extra) -> Path:
    grid = grid or {"inject.value": [0.0, -0.5], "seed": [0, 1]}
    fixed = {"steps": 3, "warm_start.steps": 10, "warm_start.cache_dir": str(warm_start_cache(tmp_path)),
             "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4, "task.eval_prompts": 8,
             "logging.eval_every": 2, "logging.checkpoint_every": 1, "inject.mode": "logit_scale"}
    if "inject.value" not in grid:  # a knob mode needs its value (a grid without one: a fixed, non-zero value)
        fixed["inject.value"] = -0.5
    spec = {"name": name, "base": str(EXPERIMENT), "output_dir": str(tmp_path / name), "set": fixed, "grid": grid,
            **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def interrupt_sweep(monkeypatch, spec, at_step_call: int) -> None:
    """Run ``spec`` locally and raise KeyboardInterrupt (Ctrl-C) in its ``at_step_call``-th training step; the
    steps are restored afterwards."""
    real_step, calls = Trainer.step, {"n": 0}

    def killed(self, step):
        calls["n"] += 1
        if calls["n"] == at_step_call:
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", killed)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, console=Console(quiet=True))
    monkeypatch.setattr(Trainer, "step", real_step)


def _metrics(spec) -> dict[str, list[dict]]:
    return {p.name: _without_timing(read_metrics(p.run_dir / "metrics.jsonl")) for p in spec.points}


def test_grid_expansion_and_validation(tmp_path):
    spec = load_sweep_spec(_sweep_file(tmp_path))
    assert [p.name for p in spec.points] == ["inject.value=0.0,seed=0", "inject.value=0.0,seed=1",
                                             "inject.value=-0.5,seed=0", "inject.value=-0.5,seed=1"]
    assert spec.points[3].config.inject.value == -0.5 and spec.points[3].config.seed == 1
    with pytest.raises(ConfigError, match="sweep point inject.valu=0.0.*unknown key"):
        load_sweep_spec(_sweep_file(tmp_path, "bad", grid={"inject.valu": [0.0]}))
    with pytest.raises(ConfigError, match="grid"):
        load_sweep_spec(_sweep_file(tmp_path, "bad2", grid={"seed": []}))


def test_interrupted_sweep_resumes_without_duplicates_or_losses(tmp_path, monkeypatch):
    reference = load_sweep_spec(_sweep_file(tmp_path, "ref"))
    run_sweep(reference, console=Console(quiet=True))
    expected = _metrics(reference)

    spec = load_sweep_spec(_sweep_file(tmp_path, "cut"))
    interrupt_sweep(monkeypatch, spec, at_step_call=8)  # Ctrl-C in the middle of the third point
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert [p["status"] for p in index["points"]] == ["completed", "completed", "interrupted", "pending"]
    finished_mtime = (spec.points[0].run_dir / "metrics.jsonl").stat().st_mtime_ns

    statuses = run_sweep(load_sweep_spec(_sweep_file(tmp_path, "cut")), console=Console(quiet=True))
    assert list(statuses.values()) == ["completed"] * 4
    assert (spec.points[0].run_dir / "metrics.jsonl").stat().st_mtime_ns == finished_mtime  # skipped, not rerun
    assert _metrics(spec) == expected  # nothing lost, nothing duplicated, bit-identical
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert len(index["points"]) == 4 and {p["name"] for p in index["points"]} == set(expected)


def test_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real_init = Trainer.__init__

    def fragile(self, cfg, console=None):
        if cfg.seed == 1:
            raise RuntimeError("boom")
        real_init(self, cfg, console)

    monkeypatch.setattr(Trainer, "__init__", fragile)
    spec = load_sweep_spec(_sweep_file(tmp_path, grid={"seed": [0, 1, 2]}))
    statuses = run_sweep(spec, console=Console(quiet=True))
    assert statuses == {"seed=0": "completed", "seed=1": "failed", "seed=2": "completed"}
    assert "RuntimeError: boom" in (spec.points[1].run_dir / "error.txt").read_text()
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert index["points"][1]["error"].startswith("RuntimeError: boom")


@pytest.mark.slow
def test_parallel_workers_and_report(tmp_path):
    path = _sweep_file(tmp_path, "par", grid={"inject.value": [0.0, -0.5]})
    assert main(["sweep", str(path), "--jobs", "2"]) == 0
    spec = load_sweep_spec(path)
    for point in spec.points:
        summary = json.loads((point.run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and "collapsed" in summary["collapse"]
    report = spec.output_dir / "report"
    assert {"summary.csv", "table.md", "table.json", "reward_curves.png"} <= {p.name for p in report.iterdir()}
    assert main(["report", str(spec.output_dir)]) == 0
    assert main(["report", str(tmp_path)]) == 2  # not a sweep directory: one clear error


def test_a_workers_share_of_the_cores_is_its_points_threads_and_another_jobs_resumes_it(tmp_path, monkeypatch):
    """``--jobs N`` gives each worker cores // N torch threads; the Trainer then set its own default over them (every
    core for a large model), so N workers took every core each. The share is now the point's ``threads`` when the
    point leaves it unset and the default is more, recorded in its config.yaml, and a re-run with other --jobs still
    resumes the point."""
    import torch

    from vexact.rl import trainer

    real_step, seen = Trainer.step, []

    def step(self, s):
        seen.append(torch.get_num_threads())
        return real_step(self, s)

    monkeypatch.setattr(Trainer, "step", step)
    spec = load_sweep_spec(_fast_sweep_file(tmp_path, "thr", grid={"seed": [0, 1]}, steps=1))
    small, large = spec.points
    assert sweep_module._run_point(small.config.to_dict(), False, 2)["status"] == "completed"
    assert seen == [1] and yaml.safe_load((small.run_dir / "config.yaml").read_text())["threads"] is None
    monkeypatch.setattr(trainer, "default_threads", lambda cfg: 8)  # a large model on 8 cores
    assert sweep_module._run_point(large.config.to_dict(), False, 2)["status"] == "completed"
    assert seen == [1, 2] and yaml.safe_load((large.run_dir / "config.yaml").read_text())["threads"] == 2
    monkeypatch.undo()  # the real default again (1), and the real step
    # one more step, run here (no --jobs): the sweep's check of its started points and the point's resume let the
    # thread count differ
    spec = load_sweep_spec(_fast_sweep_file(tmp_path, "thr", grid={"seed": [0, 1]}, steps=2))
    assert run_sweep(spec, console=Console(quiet=True)) == {"seed=0": "completed", "seed=1": "completed"}
    assert [r["step"] for r in read_metrics(spec.points[1].run_dir / "metrics.jsonl")] == [0, 1]


def test_variants_bundle_overrides_and_cross_the_grid(tmp_path):
    variants = {"none": {}, "tis_decay": {"correction.method": "token_tis", "lr_schedule.kind": "length_triggered"}}
    spec = load_sweep_spec(_sweep_file(tmp_path, "v", grid={"seed": [0, 1]}, variants=variants))
    assert [p.name for p in spec.points] == ["variant=none,seed=0", "variant=none,seed=1",
                                             "variant=tis_decay,seed=0", "variant=tis_decay,seed=1"]
    assert spec.grid == {"variant": ["none", "tis_decay"], "seed": [0, 1]}
    plain, remedy = spec.points[1].config, spec.points[3].config
    assert plain.correction.method == "none" and plain.lr_schedule.kind == "constant" and plain.seed == 1
    assert remedy.correction.method == "token_tis" and remedy.lr_schedule.kind == "length_triggered"
    assert remedy.seed == 1 and remedy.inject.mode == "logit_scale"  # the common settings still apply
    with pytest.raises(ConfigError, match="variant=bad,seed=0.*correction.method"):
        load_sweep_spec(_sweep_file(tmp_path, "b1", grid={"seed": [0]}, variants={"bad": {"correction.method": "x"}}))
    with pytest.raises(ConfigError, match="'variants'"):
        load_sweep_spec(_sweep_file(tmp_path, "b2", grid={"seed": [0]}, variants=["none"]))
    with pytest.raises(ConfigError, match="remove it from the grid"):
        load_sweep_spec(_sweep_file(tmp_path, "b3", grid={"variant": ["a"]}, variants={"a": {}}))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGINT, 130, id="SIGINT"),
                                      pytest.param(signal.SIGTERM, 143, id="SIGTERM")])
def test_a_signal_sent_to_the_sweep_alone_stops_its_running_workers(tmp_path, sig, code):
    """``kill -INT`` or ``kill -TERM`` of a sweep (not a terminal's Ctrl-C, which reaches the whole process group; a
    job scheduler's SIGTERM) must stop the points that are running in worker processes, not wait for them to
    finish (the points here would run 5000 steps): each records itself as interrupted, and re-running the sweep
    resumes them. SIGTERM ended the sweep at once (exit -15) and its workers with it, unrecorded."""
    import time

    path = _fast_sweep_file(tmp_path, "sig", {"seed": [0, 1]}, steps=5000)
    spec_data = yaml.safe_load(path.read_text())
    spec_data["set"]["logging.checkpoint_every"] = 1
    path.write_text(yaml.safe_dump(spec_data))
    spec = load_sweep_spec(path)
    # SIGINT's default disposition in the sweep, as a sweep started from a terminal has it: a script's background
    # job (CI started as `cmd &`) inherits SIGINT ignored, and a process that starts with it ignored keeps ignoring it
    sweep = subprocess.Popen([sys.executable, "-m", "vexact", "sweep", str(path), "--jobs", "2", "--no-report"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        # a step finished in each point (one interrupted before that is removed: it would start over, unrecorded)
        while not all((p.run_dir / "metrics.jsonl").exists() and read_metrics(p.run_dir / "metrics.jsonl")
                      for p in spec.points):
            assert sweep.poll() is None and time.monotonic() < deadline, "the points never started"
            time.sleep(0.2)
        os.kill(sweep.pid, sig)  # the sweep's process only: its workers are not signalled by us
        output, _ = sweep.communicate(timeout=90)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == code, output[-2000:]
    done = {}
    for point in spec.points:
        summary = json.loads((point.run_dir / "summary.json").read_text())
        assert (summary["status"], summary["signal"]) == ("interrupted", sig.name), (point.name, summary)
        done[point.name] = len(read_metrics(point.run_dir / "metrics.jsonl"))
        assert done[point.name] < 5000
    # and so does sweep.json, which the report reads first: it kept the running points "pending"
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert [p["status"] for p in index["points"]] == ["interrupted"] * len(spec.points), index["points"]

    steps = max(done.values()) + 1  # each point resumes from its checkpoint and runs past where it stopped
    rerun = subprocess.run([sys.executable, "-m", "vexact", "sweep", str(path), "--jobs", "2", "--no-report",
                            "--set", f"steps={steps}"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    for point in spec.points:
        assert json.loads((point.run_dir / "summary.json").read_text())["status"] == "completed"
        assert [r["step"] for r in read_metrics(point.run_dir / "metrics.jsonl")] == list(range(steps))


def test_a_sigterm_in_a_point_the_sweep_runs_itself_ends_the_sweep_as_sigterm(tmp_path, monkeypatch, capsys):
    """With one job, each point runs in the sweep's own process: the point's run records the interrupt, and the
    sweep raises it again to stop. It raised Ctrl-C's KeyboardInterrupt whatever stopped the point, so a SIGTERM
    (``Terminated``) ended the sweep with 130."""
    path = _fast_sweep_file(tmp_path, "term", {"seed": [0, 1]}, steps=3)

    def terminated(self, step):
        raise Terminated

    monkeypatch.setattr(Trainer, "step", terminated)
    assert main(["sweep", str(path), "--no-report", "--quiet"]) == 143


def test_a_sweep_whose_steps_grew_extends_its_finished_points_bit_identically(tmp_path):
    """Raising ``steps`` in the sweep file and running it again extends every point that ran to its planned end
    (as --resume --set steps=N --allow-change steps would), with the bits of a sweep run that long from the start;
    a point that stopped early on a confirmed collapse is left as it is."""
    grid = {"seed": [0, 1]}
    long = load_sweep_spec(_sweep_file(tmp_path, "long", grid=grid))
    for point in long.points:
        point.config.steps = 5
    run_sweep(long, console=Console(quiet=True))

    short_path = _sweep_file(tmp_path, "grow", grid=grid)
    run_sweep(load_sweep_spec(short_path), console=Console(quiet=True))  # 3 steps
    spec_data = yaml.safe_load(short_path.read_text())
    spec_data["set"]["steps"] = 5
    short_path.write_text(yaml.safe_dump(spec_data))
    grown = load_sweep_spec(short_path)
    assert run_sweep(grown, console=Console(quiet=True)) == {"seed=0": "completed", "seed=1": "completed"}
    extended = _metrics(grown)
    assert all(len(rows) == 5 for rows in extended.values())
    assert extended == _metrics(long)  # the extension is the 5-step run, bit for bit

    summary_path = grown.points[0].run_dir / "summary.json"  # a run that ended early keeps its outcome
    summary = json.loads(summary_path.read_text())
    summary.update(steps_planned=5, steps_completed=4)
    summary_path.write_text(json.dumps(summary))
    spec_data["set"]["steps"] = 7
    short_path.write_text(yaml.safe_dump(spec_data))
    run_sweep(load_sweep_spec(short_path), console=Console(quiet=True))
    assert len(read_metrics(grown.points[0].run_dir / "metrics.jsonl")) == 5
    assert len(read_metrics(grown.points[1].run_dir / "metrics.jsonl")) == 7


def test_a_cosine_sweep_whose_steps_grew_is_refused_and_its_finished_points_kept(tmp_path):
    """A cosine schedule spans the run's steps: a finished 3-step point "extended" to 5 steps took its first 3 steps
    on a 3-step horizon, so its LRs differed from a 5-step run's from step 1 on, while the sweep said it gave the
    same bits. Now the sweep is refused before anything runs, naming the point, steps and lr_schedule.kind, and the
    finished point is left as it is; with lr_schedule.total_steps set from the start it is extended bit for bit."""
    path = _sweep_file(tmp_path, "cos", grid={"seed": [0]})
    data = yaml.safe_load(path.read_text())
    data["set"].update({"lr_schedule.kind": "cosine", "optimizer.warmup_steps": 0})
    path.write_text(yaml.safe_dump(data))
    spec = load_sweep_spec(path)
    run_sweep(spec, console=Console(quiet=True))
    run_dir = spec.points[0].run_dir
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"}
    data["set"]["steps"] = 5
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"point seed=0 cannot go on with steps 3 -> 5, but lr_schedule\.kind cosine "
                       r"spans the run's steps \(lr_schedule\.total_steps is unset\)"):
        run_sweep(load_sweep_spec(path), console=Console(quiet=True))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".lock"} == before

    fixed = {**data, "name": "fixed", "output_dir": str(tmp_path / "fixed")}
    fixed["set"] = {**data["set"], "lr_schedule.total_steps": 5, "steps": 3}
    fixed_path = tmp_path / "fixed.yaml"
    fixed_path.write_text(yaml.safe_dump(fixed))
    run_sweep(load_sweep_spec(fixed_path), console=Console(quiet=True))
    fixed["set"]["steps"] = 5  # the horizon is its own: the point is extended, as a 5-step run from the start
    fixed_path.write_text(yaml.safe_dump(fixed))
    grown = load_sweep_spec(fixed_path)
    assert run_sweep(grown, console=Console(quiet=True)) == {"seed=0": "completed"}
    fresh = {**fixed, "name": "fresh", "output_dir": str(tmp_path / "fresh")}
    fresh_path = tmp_path / "fresh.yaml"
    fresh_path.write_text(yaml.safe_dump(fresh))
    long = load_sweep_spec(fresh_path)
    run_sweep(long, console=Console(quiet=True))
    assert _metrics(grown) == _metrics(long)


def test_only_runs_a_round_of_the_grid_and_a_later_round_adds_the_rest(tmp_path):
    """--only KEY=V1,V2 selects points by grid value; the rest of the grid runs later into the same directory,
    the finished round is skipped, and a bad key or value is one clear error (exit code 2)."""
    path = _sweep_file(tmp_path, "only", grid={"inject.value": [0.0, -0.5], "seed": [0, 1]})
    assert main(["sweep", str(path), "--only", "inject.value=-0.5", "--only", "seed=1", "--no-report",
                 "--quiet"]) == 0
    spec = load_sweep_spec(path)
    ran = sorted(p.name for p in spec.points if (p.run_dir / "summary.json").exists())
    assert ran == ["inject.value=-0.5,seed=1"]
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert [point["name"] for point in index["points"] if point["status"] == "completed"] == ran
    first = (spec.output_dir / "points" / ran[0] / "metrics.jsonl").read_bytes()
    assert main(["sweep", str(path), "--no-report", "--quiet"]) == 0
    assert all((p.run_dir / "summary.json").exists() for p in spec.points)
    assert (spec.output_dir / "points" / ran[0] / "metrics.jsonl").read_bytes() == first  # skipped, not re-run
    assert main(["sweep", str(path), "--only", "seed=7"]) == 2
    assert main(["sweep", str(path), "--only", "inject.valu=0.0"]) == 2
    assert main(["sweep", str(path), "--only", "seed"]) == 2


def test_point_runs_named_points_that_are_no_cross_product(tmp_path, capsys):
    """--point NAME (repeatable) runs exactly the named points: one magnitude at one seed and another at another, in
    one call and one directory, which no --only can select; with --only, the named points that also match it. A name
    of no point is one clear error (exit code 2) that shows the form names take."""
    path = _sweep_file(tmp_path, "named", grid={"inject.value": [0.0, -0.5], "seed": [0, 1]})
    spec = load_sweep_spec(path)
    wanted = ["inject.value=0.0,seed=1", "inject.value=-0.5,seed=0"]
    assert select_points(spec, ["seed=1"], wanted) == [p for p in spec.points if p.name == wanted[0]]
    assert main(["sweep", str(path), "--point", wanted[0], "--point", wanted[1], "--no-report", "--quiet"]) == 0
    ran = sorted(p.name for p in spec.points if (p.run_dir / "summary.json").exists())
    assert ran == sorted(wanted)
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    assert sorted(point["name"] for point in index["points"] if point["status"] == "completed") == ran
    capsys.readouterr()
    assert main(["sweep", str(path), "--point", "seed=1,inject.value=0.0"]) == 2  # keys out of grid order
    err = capsys.readouterr().err
    assert "--point 'seed=1,inject.value=0.0'" in err and "e.g. 'inject.value=0.0,seed=0'" in err


def test_sweep_set_changes_every_point_and_is_recorded_and_checked_on_a_rerun(tmp_path, capsys, monkeypatch):
    path = _fast_sweep_file(tmp_path, "s", grid={"seed": [0, 1]})
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


def test_the_cli_offers_the_executors_run_sweep_takes(tmp_path):
    """``--executor``'s choices and run_sweep's check read one tuple (an executor added to it is offered and run)."""
    from vexact.cli import build_parser
    from vexact.sweeps import EXECUTORS

    sweep = build_parser()._subparsers._group_actions[0].choices["sweep"]
    (flag,) = [action for action in sweep._actions if "--executor" in action.option_strings]
    assert flag.choices is EXECUTORS and flag.default in EXECUTORS
    spec = load_sweep_spec(_fast_sweep_file(tmp_path, "e", {"seed": [0]}))
    with pytest.raises(ValueError, match=r"^unknown executor 'slurm'; expected local or ray$"):
        run_sweep(spec, executor="slurm")


def test_a_sweep_file_names_the_knob_inject_value_without_the_run_configs_warning(tmp_path):
    """In a sweep file ``inject.value`` names the mode's knob and its points' folders (so sweeps written before the
    per-mode names resume): the demo's sweep loads without a FutureWarning, its points keep their names and values,
    while the same key in a run config still warns."""
    import warnings

    from vexact.rl.config import config_from_dict

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        spec = load_sweep_spec(Path(sweep_module.__file__).parent / "demo_sweep.yaml", tmp_path / "demo")
    assert [p.name for p in spec.points][:2] == ["inject.value=0.0,seed=0", "inject.value=0.0,seed=1"]
    assert sorted({p.config.inject.value for p in spec.points}) == [-0.5, -0.25, 0.0]
    with pytest.warns(FutureWarning, match="use 'inject.epsilon'"):
        config_from_dict({"inject": {"mode": "logit_scale"}}, ["inject.value=-0.25"])
