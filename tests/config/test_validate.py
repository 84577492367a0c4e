"""The generic config validator (vexact.rl.validate): one set of rules for run configs and sweep files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml
from test_sweep_faults import _cli_error

from vexact.rl import config as run_config
from vexact.rl.validate import MAX_YAML_DEPTH, MAX_YAML_VALUES, ConfigError, bounds, build, parse_yaml
from vexact.sweeps.sweep import SWEEP_KEYS, SweepFile, load_sweep_spec


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


# --- hostile YAML: one guarded reader for every YAML input ---------------------------------------------------


def _alias_bomb(levels: int = 6, width: int = 9) -> str:
    """"Billion laughs": each anchor lists the previous one ``width`` times, so ``levels`` lines expand to
    width**levels values (531,441 here: over the budget, yet small enough for the unguarded loader to finish)."""
    names = [f"l{i}" for i in range(levels + 1)]
    lines = [f"  - &{names[0]} [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"  - &{names[i]} [" + ", ".join([f"*{names[i - 1]}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("key", ["lulz", "plugins"])
def test_an_alias_bomb_is_one_error_before_any_value_is_expanded(tmp_path, key):
    """An alias bomb under an unknown top-level key, or as the value of ``plugins:``, used to be expanded by the
    config's deep copy before any key was checked (a hang while memory grew); now the reader refuses it."""
    assert 9 ** 6 > MAX_YAML_VALUES
    path = tmp_path / "bomb.yaml"
    path.write_text(f"{key}:\n{_alias_bomb()}")
    with pytest.raises(ConfigError, match=r"aliases expand this value to more than 100,000 values \(an alias "
                                          r"bomb\?\).*\(line \d+, column \d+\)") as e:
        run_config.load_config(path)
    assert str(path) in str(e.value)
    with pytest.raises(ConfigError, match="alias bomb"):  # a sweep file too
        load_sweep_spec(path)


def test_an_integer_past_pythons_digit_limit_is_one_error_naming_the_file_and_line(tmp_path):
    """Python reads at most ``sys.get_int_max_str_digits()`` digits (4,300): a longer integer was a ValueError naming
    neither the file nor the place. The integers YAML reads otherwise are as before."""
    import sys

    path = tmp_path / "big.yaml"
    path.write_text("name: big\nseed: " + "1" * (sys.get_int_max_str_digits() + 1) + "\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in config file '.*big.yaml': an integer of 4,301 characters: "
                                          r"more digits than Python reads \(4,300\); no config value needs one "
                                          r"\(line 2, column 7\)$"):
        run_config.load_config(path)
    assert parse_yaml("a: 0x1f\nb: -12\nc: 1000\nd: 017\ne: " + "9" * 4300) == {
        "a": 31, "b": -12, "c": 1000, "d": 15, "e": int("9" * 4300)}


def test_an_underscore_between_digits_is_text_so_a_lower_upper_band_stays_a_band(tmp_path):
    """YAML 1.1 reads ``_`` between digits as a separator: the IcePop band ``0.5_5`` was the TIS cap 0.55 and the
    k1 band ``1_2`` the number 12, each a different correction with no error. Without separators (as YAML 1.2 and
    JSON) they are the strings their fields parse, and ``1_000`` where a number belongs is an error naming its key."""
    from vexact.rl.corrections import plan_for

    path = tmp_path / "band.yaml"
    path.write_text("correction:\n  rollout_is: token\n  rollout_is_threshold: 0.5_5\n"
                    "  rollout_rs: token_k1\n  rollout_rs_threshold: 1_2\n")
    cfg = run_config.load_config(path)
    assert cfg.correction.rollout_is_threshold == "0.5_5" and cfg.correction.rollout_rs_threshold == "1_2"
    plan = plan_for(cfg.correction)
    assert (plan.is_lower, plan.is_upper) == (0.5, 5.0)
    assert [(r.lower, r.upper) for r in plan.reject] == [(1.0, 2.0)]
    assert parse_yaml("a: 0.5_5\nb: 2_0.5\nc: 1_000\nd: 0.55\ne: -1.5e+3\nf: .inf") == {
        "a": "0.5_5", "b": "2_0.5", "c": "1_000", "d": 0.55, "e": -1500.0, "f": float("inf")}
    with pytest.raises(ConfigError, match=r"config error at 'steps': expected an integer >= 1, got '1_000'"):
        run_config.load_config(path, ["steps=1_000"])


def test_aliases_within_the_budget_still_work_and_a_self_reference_is_refused():
    assert parse_yaml("a: &a [1, 2]\nb: [*a, *a]\nc: {k: *a}") == {"a": [1, 2], "b": [[1, 2], [1, 2]],
                                                                      "c": {"k": [1, 2]}}
    with pytest.raises(yaml.YAMLError, match="refers to a node that contains it"):
        parse_yaml("a: &a [*a]")
    half = MAX_YAML_DEPTH // 2  # each value nests half the limit as written; the alias nests one in the other
    text = f"a: &a {'[' * half}x{']' * half}\nb: {'[' * half}*a{']' * half}\n"
    with pytest.raises(yaml.YAMLError, match=f"aliases nest it deeper than {MAX_YAML_DEPTH} levels"):
        parse_yaml(text)
    assert parse_yaml(text.partition("\nb")[0])["a"][0][0]  # half the limit alone is fine


DEEP = "[" * 20_000 + "]" * 20_000


def _deep_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("argv", [
    lambda tmp: ["run", _deep_file(tmp, "run.yaml", f"model: {DEEP}\n")],
    lambda tmp: ["sweep", _deep_file(tmp, "sweep.yaml", f"grid: {{seed: {DEEP}}}\n")],
    lambda tmp: ["run", _deep_file(tmp, "ok.yaml", "steps: 1\n"), "--set", f"model={DEEP}"],
    lambda tmp: ["compare", str(tmp / "rollout.jsonl"), "--map", "--correction", _deep_file(tmp, "c.yaml", DEEP)],
], ids=["run config", "sweep file", "--set", "--correction"])
def test_nesting_20000_deep_is_one_error_not_a_recursion_error(tmp_path, capsys, monkeypatch, argv):
    line = _cli_error(capsys, monkeypatch, *argv(tmp_path))
    assert f"nested deeper than {MAX_YAML_DEPTH} levels (line 1, column" in line


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
