"""An extension owns its settings: a registered mode, task, schedule, correction method, advantage estimator or log
backend declares a dataclass whose fields become config keys of its section (``vexact.registry``), validated,
saved, settable with ``--set``, documented and gone again when it is unregistered; the run config (the schema
``vexact/rl/config_schema.py``, and ``config.py`` that reads files into it) imports no extension."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import vexact
from tools import docs_gen
from vexact.registry import PluginCodeError, mounts, type_hints
from vexact.rl import BUILTINS
from vexact.rl.config import config_from_dict
from vexact.rl.config_schema import InjectSection, RunConfig
from vexact.rl.log_backends import LOG_BACKENDS, open_backends
from vexact.rl.objective import compute_advantages
from vexact.rl.registries import ADVANTAGE_ESTIMATORS, INJECT_MODES, REGISTRIES, TASKS
from vexact.rl.validate import ConfigError, bounds
from vexact.rl.warmstart import warm_start_key

ROOT = Path(__file__).resolve().parents[2]


# --- the schema imports no extension ---------------------------------------------------------------------------


def _module_imports(module: str) -> set[str]:
    """The vexact modules ``module`` imports when it is imported (module level; ``if TYPE_CHECKING:`` blocks and
    imports inside functions run later, or never)."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    if not path.exists():
        path = ROOT / Path(*module.split(".")) / "__init__.py"
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("vexact.") and _exists(n)}
    return found


def _exists(module: str) -> bool:
    base = ROOT / Path(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += list(_module_imports(name))
    return seen - {module}


def test_the_config_schema_imports_no_extension():
    """Not directly, not through another module: the built-ins register when the ``vexact.rl`` package imports
    them, as a plugin's extensions do (package ``__init__`` files, which Python runs anyway, are not followed)."""
    extensions = set(BUILTINS) | {"vexact.rl.surge_task", "vexact.rl.horizon_task", "vexact.rl.vocab_tail"}
    reached = _closure("vexact.rl.config")  # the loader, and through it the schema and the other spellings
    assert not reached & extensions, sorted(reached & extensions)
    assert "vexact.rl.registries" in reached  # ... it validates against the registries
    assert _closure("vexact.rl.inject_modes") & {"vexact.rl.config_schema"}  # counter-case: the walk finds imports


# --- the built-ins' settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key, owners", [
    ("inject.precision", ["injection mode 'precision'"]),
    ("inject.sites", ["injection mode 'precision'"]),
    ("inject.kernel_backend", ["injection mode 'kernel'"]),
    ("warm_start.trace_fraction", ["task 'surge'"]),
    ("lr_schedule.total_steps", ["LR schedule 'cosine'"]),
    ("lr_schedule.gamma", ["LR schedule 'step'"]),
    ("lr_schedule.decay_period", ["LR schedule 'length_triggered'", "LR schedule 'mismatch_triggered'"]),
    ("lr_schedule.mismatch_window", ["LR schedule 'mismatch_triggered'"]),
    ("correction.threshold", [f"correction method '{m}'" for m in ("token_tis", "seq_tis", "token_mis", "seq_mis")]),
    ("correction.band", ["correction method 'icepop'", "correction method 'geo_rs'"]),
    ("logging.wandb_project", ["log backend 'wandb'"]),
])
def test_each_extensions_keys_are_its_own(key, owners):
    section, name = key.split(".")
    cls = type(getattr(RunConfig(), section))
    assert mounts(cls)[name].owner_names == owners
    assert name in {f.name for f in dataclasses.fields(cls)}  # a key of the section like any other


def test_the_sections_own_keys_are_shared_by_every_entry():
    own = {f.name for f in dataclasses.fields(InjectSection)} - set(mounts(InjectSection))
    assert {"mode", "value", "scope", "onset_step", "ramp_steps", "target"} <= own
    assert not own & {"precision", "sites", "kernel_backend", "kernel_dtype"}


def test_a_setting_that_needs_its_entry_selected():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": {"name": "reverse"}, "warm_start": {"trace_fraction": 0.1}})
    assert e.value.key == "warm_start.trace_fraction"
    assert "is a setting of task surge only: it needs task.name: surge, got task.name 'reverse'" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"correction": {"method": "token_tis", "band": [0.5, 2.0]}})
    assert e.value.key == "correction.band" and "needs correction.method: icepop or geo_rs" in e.value.problem
    # counter-cases: the owner selected, or the setting left at its default
    assert config_from_dict({"correction": {"method": "geo_rs", "band": [0.5, 2.0]}}).correction.band == (0.5, 2.0)
    assert config_from_dict({"task": {"name": "reverse"}}).warm_start.trace_fraction is None


