"""``vexact check``'s run and report: the settings its arguments give, the results table, the kernel paths each
exact backend took (one line, or ``--verbose``'s table per op) and the verdict line. The checks themselves are
``vexact.real.check``'s; the CLI (``vexact.cli``) parses the arguments and calls ``check_command``."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from vexact_kernels.backends import BACKENDS
from vexact_kernels.host_guard import SAME_BITS

from ..cli_base import EXIT_FAILED, EXIT_OK, check_writable, make_console
from ..engine.devices import resolve_device
from ..engine.model import DTYPE_NAMES, DTYPES, canonical_dtype_name, dtype_names_text, short_dtype_name
from ..engine.seeds import check_seed
from ..metric_keys import ABS_DLOGP_MAX, K3_KL
from ..progress import Progress
from ..records.atomic import write_text_atomic
from .check import CheckSettings, check_units, mismatched, run_check, wide_settings

__all__ = ["check_command", "check_verdict"]


def check_command(args: argparse.Namespace, shape: dict) -> int:
    """``vexact check`` from its parsed arguments and the random model's ``shape`` (``--preset`` and the size flags):
    run every backend and dtype, print the results table, the kernel paths and the verdict; the exit code."""
    if args.json:  # before the check's minutes of work, not after them
        check_writable(args.json, "--json")
    device = resolve_device(args.device or "cpu", "--device")  # no CUDA for --device cuda: one error, before work
    dtypes = list(DTYPE_NAMES) if args.dtype == "all" else [args.dtype]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype: unsupported dtype {d!r}; expected {dtype_names_text()} or all")
    dtypes = [canonical_dtype_name(d) for d in dtypes]
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    unknown = [b for b in backends if b not in BACKENDS]  # before any backend's minutes of work, not after them
    if unknown or not backends:
        raise ValueError(f"--backend: {'unknown backend ' + repr(unknown[0]) if unknown else 'no backend given'}; "
                         f"expected a comma-separated list of {', '.join(BACKENDS)}")
    twice = next((b for i, b in enumerate(backends) if b in backends[:i]), None)
    if twice is not None:  # it ran twice, and the verdict counted its tokens twice
        raise ValueError(f"--backend: {twice!r} is named twice; name each backend once")
    try:
        check_seed(args.seed)
    except ValueError as err:
        raise ValueError(f"--seed: {err}") from None
    settings = [CheckSettings(**shape, num_prompts=args.num_prompts,
                              max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, dtype=dtype, seed=args.seed, threads=args.threads,
                              scoring_threads=args.scoring_threads,
                              batch_sizes=args.batch_sizes, micro_batch_sizes=args.micro_batch_sizes)
                for dtype in dtypes]
    # then each dtype's wide model (--wide-hidden), where the checked model is narrower
    settings += [wide for one in settings if (wide := wide_settings(one, args.wide_hidden)) is not None]
    total = sum(check_units(s) for s in settings) * len(backends)
    rows = []
    # progress on stderr: stdout keeps the results and the verdict
    with Progress(make_console(stderr=True), "vexact check", total, quiet=args.quiet, min_interval=10) as progress:
        for one in settings:
            rows += run_check(one, backends, device=device, progress=progress)

    table = Table(title="vexact check: rollout log-probs vs training log-probs")
    moe = any(r.get("routing_flip_rate") is not None for r in rows)
    for col in ("model", "backend", "dtype", "threads (gen / score)", "tokens", "bitwise equal", "mismatched",
                "max |Δlogp|", "k3 KL", *(("routing flips",) if moe else ()), "batch-inv. sampling", "s"):
        table.add_column(col, justify="right")
    for r in rows:
        style = "green" if mismatched(r) == 0 else ("red" if r["backend"] != "native" else "yellow")
        threads = f"{r['threads']} / {','.join(map(str, r['scoring_threads']))}"
        m = r["metrics"]
        flips = (f"{r['routing_flip_rate']:.3g}",) if moe else ()
        cells = [_model(r) or "-", r["backend"], short_dtype_name(r["dtype"]), threads, r["tokens"], r["bitwise_equal"],
                 f"[{style}]{mismatched(r)}[/]", f"{m[ABS_DLOGP_MAX]:.3g}", f"{m[K3_KL]:.3g}",
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
        write_text_atomic(args.json, json.dumps(rows, indent=2))  # whole: no half file, the old one kept on failure
    exact_failures = [r for r in rows if r["backend"] != "native"
                      and (mismatched(r) or not r["sampling_batch_invariant"] or r.get("routing_flip_rate"))]
    if exact_failures:
        Console(stderr=True).print("[red]exactness violated[/] for: "
                                   + ", ".join(_where(r) for r in exact_failures))
    console.print(check_verdict(rows), soft_wrap=True, highlight=False)
    return EXIT_FAILED if exact_failures else EXIT_OK


def check_verdict(rows: list[dict]) -> str:
    """The last line of ``vexact check``: PASS when every exact backend's rollout log-probs equal its training
    log-probs bit for bit (and sampling is batch-invariant), else FAIL naming where; native makes no promise."""
    exact = [r for r in rows if r["backend"] != "native"]
    failed = [r for r in exact if mismatched(r) or not r["sampling_batch_invariant"] or r.get("routing_flip_rate")]
    if failed:
        where = ", ".join(f"{_where(r)} ({mismatched(r)} of {r['tokens']} tokens "
                          f"differ{'' if r['sampling_batch_invariant'] else ', sampling not batch-invariant'}"
                          f"{', MoE routing differs' if r.get('routing_flip_rate') else ''})"
                          for r in failed)
        return f"FAIL: exactness violated on this machine: {where}"
    if not exact:
        return "PASS (vacuous): only the native backend was checked, and it makes no bitwise promise"
    tokens = sum(r["tokens"] for r in exact)
    paths = ", ".join(sorted({f"{r['backend']}/{r['dtype']}" for r in exact}))
    return f"PASS: rollout log-probs == training log-probs bit for bit on {paths} ({tokens} of {tokens} tokens)"


def _model(row: dict) -> str:
    """Which model a check row is: its hidden size and layers (the checked model, or the wide one); "" for a row
    that does not say (one written before rows named their model)."""
    if "hidden_size" not in row:
        return ""
    return f"hidden {row['hidden_size']} x {row['num_layers']} layer{'s' if row['num_layers'] > 1 else ''}"


def _where(row: dict) -> str:
    """A check row's path and model, as the verdict names it: ``exact/bfloat16 at hidden 512 x 1 layer``."""
    return f"{row['backend']}/{row['dtype']}" + (f" at {model}" if (model := _model(row)) else "")


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
        # a failed same_bits probe costs speed, not bits (the class keeps its canonical arrangement): counted, not named
        refused = [p for p in failed if p["property"] == SAME_BITS]
        threads = ",".join(map(str, sorted({t for p in probed for t in p["threads_checked"]})))
        line += (f"; host probes: {len(probed) - len(failed)} of {len(probed)} passed (threads {threads})"
                 + (f", failed: {', '.join(p['property'] + ': ' + p['shape_class'] for p in named)}"
                    if (named := [p for p in failed if p not in refused]) else "")
                 + (f", {len(refused)} faster arrangements refused ({SAME_BITS}: speed only)" if refused else ""))
    if low := paths.get("library_dtype_gemm"):  # the exact CPU kernels' bf16 GEMM classes: the host's GEMM or fp32
        on_host = sum(c["path"] != "fp32-upcast" for c in low)
        line += f"; bf16 GEMM classes: {on_host} on the host's bf16 GEMM, {len(low) - on_host} in fp32"
    return line + " (per op: --verbose)"


def _kernel_paths_table(paths: dict) -> Table:
    """One row per op: the path it took on this host and, for probed ops, each shape class's verdict."""
    verdicts = {f"{p['property']}: {p['shape_class']}": p for p in paths["probes"]}
    mode = f", guard mode {paths['mode']}" if "mode" in paths else ""
    if paths.get("onednn") == "off":  # VEXACT_CPU_ONEDNN=off: large fp32 layers on torch.bmm (default auto: unsaid)
        mode += ", oneDNN off"
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
            # a class with two library paths (bf16: its own GEMM or fp32; a large fp32 layer: oneDNN or torch.bmm)
            path = f", path {p['path']}" if "fallback" in p else ""
            probes.append(f"{shape_class}: {verdict}" + (f" (threads {threads}{path})" if threads else path))
        style = "yellow" if info["path"] in ("fixed-order", "mixed") else ""
        table.add_row(op, f"[{style}]{info['path']}[/]" if style else info["path"], "\n".join(probes) or "-")
    return table
