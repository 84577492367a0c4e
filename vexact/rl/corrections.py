"""Rollout corrections in verl's vocabulary: importance-sampling (IS) weights and rejection-sampling (RS) masks.

For each generated token t the rollout path μ recorded ``logp_roll(t)``, and the training path π at the same
(pre-update) weights gives ``logp_train(t)``. With r_t = logp_train - logp_roll and B = ``log_ratio_bound``
(verl's SAFETY_BOUND, 20):

    token ratio      ρ_t   = exp(clamp(r_t, ±B))
    sequence ratio   ρ_seq = exp(clamp(Σ_t r_t, ±B))        (only the sum is clamped, as in verl)

**One implementation, two vocabularies.** A ``correction`` section is resolved into a ``CorrectionPlan`` in
verl 0.9.1's terms (``algorithm.rollout_correction``), and only the plan is executed:

* verl's keys: ``rollout_is`` (null | token | sequence) with ``rollout_is_threshold`` (a number C: truncate
  at C, "TIS"; a string "a_b": zero the weights outside [a, b], "IcePop"), ``rollout_is_batch_normalize``,
  ``rollout_rs`` (a comma list of rejection options, all combined by AND) with ``rollout_rs_threshold`` (one
  value per option, or one shared), ``loss_type`` -- or a ``preset`` named as verl's
  ``RolloutCorrectionConfig`` factory methods (``PRESETS``), whose values explicit keys override;
* vexact's shorthand ``method`` (with ``threshold`` C and ``band`` [a, b], settings the methods that use them bring:
  ``ThresholdSettings``, ``BandSettings``), expanded by its entry in the registry ``CORRECTION_METHODS``
  (``register_correction_method`` adds one): ``token_tis`` / ``seq_tis`` truncate the token /
  sequence ratio at C, ``token_mis`` / ``seq_mis`` also reject above C, ``icepop`` zeroes token weights outside
  [a, b], ``geo_rs`` rejects sequences whose geometric-mean ratio is outside [a, b]. The config's choices and the
  table in the config reference (each method's verl equivalent and effect) are read from the registry.

**Rejection options** (verl's ``rollout_rs``), on the clamped log-ratio s_t = clamp(r_t, ±B): the token
statistics k1 = -s, k2 = s²/2, k3 = e^s - 1 - s; ``token_kX`` judges each token, ``seq_sum_kX`` /
``seq_mean_kX`` / ``seq_max_kX`` the sum / mean / max over a sequence's tokens and reject the whole sequence.
k1 options keep log(lower) <= stat <= log(upper) (thresholds are ratio bounds "lower_upper"; a single number
U means [1/U, U]); k2/k3 options keep stat <= upper. vexact's methods judge their own ratio against their own band,
edges included (``RejectOption.ratio_band``): ``geo_rs`` log a <= mean_t s_t <= log b, ``token_mis`` ρ_t <= C,
``seq_mis`` ρ_seq <= C with ρ_seq as above (only the sum clamped).

**How it enters the loss** (``vexact.rl.objective``). Rejected tokens leave the loss, numerator and
denominator (verl multiplies them out of ``response_mask``). IS weights multiply the per-token loss:

* decoupled mode (``algorithm.old_logprobs: recompute``): the clipped PPO loss times w_t, as verl;
* bypass mode (``algorithm.old_logprobs: rollout``), by ``loss_type``:
  ``ppo_clip`` (verl): the ratio π_θ/μ alone, IS weights computed for metrics only;
  ``reinforce`` (verl): -A·w_t·log π_θ, no clipping (w_t = 1 without ``rollout_is``);
  ``ppo_clip_is`` (vexact's, the default of ``method``): the ratio's mismatch factor π_old/μ replaced by w_t,
  ratio = exp(logp - logp_train)·w_t, so the clip acts on the corrected ratio.

IcePop's zeroed weights stay in the denominator (verl keeps those tokens in ``response_mask``).

**Metrics.** Under verl's names (``rollout_corr/rollout_is_*``, ``rollout_corr/rollout_rs_*``), verl 0.9.1's
definitions, over all valid tokens and all rows, before batch normalisation; vexact's own view of what the loss
applied (kept tokens, after normalisation) is logged under ``correction/*``. Remaining differences from verl
are listed in the README ("Rollout correction").

With zero mismatch (logp_train == logp_roll bit for bit) every ratio is exactly 1.0, every weight exactly 1.0 and
nothing is rejected (for any threshold that admits 1), so each correction is an exact no-op on the loss.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..metric_keys import RS_OPTIONS, raw_ratio_affected_key  # verl's rejection options name metric keys too
from ..registry import PluginCodeError, call_entry, entry_code, type_hints
from .metrics import is_weight_stats
from .registries import BYPASS_LOSSES, CORRECTION_METHODS, register_run_check
from .validate import ConfigError, bounds, convert, show_repr

if TYPE_CHECKING:
    from .config_schema import CorrectionSection, RunConfig


@dataclass(frozen=True)
class CorrectionMethod:
    """One value of vexact's shorthand ``correction.method``: ``to_verl(cfg)`` gives the verl-vocabulary keys it
    stands for, a dict whose keys are among ``VERL_KEYS`` and ``bypass_mode`` and whose values pass the config's
    checks of those keys (``rollout_is`` "token" or "sequence", ``rollout_is_batch_normalize`` a bool, ...);
    anything else is a ``PluginCodeError`` naming the method. Every run resolves every registered method's plan
    at its default settings (``mismatch/ratio_affected_frac/<method>``), so a config is refused, naming the
    method, when any registered method's ``to_verl`` fails there, selected or not. ``to_verl`` None (for
    ``none``): no shorthand, verl's own keys apply. ``band``: the default [a, b] of a method that takes
    ``correction.band`` (None: the method takes no band); ``settings``: the dataclass of the
    ``correction.*`` keys the method reads (``ThresholdSettings``, ``BandSettings``). ``verl`` / ``effect``: the
    docs' table."""

    name: str
    verl: str
    effect: str
    to_verl: Callable[[CorrectionSection], dict] | None = None
    band: tuple[float, float] | None = None
    settings: type | None = None
    ratio_band: Callable[[CorrectionSection], tuple[float, float]] | None = None  # what its k1 rejection judges


