"""The map and its verdicts: read a map, take the curve of the user's correction and source, and place a user's k3
at their horizon on it. ``compare --map`` and ``vexact.live`` read the map through this module.

**Placing a user.** ``place_on_map(map_data, k3, horizon, correction)`` takes that correction's curve (None:
``bypass``, and the verdict says it was assumed; a correction the map has no curve for gets one sentence saying so,
never another curve): the law at the user's T (its interval from the replicates), the ratio k3 / threshold, a
verdict in words and how far T lies outside the measured horizons. Beyond them the verdict weighs the range the
law's interval and the saturating shape allow there (``range_low`` .. ``range_high``): "near" wherever that range
spans the k3. A bound (no collapse up to X, or every run collapsed from X) speaks within 1.5x of its own horizon
only (the threshold is not monotone in T), and not where a horizon with a fitted threshold lies as near the user's T
or nearer. On a curve of bounds only, "no collapse measured up to k3 X at T Y". Every verdict ends by naming the
curve as the user runs it (``correction_words``: ``token_tis`` is recompute + token-level TIS, ``bypass_token_tis``
the same on the rollout's log-probs). ``load_map(None)`` is the map shipped with vexact (``default_map.json``, made
by ``python -m vexact.map build-map``; a single-curve file from before corrections were recorded loads as a
``bypass`` curve).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..metric_keys import K3_KL
from ..records.json_file import read_json
from ..rl.vocab_tail import tokenizer_for
from .fit import earlier_method_horizons, law_band
from .naming import (
    BYPASS,
    CONFIG_SUFFIXES,
    DEFAULT_CORRECTION,
    RECOMPUTE,
    TRL_MODES,
    correction_from_config,
    correction_from_file,
    correction_names,
    correction_words,
    source_name,
)
from .points import HORIZON_KEY, finite, interval_text, positive

DEFAULT_MAP = Path(__file__).with_name("default_map.json")
DEFAULT_TAIL_MAP = Path(__file__).with_name("default_tail_map.json")
SHIPPED_MAPS = {DEFAULT_MAP: "the map shipped with vexact (vexact/map/default_map.json)",
                DEFAULT_TAIL_MAP: "the tail map shipped with vexact (vexact/map/default_tail_map.json)"}
"""The maps vexact ships, one per testbed vocabulary (``map_vocab``): the main map, on the task's characters, and the
tail map, the same testbed with a tail of distractor tokens. ``shipped_map_for(vocab)`` picks one for a user."""
MAP_KEYS = ("horizon", "k3", "threshold_50", "ci_low", "ci_high", "ratio", "verdict", "extrapolation_factor",
            "correction", "source", "vocab", "range_low", "range_high", "policy_lag")
"""``range_low`` / ``range_high``: beyond a fitted curve's measured horizons, the range the power law's interval and
the saturating shape allow there (None inside them, or without a law)."""
ASSUMPTIONS = (
    "beyond the measured horizons the threshold lies where the fitted power law threshold ∝ T^(−alpha) (within its "
    "interval) or the saturating shape F + B/T puts it: the data do not tell the two apart",
    "the map's testbed (a 0.5M-parameter decoder on CPU, on-policy GRPO, the curve's correction and run length) "
    "stands for your stack; model size, mini-batches and run length are not on the map, and the vocabulary only as "
    "the testbed's (vocab: 22 characters, or 1,024 with the tail map)",
    "k3 is the token mean of exp(r) − r − 1 over your dump (rollout_corr/k3_kl); the map's doses are run means of "
    "the same metric before collapse",
    "your horizon is your dump's mean response length (tokens per sequence)",
)
BOUND_ASSUMPTION = ("a no-collapse bound measured at a horizon holds within 1.5x of it, and is carried no further: "
                    "the threshold does not fall monotonically with T (on the map's bypass curve it rises from one "
                    "horizon to the next twice)")
COLLAPSE_BOUND_ASSUMPTION = ("a collapse measured at a horizon also happens within 1.5x of it, and is carried no "
                             "further: the threshold does not fall monotonically with T (on the map's bypass curve "
                             "it rises from one horizon to the next twice)")
SAME_HORIZON = 1.5  # a horizon's threshold or bound answers within this factor of it, and nowhere else
WIDEST_INTERVAL_DECADES = 3.0  # a law whose interval at the user's T spans more decades than this pins nothing there


def resolve_correction(spec: Any, map_data: dict[str, Any] | None = None) -> str | None:
    """The user's correction as a curve name: None stays None (the caller assumes ``bypass`` and says so); a name
    (one of ``correction_names()``, a curve of ``map_data``, or TRL's mode name); a config file (.yaml, .yml,
    .json) or a config mapping (``correction_from_config``); or a config object with ``to_dict`` (TRL's
    GRPOConfig). An unknown name is one ValueError listing the known ones."""
    if spec is None:
        return None
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.lower().endswith(CONFIG_SUFFIXES)):
        return correction_from_file(spec)
    if isinstance(spec, Mapping):
        return correction_from_config(spec, "the correction config")
    if isinstance(spec, str):
        name = TRL_MODES.get(spec, spec)
        mapped = [c["correction"] for c in map_curves(map_data)] if map_data is not None else []
        if name not in correction_names() and name not in mapped:
            raise ValueError(f"unknown correction {spec!r}: expected one of {', '.join(correction_names())} (TRL's "
                             f"{', '.join(TRL_MODES)} name {', '.join(dict.fromkeys(TRL_MODES.values()))}), or a "
                             f"verl / TRL / vexact config file ({', '.join(CONFIG_SUFFIXES)})")
        return name
    to_dict = getattr(spec, "to_dict", None)
    if callable(to_dict) and isinstance(to_dict(), Mapping):
        return correction_from_config(to_dict(), type(spec).__name__)
    raise ValueError(f"correction must be a name, a config file or a config mapping, got {type(spec).__name__}")


def load_map(path: str | Path | None = None, vocab: int | None = None) -> dict[str, Any]:
    """A map (a ``scaling.json``, or one made by ``build-map``); None = the map shipped with vexact for ``vocab``
    (``shipped_map_for``: the main map without one; a named file is read whatever ``vocab`` says). Its ``curves``
    come back each with its ``correction`` (``map_curves``). One clear error on a bad file."""
    path = Path(path) if path is not None else shipped_map_for(vocab)
    if path.is_dir():
        raise ValueError(f"'{path}' is a directory: give a map file (a sweep's report/scaling.json, or build-map's)")
    if not path.is_file():
        raise ValueError(f"map file not found: '{path}'")
    data = read_json(path, f"map file '{path}'")
    if not isinstance(data, dict) or "status" not in data or "horizon_range" not in data:
        raise ValueError(f"map file '{path}' is not a scaling.json (no 'status' / 'horizon_range'); make one with "
                         "vexact report on a sweep over task.max_len")
    data["curves"] = map_curves(data, f"map file '{path}'")
    data["origin"] = SHIPPED_MAPS.get(path, str(path))
    return data


def map_vocab(map_data: dict[str, Any]) -> int | None:
    """The vocabulary size of a map's testbed: the task's characters plus its ``task.distractors`` (the vocabulary
    tail, ``vexact.rl.vocab_tail``); None for a map without a testbed."""
    testbed = map_data.get("testbed")
    if not isinstance(testbed, dict):
        return None
    return tokenizer_for(int(testbed.get("task.distractors") or 0)).vocab_size


def shipped_map_for(vocab: int | None, maps: Mapping[Path, str] | None = None) -> Path:
    """The shipped map (``SHIPPED_MAPS``, or ``maps``) whose testbed vocabulary is nearest ``vocab`` on a log scale;
    None: the main map. The main map's 22 characters and the tail map's 1,024 tokens meet at ~150, so every real
    LLM vocabulary (32k to 256k) gets the tail map: k3 over a vocabulary with a tail is not k3 over 22 tokens (the
    same flattening gives ~4x the k3 with the tail)."""
    candidates = [Path(p) for p in (maps or SHIPPED_MAPS)]
    if vocab is None:
        return candidates[0]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise ValueError(f"a vocabulary size must be an integer >= 2, got {vocab!r}")
    sizes = {path: map_vocab(load_map(path)) for path in candidates if path.is_file()}
    sizes = {path: size for path, size in sizes.items() if size}
    if not sizes:
        return candidates[0]
    return min(sizes, key=lambda path: (abs(math.log(sizes[path] / vocab)), candidates.index(path)))


def map_curves(map_data: dict[str, Any] | None, where: str = "the map") -> list[dict[str, Any]]:
    """The map's curves, each with its ``correction`` and ``source`` (the injected mismatch its runs had:
    ``source_name``; a curve saved without one takes it from its testbed, else None). A file from before corrections
    were recorded is one curve, its top level: ``bypass`` (``recompute`` when its label says
    ``algorithm.old_logprobs=recompute``). Two curves for one (correction, source) are an error: a map answers with
    one curve per correction and source."""
    if not map_data:
        return []
    curves = map_data.get("curves")
    if isinstance(curves, list) and curves and all(isinstance(c, dict) and "correction" in c for c in curves):
        seen: dict[tuple[str, Any, Any], str] = {}
        out = []
        for c in curves:
            c = c if "source" in c else {**c, "source": _curve_source(c)}
            c = c if "policy_lag" in c else {**c, "policy_lag": 0}  # a curve from before the lag axis: on-policy
            key = (c["correction"], c["source"], c["policy_lag"])
            if key in seen:
                raise ValueError(f"{where} has two curves for correction {key[0]!r} and source {key[1]!r} at policy "
                                 f"lag {key[2]} ({seen[key]!r} and {c.get('curve')!r}): a map holds one curve per "
                                 "correction, source and policy lag")
            seen[key] = str(c.get("curve"))
            out.append(c)
        return out
    label = str(map_data.get("curve", ""))
    legacy = RECOMPUTE if "algorithm.old_logprobs=recompute" in label else BYPASS
    legacy_curve = {k: v for k, v in map_data.items() if k not in ("curves", "origin")}
    return [{**legacy_curve, "correction": legacy, "source": _curve_source(legacy_curve),
             "policy_lag": legacy_curve.get("policy_lag", 0)}]


def _curve_source(curve: dict[str, Any]) -> str | None:
    """A curve's source: its own ``source``, else the one its ``testbed`` (flat config) injected, else None."""
    if curve.get("source") is not None:
        return str(curve["source"])
    testbed = curve.get("testbed")
    return source_name(testbed) if isinstance(testbed, dict) and "inject.mode" in testbed else None


