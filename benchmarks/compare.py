"""Throughput and peak memory of ``vexact compare`` on a synthetic dump.

    python -m benchmarks.compare                                  # 20k sequences, ~2M tokens, ~90 MB of JSON Lines
    python -m benchmarks.compare --sequences 200000 --max-len 64 --formats two-files

The dump is seeded: each sequence has a length drawn uniformly from 1..``--max-len``, rollout log-probs log(U) in
float32, token ids, and training log-probs equal to the rollout's except on a ``--mismatch-frac`` share of tokens,
where float32 noise of std 0.01 is added (a bf16-like mismatch) and the sum reflected at 0 (``-|x|``), so every value
stays a log-prob (at most 0: ``vexact compare`` refuses one above +1e-3). JSON numbers are written as
``json.dumps`` of the float32 values' ``tolist()`` (the repr of their float64 value, up to 17 significant digits:
what a user's ``json.dumps(t.tolist())`` writes). Formats:

- ``two-files``: rollout.jsonl in id order and train.jsonl in a shuffled order (so matching by id is exercised);
- ``one-file``: one dump.jsonl with ``rollout_log_probs`` / ``old_log_probs`` per line;
- ``safetensors``: padded [B, T] float32 tensors with ``response_mask`` and ``responses``.

Each timing runs ``vexact compare`` in a fresh Python subprocess, so its peak RSS (``VmHWM`` of that process, after
its exec) is compare's own and not the writer's. Reported: seconds inside ``compare`` (median of ``--reps``),
tokens/s and MB/s, the peak RSS, the peak RSS of a subprocess that only imports the same modules (the floor), and
bytes per token above that floor. The report's bitwise-equal count is checked against the count the writer knows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from .common import cli_main, machine_info, parse_list, print_table

FORMATS = ("two-files", "one-file", "safetensors")

# Run in the subprocess: argv = [stats_path, *compare_args]; "--baseline" as the only compare arg imports only.
# The peak is VmHWM of /proc/self/status: the high-water mark of this program's own address space. getrusage's
# ru_maxrss survives exec, so it would also count the benchmark's own memory, shared with the child until exec.
_CHILD = r"""
import json, resource, sys, time
import vexact.cli, vexact.real.compare  # noqa: F401 -- what the baseline holds too
stats, args = sys.argv[1], sys.argv[2:]
code, seconds = None, 0.0
if args != ["--baseline"]:
    start = time.perf_counter()
    code = vexact.cli.main(["compare", *args])
    seconds = time.perf_counter() - start
try:
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: may include the parent's share
with open(stats, "w") as f:
    json.dump({"exit_code": code, "seconds": seconds, "peak_rss_kib": peak}, f)
"""


def synthetic(sequences: int, max_len: int, mismatch_frac: float, seed: int) -> dict[str, np.ndarray]:
    """Lengths, token ids and float32 rollout / training log-probs (flat), and how many tokens are equal."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=sequences)
    total = int(lengths.sum())
    roll = np.log(1.0 - rng.random(total)).astype(np.float32)  # 1 - U in (0, 1]: finite log-probs
    train = roll.copy()
    perturbed = rng.random(total) < mismatch_frac
    noise = rng.normal(0.0, 0.01, int(perturbed.sum())).astype(np.float32)
    train[perturbed] = -np.abs(roll[perturbed] + noise)  # reflected at 0: near-certain tokens stay log-probs
    tokens = rng.integers(0, 50_000, size=total)
    return {"lengths": lengths, "roll": roll, "train": train, "tokens": tokens,
            "equal": np.array(int((roll == train).sum()))}


