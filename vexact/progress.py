"""Progress of long work (``vexact sweep``, ``vexact demo``, ``vexact check``): one reporter, three ways to show it.

- **On a terminal** (the console it draws on is a TTY): a rich progress bar -- done/total, elapsed time, ETA, and
  what is running now; lines printed meanwhile (a finished sweep point) appear above the bar.
- **Not a terminal** (a log file, CI, a pipe): plain lines ``[k/N] what finished (elapsed 1m05s, ETA 2m10s)``, one
  per finished item, or at most one per ``min_interval`` seconds for fine-grained work (the last one always).
- **Quiet** (``--quiet``): nothing; a line passed with ``always=True`` (a failed sweep point) still prints.

The ETA is the time per item finished in this session times the items left (items done before the session, a
resumed sweep's finished points, do not count towards the rate).
"""

from __future__ import annotations

import time
from typing import Protocol

from rich.console import Console
from rich.markup import escape


class StepReporter(Protocol):
    """What long work needs from a progress reporter (``Progress`` below; tests pass their own)."""

    def running(self, text: str) -> None:
        """``text`` names the work in progress now."""

    def advance(self, said: str | None = None, always: bool = False) -> None:
        """One item finished; ``said``: a line about it (printed in every mode but quiet, or always)."""


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m: what a person reads at a glance."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Progress of ``total`` items (``done`` of them finished before): a context manager, used as a ``StepReporter``.

    ``console``: where it draws (its ``is_terminal`` picks the rich bar or plain lines); ``quiet``: nothing extra;
    ``min_interval``: seconds between plain lines of items that say nothing (``advance()`` without ``said``)."""

    def __init__(self, console: Console, description: str, total: int, done: int = 0, quiet: bool = False,
                 min_interval: float = 0.0):
        self.console, self.description, self.total, self.done = console, description, total, done
        self.quiet, self.min_interval = quiet, min_interval
        self.mode = "quiet" if quiet else ("rich" if console.is_terminal else "plain")
        self._first_done, self._current = done, ""
        self._started = self._last_line = time.monotonic()
        self._bar = None

    def __enter__(self) -> Progress:
        self._started = self._last_line = time.monotonic()
        if self.mode == "rich":
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                     TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[current]}"),
                                     console=self.console)
            self._bar.__enter__()
            # the columns are markup: the description and what runs are plain text (a sweep's or point's name)
            self._task = self._bar.add_task(escape(self.description), total=self.total, completed=self.done,
                                            current="")
        return self

    def __exit__(self, *exc: object) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
        return False

    def running(self, text: str) -> None:
        self._current = text
        if self._bar is not None:
            self._bar.update(self._task, current=escape(text))

    def advance(self, said: str | None = None, always: bool = False) -> None:
        self.done += 1
        if self.mode == "rich":
            if said is not None:
                self.console.print(said, soft_wrap=True)
            self._bar.update(self._task, completed=self.done)
        elif self.mode == "plain":
            now = time.monotonic()
            if said is None and self.done < self.total and now - self._last_line < self.min_interval:
                return
            self._last_line = now
            what = said if said is not None else escape(self._current if self.done < self.total else "")
            self.console.print(f"[{self.done}/{self.total}] {escape(self.description)}"
                               + (f": {what}" if what else "") + f" ({self.timing()})", soft_wrap=True)
        elif always and said is not None:
            self.console.print(said, soft_wrap=True)

    def timing(self) -> str:
        """'1m05s elapsed, ETA 2m10s' (or 'done in ...' once every item is finished)."""
        elapsed = time.monotonic() - self._started
        if self.done >= self.total:
            return f"done in {format_duration(elapsed)}"
        finished_here = self.done - self._first_done
        eta = format_duration(elapsed / finished_here * (self.total - self.done)) if finished_here > 0 else "?"
        return f"{format_duration(elapsed)} elapsed, ETA {eta}"
