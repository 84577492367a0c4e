"""What vexact's commands share, below every layer: the exit codes, the console and the positive-integer argument.

``vexact.cli`` only parses; the modules that do a command's work (``vexact.real.check_report``,
``vexact.rl.run_launch``, the ``add_arguments`` and ``main`` of ``real/compare.py``, ``real/locate.py`` and
``integrations/vllm.py``) sit in layers below the CLI and cannot import it, so what they share with it is here, once.
Imports nothing of vexact (and rich only when a console is made).
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported by the commands that print, not by --help
    from rich.console import Console

__all__ = ["EXIT_BAD_INPUT", "EXIT_ENVIRONMENT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED",
           "RANK_ERRORS_ENV", "Terminated", "check_outputs", "check_writable", "interrupted_exit_code",
           "launched_rank", "leave_error_for_launcher", "make_console", "positive_int", "print_error_line",
           "rank_errors", "stop_on_sigterm", "stop_signal", "stopped_by"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ENVIRONMENT = 0, 1, 2, 3
"""Every command's exit codes: success; the command ran but its outcome is a failure; bad input; the machine failed
the work (a full disk, an I/O error)."""


def interrupted_exit_code(sig: signal.Signals) -> int:
    """The exit code of a command stopped by ``sig`` (SIGINT or SIGTERM): 128 + its number, the shell's own
    convention for a process a signal ended, so a job scheduler reads it as it would read the signal itself."""
    return 128 + sig


EXIT_INTERRUPTED, EXIT_TERMINATED = interrupted_exit_code(signal.SIGINT), interrupted_exit_code(signal.SIGTERM)
"""Interrupted: by SIGINT (Ctrl-C, 130) or by SIGTERM (a job scheduler, ``kill PID``, ``timeout``: 143)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (``stop_on_sigterm``): a KeyboardInterrupt, so every
    ``except KeyboardInterrupt`` stops the work as Ctrl-C does (the interrupted summary, the resume hint, a sweep's
    workers stopped); only the exit code tells the two apart (``stop_signal``)."""

    signum = signal.SIGTERM


def stop_signal(stop: BaseException) -> signal.Signals:
    """The signal an interrupt stands for: SIGTERM for ``Terminated``, else SIGINT (Ctrl-C's KeyboardInterrupt)."""
    return getattr(stop, "signum", signal.SIGINT)


def stopped_by(sig: signal.Signals | str) -> KeyboardInterrupt:
    """The interrupt to raise again for ``sig`` (or its name, as ``summary.json`` records it) once it was caught
    and recorded: what ``stop_signal`` reads back."""
    sig = signal.Signals[sig] if isinstance(sig, str) else sig
    return Terminated() if sig == signal.SIGTERM else KeyboardInterrupt()


LAUNCHED_RANK_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
"""Set in the processes a launcher starts as ranks (torchrun's elastic agent, ``vexact run --nproc``)."""


def launched_rank(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is that of a rank a launcher started (``LAUNCHED_RANK_ENV``)."""
    return any(name in environ for name in LAUNCHED_RANK_ENV)


RANK_ERRORS_ENV = "VEXACT_RANK_ERRORS"
"""Set by ``vexact run --nproc`` in its ranks: a directory where each rank leaves its error line for the launcher
(``leave_error_for_launcher``)."""


def leave_error_for_launcher(message: str) -> bool:
    """In a rank of ``vexact run --nproc`` (``RANK_ERRORS_ENV`` set): leave this rank's error line for the launcher;
    whether the rank should then not print it -- every rank but rank 0, which prints its own. The ranks mostly fail
    on the same bad input, which printed once per rank; the launcher prints the lines rank 0 did not."""
    directory = os.environ.get(RANK_ERRORS_ENV)
    if not directory:
        return False
    rank = os.environ.get("RANK", "0")
    try:
        (Path(directory) / f"rank{rank}.txt").write_text(message)
    except OSError:  # the launcher will not see it: the rank prints it itself
        return False
    return rank != "0"


def print_error_line(message: str, label: str = "error", colour: str = "red") -> None:
    """``LABEL: MESSAGE``, one unwrapped stderr line; the message is printed as is (no markup: paths and lists contain
    brackets)."""
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    console.print(f"[{colour}]{label}[/]" + (":" if message else ""), end=" " if message else "\n")
    if message:
        console.print(message, markup=False, highlight=False)


def rank_errors(directory: Path) -> dict[int, str]:
    """The error lines the ranks left in ``directory`` (``leave_error_for_launcher``), by rank."""
    found = {}
    for path in directory.glob("rank*.txt"):
        if path.stem[4:].isdigit():
            found[int(path.stem[4:])] = path.read_text()
    return dict(sorted(found.items()))


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def stop_on_sigterm(handle: bool) -> None:
    """For the rest of this process's life: SIGTERM raises ``Terminated`` (a KeyboardInterrupt) where ``handle``,
    so a job scheduler's stop ends the work as Ctrl-C does; otherwise SIGTERM keeps its default (the process ends at
    once). Call it once, where the process starts (the CLI's entry point, a sweep worker's initializer); it must run
    in the main thread.

    Not ``handle`` in a rank a launcher started (``launched_rank``): torch's elastic agent sends SIGTERM to every
    surviving rank when one rank *fails*, so a handled SIGTERM would have rank 0 record a crash elsewhere as
    "interrupted" (and the launcher report exit 143, not the failure); and a rank blocked in a collective runs no
    Python handler, so it would end only by the agent's SIGKILL after its timeout, not at once. Rank 0 loses nothing
    finished either way (every step's line and checkpoint are on disk), and the launcher, which vexact owns, handles
    the SIGTERM it gets: it says how to --resume and exits 143."""
    if handle:
        signal.signal(signal.SIGTERM, _raise_terminated)


def make_console(stderr: bool = False) -> Console:
    """Rich console; wide when output is not a terminal (logs, CI) so lines don't wrap."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, else the one error argparse prints with the flag's name."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    """An argparse type: 0 or a positive integer, else the one error argparse prints with the flag's name."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text!r}")
    return int(text)


def check_writable(path: Path, flag: str) -> None:
    """A ValueError naming ``flag`` unless ``path`` can be written: a command that writes its results at the end finds
    out before its work, not after it. The probe leaves nothing behind, whatever its outcome: the file and the
    folders it made for it are removed again (a command that then fails left them behind), so the writer makes the
    folders it needs. A broken symlink on the way (``path`` or a folder above it, its target missing) is refused:
    the probe wrote through it (making its target, then removing the link) or failed with "No such file"."""
    broken = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if broken is not None:
        raise ValueError(f"{flag}: cannot write {path}: {broken} is a broken symlink (its target "
                         f"{os.readlink(broken)} does not exist); remove it or name another file")
    existed = path.exists()
    made = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]  # deepest first
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as e:
            raise ValueError(f"{flag}: cannot write {path}: {e.strerror or e}") from None
        if not existed:
            path.unlink()
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not made here after all (or not empty: something else writes there)
                break


def check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Before a command's work, a ValueError naming the flag unless each output file (``--json``, ``--png``) can be
    written (``check_writable``: not a folder, its folder writable) and is no file the command reads: the report,
    written after the work, would replace it (``--json rollout.jsonl`` for ``--json report.json``) and the work
    could not be run again. Keys are the flags; None is a flag not given; an input folder (``--model DIR``, a
    checkpoint) counts as the files in it; an input that is neither (a name) is passed over."""
    read: dict[Path, str] = {}
    for flag, path in inputs.items():
        if path is None:
            continue
        path = Path(path)
        folder = path.is_dir()
        for file in sorted(path.iterdir()) if folder else [path]:
            if file.is_file():  # a file given twice is named by its first flag
                read.setdefault(file.resolve(), f"a file of {flag} {path}" if folder else f"the {flag} file")
    written: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if Path(path).resolve() in read:
            raise ValueError(f"{flag} {path} is {read[Path(path).resolve()]}: the output would overwrite it; name "
                             "another file")
        if Path(path).resolve() in written:  # the second output would replace the first
            raise ValueError(f"{flag} {path} is also {written[Path(path).resolve()]}'s file: each output needs its "
                             "own file")
        written[Path(path).resolve()] = flag
        check_writable(Path(path), flag)


# The flags that measure and locate share, with one help each. Three helpers, not one: each command keeps its flags
# in its own --help order.
def add_prompts_flag(group: argparse._ActionsContainer) -> None:
    """``--prompts FILE``, into ``group``: the mutually exclusive group of the command's other prompt sources."""
    group.add_argument("--prompts", type=Path, metavar="FILE", help="one prompt per line: text if the checkpoint "
                       "has a tokenizer, else whitespace-separated token ids")


def add_prompt_length_flags(parser: argparse.ArgumentParser, default: int, none_unless_given: bool = False) -> None:
    """``--max-prompt-len`` (random prompts; ``default`` when not given) and ``--token-ids``. ``none_unless_given``:
    the flag parses to None when not given and the command fills in ``default`` (so it can tell a flag given)."""
    parser.add_argument("--max-prompt-len", type=positive_int, default=None if none_unless_given else default,
                        help=f"longest --random-prompts prompt (default: {default})")
    parser.add_argument("--token-ids", action="store_true", help="read --prompts as token ids even with a tokenizer")


def prompt_source(prompts_file: Path | str | None) -> str:
    """The flag the prompts come from, as ``check_prompt_length_flags`` and ``check_sampling_seed`` take it:
    ``--prompts`` where a file is given, else ``--random-prompts`` (given, or the command's default). Measure, the
    vLLM dump and locate (whose ``--prompt-tokens`` comes before both) all ask here."""
    return "--prompts" if prompts_file is not None else "--random-prompts"


def check_prompt_length_flags(source: str, max_prompt_len: int | None, token_ids: bool) -> None:
    """A ValueError naming the flag where one of ``add_prompt_length_flags``' flags was given and would do nothing:
    ``source`` is the flag the prompts come from (``--random-prompts`` for random ones, given or a command's
    default); ``max_prompt_len`` None is the flag not given."""
    here = "random (--random-prompts)" if source == "--random-prompts" else f"given by {source}"
    if max_prompt_len is not None and source != "--random-prompts":
        raise ValueError(f"--max-prompt-len: it bounds the length of random prompts (--random-prompts), and the "
                         f"prompts here are {here}: it would change nothing")
    if token_ids and source != "--prompts":
        raise ValueError(f"--token-ids: it reads a --prompts file as token ids, and the prompts here are {here}: it "
                         "would change nothing")


def moot_seed_error(fixed: list[str]) -> ValueError:
    """The error for ``--seed`` given where nothing it seeds is random; ``fixed`` says why each thing is not."""
    return ValueError(f"--seed: nothing it seeds is random here ({', '.join(fixed)}): it would change nothing")


def check_sampling_seed(source: str, seed: int | None, temperature: float) -> None:
    """For a command whose ``--seed`` seeds only its random prompts and its sampling (measure, the vLLM dump): the
    moot-seed ValueError where it was given (``seed`` not None) and neither is random: the prompts come from
    ``source`` (the flag, as for ``check_prompt_length_flags``) and temperature 0 is greedy."""
    if seed is not None and source != "--random-prompts" and temperature == 0:
        raise moot_seed_error([f"{source} gives the prompts", "--temperature 0 is greedy"])


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch threads to set; None (torch's own count) when not given."""
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