def default_source(map_data: dict[str, Any]) -> str | None:
    """The source a placement uses when the user names none: the map's primary curve's (its top level: the
    ``bypass`` curve of the map's main source)."""
    curves = map_curves(map_data)
    top = _curve_source(map_data) if "testbed" in map_data or "source" in map_data else None
    return top if top is not None or not curves else curves[0]["source"]


def map_sources(map_data: dict[str, Any]) -> list[str]:
    """The sources the map has curves for, the default first."""
    first = default_source(map_data)
    rest = [c["source"] for c in map_curves(map_data) if c["source"] is not None and c["source"] != first]
    return [s for s in dict.fromkeys([first, *rest]) if s is not None]


def curve_for(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
              ) -> dict[str, Any]:
    """The map's curve for ``correction`` and ``source`` (None: ``default_source``) at ``policy_lag`` (the user's
    ``rollout.policy_lag``: 0 on-policy); a correction, source or lag it has no curve for is one ValueError naming it
    and the curves there are (never another correction's, source's or lag's curve in its place)."""
    curve = find_curve(map_data, correction, source, policy_lag)  # a lag or source it has none at: its error
    if curve is not None:
        return curve
    curves = _curves_at_lag(map_data, policy_lag)
    where = _map_where(map_data)
    wanted = default_source(map_data) if source is None else source
    names = ", ".join(c["correction"] for c in curves if c["source"] == wanted) or "none"
    elsewhere = [c["source"] for c in curves if c["correction"] == correction and c["source"] != wanted]
    hint = (f" (source {wanted!r}; the map has {correction} for source(s) {', '.join(map(repr, elsewhere))}: name "
            "one with --source / source=)") if elsewhere else ""
    raise ValueError(f"{where} has no curve for correction {correction!r}: it has {names}{hint}; another correction's "
                     "threshold would not answer for yours")


