"""A run's output directory: config.yaml, metrics.jsonl, summary.json, checkpoints/, and its lock.

Everything is written so that a kill loses nothing finished: metric lines are appended, flushed and fsynced
each step (read back by ``metrics_log.read_metrics``); JSON files are published by ``atomic.publish`` (unique temp
file, fsync, rename, fsync of the directory); a checkpoint is a directory published by one rename
(see "checkpoints" below). The run directory is locked (``run_lock``) while a process works in it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from ..metric_keys import with_deprecated_names
from . import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from .atomic import WriteFailed, apply_umask, fsync_path, json_safe, write_file, write_json_atomic, write_text_atomic
from .metrics_log import MetricsDamaged, complete_lines, parse_lines, read_metrics, scalars

__all__ = ["MetricsDamaged", "apply_umask", "json_safe", "read_metrics", "write_json_atomic"]  # re-exported


LOCK_FILE = ".lock"
CHECKPOINTS = "checkpoints"  # the folder of published checkpoints (see "checkpoints" below)


class RunLocked(ValueError):
    """The run directory is held by another live process."""


@contextmanager
def run_lock(run_dir: Path, who: str = "", again: str = "") -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` (``flock`` on ``run_dir/.lock``) for the block.

    The OS releases the lock when the holder dies, however it dies, so a killed run never leaves a stale lock.
    A second holder -- another process, or another open in this one -- gets ``RunLocked`` naming the pid, after
    ``who`` asked for it (``sweep NAME``) and before ``again``, what to do instead, where given."""
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
        raise RunLocked(f"{who + ': ' if who else ''}{run_dir} is in use by another vexact process (pid {holder}); "
                        f"wait for it to finish or stop it{'; ' + again if again else ''}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


UNFINISHED = {LOCK_FILE, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINTS}
"""What a run directory may hold when nothing in it is finished yet (empty metrics, no published checkpoint)."""


def nothing_finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing a user could want back: only the lock, the config, an empty metrics.jsonl,
    a summary that says interrupted and unpublished (``.partial-*``) checkpoints. Anything else -- a metric line, a
    checkpoint, a file vexact did not write there -- counts as finished."""
    run_dir = Path(run_dir)
    try:
        names = {p.name for p in run_dir.iterdir()}
        if not names <= UNFINISHED:
            return False
        if (run_dir / METRICS_FILE).exists() and (run_dir / METRICS_FILE).stat().st_size:
            return False
        if (run_dir / CHECKPOINTS).exists() and not all(
                p.name.startswith(".partial-") for p in (run_dir / CHECKPOINTS).iterdir()):
            return False
        summary = run_dir / SUMMARY_FILE
        return not summary.exists() or json.loads(summary.read_text()).get("status") == "interrupted"
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object: keep it
        return False


@contextmanager
def discard_if_interrupted_early(run_dir: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Around a run: when it is interrupted (Ctrl-C) before anything in ``run_dir`` is finished, and the directory
    did not exist before the block, remove it, so that an interrupted warm start leaves no empty run directory that
    the next attempt would have to --resume or rename around. Finished work is never removed (``nothing_finished``),
    nor a directory that existed before, nor one another process holds by then."""
    run_dir = Path(run_dir)
    fresh = not run_dir.exists()
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if fresh and run_dir.is_dir():
            _discard_unfinished(run_dir, interrupted, log)


def _discard_unfinished(run_dir: Path, interrupted: bool, log: Callable[[str], None]) -> None:
    try:
        status = json.loads((run_dir / SUMMARY_FILE).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if not (interrupted or status == "interrupted"):
        return
    try:
        with run_lock(run_dir):  # not while another process has started in it
            if not nothing_finished(run_dir):
                return
            shutil.rmtree(run_dir)
    except (RunLocked, OSError):
        return
    log(f"removed {run_dir}: interrupted before anything in it was finished")


class UnsafeFileError(ValueError):
    """A torch pickle file that is not a plain tensor file (it would run code or build arbitrary objects)."""


def load_tensor_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with one clear error for anything but plain tensors/containers.

    The weights-only unpickler is the only one vexact uses. A pickle it refuses for naming a global (a class or
    function: it would build objects or run code) is "refusing to unpickle FILE: not a plain tensor file (it names
    X)" -- never with torch's advice to load the file unsafely. Any other pickle it cannot read looks the same to it
    whether damaged or written by plain ``pickle``, so that one says so; a damaged zip or a truncated file is "not
    a readable torch tensor file" with the gist of torch's reason. Each is a ValueError naming the file."""
    path = Path(path)
    try:
        with warnings.catch_warnings(record=True) as said:  # torch's remarks on a file refused below are noise
            warnings.simplefilter("always")
            data = torch.load(path, map_location="cpu", weights_only=True)
        for w in said:  # a file that loaded: its warnings are news
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return data
    except (pickle.UnpicklingError, KeyError) as e:  # KeyError: the legacy unpickler reading bytes that are no
        refused = _REFUSED_GLOBAL.search(str(e))    # pickle (text, say) looks up a memo key that is not there
        if refused and isinstance(e, pickle.UnpicklingError):
            raise UnsafeFileError(f"refusing to unpickle {path}: not a plain tensor file (it names "
                                  f"{refused.group(1)})") from None
        raise ValueError(f"{path}: cannot be read as a plain tensor file (damaged, or not saved by torch.save of "
                         "tensors)") from None
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except EOFError:
        raise ValueError(f"{path}: not a readable torch tensor file (it ends early: empty or truncated)") from None
    except (RuntimeError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable torch tensor file ({_gist(e)})") from None


_REFUSED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")
"""torch's weights-only unpickler names the global it refused as "GLOBAL module.name" (blocked module or not
allow-listed); any other refusal (an unsupported opcode) is what damaged bytes and plain pickles alike meet."""


def _gist(err: BaseException, limit: int = 160) -> str:
    """The useful part of an exception's message: its first sentence (torch follows it with advice), cut at a word
    boundary with an ellipsis past ``limit`` characters; the exception's type when it says nothing."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    text = re.split(r"(?<=[^.\s])\.\s", text, maxsplit=1)[0]
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


class LogBackend(Protocol):
    """A live view of metrics.jsonl (TensorBoard, W&B): gets each step's numbers after the line is on disk."""

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


LiveViews = Callable[[list[dict[str, Any]]], list[LogBackend]]
"""Opens a run's live views given the rows metrics.jsonl already holds, replayed into each first
(``vexact.rl.log_backends.live_views`` makes one from a run's config)."""


def close_views(views: list[LogBackend]) -> Exception | None:
    """Close every view in ``views``, each even when one before it fails; the first failure, or None. A view is a
    copy of the record: its failure must not leave the others open, nor cost the run its own end."""
    first: Exception | None = None
    for view in views:
        try:
            view.close()
        except Exception as e:
            first = first or e
    return first


class MetricsWriter:
    """Appends one JSON line per step to metrics.jsonl, flushed and fsynced; with ``live_views``, also to the views
    it opens (TensorBoard, W&B), which are rebuilt from the kept lines first so that they match metrics.jsonl after
    a resume. ``amend``: applied to each kept line's JSON object; a line it returns another object for is rewritten
    as ``write`` writes one (an extended run takes back its off-schedule final evaluation)."""

    def __init__(self, path: Path, keep_steps_below: int | None = None, live_views: LiveViews | None = None,
                 amend: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
        self.path = path
        kept = self._kept(keep_steps_below, amend) if keep_steps_below is not None else None
        self._backends = []
        if live_views is not None:  # (only a view to rebuild reads the log back)
            rows = read_metrics(path) if kept is None else kept[1]
            # the kept lines replay as they were written: new and deprecated names (metric_keys.RENAMED_METRICS)
            self._backends = live_views([with_deprecated_names(r) for r in rows])
        try:
            if kept is not None and kept[0] is not None:  # cut only once the views opened: a view refused (W&B
                write_text_atomic(path, kept[0])  # refusing its project) leaves the log as it was
            # unbuffered: a write that fails (a full disk) fails once, naming the file, and leaves nothing in a
            # buffer for close() to fail on again
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            close_views(self._backends)  # the error that stopped the open is the one to report
            raise WriteFailed(path, e) from None
        except BaseException:
            close_views(self._backends)
            raise

    def _kept(self, next_step: int, amend: Callable[[dict[str, Any]], dict[str, Any]] | None = None
              ) -> tuple[str | None, list[dict[str, Any]]]:
        """Resuming at ``next_step``: the text of the lines of steps 0 .. next_step - 1 (one per step, in order; None
        where there is no file) and their rows; the rest is dropped unparsed -- recomputed identically, and the last
        may be torn by the crash."""
        path = self.path
        if not path.exists():
            if next_step:
                raise ValueError(f"{path} is missing, but the checkpoint is at step {next_step}: the run's log is "
                                 "gone; start a new run")
            return None, []
        lines = complete_lines(path.read_bytes().decode("utf-8", errors="surrogateescape"))[:next_step]
        if amend is not None:
            lines = [_amended(line, amend) for line in lines]
        kept = parse_lines(path, lines)
        if [row.get("step") for row in kept] != list(range(next_step)):
            raise ValueError(f"{path}: expected one line per step 0..{next_step - 1} before the checkpoint at step "
                             f"{next_step}, found steps {[row.get('step') for row in kept][:10]}...; the log does "
                             "not belong to this checkpoint")
        return "".join(line + "\n" for line in lines), kept

    def write(self, metrics: dict) -> None:
        """One line, appended and fsynced; a failure is ``WriteFailed`` naming metrics.jsonl (a part of the line
        that reached the disk is a torn last line, which every reader and resume leave out). A renamed key is
        written under its old name too, for the deprecation period (``metric_keys.RENAMED_METRICS``)."""
        metrics = with_deprecated_names(metrics)
        line = memoryview((json.dumps(json_safe(metrics), sort_keys=True) + "\n").encode())
        try:
            while line:
                line = line[os.write(self._fd, line):]
            os.fsync(self._fd)
            deleted = os.fstat(self._fd).st_nlink == 0
        except OSError as e:
            raise WriteFailed(self.path, e) from None
        if deleted:  # the lines would go on into a file no one can read, and the run would end "completed"
            raise WriteFailed(self.path, FileNotFoundError(errno.ENOENT, "it was deleted while the run wrote it"),
                              "the run directory was removed or its log deleted; the run cannot keep its results")
        if self._backends:  # after the fsync: the record is safe before any live view sees the step
            values = scalars(metrics)
            for backend in self._backends:
                backend.write(int(metrics["step"]), values)

    def close(self) -> None:
        """Close metrics.jsonl, then every live view, each even when one fails; then raise the first view's failure
        (the file's own failure, raised first, wins). A caller whose run must still end (write its summary)
        catches the view's failure and reports it after."""
        try:
            os.close(self._fd)
        finally:
            failure = close_views(self._backends)
        if failure is not None:
            raise failure


def _amended(line: str, amend: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """``line`` with ``amend`` applied to its JSON object: unchanged where ``amend`` returns the object itself (or
    the line is no object: the parse after names it), else re-serialized as ``MetricsWriter.write`` writes a line
    (the values were json_safe already, so the kept keys keep their bytes)."""
    try:
        row = json.loads(line)
    except ValueError:
        return line
    if not isinstance(row, dict):
        return line
    changed = amend(row)
    return line if changed is row else json.dumps(changed, sort_keys=True)


# --- checkpoints -------------------------------------------------------------------------------------------
#
# A checkpoint is one directory, run_dir/checkpoints/step-<next_step>, published by a single rename once every file
# in it is written and fsynced; its manifest.json (written last, before the rename) holds each file's sha256.
# A kill at any moment leaves either the previous checkpoints untouched plus a ".partial-*" directory (ignored and
# cleaned up), or the new checkpoint complete. Loading verifies the manifest and falls back to the previous
# complete checkpoint when one is damaged. The newest KEEP_CHECKPOINTS are kept.

CHECKPOINT = "checkpoint.safetensors"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
SNAPSHOTS = "snapshots.safetensors"  # extra tensors a run keeps between steps (rollout.policy_lag's weights)
MANIFEST = "manifest.json"
KEEP_CHECKPOINTS = 2
CHECKPOINT_FORMAT = 1


def _write_boundary(name: str) -> None:
    """Called after each file of a checkpoint is written (and at publication): fault tests replace it to kill
    the process exactly there."""


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Published checkpoint directories of a run, newest first (partial ones are not listed)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and re.fullmatch(r"step-\d+", d.name)]
    return sorted(found, key=lambda d: int(d.name.split("-")[1]), reverse=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest published checkpoint directory (not verified), or None."""
    dirs = checkpoint_dirs(run_dir)
    return dirs[0] if dirs else None


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict, snapshots: dict[str, torch.Tensor] | None = None) -> Path:
    """Publish checkpoint ``step-<state['next_step']>``: weights (safetensors), optimizer state (torch.save; read
    back weights-only), trainer state (JSON), ``snapshots`` when given (safetensors: e.g. the policy-lag weight
    snapshots; ``load_checkpoint`` returns them as ``state["snapshots"]``) and a manifest of their hashes, renamed
    into place in one step.

    Every file is serialized in memory and written by ``atomic.write_file``, so a write that fails (a full disk, a
    file-size limit) is one ``WriteFailed`` naming the file and the OS error, and the unpublished directory is
    removed: the previous checkpoints stay as they were, and nothing partial is left."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        root.mkdir(exist_ok=True)  # not parents: a run directory removed during the run is an error, not re-made
    except OSError as e:
        raise WriteFailed(root, e) from None
    name = f"step-{int(state['next_step']):08d}"
    partial = root / f".partial-{name}"
    final = root / name
    try:
        try:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
            _write_checkpoint_files(partial, model, optimizer, state, snapshots)
        except OSError as e:  # named as the file of the checkpoint it would have been
            where = final / Path(e.filename).name if e.filename and Path(e.filename).parent == partial else root
            raise WriteFailed(where, e, "the checkpoint is not published (nothing partial is left); the earlier "
                              "checkpoints are kept, and --resume continues from the newest once there is room") \
                from None
    except Exception:  # an error (not a kill, which tests stand in for with BaseException): leave nothing partial
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():  # the same step saved again (e.g. a collapse stop on a checkpoint step): replace it
        stale = root / f".stale-{name}"
        os.replace(final, stale)
        shutil.rmtree(stale)
    os.replace(partial, final)
    fsync_path(root)
    _write_boundary("publish")
    leftovers = [d for d in root.iterdir() if d.name.startswith((".partial-", ".stale-"))]  # from earlier kills
    for old in checkpoint_dirs(run_dir)[KEEP_CHECKPOINTS:] + leftovers:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_checkpoint_files(partial: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                            state: dict, snapshots: dict[str, torch.Tensor] | None = None) -> None:
    """The checkpoint's files in ``partial``, each written and fsynced, the manifest last."""
    write_file(partial / CHECKPOINT, save_tensors({k: v.detach().contiguous()
                                                   for k, v in model.state_dict().items()}))
    apply_umask(partial / CHECKPOINT)
    _write_boundary(CHECKPOINT)
    files = [CHECKPOINT]
    if optimizer is not None:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        write_file(partial / OPTIMIZER, buffer.getvalue())
        _write_boundary(OPTIMIZER)
        files.append(OPTIMIZER)
    if snapshots:
        write_file(partial / SNAPSHOTS, save_tensors({k: v.detach().contiguous() for k, v in snapshots.items()}))
        apply_umask(partial / SNAPSHOTS)
        _write_boundary(SNAPSHOTS)
        files.append(SNAPSHOTS)
    write_file(partial / TRAINER_STATE, json.dumps(json_safe(state), indent=2, sort_keys=True).encode())
    _write_boundary(TRAINER_STATE)
    files.append(TRAINER_STATE)
    manifest = {"format": CHECKPOINT_FORMAT, "next_step": int(state["next_step"]),
                "sha256": {f: file_sha256(partial / f) for f in files}}
    write_file(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    fsync_path(partial)
    _write_boundary(MANIFEST)


def verify_checkpoint(directory: Path) -> str | None:
    """None when the checkpoint directory is complete and every file matches its manifest hash, else what is
    wrong with it."""
    manifest_path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        hashes = manifest["sha256"]
    except FileNotFoundError:
        return "no manifest.json"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest.json is damaged"
    for required in (CHECKPOINT, TRAINER_STATE):
        if required not in hashes:
            return f"manifest.json does not list {required}"
    for name, expected in hashes.items():
        path = Path(directory) / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != expected:
            return f"{name} does not match its hash in manifest.json"
    return None


def load_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    log: Callable[[str], None] = print) -> dict | None:
    """Restore the newest intact checkpoint; None if the run has none. A damaged newest one is reported through
    ``log`` and the previous one is used; when checkpoints exist but none is intact, ValueError. A file that is
    intact but not a plain tensor file (a hostile optimizer.pt) is refused, never skipped."""
    problems = []
    for directory in checkpoint_dirs(run_dir):
        problem = verify_checkpoint(directory)
        if problem is not None:
            problems.append(f"{directory.name}: {problem}")
            log(f"checkpoint {directory} is incomplete or damaged ({problem}); trying the previous one")
            continue
        return _load_files(directory, model, optimizer)
    if problems:
        raise ValueError(f"cannot resume {run_dir}: no intact checkpoint ({'; '.join(problems)})")
    if (Path(run_dir) / TRAINER_STATE).is_file():  # a run written before checkpoints became directories
        log(f"{run_dir}: loading an old-format checkpoint (files in the run directory, no manifest to verify)")
        return _load_files(Path(run_dir), model, optimizer)
    return None


def _load_files(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    try:
        weights = load_file(str(directory / CHECKPOINT))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{directory / CHECKPOINT}: not a readable safetensors file ({e})") from None
    model.load_state_dict(weights)
    if optimizer is not None and (directory / OPTIMIZER).exists():
        optimizer.load_state_dict(load_tensor_file(directory / OPTIMIZER))
    try:
        state = json.loads((directory / TRAINER_STATE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / TRAINER_STATE}: not JSON ({e.msg})") from None
    if (directory / SNAPSHOTS).is_file():
        try:
            state["snapshots"] = load_file(str(directory / SNAPSHOTS))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{directory / SNAPSHOTS}: not a readable safetensors file ({e})") from None
    return state