def test_a_settings_classes_own_check_names_its_key():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"correction": {"method": "icepop", "band": [2.0, 1.0]}})
    assert e.value.key == "correction.band" and "lower < upper" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"mode": "precision", "sites": ["logits", "mlp"]}})
    assert e.value.key == "inject.sites[1]" and "'linear', 'attention', 'norm', 'logits'" in e.value.problem


def test_other_spellings_reach_registered_names():
    """``VALUE_ALIASES`` apply to a registry's names as to a Literal's: verl's ``token-mean`` is ``token_mean``."""
    assert config_from_dict({"algorithm": {"loss_agg": "token-mean"}}).algorithm.loss_agg == "token_mean"
    with pytest.raises(ConfigError, match=r"also spelled 'token-mean', 'seq-mean-token-mean'"):
        config_from_dict({"algorithm": {"loss_agg": "token-sum"}})


# --- an outside entry's settings -------------------------------------------------------------------------------


@dataclass
class BoostSettings:
    boost_token: int = field(default=3, metadata=bounds(min=0))  # the token whose logit is raised
    boost_sites: list[str] = field(default_factory=lambda: ["logits"])


class Boost(vexact.InjectMode):
    """``boost_outside``: raise one token's logit on the rollout path."""

    name = "boost_outside"
    knob = "logit bonus"
    settings = BoostSettings


@pytest.fixture
def boost():
    vexact.register_inject_mode(Boost())
    yield
    if Boost.name in INJECT_MODES:
        INJECT_MODES.remove(Boost.name)


def test_an_outside_entrys_settings_are_config_keys(boost):
    cfg = config_from_dict({"inject": {"mode": Boost.name, "value": 1.0, "boost_token": 7}},
                           ["inject.boost_sites=[linear]"])
    assert (cfg.inject.boost_token, cfg.inject.boost_sites) == (7, ["linear"])
    assert cfg.to_dict()["inject"]["boost_token"] == 7 and config_from_dict(cfg.to_dict()) == cfg  # saved, reloaded
    assert RunConfig().inject.boost_token == 3  # the default, also for a config built in Python
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"boost_token": -1}})
    assert e.value.key == "inject.boost_token" and "an integer >= 0" in e.value.problem
    page = docs_gen.config_markdown()
    assert "| `inject.boost_token` |" in page and "the token whose logit is raised (from injection mode " \
        "'boost_outside')" in page
    assert "`inject.boost_token`, `inject.boost_sites`" in docs_gen.choices_markdown()


def test_unregistering_takes_the_keys_out_again(boost):
    INJECT_MODES.remove(Boost.name)
    assert "boost_token" not in {f.name for f in dataclasses.fields(InjectSection)}
    assert not hasattr(InjectSection, "boost_token") and "boost_token" not in RunConfig().to_dict()["inject"]
    with pytest.raises(ConfigError) as e:
        config_from_dict({"inject": {"boost_token": 7}})
    assert e.value.key == "inject.boost_token" and "unknown key" in e.value.problem


def test_a_sections_type_hints_follow_its_keys(boost):
    """``registry.type_hints`` works a class's hints out once; a section re-made in place (an entry's settings
    mounted or withdrawn: the same class object) gets its new ones, not the ones worked out before."""
    hints = type_hints(InjectSection)
    assert hints["boost_token"] is int and type_hints(InjectSection) is hints  # worked out once
    INJECT_MODES.remove(Boost.name)
    assert "boost_token" not in type_hints(InjectSection)
    vexact.register_inject_mode(Boost())
    assert type_hints(InjectSection)["boost_token"] is int


def test_a_key_declared_twice_is_refused(boost):
    @dataclass
    class Clash:
        boost_token: int = 0

    class Other(vexact.InjectMode):
        name, knob, settings = "other_outside", "x", Clash

    with pytest.raises(ValueError, match="'inject.boost_token', which injection mode 'boost_outside' declared"):
        vexact.register_inject_mode(Other())
    assert "other_outside" not in INJECT_MODES and mounts(InjectSection)["boost_token"].declared_in is BoostSettings

    @dataclass
    class OwnKey:
        value: float = 0.0

    class Third(vexact.InjectMode):
        name, knob, settings = "third_outside", "x", OwnKey

    with pytest.raises(ValueError, match="'inject.value', a key of the section itself"):
        vexact.register_inject_mode(Third())


