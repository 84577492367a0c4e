"""One way to write a file that must never be seen half written: summary.json, sweep.json, manifests, the warm-start
cache, reports.

``publish(path, write)``: ``write`` fills a temp file with a unique name (pid + random) in ``path``'s own directory
(so the rename below is within one filesystem), the temp file is fsynced, renamed over ``path`` in one step, and
the directory is fsynced so that the rename itself survives a power loss. Readers therefore see the old file or the
new one, whole, never an empty or partial one; two writers at once each rename their own temp file (the last rename
wins) instead of one renaming the other's away; a crash before the rename leaves the old file untouched and at most
a ``.NAME.*.tmp`` file beside it, which no reader looks at. The modes a new file gets are the usual
``0o666 & ~umask`` (``apply_umask``), also for writers like safetensors that create 0600 files.

A write that fails is an ``OSError`` naming the file it was writing (``WriteFailed``): a full disk or a file-size
limit says which file, with the OS's reason. ``ENVIRONMENT_ERRNOS`` are the failures of the machine rather than of
the input (the CLI's exit code 3).
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMP_SUFFIX = ".tmp"

ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.ENOMEM})
"""OS errors that are the machine's, not the input's: no space left, a disk quota, a file-size limit (``ulimit -f``:
Python ignores SIGXFSZ, so the write fails with EFBIG), an I/O error, no memory."""


class WriteFailed(OSError):
    """Writing ``filename`` failed: the OS error (errno, reason) with the file it was writing, so the one error line
    says which file (an OSError from ``write`` carries no file name)."""

    def __init__(self, path: str | Path, err: OSError, note: str = ""):
        super().__init__(err.errno, err.strerror or str(err), str(path))
        self.note = note

    def __str__(self) -> str:
        limit = " (the file-size limit: ulimit -f)" if self.errno == errno.EFBIG else ""
        return f"cannot write {self.filename}: {self.strerror}{limit}{'; ' + self.note if self.note else ''}"


def write_file(path: str | Path, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it; a failure is ``WriteFailed`` naming the file. Written with
    unbuffered ``os.write`` calls, so that nothing is left in a buffer to fail a second time when the file is
    closed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise WriteFailed(path, e) from None


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
        try:
            write(tmp)
            apply_umask(tmp)
            fsync_path(tmp)
            _before_rename(tmp, path)
            os.replace(tmp, path)
        except OSError as e:  # named by the file being published (the temp file's name means nothing to a user)
            raise WriteFailed(path, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """``publish`` ``data`` as the whole content of ``path``."""
    return publish(path, lambda tmp: write_file(tmp, data))


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