def find_curve(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
               ) -> dict[str, Any] | None:
    """The map's curve for ``correction`` and ``source`` (None: ``default_source``) at ``policy_lag``, or None when
    it has none for that correction; a source or a lag the map has no curves for at all is one ValueError naming what
    it has (a bad input, not a gap)."""
    curves = _curves_at_lag(map_data, policy_lag)
    wanted = default_source(map_data) if source is None else source
    if source is not None and not any(c["source"] == wanted for c in curves):
        raise ValueError(f"{_map_where(map_data)} has no curves for source {source!r}: its sources are "
                         f"{', '.join(map(repr, map_sources(map_data))) or 'none'}")
    return next((c for c in curves if c["correction"] == correction and c["source"] == wanted), None)


def _curves_at_lag(map_data: dict[str, Any], policy_lag: int) -> list[dict[str, Any]]:
    """The map's curves measured at ``policy_lag``; a lag it has no curve at is one ValueError naming its lags."""
    if isinstance(policy_lag, bool) or not isinstance(policy_lag, int) or policy_lag < 0:
        raise ValueError(f"a policy lag is a number of optimizer steps, an integer >= 0, got {policy_lag!r}")
    curves = map_curves(map_data)
    lags = sorted({c["policy_lag"] for c in curves})
    if policy_lag not in lags:
        raise ValueError(f"{_map_where(map_data)} has no curve at policy lag {policy_lag} (its curves are at lag "
                         f"{', '.join(map(str, lags)) or 'none'}): another lag's threshold would not answer for "
                         f"rollouts {policy_lag} optimizer step(s) behind the trained policy")
    return [c for c in curves if c["policy_lag"] == policy_lag]


def _map_where(map_data: dict[str, Any]) -> str:
    origin = str(map_data.get("origin", "the map"))
    return origin if origin in (*SHIPPED_MAPS.values(), "the map") else f"the map '{origin}'"


def no_curve_sentence(map_data: dict[str, Any], correction: str, source: str | None = None, policy_lag: int = 0
                      ) -> str:
    """One sentence: the map has no curve for this correction (and source, at this lag), so no verdict; never
    another correction's or another source's curve in its place."""
    wanted = default_source(map_data) if source is None else source
    there = [c["correction"] for c in _curves_at_lag(map_data, policy_lag) if c["source"] == wanted]
    lag = f" at policy lag {policy_lag}" if policy_lag else ""
    return (f"no verdict: {_map_where(map_data)} has no curve for your correction ({correction_words(correction)}) "
            f"on source {wanted}{lag} (its curves there: {', '.join(there) or 'none'}), "
            "and another correction's threshold would not answer for yours")


def _no_curve_placement(map_data: dict[str, Any], k3: float, horizon: float, name: str, source: str | None,
                        assumed: bool, policy_lag: int) -> dict[str, Any]:
    return {"horizon": float(horizon), "k3": float(k3), "threshold_50": None, "ci_low": None, "ci_high": None,
            "ratio": None, "verdict": no_curve_sentence(map_data, name, source, policy_lag),
            "extrapolation_factor": 1.0, "correction": name,
            "source": default_source(map_data) if source is None else source, "vocab": map_vocab(map_data),
            "range_low": None, "range_high": None, "policy_lag": policy_lag, "correction_assumed": assumed,
            "bound_assumption": None, "no_curve": True}


