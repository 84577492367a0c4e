"""Run configuration for ``vexact run CONFIG.yaml``: a YAML file or a mapping, with ``--set`` overrides, read and
validated into a ``RunConfig`` (``load_config``, ``config_from_dict``), saved (``save_config``) and hashed
(``config_hash``).

The config's modules, lowest first (each imports only the ones before it):

* ``config_spellings``: other spellings of keys and values (renamed keys, old values, verl's names), moved to the
  current spelling before the schema sees the data;
* ``config_schema``: ``RunConfig`` and its sections, the dataclasses whose fields are the config keys (types,
  defaults, bounds, the checks that involve several fields), and the injection knob's key (``knob_key``);
* ``config`` (this module): the public API. A raw mapping is read in this order: its spellings, the plugins, the
  ``--set`` overrides (walked against the schema, so a typo is caught), the model preset, the injection knob; then
  the schema validates it. Also ``save_config``, ``dotted_items`` and ``config_hash``.

The section classes, ``knob_key(s)``, ``MODEL_DEFAULTS`` and ``DEFAULT_PRESET`` are defined in ``config_schema`` and
importable from here too (``__all__``): the names users import from ``vexact.rl.config``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import yaml

from ..engine.devices import same_device_kind
from ..engine.presets import MODEL_PRESETS, PRESET_NAMES, preset_values
from ..records.atomic import write_text_atomic
from ..registry import type_hints
from .config_schema import (
    DEFAULT_PRESET,
    MODEL_DEFAULTS,
    AlgorithmSection,
    CollapseSection,
    CorrectionSection,
    DistributedSection,
    InjectSection,
    LoggingSection,
    LRScheduleSection,
    ModelSection,
    MonitorSection,
    OptimizerSection,
    RolloutSection,
    RunConfig,
    TargetSection,
    TaskSection,
    WarmStartSection,
    knob_key,
    knob_keys,
)
from .config_spellings import (
    DEPRECATED_SPELLINGS,
    DROP,
    KEY_ALIASES,
    RENAMED_KEYS,
    VALUE_ALIASES,
    current_spelling,
    modernize_values,
    move_aliases,
    move_renamed_keys,
    warn_deprecated,
)
from .plugins import load_plugins
from .registries import INJECT_MODES
from .validate import ConfigError, build, describe, parse_yaml, plain, read_yaml, show_value, yaml_problem

__all__ = [
    "AlgorithmSection",
    "CollapseSection",
    "ConfigError",
    "CorrectionSection",
    "DistributedSection",
    "InjectSection",
    "LRScheduleSection",
    "LoggingSection",
    "ModelSection",
    "MonitorSection",
    "OptimizerSection",
    "RolloutSection",
    "RunConfig",
    "TargetSection",
    "TaskSection",
    "WarmStartSection",
    "DEFAULT_PRESET",
    "DEPRECATED_SPELLINGS",
    "KEY_ALIASES",
    "MODEL_DEFAULTS",
    "config_from_dict",
    "config_hash",
    "dotted_items",
    "knob_key",
    "knob_keys",
    "load_config",
    "move_renamed_keys",
    "save_config",
]


# --- overrides ---------------------------------------------------------------------------------------------


def _apply_override(data: dict, item: str, origin: str | None = None, quiet: Collection[str] = ()) -> str:
    """Apply one ``a.b.c=value`` override to the raw mapping ``data`` in place; returns the dotted key. ``origin``:
    where the item came from, for errors (default ``--set ITEM``); ``quiet``: as ``config_from_dict``'s."""
    origin = origin or f"--set {item}"
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"malformed override {item!r}: expected KEY=VALUE, e.g. --set optimizer.lr=1e-4")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"malformed override {item!r}: empty key segment in {key!r}")
    renamed = RENAMED_KEYS.get(key)
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {raw!r} as YAML (from {origin}): {yaml_problem(e)}", key) from None
    if renamed is not None:
        try:
            value = renamed.translate(key, value)
        except ConfigError as e:
            raise ConfigError(f"{e.problem} (from {origin})", e.key) from None
        if value is DROP:
            return renamed.new
    key = current_spelling(key, quiet)
    key = KEY_ALIASES.get(key, key)
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == "inject" and parts[1] in knob_keys():  # a mode's knob: _resolve_knob's
        if not isinstance(data.setdefault("inject", {}), dict):
            raise ConfigError(f"expected a mapping, got {show_value(data['inject'])}", "inject")
        data["inject"][parts[1]] = value
        return key

    # Walk the schema, not the data, so a typo is caught even when the YAML file never mentions the section.
    tp: Any = RunConfig
    meta: dict = {}  # the field's bounds, for messages
    node = data
    for depth, part in enumerate(parts):
        path = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            hints = type_hints(tp)
            if part not in hints:
                known = ", ".join(f.name for f in dataclasses.fields(tp))
                raise ConfigError(f"unknown key (known keys: {known}) (from {origin})", path)
            meta = next(dict(f.metadata) for f in dataclasses.fields(tp) if f.name == part)
            tp = hints[part]
        elif typing.get_origin(tp) is dict or tp is dict:  # free-form mapping: any key below it
            tp = Any
        elif tp is not Any:
            raise ConfigError(f"'{'.'.join(parts[:depth])}' is not a section; cannot set {key!r}", path)
        if not last:
            tp = _section_type(tp)  # an optional section (inject.target: null by default) is a section too
            if not (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict or tp in (dict, Any)):
                raise ConfigError(f"'{path}' is not a section (it takes {describe(tp, meta)}), so {key!r} does not "
                                  f"exist; set it with --set {path}=VALUE (from {origin})",
                                  ".".join(parts[: depth + 2]))
        if last:
            node[part] = value
        else:
            if node.get(part) is None:  # absent, or left empty in YAML
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigError(f"expected {describe(tp, {})}, got {show_value(node[part])}", path)
            node = node[part]
    return key


