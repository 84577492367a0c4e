"""The ``vexact`` command line. Each subcommand lives in its own module; this file only parses."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported by the commands that print, not by --help
    from rich.console import Console
    from rich.table import Table

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
FAILED_MEANS = {
    "check": "a bitwise mismatch on an exact backend",
    "run": "the run stopped itself (non-finite values, exactness violated); see summary.json",
    "sweep": "a point failed (its error is in sweep.json)",
    "demo": "a point failed (its error is in sweep.json)",
    "measure": "--fail-on-mismatch and not every token is bitwise equal",
    "report": "(not used)",
    "bench": "a benchmark found a problem",
    "compare": "a gate failed (--fail-on-mismatch, --max-k3, --max-abs-dlogp)",
    "locate": "the two paths diverge (with --fail-on-divergence)",
}


RESUMED_BY = {"sweep": "re-running the same command resumes it", "demo": "re-running vexact demo resumes it",
              "run": "--resume continues"}
"""How a command's interrupted work is continued (for ``--help``); other commands keep nothing to continue."""


def exit_codes_help(command: str | None = None) -> str:
    """The exit-code scheme every command shares, for ``--help`` (and the docs' failure page)."""
    failed = FAILED_MEANS.get(command, "the command ran but its outcome is a failure (see each command's --help)")
    resumed = RESUMED_BY.get(command, "vexact run --resume or re-running a sweep continues" if command is None
                             else None)
    return (f"exit codes: {EXIT_OK} success; {EXIT_FAILED} {failed}; {EXIT_BAD_INPUT} bad input (config, files, "
            f"a locked or mismatched run directory: one 'error:' line on stderr); {EXIT_ENVIRONMENT} the machine "
            "failed the work (no space left on the disk, a file-size limit, an I/O error: one 'error:' line naming "
            f"the file); {EXIT_INTERRUPTED} interrupted (Ctrl-C; finished work is kept"
            + (f"; {resumed})" if resumed else ")"))


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default: appended as "(default: X)" unless the help text already names it
    (most say it in their own words) or there is none to show (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # on/off: nothing to add
        empty = default is None or default is False or default is argparse.SUPPRESS or default in ([], ())
        if "default" in text.lower() or empty or flag or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _LaidOutDescription(_DefaultsFormatter):
    """For a command whose description is laid out by hand (examples in columns): text of several lines is kept as
    written, a one-paragraph text (the exit codes' epilog) is wrapped as every other command's."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """vexact's parsers (the subcommands' too: argparse builds them with the parent's class): defaults in --help.

    ``arguments``: a function that adds the parser's arguments, called on first parse or help (``build_parser(lazy=
    True)``): a command's arguments may need its module (and torch), which only that command should import."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.arguments: Callable[[argparse.ArgumentParser], None] | None = None

    def _complete(self) -> None:
        if self.arguments is not None:
            arguments, self.arguments = self.arguments, None
            arguments(self)

    def parse_known_args(self, args=None, namespace=None):  # argparse hands a subcommand its words here
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()


def package_version() -> str:
    """vexact's version: ``vexact.__version__``, the one place it is written (pyproject.toml reads it from there,
    so installed metadata agrees; a stale editable install's metadata could not)."""
    from . import __version__

    return __version__


def make_console(stderr: bool = False) -> Console:
    """Rich console; wide when output is not a terminal (logs, CI) so lines don't wrap."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


def _batch_list(text: str) -> tuple[int | None, ...]:
    """'all,1,3' -> (None, 1, 3)."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "all":
            out.append(None)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"expected a comma list of positive ints or 'all', got {item!r}")
    return tuple(out)


def _batch_text(sizes: tuple[int | None, ...]) -> str:
    """(None, 1, 3) -> 'all,1,3' (what ``_batch_list`` reads)."""
    return ",".join("all" if s is None else str(s) for s in sizes)


def _thread_list(text: str) -> tuple[int, ...]:
    """'1,3' -> (1, 3)."""
    return tuple(_positive_int(item.strip()) for item in text.split(","))


class _DeprecatedFlag(argparse.Action):
    """The old spelling of a flag: stores into the new flag's ``dest`` and warns (FutureWarning, as the config's
    renamed keys do) that ``new`` replaces it."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values, option_string=None):
        import warnings

        # attributed to the command, not to argparse's source line
        warnings.warn_explicit(f"{option_string} is deprecated; use {self.new}", FutureWarning, parser.prog, 0)
        setattr(namespace, self.dest, values)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


_CHECK_SIZES = {"vocab_size": "vocabulary of the random model", "hidden_size": "hidden size of the random model",
               "num_layers": "decoder layers of the random model", "num_heads": "attention heads",
               "num_kv_heads": "key/value heads (grouped-query attention)",
               "intermediate_size": "MLP intermediate size",
               "num_experts": "experts per MoE layer: a mixture-of-experts model (the preset small_moe has 4)",
               "num_experts_per_tok": "experts each token is routed to (top-k; with --num-experts)",
               "moe_intermediate_size": "an expert's intermediate size (with --num-experts; default: "
                                        "--intermediate-size)"}


_CHECK_PRESET_ONLY = ("head_dim", "qk_norm", "rope_theta", "norm_topk_prob")
"""Shape keys ``vexact check`` takes from ``--preset`` only (no flag of their own)."""

CHECK_THREADS = 1
"""``vexact check``'s default generation threads."""


