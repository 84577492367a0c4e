"""Extension points registered from outside the package: a new injection mode and a new task, defined in this test
module (never in vexact), run two RL steps through the ordinary config path; an unregistered name is one clear
config error naming the field."""

from __future__ import annotations

import random

import pytest
from rich.console import Console
from torch import Tensor

import vexact
from vexact.records.runlog import read_metrics
from vexact.rl.config import config_from_dict
from vexact.rl.corrections import CORRECTION_METHODS
from vexact.rl.inject_modes import INJECT_MODES
from vexact.rl.schedules import LR_SCHEDULES
from vexact.rl.tasks import TASKS, Problem
from vexact.rl.trainer import Trainer
from vexact.rl.validate import ConfigError


class EchoTask(vexact.Task):
    """Repeat L random digits: ``#:123=`` -> ``123`` (an outside task; its tag reuses a vocabulary character)."""

    name = "echo_outside"
    tag = "#"

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(self._prompt(digits), digits)

    def max_answer_len(self) -> int:
        return self.max_len

    def max_input_len(self) -> int:
        return self.max_len


class FavourToken(vexact.InjectMode):
    """Add ``value`` to one vocabulary entry's logit on the rollout path (an outside mode with a knob)."""

    name = "favour_token_outside"
    knob = "logit bonus of token 3"

    def value_problem(self, value: float) -> str | None:
        return f"{self.name} needs value >= 0, got {value}" if value < 0 else None

    def logits_hook(self, injector, value: float, step: int):
        if value == 0.0:
            return None

        def hook(z: Tensor, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
            changed = z.clone()
            changed[..., 3] += value
            return changed, changed

        return hook


@pytest.fixture
def registered():
    """Register the outside task and mode for one test, and take them out again."""
    vexact.register_task(EchoTask)
    vexact.register_inject_mode(FavourToken())
    yield
    TASKS.remove(EchoTask.name)
    INJECT_MODES.remove(FavourToken.name)


def _tiny(tmp_path, **extra) -> dict:
    cfg = {"name": "outside", "seed": 0, "steps": 2, "threads": 1, "output_dir": str(tmp_path / "run"),
           "model": {"preset": "tiny", "max_seq_len": 24},
           "task": {"name": EchoTask.name, "min_len": 2, "max_len": 3, "eval_prompts": 4},
           "warm_start": {"steps": 3, "batch_size": 8, "cache_dir": str(tmp_path / "cache")},
           "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
           "inject": {"mode": FavourToken.name, "value": 2.0},
           "logging": {"live": False, "eval_every": 1, "checkpoint_every": 1}}
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def test_outside_mode_and_task_run_two_rl_steps(tmp_path, registered):
    cfg = config_from_dict(_tiny(tmp_path), ["distributed.leaves=1"])
    assert cfg.task.name == EchoTask.name and cfg.inject.mode == FavourToken.name
    summary = Trainer(cfg, Console(quiet=True)).run()
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # the outside mode changed the rollout path, and only it: training stays exact
        assert r["inject/active"] == 1.0 and r["inject/value"] == 2.0
        assert r["rollout_corr/k3_kl"] > 0 and r["mismatch/bitwise_equal_frac"] < 1.0


def test_outside_mode_at_zero_is_a_bitwise_no_op(tmp_path, registered):
    """Counter-case to the test above: the same run at value 0 installs no hook, so nothing is injected."""
    cfg = config_from_dict(_tiny(tmp_path, inject={"value": 0.0}), ["distributed.leaves=1"])
    Trainer(cfg, Console(quiet=True)).run()
    for r in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert r["inject/active"] == 0.0 and r["rollout_corr/k3_kl"] == 0.0
        assert r["mismatch/bitwise_equal_frac"] == 1.0


def test_outside_mode_checks_its_own_settings(tmp_path, registered):
    with pytest.raises(ConfigError) as e:
        config_from_dict(_tiny(tmp_path, inject={"value": -1.0}))
    assert e.value.key == "inject.value" and "needs value >= 0" in str(e.value)
    with pytest.raises(ConfigError, match="logit bonus of token 3"):  # a knob mode without its value
        config_from_dict(_tiny(tmp_path, inject={"value": None}))


@pytest.mark.parametrize("key, section, field", [("task.name", "task", "name"), ("inject.mode", "inject", "mode"),
                                                 ("correction.method", "correction", "method"),
                                                 ("lr_schedule.kind", "lr_schedule", "kind")])
def test_an_unregistered_name_is_one_config_error_naming_the_field(tmp_path, key, section, field):
    """Without the fixture the outside names are not registered: each is refused, naming the key, the registered
    names and how to add one. The same config is accepted once they are registered (test above)."""
    data = _tiny(tmp_path)
    data[section] = {**data.get(section, {}), field: "not_registered_anywhere"}
    if section != "task":
        data["task"]["name"] = "reverse"
    if section != "inject":
        data["inject"] = {}
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert e.value.key == key
    assert "registered" in e.value.problem and "'not_registered_anywhere'" in e.value.problem


def test_outside_names_are_refused_once_unregistered(tmp_path, registered):
    config_from_dict(_tiny(tmp_path))
    TASKS.remove(EchoTask.name)
    try:
        with pytest.raises(ConfigError) as e:
            config_from_dict(_tiny(tmp_path))
        assert e.value.key == "task.name" and EchoTask.name in e.value.problem
    finally:
        vexact.register_task(EchoTask)


def test_registering_checks_what_it_is_given():
    with pytest.raises(ValueError, match="already registered"):
        vexact.register_task(TASKS["reverse"])
    with pytest.raises(TypeError, match="subclass of"):
        vexact.register_task(object)  # type: ignore[arg-type]

    class NoTag(EchoTask):
        name, tag = "no_tag_outside", "!"

    with pytest.raises(ValueError, match="vocabulary"):
        vexact.register_task(NoTag)
    with pytest.raises(TypeError, match="InjectMode instance"):
        vexact.register_inject_mode(FavourToken)  # type: ignore[arg-type]
    assert "no_tag_outside" not in TASKS and len(CORRECTION_METHODS) and len(LR_SCHEDULES)


def test_registered_names_are_plain_strings_in_the_saved_config(tmp_path, registered):
    cfg = config_from_dict(_tiny(tmp_path))
    assert type(cfg.task.name) is str and type(cfg.inject.mode) is str
    assert cfg.to_dict()["task"]["name"] == EchoTask.name


def test_the_reference_lists_what_is_registered(registered):
    """The docs' choices tables are read from the registries: an outside entry appears while it is registered."""
    from tools.docs_gen import choices_markdown

    page = choices_markdown()
    assert f"`{EchoTask.name}`" in page and f"`{FavourToken.name}`" in page
    for name in (*TASKS.names(), *INJECT_MODES.names(), *CORRECTION_METHODS.names(), *LR_SCHEDULES.names()):
        assert f"| `{name}` |" in page, name
    TASKS.remove(EchoTask.name)
    try:
        assert f"`{EchoTask.name}`" not in choices_markdown()  # counter-case
    finally:
        vexact.register_task(EchoTask)
