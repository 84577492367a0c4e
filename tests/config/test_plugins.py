"""Extensions from the command line: a module outside the package, named in a config's ``plugins:`` key (or by the
``vexact.plugins`` entry-point group), registers an injection mode, a task and an LR schedule, and ``vexact run``,
``vexact sweep --jobs 2`` (worker processes) and ``vexact report`` use them. The module is written to a temporary
folder and reaches the subprocesses through PYTHONPATH only: it is no part of vexact or of this test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vexact.records.runlog import read_metrics
from vexact.rl import plugins
from vexact.rl.config import config_from_dict
from vexact.rl.validate import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "outside_ext"

PLUGIN_SOURCE = '''
"""An outside extension: a task, an injection mode and an LR schedule with their own settings, registered on import."""
import random
from dataclasses import dataclass, field

import vexact
from vexact.rl.tasks import Problem
from vexact.rl.validate import bounds


class EchoTask(vexact.Task):
    """Repeat L random digits: ``#:123=`` -> ``123``."""

    name = "echo_plugin"
    tag = "#"

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(self._prompt(digits), digits)

    def max_answer_len(self) -> int:
        return self.max_len

    def max_input_len(self) -> int:
        return self.max_len


@dataclass
class FavourSettings:
    favoured_token: int = field(default=3, metadata=bounds(min=0))  # the token whose logit gets the bonus


class FavourToken(vexact.InjectMode):
    """Add ``value`` to one token's logit (``inject.favoured_token``) on the rollout path."""

    name = "favour_plugin"
    knob = "logit bonus of the favoured token"
    settings = FavourSettings

    def logits_hook(self, injector, value, step):
        if value == 0.0:
            return None
        token = injector.cfg.favoured_token

        def hook(z, seq, pos):
            changed = z.clone()
            changed[..., token] += value
            return changed, changed

        return hook


@dataclass
class HalfSettings:
    half_from: int = field(default=1, metadata=bounds(min=0))  # the first step at half the base LR


class HalfFrom(vexact.ScheduleKind):
    """Half the base LR from step ``lr_schedule.half_from`` on."""

    name = "half_plugin"
    settings = HalfSettings

    def decay(self, s, step):
        return 0.5 if step >= s.cfg.half_from else 1.0


