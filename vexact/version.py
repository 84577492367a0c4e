"""vexact's version, the one place it is written: ``vexact.__version__`` re-exports it, pyproject.toml reads it
(``[tool.setuptools.dynamic]``), and a run's ``summary.json`` records it. A module of its own, below every layer, so
that any layer may name it."""

__version__ = "0.1.0"
