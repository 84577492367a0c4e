"""The ``vexact`` command line. Each subcommand lives in its own module; this file only parses."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .cli_base import (  # what every command shares; the CLI's names for them too (vexact.cli.EXIT_FAILED, ...)
    EXIT_BAD_INPUT,
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    add_prompt_length_flags,
    add_prompts_flag,
    add_threads_flag,
    check_outputs,
    check_prompt_length_flags,
    check_sampling_seed,
    interrupted_exit_code,
    launched_rank,
    leave_error_for_launcher,
    make_console,
    print_error_line,
    prompt_source,
    stop_on_sigterm,
    stop_signal,
)
from .cli_base import non_negative_int as _non_negative_int
from .cli_base import positive_int as _positive_int
from .sweeps import EXECUTORS, MAX_JOBS

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
            "the file; out of memory, or compiled loops VEXACT_CPU_LOOPS=compiled demands that do not build: one "
            f"'error:' line); {EXIT_INTERRUPTED} interrupted (Ctrl-C; "
            f"{EXIT_TERMINATED} for SIGTERM, a job scheduler's stop; finished work is kept"
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

    # argparse's own _split_lines (help) and _fill_text (description, epilog), but never breaking a line at a hyphen:
    # a flag (--allow-change) or a word (re-running) stays whole, whatever the terminal's width
    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


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
    from .real.check import CHECK_PRESET, WIDE_HIDDEN, CheckSettings

    p.add_argument("--preset", choices=PRESET_NAMES, default=CHECK_PRESET,
                   help=f"named shape of the random model (default {CHECK_PRESET}); size flags below win over it")
    for flag, what in _CHECK_SIZES.items():
        p.add_argument("--" + flag.replace("_", "-"), type=_positive_int, default=None, help=what + " (default: the "
                       "preset's)")
    p.add_argument("--wide-hidden", type=_non_negative_int, default=WIDE_HIDDEN, metavar="N",
                   help=f"also check a one-layer model of hidden size N (default {WIDE_HIDDEN}; a multiple of 128) "
                        "where the checked model is narrower: a host's GEMM may switch kernels only at real widths, "
                        "as one did at 512; 0: only the checked model")
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


def _cmd_check(args: argparse.Namespace) -> int:
    from .real.check_report import check_command

    return check_command(args, _check_shape(args))


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
    from .rl.run_launch import run_command

    args.overrides = [*args.overrides, *_device_overrides(args)]  # the ranks get it as a --set too
    return run_command(args)


def _jobs(text: str) -> int:
    """An argparse type for ``--jobs``: a positive integer up to ``MAX_JOBS``, else argparse's one error."""
    jobs = _positive_int(text)
    if jobs > MAX_JOBS:
        raise argparse.ArgumentTypeError(f"at most {MAX_JOBS} worker processes, got {jobs}")
    return jobs


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", type=Path, help="sweep YAML: base config + grid")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of every point, e.g. --set optimizer.lr=1e-4 (repeatable; as vexact "
                        "run --set, applied over the sweep's base and set, under its grid and variants). Recorded in "
                        "sweep.json: a re-run with other --set values is refused")
    p.add_argument("--jobs", type=_jobs, default=1, help=f"worker processes (default 1, at most {MAX_JOBS})")
    p.add_argument("--output-dir", type=Path, default=None, help="override the sweep's output_dir")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help="run only the points whose grid key KEY (variant included) has one of these values "
                        "(repeatable: a point must match each KEY named; a KEY given twice keeps the values of "
                        "both). An adaptive round: the rest runs later into the "
                        "same directory, finished points are skipped")
    p.add_argument("--point", dest="points", action="append", default=[], metavar="NAME",
                   help="run only the point of this name, as sweep.json and its folder spell it (repeatable; with "
                        "--only, the named points that also match it): a round that is no cross product of values")
    p.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    _add_device(p, "each point's device key; with cuda and --jobs N on several GPUs each worker its own GPU")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: this machine's processes (default); ray: one Ray task per point, CPUs per task = "
                        "the config's threads (default 1); needs pip install 'vexact[ray]'")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="with --executor ray: an existing cluster (auto or HOST:PORT); default: a private "
                        "single-node Ray bound to 127.0.0.1")
    _add_quiet(p)
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .sweeps.sweep import load_sweep_spec

    overrides = [*args.overrides, *_device_overrides(args)]
    return _sweep_and_report(load_sweep_spec(args.sweep, args.output_dir, overrides), args.jobs,
                             not args.no_report, "vexact sweep [bold]{name}[/]: {n} points -> {out}", args.executor,
                             args.address, args.quiet, args.only, args.points)


