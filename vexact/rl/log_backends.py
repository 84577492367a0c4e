"""Live views of a run besides metrics.jsonl: TensorBoard event files and W&B runs (``logging.backends``).

metrics.jsonl stays the record -- resume, ``vexact report`` and collapse detection read it, and it is always
written. A backend is a copy of its numbers: it gets each step's scalars under the JSONL's own keys and step, after
the line is written and fsynced, and it never feeds anything back, so no computed value depends on it.

Both live under the run directory (``tensorboard/``, ``wandb/``) and are rebuilt from metrics.jsonl whenever a
writer opens (a fresh run, a resume): the kept rows are replayed before the run goes on. So after a resume or a
kill that lost buffered events they hold exactly what metrics.jsonl holds, never a step twice:

- TensorBoard: the old event files are deleted and the new file starts with ``purge_step=0`` (a SessionLog START
  at step 0), so a TensorBoard that is already showing the old files drops them too instead of plotting steps
  twice. Values are stored as float32 (TensorBoard's scalar type).
- W&B: each session (start, each resume) is a new W&B run named after the run, holding all steps so far; the
  newest is complete. ``wandb_mode: offline`` (the default) needs no network or account: ``wandb sync`` uploads
  ``wandb/offline-run-*`` later.

The packages are extras (``pip install 'vexact[tensorboard]'``, ``'vexact[wandb]'``). A backend whose package is
missing is a ConfigError with that pip line when the run opens its log -- before the first step and before
metrics.jsonl exists, so the same command works once the extra is installed. It is not a load-time check: a
config.yaml stays readable (by a report, say) on a machine without the extras.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .config import ConfigError
from .metrics_log import non_finite_value

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = ["TENSORBOARD_DIR", "WANDB_DIR", "LogBackend", "missing_package", "open_backends", "scalars"]

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # wandb.init(dir=run_dir) writes run_dir/wandb/

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Backend -> the module it imports; the extra of the same name installs it."""



class LogBackend(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_package(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its package is not installed, with the pip line), or None.

    ``find_spec`` only looks the package up: the check costs no import."""
    module = PACKAGES.get(backend)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"backend {backend!r} needs the {module!r} package, which is not installed: pip install 'vexact[{backend}]'"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics row under their JSONL keys, as floats; ``step`` (the x axis) and anything
    non-numeric are left out. NaN/Inf are kept -- a diverged run is an outcome to see -- whether they come as
    floats (a live step) or as json_safe's strings "nan"/"inf"/"-inf" (a row read back from metrics.jsonl), so a
    replayed row and a live one give the same values."""
    out = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, str) and non_finite_value(value) is not None:  # metrics_log's one table
            out[key] = non_finite_value(value)
    return out


class TensorBoardBackend:
    """torch's SummaryWriter into ``run_dir/tensorboard``, flushed every step (a live view that lags is no view)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("events.out.tfevents.*"):  # rebuilt from metrics.jsonl below; see the module doc
            old.unlink()
        self._writer = SummaryWriter(str(log_dir), purge_step=0)

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """One W&B run per session, in ``run_dir/wandb``; console capture, code and git saving off (they would wrap
    the progress bar's stdout and copy files nobody asked for)."""

    def __init__(self, run_dir: Path, cfg: RunConfig):
        import wandb

        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  disable_job_creation=True)
        self._run = wandb.init(project=cfg.logging.wandb_project, name=cfg.name, dir=str(run_dir),
                               mode=cfg.logging.wandb_mode, config=cfg.to_dict(), reinit="create_new",
                               settings=settings)

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def open_backends(run_dir: Path, cfg: RunConfig, history: Iterable[dict[str, Any]]) -> list[LogBackend]:
    """Open ``cfg.logging.backends`` other than jsonl (which the caller writes) and replay ``history``, the rows
    already in metrics.jsonl, into each. A missing package is a ConfigError at ``logging.backends`` with the pip
    line, raised before anything is opened."""
    run_dir = Path(run_dir)
    names = [b for b in cfg.logging.backends if b != "jsonl"]
    for name in names:
        problem = missing_package(name)
        if problem:
            raise ConfigError(problem, "logging.backends")
    opened: list[LogBackend] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardBackend(run_dir / TENSORBOARD_DIR))
            elif name == "wandb":
                opened.append(WandbBackend(run_dir, cfg))
            else:
                raise ConfigError(f"unknown backend {name!r}; expected jsonl, tensorboard or wandb", "logging.backends")
        rows = list(history)
        for backend in opened:
            for row in rows:
                backend.write(int(row["step"]), scalars(row))
    except BaseException:
        for backend in opened:
            backend.close()
        raise
    return opened
