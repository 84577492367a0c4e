"""Where the exact path's per-op overhead comes from: aten calls of one RL step, counted per Python function.

    python -m benchmarks.op_count                      # experiments/zero_mismatch.yaml, fp32, top 15 functions
    vexact bench op_count --top 25 --rl-set distributed.leaves=1
    vexact bench op_count --decode-shape llama100m --dtype bfloat16   # one decode step (end_to_end's) instead

On the small models this project trains, the exact backend's price over native is mostly per-op dispatch: its
tiles, trees and exactly rounded passes are many small aten calls (see docs/results/benchmarks_price_fp32.md). A
time profile says which aten ops are slow; this says which of vexact's own functions issue them. Every aten call of
one ``Trainer.step`` (rollout, scoring, loss, backward, AdamW) is counted under a ``TorchDispatchMode`` -- views
included, since each is a dispatch too -- and charged to the innermost frame in ``vexact/`` or ``kernels/`` that
issued it (a backward's calls land in the op's VJP). Counts, not times: they are the same on any machine and under
any load, so two commits can be compared exactly. The step runs once before counting, so host probes and caches
are already in place, and starts from the config's random init (no warm start: the counts barely depend on it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import DTYPES, add_rl_step_arguments, check_rl_step_flags_used, cli_main, machine_info, set_malloc

BACKENDS = ("exact", "native")


class _CountCalls(TorchDispatchMode):
    """Counts every aten call, by op name and by the innermost vexact / kernels frame that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.own_code = own_code()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_function: collections.Counter[str] = collections.Counter()
        self.in_compiled = 0  # compiled-loop calls in progress (``_marking_compiled_calls``)
        self.from_compiled = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.by_op[str(func.overloadpacket)] += 1
        self.by_function[_caller(self.own_code)] += 1
        self.from_compiled += self.in_compiled > 0
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict:
        total = sum(self.by_op.values())
        return {"aten_calls": total, "from_python": total - self.from_compiled,
                "from_compiled_calls": self.from_compiled, "by_function": dict(self.by_function.most_common()),
                "by_op": dict(self.by_op.most_common())}