def _sweep_and_report(spec, jobs: int, report: bool, headline: str, executor: str = "local",
                      address: str | None = None, quiet: bool = False, only: list[str] | None = None,
                      names: list[str] | None = None) -> int:
    """Run a sweep, then print its report; exit code 1 if any point failed."""
    from rich.markup import escape

    from .rl.tasks import check_memory
    from .sweeps.sweep import run_sweep, select_points

    select_points(spec, only, names)  # a bad --only or --point is one error before anything is printed or run

    for shape in {json.dumps(p.config.to_dict()["model"], sort_keys=True): p.config for p in spec.points}.values():
        check_memory(shape)  # before any point allocates: an absurd model size is one error
    from .engine.devices import resolve_device

    for device in sorted({p.config.device for p in spec.points}):
        resolve_device(device)  # device: cuda where there is none: one error before any point runs
    console = make_console()
    if not quiet:
        console.print(headline.format(name=escape(spec.name), n=len(spec.points), out=escape(str(spec.output_dir))))
    statuses = run_sweep(spec, jobs=jobs, console=console, executor=executor, address=address, quiet=quiet,
                         only=only, names=names)
    if report:
        from .reports.sweep_report import write_report

        write_report(spec.output_dir, console)
    return EXIT_FAILED if any(status == "failed" for status in statuses.values()) else EXIT_OK


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, metavar="DIR",
                   help="a vexact sweep output (has sweep.json) or a vexact run output (has metrics.jsonl)")
    p.add_argument("--skip-damaged", action="store_true",
                   help="report without damaged or unreadable points (named in the output) instead of refusing")
    p.set_defaults(func=lambda args: _cmd_report(args.directory, args.skip_damaged))


def _cmd_report(directory: Path, skip_damaged: bool = False) -> int:
    from .reports.run_report import write_any_report

    write_any_report(directory, make_console(), skip_damaged)  # prints the one "report written to" line itself
    return EXIT_OK


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", type=Path, default=Path("runs") / "demo",
                   help="where the sweep's runs and report go (default runs/demo; re-running resumes it)")
    p.add_argument("--jobs", type=_jobs, default=1,
                   help=f"worker processes, one run each (default 1, at most {MAX_JOBS})")
    _add_device(p, "cpu, the demo's own")
    _add_quiet(p)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .sweeps.sweep import load_sweep_spec

    spec = load_sweep_spec(Path(__file__).resolve().parent / "sweeps" / "demo_sweep.yaml", args.output_dir,
                           _device_overrides(args))
    return _sweep_and_report(spec, args.jobs, True, "vexact demo: {n} runs of logit-scale injection -> {out}",
                             quiet=args.quiet)


def _measure_arguments(p: argparse.ArgumentParser) -> None:
    # The defaults are MeasureSettings' (their one source), imported here, when measure parses or prints its help
    # (main's lazy parser), not when cli.py is: it imports torch.
    from .real.measure import MeasureSettings as defaults

    p.description = ("Generates with one computation path of a local checkpoint, rescores the same tokens with "
                     "another and reports their per-token log-prob mismatch (k3 KL, |Δlogp|, bitwise-equal "
                     "fraction). No training and no gradient: for how much a mismatch moves the RL policy gradient, "
                     "see vexact meter.")
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="checkpoint directory (config.json + "
                   "safetensors); python -m vexact.real.measure --make-tiny-checkpoint DIR writes a tiny one")
    source = p.add_mutually_exclusive_group(required=True)
    add_prompts_flag(source)
    source.add_argument("--random-prompts", type=_positive_int, metavar="N", help="N random token-id prompts "
                        "(the flag vexact locate uses too, where --random is a random model)")
    source.add_argument("--random", type=_positive_int, metavar="N", dest="random_prompts", action=_DeprecatedFlag,
                        new="--random-prompts", help="deprecated spelling of --random-prompts")
    p.add_argument("--max-new-tokens", type=_positive_int, default=defaults.max_new_tokens,
                   help="tokens generated per prompt")
    p.add_argument("--rollout", default=defaults.rollout, help="path that generates: BACKEND:DTYPE with BACKEND in "
                   "exact, native, triton, hf and DTYPE in fp32 (float32), bf16 (bfloat16) "
                   f"(default {defaults.rollout})")
    p.add_argument("--train", default=defaults.train, help="path that rescores the tokens, BACKEND:DTYPE as for "
                   f"--rollout (default {defaults.train})")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="sampling temperature (0 = greedy)")
    # --seed, --max-prompt-len and --device parse to None unless given: _cmd_measure leaves MeasureSettings' default
    p.add_argument("--seed", type=int, default=None, help="seed of the --random-prompts prompts and of sampling "
                   f"(default: {defaults.seed})")
    add_prompt_length_flags(p, defaults.max_prompt_len, none_unless_given=True)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="generation batch size (default all)")
    p.add_argument("--micro-batch-size", type=_positive_int, default=None, help="scoring micro-batch (default all)")
    add_threads_flag(p)
    p.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    p.add_argument("--png", type=Path, default=None, help="also plot Δlogp histogram and |Δlogp| vs probability")
    p.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 unless every token is bitwise equal")
    _add_device(p, defaults.device)
    p.add_argument("--no-full-vocab", dest="full_vocab", action="store_false",
                   help="skip the full next-token distribution comparison (mismatch/full_vocab_*: one more forward "
                        "per path)")
    p.set_defaults(func=_cmd_measure)


