"""Live views of a run besides metrics.jsonl: TensorBoard event files and W&B runs (``logging.backends``).

metrics.jsonl stays the record -- resume, ``vexact report`` and collapse detection read it, and it is always
written. A backend is a copy of its numbers: it gets each step's scalars under the JSONL's own keys and step, after
the line is written and fsynced, and it never feeds anything back, so no computed value depends on it. Its code is
called through ``vexact.registry.call_entry``: a raise, or an ``open`` that returns no writer, is one error naming the
backend; a writer that fails to close is reported only once every other view is closed and the run's summary.json
is written (``Trainer.run``).

Both live under the run directory (``tensorboard/``, ``wandb/``) and are rebuilt from metrics.jsonl whenever a
writer opens (a fresh run, a resume): the kept rows are replayed before the run goes on. So after a resume or a
kill that lost buffered events they hold exactly what metrics.jsonl holds, never a step twice:

- TensorBoard: the old event files are deleted and the new file starts with ``purge_step=0`` (a SessionLog START
  at step 0), so a TensorBoard that is already showing the old files drops them too instead of plotting steps
  twice. Values are stored as float32 (TensorBoard's scalar type). The old files go only once every backend has
  opened and the kept rows are replayed: a backend that cannot open (W&B refusing ``wandb_project`` or
  ``wandb_mode``: a ConfigError naming the key) leaves the old views as they were.
- W&B: each session (start, each resume) is a new W&B run named after the run, holding all steps so far; the
  newest is complete. ``wandb_mode: offline`` (the default) needs no network or account: ``wandb sync`` uploads
  ``wandb/offline-run-*`` later.

The packages are extras (``pip install 'vexact[tensorboard]'``, ``'vexact[wandb]'``). A backend whose package is
missing is a ConfigError with that pip line when the run opens its log -- before the first step and before
metrics.jsonl exists, so the same command works once the extra is installed. It is not a load-time check: a
config.yaml stays readable (by a report, say) on a machine without the extras.

Each backend is one ``LogBackendKind`` registered in ``LOG_BACKENDS`` (``register_log_backend`` adds one): its name
in ``logging.backends``, the package it needs, its own settings (``wandb_project``, ``wandb_mode``: ``logging.*``
keys) and how it opens a writer (a ``LogBackend``: ``vexact.records.runlog``, whose ``MetricsWriter`` feeds it).
``live_views(run_dir, cfg)`` is what a run hands that writer: the run's config stays up here, out of the file layer.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from ..records.metrics_log import scalars
from ..records.runlog import LiveViews, LogBackend, close_views
from ..registry import PluginCodeError, a_type, call_entry, entry_code, install_line
from .config import ConfigError
from .registries import LOG_BACKENDS

if TYPE_CHECKING:
    from .config_schema import RunConfig

__all__ = ["LOG_BACKENDS", "TENSORBOARD_DIR", "WANDB_DIR", "LogBackendKind", "NamedView", "WandbSettings",
           "live_views", "missing_package", "open_backends", "register_log_backend"]

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # wandb.init(dir=run_dir) writes run_dir/wandb/
EVENT_FILES = "events.out.tfevents.*"  # the names of TensorBoard's event files


class LogBackendKind:
    """One ``logging.backends`` entry: ``package``, the module it imports (None: nothing to install) and ``install``,
    the line that installs it (empty: ``pip install PACKAGE``; a built-in names its extra); ``settings``, a
    dataclass of its own ``logging.*`` keys; ``open(run_dir, cfg)``, its writer, a ``LogBackend``
    (``write(step, values)``, ``close()``; None for ``jsonl``, metrics.jsonl itself, which the run log writes)."""

    name: ClassVar[str] = ""
    package: ClassVar[str | None] = None
    install: ClassVar[str] = ""
    settings: ClassVar[type | None] = None

    def open(self, run_dir: Path, cfg: RunConfig) -> LogBackend | None:
        raise NotImplementedError


def register_log_backend(kind: LogBackendKind, replace: bool = False) -> LogBackendKind:
    """Register a log backend (a ``LogBackendKind`` instance) under its ``name``: ``logging.backends: [jsonl, NAME]``
    selects it. A name already taken is an error unless ``replace``."""
    if not isinstance(kind, LogBackendKind):
        raise TypeError(f"register_log_backend needs a LogBackendKind instance, got {kind!r}")
    return LOG_BACKENDS.add(kind.name, kind, replace=replace)


def missing_package(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its package is not installed, with its install line), or None.

    ``find_spec`` only looks the package up: the check costs no import."""
    kind = LOG_BACKENDS[backend] if backend in LOG_BACKENDS else None
    if kind is None or kind.package is None or importlib.util.find_spec(kind.package) is not None:
        return None
    return (f"backend {backend!r} needs the {kind.package!r} package, which is not installed: "
            f"{install_line(kind.package, kind.install)}")


