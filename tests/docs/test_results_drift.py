"""The results pages' generated blocks are what their commands print now: a block cannot drift from its data.

The convention (docs/reference/tests.md): a block of command output on a page under ``docs/results/`` sits between

    <!-- generated: COMMAND -->
    ...the output, as a table or a fenced block...
    <!-- end generated -->

where COMMAND is the command a reader runs to get it, optionally followed by a parenthesised qualifier: ``(rows with
finished points)`` (a sweep table without the rows of grid points not yet run), ``(last lines)`` (the tail of
the output), ``(first table)`` / ``(second table)``. Prose numbers a page gives are read off these blocks.

This test regenerates every block whose command is cheap and deterministic from what the repository holds:

* ``vexact report runs/sweeps/NAME`` where ``docs/results/data/*.tar.gz`` holds the sweep's kept logs: the table
  ``report/table.md`` holds (without its title), from the extracted logs, in-process and without the plots;
* ``python -m tools.published`` (both tables) and ``python -m vexact.map shape`` (the shipped map);
* ``python -m vexact.map sensitivity vexact/map/default_map.json runs/sweeps/...`` on the kept logs of those sweeps;
* ``python -m vexact.sweeps.bias_meter noise-bias ...`` on the shipped ``horizon_scaling_noise_bias_meter.json``;
* ``python -m tools.studies.tail_compare --sweep runs/sweeps/horizon_scaling_tail_sweep`` (the kept tail logs);
* ``python -m tools.studies.policy_lag runs/sweeps/NAME`` (the kept logs of a policy-lag sweep);
* ``python (the block above)``: what the runnable python block right above the marker prints;
* ``vexact bench tables FILE...`` where every FILE is a benchmark record kept in ``docs/results/data/``: the tables
  printed from the record (without the ``## FILE`` line each record's tables start with, as the pages show them;
  ``(from its Measured on: line)`` marks the same), in-process -- the timings were measured once, the tables are a
  function of the kept JSON;
* ``vexact compare /tmp/roll.jsonl /tmp/train.jsonl --map ...`` on the synthetic dumps that the runnable block of
  docs/reference/map.md writes (that page's worked example is checked too); qualifiers ``(last lines)`` and
  ``(verdict and reference lines)``.

Not regenerated (``NOT_REGENERATED`` holds each block with its reason; :func:`test_every_generated_block_is_
regenerated_or_listed` fails on a block in neither set, so a new page cannot add an unchecked block silently):

* reports of sweeps whose run directories are not kept (their runs take hours): collapse_sweep.md; how_low.md
  (both); remedies.md (both); horizon_sweeps.md's bias sweep and horizon_corrections.md's recompute and
  fp8 sweeps; surge.md's calibration table and its
  sources and recompute reports; surge_remedies.md's report; what_mismatch_is_safe.md (all four);
* meters whose cells are not kept: horizon_meter.md's bias-ratio meter, vocab_tail.md's tail meter and its
  comparison with the 22-token meter;
* surge.md's ``surge_modes`` table (it trains an 800-step warm start: minutes);
* vllm_map.md's two tables (vLLM runs, in vLLM's own venv, not kept).

The timing pages (``benchmarks.md``, ``benchmarks_sessions.md``, ``benchmarks_price_fp32.md``, ``benchmarks_peer.md``:
timings of one machine) are checked like the others: their blocks print from kept JSON (``vexact bench tables``,
runnable python blocks), so a page cannot show a record's old tables after the record was measured again
(gpu_triton.md's tables are printed from its kept raw output, so they are regenerated too).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
DATA = RESULTS / "data"
GENERATED = re.compile(r"<!-- generated: (?P<command>.+?) -->\n(?P<body>.*?)\n\s*<!-- end generated -->", re.S)
QUALIFIER = re.compile(r"^(?P<command>.*?)(?: \((?P<qualifier>[^()]*)\))?$")

NOT_KEPT = "the sweep's run directories are not kept in the repository (its runs take hours)"
# page -> {command as marked: why this test cannot regenerate it}
NOT_REGENERATED: dict[str, dict[str, str]] = {
    "collapse_sweep.md": {"vexact report runs/sweeps/collapse_sweep": NOT_KEPT},
    "horizon_sweeps.md": {
        "vexact report runs/sweeps/horizon_scaling_bias_sweep": NOT_KEPT + "; its thresholds are in the shipped map",
    },
    "horizon_corrections.md": {
        "vexact report runs/sweeps/horizon_scaling_bias_recompute_sweep": NOT_KEPT,
        "vexact report runs/sweeps/horizon_scaling_sources_sweep": NOT_KEPT,
    },
    "horizon_meter.md": {"vexact meter experiments/horizon_scaling_meter.yaml":
                         "the meter's cells (meter.json) are not kept; the meter itself takes about an hour"},
    "how_low.md": {"vexact report runs/sweeps/collapse_low_sweep": NOT_KEPT,
                   "vexact report runs/sweeps/collapse_long_sweep": NOT_KEPT},
    "remedies.md": {"vexact report runs/sweeps/remedies_sweep": NOT_KEPT,
                    "vexact report runs/sweeps/remedies_ramp_sweep": NOT_KEPT},
    "surge.md": {
        "python -m tools.studies.surge_modes experiments/surge_testbed.yaml":
            "trains the surge testbed's 800-step warm start (minutes)",
        "python -m tools.studies.surge_plot runs/sweeps/surge_calibration_sweep --table": NOT_KEPT,
        "vexact report runs/sweeps/surge_sources_sweep": NOT_KEPT,
        "vexact report runs/sweeps/surge_sources_recompute_sweep": NOT_KEPT,
    },
    "surge_remedies.md": {"vexact report runs/sweeps/surge_remedies_sweep": NOT_KEPT},
    "vllm_map.md": {
        "python -m tools.studies.run_on_map runs/vllm_horizon/* runs/vllm_surge/*":
            "vLLM runs: they need vLLM's CPU build in its own venv, and their run directories are not kept",
        "the second table's python": "the same vLLM runs' metrics.jsonl, not kept",
    },
    "vocab_tail.md": {
        "vexact meter experiments/horizon_scaling_tail_meter.yaml": "the tail meter's cells are not kept (15 minutes)",
        "python -m tools.studies.tail_compare runs/meter/horizon_scaling_tail_meter/meter.json "
        "runs/meter/horizon_scaling_meter/meter.json": "both meters' cells are not kept",
    },
    "what_mismatch_is_safe.md": {
        "vexact report runs/sweeps/realistic_noise_sweep": NOT_KEPT,
        "vexact report runs/sweeps/realistic_sources_sweep": NOT_KEPT,
        "vexact report runs/sweeps/realistic_sources_recompute_sweep": NOT_KEPT,
        "vexact report runs/sweeps/realistic_fp8_long_sweep": NOT_KEPT,
    },
}


def generated_blocks(page: Path) -> list[tuple[str, str]]:
    """(command as marked, body) of each generated block of a page, in order."""
    return [(m.group("command"), m.group("body")) for m in GENERATED.finditer(page.read_text())]


def _pages() -> list[Path]:
    """The results pages, and the reference page that carries the map's worked ``compare --map`` example."""
    return sorted(RESULTS.glob("*.md")) + [ROOT / "docs/reference/map.md"]


