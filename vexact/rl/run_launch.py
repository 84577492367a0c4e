"""Starting ``vexact run``: the config a command names (an experiment YAML, or a run directory to resume), whether
the run may start or resume in its directory (each refusal spells out the commands that would work), the ranks
``--nproc`` launches, and the summary printed at the end. The CLI (``vexact.cli``) parses the arguments and calls
``run_command``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..cli_base import (
    EXIT_BAD_INPUT,
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    interrupted_exit_code,
    make_console,
    print_error_line,
    rank_errors,
    stop_signal,
)
from ..engine.devices import rank_device
from ..records import CONFIG_FILE, SUMMARY_FILE
from ..records.runlog import LOCK_FILE, run_lock
from .config import load_config
from .config_schema import RunConfig
from .data_parallel import LAUNCHER_ENV, DataParallel, check_leaves, launch
from .tasks import check_memory
from .trainer import Trainer, foreign_entries, holds_results, holds_run, run_dir_for

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["check_run_dir", "command_line", "free_run_name", "launch_ranks", "print_nothing_to_resume",
           "print_run_summary", "run_command", "run_config", "summary_exit_code"]


def run_command(args: argparse.Namespace) -> int:
    """``vexact run`` from its parsed arguments (``config``, ``overrides``, ``resume``, ``allow_changes``,
    ``nproc``): the checks before any work, then the run in this process (or as torchrun's rank) or ``nproc``
    ranks launched here; the exit code."""
    if args.allow_changes and not args.resume:  # a new run has no saved config.yaml for a key to differ from
        raise ValueError(f"--allow-change {args.allow_changes[0]}: lets a key differ from the config.yaml of a run "
                         "being resumed; give it with --resume")
    cfg = run_config(args)
    device = rank_device(cfg.device)  # no CUDA for device: cuda is one error here, before any rank starts
    check_memory(cfg)  # before anything is allocated: an absurd model size is one error naming the sizes
    if args.nproc > 1:
        check_leaves(cfg.distributed.leaves, args.nproc)  # before starting any rank
    check_run_dir(args, cfg)
    console = make_console()
    if args.nproc > 1:
        return launch_ranks(args, cfg, console)
    if device.type == "cuda":
        # NCCL's collectives and the Triton launches run on the current GPU: make it this rank's own
        # (set_device needs an index; plain ``cuda`` is the current one)
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    # torchrun's ranks (gloo on the CPU, NCCL on GPUs), or this process alone
    ranks = DataParallel.from_environment(cfg.distributed.reduce, device)
    # a rank of `vexact run --nproc`: its launcher prints the restart hint, with --nproc (the rank's command has none)
    launched = LAUNCHER_ENV in os.environ
    try:
        if ranks.is_main:
            console.print(f"vexact run [bold]{cfg.name}[/] -> {run_dir_for(cfg)}"
                          + (f" on {ranks.world_size} ranks" if ranks.world_size > 1 else ""))
        summary = Trainer(cfg, console, ranks).run(resume=args.resume, allow_changes=tuple(args.allow_changes))
    except KeyboardInterrupt as stop:  # in the warm start (or a resume's restore)
        ranks.close(wait=False)
        if not ranks.is_main or holds_run(run_dir_for(cfg)):
            raise
        if not launched:
            print_nothing_to_resume(args, console)
        return interrupted_exit_code(stop_signal(stop))
    except BaseException:
        ranks.close(wait=False)
        raise
    ranks.close(wait=summary["status"] != "interrupted")
    if ranks.is_main:
        if summary["status"] == "interrupted" and not holds_run(run_dir_for(cfg)):
            if not launched:  # its summary.json went with the directory: no table of it
                print_nothing_to_resume(args, console)
        else:
            print_run_summary(cfg, summary, console)
    code = summary_exit_code(summary)
    if ranks.world_size > 1:
        # A rank's work is written and fsynced by now. Interpreter finalization can still abort it (SIGABRT,
        # "terminate called without an active exception": gloo worker threads torn down late), which turned a
        # finished run into a failed rank now and then; a rank leaves without finalization instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of ``vexact run``: from CONFIG.yaml and --set, or, given a run directory with --resume, from the
    config.yaml the run saved (the --set given now apply on top: with --allow-change, e.g. more steps)."""
    if args.resume and not args.config.exists():
        raise ValueError(f"cannot resume {args.config}: no such run directory (a run interrupted before its first "
                         "step finished leaves none: start it again from its experiment YAML)")
    if not args.config.is_dir():
        return load_config(args.config, args.overrides)
    run_dir = args.config
    saved = run_dir / CONFIG_FILE
    if not args.resume and not holds_run(run_dir):
        raise ValueError(f"{run_dir} is a directory but not a vexact run: it holds no config.yaml, metrics.jsonl or "
                         "checkpoints/; vexact run takes an experiment YAML (e.g. experiments/zero_mismatch.yaml), "
                         "or with --resume the directory of a run it wrote")
    if not args.resume:
        raise ValueError(f"{run_dir} is a run directory; to continue it: vexact run {shlex.quote(str(run_dir))} "
                         f"--resume; to start a new run from its config: vexact run {shlex.quote(str(saved))} "
                         f"--set name=NEW_NAME")
    if not saved.exists():
        raise ValueError(f"cannot resume {run_dir}: it holds no config.yaml, so it is not a vexact run directory (or "
                         "its run was stopped before the warm start finished: start it again from its experiment "
                         "YAML)")
    # the run's own record: its old spellings read silently, unless --set items (the user's) come with it
    return dataclasses.replace(load_config(saved, args.overrides, saved=not args.overrides), output_dir=str(run_dir))


def check_run_dir(args: argparse.Namespace, cfg: RunConfig) -> None:
    """Before any work (and before any rank starts): ``--resume`` needs a run to resume, and a new run needs a
    directory without one; each refusal spells out the commands that would work."""
    run_dir = run_dir_for(cfg)
    if stray := foreign_entries(run_dir):  # the user's own folder: a run's files would mix with theirs
        shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise ValueError(f"{run_dir} is not empty and not a vexact run directory (it holds {shown}): a run there "
                         "would mix its files with them; choose a new or empty directory (output_dir / name)")
    # Only rank 0 probes the lock: ranks probing at once would each hold it for a moment and refuse one another.
    # Only a lock file that exists is probed: the probe creates none, so a refused directory is left as it was.
    if (run_dir / LOCK_FILE).is_file() and DataParallel.environment_rank() == 0:
        with run_lock(run_dir):  # a run in progress there: RunLocked names its pid (the checks below would not)
            pass
    if args.resume and not holds_run(run_dir):
        raise ValueError(f"cannot resume {run_dir}: there is no run there (no config.yaml, metrics.jsonl or "
                         f"checkpoint); to start it: {command_line(args, resume=False)}")
    if not args.resume and holds_results(run_dir):
        key, value = free_run_name(cfg)
        raise ValueError(f"{run_dir} already holds a run; to continue it: vexact run {shlex.quote(str(run_dir))} "
                         f"--resume; to start another beside it: {command_line(args, extra=f'{key}={value}')}")


def free_run_name(cfg: RunConfig) -> tuple[str, str]:
    """The ``--set`` that gives a new run a free directory: name-2, name-3, ... (or output_dir-2, ... when the
    config names its output_dir)."""
    key, base = ("output_dir", cfg.output_dir) if cfg.output_dir else ("name", cfg.name)
    parent = Path(".") if cfg.output_dir else Path("runs")
    n = 2
    while holds_results(parent / f"{base}-{n}"):
        n += 1
    return key, f"{base}-{n}"


def command_line(args: argparse.Namespace, resume: bool = True, extra: str | None = None) -> str:
    """This ``vexact run`` command as a shell line (``extra``: one more --set, replacing any earlier one of its key)."""
    overrides = list(args.overrides)
    if extra is not None:
        key = extra.partition("=")[0]
        overrides = [o for o in overrides if o.partition("=")[0].strip() != key] + [extra]
    words = ["vexact", "run", str(args.config), *(f"--set={o}" for o in overrides),
             *(["--resume"] if resume and args.resume else []), *(f"--allow-change={k}" for k in args.allow_changes),
             *([f"--nproc={args.nproc}"] if args.nproc > 1 else [])]
    return shlex.join(words)


def launch_ranks(args: argparse.Namespace, cfg: RunConfig, console: Console) -> int:
    """``vexact run --nproc N``: the same command as N ranks; the exit code follows the run's summary.json, or a
    failed rank's exit code when it is vexact's own (2 bad input, 3 the machine failed), else 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    rank_args = ["-m", "vexact", "run", str(args.config), *(f"--set={o}" for o in args.overrides),
                 *(["--resume"] if args.resume else []), *(f"--allow-change={k}" for k in args.allow_changes)]
    try:
        with tempfile.TemporaryDirectory(prefix="vexact-errors-") as errors:
            try:
                launch(args.nproc, rank_args, threads=cfg.threads, errors_dir=errors)
            except ChildFailedError as err:
                return _failed_ranks(err, rank_errors(Path(errors)), args, cfg, console)
    except (KeyboardInterrupt, SignalException) as stop:  # the ranks got the signal too (the agent sends them the
        # one it got); rank 0 recorded what finished. The agent's own handler raises SignalException here, in place of
        # the CLI's (cli_base.stop_on_sigterm), and names the signal.
        return _interrupted(args, cfg, console, interrupted_exit_code(
            signal.Signals(stop.sigval) if isinstance(stop, SignalException) else stop_signal(stop)))
    return EXIT_OK


def _interrupted(args: argparse.Namespace, cfg: RunConfig, console: Console, code: int) -> int:
    """What the launcher says when the ranks were interrupted (they leave the restart hint to it); ``code``."""
    if not holds_run(run_dir_for(cfg)):  # stopped in the warm start: rank 0 removed the directory it had begun
        print_nothing_to_resume(args, console)
        return code
    console.print("[yellow]interrupted[/]: the ranks stopped; finished steps are in metrics.jsonl; continue "
                  "with --resume")
    return code


OWN_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_ENVIRONMENT)
"""A rank's exit codes the launcher passes on: vexact's own verdicts (any other is a crash: 1)."""
INTERRUPTED_CODES = (EXIT_INTERRUPTED, EXIT_TERMINATED)
"""A rank's exit codes for Ctrl-C and SIGTERM: the launcher says what it says when it is interrupted itself."""


def _failed_ranks(err: ChildFailedError, errors: dict[int, str], args: argparse.Namespace, cfg: RunConfig,
                  console: Console) -> int:
    """What ``vexact run --nproc`` says and returns when a rank exited non-zero; ``errors``: the error lines the
    ranks left (rank 0 printed its own)."""
    summary_path = run_dir_for(cfg) / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if summary.get("status") in ("interrupted", "stopped"):  # a recorded outcome, already printed by rank 0
        return summary_exit_code(summary)
    # the first to fail (timestamps are whole seconds: of a tie, a rank that failed on its own account, not a peer
    # whose collective broke when that rank left)
    rank = min(err.failures, key=lambda r: (err.failures[r].timestamp,
                                            err.failures[r].exitcode not in OWN_EXIT_CODES + INTERRUPTED_CODES))
    failure = err.failures[rank]
    if failure.exitcode in INTERRUPTED_CODES:  # a signal that reached the ranks, not the launcher: no summary yet
        return _interrupted(args, cfg, console, failure.exitcode)
    if failure.exitcode < 0:  # killed from outside (the OOM killer, kill -9): it printed nothing
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        console.print(f"[red]rank {rank} was killed[/] by {name}" + ("; finished steps are in metrics.jsonl; "
                      "continue with --resume" if holds_run(run_dir_for(cfg)) else ""))
        return EXIT_FAILED
    shown = {errors.get(0)}  # the other ranks' lines, once each
    for message in errors.values():
        if message not in shown:
            shown.add(message)
            print_error_line(message)
    if failure.exitcode in OWN_EXIT_CODES and rank in errors:  # its one error line is printed: nothing to add
        return failure.exitcode
    console.print(f"[red]rank {rank} failed[/] (exit code {failure.exitcode}); its error is printed above")
    return failure.exitcode if failure.exitcode in OWN_EXIT_CODES else EXIT_FAILED


def summary_exit_code(summary: dict) -> int:
    """The exit code of a run's outcome, from its summary: 0 completed; interrupted: 130 or 143, for the signal it
    records (SIGINT or SIGTERM; SIGINT where a summary written before vexact recorded it names none); else 1."""
    if summary.get("status") == "interrupted":
        return interrupted_exit_code(signal.Signals[summary.get("signal") or "SIGINT"])
    return EXIT_OK if summary.get("status") == "completed" else EXIT_FAILED


def print_nothing_to_resume(args: argparse.Namespace, console: Console) -> None:
    """After an interrupt before any step finished (the run's new directory was removed): how to start it again."""
    console.print(f"[yellow]interrupted[/] before the run began: nothing to resume; to start it: "
                  f"{escape(command_line(args, resume=False))}", soft_wrap=True)


def print_run_summary(cfg: RunConfig, summary: dict, console: Console) -> None:
    """The run's outcome, from its summary.json: status, rewards, mismatch, step time."""
    keys = ("status", "reason", "steps_completed", "collapse.initial_reward", "collapse.final_reward",
            "eval_reward_first", "eval_reward_last", "eval_greedy_accuracy_first", "eval_greedy_accuracy_last",
            "collapse.mean_k3_kl", "min_bitwise_equal_frac", "mean_step_seconds")
    table = Table(title=f"summary: {run_dir_for(cfg) / SUMMARY_FILE}")
    table.add_column("key")
    table.add_column("value", justify="right")
    for key in keys:
        section, _, name = key.rpartition(".")
        value = (summary.get(section) or {} if section else summary).get(name)
        if value is not None:
            if section == "collapse" and name.endswith("_reward"):  # of the judged metric (collapse.metric)
                key += f" ({(summary['collapse'].get('criteria') or {}).get('metric', '?')})"
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
