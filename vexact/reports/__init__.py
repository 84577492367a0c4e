"""``vexact report``: a sweep's report (``sweep_report``: tables, plots, summary.csv, the dose-response, dynamics,
failure and scaling files) and a run's (``run_report``), with the sweep tables and plots they draw
(``sweep_table``, ``sweep_plots``). Imports ``vexact.map`` and below."""
