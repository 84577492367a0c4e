"""Deprecated: moved to ``vexact.sweeps.bias_meter``; this name is that module, with a DeprecationWarning
(``python -m vexact.lab.bias_meter`` runs ``python -m vexact.sweeps.bias_meter``)."""

from . import alias, run_moved

if __name__ == "__main__":
    raise SystemExit(run_moved("bias_meter"))
alias(__name__)
