"""Named registries: one per extension point (tasks, injection modes, correction methods, LR schedules).

Why: an extension point whose names are typed out in several places (a config ``Literal``, a CLI ``choices``, a
docs table, an ``if name == ...`` chain) makes every addition a change to several files, and a name registered
after import is still refused. A ``Registry`` is the one source: config types, validation and the generated
documentation tables all read it, and they read it *when they run* -- so an entry registered from outside the
package (``vexact.register_task``, ``vexact.register_inject_mode``) is accepted by the config like a built-in.

The config schema names a registry by its ``name_type``: a ``str`` subclass that the generic validator
(``vexact.rl.validate``) recognises and checks against the registry's names at validation time.

**Settings travel with the entry.** An entry may declare ``settings``: a dataclass of the options only it reads
(the ``precision`` injection mode's format and sites, the ``step`` schedule's ``gamma``). Registering the entry
mounts those fields, by name, into the config section that the registry's key lives in (``inject`` for
``inject.mode``; the settings class may name another with a ``section`` class variable, as the ``surge`` task's
warm-start option does), so ``inject.sites`` is a config key like any other: typed, bounded, validated, saved,
settable with ``--set`` and listed in the config reference, with no line of the config schema written for it.
Unregistering the entry takes its fields out again. Two declarations of one key by different classes are refused
(entries may share one settings class: the correction methods that take a threshold). The config schema marks
the sections that take settings with ``extensible("inject")``; settings registered before the schema is imported
wait for it. After the section's fields are checked, each settings class's own ``check()`` runs on its values, with
errors at keys relative to the section. A settings class with ``requires_owner = True`` may only leave its defaults
when its entry is the one the config selects (``warm_start.trace_fraction`` needs ``task.name: surge``).

This module imports nothing of vexact: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["Mount", "PluginCodeError", "RegisteredName", "Registry", "a_type", "call_entry", "declare_settings",
           "extensible", "install_line", "mounts", "settings_classes", "type_hints", "withdraw_settings"]

T = TypeVar("T")


@functools.cache
def type_hints(cls: type) -> types.MappingProxyType[str, Any]:
    """``typing.get_type_hints(cls)``, read-only, worked out once per class: config loading asks for a section's
    hints at every key and every sweep point (a 576-point sweep spent 8 of its 14 s evaluating the same hints)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


class PluginCodeError(ValueError):
    """A registered entry's own code (a plugin's, maybe) raised, or returned what its contract does not allow. The
    message names the entry (``injection mode 'favour_token'``), its function and what was wrong; a ValueError, so
    the CLI prints it as one error line, not a traceback ending somewhere in the plugin."""


def a_type(value: object) -> str:
    """``value``'s type with its article, for messages about what an entry returned: ``a dict``, ``an int``,
    ``None``."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def entry_code(what: str, name: str, function: str) -> str:
    """How an error names an entry's code: ``advantage estimator 'my_adv' (compute)``."""
    return f"{what} {name!r} ({function})"


def install_line(package: str, install: str = "") -> str:
    """The line that installs ``package``, the module an entry needs (a rollout engine's, a log backend's), for the
    error saying it is missing: the entry's own ``install`` line (a built-in names its extra), else
    ``pip install PACKAGE``."""
    return install or f"pip install {package}"