def write_dump(data: dict[str, np.ndarray], fmt: str, directory: Path, seed: int) -> list[Path]:
    """The dump in one format; returns the file paths (the compare arguments)."""
    lengths = data["lengths"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])

    def side(i: int, key: str) -> list[float]:
        return data[key][offsets[i] : offsets[i + 1]].tolist()

    def tokens(i: int) -> list[int]:
        return data["tokens"][offsets[i] : offsets[i + 1]].tolist()

    if fmt == "two-files":
        rollout, train = directory / "rollout.jsonl", directory / "train.jsonl"
        with open(rollout, "w") as f:
            for i in range(len(lengths)):
                f.write(json.dumps({"id": i, "tokens": tokens(i), "logprobs": side(i, "roll")}) + "\n")
        with open(train, "w") as f:
            for i in np.random.default_rng(seed + 1).permutation(len(lengths)).tolist():
                f.write(json.dumps({"id": i, "tokens": tokens(i), "logprobs": side(i, "train")}) + "\n")
        return [rollout, train]
    if fmt == "one-file":
        dump = directory / "dump.jsonl"
        with open(dump, "w") as f:
            for i in range(len(lengths)):
                f.write(json.dumps({"id": i, "tokens": tokens(i), "rollout_log_probs": side(i, "roll"),
                                    "old_log_probs": side(i, "train")}) + "\n")
        return [dump]
    if fmt == "safetensors":
        from safetensors.torch import save_file

        width = int(lengths.max())
        mask = np.arange(width)[None, :] < lengths[:, None]
        tensors = {}
        for key, name, dtype in (("roll", "rollout_log_probs", np.float32), ("train", "old_log_probs", np.float32),
                                 ("tokens", "responses", np.int64)):
            padded = np.zeros((len(lengths), width), dtype=dtype)
            padded[mask] = data[key]
            tensors[name] = torch.from_numpy(padded)
        tensors["response_mask"] = torch.from_numpy(mask.astype(np.int64))
        dump = directory / "batch.safetensors"
        save_file(tensors, dump)
        return [dump]
    raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _child(stats: Path, args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(stats), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0 or not stats.exists():
        raise RuntimeError(f"vexact compare subprocess failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    result = json.loads(stats.read_text())
    if result["exit_code"] not in (None, 0):  # compare refused the dump: say why, not a missing report later
        raise RuntimeError(f"vexact compare exited {result['exit_code']}: {done.stderr.strip()[-400:]}")
    return result


def bench_format(data: dict[str, np.ndarray], fmt: str, directory: Path, reps: int, seed: int,
                 baseline_kib: int) -> dict:
    """Write the dump in ``fmt``, run compare ``reps`` times in subprocesses; one result row (``baseline_kib``: the
    peak of a subprocess that only imports)."""
    import time

    start = time.perf_counter()
    files = write_dump(data, fmt, directory, seed)
    write_s = time.perf_counter() - start
    report = directory / f"report-{fmt}.json"
    runs = [_child(directory / f"stats-{fmt}-{rep}.json", [*map(str, files), "--json", str(report)])
            for rep in range(reps)]
    summary = json.loads(report.read_text())
    tokens = int(data["lengths"].sum())
    seconds = statistics.median(r["seconds"] for r in runs)
    size = sum(f.stat().st_size for f in files)
    peak = max(r["peak_rss_kib"] for r in runs) * 1024
    floor = baseline_kib * 1024
    for f in files:
        f.unlink()
    return {"format": fmt, "sequences": int(len(data["lengths"])), "tokens": tokens, "file_mb": size / 1e6,
            "write_s": write_s, "compare_s": seconds, "compare_s_all": [r["seconds"] for r in runs],
            "tokens_per_s": tokens / seconds, "mb_per_s": size / 1e6 / seconds, "peak_rss_mb": peak / 2**20,
            "baseline_rss_mb": floor / 2**20, "bytes_per_token": (peak - floor) / tokens,
            "bytes_per_file_byte": (peak - floor) / size, "exit_code": runs[0]["exit_code"],
            "report_tokens": summary["tokens"], "report_bitwise_equal": summary["bitwise_equal"],
            "expected_bitwise_equal": int(data["equal"]),
            "correct": summary["tokens"] == tokens and summary["bitwise_equal"] == int(data["equal"])}


def run(sequences: int, max_len: int, formats: list[str], reps: int = 1, mismatch_frac: float = 0.3, seed: int = 0,
        directory: Path | None = None, device: torch.device | None = None) -> dict:
    """The benchmark record: machine, settings and one result row per format."""
    if sequences < 1 or max_len < 1 or reps < 1:
        raise ValueError("--sequences, --max-len and --reps must be positive")
    if not 0.0 <= mismatch_frac <= 1.0:
        raise ValueError(f"--mismatch-frac must be in [0, 1], got {mismatch_frac}")
    record = {"benchmark": "compare", "machine": machine_info(device or "cpu"),
              "settings": {"sequences": sequences, "max_len": max_len, "formats": formats, "reps": reps,
                           "mismatch_frac": mismatch_frac, "seed": seed},
              "results": []}
    data = synthetic(sequences, max_len, mismatch_frac, seed)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        baseline = _child(Path(tmp) / "stats-baseline.json", ["--baseline"])["peak_rss_kib"]
        for fmt in formats:
            record["results"].append(bench_format(data, fmt, Path(tmp), reps, seed, baseline))
    return record


def print_results(record: dict) -> None:
    m = record["machine"]
    rows = [[r["format"], str(r["sequences"]), str(r["tokens"]), f"{r['file_mb']:.1f}", f"{r['compare_s']:.2f}",
             f"{r['tokens_per_s'] / 1e6:.2f}", f"{r['mb_per_s']:.1f}", f"{r['peak_rss_mb']:.0f}",
             f"{r['baseline_rss_mb']:.0f}", f"{r['bytes_per_token']:.1f}", "yes" if r["correct"] else "NO"]
            for r in record["results"]]
    print_table(f"vexact compare throughput and peak RSS ({m['cpu_model']}, {m['logical_cpus']} logical CPUs)",
                ["format", "sequences", "tokens", "file MB", "compare s", "M tokens/s", "MB/s", "peak RSS MB",
                 "import-only RSS MB", "bytes/token above it", "counts right"], rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=int, default=20_000, help="sequences in the dump (default 20000)")
    p.add_argument("--max-len", type=int, default=200, help="longest sequence; lengths are uniform in 1..N "
                   "(default 200)")
    p.add_argument("--formats", default="all", help="comma list of: " + ", ".join(FORMATS))
    p.add_argument("--reps", type=int, default=1, help="compare runs per format (median time; default 1)")
    p.add_argument("--mismatch-frac", type=float, default=0.3, help="share of perturbed tokens (default 0.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="where to write the dump (a temporary folder inside it)")
    p.add_argument("--device", default="cpu", help="cpu (compare reads files on the CPU)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default runs/bench/compare-cpu.json)")


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Run the benchmark the parsed options ask for; the JSON-ready record."""
    if device.type != "cpu":
        raise ValueError("vexact compare runs on the CPU; use --device cpu")
    return run(args.sequences, args.max_len, parse_list(args.formats, FORMATS, "format"), args.reps,
               args.mismatch_frac, args.seed, args.dir, device)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.compare") -> int:
    """Command-line entry point; bad input exits 2 with one line."""
    return cli_main(argv, prog, __doc__.split("\n")[0], "compare", add_arguments, measure, print_results)


if __name__ == "__main__":
    sys.exit(main())