@contextlib.contextmanager
def _marking_compiled_calls(counter: _CountCalls):
    """While it lasts, each function of the exact kernels' compiled loops tells ``counter`` that the aten calls it
    issues come from C++ (the module's functions are wrapped, and put back after)."""
    from vexact_kernels import compiled_loops

    library = compiled_loops.library()
    names = [n for n in dir(library) if not n.startswith("_") and callable(getattr(library, n))] if library else []
    originals = {name: getattr(library, name) for name in names}

    def marked(fn):
        def call(*args, **kwargs):
            counter.in_compiled += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.in_compiled -= 1
        return call

    for name, fn in originals.items():
        setattr(library, name, marked(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(library, name, fn)


def own_code() -> tuple[tuple[str, str], ...]:
    """``(folder + "/", label)`` for each package whose frames are charged with the calls they issue: vexact, and
    the kernel library labelled ``kernels`` (its folder in the checkout) also where it is installed as
    vexact_kernels, so labels read the same from a checkout and from an install. The folders are the imported
    modules' own (a repository-relative path misses site-packages), each as imported and resolved: a frame's file
    name is the path its module was imported by."""
    import vexact
    import vexact_kernels

    roots = []
    for module, label in ((vexact, "vexact"), (vexact_kernels, "kernels")):
        folder = Path(module.__file__).parent
        roots += [(f"{path}{os.sep}", label) for path in dict.fromkeys((str(folder), str(folder.resolve())))]
    return tuple(roots)


def _caller(roots: tuple[tuple[str, str], ...]) -> str:
    """``label/path:function`` of the innermost frame in one of ``roots`` (``own_code``), or ``other``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for root, label in roots:
            if path.startswith(root):
                return f"{label}/{Path(path[len(root):]).as_posix()}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def count_rl_step(backend: str, config: Path, overrides: list[str]) -> dict:
    """The aten calls of one ``Trainer.step`` of ``config`` with ``backend``: total, by op and by function."""
    from rich.console import Console

    from vexact.rl.config import load_config
    from vexact.rl.trainer import Trainer

    trainer = Trainer(load_config(config, [f"backend={backend}", "logging.live=false", *overrides]),
                      Console(quiet=True))
    trainer.step(0)  # probes, layouts and caches in place before counting
    counter = _CountCalls()
    with _marking_compiled_calls(counter), counter:
        trainer.step(1)
    return {"backend": backend, **counter.counts()}


def count_decode_steps(shape_name: str, dtype_name: str) -> list[dict]:
    """The aten calls of one decode step of ``benchmarks.end_to_end``'s ``decode_step`` item (the model forward for
    one token per sequence against the prefilled cache, the LM head, the token's log-prob), per backend."""
    from vexact.engine.generation import CACHE_BLOCK
    from vexact.engine.inputs import pad_right

    from .common import shapes
    from .end_to_end import _models, prompts_of

    known = shapes()
    if shape_name not in known:
        raise ValueError(f"--decode-shape {shape_name!r}: expected one of {', '.join(known)}")
    shape = known[shape_name]
    models = _models(shape, DTYPES[dtype_name], torch.device("cpu"), "exact")
    prompts = prompts_of(shape)
    lengths = torch.tensor([len(p) for p in prompts])
    token = torch.tensor([p[-1] for p in prompts])
    results = []
    for backend in BACKENDS:
        model = models[backend]
        cache = model.new_cache(len(prompts), -(-(int(lengths.max()) + 1) // CACHE_BLOCK) * CACHE_BLOCK)
        with torch.no_grad():
            model(pad_right(prompts, "cpu"), cache=cache)

            def step(model=model, cache=cache) -> None:
                # (positions known in range, as generate's decode steps: nothing read back per step)
                hidden = model(token[:, None], q_start=lengths, cache=cache, q_start_checked=True)[:, 0]
                model.ops.token_logprobs(model.logits(hidden).float(), token)
            step()  # probes, layouts and caches in place before counting
            counter = _CountCalls()
            with _marking_compiled_calls(counter), counter:
                step()
        results.append({"backend": backend, **counter.counts()})
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rl_step_arguments(p)
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="compute dtype")
    p.add_argument("--top", type=int, default=15, help="functions and ops printed per backend (default 15)")
    p.add_argument("--device", default="cpu", choices=("cpu",), help="cpu (the Trainer has no device option)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default runs/bench/op_count-cpu.json)")
    p.add_argument("--decode-shape", default=None, metavar="SHAPE",
                   help="count one decode step of this benchmark shape (end_to_end's decode_step), not the RL step")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Both backends' counts, one thread (counts do not depend on it; the step is just quicker)."""
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    check_rl_step_flags_used(args, args.decode_shape is None, f"--decode-shape {args.decode_shape} counts a decode "
                             "step")
    if not args.rl_config.is_file():
        raise ValueError(f"--rl-config {args.rl_config} not found")
    torch.set_num_threads(1)
    machine = {**machine_info(device), "malloc": set_malloc("steady")}
    if args.decode_shape is not None:
        return {"benchmark": "op_count", "machine": machine,
                "settings": {"decode_shape": args.decode_shape, "dtype": args.dtype, "top": args.top},
                "results": count_decode_steps(args.decode_shape, args.dtype)}
    overrides = [f"dtype={args.dtype}", "threads=1", "warm_start.steps=0", *args.rl_set]
    return {"benchmark": "op_count", "machine": machine,
            "settings": {"config": str(args.rl_config), "overrides": overrides, "top": args.top},
            "results": [count_rl_step(backend, args.rl_config, overrides) for backend in BACKENDS]}


def print_results(record: dict) -> None:
    top = record["settings"]["top"]
    counts = {r["backend"]: r for r in record["results"]}
    exact, native = counts["exact"]["aten_calls"], counts["native"]["aten_calls"]
    settings = record["settings"]
    what = (f"one decode step ({settings['decode_shape']}, {settings['dtype']})" if "decode_shape" in settings
            else f"one RL step ({settings['config']})")
    print(f"aten calls in {what}: exact {exact}, native {native} ({exact / native:.2f}x); from Python (outside "
          f"the compiled loops): exact {counts['exact']['from_python']}, native {counts['native']['from_python']}")
    for r in record["results"]:
        print(f"\n{r['backend']}: the {top} functions issuing the most aten calls")
        for name, n in list(r["by_function"].items())[:top]:
            print(f"  {n:7d}  {name}")
        print(f"{r['backend']}: the {top} most called aten ops")
        for name, n in list(r["by_op"].items())[:top]:
            print(f"  {n:7d}  {name}")


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.op_count") -> int:
    """Command-line entry point; bad input exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "op_count", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