def _section_type(tp: Any) -> Any:
    """The section behind an optional one: ``TargetSection | None`` -> ``TargetSection`` (also for free-form
    mappings, ``dict[str, Any] | None``); any other type hint unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and (dataclasses.is_dataclass(arms[0]) or typing.get_origin(arms[0]) is dict
                               or arms[0] is dict):
            return arms[0]
    return tp


# --- public API --------------------------------------------------------------------------------------------


def config_from_dict(d: dict, overrides: Iterable[str] = (), origins: Iterable[str] | None = None,
                     quiet: Collection[str] = ()) -> RunConfig:
    """Validate a raw mapping (as read from YAML), apply ``--set`` overrides, and build the RunConfig.

    ``origins``: where each override came from, in the same order, for errors about its value (default ``--set
    ITEM``; a sweep names its ``set``, grid or variant). ``quiet``: config keys whose deprecated spelling is read
    without its FutureWarning, which is for the files users write: ``DEPRECATED_SPELLINGS`` for a record vexact
    wrote itself (``load_config(saved=True)``), ``{"inject.value"}`` for a sweep's points."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping of config keys, got {type(d).__name__}")
    data = plain(d)  # deep copy: overrides must not mutate the caller's dict
    move_renamed_keys(data, quiet)
    written = move_aliases(data)
    overrides = list(overrides)
    labels = [f"--set {item}" for item in overrides] if origins is None else list(origins)
    if len(labels) != len(overrides):
        raise TypeError(f"config_from_dict: {len(labels)} origins for {len(overrides)} overrides")
    applied: dict[str, tuple[str, str]] = {}  # dotted key -> (the item that set it last, where that came from)
    # The plugins first (--set plugins=..., else the file's key): the other overrides may name keys they register.
    plugin_sets = [i for i, item in enumerate(overrides) if item.partition("=")[0].strip() == "plugins"]
    for i in plugin_sets:
        applied[_apply_override(data, overrides[i], labels[i], quiet)] = overrides[i], labels[i]
    try:  # the entry points' plugins too; a plugins value of another type is build()'s error to report
        load_plugins(data["plugins"] if isinstance(data.get("plugins"), list) else [])
    except ConfigError as e:
        if not plugin_sets:
            raise
        raise ConfigError(f"{e.problem} (from {labels[plugin_sets[-1]]})", e.key) from None
    for i, item in enumerate(overrides):
        if i in plugin_sets:
            continue
        key = _apply_override(data, item, labels[i], quiet)
        earlier, earlier_label = applied.get(key, (None, None))
        spellings = {earlier.partition("=")[0].strip() if earlier else key, item.partition("=")[0].strip()}
        if earlier is not None and len(spellings) > 1 and spellings & {*KEY_ALIASES, *RENAMED_KEYS}:
            which = "verl's and vexact's spelling" if spellings & set(KEY_ALIASES) else "a deprecated spelling"
            raise ConfigError(f"{earlier_label} and {labels[i]} set the same key ({which}); keep only one", key)
        applied[key] = item, labels[i]
    modernize_values(data, quiet)
    knob = None
    try:
        _expand_preset(data.get("model"))
        knob = _resolve_knob(data.get("inject"), quiet)
        _check_inject_knob(data.get("inject"))
        return build(RunConfig, data, "", VALUE_ALIASES)
    except ConfigError as err:
        e = err  # a knob is named as given (inject.sigma, ...), not where it is read (inject.value)
        if knob is not None and err.key == "inject.value":
            e = ConfigError(err.problem, f"inject.{knob}")
        # Point at the --set that produced the bad value, if any, or at the verl spelling the file used.
        for key, (_, label) in applied.items():
            if e.key and (e.key == key or e.key.startswith((key + ".", key + "["))):
                raise ConfigError(f"{e.problem} (from {label})", e.key) from None
        if e.key in written:
            raise ConfigError(f"{e.problem} (written as '{written[e.key]}')", e.key) from None
        raise e from None


