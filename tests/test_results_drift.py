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
* ``python -m tools.published`` (both tables) and ``python -m vexact.lab.scaling shape`` (the shipped map);
* ``python -m vexact.lab.bias_meter noise-bias ...`` on the shipped ``horizon_scaling_noise_bias_meter.json``;
* ``python -m tools.studies.tail_compare --sweep runs/sweeps/horizon_scaling_tail_sweep`` (the kept tail logs);
* ``python (the block above)``: what the runnable python block right above the marker prints;
* ``vexact compare /tmp/roll.jsonl /tmp/train.jsonl --map ...`` on the synthetic dumps that the runnable block of
  docs/reference/map.md writes (that page's worked example is checked too); qualifiers ``(last lines)`` and
  ``(verdict and reference lines)``.

Every other generated block is listed in ``NOT_REGENERATED`` with the reason (its run directories are not kept:
the sweeps, meters and GPU runs behind them take minutes to hours, or a GPU). :func:`test_every_generated_block_is_
regenerated_or_listed` fails on a block in neither set, so a new page cannot add an unchecked block silently.
Skipped: ``benchmarks.md``, ``benchmarks_price_fp32.md`` and ``gpu_triton.md`` (timings of one machine; their own
tests regenerate their tables from the kept JSON where they can).
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DATA = RESULTS / "data"
GENERATED = re.compile(r"<!-- generated: (?P<command>.+?) -->\n(?P<body>.*?)\n\s*<!-- end generated -->", re.S)
QUALIFIER = re.compile(r"^(?P<command>.*?)(?: \((?P<qualifier>[^()]*)\))?$")
SKIPPED_PAGES = {"benchmarks.md", "benchmarks_price_fp32.md", "gpu_triton.md"}  # timings: their own tests

# page -> {command as marked: why it is not regenerated here}
NOT_REGENERATED: dict[str, dict[str, str]] = {}


def generated_blocks(page: Path) -> list[tuple[str, str]]:
    """(command as marked, body) of each generated block of a page, in order."""
    return [(m.group("command"), m.group("body")) for m in GENERATED.finditer(page.read_text())]


def _pages() -> list[Path]:
    """The results pages, and the reference page that carries the map's worked ``compare --map`` example."""
    return [p for p in sorted(RESULTS.glob("*.md")) if p.name not in SKIPPED_PAGES] + [ROOT / "docs/reference/map.md"]


def _tarball_holding(sweep: str) -> Path | None:
    for path in sorted(DATA.glob("*.tar.gz")):
        if sweep in _top_dirs(path):
            return path
    return None


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
    from vexact.lab.sweep_data import read_sweep_results
    from vexact.lab.sweep_table import group_markdown, group_table, reward_definition

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


def regenerate(page: Path, command: str, body: str, tmp: Path) -> str | None:
    """What ``command`` (as marked on ``page`` above ``body``) prints now, or None when this test cannot regenerate
    it."""
    parsed = QUALIFIER.match(command)
    bare, qualifier = parsed.group("command"), parsed.group("qualifier")
    words = bare.split()
    if words[:2] == ["vexact", "report"] and words[2].startswith("runs/sweeps/"):
        sweep = words[2].removeprefix("runs/sweeps/")
        if _tarball_holding(sweep) is None:
            return None
        return _report_table(_extract(sweep, tmp), finished_only=qualifier == "rows with finished points")
    if bare == "python -m tools.published":
        from tools import published

        first, second = _printed(published.main, []).split("\n\n")
        return {"first table": first, "second table": second}[qualifier]
    if bare == "python -m vexact.lab.scaling shape":
        from vexact.lab import scaling

        return f"```\n{_printed(scaling._main, ['shape'])}\n```"
    if bare.startswith("python -m vexact.lab.bias_meter noise-bias "):
        from vexact.lab import bias_meter

        return _printed(bias_meter._main, ["noise-bias", str(DATA / "horizon_scaling_noise_bias_meter.json")])
    if bare.startswith("python -m tools.studies.tail_compare --sweep runs/sweeps/"):
        from tools.studies import tail_compare

        sweep = _extract(words[-1].removeprefix("runs/sweeps/"), tmp)
        return _printed(tail_compare.main, ["--sweep", str(sweep)])
    if bare == "python" and qualifier == "the block above":
        return f"```\n{_run_python_above(page, command)}\n```"
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


def _run_python_above(page: Path, command: str) -> str:
    """What the runnable python block right above the marker prints (run as test_docs_blocks runs it)."""
    text = page.read_text()
    above = text[:text.index(f"<!-- generated: {command} -->")]
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
