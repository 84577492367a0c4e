"""Extensions from outside the package, on the command line: the ``plugins:`` key and the ``vexact.plugins`` group.

An extension registers itself when its module is imported (``vexact.register_task``, ``register_inject_mode``,
``register_lr_schedule``, ...). From Python that is an ``import``; ``vexact run``, ``vexact sweep`` (its worker
processes and Ray tasks) and ``vexact report`` are told which modules to import in one of two ways:

* ``plugins: [my_package.my_modes, my_tasks]`` at the top of a run config or a sweep file: importable module names,
  imported before the config is validated, so a name they register is accepted like a built-in one. The key is
  saved in the run's config.yaml, so a resumed run, each sweep worker (which rebuilds its point's config from that
  mapping) and a report of the run import the same modules. ``--set plugins=[...]`` works too.
* the entry-point group ``vexact.plugins`` of installed distributions (``[project.entry-points."vexact.plugins"]``
  in a plugin's pyproject.toml): each entry is a module (imported) or a function (called with no arguments), loaded
  once per process, the first time a config is validated. An installed plugin needs no ``plugins:`` key.

A module that cannot be imported is one ``ConfigError`` at ``plugins`` naming the module and the import error, before
any work; an entry point that fails to load names the distribution and the entry point.

The built-in extensions are registered the same way: the ``vexact.rl`` package imports the modules of ``vexact.rl``
that register them (``vexact.rl.BUILTINS``), so the config schema itself imports none of them. A built-in extension
that lives in a higher layer (``vexact.integrations.vllm_rollout``: ``rollout.engine: vllm``) is an entry point of
vexact's own pyproject.toml in the ``vexact.plugins`` group, loaded as an installed plugin's is: naming it in
``vexact.rl`` would make ``import vexact.rl`` import the layer above it.

Layer: this module imports only the validator's error type (``vexact.rl.validate``); the config calls it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Iterable

from .validate import ConfigError, show_value

__all__ = ["ENTRY_POINT_GROUP", "load_entry_points", "load_plugins"]

ENTRY_POINT_GROUP = "vexact.plugins"
"""The entry-point group whose entries every vexact process loads before it validates a config."""

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_entry_points_loaded = False


def load_entry_points() -> None:
    """Load every entry point of the group ``vexact.plugins`` (once per process; a later call does nothing)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(entry.dist, "name", None) or "an unnamed distribution"
        try:
            loaded = entry.load()
            if inspect.isfunction(loaded):
                loaded()
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- any failure of outside code is reported the same way
            raise ConfigError(f"the {ENTRY_POINT_GROUP} entry point {entry.name!r} = {entry.value!r} of {dist} "
                              f"failed to load: {_failure(e)}") from None
    _entry_points_loaded = True


def load_plugins(names: Iterable[str], key: str = "plugins") -> None:
    """Import the entry points' plugins (once) and the modules ``names`` (a run's or sweep's ``plugins``), in order.

    Importing a module twice is Python's no-op, so calling this for every config costs nothing after the first.
    ``key`` names the config key in errors (``plugins``; a sweep adds where it came from)."""
    load_entry_points()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            raise ConfigError(f"expected an importable module name (dotted identifiers, e.g. my_package.modes), got "
                              f"{show_value(name)}", f"{key}[{i}]")
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"plugin {name!r} cannot be imported: {type(e).__name__}: {e} (is it installed, or on "
                              "PYTHONPATH?)", f"{key}[{i}]") from None
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the plugin's own code failed while it registered
            raise ConfigError(f"plugin {name!r} failed while being imported: {_failure(e)}", f"{key}[{i}]") from None


def _failure(e: BaseException) -> str:
    """How outside code failed, for one error line: its exception, or the ``sys.exit`` it called (which would
    otherwise end vexact with the plugin's exit code and no word)."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"