vexact.register_task(EchoTask)
vexact.register_inject_mode(FavourToken())
vexact.register_lr_schedule(HalfFrom())
'''

RUN = {"name": "plugin_run", "seed": 0, "steps": 2, "threads": 1,
       "model": {"preset": "tiny", "max_seq_len": 24},
       "task": {"name": "echo_plugin", "min_len": 2, "max_len": 3, "eval_prompts": 4},
       "warm_start": {"steps": 0},
       "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
       "inject": {"mode": "favour_plugin", "value": 2.0},
       "lr_schedule": {"kind": "half_plugin", "half_from": 1},
       "optimizer": {"warmup_steps": 0},
       "distributed": {"leaves": 1},
       "logging": {"live": False, "eval_every": 1, "checkpoint_every": 1}}


def _plugin_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    return folder


def _vexact(*args: str, path: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m vexact ARGS`` from the repository root, with ``path`` (the plugin's folder) on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([str(path)] if path else []))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "vexact", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def _check_plugin_run(run_dir: Path, favoured: int = 3) -> None:
    """The run used the outside task, mode and schedule, with their settings: the knob was on, and the LR halved at
    step 1 (``lr_schedule.half_from``)."""
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["plugins"] == [PLUGIN] and saved["task"]["name"] == "echo_plugin"
    assert saved["inject"]["favoured_token"] == favoured and saved["lr_schedule"]["half_from"] == 1
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["inject/active"] == 1.0 and r["inject/value"] == 2.0 for r in rows)
    assert rows[1]["actor/lr"] == rows[0]["actor/lr"] / 2


@pytest.mark.slow
def test_vexact_run_and_report_import_the_plugins_key(tmp_path):
    folder = _plugin_dir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": [PLUGIN], **RUN, "output_dir": str(tmp_path / "run")}))
    # the plugin's own key on the command line: the plugins load before the --set overrides are applied
    done = _vexact("run", str(config), "--set", "inject.favoured_token=5", path=folder)
    assert done.returncode == 0, done.stderr
    _check_plugin_run(tmp_path / "run", favoured=5)
    report = _vexact("report", str(tmp_path / "run"), path=folder)  # reads config.yaml: imports the plugin again
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "run" / "report" / "report.json").is_file()


@pytest.mark.slow
def test_vexact_sweep_with_two_workers_imports_the_sweep_files_plugins(tmp_path):
    """The sweep file names the plugin (its base config does not): every point's config carries it, so each
    spawned worker imports it before it validates the point's config."""
    folder = _plugin_dir(tmp_path)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(RUN))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "plugin_sweep", "base": "base.yaml", "plugins": [PLUGIN],
                                     "output_dir": str(tmp_path / "sweep"), "grid": {"seed": [0, 1]}}))
    done = _vexact("sweep", str(sweep), "--jobs", "2", path=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    points = sorted((tmp_path / "sweep" / "points").iterdir())
    assert [p.name for p in points] == ["seed=0", "seed=1"]
    for point in points:
        assert json.loads((point / "summary.json").read_text())["status"] == "completed"
        _check_plugin_run(point)
    report = _vexact("report", str(tmp_path / "sweep"), path=folder)
    assert report.returncode == 0, report.stderr


@pytest.mark.slow
def test_a_plugins_setting_is_validated_under_its_own_key(tmp_path):
    folder = _plugin_dir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": [PLUGIN], **RUN, "output_dir": str(tmp_path / "run")}))
    done = _vexact("run", str(config), "--set", "lr_schedule.half_from=-1", path=folder)
    assert done.returncode == 2
    assert done.stderr == ("error: config error at 'lr_schedule.half_from': expected an integer >= 0, got -1 (from "
                           "--set lr_schedule.half_from=-1)\n")


@pytest.mark.slow
def test_a_plugin_that_cannot_be_imported_is_one_error_line(tmp_path):
    """Without the plugin's folder on the path: exit code 2 and one line naming the module and the ImportError."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": [PLUGIN], **RUN, "output_dir": str(tmp_path / "run")}))
    done = _vexact("run", str(config))
    assert done.returncode == 2
    assert done.stderr == (f"error: config error at 'plugins[0]': plugin '{PLUGIN}' cannot be imported: "
                           f"ModuleNotFoundError: No module named '{PLUGIN}' (is it installed, or on PYTHONPATH?)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_plugin_that_calls_sys_exit_is_one_error_line_naming_it(tmp_path):
    """A plugin that calls ``sys.exit(3)`` while imported made vexact exit 3 with no word; now it is bad input."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "exiting_ext.py").write_text("import sys\n\nsys.exit(3)\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"plugins": ["exiting_ext"], **RUN, "output_dir": str(tmp_path / "run")}))
    done = _vexact("run", str(config), path=folder)
    assert done.returncode == 2
    assert done.stderr == ("error: config error at 'plugins[0]': plugin 'exiting_ext' failed while being imported: it "
                           "called sys.exit(3)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_entry_point_loads_the_plugin_without_a_plugins_key(tmp_path):
    """An installed distribution's ``vexact.plugins`` entry point is loaded before a config is validated."""
    folder = _plugin_dir(tmp_path)
    dist = folder / "outside_ext-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-ext\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[vexact.plugins]\noutside = {PLUGIN}\n")
    code = (f"from vexact.rl.config import config_from_dict; import json; "
            f"cfg = config_from_dict(json.loads({json.dumps(RUN)!r})); print(cfg.task.name, cfg.plugins)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["echo_plugin", "[]"]
    # counter-case: the same code without the distribution's metadata refuses the outside task
    (dist / "entry_points.txt").unlink()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert done.returncode != 0 and "echo_plugin" in done.stderr and "task.name" in done.stderr


def test_a_failing_entry_point_names_its_distribution(monkeypatch):
    class Broken:
        name, value, group = "broken", "no_such_module_anywhere", plugins.ENTRY_POINT_GROUP
        dist = type("Dist", (), {"name": "broken-dist"})()

        def load(self):
            raise ModuleNotFoundError("No module named 'no_such_module_anywhere'")

    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [Broken()])
    with pytest.raises(ConfigError, match="entry point 'broken' = 'no_such_module_anywhere' of broken-dist failed"):
        plugins.load_entry_points()


@pytest.mark.parametrize("plugins_value, key, problem", [
    (["not a module"], "plugins[0]", "expected an importable module name"),
    (["json", ".relative"], "plugins[1]", "expected an importable module name"),
    (["no_such_module_anywhere"], "plugins[0]", "cannot be imported: ModuleNotFoundError"),
    ("json", "plugins", "expected a list of strings"),
])
def test_bad_plugins_are_one_config_error_at_the_key(plugins_value, key, problem):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"plugins": plugins_value})
    assert e.value.key == key and problem in e.value.problem


def test_a_plugin_set_on_the_command_line_is_named_in_its_error():
    assert config_from_dict({}, ["task.name=reverse", "plugins=[json]"]).plugins == ["json"]
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, ["plugins=[no_such_module_anywhere]"])
    assert e.value.key == "plugins[0]" and "(from --set plugins=[no_such_module_anywhere])" in e.value.problem


@pytest.fixture
def plugin_on_sys_path(tmp_path, monkeypatch):
    """The plugin's folder on this process's ``sys.path`` only (not in PYTHONPATH); its registrations are taken out
    again afterwards."""
    from vexact.rl.inject_modes import INJECT_MODES
    from vexact.rl.schedules import LR_SCHEDULES
    from vexact.rl.tasks import TASKS

    monkeypatch.syspath_prepend(str(_plugin_dir(tmp_path)))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield
    for registry, name in ((TASKS, "echo_plugin"), (INJECT_MODES, "favour_plugin"), (LR_SCHEDULES, "half_plugin")):
        if name in registry:
            registry.remove(name)
    sys.modules.pop(PLUGIN, None)


@pytest.mark.slow
@pytest.mark.needs_package("ray", "pip install 'vexact[ray]' (.ci/run does)")
def test_ray_tasks_import_the_plugins_from_the_drivers_path(tmp_path, plugin_on_sys_path):
    """A Ray task runs in a worker process Ray started, not one this process spawned: the driver's import path
    travels with the task, so the plugin that this process imports from its ``sys.path`` imports there too."""
    from vexact.sweeps import ray_executor
    from vexact.sweeps.sweep import load_sweep_spec, run_sweep

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(RUN))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "plugin_ray", "base": "base.yaml", "plugins": [PLUGIN],
                                     "output_dir": str(tmp_path / "sweep"), "grid": {"seed": [0]}}))
    assert ray_executor.start(None, num_cpus=1)
    try:
        statuses = run_sweep(load_sweep_spec(sweep), executor="ray")
    finally:
        ray_executor.stop()
    assert statuses == {"seed=0": "completed"}, (tmp_path / "sweep" / "points" / "seed=0" / "error.txt").read_text()
    _check_plugin_run(tmp_path / "sweep" / "points" / "seed=0")
