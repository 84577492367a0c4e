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
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- generated: (?P<command>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


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


def regenerate(text: str, outputs: dict[str, Path]) -> tuple[str, list[str]]:
    """The README text with every block rendered from ``outputs[command]``, and the commands whose block changed."""
    changed: list[str] = []
    pieces, last = [], 0
    for m in blocks(text):
        command = m.group("command")
        body = GENERATORS[command][0](outputs[command])
        if body != m.group("body"):
            changed.append(command)
        pieces += [text[last:m.start("body")], body]
        last = m.end("body")
    return "".join(pieces + [text[last:]]), changed


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
            new, changed = regenerate(text, outputs)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
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