def test_an_outside_estimator_reads_its_settings_from_the_algorithm_section():
    @dataclass
    class ScaleSettings:
        advantage_scale: float = field(default=1.0, metadata=bounds(gt=0))

    class Scaled(vexact.AdvantageEstimator):
        """``scaled_outside``: the reward times ``algorithm.advantage_scale``."""

        name = "scaled_outside"
        settings = ScaleSettings

        def advantages(self, rewards, group_size, std_normalize, alg):
            return rewards * alg.advantage_scale

    vexact.register_advantage_estimator(Scaled())
    try:
        alg = config_from_dict({"algorithm": {"advantage": "scaled_outside", "advantage_scale": 2.0}}).algorithm
        rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
        assert torch.equal(compute_advantages(rewards, 2, alg.advantage, alg.std_normalize, alg),
                           torch.tensor([2.0, 0.0, 1.0, 0.5]))
    finally:
        ADVANTAGE_ESTIMATORS.remove("scaled_outside")
    assert "advantage_scale" not in RunConfig().to_dict()["algorithm"]


def test_an_outside_estimator_says_which_rollouts_it_cannot_learn_from():
    """The config asks the selected estimator (``signal_problem``), so a new group-baseline estimator is refused at
    one sample per prompt as ``grpo`` is, with no name list in the config to edit."""

    class GroupMax(vexact.AdvantageEstimator):
        """``group_max_outside``: r - the group's best reward."""

        name = "group_max_outside"

        def advantages(self, rewards, group_size, std_normalize, alg):
            groups = rewards.view(-1, group_size)
            return (groups - groups.max(dim=1, keepdim=True).values).reshape(-1)

        def signal_problem(self, group_size, prompts_per_step):
            return ("a group of 1 has nothing to compare", "rollout.samples_per_prompt") if group_size < 2 else None

    vexact.register_advantage_estimator(GroupMax())
    try:
        with pytest.raises(ConfigError) as err:
            config_from_dict({"algorithm": {"advantage": "group_max_outside"}, "rollout": {"samples_per_prompt": 1}})
        assert err.value.key == "rollout.samples_per_prompt"
        assert err.value.problem == "a group of 1 has nothing to compare"
        config_from_dict({"algorithm": {"advantage": "group_max_outside"}, "rollout": {"samples_per_prompt": 2}})
    finally:
        ADVANTAGE_ESTIMATORS.remove("group_max_outside")


def test_an_outside_log_backend_is_opened_with_its_settings(tmp_path):
    written: list[tuple[int, dict]] = []

    @dataclass
    class ListSettings:
        list_label: str = "run"

    class ListBackend(vexact.LogBackendKind):
        """``list_outside``: rows into a Python list."""

        name = "list_outside"
        settings = ListSettings

        def open(self, run_dir, cfg):
            label = cfg.logging.list_label

            class Writer:
                def write(self, step, values):
                    written.append((step, {label: values}))

                def close(self):
                    pass

            return Writer()

    vexact.register_log_backend(ListBackend())
    try:
        cfg = config_from_dict({"logging": {"backends": ["jsonl", "list_outside"], "list_label": "mine"}})
        backends = open_backends(tmp_path, cfg, [{"step": 0, "actor/lr": 0.5}])
        assert len(backends) == 1 and written == [(0, {"mine": {"actor/lr": 0.5}})]
        # the user's own trainer's monitor takes it as well: its backends are the registry's, read when it starts
        with vexact.LiveMonitor(tmp_path / "live", backends=("jsonl", "list_outside")) as monitor:
            monitor.step(0, [torch.tensor([-0.5, -1.0])], [torch.tensor([-0.5, -1.0])])
        assert written[1][0] == 0 and written[1][1]["run"]["mismatch/bitwise_equal_frac"] == 1.0
    finally:
        LOG_BACKENDS.remove("list_outside")


