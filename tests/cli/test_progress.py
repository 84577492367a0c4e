"""Progress of long commands (``vexact.progress``): a bar on a terminal, ``[k/N]`` lines with elapsed time and ETA
otherwise, nothing under ``--quiet``; a sweep's and ``vexact check``'s progress on stderr, the verdict last."""

from __future__ import annotations

import io
import re

from rich.console import Console
from test_sweep_faults import _sweep_file

from vexact.cli import main
from vexact.progress import Progress
from vexact.sweeps import sweep as sweep_module
from vexact.sweeps.sweep import load_sweep_spec, run_sweep


class _Clock:
    """time.monotonic for vexact.progress, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_prints_plain_lines_with_k_of_n_elapsed_and_eta_when_not_a_terminal(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("vexact.progress.time.monotonic", clock)
    out = io.StringIO()
    with Progress(Console(file=out, width=200), "sweep s", total=4, done=1) as progress:
        assert progress.mode == "plain"
        clock.now += 30
        progress.advance("a: completed")
        clock.now += 30
        progress.advance("b: completed")
        clock.now += 5
        progress.advance("c: completed")
    lines = out.getvalue().splitlines()
    # one point done before (a resume) is not counted in the rate: 30 s a point here
    assert lines == ["[2/4] sweep s: a: completed (30s elapsed, ETA 1m00s)",
                     "[3/4] sweep s: b: completed (1m00s elapsed, ETA 30s)",
                     "[4/4] sweep s: c: completed (done in 1m05s)"]


def test_progress_prints_names_as_text_and_said_lines_as_markup(monkeypatch):
    """A sweep's or point's name with brackets ("[/x]") was read as markup: a MarkupError, or text that vanished."""
    monkeypatch.setattr("vexact.progress.time.monotonic", _Clock())
    out = io.StringIO()
    with Progress(Console(file=out, width=200), "sweep s[v2]", total=2) as progress:
        progress.running("a=[/x]")
        progress.advance()
        progress.advance("[red]b: failed[/]")  # a said line is markup (its caller escapes the names in it)
    assert out.getvalue().splitlines() == ["[1/2] sweep s[v2]: a=[/x] (0s elapsed, ETA 0s)",
                                           "[2/2] sweep s[v2]: b: failed (done in 0s)"]
    bar = io.StringIO()
    with Progress(Console(file=bar, width=200, force_terminal=True), "sweep s[/v2]", total=1) as progress:
        assert progress.mode == "rich"
        progress.running("a=[/x]")
        progress.advance()
    assert "sweep s[/v2]" in bar.getvalue() and "a=[/x]" in bar.getvalue()


def test_progress_throttles_silent_items_and_is_quiet_under_quiet(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("vexact.progress.time.monotonic", clock)
    out = io.StringIO()
    with Progress(Console(file=out, width=200), "check", total=5, min_interval=10) as progress:
        for step in range(5):
            progress.running(f"unit {step}")
            clock.now += 4
            progress.advance()
    # 4 s an item, a line at most every 10 s, and the last one always
    assert out.getvalue().splitlines() == ["[3/5] check: unit 2 (12s elapsed, ETA 8s)", "[5/5] check (done in 20s)"]
    quiet = io.StringIO()
    with Progress(Console(file=quiet), "check", total=2, quiet=True) as progress:
        progress.advance()
        progress.advance("failed point", always=True)
    assert quiet.getvalue() == "failed point\n"  # only what must always be said


def test_progress_draws_a_rich_bar_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with Progress(console, "sweep s", total=2) as progress:
        assert progress.mode == "rich"
        progress.running("seed=0")
        progress.advance("seed=0: completed")
        progress.advance("seed=1: completed")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "seed=0: completed" in text and "2/2" in text and "ETA" in text and "━" in text


def test_sweep_prints_progress_lines_and_a_points_warm_start_before_its_outcome(tmp_path, monkeypatch):
    def fake_point(config: dict, resume: bool, threads: int | None) -> dict:
        return {"status": "completed", "error": None, "warm_start": [f"warm start: loaded cache {config['seed']}"]}

    monkeypatch.setattr(sweep_module, "_run_point", fake_point)
    spec = load_sweep_spec(_sweep_file(tmp_path, "p", grid={"seed": [0, 1]}))
    out = io.StringIO()
    run_sweep(spec, console=Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert lines[0] == "  seed=0 warm start: loaded cache 0"
    assert re.fullmatch(r"\[1/2\] sweep p: seed=0: completed \(\d+s elapsed, ETA \d+s\)", lines[1]), lines
    assert lines[2] == "  seed=1 warm start: loaded cache 1"
    assert re.fullmatch(r"\[2/2\] sweep p: seed=1: completed \(done in \d+s\)", lines[3]), lines
    quiet = io.StringIO()
    spec = load_sweep_spec(_sweep_file(tmp_path, "q", grid={"seed": [0, 1]}))
    run_sweep(spec, console=Console(file=quiet), quiet=True)
    assert quiet.getvalue() == ""


def test_check_reports_progress_on_stderr_keeps_the_verdict_last_and_probe_detail_behind_verbose(capsys,
                                                                                                monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    small = ["--num-prompts", "3", "--max-new-tokens", "4", "--max-prompt-len", "5", "--hidden-size", "32",
             "--intermediate-size", "64", "--backend", "exact", "--wide-hidden", "0"]
    assert main(["check", *small]) == 0
    captured = capsys.readouterr()
    out = [line for line in captured.out.splitlines() if line.strip()]
    assert out[-1].startswith("PASS: rollout log-probs == training log-probs bit for bit on exact/float32")
    assert out[-2].startswith("exact backend (cpu_exact): ops by path: ") and "(per op: --verbose)" in out[-2]
    assert "path per op" not in captured.out  # the per-op table is --verbose's
    assert re.search(r"^\[12/12\] vexact check \(done in \d+s\)$", captured.err, re.M), captured.err
    assert "1 / 1" in captured.out  # generation and scoring at 1 thread by default
    assert main(["check", *small, "--quiet", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "path per op" in captured.out
    assert [line for line in captured.out.splitlines() if line.strip()][-1].startswith("PASS: ")
