"""Random settings into ``vexact run``: every run is a run (exit 0), a run that stopped itself (1) or one error line
(2) -- never an exception out of ``main``, never a traceback.

The other config tests name each rule's key and value; this one draws combinations of them, seeded: one to three
keys of the run config's schema (walked from ``RunConfig``'s dataclasses, so a key added to the schema is drawn
too), each set to a value its type and bounds suggest (the bounds themselves and just inside them, a Literal's
options, a registry's names, ``null`` where allowed), on top of a tiny two-step run of
``experiments/zero_mismatch.yaml``. Many draws are refused (a bound, a cross-key rule); the rest run. 900 draws
passed once (session 62's scratch fuzz); this keeps 48 of them.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from pathlib import Path

import pytest

from vexact.cli import main
from vexact.registry import RegisteredName
from vexact.rl.config_schema import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
TINY = {"steps": 2, "warm_start.steps": 0, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "task.eval_prompts": 4, "logging.eval_every": 1000, "logging.checkpoint_every": 1000, "threads": 1,
        "logging.live": "false"}
NOT_DRAWN = {"name", "output_dir", "device", "plugins", "warm_start.cache_dir", "logging.backends", "rollout.engine",
             "rollout.cuda_graphs"}  # where a run writes, what it imports, which machine or engine: tested elsewhere
SLOW_VALUES = {"triton"}  # a backend run under the Triton interpreter: minutes
SIZE_KEYS = ("steps", "warm_start.steps", "rollout.prompts_per_step", "rollout.samples_per_prompt", "task.eval_prompts")
"""Keys whose drawn value may make the run long: kept at TINY's value when drawn above 8."""


def _schema_keys(cls: type, prefix: str = "") -> list[tuple[str, object, dict]]:
    """(dotted key, type hint, bounds) of every leaf of the config schema, sections walked."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        section = inner[0] if len(inner) == 1 else hint
        if dataclasses.is_dataclass(section):
            keys += _schema_keys(section, f"{prefix}{f.name}.")
        elif prefix + f.name not in NOT_DRAWN:
            keys.append((prefix + f.name, hint, dict(f.metadata)))
    return keys


def _candidates(hint: object, bounds: dict) -> list[object]:
    """Values a setting of this type and bounds might be given, in range and at its edges."""
    args = typing.get_args(hint)
    kinds = {hint, *args}
    nullable = ["null"] if type(None) in kinds else []
    for kind in kinds:
        if isinstance(kind, type) and issubclass(kind, RegisteredName):
            return [*kind.registry.names(), *nullable]
        if typing.get_origin(kind) is typing.Literal:
            return [*typing.get_args(kind), *nullable]
    low, high = bounds.get("min", bounds.get("gt")), bounds.get("max", bounds.get("lt"))
    values: list[object] = [*nullable]
    if bool in kinds:
        values += ["true", "false"]
    elif int in kinds:
        base = int(low) if low is not None else 0
        values += [base, base + 1, base + 2, base + 7, 64] + ([int(high)] if high is not None else [])
    if float in kinds:
        base = float(low) if low is not None else 0.0
        values += [base, base + 1e-9, base + 0.5, 1.0, 2.0, 1e6] + ([high, high - 1e-9] if high is not None else [])
    if str in kinds:
        values += ["x", "1"]
    return [v for v in values if v not in SLOW_VALUES] or ["1"]


@pytest.mark.parametrize("seed", range(6))
def test_random_settings_are_a_run_or_one_error_line(tmp_path, capsys, seed):
    rng = random.Random(seed)
    keys = _schema_keys(RunConfig)
    for trial in range(8):
        settings = dict(TINY)
        for key, hint, bounds in rng.sample(keys, rng.randint(1, 3)):
            settings[key] = rng.choice(_candidates(hint, bounds))
        for key in SIZE_KEYS:
            if isinstance(settings.get(key), int) and settings[key] > 8:
                settings[key] = TINY[key]
        drawn = {k: v for k, v in settings.items() if TINY.get(k, object()) != v}
        argv = ["run", str(EXPERIMENT), "--set", f"output_dir={tmp_path / f'run{trial}'}",
                "--set", f"warm_start.cache_dir={tmp_path / 'warm_start'}"]
        for key, value in settings.items():
            argv += ["--set", f"{key}={value}"]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 1, 2) and "Traceback" not in err, (drawn, code, err[-2000:])
        if code == 2:
            assert err.startswith("error: ") and len(err.splitlines()) == 1, (drawn, err)