def _expand_preset(model: Any) -> None:
    """Fill ``model.preset``'s values into the raw model mapping where no key is given, in place: keys the file or
    ``--set`` give explicitly win over the preset. An unknown name is one config error listing the presets. The
    preset's ``vocab_size`` (if any) is not used: the task sets the vocabulary."""
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    name = model["preset"]
    if not isinstance(name, str) or name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {show_value(name)}; expected one of {', '.join(PRESET_NAMES)}",
                          "model.preset")
    for key, value in preset_values(name).items():
        if key != "vocab_size":
            model.setdefault(key, value)


INJECT_VALUE_DEPRECATED = "config key 'inject.value' is deprecated"
"""How the FutureWarning for ``inject.value`` in a run config begins (a sweep file, where ``inject.value`` names
the mode's knob and its points' folders, reads it without the warning: ``vexact.sweeps.sweep`` passes the key in
``config_from_dict``'s ``quiet``)."""


def _resolve_knob(inject: Any, quiet: Collection[str] = ()) -> str | None:
    """Read the injection knob of a raw ``inject`` mapping into ``value``, in place: the mode's own key
    (``inject.sigma``, ...) is the spelling, ``inject.value`` the old one (a FutureWarning naming the mode's key).
    A knob key of another mode, or both spellings, is one config error. Returns the key moved into ``value``
    (``sigma``, ...; None when none was), which errors about the value name."""
    if not isinstance(inject, dict):
        return None
    mode = inject.get("mode", "none")
    names = knob_keys()
    given = [name for name in names if name in inject]
    if not isinstance(mode, str) or mode not in INJECT_MODES:
        return None  # an unknown or mistyped mode is build()'s error (the knob key then is one too)
    own = INJECT_MODES[mode].knob_name
    for name in given:
        if name != own:
            takes = (f"its knob is inject.{own}" if own else "its knob is inject.value" if INJECT_MODES[mode].knob
                     else "it has no knob")
            raise ConfigError(f"is the knob of mode {' / '.join(names[name])}, not of inject.mode {mode!r} ({takes})",
                              f"inject.{name}")
    if own is None:
        return None
    if "value" in inject:
        if own in inject:
            raise ConfigError(f"is the old spelling of inject.{own}, which is given too; keep only inject.{own}",
                              "inject.value")
        warn_deprecated("inject.value", f"{INJECT_VALUE_DEPRECATED} for inject.mode {mode!r}; use 'inject.{own}' "
                        f"({INJECT_MODES[mode].knob})", quiet, 3)
    elif own in inject:
        inject["value"] = inject.pop(own)
        return own
    return None


