"""Shared benchmark machinery: model shapes, interleaved exact/native timing, machine record, JSON, table.

Every figure is a *ratio* exact/native measured in the same process: for each repetition the
exact and the native variant run back to back (their order alternating between repetitions), and
the ratio of that pair is one sample. On a shared machine, load that slows one repetition slows both
halves of the pair, so the ratio is far steadier than either time. Reported: the median ratio with
its min-max over the repetitions, plus the median times themselves.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vexact import ModelConfig
from vexact.cli_base import check_writable
from vexact.engine.devices import resolve_device as engine_resolve_device
from vexact.engine.model import DTYPES as MODEL_DTYPES
from vexact.engine.presets import preset_config
from vexact.records.runlog import write_json_atomic
from vexact.version import __version__
from vexact_kernels import EXACT_BACKENDS
from vexact_kernels.host_guard import host_cpu, mode_from_env, onednn_from_env


def experiment(name: str) -> Path:
    """The experiment YAML ``name`` a benchmark runs: the checkout's experiments/NAME, else (an installed package,
    vexact_benchmarks, has no experiments/) the copy shipped beside this module, which in the checkout is a link to
    that file (pyproject's package-data for vexact_benchmarks): one source."""
    checkout = Path(__file__).resolve().parents[1] / "experiments" / name
    return checkout if checkout.is_file() else Path(__file__).parent / name


# The experiment whose RL step the benchmarks run (the default of ``--rl-config``, see add_rl_step_arguments).
EXPERIMENT = experiment("zero_mismatch.yaml")
DTYPES = {name: MODEL_DTYPES[name] for name in ("float32", "bfloat16")}  # the model's dtypes, canonical names


@dataclass(frozen=True)
class Shape:
    """A model shape and the batch sizes the benchmarks use with it."""

    name: str
    model: ModelConfig
    decode_batch: int  # sequences decoding together (rollout batch)
    context: int  # tokens already in the cache at a decode step / prompt length
    train_batch: int  # sequences in a training forward
    train_len: int  # tokens per training sequence
    new_tokens: int  # tokens generated per sequence in the end-to-end rollout
    e2e_batch: int  # sequences in the end-to-end rollout and training benchmarks
    e2e_prompt_len: int  # prompt tokens per sequence there (0 = the default experiment's task prompts)

    def describe(self) -> dict:
        return {"name": self.name, "model": self.model.to_dict(), "decode_batch": self.decode_batch,
                "context": self.context, "train_batch": self.train_batch, "train_len": self.train_len,
                "new_tokens": self.new_tokens, "e2e_batch": self.e2e_batch, "e2e_prompt_len": self.e2e_prompt_len}


def _default_experiment_model() -> ModelConfig:
    """The policy of experiments/zero_mismatch.yaml: its model section on the task's 22-token vocabulary."""
    from vexact.rl.tasks import CharTokenizer

    return preset_config("testbed", vocab_size=CharTokenizer().vocab_size, max_seq_len=48)


def shapes() -> dict[str, Shape]:
    """Named shapes, each a model preset (``vexact.engine.presets``) with batch sizes: ``default`` (the
    zero_mismatch experiment's ``testbed`` policy: 16 prompts x 8 samples, prompts of 7-11 tokens, 20 new tokens,
    training rows of up to ~30 tokens), ``llama100m`` (SmolLM-135M-like; batches small enough for 2 CPU cores)
    and ``tiny`` (smoke tests)."""
    return {
        "default": Shape("default", _default_experiment_model(), decode_batch=128, context=12, train_batch=128,
                         train_len=28, new_tokens=20, e2e_batch=128, e2e_prompt_len=0),
        "llama100m": Shape("llama100m", preset_config("llama100m"),
                           decode_batch=16, context=256, train_batch=2, train_len=128, new_tokens=8, e2e_batch=8,
                           e2e_prompt_len=32),
        "tiny": Shape("tiny", preset_config("tiny"),
                      decode_batch=4, context=5, train_batch=3, train_len=9, new_tokens=3, e2e_batch=3,
                      e2e_prompt_len=4),
    }


ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_list(value: str | list[str] | tuple[str, ...], known: list[str] | tuple[str, ...], what: str) -> list[str]:
    """'a,b' or ['a', 'b'] (or 'all') -> a validated list; unknown names raise one ValueError."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    items = [ALIASES.get(v, v) for v in items if v]
    if items == ["all"]:
        return list(known)
    bad = [v for v in items if v not in known]
    if bad or not items:
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad)) or '(none given)'}; "
                         f"expected a comma list of {', '.join(known)} or 'all'")
    return items


def parse_one(value: str, known: list[str] | tuple[str, ...], what: str) -> str:
    """``parse_list`` for a flag that takes one name (a benchmark that measures one shape or dtype per run)."""
    items = parse_list(value, known, what)
    if len(items) != 1:
        raise ValueError(f"--{what}: one {what}, got {value!r}")
    return items[0]


# --------------------------------------------------------------------------- allocator
MALLOC_MODES = ("steady", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameter numbers (malloc.h)


def set_malloc(mode: str) -> str:
    """``steady``: keep glibc from handing freed memory back to the OS (mmap threshold 32 MiB, the
    largest it takes; trim threshold 1 GiB); ``default``: leave the allocator alone. Returns what
    holds, for the JSON.

    Why: the exact and native variants run in one process, and with glibc's adaptive thresholds
    one side's allocations decide whether the other side's buffers come back as fresh pages.
    Measured on the default model's decode step: native took 2.5-5.3 ms depending on what the
    exact side had allocated before (558-1456 minor page faults per step against 0.03 with this
    setting), which moved the ratio from 0.5x to 1.4x between runs of the same code. ``steady``
    measures the kernels, not the page faults (what a long-running trainer with a warm heap, or
    jemalloc/tcmalloc, sees)."""
    if mode not in MALLOC_MODES:
        raise ValueError(f"unknown malloc mode {mode!r}; expected one of {', '.join(MALLOC_MODES)}")
    if mode == "default":
        return "default"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        return "default (not glibc: steady unavailable)"
    return "steady (glibc mmap threshold 32 MiB, trim threshold 1 GiB)" if ok else "default (mallopt refused)"


# --------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Comparison:
    """Interleaved timings of an exact and a native variant of the same work."""

    exact_s: list[float]
    native_s: list[float]

    @property
    def ratios(self) -> list[float]:
        return [e / n for e, n in zip(self.exact_s, self.native_s)]

    def summary(self) -> dict:
        ratios = self.ratios
        return {
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "exact_s_median": statistics.median(self.exact_s), "native_s_median": statistics.median(self.native_s),
            "exact_s": self.exact_s, "native_s": self.native_s, "repetitions": len(ratios),
        }


def time_call(fn: Callable[[], object], device: torch.device | str = "cpu", inner: int = 1) -> float:
    """Seconds per call of ``fn`` (``inner`` calls timed together, synchronised on CUDA)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / inner


def compare(exact: Callable[[], object], native: Callable[[], object], reps: int, warmup: int = 1,
            device: torch.device | str = "cpu", inner: int = 1) -> Comparison:
    """Time ``exact`` and ``native`` back to back ``reps`` times, alternating which goes first."""
    for _ in range(warmup):
        exact()
        native()
    exact_s, native_s = [], []
    for rep in range(reps):
        if rep % 2 == 0:
            exact_s.append(time_call(exact, device, inner))
            native_s.append(time_call(native, device, inner))
        else:
            native_s.append(time_call(native, device, inner))
            exact_s.append(time_call(exact, device, inner))
    return Comparison(exact_s, native_s)


def renamed_sides(summary: dict, exact: str, native: str) -> dict:
    """``compare``'s summary with its ``exact_s*`` / ``native_s*`` keys named for what the two sides are in a
    benchmark that compares two exact variants (``exact_s_median`` -> ``{exact}_s_median``, ...); the ratio keys
    keep their names (first side / second side)."""
    names = {"exact_s": f"{exact}_s", "native_s": f"{native}_s"}
    out = {}
    for key, value in summary.items():
        for old, new in names.items():
            if key.startswith(old):
                key = new + key[len(old):]
        out[key] = value
    return out


def inner_repeats(fn: Callable[[], object], device: torch.device | str = "cpu", target_s: float = 0.02,
                  limit: int = 200, exact_backend: str = "exact") -> int:
    """How many calls make one timed sample last about ``target_s`` (short ops are timed in groups).
    Sized on ``fn`` (the native variant); 1 when the exact side runs in the Triton interpreter."""
    if interpreted(exact_backend, torch.device(device)):
        return 1
    once = time_call(fn, device)
    return max(1, min(limit, math.ceil(target_s / max(once, 1e-7))))


# The library ops a profile counts as ops (not as autograd nodes or Python ranges): aten's, and torch's oneDNN ops,
# which the exact path calls directly for its linear layers on x86 (``mkldnn::_linear_pointwise``).
LIBRARY_OP_PREFIXES = ("aten::", "mkldnn::")
# The ops that do matrix products: the exact path's GEMM tiles (bmm) and oneDNN linear calls, native's GEMMs (mm,
# addmm, ...) and native's fused attention (SDPA, whose kernels hold its QK^T and PV products).
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "mkldnn::_linear_pointwise")
FUSED_ATTENTION_PREFIXES = ("aten::scaled_dot_product", "aten::_scaled_dot_product")