@dataclass
class ThresholdSettings:
    """The truncating and masking methods' setting (``correction`` section)."""

    threshold: float = field(default=2.0, metadata=bounds(gt=1))  # C: TIS truncates at C, MIS masks above C


@dataclass
class BandSettings:
    """The band methods' setting (``correction`` section); it needs one of them as ``correction.method``."""

    requires_owner: ClassVar[bool] = True
    band: tuple[float, float] | None = field(default=None, metadata=bounds(gt=0))  # icepop / geo_rs [a, b]

    def check(self) -> None:
        if self.band is not None and not self.band[0] < self.band[1]:
            raise ConfigError(f"band needs lower < upper, got {list(self.band)}", "band")


def register_correction_method(method: CorrectionMethod, replace: bool = False) -> CorrectionMethod:
    """Register a shorthand ``correction.method`` (a ``CorrectionMethod``); a name already taken is an error
    unless ``replace``."""
    if not isinstance(method, CorrectionMethod):
        raise TypeError(f"register_correction_method needs a CorrectionMethod, got {method!r}")
    return CORRECTION_METHODS.add(method.name, method, replace=replace)


def _one_sided(C: float) -> str:
    return f"{1.0 / C!r}_inf"  # k1 keeps -log ρ >= log(1/C), i.e. ρ <= C; no lower ratio bound


def _icepop_keys(a: float, b: float) -> dict:
    return {"rollout_is": "token", "rollout_is_threshold": f"{a!r}_{b!r}"}  # IcePop's band [a, b]


