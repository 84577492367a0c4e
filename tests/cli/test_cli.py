"""``vexact check`` end to end through the console entry point; what ``--help`` imports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vexact.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]

# What a command imports to do its work, never to print a help: the trainer, the report, the sweep, the kernels,
# torch (and rich, which prints results)
HEAVY = ("torch", "vexact.rl.trainer", "vexact.reports.sweep_report", "vexact.sweeps.sweep", "vexact_kernels",
         "vexact.real.check", "rich")


def test_check_reports_zero_exact_mismatch_and_native_mismatch(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--num-prompts", "16", "--max-new-tokens", "24", "--hidden-size", "64",
                 "--intermediate-size", "160", "--dtype", "all", "--json", str(out), "--verbose"])
    assert code == 0
    rows = json.loads(out.read_text())
    assert {(r["backend"], r["dtype"]) for r in rows} == {(b, d) for b in ("exact", "native")
                                                          for d in ("float32", "bfloat16")}
    for r in rows:  # the keys of measure's and compare's --json reports
        assert r["tokens"] > 0
        if r["backend"] == "exact":
            assert r["bitwise_equal"] == r["tokens"] and r["metrics"]["mismatch/abs_dlogp_max"] == 0.0
            assert r["metrics"]["rollout_corr/k3_kl"] == 0.0
    assert sum(r["tokens"] - r["bitwise_equal"] for r in rows if r["backend"] == "native") > 0
    exact_paths = next(r["kernel_paths"] for r in rows if r["backend"] == "exact")
    # every exact op says which path it took; probed ops name their probes, by-construction ops need none
    assert exact_paths["ops"]["embedding"]["path"] == "by construction"
    for op in ("linear", "attention", "rms_norm", "silu_mul", "token_logprobs", "sampling"):
        assert exact_paths["ops"][op]["path"] in ("fast", "fixed-order", "mixed"), op
        assert exact_paths["ops"][op]["shape_classes"], op
    if exact_paths["mode"] == "auto":  # (VEXACT_CPU_EXACT_PATH=fixed-order: nothing is probed)
        assert all(p["passed"] is not None and p["threads_checked"] for p in exact_paths["probes"])
    out = capsys.readouterr().out
    assert "vexact check" in out and "path per op" in out and "gemm_rows" in out


def test_check_scores_at_other_thread_counts(tmp_path):
    """Rollout at 1 thread, every rollout rescored at 2 and at 3: still 0 mismatched exact tokens."""
    out = tmp_path / "check.json"
    assert main(["check", "--num-prompts", "6", "--max-new-tokens", "8", "--hidden-size", "64", "--intermediate-size",
                 "160", "--backend", "exact", "--threads", "1", "--scoring-threads", "2,3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["threads"] == 1 and row["scoring_threads"] == [2, 3]
    assert row["tokens"] == row["bitwise_equal"] == 6 * 8 * 3 * 3 * 2


def test_check_bad_dtype_is_one_clear_error(capsys):
    assert main(["check", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "unsupported dtype 'fp8'" in err and "Traceback" not in err


def _imported(*args: str) -> set[str]:
    """The modules ``python -X importtime -m vexact ARGS`` imports (its import-time lines name each one)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "vexact", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: vexact" in done.stdout
    return {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--help",), ("run", "--help")], ids=["vexact", "run"])
def test_help_imports_only_what_it_prints(args):
    modules = _imported(*args)
    assert {"vexact.cli", "argparse"} <= modules  # the lines were read: a module list, not an empty set
    heavy = sorted(m for m in modules if m.partition(".")[0] in HEAVY or m in HEAVY)
    assert heavy == [], f"vexact {' '.join(args)} imported {heavy}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_lazy_subcommand_parses_and_helps_as_the_full_one(name):
    """``main``'s parser adds a subcommand's arguments on first use; its help and parse are the full parser's."""
    def command(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]

    lazy, full = build_parser(lazy=True), build_parser()
    assert command(lazy).format_help() == command(full).format_help()
    words = {"check": [], "run": ["x.yaml"], "sweep": ["s.yaml"], "report": ["d"], "demo": [],
             "measure": ["--model", "m", "--random-prompts", "2"], "compare": ["a.pt", "b.pt"],
             "locate": ["--random"], "meter": ["m.yaml"], "bench": ["kernels"]}[name]
    lazy_args = vars(build_parser(lazy=True).parse_args([name, *words]))
    full_args = vars(full.parse_args([name, *words]))
    assert lazy_args.keys() == full_args.keys()
    assert {k: v for k, v in lazy_args.items() if k != "func"} == {k: v for k, v in full_args.items() if k != "func"}


def test_version_has_one_source():
    from setuptools.config.pyprojecttoml import read_configuration

    import vexact
    from vexact.cli import package_version

    root = Path(__file__).resolve().parents[2]
    project = read_configuration(root / "pyproject.toml")["project"]
    assert project["version"] == vexact.__version__ == package_version()
    assert 'dynamic = ["version"]' in (root / "pyproject.toml").read_text()  # no second literal version


def test_check_and_check_paths_share_their_arrangements():
    import inspect

    from vexact.cli import build_parser
    from vexact.real.check import DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES, CheckSettings
    from vexact.testing import check_paths

    kw = {n: p.default for n, p in inspect.signature(check_paths).parameters.items()}
    assert kw["batch_sizes"] == DEFAULT_BATCH_SIZES == CheckSettings().batch_sizes
    assert kw["micro_batch_sizes"] == DEFAULT_MICRO_BATCH_SIZES == CheckSettings().micro_batch_sizes
    args = build_parser().parse_args(["check"])
    assert (args.batch_sizes, args.micro_batch_sizes) == (DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES)
