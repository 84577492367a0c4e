"""Experiments over many runs: ``sweep`` (a grid of RL runs, resumable, on worker processes) and ``report``
(tables, plots and summary.csv over a sweep's results). Imports ``vexact.rl`` and below."""