def saturating_at(shape: dict[str, Any], horizon: float) -> float | None:
    """The saturating shape's threshold F + B/T at ``horizon`` (None: the curve's shapes were not compared)."""
    fit = shape.get("saturating") if shape.get("status") == "compared" else None
    if not isinstance(fit, dict) or not finite(fit.get("floor")) or not finite(fit.get("scale")):
        return None
    value = fit["floor"] + fit["scale"] / horizon
    return value if value > 0 else None


def choose_correction(map_data: dict[str, Any], spec: Any, source: str | None = None, policy_lag: int = 0
                      ) -> str | None:
    """``resolve_correction(spec)`` checked against the map: a known name (or config), a source the map has (None:
    the map's default) and a policy lag it has curves at, for callers that check once before placing many points. A
    correction the map has no curve for is no error: its verdict is one sentence saying so (``no_curve_sentence``)."""
    name = resolve_correction(spec, map_data)
    find_curve(map_data, DEFAULT_CORRECTION if name is None else name, source, policy_lag)
    return name


def place_on_map(map_data: dict[str, Any], k3: float, horizon: float, correction: str | None = None,
                 source: str | None = None, policy_lag: int = 0) -> dict[str, Any]:
    """The curve of ``correction`` (None: ``bypass``, assumed and said so in the verdict) and ``source`` (None: the
    map's default source, ``default_source``) at ``horizon``, as the ``MAP_KEYS``: the law's threshold (with its
    interval), ``ratio`` = k3 / threshold, a ``verdict`` in words, ``extrapolation_factor`` (how many times outside
    the curve's measured horizons T lies; 1.0 inside them), ``correction`` and ``source``; on a curve without a law,
    the verdict says what its threshold at its one horizon or its bounds say. ``policy_lag``: the user's lag; the
    curve measured at it, or one ValueError saying the map has none (``curve_for``)."""
    placed = placement(map_data, k3, horizon, correction, source, policy_lag)
    return {k: placed[k] for k in MAP_KEYS}


def placement(map_data: dict[str, Any], k3: float, horizon: float, correction: str | None,
              source: str | None = None, policy_lag: int = 0) -> dict[str, Any]:
    """``place_on_map``'s keys and what the printed lines add: ``correction_assumed``, ``bound_assumption`` (the
    assumption a verdict from a measured bound rests on, or None) and ``outside_every_curve`` (the sentence when T is
    outside every curve's measured horizons)."""
    k3, horizon = _real(k3), _real(horizon)  # numpy's scalars (a float32 k3 of the user's own) are numbers too
    if not finite(k3) or k3 < 0:
        raise ValueError(f"k3 must be a finite number >= 0, got {k3!r}")
    if not positive(horizon):
        raise ValueError(f"the horizon (mean response length) must be a positive number, got {horizon!r}: the dump "
                         "has no response lengths to place on the map")
    name = resolve_correction(correction, map_data)
    assumed = name is None
    name = DEFAULT_CORRECTION if assumed else name
    curve = find_curve(map_data, name, source, policy_lag)
    if curve is None:
        return _no_curve_placement(map_data, k3, horizon, name, source, assumed, policy_lag)
    t_range = curve.get("horizon_range")
    if not (isinstance(t_range, list) and len(t_range) == 2 and all(positive(t) for t in t_range)):
        raise ValueError(f"the map's {name} curve has no measured horizons (horizon_range): it cannot place a horizon")
    t0, t1 = t_range
    factor = horizon / t1 if horizon > t1 else t0 / horizon if horizon < t0 else 1.0
    out: dict[str, Any] = {"horizon": float(horizon), "k3": float(k3), "threshold_50": None, "ci_low": None,
                           "ci_high": None, "ratio": None, "verdict": None, "extrapolation_factor": factor,
                           "correction": name, "source": curve["source"], "vocab": map_vocab(map_data),
                           "range_low": None, "range_high": None, "policy_lag": curve["policy_lag"],
                           "correction_assumed": assumed,
                           "bound_assumption": None}
    if curve.get("status") == "fitted":
        thr = 10 ** (curve["log10_prefactor"] - curve["alpha"] * math.log10(horizon))
        band = law_band(curve.get("replicates") or [], horizon)
        lo, hi = band if band is not None else (None, None)
        out.update(threshold_50=thr, ci_low=lo, ci_high=hi, ratio=k3 / thr)
        low, high = lo or thr, hi or thr
        shape = None
        if factor > 1 and band is not None:  # beyond the measured horizons: what the law's interval and shapes allow
            shape = saturating_at(curve.get("shape") or {}, horizon)
            if shape is not None:
                low, high = min(low, shape), max(high, shape)
            out.update(range_low=low, range_high=high)
        if band is None:  # (open threshold intervals, or two horizons: the law's spread is unknown)
            why = ("it was fitted to two horizons, and a line through two points leaves no scatter to measure"
                   if len(_fitted_horizons(curve)) == 2 else "the thresholds it was fitted to have open intervals")
            verdict = (f"no verdict: the {name} curve's power law has no 95% interval ({why}), so nothing bounds how "
                       f"far the threshold at this T lies from {thr:.2g}")
        elif math.log10(high / low) > WIDEST_INTERVAL_DECADES:
            what = ("the law's 95% interval" if shape is None else
                    "the range the law's interval and the saturating shape allow")
            verdict = (f"no verdict: {what} at this T spans k3 {low:.2g} .. {high:.2g} "
                       f"({math.log10(high / low):.0f} decades), so the {name} curve's horizons do not pin the "
                       "threshold here")
        elif k3 < low / 10:
            verdict = "far below the measured collapse range"
        elif k3 < high:
            verdict = "near the measured collapse range"
        else:
            verdict = "above the measured collapse range"
        measured = _measured_over_law(curve, name, k3, horizon, thr, verdict)
        if measured is not None:
            verdict, out["bound_assumption"] = measured
        if factor > 1:
            verdict += (f"; extrapolated: T = {fmt_t(horizon)} lies {factor:.3g}x outside the {name} curve's measured "
                        f"horizons (T = {fmt_t(t0)} .. {fmt_t(t1)})")
            if band is not None:
                verdict += (f", where the threshold may lie anywhere in k3 {low:.2g} .. {high:.2g} (the power law's "
                            f"95% interval [{lo:.2g}, {hi:.2g}]"
                            + (f" and the saturating shape's {shape:.2g}" if shape is not None else "") + ")")
        single = curve.get("single_run_horizons") or []
        if single:
            verdict += (f"; the law rests on horizon(s) fitted from one run per dose ({HORIZON_KEY} = "
                        f"{', '.join(map(str, single))})")
        earlier = earlier_method_horizons(curve.get("horizons") or [])
        if earlier:
            verdict += (f"; its interval rests on threshold intervals made by an earlier method that can be narrower "
                        f"({HORIZON_KEY} = {', '.join(map(str, earlier))})")
    else:
        verdict = _bound_verdict(curve, name, k3, horizon, (t0, t1))
        if verdict.startswith("below every level tested"):
            out["bound_assumption"] = BOUND_ASSUMPTION
    verdict += _too_few_near(curve, name, horizon)
    if assumed:
        verdict += f"; correction assumed: {name} (none given: name the one you run)"
    out["verdict"] = verdict + f"; curve: {correction_words(name)}"
    ranges = [(c["correction"], c.get("horizon_range")) for c in map_curves(map_data)  # the curves that answer at
              if c["source"] == curve["source"] and c["policy_lag"] == curve["policy_lag"]]  # this source and lag
    ranges = [(c, r) for c, r in ranges if isinstance(r, list) and len(r) == 2 and all(positive(t) for t in r)]
    if ranges and all(not r[0] <= horizon <= r[1] for _, r in ranges):
        out["outside_every_curve"] = (
            f"T = {fmt_t(horizon)} lies outside every curve's measured horizons ("
            + "; ".join(f"{c}: T = {fmt_t(r[0])} .. {fmt_t(r[1])}" for c, r in ranges)
            + "): every threshold the map gives at this T is an extrapolation")
    return out