def test_an_outside_tasks_default_setting_leaves_the_warm_start_key_as_it_was():
    """A setting an extension adds to ``task`` or ``warm_start`` enters the warm-start cache key only when set away
    from its default, so registering a plugin does not orphan existing cached warm starts."""
    before = warm_start_key(config_from_dict({}))

    @dataclass
    class EchoSettings:
        section: ClassVar[str] = "warm_start"
        echo_weight: float = 1.0

    class Echo(vexact.Task):
        name, tag, settings = "echo_settings_outside", "#", EchoSettings

        def sample(self, rng):
            raise NotImplementedError

        def max_answer_len(self):
            return self.max_len

        def max_input_len(self):
            return self.max_len

    vexact.register_task(Echo)
    try:
        assert warm_start_key(config_from_dict({})) == before
        assert warm_start_key(config_from_dict({"warm_start": {"echo_weight": 2.0}})) != before
    finally:
        TASKS.remove(Echo.name)


def test_the_schema_types_out_no_extension_points_names():
    """The choices of the extension points are registry names in the schema (``TaskName``, ...), read from the
    registries at validation: no ``Literal`` in config_schema.py lists a registered name (as ``advantage``,
    ``loss_agg``, ``loss_type``, ``backends``, ``inject.sites`` and ``mismatch_metric`` did)."""
    literals = set()
    for node in ast.walk(ast.parse((ROOT / "vexact" / "rl" / "config_schema.py").read_text())):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
            literals |= {c.value for c in ast.walk(node.slice) if isinstance(c, ast.Constant)}
    registered = {name for registry in REGISTRIES for name in registry.names()}
    assert literals and not literals & registered, literals & registered
    assert not literals & {"linear", "attention", "norm", "logits"}  # the precision sites: one table, in their mode


class _OutsideAdvantages(vexact.AdvantageEstimator):
    """An outside estimator whose ``advantages`` is the test's ``make`` and ``signal_problem`` its ``problem``."""

    name = "outside_adv"
    make = staticmethod(lambda rewards, group_size: rewards - rewards.mean())
    problem = None

    def advantages(self, rewards, group_size, std_normalize, alg):
        return self.make(rewards, group_size)

    def signal_problem(self, group_size, prompts_per_step):
        return self.problem


@pytest.fixture
def outside_adv():
    estimator = vexact.register_advantage_estimator(_OutsideAdvantages())
    yield estimator
    ADVANTAGE_ESTIMATORS.remove("outside_adv")


def _raise(rewards, group_size):
    raise RuntimeError("boom")


@pytest.mark.parametrize("make, got", [
    (lambda r, g: r.view(-1, g).mean(1), "returned a torch.float64 tensor of shape [2]"),  # one per group
    (lambda r, g: r.view(-1, 1), "returned a torch.float64 tensor of shape [4, 1]"),
    (lambda r, g: r.mean(), "returned a torch.float64 tensor of shape []"),
    (lambda r, g: torch.cat([r, r]), "returned a torch.float64 tensor of shape [8]"),  # 2N: the first N were used
    (lambda r, g: (r > 0).long(), "returned a torch.int64 tensor of shape [4]"),
    (lambda r, g: [0.0] * r.numel(), "returned [0.0, 0.0, 0.0, 0.0] (a list)"),
    (_raise, "raised RuntimeError: boom"),
    (lambda r: r, "raised TypeError"),  # the wrong signature
])
def test_an_outside_estimators_advantages_must_be_one_float_per_sequence(outside_adv, make, got):
    outside_adv.make = make
    with pytest.raises(PluginCodeError) as err:
        compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), 2, "outside_adv")
    assert str(err.value).startswith(f"advantage estimator 'outside_adv' (advantages) {got}")


@pytest.mark.parametrize("make, got", [
    (lambda r, g: r / 0.0, "returned 4 non-finite advantage(s) of 4 (the first, inf, at index 0)"),
    (lambda r, g: torch.where(r == 0.5, float("nan"), r), "returned 1 non-finite advantage(s) of 4 (the first, nan, "
     "at index 2)"),
])
def test_an_outside_estimators_non_finite_advantages_from_finite_rewards_are_its_defect(outside_adv, make, got):
    """NaN/Inf advantages from finite rewards went on into the loss and the update unnoticed (the return check read
    the shape and dtype only), to show up as the run's own NaN outcome."""
    outside_adv.make = make
    with pytest.raises(PluginCodeError) as err:
        compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), 2, "outside_adv")
    assert str(err.value) == (f"advantage estimator 'outside_adv' (advantages) {got} from finite rewards: expected "
                              "finite advantages")