class TensorBoardBackend:
    """torch's SummaryWriter into ``run_dir/tensorboard``, flushed every step (a live view that lags is no view).

    The old event files (the view before this session, rebuilt from metrics.jsonl: see the module doc) go only in
    ``replace_previous``, once every backend has opened and replayed the history (``open_backends``): a backend
    that fails to open (W&B refusing its settings) then leaves the view as it was -- closed before that, this one
    removes its own new file instead, whose purge at step 0 would otherwise hide the old steps."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._created_dir = not log_dir.exists()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_dir = log_dir
        self._previous = set(log_dir.glob(EVENT_FILES))
        self._writer = SummaryWriter(str(log_dir), purge_step=0)
        self._own = set(log_dir.glob(EVENT_FILES)) - self._previous  # the file SummaryWriter just created
        self._replaced = False

    def replace_previous(self) -> None:
        """Delete the event files that were there before this writer opened: its own file replaces them."""
        for old in self._previous:
            old.unlink(missing_ok=True)
        self._replaced = True

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        if not self._replaced:  # opening the views failed: leave the old view as it was
            for own in self._own:
                own.unlink(missing_ok=True)
            if self._created_dir and not any(self._log_dir.iterdir()):
                self._log_dir.rmdir()


class WandbBackend:
    """One W&B run per session, in ``run_dir/wandb``; console capture, code and git saving off (they would wrap
    the progress bar's stdout and copy files nobody asked for)."""

    def __init__(self, run_dir: Path, cfg: RunConfig):
        import wandb

        project, mode = cfg.logging.wandb_project, cfg.logging.wandb_mode
        try:  # W&B checks the project name as its settings take it: a refusal there is that key's
            settings = wandb.Settings(project=project, console="off", silent=True, save_code=False,
                                      disable_git=True, disable_job_creation=True)
        except wandb.errors.Error as e:
            raise ConfigError(f"W&B refuses the project name: {_first_line(e)}",
                              "logging.wandb_project") from None
        try:
            self._run = wandb.init(project=project, name=cfg.name, dir=str(run_dir), mode=mode,
                                   config=cfg.to_dict(), reinit="create_new", settings=settings)
        except wandb.errors.Error as e:  # no API key or no connection (online), ...
            hint = "; wandb_mode: offline needs no account or network" if mode != "offline" else ""
            raise ConfigError(f"W&B could not start an {mode} run: {_first_line(e)}{hint}",
                              "logging.wandb_mode") from None

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def _first_line(err: BaseException) -> str:
    """An exception's message as a clause of ours: its first line, without the closing full stop."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")


class Jsonl(LogBackendKind):
    """``jsonl``: metrics.jsonl, the record (required: resume and report read it)."""

    name = "jsonl"

    def open(self, run_dir: Path, cfg: RunConfig) -> LogBackend | None:
        return None  # the run log writes it


class TensorBoard(LogBackendKind):
    """``tensorboard``: TensorBoard event files in ``tensorboard/``."""

    name = "tensorboard"
    package = "tensorboard"
    install = "pip install 'vexact[tensorboard]'"

    def open(self, run_dir: Path, cfg: RunConfig) -> LogBackend:
        return TensorBoardBackend(run_dir / TENSORBOARD_DIR)


WandbMode = Literal["offline", "online"]
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)
"""The ``wandb`` backend's modes (``logging.wandb_mode``, ``LiveMonitor(wandb_mode=...)``)."""


@dataclass
class WandbSettings:
    """The ``wandb`` backend's settings (``logging`` section)."""

    wandb_project: str = "vexact"  # W&B project of the wandb backend
    wandb_mode: WandbMode = "offline"  # offline: no network or account; `wandb sync` later


class Wandb(LogBackendKind):
    """``wandb``: one W&B run per session in ``wandb/`` (offline by default)."""

    name = "wandb"
    package = "wandb"
    install = "pip install 'vexact[wandb]'"
    settings = WandbSettings

    def open(self, run_dir: Path, cfg: RunConfig) -> LogBackend:
        return WandbBackend(run_dir, cfg)


for _kind in (Jsonl(), TensorBoard(), Wandb()):
    register_log_backend(_kind)

PACKAGES = {name: kind.package for name, kind in LOG_BACKENDS.items() if kind.package is not None}
"""The built-in backends that need a package -> the module each imports (``LOG_BACKENDS`` has later ones too)."""


def open_backends(run_dir: Path, cfg: RunConfig, history: Iterable[dict[str, Any]]) -> list[LogBackend]:
    """Open ``cfg.logging.backends`` other than jsonl (which the caller writes) and replay ``history``, the rows
    already in metrics.jsonl, into each. A missing package is a ConfigError at ``logging.backends`` with the pip
    line, raised before anything is opened; a backend that refuses its settings (a ConfigError naming the key)
    closes the ones already open, and TensorBoard's old event files stay until every backend has opened and
    replayed. Any other raise of a backend's code, or an ``open`` that returns no writer (``NamedView``), is one
    ``PluginCodeError`` naming it. The writers come back as ``NamedView``s: their raises name the backend too."""
    run_dir = Path(run_dir)
    names = [b for b in cfg.logging.backends if b != "jsonl"]
    for name in names:
        problem = missing_package(name)
        if problem:
            raise ConfigError(problem, "logging.backends")
    opened: list[NamedView] = []
    try:
        for name in names:
            if name not in LOG_BACKENDS:
                raise ConfigError(LOG_BACKENDS.unknown(name), "logging.backends")
            try:
                writer = call_entry(LOG_BACKENDS.what, name, "open", LOG_BACKENDS[name].open, run_dir, cfg)
            except PluginCodeError as e:
                if isinstance(e.__cause__, ConfigError):  # the backend refusing a setting: named at its key
                    raise e.__cause__ from None
                raise
            if writer is not None:
                opened.append(NamedView(name, writer))
        rows = list(history)
        for backend in opened:
            for row in rows:
                backend.write(int(row["step"]), scalars(row))
        # only now may a view drop what it showed before: a failure above leaves every old view as it was
        for backend in opened:
            if isinstance(backend.writer, TensorBoardBackend):
                backend.writer.replace_previous()
    except BaseException:
        close_views(opened)  # the error that stopped the open is the one to report
        raise
    return opened


class NamedView:
    """The writer a backend's ``open`` returned (a ``LogBackend``: ``write`` and ``close``, checked here), called
    through ``call_entry``: a raise in it is one ``PluginCodeError`` naming ``log backend 'NAME'`` and the call."""

    def __init__(self, name: str, writer: object):
        if not all(callable(getattr(writer, f, None)) for f in ("write", "close")):
            raise PluginCodeError(f"{entry_code(LOG_BACKENDS.what, name, 'open')} returned {a_type(writer)}: "
                                  "expected a writer with write(step, values) and close(), or None")
        self.name, self.writer = name, writer

    def write(self, step: int, values: dict[str, float]) -> None:
        call_entry(LOG_BACKENDS.what, self.name, "write", self.writer.write, step, values)

    def close(self) -> None:
        call_entry(LOG_BACKENDS.what, self.name, "close", self.writer.close)


def live_views(run_dir: Path, cfg: RunConfig) -> LiveViews | None:
    """What ``MetricsWriter(live_views=...)`` calls to open ``cfg.logging.backends`` besides jsonl in ``run_dir``
    (``open_backends``); None when jsonl is the only one, so that metrics.jsonl is not read back for nothing."""
    if not any(name != "jsonl" for name in cfg.logging.backends):
        return None
    return functools.partial(open_backends, Path(run_dir), cfg)