def _tarball_holding(sweep: str) -> Path | None:
    """The kept logs of ``sweep``: ``SWEEP.tar.gz`` (the page's tar command), else the first tarball holding it."""
    named = DATA / f"{sweep}.tar.gz"
    if named.is_file():
        return named
    return next((path for path in sorted(DATA.glob("*.tar.gz")) if sweep in _top_dirs(path)), None)


_TOPS: dict[Path, set[str]] = {}


def _top_dirs(path: Path) -> set[str]:
    if path not in _TOPS:
        with tarfile.open(path) as tar:
            _TOPS[path] = {name.split("/", 1)[0] for name in tar.getnames()}
    return _TOPS[path]


def _extract(sweep: str, where: Path) -> Path:
    """The sweep's kept logs extracted under ``where`` (once per test), as its page's tar command does."""
    target = where / sweep
    if not target.exists():
        tarball = _tarball_holding(sweep)
        assert tarball is not None, f"no tarball under {DATA} holds {sweep}"
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/", 1)[0] == sweep]
            tar.extractall(where, members=members, filter="data")
    return target


def _report_table(sweep_dir: Path, finished_only: bool) -> str:
    """What ``vexact report`` writes to report/table.md (its title left out), without writing or plotting."""
    from vexact.reports.sweep_table import group_markdown, group_table, reward_definition
    from vexact.sweeps.sweep_data import read_sweep_results

    data = read_sweep_results(sweep_dir)
    rows = group_table(data)
    if finished_only:
        rows = [row for row in rows if row.get("seeds")]
    return group_markdown(rows, notes=[reward_definition(data.points)]).rstrip("\n")