def _real(value: Any) -> Any:
    """A real number of any type (numpy's float32, int64, ...) as a Python float; anything else as it is."""
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)) else value


def fmt_t(horizon: float) -> str:
    """A horizon in words: whole tokens from 20 on, one decimal below, two significant digits below 0.1 (a mostly
    masked batch: 0.01 is not "0.0")."""
    return f"{horizon:.0f}" if horizon >= 20 else f"{horizon:.1f}" if horizon >= 0.1 else f"{horizon:.2g}"


def _measured_over_law(curve: dict[str, Any], name: str, k3: float, horizon: float, thr: float, verdict: str
                       ) -> tuple[str, str] | None:
    """Where a horizon with only a bound speaks for the user's T, the measurement wins over the law (which was not
    fitted to it, and may cross it): (the verdict, the assumption it rests on), or None to keep the law's verdict.

    Only a horizon within 1.5x of the user's T speaks (``SAME_HORIZON``): the threshold is not monotone in T. And
    only where no horizon with a fitted threshold lies as near the user's T or nearer (``_outranked``): the law was
    fitted to that one, a measurement at the user's own T, which a neighbour's bound does not override.

    - Every run collapsed, from k3 D, at T_b: k3 >= D is above a measured collapse; k3 < D where the law's threshold
      lies above D: the law is wrong there, and the map can only say "below D, where runs collapsed". Where the
      logistic fit put the 50% point below D though some run held (``some_held``), k3 >= D is above that 50% point,
      and the verdict says not every run collapsed (never "above the measured collapse range").
    - Nothing collapsed up to k3 D at T_b: k3 <= D where the law says near or above is below every level tested
      there; k3 > D where the law's threshold lies below D is not placed (the law is wrong there, and
      nothing was measured above D)."""
    fitted = _fitted_horizons(curve)
    for h in curve.get("horizons") or []:
        t_b = h.get("horizon")
        if not positive(t_b):
            continue
        at = f"T {fmt_t(t_b)} ({name})"
        if not horizon / SAME_HORIZON <= t_b <= horizon * SAME_HORIZON:
            continue  # a bound speaks for its own horizon only: the threshold is not monotone in T
        if _outranked(t_b, horizon, fitted):
            continue
        if h.get("status") == "below_range" and positive(h.get("upper_bound")):
            dose = h["upper_bound"]
            fact = f"{collapsed_from(h)} from k3 {dose:.2g} at {at}" + one_run(h)
            if k3 >= dose and some_held(h):
                return (f"above the 50% collapse point, which the fit puts below k3 {dose:.2g} though not every run "
                        f"collapsed: {fact}", COLLAPSE_BOUND_ASSUMPTION)
            if k3 >= dose:
                return f"above the measured collapse range: {fact}", COLLAPSE_BOUND_ASSUMPTION
            if thr > dose:
                times = f" ({dose / k3:.3g}x)" if k3 > 0 else ""
                return (f"below k3 {dose:.2g}{times}, where runs collapsed: {fact}; the law's threshold at this T "
                        f"(k3 {thr:.2g}) lies above that measured collapse, so the map cannot say how far below the "
                        "threshold you are", COLLAPSE_BOUND_ASSUMPTION)
        if h.get("status") == "above_range" and not h.get("collapsed") and positive(h.get("lower_bound")):
            dose = h["lower_bound"]
            fact = _no_collapse_fact(h, at)
            if k3 <= dose and not verdict.startswith("far below"):
                return (f"below every level tested: {fact}; the law's threshold at this T (k3 {thr:.2g}) lies below "
                        "that measured survival", BOUND_ASSUMPTION)
            if k3 > dose and thr < dose:
                return (f"not placed: your k3 is above the largest level tested without collapse ({fact}), and the "
                        f"law's threshold at this T (k3 {thr:.2g}) lies below that measured survival: the map does "
                        "not know where this collapses", BOUND_ASSUMPTION)
    return None


