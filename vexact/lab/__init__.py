"""Old import paths, kept working with a DeprecationWarning: ``vexact.lab`` held the sweeps, reports and the map
before they became ``vexact.sweeps``, ``vexact.reports`` and ``vexact.map``. Each module here names its new home
(``MOVED``); ``vexact.lab.scaling``, split by job, names the home of each of its public names."""

from __future__ import annotations

import importlib
import warnings

from ..moved import deprecated, moved

__all__ = ["MOVED", "alias", "deprecated", "run_moved"]

MOVED = {
    "sweep": "vexact.sweeps.sweep", "ray_executor": "vexact.sweeps.ray_executor",
    "sweep_data": "vexact.sweeps.sweep_data", "dose_response": "vexact.sweeps.dose_response",
    "dynamics": "vexact.sweeps.dynamics", "failure": "vexact.sweeps.failure", "bias_meter": "vexact.sweeps.bias_meter",
    "text_table": "vexact.sweeps.text_table", "markdown_table": "vexact.sweeps.markdown_table",
    "report": "vexact.reports.sweep_report", "run_report": "vexact.reports.run_report",
    "sweep_table": "vexact.reports.sweep_table", "sweep_plots": "vexact.reports.sweep_plots",
}
"""Old module of ``vexact.lab`` -> the module it now is."""


def alias(name: str) -> None:
    """Make the old module ``name`` (``vexact.lab.sweep``) the module it moved to (``vexact.moved.moved``)."""
    moved(name, MOVED[name.rsplit(".", 1)[1]])


def run_moved(name: str) -> int:
    """``python -m vexact.lab.X``: the moved module's command line, after a DeprecationWarning naming the new one."""
    new = MOVED[name]
    warnings.warn(f"python -m vexact.lab.{name} is deprecated: use python -m {new}", DeprecationWarning, stacklevel=2)
    return importlib.import_module(new)._main()
