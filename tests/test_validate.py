"""The generic config validator (vexact.rl.validate): one set of rules for run configs and sweep files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from vexact.lab.sweep import SWEEP_KEYS, SweepFile, load_sweep_spec
from vexact.rl import config as run_config
from vexact.rl.validate import ConfigError, bounds, build


@dataclass
class _Inner:
    rate: float = field(default=0.5, metadata=bounds(gt=0, max=1))


@dataclass
class _Schema:
    kind: Literal["a", "b"] = "a"
    inner: _Inner = field(default_factory=_Inner)
    sizes: list[int] = field(default_factory=list)


def test_a_schema_outside_the_run_config_is_validated():
    built = build(_Schema, {"kind": "B", "inner": {"rate": "1e-1"}, "sizes": [1, 2]}, aliases={"B": "b"})
    assert built == _Schema("b", _Inner(0.1), [1, 2])  # the alias is stored as its value; 1e-1 read as a float
    for data, key, says in (({"kynd": "a"}, "kynd", "unknown key"), ({"inner": {"rate": 2}}, "inner.rate", "<= 1"),
                            ({"sizes": [1, "x"]}, "sizes[1]", "an integer"), ({"kind": "B"}, "kind", "one of")):
        with pytest.raises(ConfigError) as e:
            build(_Schema, data)  # (no aliases given here: 'B' is refused)
        assert e.value.key == key and says in str(e.value)


def test_the_run_config_uses_the_validator():
    assert run_config.ConfigError is ConfigError
    with pytest.raises(ConfigError, match="unknown key"):
        run_config.config_from_dict({"optimizer": {"lrr": 1}})


def test_sweep_files_go_through_the_validator(tmp_path):
    assert SWEEP_KEYS == {"name", "base", "set", "grid", "variants", "curves", "output_dir", "plugins"}
    assert build(SweepFile, {"grid": {"seed": [0, 1]}, "curves": ["seed"]}).curves == ["seed"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid: {seed: [0]}\ncurves: 3\n")
    with pytest.raises(ConfigError) as e:
        load_sweep_spec(bad)
    assert e.value.key == "curves" and "expected a list of strings" in str(e.value) and str(bad) in str(e.value)
    good = tmp_path / "good.yaml"
    good.write_text("grid: {seed: [0]}\ncurves: [seed]\nbase: {steps: 2}\n")
    assert [p.name for p in load_sweep_spec(good, tmp_path / "out").points] == ["seed=0"]