def _check_arguments(p: argparse.ArgumentParser) -> None:
    from .engine.presets import PRESET_NAMES
    from .real.check import CHECK_PRESET, CheckSettings

    p.add_argument("--preset", choices=PRESET_NAMES, default=CHECK_PRESET,
                   help=f"named shape of the random model (default {CHECK_PRESET}); size flags below win over it")
    for flag, what in _CHECK_SIZES.items():
        p.add_argument("--" + flag.replace("_", "-"), type=_positive_int, default=None, help=what + " (default: the "
                       "preset's)")
    p.add_argument("--num-prompts", type=_positive_int, default=24, help="random prompts to generate from")
    p.add_argument("--max-prompt-len", type=_positive_int, default=40,
                   help="longest random prompt (lengths are 1..N, so batches are ragged)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--dtype", default="float32",
                   help="float32 (fp32) | bfloat16 (bf16) | all (default float32)")
    p.add_argument("--backend", default="exact,native",
                   help="comma list of backends: exact, native, triton (default exact,native; triton without a GPU "
                        "runs in the Triton interpreter: very slow)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random model, prompts and sampling")
    p.add_argument("--threads", type=_positive_int, default=CHECK_THREADS,
                   help=f"torch threads for generation (default {CHECK_THREADS}: the check's small ops run fastest "
                        "on one thread, above all on a busy host; the host probes verify the machine's thread count "
                        "against 1 thread all the same, see --verbose)")
    p.add_argument("--scoring-threads", type=_thread_list, default=(), metavar="N[,M...]",
                   help="torch threads for the training-path scoring, e.g. 1,3: every rollout is rescored at each "
                        "(default: the generation's)")
    # defaults as the flag's own text (argparse parses it with the flag's type), so --help and the docs show it so
    p.add_argument("--batch-sizes", type=_batch_list, default=_batch_text(CheckSettings.batch_sizes),
                   help="generation batch sizes, each a positive integer or all (default "
                        f"{_batch_text(CheckSettings.batch_sizes)}, as vexact.testing.check_paths)")
    p.add_argument("--micro-batch-sizes", type=_batch_list, default=_batch_text(CheckSettings.micro_batch_sizes),
                   help="scoring micro-batch sizes, each a positive integer or all (default "
                        f"{_batch_text(CheckSettings.micro_batch_sizes)}, as vexact.testing.check_paths)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file (with every "
                   "op's path and host probe)")
    _add_device(p, "cpu; cuda runs the exact backend as the compiled Triton kernels")
    p.add_argument("--verbose", action="store_true", help="print the path each op took and what each host probe "
                   "found (a table per exact backend) instead of one line per backend")
    _add_quiet(p)
    p.set_defaults(func=_cmd_check)