def _printed(main, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) in (0, None)
    return out.getvalue().rstrip("\n")


def regenerable(command: str) -> bool:
    """Whether :func:`regenerate` can regenerate a block marked with ``command`` (without running it)."""
    parsed = QUALIFIER.match(command)
    bare, qualifier = parsed.group("command"), parsed.group("qualifier")
    words = bare.split()
    if words[:2] == ["vexact", "report"] and words[2].startswith("runs/sweeps/"):
        return _tarball_holding(words[2].removeprefix("runs/sweeps/")) is not None
    return (bare in ("python -m tools.published", "python -m vexact.map shape")
            or bare.startswith(("python -m vexact.sweeps.bias_meter noise-bias ",
                                "python -m vexact.map sensitivity vexact/map/default_map.json runs/sweeps/",
                                "python -m tools.studies.tail_compare --sweep runs/sweeps/",
                                "python -m tools.studies.policy_lag runs/sweeps/",
                                "vexact compare /tmp/roll.jsonl /tmp/train.jsonl --map"))
            or (bare == "python" and qualifier == "the block above")
            or _kept_benchmark_records(words) is not None)


def _kept_benchmark_records(words: list[str]) -> list[str] | None:
    """The arguments of a ``vexact bench tables`` command whose every file is a record kept in docs/results/data
    (flags as given), else None."""
    if words[:3] != ["vexact", "bench", "tables"]:
        return None
    args = words[3:]
    files = [a for a in args if not a.startswith("--")]
    kept = bool(files) and all(Path(f).parent == Path("docs/results/data") and (ROOT / f).is_file() for f in files)
    return [a if a.startswith("--") else str(ROOT / a) for a in args] if kept else None


def regenerate(page: Path, command: str, body: str, tmp: Path) -> str | None:
    """What ``command`` (as marked on ``page`` above ``body``) prints now, or None when this test cannot regenerate
    it."""
    if not regenerable(command):
        return None
    parsed = QUALIFIER.match(command)
    bare, qualifier = parsed.group("command"), parsed.group("qualifier")
    words = bare.split()
    if words[:2] == ["vexact", "report"]:
        sweep = words[2].removeprefix("runs/sweeps/")
        return _report_table(_extract(sweep, tmp), finished_only=qualifier == "rows with finished points")
    if bare == "python -m tools.published":
        from tools import published

        first, second = _printed(published.main, []).split("\n\n")
        return {"first table": first, "second table": second}[qualifier]
    if bare == "python -m vexact.map shape":
        from vexact.map import build

        return f"```\n{_printed(build.main, ['shape'])}\n```"
    if bare.startswith("python -m vexact.map sensitivity "):
        from vexact.map import build

        # the map's curves name the sweeps their horizons came from as runs/sweeps/NAME: run where that path holds
        for w in words[5:]:
            _extract(w.removeprefix("runs/sweeps/"), tmp / "runs" / "sweeps")
        with contextlib.chdir(tmp):
            printed = _printed(build.main, ["sensitivity", str(ROOT / words[4]), *words[5:]])
        return f"```\n{printed}\n```"
    if bare.startswith("python -m vexact.sweeps.bias_meter noise-bias "):
        from vexact.sweeps import bias_meter

        return _printed(bias_meter._main, ["noise-bias", str(DATA / "horizon_scaling_noise_bias_meter.json")])
    if bare.startswith("python -m tools.studies.tail_compare --sweep runs/sweeps/"):
        from tools.studies import tail_compare

        sweep = _extract(words[-1].removeprefix("runs/sweeps/"), tmp)
        return _printed(tail_compare.main, ["--sweep", str(sweep)])
    if bare.startswith("python -m tools.studies.policy_lag runs/sweeps/"):
        from tools.studies import policy_lag

        return _printed(policy_lag.main, [str(_extract(words[-1].removeprefix("runs/sweeps/"), tmp))])
    if bare == "python" and qualifier == "the block above":
        return f"```\n{_run_python_above(page, command, body)}\n```"
    if (records := _kept_benchmark_records(words)) is not None:
        from benchmarks import tables

        printed = _printed(tables.main, records)
        if qualifier == "from its Measured on: line":
            return printed[printed.index("Measured on:"):]
        assert qualifier is None, f"{page.name}: unknown qualifier ({qualifier}) of `{command}`"
        # one record's tables start with the line `## FILE` and a blank line, which the pages leave out
        return printed.split("\n", 2)[2] if printed.startswith("## ") else printed
    if bare.startswith("vexact compare /tmp/roll.jsonl /tmp/train.jsonl --map"):
        printed = _compare(page, words[2:], tmp)
        if qualifier == "last lines":  # the block shows the output's last lines, fenced
            shown = len(body.splitlines()) - 2
            printed = "\n".join(printed.splitlines()[-shown:])
        elif qualifier == "verdict and reference lines":
            printed = "\n".join(line for line in printed.splitlines()
                                 if line.startswith(("  verdict:", "  vocabulary:", "  for reference")))
        return f"```\n{printed}\n```"
    return None