def _fitted_horizons(curve: dict[str, Any]) -> list[dict[str, Any]]:
    """The curve's horizons with a fitted 50% threshold (a measurement at that T, not a bound)."""
    return [h for h in curve.get("horizons") or [] if h.get("status") == "fitted" and positive(h.get("horizon"))
            and positive(h.get("threshold_50"))]


def _outranked(t_b: float, horizon: float, fitted: list[dict[str, Any]]) -> bool:
    """Whether a horizon of ``fitted`` lies as near ``horizon`` as the bound's ``t_b`` or nearer (on a log scale):
    then the threshold measured there answers for the user's T, not the neighbour's bound."""
    return any(abs(math.log(f["horizon"] / horizon)) <= abs(math.log(t_b / horizon)) for f in fitted)


def _too_few_near(curve: dict[str, Any], name: str, horizon: float) -> str:
    """What the curve measured within ``SAME_HORIZON`` of the user's T with too few runs for a threshold or a bound
    (``insufficient``: one dose level), as clauses to append to a verdict: said, never used to place the k3."""
    said = ""
    for h in curve.get("horizons") or []:
        if (h.get("status") != "insufficient" or not h.get("runs") or not positive(h.get("horizon"))
                or not horizon / SAME_HORIZON <= h["horizon"] <= horizon * SAME_HORIZON):
            continue
        dose = f" at realised k3 {h['dose_min']:.2g}" if positive(h.get("dose_min")) else ""
        said += (f"; measured but not placed: {h.get('collapsed', 0)} of {h['runs']} run(s) collapsed{dose} at "
                 f"T {fmt_t(h['horizon'])} ({name}), one dose level: too few for a threshold or a bound")
    return said


def _bound_verdict(curve: dict[str, Any], name: str, k3: float, horizon: float, t_range: tuple[float, float]
                   ) -> str:
    """A curve without a law: what its no-collapse bounds say. A bound measured within 1.5x of the user's T speaks
    for it (``BOUND_ASSUMPTION``); none is carried further, up or down (the threshold is not monotone in T)."""
    safe = [h for h in curve.get("horizons", []) if h.get("status") == "above_range" and not h.get("collapsed")
            and positive(h.get("lower_bound")) and positive(h.get("horizon"))]  # nothing collapsed up to the bound
    measured = _fitted_horizons(curve)
    one = measured if len(measured) == 1 else []  # (only a single threshold answers without a law: below)
    carried = [h for h in safe if horizon / SAME_HORIZON <= h["horizon"] <= horizon * SAME_HORIZON
               and not _outranked(h["horizon"], horizon, one)]
    if carried:
        best = max(carried, key=lambda h: h["lower_bound"])
        fact = _no_collapse_fact(best, f"T {fmt_t(best['horizon'])} ({name})")
        if k3 <= best["lower_bound"]:  # (the level D itself ran without collapse: k3 <= D, as the law's case)
            return f"below every level tested: {fact}; the curve has no threshold to compare with"
        return (f"not placed: your k3 is above the largest level tested without collapse ({fact}); the {name} "
                "curve does not say where this correction collapses")
    if len(measured) == 1:  # one horizon with a threshold: an answer at that T only, no law to carry it
        h = measured[0]
        lo, hi = h.get("ci_low"), h.get("ci_high")
        fact = (f"50% collapse threshold k3 {h['threshold_50']:.2g}{interval_text(lo, hi)} measured at T "
                f"{fmt_t(h['horizon'])} only ({name}){one_run(h)}")
        if not h["horizon"] / SAME_HORIZON <= horizon <= h["horizon"] * SAME_HORIZON:
            if not safe:
                return (f"no verdict at this horizon: the {name} curve has one horizon ({fact}) and no law to carry "
                        f"it to T = {fmt_t(horizon)}")
        else:
            # an interval open on one side (the runs do not bound it there: dose_response.CI_METHOD) bounds nothing
            # there: no "far below" under an open lower end, no "above" over an open upper end; open on both sides,
            # the point value alone places nothing: only "near"
            low, high = (lo if positive(lo) else None), (hi if positive(hi) else None)
            where = ("far below" if low is not None and k3 < low / 10 else
                     "above" if high is not None and k3 >= high else "near")
            return f"{where} the measured collapse range: {fact}"
    if safe:
        nearest = min(safe, key=lambda h: abs(math.log(h["horizon"] / horizon)))
        at = f"T {fmt_t(nearest['horizon'])} ({name})"
        where = (f"lies {'beyond' if horizon > t_range[1] else 'below'} the {name} curve's measured horizons "
                 f"(T = {fmt_t(t_range[0])} .. {fmt_t(t_range[1])})" if not t_range[0] <= horizon <= t_range[1] else
                 f"is more than {SAME_HORIZON}x from every horizon of the {name} curve")
        return (f"no verdict at this horizon: T = {fmt_t(horizon)} {where}: the nearest bound, "
                f"{_no_collapse_fact(nearest, at)}, is not carried to another T (the threshold is not monotone in T) "
                "and the curve has no law")
    return f"unknown: the {name} curve has no fitted law ({curve.get('status')}): {curve.get('note')}"


