"""The code blocks of README.md and docs/ that say they run, run as written; every other one says why it is not run.

Every fenced block in bash or python (also ``sh``, ``shell``, ``console``, ``py``) carries a marker: an HTML comment
on the last non-blank line before its opening fence (invisible on the site and on a code host).

* ``<!-- runnable -->``: this test runs it. A page's runnable blocks run in order in one fresh directory (a later
  block sees the files of an earlier one, as a reader following the page would), with ``vexact``, ``python`` and
  ``python3`` on ``PATH`` meaning this interpreter and this checkout, ``experiments/`` linked in, one torch thread
  (``OMP_NUM_THREADS=1``: the commands give the same results at any thread count, and CI's cores are shared), and a
  time limit. A bash block runs under ``bash -e -o pipefail``, a python block as a script. Options, after a colon,
  separated by ``;``: ``exit=N`` (the exit code the page shows, default 0), ``timeout=S`` (seconds, default
  ``TIMEOUT``), ``expect=TEXT`` (a text the output must contain), ``file=NAME`` with ``run=COMMAND`` (write the
  block to ``NAME`` and run ``COMMAND``: a test file the page runs with pytest, say).
* ``<!-- not-run: REASON -->``: not run, for the reason given (minutes or hours of work, a GPU, a package not
  installed, a placeholder to fill in). Where the work itself matters, a smaller equivalent is tested elsewhere and
  the reason says where.
* ``<!-- run-by: tests/SUBJECT/test_x.py::test_name -->``: run as written by that test, which checks more than an exit
  code (this test checks that the test exists).
* ``<!-- fragment -->`` (python only): part of a program (a method body, names defined by the reader's code).

Every python block must parse, whatever its marker. A block without a marker, or with an unknown one, fails
:func:`test_every_code_block_is_marked`, so a new page cannot add a block that nobody ran.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import nested_pytest_environment

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python", "py": "python"}
TIMEOUT = 300
"""Seconds per runnable block: each takes seconds on an idle 2-core host; the margin is for a loaded CI host."""
MARKER = re.compile(r"^\s*<!-- (runnable|not-run|run-by|fragment)(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
OPTIONS = {"exit", "timeout", "expect", "file", "run"}


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str  # bash or python
    code: str  # dedented
    kind: str | None  # runnable, not-run, run-by, fragment; None when unmarked
    argument: str  # the text after the colon: options, or the reason

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def options(self) -> dict[str, str]:
        """The ``key=value`` options of a runnable block (ValueError naming the block on a bad one)."""
        out = {}
        for part in filter(None, (p.strip() for p in self.argument.split(";"))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in OPTIONS:
                raise ValueError(f"{self.where}: runnable option {part!r}; expected key=value with a key of "
                                 f"{', '.join(sorted(OPTIONS))}")
            out[key.strip()] = value.strip()
        if ("file" in out) != ("run" in out):
            raise ValueError(f"{self.where}: runnable options file= and run= go together")
        return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The bash and python blocks of one page, each with the marker before it (``page``: relative to ``root``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, language = match.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])),
                   len(lines))
        if language in LANGUAGES:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before)
            code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
            found.append(Block(path.relative_to(root).as_posix(), i + 1, LANGUAGES[language], code,
                               marker.group(1) if marker else None, (marker.group(2) or "") if marker else ""))
        i = end + 1
    return found


ALL = [b for page in pages() for b in blocks(page)]
RUNNABLE_PAGES = sorted({b.page for b in ALL if b.kind == "runnable"})


def test_every_code_block_is_marked():
    assert len(ALL) > 50 and RUNNABLE_PAGES  # the scan finds the pages' blocks
    unmarked = [f"{b.where} ({b.language})" for b in ALL if b.kind is None]
    assert unmarked == [], ("a code block needs a marker on the line before it: <!-- runnable -->, "
                            "<!-- not-run: REASON -->, <!-- run-by: TEST --> or (python) <!-- fragment -->; see "
                            "tests/docs/test_docs_blocks.py")
    assert [b.where for b in ALL if b.kind == "not-run" and not b.argument.strip()] == []  # a reason is given
    assert [b.where for b in ALL if b.kind == "fragment" and b.language != "python"] == []
    for b in ALL:
        if b.kind == "runnable":
            b.options()  # raises naming the block
    missing = []
    for b in (b for b in ALL if b.kind == "run-by"):
        path, _, name = b.argument.partition("::")
        test = ROOT / path
        if not (test.is_file() and name and f"def {name}(" in test.read_text()):
            missing.append(f"{b.where}: {b.argument}")
    assert missing == []  # the test that runs the block exists
    named = {(b.where, path) for b in ALL if b.kind == "not-run"
             for path in re.findall(r"tests/\w+/\w+\.py", b.argument)}
    assert [f"{where}: {path}" for where, path in sorted(named) if not (ROOT / path).is_file()] == []


def test_every_python_block_parses():
    bad = []
    for b in ALL:
        if b.language == "python":
            try:
                compile(b.code, b.where, "exec")
            except SyntaxError as err:
                bad.append(f"{b.where}: {err.msg} (block line {err.lineno})")
    assert bad == []


def test_add_tasks_command_for_a_task_in_your_own_module_imports_the_module():
    """A task in your own module exists once the module is imported, as add_task.md says: its "Check it" command
    lacked --set plugins=[MODULE], so as written it ran into "task.name: not registered". The command names the
    module, and its overrides load with MODULE and NEW filled in."""
    from vexact.rl.config import load_config

    page = ROOT / "docs" / "howto" / "add_task.md"
    commands = [line for b in blocks(page) if b.language == "bash" for line in b.code.splitlines()
                if line.startswith("vexact run") and "task.name=NEW" in line and "MODULE" in line]
    assert commands, f"{page.name}: no vexact run command for a task in your own module (MODULE)"
    for command in commands:
        argv = shlex.split(command.replace("MODULE", "json").replace("NEW", "reverse"))
        overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        assert "plugins=[json]" in overrides, command
        assert load_config(ROOT / argv[2], overrides).plugins == ["json"]


def test_the_scan_sees_markers_and_refuses_a_bad_option(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n<!-- runnable: exit=1; expect=x -->\n```bash\nfalse\n```\n\n```python\nx = 1\n```\n\n"
                    "- item\n\n    <!-- not-run: takes an hour -->\n\n    ```bash\n    sleep 3600\n    ```\n")
    found = blocks(page, tmp_path)
    assert [(b.line, b.language, b.kind, b.argument, b.code) for b in found] == [
        (4, "bash", "runnable", "exit=1; expect=x", "false\n"),
        (8, "python", None, "", "x = 1\n"),
        (16, "bash", "not-run", "takes an hour", "sleep 3600\n")]
    assert found[0].options() == {"exit": "1", "expect": "x"}
    with pytest.raises(ValueError, match="page.md:4: runnable option 'retries=2'"):
        Block("page.md", 4, "bash", "", "runnable", "retries=2").options()


def _environment(tmp: Path) -> dict[str, str]:
    """PATH with ``vexact``, ``python`` and ``python3`` as this interpreter (with this checkout first on its path)."""
    shims = tmp / ".shims"
    shims.mkdir()
    for name, command in (("vexact", f"{shlex.quote(sys.executable)} -m vexact"),
                          ("python", shlex.quote(sys.executable)), ("python3", shlex.quote(sys.executable))):
        (shims / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (shims / name).chmod(0o755)
    # a block may run pytest itself (docs/tutorials/testing.md): as a user's run, not as this run's xdist worker
    return {**nested_pytest_environment(), "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "160"}


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run one runnable block in ``cwd``: (exit code, stdout + stderr). A path under ``/tmp/`` that a page writes
    for its reader is taken under ``cwd`` instead: another run on the host (or another user's file) may hold it."""
    options = block.options()
    code = block.code.replace("/tmp/", f"{cwd}/")
    if "file" in options:
        (cwd / options["file"]).write_text(code)
        argv = ["bash", "-e", "-o", "pipefail", "-c", options["run"].replace("/tmp/", f"{cwd}/")]
    elif block.language == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        script = cwd / f".block-{block.line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    timeout = float(options.get("timeout", TIMEOUT))
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {timeout:g} s")
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_runnable_blocks_run_as_written(page, tmp_path):
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    env = _environment(tmp_path)
    for block in [b for b in ALL if b.page == page and b.kind == "runnable"]:
        options = block.options()
        code, output = run_block(block, tmp_path, env)
        assert code == int(options.get("exit", 0)), f"{block.where}: exit code {code}\n{output[-3000:]}"
        assert options.get("expect", "") in output, f"{block.where}: no {options['expect']!r} in\n{output[-3000:]}"
