"""One way to write a file that must never be seen half written: summary.json, sweep.json, manifests, the warm-start
cache, reports.

``publish(path, write)``: ``write`` fills a temp file with a unique name (pid + random) in ``path``'s own directory
(so the rename below is within one filesystem), the temp file is fsynced, renamed over ``path`` in one step, and
the directory is fsynced so that the rename itself survives a power loss. Readers therefore see the old file or the
new one, whole, never an empty or partial one; two writers at once each rename their own temp file (the last rename
wins) instead of one renaming the other's away; a crash before the rename leaves the old file untouched and at most
a ``.NAME.*.tmp`` file beside it, which no reader looks at. The modes a new file gets are the usual
``0o666 & ~umask`` (``apply_umask``), also for writers like safetensors that create 0600 files.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMP_SUFFIX = ".tmp"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory's fsync makes the renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read from /proc where possible (``os.umask`` can only be read by setting it, which
    races with other threads creating files); the set-and-restore round trip elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give a file written through a private temp file (safetensors writes mode 0600) the mode every other tool
    gives a new file, 0o666 & ~umask, so a checkpoint is readable by whoever may read the rest of the run."""
    os.chmod(path, 0o666 & ~_umask())


def temp_name(path: Path) -> Path:
    """A temp file name beside ``path`` that no other writer (process or thread) picks."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def _before_rename(tmp: Path, path: Path) -> None:
    """Called once the temp file is written and fsynced, just before the rename: tests replace it to crash or pause
    the writer exactly there."""


def publish(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write ``path`` atomically and durably: ``write(tmp)`` creates the content at ``tmp``; then fsync, one rename
    over ``path``, fsync of the directory. On any error the temp file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        write(tmp)
        apply_umask(tmp)
        fsync_path(tmp)
        _before_rename(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """``publish`` ``data`` as the whole content of ``path``."""
    return publish(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``publish`` ``text`` (UTF-8) as the whole content of ``path``."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def json_safe(value: Any) -> Any:
    """NaN/Inf are legal outcomes (a diverged run) but not legal JSON: write them as strings ("nan", "inf", "-inf";
    read back by ``metrics_log.decode_non_finite``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: str | Path, data: Any, sort_keys: bool = True) -> Path:
    """``data`` as indented JSON (NaN/Inf as strings, see ``json_safe``), published atomically."""
    return write_text_atomic(path, json.dumps(json_safe(data), indent=2, sort_keys=sort_keys) + "\n")