def _check_inject_knob(inject: Any) -> None:
    """No silent no-op injection: a knob mode needs ``inject.value`` given (0 included: an explicit baseline) or
    ``inject.target``; a non-zero value needs a knob mode. Checked on the raw mapping, where "not given" differs
    from the default 0 (a saved config.yaml always gives both). Types are ``validate.build``'s to check."""
    if not isinstance(inject, dict):
        return
    mode, value = inject.get("mode", "none"), inject.get("value")
    if not isinstance(mode, str) or isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
        return
    spec = INJECT_MODES[mode] if mode in INJECT_MODES else None  # an unknown name is build()'s error
    knobs = " | ".join(name for name, m in INJECT_MODES.items() if m.knob is not None)
    if spec is not None and spec.knob is not None and value is None and inject.get("target") is None:
        key = f"inject.{spec.knob_key}"
        raise ConfigError(f"mode {mode!r} needs {key} ({spec.knob}), which is not given: nothing would "
                          f"be injected; set it (e.g. --set {key}=...), or inject.target to calibrate it",
                          "inject.mode")
    if spec is not None and spec.source_keys and value:
        raise ConfigError(f"{show_value(value)} is not used by mode {mode!r}, whose mismatch is set by "
                          f"{' and '.join(spec.source_keys)}; remove inject.value", "inject.value")
    if mode == "none" and value:
        raise ConfigError(f"{show_value(value)} would inject nothing: no inject.mode is set; set inject.mode to one of "
                          f"{knobs}, or remove inject.value", "inject.value")
    ramp = inject.get("ramp_steps")
    if spec is not None and spec.knob is None and isinstance(ramp, int) and not isinstance(ramp, bool) and ramp > 0:
        raise ConfigError(f"{ramp} ramps a knob, and mode {mode!r} has none (it "
                          + ("injects nothing" if mode == "none" else "changes the rollout path at inject.onset_step")
                          + "); remove inject.ramp_steps", "inject.ramp_steps")


def load_config(path: str | Path, overrides: Iterable[str] = (), saved: bool = False) -> RunConfig:
    """Read a YAML config file, apply ``--set`` overrides (``a.b.c=value``) and validate it.

    ``saved``: the file is a run's own config.yaml, a record the run wrote (resume, reports): the old spellings one
    written before a rename holds are read without their FutureWarning, which is for the files users write."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: '{path}'")
    data = read_yaml(path, "config file")
    if data is None:  # nothing but whitespace and comments: a wrong or truncated file, not a choice
        raise ConfigError(f"config file '{path}' is empty; write the keys to change (e.g. name: my_run), or {{}} "
                          "for a run with every default")
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must contain a mapping of config keys at top level, "
                          f"got {type(data).__name__}: {show_value(data)}")
    return config_from_dict(data, overrides, quiet=DEPRECATED_SPELLINGS if saved else ())


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the fully resolved config (every field, defaults included) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # a torn config.yaml blocks resume


def dotted_items(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}`` (the spelling of ``--set`` keys); empty sub-mappings add nothing."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted_items(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved_path: str | Path, cfg: RunConfig) -> dict[str, list]:
    """Keys whose value in ``cfg`` differs from a run's saved config (its config.yaml): ``{key: [old, new]}``, keys
    dotted. The run's ``output_dir`` is no change, nor another GPU of the same kind (``cuda:0`` for ``cuda:1``)."""
    saved = dotted_items(load_config(saved_path, saved=True).to_dict())
    now = dotted_items(cfg.to_dict())
    return {k: [saved.get(k), now.get(k)] for k in sorted(set(saved) | set(now))
            if k != "output_dir" and saved.get(k) != now.get(k)
            and not (k == "device" and same_device_kind(saved[k], now[k]))}


def config_hash(section_or_dict: Any) -> str:
    """Stable sha256 hex digest of a dataclass or dict (canonical JSON: sorted keys, tuples as lists)."""
    canonical = json.dumps(plain(section_or_dict), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