def _geo_rs_keys(a: float, b: float) -> dict:
    return {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": f"{1.0 / b!r}_{1.0 / a!r}"}  # k1 = -log ρ


_C = ThresholdSettings
for _method in (
    CorrectionMethod("none", "(no correction; verl's keys apply)", "w_t = 1"),
    CorrectionMethod("token_tis", "rollout_is token, threshold C", "w_t = min(ρ_t, C)",
                     lambda cfg: {"rollout_is": "token", "rollout_is_threshold": cfg.threshold}, settings=_C),
    CorrectionMethod("seq_tis", "rollout_is sequence, threshold C", "w_t = min(ρ_seq, C)",
                     lambda cfg: {"rollout_is": "sequence", "rollout_is_threshold": cfg.threshold}, settings=_C),
    CorrectionMethod("token_mis", 'token_tis + rollout_rs token_k1 "1/C_inf"', "reject tokens with ρ_t > C",
                     lambda cfg: {"rollout_is": "token", "rollout_is_threshold": cfg.threshold,
                                  "rollout_rs": "token_k1", "rollout_rs_threshold": _one_sided(cfg.threshold)},
                     settings=_C, ratio_band=lambda cfg: (0.0, cfg.threshold)),
    CorrectionMethod("seq_mis", 'seq_tis + rollout_rs seq_sum_k1 "1/C_inf"', "reject sequences with ρ_seq > C",
                     lambda cfg: {"rollout_is": "sequence", "rollout_is_threshold": cfg.threshold,
                                  "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": _one_sided(cfg.threshold)},
                     settings=_C, ratio_band=lambda cfg: (0.0, cfg.threshold)),
    CorrectionMethod("icepop", 'rollout_is token, threshold "a_b"', "w_t = ρ_t inside [a, b], 0 outside",
                     lambda cfg: _icepop_keys(*band_for(cfg)), band=(0.5, 5.0),  # IcePop's published band
                     settings=BandSettings),
    CorrectionMethod("geo_rs", 'rollout_rs seq_mean_k1 "1/b_1/a"',
                     "reject sequences whose geometric-mean ratio exp(mean_t log ρ_t) is outside [a, b]",
                     lambda cfg: _geo_rs_keys(*band_for(cfg)), band=(0.999, 1.001),  # verl geo preset threshold
                     settings=BandSettings, ratio_band=lambda cfg: band_for(cfg)),
):
    register_correction_method(_method)

_GEO = "0.999_1.001"
PRESETS: dict[str, dict] = {
    "disabled": {},
    "decoupled_token_is": {"bypass_mode": False, "rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"bypass_mode": False, "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_token_icepop": {"bypass_mode": False, "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "decoupled_seq_is_rs": {"bypass_mode": False, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
                            "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": {"bypass_mode": False, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _GEO},
    "decoupled_geo_rs_seq_tis": {"bypass_mode": False, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
                                 "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _GEO},
    "decoupled_geo_rs_token_tis": {"bypass_mode": False, "rollout_is": "token", "rollout_is_threshold": 2.0,
                                   "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _GEO},
    "decoupled_k3_rs": {"bypass_mode": False, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {"bypass_mode": False, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
                                "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_token_tis": {"bypass_mode": False, "rollout_is": "token", "rollout_is_threshold": 2.0,
                                  "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "bypass_ppo_clip": {"bypass_mode": True, "loss_type": "ppo_clip"},
    "bypass_ppo_clip_geo_rs": {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k1",
                               "rollout_rs_threshold": _GEO},
    "bypass_ppo_clip_k3_rs": {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3",
                              "rollout_rs_threshold": 0.01},
    "bypass_pg_is": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence",
                     "rollout_is_threshold": 2.0},
    "bypass_pg_token_icepop": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                               "rollout_is_threshold": "0.5_5.0"},
    "bypass_pg_geo_rs": {"bypass_mode": True, "loss_type": "reinforce", "rollout_rs": "seq_mean_k1",
                         "rollout_rs_threshold": _GEO},
    "bypass_pg_geo_rs_seq_tis": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence",
                                 "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": _GEO},
    "bypass_pg_geo_rs_token_tis": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                                   "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": _GEO},
}
"""verl 0.9.1's ``RolloutCorrectionConfig`` presets with their default arguments, as verl-vocabulary keys."""

VERL_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
             "rollout_rs_threshold", "loss_type")
"""The ``correction`` keys that spell verl's ``algorithm.rollout_correction`` (plus ``preset``). verl's
``bypass_mode`` is vexact's ``algorithm.old_logprobs`` (the config reads it there: ``config.RENAMED_KEYS``); a verl
block's own is passed to ``plan_for`` as ``bypass_mode``."""

VERL_EPS = 1e-8
"""verl's masked mean divides by (count + 1e-8); under verl's names vexact does the same (``verl_count``)."""


def verl_count(count: int | Tensor) -> Tensor:
    """verl's masked-mean denominator, ``mask.sum() + 1e-8``, for the mask its pipeline passes: the response mask is
    a slice of the integer attention mask (``compute_response_mask``), so the count is an int64 and ``+ 1e-8`` makes
    a float32, in which 1e-8 vanishes beside any count >= 1. So a mean over tokens is sum / count exactly (weights
    of exactly 1 give a mean of exactly 1 and a dispersion of exactly 0), and an empty mask divides by 1e-8.
    (A float mask would give count + 1e-8 in its own dtype: a std of ~sqrt(1e-8 / count) at zero mismatch.)"""
    return torch.as_tensor(count, dtype=torch.int64) + VERL_EPS

PREFIX = "rollout_corr/"
OWN_PREFIX = "correction/"


@dataclass(frozen=True)
class RejectOption:
    """One ``rollout_rs`` option: k1 options keep log(lower) <= stat <= log(upper), others stat <= upper.

    ``ratio_band``: the ratio band [a, b] of a vexact method whose k1 option stands for it (``geo_rs``, and the MIS
    methods' one-sided [0, C]; ``CorrectionMethod.ratio_band``): the option then keeps -log b <= stat <= -log a,
    i.e. log a <= mean / sum of log ρ <= log b, edges included, instead of comparing with log(1/b) and log(1/a),
    which rounding may put one step off (its ``lower`` / ``upper`` 1/b, 1/a stay its verl spelling). A
    ``seq_sum_k1`` option with a ratio band (``seq_mis``) judges the method's sequence ratio ρ_seq = exp(clamp(Σ_t r_t,
    ±B)), the one its IS half (``seq_tis``) truncates: its statistic is −clamp(Σ_t r_t, ±B), not verl's
    Σ_t −clamp(r_t, ±B), which keeps a sequence such as r = [+25, −22] (ρ_seq = e³) as if its sum were −2."""

    name: str
    lower: float | None
    upper: float
    ratio_band: tuple[float, float] | None = None


@dataclass(frozen=True)
class CorrectionPlan:
    """A correction section resolved into verl's terms; the only thing ``rollout_correction`` executes."""

    rollout_is: str | None  # None, "token" or "sequence"
    is_upper: float  # TIS truncation C, or IcePop's upper bound
    is_lower: float | None  # IcePop's lower bound (None: TIS)
    batch_normalize: bool
    reject: tuple[RejectOption, ...]
    loss_type: str  # bypass mode's loss: a name in BYPASS_LOSSES (ppo_clip, ppo_clip_is, reinforce)
    bypass_mode: bool | None  # what the preset (or a verl block's bypass_mode) says; None: algorithm.old_logprobs

    @property
    def active(self) -> bool:
        return self.rollout_is is not None or bool(self.reject)


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number U (or "U") -> (U, None); "a_b" -> (b, a). Raises ValueError."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                low_text, up_text = text.split("_", 1)
                lower, upper = float(low_text), float(up_text)
            else:
                upper = float(text)
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' pair") from None
    else:
        upper = float(spec)
    if not math.isfinite(upper) or (lower is not None and not math.isfinite(lower)):
        # "inf" passed as a string (.inf, a YAML float, is refused by the schema): a sequence-level ratio's metrics
        # took log(1 / inf) mid-run; no cap is written by leaving rollout_is unset
        raise ValueError(f"rollout_is_threshold: the bounds must be finite numbers, got {spec!r}")
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold: the upper bound must be positive, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold: need 0 < lower <= upper, got {spec!r}")
    return upper, lower


def parse_rs(options: str, spec: float | str | None) -> tuple[RejectOption, ...]:
    """verl's ``rollout_rs`` (comma list, duplicates dropped) with ``rollout_rs_threshold`` (one value per option,
    or one shared; k1 options take "lower_upper" ratio bounds or U meaning [1/U, U]). Raises ValueError."""
    names: list[str] = []
    for name in (part.strip() for part in options.split(",")):
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {name!r}; expected one of {', '.join(RS_OPTIONS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("rollout_rs names no option")
    if spec is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    if isinstance(spec, bool):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    specs = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} values for {len(names)} rollout_rs options; "
                         f"give one shared value or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, text in zip(names, specs):
        try:
            if name.endswith("k1"):
                if "_" in text:
                    low_text, up_text = text.split("_", 1)
                    lower, upper = float(low_text), float(up_text)
                else:
                    upper = float(text)
                    lower = 1.0 / upper
                if not (lower > 0 and upper > 0 and lower <= upper):
                    raise ValueError
            else:
                if "_" in text:
                    raise ValueError
                lower, upper = None, float(text)
                if not upper > 0:
                    raise ValueError
        except (ValueError, ZeroDivisionError):
            form = "a positive 'lower_upper' pair or number" if name.endswith("k1") else "one positive number"
            raise ValueError(f"rollout_rs_threshold {text!r} for option {name}: expected {form}") from None
        out.append(RejectOption(name, lower, upper))
    return tuple(out)


def _method_keys(cfg: CorrectionSection) -> dict:
    """verl-vocabulary keys of vexact's shorthand ``method`` (its ``CORRECTION_METHODS`` entry)."""
    if cfg.method not in CORRECTION_METHODS:
        raise ValueError(f"{CORRECTION_METHODS.unknown(cfg.method)} (correction.method)")
    keys: dict = {"rollout_is_batch_normalize": cfg.batch_normalize, "loss_type": "ppo_clip_is"}
    to_verl = CORRECTION_METHODS[cfg.method].to_verl
    if to_verl is not None:
        given = call_entry(CORRECTION_METHODS.what, cfg.method, "to_verl", to_verl, cfg)
        keys.update(_checked_verl_keys(cfg, given))
    return keys


def _checked_verl_keys(cfg: CorrectionSection, given: Any) -> dict:
    """What method ``cfg.method``'s ``to_verl`` returned, held to the config's own checks of verl's keys (an unknown
    key would be dropped and a wrong value read as another: "tokens" as sequence-level, "no" as true), converted as
    the config converts them. A ``PluginCodeError`` naming the method and the key otherwise."""
    code = entry_code(CORRECTION_METHODS.what, cfg.method, "to_verl")
    allowed = (*VERL_KEYS, "bypass_mode")
    if not isinstance(given, dict):
        raise PluginCodeError(f"{code} returned {show_repr(given)}: expected a dict of verl keys "
                              f"({', '.join(allowed)})")
    section = type(cfg)
    hints = dict(type_hints(section))
    meta = {f.name: dict(f.metadata) for f in dataclasses.fields(section)}
    hints["bypass_mode"], meta["bypass_mode"] = bool | None, {}
    out = {}
    for key, value in given.items():
        if key not in allowed:
            raise PluginCodeError(f"{code} returned the key {show_repr(key)}: expected verl keys only "
                                  f"({', '.join(allowed)})")
        try:
            out[key] = convert(value, hints[key], key, meta[key])
        except ConfigError as e:
            raise PluginCodeError(f"{code} returned {key}: {show_repr(value)}: {e.problem}") from None
    return out


def band_for(cfg: CorrectionSection) -> tuple[float, float]:
    """The [a, b] band a band method uses: the configured one or the method's default."""
    if cfg.band is not None:
        return float(cfg.band[0]), float(cfg.band[1])
    band = CORRECTION_METHODS[cfg.method].band
    if band is None:
        raise ValueError(f"correction method {cfg.method!r} takes no band")
    return band


def uses_verl_keys(cfg: CorrectionSection) -> bool:
    return cfg.preset is not None or any(getattr(cfg, key) is not None for key in VERL_KEYS)


def plan_for(cfg: CorrectionSection, bypass_mode: bool | None = None) -> CorrectionPlan:
    """Resolve a correction section into verl's terms. Raises ValueError naming the offending key.

    ``bypass_mode``: a verl ``rollout_correction`` block's own (it overrides its preset's, as verl's keys do); a
    vexact config says it as ``algorithm.old_logprobs``, which ``_check_correction`` holds the plan to."""
    if cfg.method != "none" and uses_verl_keys(cfg):
        given = ["preset"] * (cfg.preset is not None) + [k for k in VERL_KEYS if getattr(cfg, k) is not None]
        raise ValueError(f"method {cfg.method!r} is vexact's shorthand; it cannot be combined with verl's keys "
                         f"({', '.join(given)}): use one vocabulary")
    if cfg.method != "none":
        keys = _method_keys(cfg)
    else:
        if cfg.preset is not None and cfg.preset not in PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; expected one of {', '.join(PRESETS)}")
        keys = dict(PRESETS.get(cfg.preset or "disabled", {}))
        keys.update({k: getattr(cfg, k) for k in VERL_KEYS if getattr(cfg, k) is not None})
    rollout_is = keys.get("rollout_is")
    is_upper, is_lower = parse_is_threshold(keys.get("rollout_is_threshold", 2.0))
    rs = keys.get("rollout_rs")
    reject = parse_rs(rs, keys.get("rollout_rs_threshold")) if rs is not None else ()
    ratio_band = CORRECTION_METHODS[cfg.method].ratio_band if cfg.method != "none" else None
    if ratio_band is not None and len(reject) == 1 and reject[0].name.endswith("_k1"):
        a, b = ratio_band(cfg)
        reject = (dataclasses.replace(reject[0], ratio_band=(float(a), float(b))),)
    loss_type = keys.get("loss_type") or "ppo_clip"
    if loss_type not in BYPASS_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(BYPASS_LOSSES.names())}")
    return CorrectionPlan(rollout_is=rollout_is, is_upper=is_upper, is_lower=is_lower,
                          batch_normalize=bool(keys.get("rollout_is_batch_normalize") or False), reject=reject,
                          loss_type=loss_type,
                          bypass_mode=keys.get("bypass_mode") if bypass_mode is None else bypass_mode)


_PLAN_KEYS = ("method", "rollout_rs_threshold", "rollout_is_threshold", "rollout_rs", "preset", "loss_type")


@register_run_check
def _check_correction(cfg: RunConfig) -> None:
    """The correction's run check: its keys expand to a plan (``plan_for``), which agrees with
    ``algorithm.old_logprobs`` (verl's bypass or decoupled mode)."""
    c = cfg.correction
    try:
        plan = plan_for(c)
        check_every_method(c)
    except PluginCodeError as err:  # a method's own code: the key to change is the method
        raise ConfigError(str(err), "correction.method") from None
    except ValueError as err:  # the message names the key it is about; point the error there
        text = str(err)
        key = next((k for k in _PLAN_KEYS if k in text), None)
        raise ConfigError(text, f"correction.{key}" if key else "correction") from None
    bypass = cfg.algorithm.old_logprobs == "rollout"
    if plan.bypass_mode is not None and plan.bypass_mode != bypass:  # only a preset says a mode
        raise ConfigError(f"preset {c.preset} means verl's {'bypass' if plan.bypass_mode else 'decoupled'} mode: "
                          f"set algorithm.old_logprobs: {'rollout' if plan.bypass_mode else 'recompute'} (it is "
                          f"{cfg.algorithm.old_logprobs!r})", "correction.preset")
    if c.loss_type is not None and not bypass:
        raise ConfigError("loss_type chooses the loss of bypass mode (algorithm.old_logprobs: rollout); in "
                          "decoupled mode the IS weights multiply the clipped loss", "correction.loss_type")
    monitor, alg = cfg.monitor, cfg.algorithm
    if plan.active and bypass and monitor.sampling and (alg.mini_batches > 1 or alg.ppo_epochs > 1):
        key = "monitor.sample_fraction" if monitor.sample_fraction < 1 else "monitor.every"
        value = monitor.sample_fraction if monitor.sample_fraction < 1 else monitor.every
        given = [f"correction.{k} {getattr(c, k)!r}" for k in ("method", "preset", "rollout_is", "rollout_rs")
                 if getattr(c, k) not in (None, "none")]
        raise ConfigError(f"{key} {value} rescores only part of the steps' sequences, but the correction "
                          f"({', '.join(given)}) weighs every token by its training-path log-prob before the update, "
                          "which bypass mode with several mini-batches or epochs scores for the whole batch anyway: "
                          "leave monitor.sample_fraction at 1.0 and monitor.every at 1 (the metrics then cost nothing "
                          "more), or set correction.method: none", key)


def check_every_method(c: CorrectionSection) -> None:
    """Each registered method's plan at its default settings, the one ``raw_ratios`` resolves for
    ``mismatch/ratio_affected_frac/<method>`` whichever method is selected (at every step of a run, and for
    ``vexact measure``'s report): a method whose ``to_verl`` fails there is one ``PluginCodeError`` naming it and
    that key, before the work rather than at its first step or its end (or with its key left out of some runs'
    logs, which ``vexact compare`` reads side by side). ``c``: the selected correction (``CorrectionSection()``
    selects ``none``): its own method is checked as configured by ``plan_for(c)``, not here."""
    for name in CORRECTION_METHODS.names():
        if name in ("none", c.method):  # none has no plan of its own
            continue
        try:
            plan_for(type(c)(method=name))
        except ValueError as err:
            raise PluginCodeError(f"{err} (registered correction method {name!r} is not selected, but its default "
                                  f"plan gives {raw_ratio_affected_key(name)}, which every run logs at each step "
                                  "and vexact measure reports; fix it or leave out the plugin that registers it)"
                                  ) from None


@dataclass
class Correction:
    """Per-token weights and keep mask for a flat batch of tokens, plus metrics.

    ``weights``: the IS weight each token's loss is multiplied by (0 where IcePop zeroed it or RS rejected
    it; 1 everywhere without ``rollout_is``); ``keep``: False where RS rejected the token (it leaves the loss)."""

    weights: Tensor
    keep: Tensor
    metrics: dict[str, float]
    plan: CorrectionPlan
    truncated: Tensor | None = None  # True where TIS truncated the token's weight (None: not recorded)
    weights64: Tensor | None = None  # ``weights`` in float64, as computed (None: not recorded)

    @property
    def reweights(self) -> bool:
        """Whether the loss uses the IS weights (False: rejection only, as verl without ``rollout_is``)."""
        return self.plan.rollout_is is not None

    @property
    def rejects_any(self) -> bool:
        return not bool(self.keep.all())


class _Rows:
    """Per-sequence reductions of flat per-token values (``lengths`` tokens per row, in order; rows may be empty)."""

    def __init__(self, lengths: list[int], device: torch.device | str = "cpu"):
        self.n_rows = len(lengths)
        self.device = device  # the log-probs' (a GPU run's): the reductions run beside them
        self.seq_id = torch.repeat_interleave(torch.arange(self.n_rows, device=device),
                                              torch.tensor(lengths, dtype=torch.long, device=device))
        self.counts = torch.tensor(lengths, dtype=torch.float64, device=device)
        self.denominators = verl_count(torch.tensor(lengths, dtype=torch.int64, device=device))
        self.nonempty = self.counts > 0

    def sum(self, values: Tensor) -> Tensor:
        return torch.zeros(self.n_rows, dtype=torch.float64, device=self.device).index_add_(0, self.seq_id,
                                                                                           values.double())

    def mean(self, values: Tensor) -> Tensor:
        """Row means as verl's masked mean (``verl_count``): sum / count, and an empty row gives 0."""
        return self.sum(values) / self.denominators

    def max(self, values: Tensor) -> Tensor:
        """Row maxima; an empty row gives 0 (as verl's ``_sequence_max``)."""
        out = torch.full((self.n_rows,), float("-inf"), dtype=torch.float64, device=self.device)
        out = out.scatter_reduce(0, self.seq_id, values.double(), reduce="amax")
        return torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)

    def any(self, flags: Tensor) -> Tensor:
        return self.sum(flags.double()) > 0


def _token_mean(values: Tensor) -> Tensor:
    """verl's ``masked_mean`` over all valid tokens (``verl_count``): sum / count."""
    return values.sum() / verl_count(values.numel())


def rollout_correction(logp_train: Tensor, logp_roll: Tensor, lengths: list[int],
                       cfg: CorrectionSection) -> Correction:
    """Weights, keep mask and metrics for one batch.

    ``logp_train`` and ``logp_roll``: flat per-token log-probs of the same tokens (training path at the
    pre-update weights, and the rollout path); ``lengths``: tokens per sequence, in order, summing to their
    length (rows may be empty). Computed in float64; the weights come back in ``logp_train``'s dtype, detached.
    Metrics: verl's ``rollout_corr/rollout_is_*`` (with ``rollout_is``) and ``rollout_corr/rollout_rs_*`` (with
    ``rollout_rs``), and vexact's ``correction/*``. Raises ValueError on bad shapes, dtypes or lengths, or no
    tokens.
    """
    plan = plan_for(cfg)
    if logp_train.shape != logp_roll.shape or logp_train.dim() != 1:
        raise ValueError(f"need two flat log-prob tensors of one shape, got {tuple(logp_train.shape)} and "
                         f"{tuple(logp_roll.shape)}")
    for side, logp in (("logp_train", logp_train), ("logp_roll", logp_roll)):
        if not logp.is_floating_point():  # integer weights would come back rounded down
            raise ValueError(f"{side} must be a floating-point tensor of log-probs, got {logp.dtype}")
    if any(not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0 for n in lengths):
        raise ValueError(f"lengths must be token counts (ints >= 0), got {list(lengths)[:8]}")
    if sum(lengths) != logp_train.numel():
        raise ValueError(f"lengths sum to {sum(lengths)} but there are {logp_train.numel()} tokens")
    if logp_train.numel() == 0:
        raise ValueError("no tokens to correct")
    bound = cfg.log_ratio_bound
    log_ratio = logp_train.detach().double() - logp_roll.detach().double()  # r_t = log(π/μ), unclamped
    rows = _Rows(lengths, log_ratio.device)
    metrics: dict[str, float] = {}

    weights = torch.ones_like(log_ratio)
    truncated = torch.zeros_like(log_ratio, dtype=torch.bool)
    if plan.rollout_is is not None:
        weights, truncated, is_metrics = _importance_weights(log_ratio, rows, plan, bound)
        metrics.update(is_metrics)
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    if plan.reject:
        keep, rs_metrics = _rejection_mask(log_ratio, rows, plan.reject, bound)
        metrics.update(rs_metrics)
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    metrics.update(_own_metrics(weights, keep, truncated, rows, plan))
    return Correction(weights=weights.to(logp_train.dtype), keep=keep, metrics=metrics, plan=plan,
                      truncated=truncated, weights64=weights)


def step_correction_metrics(logp_train: list[Tensor], logp_roll: list[Tensor],
                            parts: list[tuple[list[int], Correction]], cfg: CorrectionSection) -> dict[str, float]:
    """The rollout correction's statistics of a step whose update had several mini-batches, over the step's whole
    batch, each sequence once: verl's ``rollout_corr/*`` of every token (``logp_train``: each sequence's training-path
    log-probs at the pre-update weights, ``logp_roll``: the rollout's), and vexact's ``correction/*`` over the
    weights and masks the loss applied (``parts``: one epoch's mini-batches, each its sequences' indices and its
    correction; the weights are each mini-batch's own, e.g. under its own batch normalisation)."""
    pre = torch.cat(list(logp_train))
    whole = rollout_correction(pre, torch.cat(list(logp_roll)).to(pre.device), [len(t) for t in logp_train], cfg)
    out = {k: v for k, v in whole.metrics.items() if k.startswith(PREFIX)}
    out.update(applied_metrics([c for _, c in parts], [[len(logp_roll[i]) for i in idx] for idx, _ in parts]))
    return out


def applied_metrics(corrections: list[Correction], lengths: list[list[int]]) -> dict[str, float]:
    """vexact's ``correction/*`` over the tokens of several corrections together, in order (a step's mini-batches,
    each sequence once: what the loss applied over the step); ``lengths``: each correction's tokens per sequence."""
    if not corrections or len(corrections) != len(lengths):
        raise ValueError("applied_metrics needs one list of lengths per correction, and at least one correction")
    weights = torch.cat([c.weights.double() if c.weights64 is None else c.weights64 for c in corrections])
    keep = torch.cat([c.keep for c in corrections])
    truncated = torch.cat([torch.zeros_like(c.keep) if c.truncated is None else c.truncated for c in corrections])
    rows = _Rows([n for part in lengths for n in part], weights.device)
    return _own_metrics(weights, keep, truncated, rows, corrections[0].plan)


def _importance_weights(log_ratio: Tensor, rows: _Rows, plan: CorrectionPlan,
                        bound: float) -> tuple[Tensor, Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_weights`` + ``compute_is_metrics`` on flat tokens: (weights after
    TIS / IcePop and batch normalisation, tokens truncated by TIS, ``rollout_corr/rollout_is_*``)."""
    upper, lower = plan.is_upper, plan.is_lower
    icepop = lower is not None
    if plan.rollout_is == "token":
        ratio_log = log_ratio  # what the fractions are judged on: per token
        raw = torch.exp(log_ratio.clamp(-bound, bound))
    else:
        ratio_log = rows.sum(log_ratio)  # per row, the unclamped sum; an empty row sums to 0 (ratio 1)
        raw = torch.exp(ratio_log.clamp(-bound, bound))[rows.seq_id]
    if icepop:
        inside = (raw >= lower) & (raw <= upper)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
        truncated = torch.zeros_like(inside)
    else:
        weights = raw.clamp(max=upper)
        truncated = raw > upper

    n = log_ratio.numel()
    lower_for_metrics = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {}
    if plan.rollout_is == "sequence":
        m["rollout_is_max"] = math.exp(min(float(ratio_log.max()), bound))  # the raw ratio, before truncation
        m["rollout_is_min"] = math.exp(min(float(ratio_log.min()), bound))  # (every row above the bound: no overflow)
        m["rollout_is_mean"] = float(_token_mean(weights))
        m["rollout_is_ratio_fraction_high"] = float((ratio_log > math.log(upper)).double().mean())  # over rows
        m["rollout_is_ratio_fraction_low"] = float((ratio_log < math.log(lower_for_metrics)).double().mean())
    else:
        m["rollout_is_mean"] = float(_token_mean(weights))
        m["rollout_is_ratio_fraction_high"] = float(_token_mean((raw > upper).double()))  # raw token ratios
        m["rollout_is_ratio_fraction_low"] = float(_token_mean((raw < lower_for_metrics).double()))
        m["rollout_is_max"] = float(weights.max())
        m["rollout_is_min"] = float(weights.min())
    clamped = weights.clamp(min=0.0, max=upper)
    if n > 1:
        variance = float(_token_mean(clamped.square())) - float(_token_mean(clamped)) ** 2
        m["rollout_is_std"] = math.sqrt(max(variance, 0.0))
    else:
        m["rollout_is_std"] = 0.0
    normalised_sq = _token_mean((clamped / (_token_mean(clamped) + VERL_EPS)).square())  # 1 / E[(w / E[w])²]
    m["rollout_is_eff_sample_size"] = 1.0 / float(normalised_sq) if float(normalised_sq) > 0 else float("inf")
    seq_mean = rows.mean(weights)  # per row, all rows (an empty row: 0)
    m["rollout_is_seq_mean"] = float(seq_mean.mean())
    m["rollout_is_seq_std"] = float(seq_mean.std()) if rows.n_rows > 1 else 0.0  # ddof 1, as torch.std
    m["rollout_is_seq_max"] = float(seq_mean.max())
    m["rollout_is_seq_min"] = float(seq_mean.min())
    m["rollout_is_seq_max_deviation"] = float((seq_mean - 1.0).abs().max())
    raw_seq_mean = rows.mean(raw)
    m["rollout_is_seq_fraction_high"] = float((raw_seq_mean > upper).double().mean())
    m["rollout_is_seq_fraction_low"] = float((raw_seq_mean < lower_for_metrics).double().mean())
    if icepop:
        m["rollout_is_oob_ratio"] = float(_token_mean(((raw < lower) | (raw > upper)).double()))

    if plan.batch_normalize:
        # The factor is logged as verl computes it (its token mean divides by N + 1e-8), but the weights are divided
        # by the plain mean, so that ρ ≡ 1 gives weights of exactly 1 (verl's are 1 + 1e-8/N).
        if plan.rollout_is == "token":
            logged, mean = float(_token_mean(weights)), float(weights.mean())
        else:  # one weight per sequence: the mean over non-empty rows of each row's weight
            per_row = rows.sum(weights) / rows.counts.clamp(min=1.0)
            mean = float(per_row[rows.nonempty].sum()) / max(float(rows.nonempty.sum()), 1e-8)
            logged = float(seq_mean[rows.nonempty].sum()) / max(float(rows.nonempty.sum()), 1e-8)
        if logged > 1e-8:
            weights = weights / mean
            m["rollout_is_batch_norm_factor"] = logged
        else:
            m["rollout_is_batch_norm_factor"] = 1.0
    return weights, truncated, {PREFIX + k: v for k, v in m.items()}


def _passes(values: Tensor, lower_cut: float, upper_cut: float, k1: bool) -> Tensor:
    """A rejection option's keep test: k1 options keep lower_cut <= stat <= upper_cut, k2/k3 keep stat <= upper_cut."""
    return (values <= upper_cut) & (values >= lower_cut) if k1 else values <= upper_cut


def _rejection_mask(log_ratio: Tensor, rows: _Rows, options: tuple[RejectOption, ...],
                    bound: float) -> tuple[Tensor, dict[str, float]]:
    """verl's ``compute_rollout_rejection_mask`` + ``compute_rs_metrics`` on flat tokens: (keep mask, metrics)."""
    safe = log_ratio.clamp(-bound, bound)
    token_stat = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep_all = torch.ones_like(safe, dtype=torch.bool)
    valid = rows.nonempty
    m: dict[str, float] = {}
    for option in options:
        level, _, estimator = option.name.rpartition("_")
        stat = token_stat[estimator]
        k1 = estimator == "k1"
        upper_cut = math.log(option.upper) if k1 else option.upper
        lower_cut = math.log(option.lower) if k1 else 0.0
        if k1 and option.ratio_band is not None:  # the method's band itself: -log b <= -log ρ <= -log a, exactly
            a, b = option.ratio_band
            lower_cut, upper_cut = -math.log(b), (math.inf if a == 0 else -math.log(a))

        if level == "token":
            per_token = stat
            keep = _passes(stat, lower_cut, upper_cut, k1)
            seq_values = rows.mean(stat)
        elif level == "seq_sum" and k1 and option.ratio_band is not None:  # the method's ρ_seq: only the sum clamped
            seq_values = -rows.sum(log_ratio).clamp(-bound, bound)
            per_token = seq_values[rows.seq_id]
            keep = _passes(seq_values, lower_cut, upper_cut, k1)[rows.seq_id]
        else:
            reduce = {"seq_sum": rows.sum, "seq_mean": rows.mean, "seq_max": rows.max}[level]
            seq_values = reduce(stat)
            per_token = seq_values[rows.seq_id]
            keep = _passes(seq_values, lower_cut, upper_cut, k1)[rows.seq_id]
        keep_all &= keep
        seq_valid = seq_values[valid]
        prefix = f"rollout_rs_{option.name}"
        m[f"{prefix}_mean"] = float(_token_mean(per_token))
        if level != "token":
            m[f"{prefix}_max"] = float(seq_valid.max())
            m[f"{prefix}_min"] = float(seq_valid.min())
            m[f"{prefix}_fraction_high"] = float((seq_valid > upper_cut).double().mean())
            m[f"{prefix}_fraction_low"] = float((seq_valid < lower_cut).double().mean()) if k1 else 0.0
        else:
            m[f"{prefix}_max"] = float(per_token.max())
            m[f"{prefix}_min"] = float(per_token.min())
            m[f"{prefix}_fraction_high"] = float(_token_mean((per_token > upper_cut).double()))
            m[f"{prefix}_fraction_low"] = float(_token_mean((per_token < lower_cut).double())) if k1 else 0.0
        if per_token.numel() > 1:
            clamped = per_token.clamp(min=lower_cut if k1 else 0.0, max=upper_cut)
            variance = float(_token_mean(clamped.square())) - float(_token_mean(clamped)) ** 2
            m[f"{prefix}_std"] = math.sqrt(max(variance, 0.0))
        else:
            m[f"{prefix}_std"] = 0.0
        m[f"{prefix}_seq_mean"] = float(seq_valid.mean())
        m[f"{prefix}_seq_std"] = float(seq_valid.std()) if seq_valid.numel() > 1 else 0.0
        m[f"{prefix}_seq_max"] = float(seq_valid.max())
        m[f"{prefix}_seq_min"] = float(seq_valid.min())
        m[f"{prefix}_seq_max_deviation"] = float(seq_valid.abs().max())
        m[f"{prefix}_seq_fraction_high"] = float((seq_valid > upper_cut).double().mean())
        if k1:
            m[f"{prefix}_seq_fraction_low"] = float((seq_valid < lower_cut).double().mean())
        m[f"{prefix}_masked_fraction"] = float(_token_mean((~keep).double()))
        m[f"{prefix}_seq_masked_fraction"] = float(rows.any(~keep)[valid].double().mean())
    m["rollout_rs_masked_fraction"] = float(_token_mean((~keep_all).double()))
    m["rollout_rs_seq_masked_fraction"] = float(rows.any(~keep_all).double().mean())  # over all rows
    return keep_all, {PREFIX + k: v for k, v in m.items()}


def _own_metrics(weights: Tensor, keep: Tensor, truncated: Tensor, rows: _Rows,
                 plan: CorrectionPlan) -> dict[str, float]:
    """vexact's view of what the loss applied (``correction/*``): the weights of the kept tokens after batch
    normalisation, and what was truncated, zeroed and rejected."""
    n = weights.numel()
    out: dict[str, float] = {}
    if plan.rollout_is is not None and bool(keep.any()):
        out.update(is_weight_stats(weights[keep], OWN_PREFIX + "weight"))
    kept_per_row = rows.sum(keep.double())
    nonempty = int(rows.nonempty.sum())
    out.update({
        OWN_PREFIX + "truncated_token_frac": int(truncated.sum()) / n,
        OWN_PREFIX + "zeroed_token_frac": int(((weights == 0) & keep).sum()) / n if plan.rollout_is else 0.0,
        OWN_PREFIX + "rejected_token_frac": int((~keep).sum()) / n,
        OWN_PREFIX + "rejected_seq_frac": int(((kept_per_row == 0) & rows.nonempty).sum()) / max(nonempty, 1),
    })
    return out