def test_non_finite_advantages_from_non_finite_rewards_or_a_built_in_are_an_outcome(outside_adv):
    """NaN rewards (a run's outcome, recorded) give NaN advantages through an outside estimator too; a built-in
    overflowing float64 on extreme finite rewards is no plugin defect: both are returned, not refused."""
    rewards = torch.tensor([1.0, float("nan"), 0.5, 0.25])
    assert torch.equal(compute_advantages(rewards, 2, "outside_adv").isnan(), torch.tensor([True] * 4))
    huge = torch.tensor([1.7e308, 1.7e308, 0.0, 1.0], dtype=torch.float64)  # the group's sum overflows
    assert not compute_advantages(huge, 2, "grpo", std_normalize=False)[:2].isfinite().any()


@pytest.mark.parametrize("problem, expected", [
    ("needs 4 samples", "returned 'needs 4 samples': expected None or a tuple"),
    (("needs 4 samples",), "returned ('needs 4 samples',): expected None or a tuple"),
    (("needs 4 samples", 7), "returned ('needs 4 samples', 7): expected None or a tuple"),
])
def test_an_outside_estimators_signal_problem_must_have_the_documented_form(outside_adv, problem, expected):
    outside_adv.problem = problem
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": {"advantage": "outside_adv"}})
    assert err.value.key == "algorithm.advantage"
    assert err.value.problem.startswith(f"advantage estimator 'outside_adv' (signal_problem) {expected}")


def test_an_outside_estimators_signal_problem_that_raises_is_one_config_error(outside_adv):
    outside_adv.signal_problem = lambda group_size: None  # the wrong signature
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": {"advantage": "outside_adv"}})
    assert err.value.key == "algorithm.advantage"
    assert err.value.problem.startswith("advantage estimator 'outside_adv' (signal_problem) raised TypeError")


def _estimator_with(settings_class: type) -> vexact.AdvantageEstimator:
    class WithSettings(vexact.AdvantageEstimator):
        name, settings = "settings_outside", settings_class

        def advantages(self, rewards, group_size, std_normalize, alg):
            return rewards - rewards.mean()

    return WithSettings()


def test_a_default_the_config_would_refuse_is_refused_at_registration():
    """A default outside its own bounds ran, was saved to config.yaml, and the run could not be resumed from it."""

    @dataclass
    class OutOfBounds:
        adv_scale: float = field(default=-1.0, metadata=bounds(gt=0))

    with pytest.raises(ValueError) as err:
        vexact.register_advantage_estimator(_estimator_with(OutOfBounds))
    assert str(err.value).startswith("advantage estimator 'settings_outside' declares the setting "
                                     "'algorithm.adv_scale' with a default the config refuses: expected a number > 0, "
                                     "got -1.0")
    assert "settings_outside" not in ADVANTAGE_ESTIMATORS and "adv_scale" not in RunConfig().to_dict()["algorithm"]

    @dataclass
    class OwnCheck:
        adv_low: float = 2.0
        adv_high: float = 1.0

        def check(self):
            if self.adv_low >= self.adv_high:
                raise ConfigError("adv_low must be below adv_high", "adv_low")

    with pytest.raises(ValueError, match="'algorithm.adv_low' with a default the config refuses: adv_low must"):
        vexact.register_advantage_estimator(_estimator_with(OwnCheck))
    assert "settings_outside" not in ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("hint", [Path, Path | None, list[Path], dict[str, Path]])
def test_a_type_the_config_cannot_check_is_refused_at_registration(hint):
    """Not a traceback "unsupported type hint" at the first --set of the key (nor never, for a null default)."""
    Unsupported = dataclasses.make_dataclass("Unsupported", [("adv_dir", hint, field(default=None))])
    with pytest.raises(ValueError) as err:
        vexact.register_advantage_estimator(_estimator_with(Unsupported))
    assert str(err.value).startswith("advantage estimator 'settings_outside' declares the setting 'algorithm.adv_dir' "
                                     f"as {hint!r}, but a config value cannot be checked as {Path!r}")
    assert "settings_outside" not in ADVANTAGE_ESTIMATORS and "adv_dir" not in RunConfig().to_dict()["algorithm"]