def call_entry(what: str, name: str, function: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, where ``call`` is the code of the entry ``name`` of a registry of ``what`` (its
    ``Registry.what``): the one way vexact calls an extension's code. An exception from it is one
    ``PluginCodeError`` naming the entry and ``function``, chained to the original; a ``PluginCodeError`` raised
    inside (a check of a nested call) passes unchanged. What the call returns is the caller's to check, with
    ``PluginCodeError(f"{entry_code(...)} returned ...")``."""
    try:
        return call(*args, **kwargs)
    except PluginCodeError:
        raise
    except Exception as e:
        raise PluginCodeError(f"{entry_code(what, name, function)} raised {type(e).__name__}: {e}") from e


class RegisteredName(str):
    """Type hint for a config field whose value must be a name in ``registry`` (checked at validation, not when the
    schema is defined). Subclasses are made by ``Registry.name_type``; values are stored as plain ``str``."""

    registry: ClassVar[Registry]


class Registry(Generic[T]):
    """Name -> entry, in registration order (the order documentation lists them).

    ``what``: the kind of entry in messages ("task", "injection mode"); ``key``: the config key that names an entry
    ("task.name"); ``adder``: the public function that registers one, named in the error for an unknown name."""

    def __init__(self, what: str, key: str, adder: str):
        self.what, self.key, self.adder = what, key, adder
        self.section = key.rpartition(".")[0]  # where an entry's settings are mounted unless they name a section
        self._entries: dict[str, T] = {}
        self.name_type: type[RegisteredName] = type(
            "".join(w.capitalize() for w in what.split()) + "Name", (RegisteredName,),
            {"registry": self, "__doc__": f"A registered {what} name (the value of ``{key}``).",
             "__module__": __name__})

    def add(self, name: str, entry: T, replace: bool = False) -> T:
        """Register ``entry`` under ``name``; a name already taken is an error unless ``replace``."""
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"a {self.what} needs a non-empty name without spaces, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered; pass replace=True to replace it")
        settings = settings_of(entry)
        replaced = self._entries.get(name)
        if replaced is not None:
            self._withdraw(name)
        if settings is not None:
            try:
                declare_settings(self.settings_section(settings), settings, self.owner(name))
            except ValueError:
                if replaced is not None:  # leave the registry as it was
                    self._declare(name, replaced)
                raise
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Unregister ``name`` (tests register entries for one test and take them out again); its settings' keys
        leave the config unless another entry declares them too."""
        if name not in self._entries:
            raise KeyError(f"{self.what} {name!r} is not registered")
        self._withdraw(name)
        return self._entries.pop(name)

    def owner(self, name: str) -> str:
        """How messages name entry ``name``: "injection mode 'precision'"."""
        return f"{self.what} {name!r}"

    def settings_section(self, settings: type) -> str:
        """The config section an entry's settings class is mounted into: its ``section``, else the registry's."""
        return getattr(settings, "section", None) or self.section

    def _declare(self, name: str, entry: object) -> None:
        settings = settings_of(entry)
        if settings is not None:
            declare_settings(self.settings_section(settings), settings, self.owner(name))

    def _withdraw(self, name: str) -> None:
        settings = settings_of(self._entries[name])
        if settings is not None:
            withdraw_settings(self.settings_section(settings), settings, self.owner(name))

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered: what was asked, what exists, how to add one."""
        return f"unknown {self.what} {name!r}; registered: {', '.join(self._entries)} ({self.adder} adds one)"

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        """The registered names now (a later registration adds to the next call's answer)."""
        return tuple(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"


# --- settings mounted into config sections ------------------------------------------------------------------


def settings_of(entry: object) -> type | None:
    """The settings dataclass an entry declares (its ``settings`` attribute), or None; anything else is an error."""
    settings = getattr(entry, "settings", None)
    if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise TypeError(f"settings must be a dataclass (its fields are the config keys), got {settings!r}")
    return settings


@dataclasses.dataclass
class Mount:
    """One config key an entry's settings brought into a section: the declaring ``Field`` (its identity is the
    declaration: entries sharing a settings class share it), its resolved type, the class whose source documents
    it, and who declared it: (entry, its settings class) pairs."""

    field: dataclasses.Field
    type: Any
    declared_in: type
    owners: list[tuple[str, type]]

    @property
    def owner_names(self) -> list[str]:
        return list(dict.fromkeys(owner for owner, _ in self.owners))


_SECTIONS: dict[str, type] = {}  # section name -> the config's dataclass (extensible)
_CORE: dict[str, list[tuple[dataclasses.Field, Any]]] = {}  # section name -> its own fields, with resolved types
_MOUNTS: dict[str, dict[str, Mount]] = {}  # section name -> key -> its mount, in mount order


def extensible(name: str) -> Callable[[type], type]:
    """Class decorator for a config section (a dataclass) that entries' settings are mounted into, as ``name``."""

    def attach(cls: type) -> type:
        if name in _SECTIONS:
            raise ValueError(f"config section {name!r} is already attached ({_SECTIONS[name].__qualname__})")
        hints = type_hints(cls)
        _CORE[name] = [(f, hints[f.name]) for f in dataclasses.fields(cls)]
        _SECTIONS[name] = cls
        if _MOUNTS.get(name):  # settings registered before the schema was imported
            _rebuild(name)
        return cls

    return attach


def declare_settings(section: str, settings: type, owner: str) -> None:
    """Mount the fields of dataclass ``settings`` into config section ``section`` for ``owner`` (an entry)."""
    mounted = _MOUNTS.setdefault(section, {})
    core = {f.name for f, _ in _CORE.get(section, ())}
    hints = type_hints(settings)
    for f in dataclasses.fields(settings):
        if f.name in core:
            raise ValueError(f"{owner} declares the setting '{section}.{f.name}', a key of the section itself")
        other = mounted.get(f.name)
        if other is not None and other.field is not f:
            raise ValueError(f"{owner} declares the setting '{section}.{f.name}', which "
                             f"{', '.join(other.owner_names)} declared already; give it another name (or share one "
                             "settings class)")
    changed = False
    for f in dataclasses.fields(settings):
        if f.name not in mounted:
            declared_in = next(c for c in settings.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
            mounted[f.name] = Mount(f, hints[f.name], declared_in, [])
            changed = True
        mounted[f.name].owners.append((owner, settings))
    if changed and section in _SECTIONS:
        _rebuild(section)


def withdraw_settings(section: str, settings: type, owner: str) -> None:
    """Undo ``declare_settings``: keys no other entry declares leave the section."""
    mounted = _MOUNTS.get(section, {})
    changed = False
    for f in dataclasses.fields(settings):
        mount = mounted.get(f.name)
        if mount is None or (owner, settings) not in mount.owners:
            continue
        mount.owners.remove((owner, settings))
        if not mount.owners:
            del mounted[f.name]
            changed = True
    if changed and section in _SECTIONS:
        _rebuild(section)


def mounts(cls: type) -> dict[str, Mount]:
    """The keys entries' settings mounted into config section class ``cls`` ({} for any other class)."""
    name = next((n for n, c in _SECTIONS.items() if c is cls), None)
    return dict(_MOUNTS.get(name, {})) if name is not None else {}


def settings_classes(cls: type) -> list[type]:
    """The settings classes mounted into section class ``cls``, each once, in mount order."""
    found: list[type] = []
    for mount in mounts(cls).values():
        found += [settings for _, settings in mount.owners if settings not in found]
    return found


_GENERATED = ("__init__", "__repr__", "__eq__", "__match_args__", "__hash__")


def _rebuild(section: str) -> None:
    """Re-make the section's dataclass in place with its own fields and the mounted ones (in that order): the same
    class object, so every reference to it (type hints, ``isinstance``, imports) sees the new keys. ``dataclass``
    keeps the methods a class defines itself, so the generated ones are removed first."""
    cls = _SECTIONS[section]
    for name in (*_GENERATED, *(f.name for f in dataclasses.fields(cls))):  # a withdrawn default must not linger
        if name in cls.__dict__:
            delattr(cls, name)
    annotations: dict[str, Any] = {}
    for f, tp in _CORE[section]:
        annotations[f.name] = tp
        setattr(cls, f.name, _copy(f, f.metadata))
    for name, mount in _MOUNTS.get(section, {}).items():
        annotations[name] = mount.type
        setattr(cls, name, _copy(mount.field, {**mount.field.metadata, "declared_in": mount.declared_in}))
    cls.__annotations__ = annotations
    dataclasses.dataclass(cls)
    type_hints.cache_clear()  # the class is the same object with other fields


def _copy(f: dataclasses.Field, metadata: Any) -> Any:
    return dataclasses.field(default=f.default, default_factory=f.default_factory, init=f.init, repr=f.repr,
                             hash=f.hash, compare=f.compare, metadata=dict(metadata), kw_only=f.kw_only)