def _cmd_measure(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .real.measure import MeasureSettings, print_measure, run_measure, write_json, write_png

    check_outputs({"--json": args.json, "--png": args.png}, {"--prompts": args.prompts, "--model": args.model})
    # --max-prompt-len and --seed parse to None unless given, so that where they would do nothing they are refused
    source = prompt_source(args.prompts)
    check_prompt_length_flags(source, args.max_prompt_len, args.token_ids)
    check_sampling_seed(source, args.seed, args.temperature)
    given = {key: getattr(args, key) for key in ("max_prompt_len", "seed", "device") if getattr(args, key) is not None}
    settings = MeasureSettings(model=args.model, rollout=args.rollout, train=args.train, prompts_file=args.prompts,
                               random_prompts=args.random_prompts, **given,  # else MeasureSettings' defaults
                               token_ids=args.token_ids, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, ignore_eos=args.ignore_eos,
                               batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                               threads=args.threads, full_vocab=args.full_vocab)
    result = run_measure(settings)
    console = make_console()
    print_measure(result, console)
    written = [f(result, path) for f, path in ((write_json, args.json), (write_png, args.png)) if path]
    if written:
        console.print("wrote " + ", ".join(str(path) for path in written), markup=False)
    if args.fail_on_mismatch and result.summary["bitwise_equal"] != result.summary["tokens"]:
        Console(stderr=True).print(f"[red]mismatch:[/] {result.summary['tokens'] - result.summary['bitwise_equal']} "
                                   f"of {result.summary['tokens']} tokens differ")
        return EXIT_FAILED
    return EXIT_OK


BENCHMARKS_PACKAGE = "vexact_benchmarks"
"""The benchmarks as installed (the checkout's benchmarks/, as vexact_kernels is its kernels/): ``vexact bench``
imports them from there, wherever it runs; ``python -m benchmarks.NAME`` still runs them from a checkout."""


def _benchmarks_module(name: str):
    """``vexact_benchmarks.<name>``: the benchmark the CLI runs, from the installed package (no checkout needed)."""
    import importlib

    try:
        return importlib.import_module(f"{BENCHMARKS_PACKAGE}.{name}")
    except ModuleNotFoundError as err:
        if err.name != BENCHMARKS_PACKAGE:
            raise
        raise ValueError(f"vexact bench needs the {BENCHMARKS_PACKAGE} package, which this installation lacks "
                         "(installed before it shipped): reinstall vexact (pip install -e . in a checkout)") from None


BENCHMARKS = {
    "kernels": "op by op at model shapes, fp32/bf16, fwd, fwd+bwd and each linear gradient, matmul GFLOP/s",
    "end_to_end": "rollout, decode step, training fwd+bwd, RL step",
    "host_guard": "the fixed-order fallback's cost against the probed fast path",
    "guard_modes": "the exact CPU path in guard mode canonical against auto, interleaved in one process (what a host "
                   "whose same_bits probes fail pays)",
    "tile_heights": "the canonical arrangement's 64-row GEMM tiles at a training pass's rows against one call, and "
                    "whether taller tiles would keep their bits on this host",
    "op_swap": "each exact CPU op in turn swapped for native's, in one process: which op owns the exact path's time "
               "over native's",
    "data_parallel": "the fixed-tree gradient reduction against a plain all_reduce, and RL steps with --nproc",
    "compare": "throughput and peak memory of vexact compare on a synthetic dump",
    "op_count": "aten calls of one RL step per vexact function, exact and native (where per-op overhead comes from)",
    "bits_digest": "digests of the exact path's bits (rollout tokens, log-probs, gradients) at the benchmark shapes: "
                   "does a change alter any bit?",
    "peer_decode": "decode tokens/s of vexact's rollout (exact, native) beside vLLM's CPU build on the same model",
    "decode_profile": "where a decode step's time goes (GEMMs, attention, sampler, glue; aten calls and host reads), "
                      "with vLLM's side where it is installed",
    "gpu_triton": "on a GPU: the exact Triton kernels' exactness at small presets and their speed against native",
    "gpu_real": "on a GPU at qwen3_1_7b (and the MoE path at qwen3_30b_a3b): one part per call (--part: exactness, "
                "speed, graphed decode, profiles, tile survey, rollout, ...), merged into --out; --tables prints a "
                "record's tables",
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
    _add_device(p, locate.RUN_DEFAULTS["device"])
    p.set_defaults(func=locate.main)


def _meter_arguments(p: argparse.ArgumentParser) -> None:
    from .sweeps import bias_meter

    p.description = ("Measures how far a mismatched rollout path (an inject source of the testbed) moves the RL "
                     "policy gradient against exact rollouts, per horizon and source, at a warm-started policy "
                     "(no training). For the log-prob mismatch of your own checkpoint's two paths, see vexact "
                     "measure.")
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
    "measure": ("measure natural TIM between two computation paths on a local HF checkpoint: per-token log-prob "
                "mismatch, no RL (not meter, the RL gradient bias of an injected mismatch)", _measure_arguments),
    "compare": ("compare log-probs dumped by your own rollout engine and trainer (a CI gate)", _compare_arguments),
    "locate": ("find the first op whose output differs between two computation paths", _locate_arguments),
    "meter": ("gradient bias of mismatched rollouts vs exact ones, per horizon and source (no training; not "
              "measure, the log-prob mismatch of a real checkpoint)", _meter_arguments),
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
    """The ``vexact`` command; the exit code. ``argv`` None: this process's own command line, so the process is the
    CLI's (the ``vexact`` script, ``python -m vexact``, a ``--nproc`` rank): SIGTERM is handled for its life as
    Ctrl-C is (``stop_on_sigterm``), except in a rank a launcher started. A caller that passes ``argv`` (a test, a
    script) keeps its own SIGTERM handling."""
    if argv is None:
        stop_on_sigterm(handle=not launched_rank(os.environ))
    try:
        # parsing imports the command's module, and with it the kernels, which read their VEXACT_* settings
        args = build_parser(lazy=True).parse_args(argv)
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
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (``Terminated``): 130 or 143
        _error_line("interrupted", "", "yellow")
        return interrupted_exit_code(stop_signal(stop))
    except (MemoryError, RuntimeError) as err:
        from vexact_kernels.compiled_loops import LoopsBuildError

        if isinstance(err, LoopsBuildError):  # the machine cannot build what the setting demands
            fix = "install a C++ compiler, or" if err.compiler else "or"  # (else the error names its own fix)
            _error_line("error", f"{err}; {fix} unset VEXACT_CPU_LOOPS (auto: the torch ops where the loops do not "
                                 "build)", "red")
            return EXIT_ENVIRONMENT
        if not out_of_memory(err):
            raise
        what = " ".join(str(err).split()) or type(err).__name__
        _error_line("error", f"out of memory: {what}; choose smaller sizes (model, batch, lengths) or run on a "
                             "machine with more memory", "red")
        return EXIT_ENVIRONMENT  # the machine could not hold the work: not the input's fault as such


def out_of_memory(err: BaseException) -> bool:
    """An allocation the machine could not satisfy: Python's MemoryError, torch's CPU allocator ("can't allocate
    memory" / "not enough memory") or a GPU's ``OutOfMemoryError``."""
    text = str(err)
    return (isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
            or "DefaultCPUAllocator" in text or "can't allocate memory" in text)


def _error_line(label: str, message: str, colour: str) -> None:
    """One unwrapped stderr line (``cli_base.print_error_line``). Under ``vexact run --nproc``, only rank 0 prints an
    error line; the launcher prints the other ranks' that differ."""
    if label == "error" and leave_error_for_launcher(message):
        return
    print_error_line(message, label, colour)


if __name__ == "__main__":
    sys.exit(main())