def map_lines(placed: dict[str, Any], map_data: dict[str, Any]) -> list[str]:
    """The placement as printed lines, assumptions included."""
    p = placed
    given = " (assumed: none given)" if p.get("correction_assumed") else ""
    lines = [f"map ({map_data.get('origin', 'map')}), correction {p['correction']}{given}: k3 = {p['k3']:.3g} at "
             f"T = {p['horizon']:.1f} tokens", f"  your correction: {correction_words(p['correction'])}"]
    if p.get("no_curve"):
        return [*lines, f"  verdict: {p['verdict']}"]
    curve = curve_for(map_data, p["correction"], p.get("source"), p.get("policy_lag", 0))
    if p["threshold_50"] is not None:
        ci = (f" [{p['ci_low']:.2g}, {p['ci_high']:.2g}]" if p["ci_low"] is not None else " [no interval]")
        alpha_ci = (f" [{curve['alpha_ci_low']:.2f}, {curve['alpha_ci_high']:.2f}]"
                    if finite(curve.get("alpha_ci_low")) and finite(curve.get("alpha_ci_high")) else "")
        lines.append(f"  the law's 50% collapse threshold at this T: k3 = {p['threshold_50']:.2g}{ci} "
                     f"(α = {curve['alpha']:.2f}{alpha_ci}); ratio k3 / threshold = {p['ratio']:.2g}")
        if p.get("range_low") is not None:
            lines.append(f"  beyond the measured horizons: the threshold may lie anywhere in k3 "
                         f"{p['range_low']:.2g} .. {p['range_high']:.2g} (the power law's interval and the "
                         "saturating shape)")
    lines.append(f"  verdict: {p['verdict']}")
    t0, t1 = curve["horizon_range"]
    lines.append(f"  extrapolation: T is {p['extrapolation_factor']:.3g}x outside the {p['correction']} curve's "
                 f"measured horizons (T = {t0:.0f} .. {t1:.0f})" if p["extrapolation_factor"] > 1 else
                 f"  T lies within the {p['correction']} curve's measured horizons (T = {t0:.0f} .. {t1:.0f})")
    if p.get("outside_every_curve"):
        lines.append(f"  outside the map: {p['outside_every_curve']}")
    bounds = bound_lines(curve)
    if bounds:
        lines.append(f"  the {p['correction']} curve's bounds (measured, not in its fit): " + "; ".join(bounds))
    assumptions = ASSUMPTIONS + ((p["bound_assumption"],) if p.get("bound_assumption") else ())
    lines.append("  assumptions: " + "; ".join(assumptions))
    what = (curve.get("provenance") or map_data.get("provenance") or {}).get("what")
    if what:
        lines.append(f"  the curve: {what}")
    others = [s for s in map_sources(map_data) if s != p.get("source")]
    if others:
        lines.append(f"  source: {p.get('source')} (the mismatch the curve's runs injected); the map's other sources "
                     f"(--source): {', '.join(others)}")
    return lines


