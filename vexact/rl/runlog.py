"""A run's output directory: config.yaml, metrics.jsonl, summary.json, checkpoints.

Everything is written so that an interrupt loses nothing finished: metric lines are
appended and flushed each step, JSON/weights are written to a temp file and renamed.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CHECKPOINT = "checkpoint.safetensors"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"


def json_safe(value: Any) -> Any:
    """NaN/Inf are legal outcomes (a diverged run) but not legal JSON: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


LOCK_FILE = ".lock"


class RunLocked(ValueError):
    """The run directory is held by another live process."""


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` (``flock`` on ``run_dir/.lock``) for the block.

    The OS releases the lock when the holder dies, however it dies, so a killed run never leaves a stale lock.
    A second holder -- another process, or another open in this one -- gets ``RunLocked`` naming the pid."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{run_dir} exists and is not a directory; choose another output_dir / name")
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunLocked(f"{run_dir} is in use by another vexact process (pid {holder}); wait for it to finish or "
                        "stop it") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


class UnsafeFileError(ValueError):
    """A torch pickle file that is not a plain tensor file (it would run code or build arbitrary objects)."""


def load_tensor_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with one clear error for anything but plain tensors/containers.

    The weights-only unpickler is the only one vexact uses; its refusal is reported as "refusing to unpickle FILE:
    not a plain tensor file" -- never with torch's advice to load the file unsafely. Unreadable or truncated files
    are a ValueError naming the file too."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafeFileError(f"refusing to unpickle {path}: not a plain tensor file") from None
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a readable torch tensor file ({first[:120]})") from None


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Appends one JSON line per step to metrics.jsonl, flushed and fsynced."""

    def __init__(self, path: Path, keep_steps_below: int | None = None):
        self.path = path
        if keep_steps_below is not None:
            # Resuming: drop lines of steps after the checkpoint; they are recomputed identically.
            kept = [m for m in read_metrics(path) if m.get("step", -1) < keep_steps_below]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in kept))
            os.replace(tmp, path)
        self._file = open(path, "a")  # noqa: SIM115 -- closed in close()

    def write(self, metrics: dict) -> None:
        self._file.write(json.dumps(json_safe(metrics), sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict) -> None:
    """Weights (safetensors), optimizer state (torch.save; loaded with weights_only=True), trainer state."""
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = run_dir / (CHECKPOINT + ".tmp")
    save_file(weights, str(tmp))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), run_dir / (OPTIMIZER + ".tmp"))
    os.replace(tmp, run_dir / CHECKPOINT)
    if optimizer is not None:
        os.replace(run_dir / (OPTIMIZER + ".tmp"), run_dir / OPTIMIZER)
    write_json_atomic(run_dir / TRAINER_STATE, state)  # written last: marks the checkpoint complete


def load_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Restore a checkpoint written by ``save_checkpoint``; None if there is none."""
    state_path = run_dir / TRAINER_STATE
    if not state_path.exists():
        return None
    model.load_state_dict(load_file(str(run_dir / CHECKPOINT)))
    if optimizer is not None and (run_dir / OPTIMIZER).exists():
        optimizer.load_state_dict(torch.load(run_dir / OPTIMIZER, weights_only=True))
    return json.loads(state_path.read_text())
