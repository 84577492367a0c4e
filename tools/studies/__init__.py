"""One-off studies over runs and sweeps, each a ``python -m tools.studies.NAME`` command a results page names:
``same_runs`` (are two runs the same bits), ``surge_modes`` and ``surge_plot`` (the length surge), ``tail_compare``
(meter cells with and without a vocabulary tail). They use the sweep machinery of ``vexact.sweeps``; nothing imports
them."""