def _run_python_above(page: Path, command: str, body: str) -> str:
    """What the runnable python block right above the marker (of the block holding ``body``: a page may have several
    such blocks) prints (run as test_docs_blocks runs it)."""
    text = page.read_text()
    above = text[:text.index(f"<!-- generated: {command} -->\n{body}")]
    *_, code = above.split("<!-- runnable -->\n```python\n")
    code, after = code.split("```", 1)
    assert not after.strip(), f"{page.name}: no runnable python block right above `{command}`"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.rstrip("\n")


def _compare(page: Path, argv: list[str], tmp: Path) -> str:
    """``vexact compare`` on the synthetic dumps of the map's worked example (docs/reference/map.md's runnable python
    block writes them; here to ``tmp`` instead of /tmp)."""
    text = (ROOT / "docs" / "reference" / "map.md").read_text()
    writer = [b for b in re.findall(r"<!-- runnable -->\n```python\n(.*?)```", text, re.S) if "/tmp/roll.jsonl" in b]
    assert len(writer) == 1, "docs/reference/map.md: one runnable block writes /tmp/roll.jsonl"
    if not (tmp / "roll.jsonl").exists():
        exec(compile(writer[0].replace("/tmp/", f"{tmp}/"), f"{page.name}: the dumps' block", "exec"), {})
    args = [a.replace("/tmp/", f"{tmp}/") for a in argv]
    done = subprocess.run([sys.executable, "-m", "vexact", "compare", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "160"}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.rstrip("\n")


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_generated_blocks_are_what_their_commands_print_now(page, tmp_path):
    checked = 0
    for command, body in generated_blocks(page):
        now = regenerate(page, command, body, tmp_path)
        if now is None:
            continue
        checked += 1
        assert body == now, f"{page.name}: the block of `{command}` drifted; regenerate it"
    if not checked:
        pytest.skip(f"{page.name}: no generated block regenerable here (see NOT_REGENERATED)")


def test_every_generated_block_is_regenerated_or_listed():
    """A generated block this test cannot regenerate is listed, with its reason, in NOT_REGENERATED (and a listed
    block is still on its page): a new page cannot add an unchecked block silently."""
    pages = _pages()
    unlisted = [f"{p.name}: {command}" for p in pages for command, _ in generated_blocks(p)
                if not regenerable(command) and command not in NOT_REGENERATED.get(p.name, {})]
    assert unlisted == []
    on_pages = {(p.name, command) for p in pages for command, _ in generated_blocks(p)}
    stale = [f"{page}: {command}" for page, listed in NOT_REGENERATED.items() for command in listed
             if (page, command) not in on_pages or regenerable(command)]
    assert stale == []
    assert sum(regenerable(command) for p in pages for command, _ in generated_blocks(p)) >= 10


@pytest.mark.slow
def test_a_stale_block_is_found(tmp_path):
    """The comparison can fail: a published-bars table with one cell changed is not what the command prints."""
    page = RESULTS / "published_runs.md"
    command, body = next((c, b) for c, b in generated_blocks(page) if c.endswith("(second table)"))
    assert regenerate(page, command, body, tmp_path) == body
    stale = body.replace("| 0.001 |", "| 0.002 |", 1)
    assert stale != body and regenerate(page, command, stale, tmp_path) != stale


@pytest.mark.slow
def test_a_stale_benchmark_table_is_found(tmp_path):
    """A timing page's table from a kept benchmark record, with one ratio changed, is not what its command prints."""
    page = RESULTS / "benchmarks_sessions.md"
    command, body = next((c, b) for c, b in generated_blocks(page) if "guard_modes_intel_xeon.json" in c)
    assert regenerate(page, command, body, tmp_path) == body
    stale = re.sub(r"\| (\d\.\d\d)×", lambda m: f"| {float(m.group(1)) + 0.01:.2f}×", body, count=1)
    assert stale != body and regenerate(page, command, stale, tmp_path) != stale
