"""Deprecated: ``vexact.lab.scaling`` was split by job into ``vexact.map`` (``naming``, ``points``, ``shapes``,
``fit``, ``verdict``, ``scaling_report``, ``build``). Its public names still resolve here, each to the module that now
holds it, with a DeprecationWarning naming that module; ``python -m vexact.lab.scaling ...`` runs
``python -m vexact.map ...``."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

from . import deprecated

HOMES: dict[str, tuple[str, ...]] = {
    "vexact.map.naming": ("BYPASS", "BYPASS_PREFIX", "CONFIG_SUFFIXES", "DEFAULT_CORRECTION", "OLD_LOGPROBS",
        "OLD_LOGPROB_WORDS", "RECOMPUTE", "SOURCE_SEPARATOR", "TRL_BAND_METHOD", "TRL_DEFAULTS", "TRL_MODES",
        "TRL_PREFIX", "VERL_BLOCK_KEYS", "correction_from_config", "correction_from_file", "correction_name",
        "correction_names", "correction_words", "flat_config", "source_name"),
    "vexact.map.points": ("CORRECTION_KEYS", "HORIZON_KEY", "HORIZON_METRIC", "POLICY_LAG_KEY", "horizon_value",
        "measured_horizon", "point_policy_lag", "point_setup"),
    "vexact.map.shapes": ("GOLDEN", "SATURATING_GRID", "SHAPE_MIN_HORIZONS", "compare_shapes"),
    "vexact.map.fit": ("ALPHA_CI_METHOD", "BOOTSTRAP", "BOOTSTRAP_SEED", "REPLICATES_KEPT", "band_misses", "fit_law",
        "law_band", "leave_one_out_alphas", "scaling"),
    "vexact.map.verdict": ("ASSUMPTIONS", "BOUND_ASSUMPTION", "COLLAPSE_BOUND_ASSUMPTION", "DEFAULT_MAP",
        "DEFAULT_TAIL_MAP", "MAP_KEYS", "SAME_HORIZON", "SHIPPED_MAPS", "WIDEST_INTERVAL_DECADES", "bound_lines",
        "choose_correction", "compare_map", "curve_for", "default_source", "find_curve", "load_map", "map_curves",
        "map_lines", "map_sources", "map_vocab", "no_curve_sentence", "place_on_map", "placement",
        "resolve_correction", "saturating_at", "shipped_map_for", "vocab_lines"),
    "vexact.map.scaling_report": ("against_meter", "failure_lines", "plot_scaling", "write_scaling"),
    "vexact.map.build": ("BOOKKEEPING_KEYS", "CurveKey", "HORIZON_SETTINGS", "MERGED", "RUNS_OF", "RUN_KEYS",
        "SENSITIVITY_DROP", "SENSITIVITY_PATIENCE", "band_lines", "build_lines", "build_map", "parse_only",
        "redetect", "sensitivity", "sensitivity_lines"),
}
"""The module of ``vexact.map`` that holds each public name ``vexact.lab.scaling`` had."""
HOME = {name: module for module, names in HOMES.items() for name in names}
__all__ = sorted(HOME)


def __getattr__(name: str) -> Any:
    """An old public name: the object of its new home, with a DeprecationWarning naming that path."""
    if name not in HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"vexact.lab.scaling.{name} is deprecated: use {HOME[name]}.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(HOME[name]), name)


if __name__ == "__main__":
    warnings.warn("python -m vexact.lab.scaling is deprecated: use python -m vexact.map", DeprecationWarning,
                  stacklevel=1)
    sys.exit(importlib.import_module("vexact.map.build").main())
else:
    deprecated(__name__, "vexact.map")
