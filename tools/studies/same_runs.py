"""Are two runs the same bits? Their metrics step for step and their newest checkpoints' weights, compared exactly.

    python -m tools.studies.same_runs RUN_A RUN_B [RUN_A2 RUN_B2 ...] [--ignore inject/] [--ignore-eval-at 99]

Determinism is a contract of vexact (same config + seed => identical bits), and this is how a results page shows it
held across commits or sessions: a run repeated later is compared with the earlier one. Metric keys under
``timing/`` are always ignored (wall-clock times); ``--ignore PREFIX`` drops more keys (e.g. ``inject/`` when one run
named a zero-magnitude injection and the other none), and ``--ignore-eval-at STEP`` drops the ``eval/*`` keys logged at
STEP (a run completed after STEP and extended by a vexact before the extension took back its off-schedule final
evaluation logged one there that a straight run does not make). Exit status 0 when every pair is identical, 1
otherwise; one line per pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from vexact.records import METRICS_FILE
from vexact.records.runlog import latest_checkpoint, read_metrics


def _metrics(run_dir: Path, ignore: tuple[str, ...], eval_steps: set[int]) -> list[dict]:
    rows = []
    for row in read_metrics(run_dir / METRICS_FILE):
        rows.append({k: v for k, v in row.items() if not k.startswith(("timing/", *ignore))
                     and not (row.get("step") in eval_steps and k.startswith("eval/"))})
    return rows


def same_run(a: str | Path, b: str | Path, ignore: tuple[str, ...] = (), ignore_eval_at: tuple[int, ...] = ()
             ) -> tuple[bool, str]:
    """Whether runs ``a`` and ``b`` have identical metrics (after the exclusions) and newest-checkpoint weights;
    with a one-line reason when they do not."""
    a, b = Path(a), Path(b)
    for run in (a, b):
        if not (run / METRICS_FILE).is_file():
            raise ValueError(f"{run} is not a run directory (no metrics.jsonl)")
    rows_a, rows_b = (_metrics(run, ignore, set(ignore_eval_at)) for run in (a, b))
    if len(rows_a) != len(rows_b):
        return False, f"{len(rows_a)} metric lines against {len(rows_b)}"
    for i, (x, y) in enumerate(zip(rows_a, rows_b)):
        if x != y:
            keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            return False, f"metric line {i} (step {x.get('step')}) differs in {', '.join(keys[:5])}"
    ckpt_a, ckpt_b = latest_checkpoint(a), latest_checkpoint(b)
    if ckpt_a is None or ckpt_b is None:
        return False, "no checkpoint to compare in " + (str(a) if ckpt_a is None else str(b))
    wa = load_file(str(ckpt_a / "checkpoint.safetensors"))
    wb = load_file(str(ckpt_b / "checkpoint.safetensors"))
    if wa.keys() != wb.keys():
        return False, "the checkpoints hold different tensors"
    differing = [k for k in wa if not torch.equal(wa[k], wb[k])]
    if differing:
        return False, f"weights differ: {', '.join(differing[:3])}"
    return True, f"identical ({len(rows_a)} metric lines, {len(wa)} tensors of {ckpt_a.name})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.same_runs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, in pairs: A B [A2 B2 ...]")
    parser.add_argument("--ignore", action="append", default=[], metavar="PREFIX",
                        help="also ignore metric keys starting with PREFIX (repeatable)")
    parser.add_argument("--ignore-eval-at", action="append", default=[], type=int, metavar="STEP",
                        help="ignore the eval/* keys logged at STEP (repeatable)")
    args = parser.parse_args(argv)
    if len(args.runs) % 2:
        parser.error(f"run directories come in pairs; got {len(args.runs)}")
    pairs = list(zip(args.runs[::2], args.runs[1::2]))
    identical = 0
    for a, b in pairs:
        try:
            same, why = same_run(a, b, tuple(args.ignore), tuple(args.ignore_eval_at))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        identical += same
        print(f"{'same' if same else 'DIFFERENT'}: {a} vs {b}: {why}")
    print(f"{identical} of {len(pairs)} pairs identical")
    return 0 if identical == len(pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