def check_writable(path: Path, flag: str) -> None:
    """A ValueError naming ``flag`` unless ``path`` can be written (its folders are made; a file this probe creates is
    removed again): a command that writes its results at the end finds out before its work, not after it."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {path}: {e.strerror or e}") from None
    if not existed:
        path.unlink()


DEVICE_COMMANDS = ("run", "sweep", "demo", "check", "measure", "locate", "meter", "bench")
"""The commands that take ``--device`` (``_add_device``)."""


def _device_name(text: str) -> str:
    from .engine.devices import DeviceError, check_device_name

    try:
        return check_device_name(text, "--device")
    except DeviceError as err:
        raise argparse.ArgumentTypeError(err.problem) from None


def _add_device(p: argparse.ArgumentParser, default: str) -> None:
    """``--device`` (one helper for every command in ``DEVICE_COMMANDS``); ``default`` says what its absence
    means for the command. Unset it is None: the command keeps its own default (a run: the config's ``device``)."""
    from .engine.devices import DEVICE_HELP

    p.add_argument("--device", type=_device_name, default=None, metavar="DEVICE",
                   help=f"{DEVICE_HELP}; cuda where there is no CUDA is an error (default: {default})")


def _device_overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` items for a config-driven command: ``--device X`` is ``--set device=X``."""
    return [f"device={args.device}"] if args.device else []


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress output (on a terminal a progress bar, "
                   "otherwise a [k/N] line now and then, with elapsed time and ETA)")


def _check_shape(args: argparse.Namespace) -> dict:
    """The random model's shape: ``--preset``'s sizes, with the size flags given explicitly winning."""
    from .engine.presets import preset_values
    from .real.check import CheckSettings

    preset = preset_values(args.preset)
    shape = {k: preset[k] for k in _CHECK_SIZES if k in preset}
    shape["vocab_size"] = preset.get("vocab_size", CheckSettings.vocab_size)  # testbed has none: 256 ids
    shape["tie_embeddings"] = preset.get("tie_embeddings", False)
    shape.update({k: preset[k] for k in _CHECK_PRESET_ONLY if k in preset})  # a real-size preset's other shape
    shape.update({k: getattr(args, k) for k in _CHECK_SIZES if getattr(args, k) is not None})
    if not shape.get("num_experts"):  # an expert flag on a dense model would be silently unused
        for k in ("num_experts_per_tok", "moe_intermediate_size"):
            if getattr(args, k) is not None:
                raise ValueError(f"--{k.replace('_', '-')} sets the mixture of experts, but the model has none: give "
                                 f"--num-experts too (or --preset small_moe)")
    return shape


def _cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .engine.model import DTYPES, canonical_dtype_name, dtype_names_text, short_dtype_name
    from .progress import Progress
    from .real.check import CheckSettings, check_units, mismatched, run_check

    if args.json:  # before the check's minutes of work, not after them
        check_writable(args.json, "--json")
    dtypes = ["float32", "bfloat16"] if args.dtype == "all" else [args.dtype]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype: unsupported dtype {d!r}; expected {dtype_names_text()} or all")
    dtypes = [canonical_dtype_name(d) for d in dtypes]
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    settings = [CheckSettings(**_check_shape(args), num_prompts=args.num_prompts,
                              max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, dtype=dtype, seed=args.seed, threads=args.threads,
                              scoring_threads=args.scoring_threads,
                              batch_sizes=args.batch_sizes, micro_batch_sizes=args.micro_batch_sizes)
                for dtype in dtypes]
    total = sum(check_units(s) for s in settings) * len(backends)
    rows = []
    from .engine.devices import resolve_device

    device = resolve_device(args.device or "cpu", "--device")  # no CUDA for --device cuda: one error, before work
    # progress on stderr: stdout keeps the results and the verdict
    with Progress(make_console(stderr=True), "vexact check", total, quiet=args.quiet, min_interval=10) as progress:
        for one in settings:
            rows += run_check(one, backends, device=device, progress=progress)

    table = Table(title="vexact check: rollout log-probs vs training log-probs")
    moe = any(r.get("routing_flip_rate") is not None for r in rows)
    for col in ("backend", "dtype", "threads (gen / score)", "tokens", "bitwise equal", "mismatched", "max |Δlogp|",
                "k3 KL", *(("routing flips",) if moe else ()), "batch-inv. sampling", "s"):
        table.add_column(col, justify="right")
    for r in rows:
        style = "green" if mismatched(r) == 0 else ("red" if r["backend"] != "native" else "yellow")
        threads = f"{r['threads']} / {','.join(map(str, r['scoring_threads']))}"
        m = r["metrics"]
        flips = (f"{r['routing_flip_rate']:.3g}",) if moe else ()
        cells = [r["backend"], short_dtype_name(r["dtype"]), threads, r["tokens"], r["bitwise_equal"],
                 f"[{style}]{mismatched(r)}[/]", f"{m['mismatch/abs_dlogp_max']:.3g}", f"{m['rollout_corr/k3_kl']:.3g}",
                 *flips, r["sampling_batch_invariant"], f"{r['seconds']:.2f}"]
        table.add_row(*map(str, cells))
    console = make_console()
    console.print(table)
    for paths in {r["backend"]: r["kernel_paths"] for r in rows if r["backend"] != "native"}.values():
        if args.verbose:
            console.print(_kernel_paths_table(paths))
        else:
            console.print(_kernel_paths_line(paths), soft_wrap=True, highlight=False, markup=False)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    exact_failures = [r for r in rows if r["backend"] != "native"
                      and (mismatched(r) or not r["sampling_batch_invariant"] or r.get("routing_flip_rate"))]
    if exact_failures:
        Console(stderr=True).print("[red]exactness violated[/] for: "
                                   + ", ".join(f"{r['backend']}/{r['dtype']}" for r in exact_failures))
    console.print(check_verdict(rows), soft_wrap=True, highlight=False)
    return EXIT_FAILED if exact_failures else EXIT_OK


def check_verdict(rows: list[dict]) -> str:
    """The last line of ``vexact check``: PASS when every exact backend's rollout log-probs equal its training
    log-probs bit for bit (and sampling is batch-invariant), else FAIL naming where; native makes no promise."""
    from .real.check import mismatched

    exact = [r for r in rows if r["backend"] != "native"]
    failed = [r for r in exact if mismatched(r) or not r["sampling_batch_invariant"] or r.get("routing_flip_rate")]
    if failed:
        where = ", ".join(f"{r['backend']}/{r['dtype']} ({mismatched(r)} of {r['tokens']} tokens "
                          f"differ{'' if r['sampling_batch_invariant'] else ', sampling not batch-invariant'}"
                          f"{', MoE routing differs' if r.get('routing_flip_rate') else ''})"
                          for r in failed)
        return f"FAIL: exactness violated on this machine: {where}"
    if not exact:
        return "PASS (vacuous): only the native backend was checked, and it makes no bitwise promise"
    tokens = sum(r["tokens"] for r in exact)
    paths = ", ".join(sorted({f"{r['backend']}/{r['dtype']}" for r in exact}))
    return f"PASS: rollout log-probs == training log-probs bit for bit on {paths} ({tokens} of {tokens} tokens)"


def _kernel_paths_line(paths: dict) -> str:
    """One line per exact backend: how many ops took each path, and what the host probes found at which thread
    counts (the per-op table is ``--verbose``'s)."""
    by_path: dict[str, int] = {}
    for info in paths["ops"].values():
        by_path[info["path"]] = by_path.get(info["path"], 0) + 1
    line = f"{paths['backend']} backend ({paths['kernels']}): ops by path: " + ", ".join(
        f"{path} {count}" for path, count in by_path.items())
    probed = [p for p in paths["probes"] if p["passed"] is not None]
    if probed:
        failed = [p for p in probed if not p["passed"]]
        threads = ",".join(map(str, sorted({t for p in probed for t in p["threads_checked"]})))
        line += (f"; host probes: {len(probed) - len(failed)} of {len(probed)} passed (threads {threads})"
                 + (f", failed: {', '.join(p['property'] + ': ' + p['shape_class'] for p in failed)}" if failed
                    else ""))
    if low := paths.get("library_dtype_gemm"):  # the exact CPU kernels' bf16 GEMM classes: the host's GEMM or fp32
        on_host = sum(c["path"] != "fp32-upcast" for c in low)
        line += f"; bf16 GEMM classes: {on_host} on the host's bf16 GEMM, {len(low) - on_host} in fp32"
    return line + " (per op: --verbose)"


def _kernel_paths_table(paths: dict) -> Table:
    """One row per op: the path it took on this host and, for probed ops, each shape class's verdict."""
    from rich.table import Table

    verdicts = {f"{p['property']}: {p['shape_class']}": p for p in paths["probes"]}
    mode = f", guard mode {paths['mode']}" if "mode" in paths else ""
    if "loops" in paths:  # the exact CPU kernels' compiled loops (kernels/compiled_loops.py), or the torch ops
        mode += f", loops: {paths['loops']['path']}"
    table = Table(title=f"{paths['backend']} backend ({paths['kernels']}{mode}): path per op")
    for col in ("op", "path", "host probes (shape class: verdict)"):
        table.add_column(col)
    for op, info in paths["ops"].items():
        probes = []
        for shape_class in info.get("shape_classes", []):
            p = verdicts[shape_class]
            verdict = "not probed" if p["passed"] is None else ("passed" if p["passed"] else f"FAILED: {p['failure']}")
            threads = ",".join(map(str, p["threads_checked"]))
            path = f", path {p['path']}" if "fallback" in p else ""  # a bf16 GEMM class: which GEMM it runs
            probes.append(f"{shape_class}: {verdict}" + (f" (threads {threads}{path})" if threads else path))
        style = "yellow" if info["path"] in ("fixed-order", "mixed") else ""
        table.add_row(op, f"[{style}]{info['path']}[/]" if style else info["path"], "\n".join(probes) or "-")
    return table


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="experiment YAML (see experiments/), or with --resume a run directory "
                   "(its own config.yaml is used: no --set to repeat)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optimizer.lr=1e-4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last intact checkpoint "
                   "(refused if the config differs; a finished run is left as it is unless steps grew)")
    p.add_argument("--allow-change", dest="allow_changes", action="append", default=[], metavar="KEY",
                   help="with --resume: let KEY differ from the run's config.yaml (steps, logging.*); "
                        "recorded in config_changes.jsonl")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="data-parallel ranks on this machine, launched by torch.distributed's elastic launcher "
                        "(default 1: this process). N must be a power of two dividing distributed.leaves; the "
                        "results are bitwise those of N=1; on GPUs one rank per GPU over NCCL. On several machines "
                        "use torchrun -m vexact run")
    _add_device(p, "the config's device key, itself cpu by default")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from .engine.devices import rank_device
    from .rl.data_parallel import DataParallel, check_leaves
    from .rl.tasks import check_memory
    from .rl.trainer import Trainer, run_dir_for

    args.overrides = [*args.overrides, *_device_overrides(args)]  # the ranks get it as a --set too
    cfg = _run_config(args)
    device = rank_device(cfg.device)  # no CUDA for device: cuda is one error here, before any rank starts
    check_memory(cfg)  # before anything is allocated: an absurd model size is one error naming the sizes
    if args.nproc > 1:
        check_leaves(cfg.distributed.leaves, args.nproc)  # before starting any rank
    _check_run_dir(args, cfg)
    console = make_console()
    if args.nproc > 1:
        return _launch_ranks(args, cfg, console)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)  # NCCL's collectives run on this rank's own GPU
    # torchrun's ranks (gloo on the CPU, NCCL on GPUs), or this process alone
    ranks = DataParallel.from_environment(cfg.distributed.reduce, device)
    try:
        if ranks.is_main:
            console.print(f"vexact run [bold]{cfg.name}[/] -> {run_dir_for(cfg)}"
                          + (f" on {ranks.world_size} ranks" if ranks.world_size > 1 else ""))
        summary = Trainer(cfg, console, ranks).run(resume=args.resume, allow_changes=tuple(args.allow_changes))
    except BaseException:
        ranks.close(wait=False)
        raise
    ranks.close(wait=summary["status"] != "interrupted")
    if ranks.is_main:
        _print_run_summary(cfg, summary, console)
    code = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(summary["status"], EXIT_FAILED)
    if ranks.world_size > 1:
        # A rank's work is written and fsynced by now. Interpreter finalization can still abort it (SIGABRT,
        # "terminate called without an active exception": gloo worker threads torn down late), which turned a
        # finished run into a failed rank now and then; a rank leaves without finalization instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_config(args: argparse.Namespace):
    """The RunConfig of ``vexact run``: from CONFIG.yaml and --set, or, given a run directory with --resume, from the
    config.yaml the run saved (the --set given now apply on top: with --allow-change, e.g. more steps)."""
    import dataclasses

    from .rl.config import load_config
    from .rl.trainer import holds_run

    if not args.config.is_dir():
        return load_config(args.config, args.overrides)
    run_dir = args.config
    saved = run_dir / "config.yaml"
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
    return dataclasses.replace(load_config(saved, args.overrides), output_dir=str(run_dir))


def _check_run_dir(args: argparse.Namespace, cfg) -> None:
    """Before any work (and before any rank starts): ``--resume`` needs a run to resume, and a new run needs a
    directory without one; each refusal spells out the commands that would work."""
    from .records.runlog import LOCK_FILE, run_lock
    from .rl.data_parallel import DataParallel
    from .rl.trainer import foreign_entries, holds_results, holds_run, run_dir_for

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
                         f"checkpoint); to start it: {_run_command(args, resume=False)}")
    if not args.resume and holds_results(run_dir):
        key, value = _free_run_name(cfg)
        raise ValueError(f"{run_dir} already holds a run; to continue it: vexact run {shlex.quote(str(run_dir))} "
                         f"--resume; to start another beside it: {_run_command(args, extra=f'{key}={value}')}")


def _free_run_name(cfg) -> tuple[str, str]:
    """The ``--set`` that gives a new run a free directory: name-2, name-3, ... (or output_dir-2, ... when the
    config names its output_dir)."""
    from .rl.trainer import holds_results

    key, base = ("output_dir", cfg.output_dir) if cfg.output_dir else ("name", cfg.name)
    parent = Path(".") if cfg.output_dir else Path("runs")
    n = 2
    while holds_results(parent / f"{base}-{n}"):
        n += 1
    return key, f"{base}-{n}"


def _run_command(args: argparse.Namespace, resume: bool = True, extra: str | None = None) -> str:
    """This ``vexact run`` command as a shell line (``extra``: one more --set, replacing any earlier one of its key)."""
    overrides = list(args.overrides)
    if extra is not None:
        key = extra.partition("=")[0]
        overrides = [o for o in overrides if o.partition("=")[0].strip() != key] + [extra]
    words = ["vexact", "run", str(args.config), *(f"--set={o}" for o in overrides),
             *(["--resume"] if resume and args.resume else []), *(f"--allow-change={k}" for k in args.allow_changes),
             *([f"--nproc={args.nproc}"] if args.nproc > 1 else [])]
    return shlex.join(words)


def _launch_ranks(args: argparse.Namespace, cfg, console: Console) -> int:
    """``vexact run --nproc N``: the same command as N ranks; the exit code follows the run's summary.json."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .rl.data_parallel import launch
    from .rl.trainer import run_dir_for

    rank_args = ["-m", "vexact", "run", str(args.config), *(f"--set={o}" for o in args.overrides),
                 *(["--resume"] if args.resume else []), *(f"--allow-change={k}" for k in args.allow_changes)]
    try:
        launch(args.nproc, rank_args, threads=cfg.threads)
    except (KeyboardInterrupt, SignalException):  # the ranks got the signal too; rank 0 recorded what finished
        console.print("[yellow]interrupted[/]: the ranks stopped; finished steps are in metrics.jsonl; continue "
                      "with --resume")
        return EXIT_INTERRUPTED
    except ChildFailedError as err:
        summary_path = run_dir_for(cfg) / "summary.json"
        status = json.loads(summary_path.read_text()).get("status") if summary_path.exists() else None
        if status in ("interrupted", "stopped"):  # a recorded outcome, already printed by rank 0
            return EXIT_INTERRUPTED if status == "interrupted" else EXIT_FAILED
        rank, failure = err.get_first_failure()
        console.print(f"[red]rank {rank} failed[/] (exit code {failure.exitcode}); its error is printed above")
        return EXIT_FAILED
    return EXIT_OK


def _print_run_summary(cfg, summary: dict, console: Console) -> None:
    from rich.table import Table

    from .rl.trainer import run_dir_for

    keys = ("status", "reason", "steps_completed", "collapse.initial_reward", "collapse.final_reward",
            "eval_reward_first", "eval_reward_last", "eval_greedy_accuracy_first", "eval_greedy_accuracy_last",
            "collapse.mean_k3_kl", "min_bitwise_equal_frac", "mean_step_seconds")
    table = Table(title=f"summary: {run_dir_for(cfg) / 'summary.json'}")
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


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", type=Path, help="sweep YAML: base config + grid")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of every point, e.g. --set optimizer.lr=1e-4 (repeatable; as vexact "
                        "run --set, applied over the sweep's base and set, under its grid and variants). Recorded in "
                        "sweep.json: a re-run with other --set values is refused")
    p.add_argument("--jobs", type=_positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--output-dir", type=Path, default=None, help="override the sweep's output_dir")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help="run only the points whose grid key KEY (variant included) has one of these values "
                        "(repeatable: a point must match each KEY named; a KEY given twice keeps the values of "
                        "both). An adaptive round: the rest runs later into the "
                        "same directory, finished points are skipped")
    p.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    _add_device(p, "each point's device key; with cuda and --jobs N on several GPUs each worker its own GPU")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: this machine's processes (default); ray: one Ray task per point, CPUs per task = "
                        "the config's threads (default 1); needs pip install 'vexact[ray]'")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="with --executor ray: an existing cluster (auto or HOST:PORT); default: a private "
                        "single-node Ray bound to 127.0.0.1")
    _add_quiet(p)
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .lab.sweep import load_sweep_spec

    overrides = [*args.overrides, *_device_overrides(args)]
    return _sweep_and_report(load_sweep_spec(args.sweep, args.output_dir, overrides), args.jobs,
                             not args.no_report, "vexact sweep [bold]{name}[/]: {n} points -> {out}", args.executor,
                             args.address, args.quiet, args.only)


def _sweep_and_report(spec, jobs: int, report: bool, headline: str, executor: str = "local",
                      address: str | None = None, quiet: bool = False, only: list[str] | None = None) -> int:
    """Run a sweep, then print its report; exit code 1 if any point failed."""
    from .lab.sweep import run_sweep, select_points
    from .rl.tasks import check_memory

    select_points(spec, only)  # a bad --only is one error before anything is printed or run

    for shape in {json.dumps(p.config.to_dict()["model"], sort_keys=True): p.config for p in spec.points}.values():
        check_memory(shape)  # before any point allocates: an absurd model size is one error
    from .engine.devices import resolve_device

    for device in sorted({p.config.device for p in spec.points}):
        resolve_device(device)  # device: cuda where there is none: one error before any point runs
    console = make_console()
    if not quiet:
        console.print(headline.format(name=spec.name, n=len(spec.points), out=spec.output_dir))
    statuses = run_sweep(spec, jobs=jobs, console=console, executor=executor, address=address, quiet=quiet,
                         only=only)
    if report:
        from .lab.report import write_report

        write_report(spec.output_dir, console)
    return EXIT_FAILED if any(status == "failed" for status in statuses.values()) else EXIT_OK


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, metavar="DIR",
                   help="a vexact sweep output (has sweep.json) or a vexact run output (has metrics.jsonl)")
    p.add_argument("--skip-damaged", action="store_true",
                   help="report without damaged or unreadable points (named in the output) instead of refusing")
    p.set_defaults(func=lambda args: _cmd_report(args.directory, args.skip_damaged))


def _cmd_report(directory: Path, skip_damaged: bool = False) -> int:
    from .lab.run_report import write_any_report

    write_any_report(directory, make_console(), skip_damaged)  # prints the one "report written to" line itself
    return EXIT_OK


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", type=Path, default=Path("runs") / "demo",
                   help="where the sweep's runs and report go (default runs/demo; re-running resumes it)")
    p.add_argument("--jobs", type=_positive_int, default=1, help="worker processes, one run each (default 1)")
    _add_device(p, "cpu, the demo's own")
    _add_quiet(p)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .lab.sweep import load_sweep_spec

    spec = load_sweep_spec(Path(__file__).resolve().parent / "lab" / "demo_sweep.yaml", args.output_dir,
                           _device_overrides(args))
    return _sweep_and_report(spec, args.jobs, True, "vexact demo: {n} runs of logit-scale injection -> {out}",
                             quiet=args.quiet)


def _measure_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="checkpoint directory (config.json + "
                   "safetensors); python -m vexact.real.measure --make-tiny-checkpoint DIR writes a tiny one")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, metavar="FILE", help="one prompt per line: text if the checkpoint "
                        "has a tokenizer, else whitespace-separated token ids")
    source.add_argument("--random-prompts", type=_positive_int, metavar="N", help="N random token-id prompts "
                        "(the flag vexact locate uses too, where --random is a random model)")
    source.add_argument("--random", type=_positive_int, metavar="N", dest="random_prompts", action=_DeprecatedFlag,
                        new="--random-prompts", help="deprecated spelling of --random-prompts")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens generated per prompt")
    p.add_argument("--rollout", default="native:bf16", help="path that generates: BACKEND:DTYPE with BACKEND in "
                   "exact, native, triton, hf and DTYPE in fp32 (float32), bf16 (bfloat16) (default native:bf16)")
    p.add_argument("--train", default="exact:fp32", help="path that rescores the tokens, BACKEND:DTYPE as for "
                   "--rollout (default exact:fp32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --random-prompts prompts and of sampling")
    p.add_argument("--max-prompt-len", type=_positive_int, default=16, help="longest --random-prompts prompt")
    p.add_argument("--token-ids", action="store_true", help="read --prompts as token ids even with a tokenizer")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="generation batch size (default all)")
    p.add_argument("--micro-batch-size", type=_positive_int, default=None, help="scoring micro-batch (default all)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    p.add_argument("--png", type=Path, default=None, help="also plot Δlogp histogram and |Δlogp| vs probability")
    p.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 unless every token is bitwise equal")
    _add_device(p, "cpu")
    p.add_argument("--no-full-vocab", dest="full_vocab", action="store_false",
                   help="skip the full next-token distribution comparison (mismatch/full_vocab_*: one more forward "
                        "per path)")
    p.set_defaults(func=_cmd_measure)


def _cmd_measure(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .real.measure import MeasureSettings, print_measure, run_measure, write_json, write_png

    settings = MeasureSettings(model=args.model, rollout=args.rollout, train=args.train, prompts_file=args.prompts,
                               random_prompts=args.random_prompts, max_prompt_len=args.max_prompt_len,
                               token_ids=args.token_ids, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos,
                               batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                               threads=args.threads, full_vocab=args.full_vocab, device=args.device or "cpu")
    result = run_measure(settings)
    console = make_console()
    print_measure(result, console)
    written = [f(result, path) for f, path in ((write_json, args.json), (write_png, args.png)) if path]
    if written:
        console.print("wrote " + ", ".join(str(path) for path in written))
    if args.fail_on_mismatch and result.summary["bitwise_equal"] != result.summary["tokens"]:
        Console(stderr=True).print(f"[red]mismatch:[/] {result.summary['tokens'] - result.summary['bitwise_equal']} "
                                   f"of {result.summary['tokens']} tokens differ")
        return EXIT_FAILED
    return EXIT_OK


def _benchmarks_module(name: str):
    """``benchmarks.<name>`` from the source checkout (benchmarks/ sits next to vexact/ and is not installed)."""
    import importlib

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__init__.py").exists():
        raise ValueError(f"vexact bench needs a source checkout: {root / 'benchmarks'} not found")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"benchmarks.{name}")


BENCHMARKS = {
    "kernels": "op by op at model shapes, fp32/bf16, fwd and fwd+bwd, matmul GFLOP/s",
    "end_to_end": "rollout, decode step, training fwd+bwd, RL step",
    "host_guard": "the fixed-order fallback's cost against the probed fast path",
    "data_parallel": "the fixed-tree gradient reduction against a plain all_reduce, and RL steps with --nproc",
    "compare": "throughput and peak memory of vexact compare on a synthetic dump",
    "op_count": "aten calls of one RL step per vexact function, exact and native (where per-op overhead comes from)",
    "peer_decode": "decode tokens/s of vexact's rollout (exact, native) beside vLLM's CPU build on the same model",
    "tables": "markdown tables from their JSON files",
}
"""``vexact bench WHICH``: benchmarks.WHICH, each with what it measures (the choices and the help)."""


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Runs python -m benchmarks.<which> with the remaining options (vexact bench kernels --help "
                     "lists them).")
    p.add_argument("which", choices=tuple(BENCHMARKS),
                   help="; ".join(f"{name}: {what}" for name, what in BENCHMARKS.items()))
    _add_device(p, "the benchmark's own: cuda when available for kernels and end_to_end; written before WHICH, "
                   "or after it as that benchmark's --device")
    p.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    options = [*args.options, *(["--device", args.device] if args.device else [])]
    return _benchmarks_module(args.which).main(options, prog=f"vexact bench {args.which}")


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    from .real import compare

    compare.add_arguments(p)
    p.formatter_class = _LaidOutDescription
    p.set_defaults(func=compare.main)


def _locate_arguments(p: argparse.ArgumentParser) -> None:
    from .real import locate

    locate.add_arguments(p)
    _add_device(p, "cpu")
    p.set_defaults(func=locate.main)


def _meter_arguments(p: argparse.ArgumentParser) -> None:
    from .lab import bias_meter

    bias_meter.add_arguments(p)
    _add_device(p, "the base config's device key")
    p.set_defaults(func=bias_meter.main)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "check": ("verify rollout log-probs == training log-probs bit for bit on this machine", _check_arguments),
    "run": ("run one RL experiment from a YAML config", _run_arguments),
    "sweep": ("run a grid of experiments (resumable); see experiments/*sweep*.yaml", _sweep_arguments),
    "report": ("tables and plots for a sweep directory (DIR/report/: summary.csv, table.md, ...) or a single run "
               "directory (DIR/report/: report.json, run_curves.png)", _report_arguments),
    "demo": ("a small injected-mismatch sweep with its report (a few minutes on 2 cores)", _demo_arguments),
    "measure": ("measure natural TIM between two computation paths on a local HF checkpoint", _measure_arguments),
    "compare": ("compare log-probs dumped by your own rollout engine and trainer (a CI gate)", _compare_arguments),
    "locate": ("find the first op whose output differs between two computation paths", _locate_arguments),
    "meter": ("gradient bias of mismatched rollouts vs exact ones, per horizon and source (no training)",
              _meter_arguments),
    "bench": ("the price of exactness: exact / native time ratios (kernels, end to end)", _bench_arguments),
}
"""The subcommands, in ``--help``'s order: {name: (the one-line help, the function that adds its arguments)}."""


def build_parser(lazy: bool = False) -> argparse.ArgumentParser:
    """The ``vexact`` parser. ``lazy``: add a subcommand's arguments only when that subcommand parses or prints its
    help (what ``main`` uses, so ``vexact --help`` and ``vexact run --help`` import no command's module); else
    every subcommand is complete now (the docs and tests walk its arguments)."""
    parser = _Parser(prog="vexact", description="Training-inference mismatch diagnostics for LLM RL.",
                     epilog=exit_codes_help())
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print vexact's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, arguments) in COMMANDS.items():
        command = sub.add_parser(name, epilog=exit_codes_help(name), help=help_text)
        if lazy:
            command.arguments = arguments
        else:
            arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(lazy=True).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad input: one clear line, no traceback
        _error_line("error", str(err), "red")
        return EXIT_BAD_INPUT
    except OSError as err:  # a path that cannot be read or written (permissions, a file where a folder must be, ...)
        from .records.atomic import ENVIRONMENT_ERRNOS, WriteFailed

        where = f": {err.filename}" if err.filename else ""
        _error_line("error", str(err) if isinstance(err, WriteFailed) else f"{err.strerror or err}{where}", "red")
        # a full disk or a file-size limit is the machine's failure, not the input's: its own exit code
        return EXIT_ENVIRONMENT if err.errno in ENVIRONMENT_ERRNOS else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _error_line("interrupted", "", "yellow")
        return EXIT_INTERRUPTED


def _error_line(label: str, message: str, colour: str) -> None:
    """One unwrapped stderr line; the message is printed as is (no markup: paths and lists contain brackets)."""
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    console.print(f"[{colour}]{label}[/]" + (":" if message else ""), end=" " if message else "\n")
    if message:
        console.print(message, markup=False, highlight=False)


if __name__ == "__main__":
    sys.exit(main())
