"""Named registries: one per extension point (tasks, injection modes, correction methods, LR schedules).

Why: an extension point whose names are typed out in several places (a config ``Literal``, a CLI ``choices``, a
docs table, an ``if name == ...`` chain) makes every addition a change to several files, and a name registered
after import is still refused. A ``Registry`` is the one source: config types, validation and the generated
documentation tables all read it, and they read it *when they run* -- so an entry registered from outside the
package (``vexact.register_task``, ``vexact.register_inject_mode``) is accepted by the config like a built-in.

The config schema names a registry by its ``name_type``: a ``str`` subclass that the generic validator
(``vexact.rl.validate``) recognises and checks against the registry's names at validation time.

This module imports nothing of vexact: every layer may use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Generic, TypeVar

__all__ = ["RegisteredName", "Registry"]

T = TypeVar("T")


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
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Unregister ``name`` (tests register entries for one test and take them out again)."""
        if name not in self._entries:
            raise KeyError(f"{self.what} {name!r} is not registered")
        return self._entries.pop(name)

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