def is_library_op(op: str) -> bool:
    """An op of a profile's library part (``LIBRARY_OP_PREFIXES``): aten's or oneDNN's."""
    return op.startswith(LIBRARY_OP_PREFIXES)


def is_matrix_product(op: str) -> bool:
    """An op of the "matrix products" part of a profile (``GEMM_OPS`` or a fused attention kernel)."""
    return op in GEMM_OPS or op.startswith(FUSED_ATTENTION_PREFIXES)


def profiled(fn: Callable[[], object], calls: int, record_shapes: bool = False) -> torch.profiler.profile:
    """The CPU profile of ``calls`` calls of ``fn``, after one unprofiled warm-up call (so first-call work, a plan
    made or a loop compiled, is not in it); ``record_shapes`` keeps each op's input shapes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        for _ in range(calls):
            fn()
    return prof


def profile_top(fn: Callable[[], object], top: int, calls: int = 3) -> dict:
    """torch.profiler over ``calls`` calls of ``fn``: the ``top`` ops by self CPU time, with their share, and the
    split of the library ops' self time (aten's and oneDNN's: ``is_library_op``; the record's ``aten_*`` keys) into
    matrix products (``is_matrix_product``) and the rest.

    Self times under the profiler run slower than unprofiled (every op is recorded), so the shares,
    not the milliseconds, are the evidence. ``total_self_ms_per_run`` minus ``aten_self_ms_per_run`` is the self time
    of the other ranges the profiler records (autograd nodes, custom Functions' Python); Python outside any
    recorded range is in none of them."""
    events = [e for e in profiled(fn, calls).key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "calls_per_run": e.count / calls, "self_ms_per_run": e.self_cpu_time_total / 1e3 / calls,
            "share": e.self_cpu_time_total / total} for e in events[:top]]
    aten = [e for e in events if is_library_op(e.key)]
    matmul = [e for e in aten if is_matrix_product(e.key)]
    return {"ops": ops, "total_self_ms_per_run": total / 1e3 / calls,
            "aten_calls_per_run": sum(e.count for e in aten) / calls,
            "aten_self_ms_per_run": sum(e.self_cpu_time_total for e in aten) / 1e3 / calls,
            "matmul_self_ms_per_run": sum(e.self_cpu_time_total for e in matmul) / 1e3 / calls}


# --------------------------------------------------------------------------- the record
def _git_commit() -> str | None:
    """The short commit of the checkout vexact was imported from, or None where vexact is not a checkout's own:
    installed, its folder may lie in a venv inside some other git project, whose commit says nothing of vexact."""
    import vexact

    checkout = Path(vexact.__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=checkout)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != checkout:
        return None
    return lines[1]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def code_locations() -> dict:
    """Where the harness and its kernel library were imported from. They must be one checkout (or one install):
    a second editable install elsewhere can shadow ``vexact_kernels`` alone, and a benchmark would then time old
    kernels under the new harness's commit."""
    import vexact
    import vexact_kernels

    harness, kernels = (Path(m.__file__).resolve().parent for m in (vexact, vexact_kernels))
    if harness.parent != kernels.parent:
        raise ValueError(f"vexact ({harness}) and its kernel library vexact_kernels ({kernels}) come from different "
                         "checkouts: reinstall this one (pip install -e .) in this environment")
    return {"vexact_path": str(harness.parent)}


def machine_info(device: torch.device | str = "cpu") -> dict:
    """What the numbers were measured on: CPU model, cores, torch threads and build, GPU if used, load, and which
    vexact: its version always, its commit where it runs from a git checkout."""
    info = {
        "cpu_model": host_cpu()["model"],
        "cpu_flags": host_cpu()["flags"],  # the features that change a BLAS's micro-kernels (AMX, AVX-512 bf16)
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_start": load_average(),
        "vexact_version": __version__,
        "git_commit": _git_commit(),
        "exact_path": mode_from_env(),  # the CPU guard mode (VEXACT_CPU_EXACT_PATH): auto, canonical, fixed-order
        "exact_onednn": "auto" if onednn_from_env() else "off",  # VEXACT_CPU_ONEDNN: large fp32 layers may run oneDNN
        **code_locations(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        try:
            import triton

            info["triton_version"] = triton.__version__
        except ImportError:
            info["triton_version"] = None
    return info


def json_path(out: Path | None, default_name: str) -> Path:
    """``out``, or runs/bench/<default_name> where it is None: where ``write_json`` writes."""
    return Path(out) if out is not None else Path("runs") / "bench" / default_name


def write_json(payload: dict, out: Path | None, default_name: str) -> Path:
    """Write ``payload`` (with the final load average) to ``out`` or runs/bench/<default_name>; returns the path."""
    payload.setdefault("machine", {})["load_average_end"] = load_average()
    path = json_path(out, default_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, payload)
    return path


def describe_run(record: dict) -> str:
    """The machine (and a forced exact backend) for table titles."""
    m = record["machine"]
    counts = thread_counts(record)
    threads = ", ".join(map(str, counts)) + (" thread" if counts == [1] else " threads")
    where = f"{m['cpu_model']}, {threads}, torch {m['torch_version']}"
    where += f", {m['gpu']}" if "gpu" in m else ""
    backend = record["settings"].get("exact_backend", "exact")
    if backend != "exact":
        where += f"; exact = {backend}"
        where += " in the Triton interpreter: a functional check, NOT a speed" if m.get("device") == "cpu" else ""
    return where


def fmt_ratio(summary: dict) -> str:
    return f"{summary['ratio_median']:.2f}× ({summary['ratio_min']:.2f}–{summary['ratio_max']:.2f})"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table on stdout (wide when not a terminal, so logs do not wrap)."""
    from rich.console import Console
    from rich.table import Table

    probe = Console()
    console = probe if probe.is_terminal else Console(width=200)
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)



def check_exact_backend(name: str) -> None:
    if name not in EXACT_BACKENDS:
        raise ValueError(f"unknown exact backend {name!r}; expected one of {', '.join(EXACT_BACKENDS)}")


def interpreted(exact_backend: str, device: torch.device) -> bool:
    """Triton kernels on CPU run in the interpreter: a functional check, timed once per sample, not a speed."""
    return exact_backend == "triton" and device.type == "cpu"


def resolve_device(name: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (None: auto), resolved by the engine's one rule
    (``vexact.engine.devices.resolve_device``); a clear error naming ``--device`` for anything else."""
    return engine_resolve_device("auto" if name is None else name, "--device")


def cli_main(argv: list[str] | None, prog: str, description: str, name: str,
             add_arguments: Callable[[argparse.ArgumentParser], None],
             measure: Callable[[argparse.Namespace, torch.device], dict],
             print_results: Callable[[dict], None]) -> int:
    """Shared entry point of the benchmarks: parse, ``measure``, print the table, write the JSON
    (``--out`` or runs/bench/<name>-<device>.json). Bad input (unknown shape, dtype, op ...) exits 2
    with one line."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
        out = json_path(args.out, f"{name}-{device.type}.json")
        check_writable(out, "--out")  # before the benchmark's minutes, not after them
        record = measure(args, device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_results(record)
    path = write_json(record, out, f"{name}-{device.type}.json")
    print(f"wrote {path}")
    return 0


def new_record(benchmark: str, device: torch.device, shape_names: list[str], dtype_names: list[str], reps: int,
               threads: int | None, exact_backend: str, malloc: str, **settings: object) -> dict:
    """Validate the shared settings, apply threads and allocator mode, and start the JSON record
    (machine, settings, empty results) of one benchmark run."""
    check_exact_backend(exact_backend)
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if threads is not None:
        if threads < 1:  # torch.set_num_threads' own refusal is a RuntimeError: a traceback
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    malloc_state = set_malloc(malloc)
    known = shapes()
    return {"benchmark": benchmark, "machine": {**machine_info(device), "malloc": malloc_state},
            "settings": {"shapes": [known[s].describe() for s in shape_names], "dtypes": dtype_names, "reps": reps,
                         "exact_backend": exact_backend, **settings},
            "results": []}


def add_rl_step_arguments(p: argparse.ArgumentParser) -> None:
    """``--rl-config`` and ``--rl-set``: which experiment's RL step a benchmark runs, and its overrides."""
    p.add_argument("--rl-config", type=Path, default=EXPERIMENT, help="experiment YAML of the RL step")
    p.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the RL step's config (repeatable)")


def check_rl_step_flags_used(args: argparse.Namespace, runs_rl_step: bool, why_not: str) -> None:
    """A ValueError naming the flag where ``--rl-set`` or ``--rl-config`` was given and no RL step runs
    (``why_not``: what the run measures instead): it would change nothing, and be recorded nowhere."""
    if runs_rl_step:
        return
    given = [flag for flag, used in (("--rl-set", bool(args.rl_set)), ("--rl-config", args.rl_config != EXPERIMENT))
             if used]
    if given:
        raise ValueError(f"{given[0]}: it sets the RL step, and {why_not}: it would change nothing")


def parse_threads(value: str | int | list[int] | None) -> list[int | None]:
    """``--threads``: None (torch's count), one count, or a comma list ``1,2`` -> the counts to run at, in order;
    anything else is one ValueError."""
    if value is None:
        return [None]
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else list(value)
    counts = []
    for item in items:
        try:
            count = int(str(item).strip())
        except ValueError:
            count = 0
        if count < 1 or isinstance(item, bool):
            raise ValueError(f"threads must be a comma list of positive integers (e.g. 1,2), got {value!r}")
        counts.append(count)
    if not counts or len(set(counts)) != len(counts):
        raise ValueError(f"threads must be a comma list of distinct positive integers (e.g. 1,2), got {value!r}")
    return counts


def thread_counts(record: dict) -> list[int]:
    """The torch thread counts a record's figures were measured at (a record without ``settings.threads``: the
    machine's one count)."""
    return record["settings"].get("threads") or [record["machine"]["torch_threads"]]


def add_common_arguments(p: argparse.ArgumentParser, name: str, default_shape: str, default_reps: int,
                         thread_list: bool = False, default_dtype: str = "all", cpu_only: str | None = None) -> None:
    """The options the benchmarks take: shapes, dtypes, repetitions, threads, device, exact backend,
    allocator mode and the JSON path. ``thread_list``: ``--threads`` takes a comma list (every figure at each
    count) instead of one count. ``cpu_only``: a benchmark of the exact CPU kernels alone (``--device`` cpu, its
    help this text; no ``--exact-backend``)."""
    p.add_argument("--shape", default=default_shape, help="comma list of: " + ", ".join(shapes()))
    p.add_argument("--dtype", default=default_dtype, help="float32, bfloat16 or all")
    p.add_argument("--reps", type=int, default=default_reps,
                   help=f"interleaved repetitions per figure (default {default_reps})")
    if thread_list:
        p.add_argument("--threads", default=None, metavar="N[,N...]",
                       help="torch threads, or a comma list (e.g. 1,2): every figure at each count (default: torch's)")
    else:
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    if cpu_only is not None:
        p.add_argument("--device", default="cpu", help=cpu_only)
    else:
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--exact-backend", default="exact",
                       help="exact (Triton on CUDA, the CPU kernels on CPU; default) or triton (the Triton kernels "
                            "forced: on CPU through the interpreter, a functional check only, not a timing)")
    p.add_argument("--malloc", default="steady", choices=MALLOC_MODES,
                   help="steady (default): freed memory stays in the process, so neither variant pays page "
                        "faults provoked by the other's allocations; default: glibc's adaptive behaviour")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default runs/bench/{name}-<device>.json)")
