"""The files a run writes and reads, below the RL loop and the real-model tools that both use them.

``atomic`` (a file published whole: temp file, fsync, rename, fsync of the directory), ``json_file`` (one reader
of a JSON file, one error for a damaged one) -> ``metrics_log`` (the one reader of metrics.jsonl, and how NaN/Inf
are spelled in it) -> ``runlog`` (a run directory: its lock, the metrics writer, checkpoints, weights-only tensor
files). Imports nothing of vexact: what a run's config asks of
these files (which live views to open) is passed in by the caller.
"""

from pathlib import Path

# The files of a run directory, named once for every module that writes or reads them (the trainer, resume, the
# sweeps, the map, the reports, the live monitor).
CONFIG_FILE = "config.yaml"  # the config the run was started with (resume compares against it)
METRICS_FILE = "metrics.jsonl"  # one JSON object per step (metrics_log reads it, runlog.MetricsWriter writes it)
SUMMARY_FILE = "summary.json"  # how the run ended: status, reason, collapse
RUN_FILES = (METRICS_FILE, SUMMARY_FILE)  # either one makes a directory a run directory
FINISHED_STATUSES = ("completed", "stopped")
"""summary.json statuses of a run that ran to an outcome (stopped: it ended itself -- NaN, exactness): resuming one
does nothing, a sweep does not run it again, and it counts in a sweep's collapse rate."""


def is_run_dir(path: str | Path) -> bool:
    """A directory holding a run's metrics.jsonl or summary.json (what ``vexact report`` reports as one run, and a
    sweep refuses as its output directory)."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)
