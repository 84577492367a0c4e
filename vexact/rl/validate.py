"""The generic config validator: a YAML mapping -> a tree of dataclasses, checked against their type hints.

Why its own module: the run config (``vexact.rl.config``) and sweep files (``vexact.sweeps.sweep``) are checked by
the same rules, and the rules do not depend on any one schema. What it checks: unknown keys (listing the known
ones), required keys, each value against its field's type hint (``int``, ``float``, ``str``, ``bool``,
``Literal``, a registry's ``name_type`` (``vexact.registry``: one of its names at validation time), ``X | None``,
``list``/``tuple``, ``dict``, nested dataclasses) and numeric bounds (``bounds(min=...)``
in a field's metadata), then each dataclass's own ``check()`` and that of each settings class an extension mounted
into it (``vexact.registry``). Every problem is one ``ConfigError`` naming the
dotted key. ``VALUE_ALIASES`` (other spellings of Literal values; the run config's are
``vexact.rl.config_spellings.VALUE_ALIASES``) is passed in by the caller that has them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from ..registry import RegisteredName, settings_classes, type_hints

__all__ = ["MAX_YAML_DEPTH", "MAX_YAML_VALUES", "NO_ALIASES", "ConfigError", "UniqueKeyLoader", "bounds", "build",
           "convert", "describe", "join_key", "parse_yaml", "plain", "read_text_file", "read_yaml", "show_value",
           "unsupported_hint", "yaml_problem"]

_BOUND_OPS = {"min": ">=", "gt": ">", "max": "<=", "lt": "<"}


def bounds(**limits: float) -> dict:
    """``field(metadata=...)`` for numeric bounds: min (>=), gt (>), max (<=), lt (<).

    On a list/tuple field the bounds apply to every element."""
    unknown = set(limits) - set(_BOUND_OPS)
    if unknown:  # a typo here would silently drop a constraint
        raise TypeError(f"unknown bound(s) {sorted(unknown)}; expected {list(_BOUND_OPS)}")
    return limits


# --- errors ------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """An invalid config. ``key`` is the full dotted path (None for file-level problems)."""

    def __init__(self, problem: str, key: str | None = None):
        self.problem, self.key = problem, key
        super().__init__(f"config error at '{key}': {problem}" if key else f"config error: {problem}")


def join_key(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def show_value(value: Any) -> str:
    """A value as the user wrote it (YAML spelling for null and booleans), truncated."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return show_repr(value)


def show_repr(value: Any) -> str:
    """A value as Python writes it, truncated to 80 characters: what Python code (a plugin's) returned."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line parser message, condensed to one line with the position."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(e).split())


MAX_YAML_DEPTH = 100
"""Deepest nesting of mappings and lists a YAML input may have (a config needs a handful of levels): deeper input
would exhaust Python's recursion limit in the parser and in every walk over the values."""

MAX_YAML_VALUES = 100_000
"""Most values a YAML input's aliases may expand to: anchors and aliases (``&a`` / ``*a``) share one node, and a few
lines of nested aliases expand to billions of values ("billion laughs"), which every copy of the config would build."""


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last silently,
    so ``grid: {seed: [0], seed: [1]}`` would quietly drop a list), and so are nesting deeper than
    ``MAX_YAML_DEPTH`` and aliases that expand to more than ``MAX_YAML_VALUES`` values or refer to themselves."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliased = False

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            self._aliased = True
        elif self._depth >= MAX_YAML_DEPTH:  # before the recursion that would end in a RecursionError
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        if self._aliased:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the safe loader reports it below
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {show_value(key)}",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _construct_int(loader: UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    """YAML's int, where Python can read it: past ``sys.get_int_max_str_digits()`` digits (4,300 by default) Python's
    own limit raised a ValueError naming neither the value nor its place."""
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(node.value):,} characters: more digits than Python reads "
            f"({sys.get_int_max_str_digits():,}); no config value needs one", node.start_mark) from None


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _without_digit_separators(resolvers: dict[str, list]) -> dict[str, list]:
    """YAML 1.1's implicit int and float patterns with ``_`` no longer a digit: ``0.5_5`` stays the string it reads
    as (an IcePop band, ``correction.rollout_is_threshold``), not the number 0.55, and ``1_000`` is a string the
    field's check names, as in YAML 1.2 and JSON. (PyYAML's patterns allow ``_`` only inside their character
    classes, each written ``..._]``.)"""
    numeric = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    return {first: [(tag, re.compile(rx.pattern.replace("_]", "]"), rx.flags) if tag in numeric else rx)
                    for tag, rx in entries]
            for first, entries in resolvers.items()}


UniqueKeyLoader.yaml_implicit_resolvers = _without_digit_separators(yaml.SafeLoader.yaml_implicit_resolvers)


def _check_expansion(root: yaml.Node) -> None:
    """A ComposerError if the node graph, aliases expanded, holds more than ``MAX_YAML_VALUES`` values, nests deeper
    than ``MAX_YAML_DEPTH`` or contains itself. Each shared node is walked once (its size and height memoized), so
    the check costs the size of the text, not of the expansion."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height) with aliases expanded
    active: set[int] = set()

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in done:
            values, height = done[key]
        elif key in active:
            raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it (a recursive "
                                              "structure)", node.start_mark)
        else:
            if depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"aliases nest it deeper than {MAX_YAML_DEPTH} levels",
                                                  node.start_mark)
            active.add(key)
            children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                        else node.value if isinstance(node, yaml.SequenceNode) else [])
            values, height = 1, 1
            for child in children:
                child_values, child_height = walk(child, depth + 1)
                values, height = values + child_values, max(height, child_height + 1)
                if values > MAX_YAML_VALUES:
                    raise yaml.composer.ComposerError(None, None, f"aliases expand this value to more "
                                                      f"than {MAX_YAML_VALUES:,} values (an alias bomb?); write the "
                                                      "values out, or use fewer aliases", node.start_mark)
            active.discard(key)
            done[key] = values, height
        if depth + height - 1 > MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"aliases nest it deeper than {MAX_YAML_DEPTH} levels",
                                              node.start_mark)
        return values, height

    walk(root, 1)


