"""Grids of runs and what their results say: ``sweep`` (a grid of RL runs, resumable, on worker processes or Ray:
``ray_executor``), ``sweep_data`` (reading a sweep's results), the analyses over them (``dose_response``,
``dynamics``, ``failure``), the gradient-bias meter (``bias_meter``: a grid of cells measured without training)
and the table formats they print (``text_table``, ``markdown_table``). Imports ``vexact.rl`` and below."""

EXECUTORS = ("local", "ray")
"""Where a sweep's points run (``vexact sweep --executor``, ``run_sweep(executor=...)``): this machine's processes,
or one Ray task per point (``ray_executor``). Here, not in ``sweep``, so that the CLI's parser reads it without
importing torch."""

MAX_JOBS = 1024
"""The most local worker processes a sweep takes (``--jobs``, ``run_sweep(jobs=...)``): more than any machine has
cores to give them, and bounded because the pool's queue and its worker slots grow with it (``--jobs 99999999999``
overflowed the pool's semaphore, after sweep.json was written). Here, for the CLI's parser too."""
