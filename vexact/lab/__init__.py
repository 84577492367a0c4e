"""Experiments over many runs: ``sweep`` (a grid of RL runs, resumable, on worker processes) and ``report``
(tables, plots and summary.csv over a sweep's results); one-off studies over runs in ``studies``. Imports
``vexact.rl`` and below."""