def compare_map(summary: dict[str, Any], map_path: str | Path | dict[str, Any] | None, correction: Any = None,
                source: str | None = None, vocab: int | None = None, policy_lag: int = 0
                ) -> tuple[dict[str, Any], list[str]]:
    """``vexact compare --map [--correction] [--source] [--vocab]``: place a compare summary (its k3 and mean response
    length) on the curve of ``correction`` (a name or a config: ``resolve_correction``; None: bypass, assumed) and
    ``source`` (None: the map's default) of a map (a path, "default"/None for the shipped one, or a loaded map);
    ``vocab``, the user's vocabulary size, picks the shipped map for it (``shipped_map_for``: the tail map for any
    real vocabulary) when no map file is named. Returns the ``map`` JSON object (``MAP_KEYS`` exactly) and the lines
    to print."""
    map_data = map_path if isinstance(map_path, dict) else load_map(
        None if map_path in (None, "default", DEFAULT_MAP) else map_path, vocab)
    name = choose_correction(map_data, correction, source, policy_lag)
    sequences, tokens = summary.get("sequences") or 0, summary.get("tokens") or 0
    if not sequences or not tokens:
        raise ValueError("the dump has no response lengths (no tokens): nothing to place on the map")
    k3, horizon = summary["metrics"][K3_KL], tokens / sequences
    placed = placement(map_data, k3, horizon, name, source, policy_lag)
    lines = map_lines(placed, map_data) + vocab_lines(placed, map_data, vocab)
    if placed["verdict"].startswith("no verdict") and map_data.get("origin") == SHIPPED_MAPS[DEFAULT_TAIL_MAP]:
        lines += _main_map_reference(k3, horizon, name, placed["source"])
    return {k: placed[k] for k in MAP_KEYS}, lines


def vocab_lines(placed: dict[str, Any], map_data: dict[str, Any], vocab: int | None) -> list[str]:
    """What the verdict's vocabulary is: the map's testbed's, against the user's (``--vocab``) when given."""
    theirs = placed.get("vocab")
    if theirs is None:
        return []
    if vocab is None:
        return [f"  vocabulary: the map's testbed has {theirs:,} tokens; yours was not given (--vocab N picks the "
                "shipped map nearest it: the tail map for any real LLM vocabulary)"]
    return [f"  vocabulary: yours {vocab:,} tokens; the map's testbed {theirs:,} (the shipped map nearest yours on a "
            "log scale)" if map_data.get("origin") in SHIPPED_MAPS.values() else
            f"  vocabulary: yours {vocab:,} tokens; this map's testbed {theirs:,}"]


def _main_map_reference(k3: float, horizon: float, correction: str, source: str | None) -> list[str]:
    """The main map's verdict for the same point, printed (never returned as the verdict) when a shipped map with
    another vocabulary has none at this horizon."""
    main = load_map(DEFAULT_MAP)
    try:
        other = placement(main, k3, horizon, correction, source)
    except ValueError as err:
        return [f"  the main map (22 tokens) cannot place it either: {err}"]
    return [f"  for reference, the main map (its testbed's {other['vocab']} tokens, no tail): {other['verdict']}; a "
            "tail moves the k3 threshold (docs/results/vocab_tail.md), so this is no verdict for your vocabulary"]


def _no_collapse_fact(h: dict[str, Any], at: str) -> str:
    """"no collapse measured up to k3 X at ``at``", and how many of those runs dropped below half their peak too late
    for the detector to confirm it (they are not collapses, and not clean survivals either)."""
    dropped = h.get("dropped_unconfirmed") or 0
    return (f"no collapse measured up to k3 {h['lower_bound']:.2g} at {at}"
            + (f" ({dropped} of {h.get('runs')} runs dropped below half their peak, unconfirmed by the run's end)"
               if dropped else "") + one_run(h))


def some_held(h: dict[str, Any]) -> bool:
    """Whether some but not all of a horizon's runs collapsed (its counts, where it records them)."""
    collapsed, runs = h.get("collapsed"), h.get("runs")
    return isinstance(collapsed, int) and isinstance(runs, int) and 0 < collapsed < runs


def collapsed_from(h: dict[str, Any]) -> str:
    """How many of a below-range horizon's runs collapsed: "every run collapsed", or "3 of 4 runs collapsed" where
    the logistic fit put the 50% point below the smallest dose though some run there held (``some_held``)."""
    return f"{h['collapsed']} of {h['runs']} runs collapsed" if some_held(h) else "every run collapsed"


def one_run(h: dict[str, Any]) -> str:
    """" (one run per dose)" for a horizon whose dose levels hold one run each (no seed scatter behind it)."""
    return " (one run per dose)" if h.get("single_run_per_dose") else ""


def bound_lines(curve: dict[str, Any]) -> list[str]:
    """The curve's horizons that give only a bound, in words: "no collapse measured up to k3 X at T Y" where no run
    collapsed; the side of a 50% point the data could not place otherwise. Bounds never enter the law's fit."""
    lines = []
    for h in curve.get("horizons") or []:
        status, t = h.get("status"), h.get("horizon")
        at = f"T {fmt_t(t)}" if positive(t) else f"{HORIZON_KEY} = {h.get('horizon_value')}"
        if status == "above_range" and positive(h.get("lower_bound")):
            if not h.get("collapsed"):
                lines.append(_no_collapse_fact(h, at))
            else:
                lines.append(f"threshold above k3 {h['lower_bound']:.2g} at {at} ({h['collapsed']} of "
                             f"{h.get('runs')} runs collapsed, the fitted 50% point lies above every dose tested)"
                             + one_run(h))
        elif status == "below_range" and positive(h.get("upper_bound")):
            below = ("the fitted 50% point lies below every dose tested" if some_held(h)
                     else "from the smallest dose tested")
            lines.append(f"threshold below k3 {h['upper_bound']:.2g} at {at} ({collapsed_from(h)}, {below})"
                         + one_run(h))
    return lines
