"""Regenerate or check the README's tables that a command prints.

    python -m benchmarks.readme_tables --check                # each block vs the command's output on disk
    python -m benchmarks.readme_tables                        # rewrite the blocks from it
    python -m benchmarks.readme_tables --run                  # run each command first (the demo: minutes)

A table a command prints sits in the README between ``<!-- generated: COMMAND -->`` and ``<!-- end generated -->``;
``GENERATORS`` maps each COMMAND to the function that renders its block from what the command wrote. ``vexact
demo`` writes its table to ``runs/demo/report/table.md`` (the table it prints, and the note that says peak and
final reward are smoothed); the block is that file without its title. ``--check`` exits 1 naming every block that
differs (``--demo-dir`` points at another demo output), so numbers in the README are copied from the command,
never typed.

A block records the host it was generated on (``<!-- generated: COMMAND; host: MODEL (FLAGS) -->``, from the runs'
``host_cpu``): the exact kernels' bits rest on each host's BLAS and vector math, so another CPU prints other rewards
and, near a threshold, other per-seed outcomes. ``--check`` on the table's host compares the whole block; on another
host it compares what carries across hosts (``carried``): the table's columns and rows, and zero mismatch at
inject.value 0 (its k3, |Δlogp| and collapse rate), and says that it did.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- generated: (?P<command>[^>;]+?)(?:; host: (?P<host>[^>]+?))? -->\n(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.S)
CARRIED_KEYS = ("inject.value", "seeds")
"""Columns that name a row: every host prints the same rows."""
CARRIED_AT_ZERO = ("realised k3 KL", "realised |Δlogp|", "collapse rate")
"""Columns that carry across hosts in the row without injection: exact's zero mismatch (and so no collapse)."""


def output_host(out: Path) -> str | None:
    """The host a command's runs ran on: ``MODEL (FLAGS)`` from the first point summary's ``host_cpu`` (None when
    the runs did not record it)."""
    for summary in sorted(out.glob("points/*/summary.json")):
        try:
            cpu = json.loads(summary.read_text()).get("host_cpu")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(cpu, dict) and cpu.get("model"):
            return f"{cpu['model']} ({', '.join(cpu.get('flags') or [])})"
    return None


def table_rows(body: str) -> list[list[str]]:
    """A markdown table's rows as cells (split on unescaped ``|``, ``\\|`` read as ``|``), separator rows left out."""
    rows = []
    for line in body.splitlines():
        if not line.startswith("|") or set(line) <= set("|:- "):
            continue
        rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def carried(body: str) -> list[list[str]]:
    """What of a demo table carries across hosts: its header, each row's key cells, and the mismatch cells of the
    row without injection; every other cell blanked."""
    rows = table_rows(body)
    if not rows:
        return []
    header = rows[0]
    keep = {i for i, name in enumerate(header) if name in CARRIED_KEYS}
    at_zero = {i for i, name in enumerate(header) if name in CARRIED_AT_ZERO}
    out = [header]
    for row in rows[1:]:
        zero = bool(row) and row[0] in ("0", "0.0")
        out.append([c if i in keep or (zero and i in at_zero) else "" for i, c in enumerate(row)])
    return out


def demo_block(out: Path) -> str:
    """The block of ``vexact demo``: its report's table.md (written by the demo) without the title line."""
    table = out / "report" / "table.md"
    if not table.exists():
        raise ValueError(f"{table} not found: run `vexact demo` (or this script with --run) first")
    lines = table.read_text().splitlines()
    if lines and lines[0].startswith("### "):  # the sweep's name: the README's section heading says it
        lines = lines[1:]
    return "\n".join(lines).strip() + "\n"


def run_demo(out: Path) -> None:
    """``vexact demo`` as the README says, into ``out`` (a fresh directory: a finished demo would be reused)."""
    subprocess.run([sys.executable, "-m", "vexact", "demo", "--output-dir", str(out)], check=True)


GENERATORS: dict[str, tuple[Callable[[Path], str], Callable[[Path], None]]] = {
    "vexact demo": (demo_block, run_demo),
}
"""README command -> (render its block from the command's output directory, run the command into one)."""


def blocks(text: str) -> list[re.Match]:
    """The generated blocks of a README text; an unknown command is a ValueError (nothing could check it)."""
    found = list(BLOCK.finditer(text))
    for m in found:
        if m.group("command") not in GENERATORS:
            raise ValueError(f"README block '<!-- generated: {m.group('command')} -->' has no generator in "
                             f"benchmarks/readme_tables.py (known: {', '.join(GENERATORS)})")
    return found


def regenerate(text: str, outputs: dict[str, Path]) -> tuple[str, list[str], list[str]]:
    """The README text with every block rendered from ``outputs[command]`` (its marker naming the output's host),
    the commands whose block differs, and notes. A block of another host than the output's differs only where what
    carries across hosts differs (``carried``), and a note says so."""
    changed: list[str] = []
    notes: list[str] = []
    pieces, last = [], 0
    for m in blocks(text):
        command, table_host = m.group("command"), m.group("host")
        body = GENERATORS[command][0](outputs[command])
        host = output_host(outputs[command])
        if host and table_host and host != table_host:
            notes.append(f"`{command}`: the table is {table_host}'s and this output {host}'s: compared what carries "
                         "across hosts (the table's rows, and zero mismatch without injection)")
            differs = carried(body) != carried(m.group("body"))
        else:
            differs = body != m.group("body") or (host or table_host) != table_host
        if differs:
            changed.append(command)
        marker = f"<!-- generated: {command}" + (f"; host: {host or table_host}" if host or table_host else "")
        pieces += [text[last:m.start()], f"{marker} -->\n{body}"]
        last = m.start(4)
    return "".join(pieces + [text[last:]]), changed, notes


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs; change nothing")
    parser.add_argument("--run", action="store_true", help="run each command first, into a temporary directory")
    parser.add_argument("--demo-dir", type=Path, default=Path("runs") / "demo",
                        help="vexact demo's output directory (default runs/demo, where `vexact demo` writes)")
    parser.add_argument("--readme", type=Path, default=README, help="the file holding the blocks")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    with tempfile.TemporaryDirectory(prefix="readme-tables-") as tmp:
        outputs = {"vexact demo": args.demo_dir}
        if args.run:
            for command in {m.group("command") for m in blocks(text)}:
                outputs[command] = Path(tmp) / command.replace(" ", "_")
                GENERATORS[command][1](outputs[command])
        try:
            new, changed, notes = regenerate(text, outputs)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    for note in notes:
        print(f"{args.readme}: {note}")
    if args.check:
        for command in changed:
            print(f"{args.readme}: the block of `{command}` differs from the command's output; regenerate it with "
                  "python -m benchmarks.readme_tables", file=sys.stderr)
        return 1 if changed else 0
    if changed:
        args.readme.write_text(new)
    print(f"{args.readme}: {len(changed)} block(s) rewritten" + (f" ({', '.join(changed)})" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