def parse_yaml(text: str) -> Any:
    """The one YAML reader of user input (config and sweep files, ``--set`` values, correction configs): safe
    loading with ``UniqueKeyLoader``'s guards. Raises ``yaml.YAMLError`` (every guard's error is one, with its
    position); ``yaml_problem`` condenses it to a line."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def read_text_file(path: Path, name: str, error: type[ValueError] = ValueError) -> str:
    """The text of ``path``, a file of the user's; every way of failing (missing, a directory, not UTF-8 text,
    unreadable) is one ``error`` naming the file as ``name`` says it (e.g. "--prompts file 'p.txt'")."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{name} does not exist") from None
    except IsADirectoryError:
        raise error(f"{name} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise error(f"{name} is not a UTF-8 text file") from None
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None


def read_yaml(path: Path, what: str, origin: str = "") -> Any:
    """The parsed YAML of ``path`` (safe loading, a key given twice is an error); every way of failing is one
    ConfigError naming the file ("{what} '{path}'{origin}")."""
    name = f"{what} '{path}'{origin}"
    text = read_text_file(path, name, ConfigError)
    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {name}: {yaml_problem(e)}") from None


# --- generic checking from type hints ----------------------------------------------------------------------

# YAML 1.1 (PyYAML) reads 1e-4, 3e-3 and 1.0e4 as strings; a float field accepts those spellings.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


NO_ALIASES: Mapping[str, str] = {}


class _Mismatch(Exception):
    """A value that does not fit a type; turned into a ConfigError with the description of what was expected."""


def describe(tp: Any, meta: dict) -> str:
    """'an integer >= 1', 'one of 'a', 'b' or null', 'a list of 2 numbers >= 0 and < 1', ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a, meta) for a in args)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_registered(tp):
        reg = tp.registry
        return f"a registered {reg.what} (one of {', '.join(map(repr, reg.names()))}; {reg.adder} adds one)"
    if origin in (list, tuple):
        count = "" if origin is list or args[-1] is Ellipsis else f"{len(args)} "
        inner = describe(args[0], meta) if args else "value"
        return f"a list of {count}{_plural(inner)}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping of keys"
    base = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, "a value")
    return base + _describe_bounds(meta) if tp in (int, float) else base


def unsupported_hint(tp: Any) -> Any:
    """The part of type hint ``tp`` that ``convert`` cannot check (``pathlib.Path`` in ``Path | None``), or None when
    it checks all of it: asked when an extension's settings register, since ``convert`` meets an unsupported arm
    only when a value reaches it (a null default never does)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (Any, type(None), bool, int, float, str, dict) or origin is Literal or _is_registered(tp):
        return None
    if origin in (typing.Union, types.UnionType, list, tuple, dict):
        return next((bad for bad in (unsupported_hint(a) for a in args if a is not Ellipsis) if bad is not None),
                    None)
    if dataclasses.is_dataclass(tp):
        hints = type_hints(tp)
        return next((bad for bad in (unsupported_hint(hints[f.name]) for f in dataclasses.fields(tp))
                     if bad is not None), None)
    return tp


def _is_registered(tp: Any) -> bool:
    """Whether ``tp`` names a registry (``Registry.name_type``): its values are checked against the registry's names
    when a config is validated, so entries registered after import count."""
    return isinstance(tp, type) and issubclass(tp, RegisteredName)


def _plural(description: str) -> str:
    for article in ("an ", "a "):
        if description.startswith(article):
            noun, _, rest = description[len(article):].partition(" ")
            return f"{noun}s {rest}".rstrip()
    return description


def _describe_bounds(meta: dict) -> str:
    parts = [f"{op} {meta[k]}" for k, op in _BOUND_OPS.items() if k in meta]
    return " " + " and ".join(parts) if parts else ""


def _within_bounds(value: float, meta: dict) -> bool:
    # Written as "not violated" so NaN (which compares False) fails every bound.
    return all((
        "min" not in meta or value >= meta["min"],
        "gt" not in meta or value > meta["gt"],
        "max" not in meta or value <= meta["max"],
        "lt" not in meta or value < meta["lt"],
    ))


def convert(value: Any, tp: Any, key: str, meta: dict, aliases: Mapping[str, str] = NO_ALIASES) -> Any:
    """Check ``value`` against type hint ``tp`` and return it in the schema's form (floats, tuples, dataclasses).

    ``aliases``: other spellings of Literal values (spelling -> value), accepted and stored as the value.
    Raises ConfigError at ``key`` (or deeper, for nested sections and list elements)."""
    try:
        return _convert_inner(value, tp, key, meta, aliases)
    except _Mismatch:
        raise ConfigError(f"expected {describe(tp, meta)}{_aliases_note(tp, aliases)}, got {show_value(value)}",
                          key) from None


def _aliases_note(tp: Any, aliases: Mapping[str, str]) -> str:
    """The note `` (also spelled 'fp32', 'bf16')`` for a type whose Literal values have other spellings
    (``aliases``), so an error shows every accepted spelling; "" for other types."""
    arms = [tp, *typing.get_args(tp)]
    values = {v for arm in arms if typing.get_origin(arm) is Literal for v in typing.get_args(arm)}
    values |= {v for arm in arms if _is_registered(arm) for v in arm.registry.names()}
    spellings = [alias for alias, value in aliases.items() if value in values]
    return f" (also spelled {', '.join(map(repr, spellings))})" if spellings else ""


def _convert_inner(value: Any, tp: Any, key: str, meta: dict, aliases: Mapping[str, str]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # X | None with a non-null value: X's own message is more precise
            return _convert_inner(value, arms[0], key, meta, aliases)
        for arm in arms:
            try:
                return convert(value, arm, key, meta, aliases)
            except ConfigError:
                continue
        raise _Mismatch
    if origin is Literal:
        # Compare type as well: True == 1, so Literal[1] must not accept true.
        if any(value == a and type(value) is type(a) for a in args):
            return value
        if isinstance(value, str) and aliases.get(value) in args:
            return aliases[value]
        raise _Mismatch
    if _is_registered(tp):
        if isinstance(value, str) and value in tp.registry:
            return str(value)
        if isinstance(value, str) and aliases.get(value) in tp.registry:
            return aliases[value]
        raise _Mismatch
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            value = plain(value)
        if value is None:  # a section left empty in YAML ("model:") means all defaults
            value = {}
        if not isinstance(value, dict):
            raise _Mismatch
        return build(tp, value, key, aliases)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch
            item_types = args
        else:
            item_types = (args[0] if args else Any,) * len(value)
        items = [convert(v, t, f"{key}[{i}]", meta, aliases) for i, (v, t) in enumerate(zip(value, item_types))]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        value_type = args[1] if args else Any
        return {k: convert(v, value_type, join_key(key, k), {}, aliases) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Mismatch
    elif tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Mismatch
        try:
            value = float(value)
        except OverflowError:  # an integer literal beyond float's range: no finite float holds it
            raise ConfigError(f"expected a finite number{_describe_bounds(meta)}, got {show_value(value)}",
                              key) from None
        if not math.isfinite(value):  # YAML's .inf and .nan: no setting means infinity (null turns a knob off)
            raise ConfigError(f"expected a finite number{_describe_bounds(meta)}, got {show_value(value)}", key)
    elif tp is str:
        if isinstance(value, os.PathLike):  # Python callers may pass a Path for a directory
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _Mismatch
        return value
    else:
        raise TypeError(f"config schema at '{key}': unsupported type hint {tp!r}")
    if not _within_bounds(value, meta):
        raise _Mismatch
    return value


def build(cls: type, data: dict, prefix: str = "", aliases: Mapping[str, str] = NO_ALIASES) -> Any:
    """Build dataclass ``cls`` from mapping ``data``: unknown keys, per-field types and bounds, then ``check()``.

    ``prefix``: the dotted key of ``data`` (errors name full keys); ``aliases``: as for ``convert``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            raise ConfigError(f"unknown key (known keys: {', '.join(fields)})", join_key(prefix, k))
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:  # a field without a default (inject.target.value) must be given
        if name not in data:
            given = ", ".join(repr(k) for k in data) or "nothing"
            raise ConfigError(f"required key missing: '{prefix}' needs {' and '.join(map(repr, required))} (it "
                              f"has no default; got {given})", join_key(prefix, name))
    hints = type_hints(cls)
    kwargs = {name: convert(data[name], hints[name], join_key(prefix, name), dict(f.metadata), aliases)
              for name, f in fields.items() if name in data}
    obj = cls(**kwargs)
    # the section's own check, then each mounted settings class's on its keys' values (vexact.registry)
    checks = [getattr(obj, "check", None)]
    checks += [getattr(s(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(s)}), "check", None)
               for s in settings_classes(cls)]
    for check in checks:
        if check is None:
            continue
        try:
            check()
        except ConfigError as e:  # check() names keys relative to its section
            raise ConfigError(e.problem, join_key(prefix, e.key) if e.key else prefix or None) from None
    return obj


def plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, recursively (YAML/JSON-friendly, field order kept)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


