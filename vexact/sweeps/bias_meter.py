"""The gradient-bias meter: how far a mismatched rollout path moves the policy gradient, measured without training.

``vexact meter`` runs it. Not to be confused with ``vexact measure`` (``vexact.real.measure``), which reports the
per-token log-prob mismatch between two paths of a real checkpoint, with no gradient and no RL.

Collapse under mismatch is slow to observe (hundreds of steps, many seeds); its mechanism is not. At a fixed
(warm-started) policy θ the meter estimates two expected policy gradients, exactly as the trainer forms them:

- ``g_π``: from rollouts of the exact path (the rollout path identical to the training path, ratio exactly 1);
- ``g_μ``: from rollouts of the mismatched path (an ``inject`` source), with the run's old-log-prob mode (bypass:
  the rollout's recorded log-probs anchor the PPO ratio, as the trainer would use them).

Batch ``k`` of both uses the same prompts and the same sampling seeds (common random numbers: the trainer's
rollout of step ``k``), so where the two paths agree on a token they sample the same token, and the difference
``d_k = g_μ,k − g_π,k`` carries little sampling noise. Over ``K`` batches the meter reports

- ``bias_ratio`` = ‖mean d‖ / ‖mean g_π‖ (the plug-in estimate) and ``bias_ratio_debiased``: the same with each
  squared norm corrected for its Monte-Carlo noise (‖mean x‖² − tr Cov(x)/K, an unbiased estimate of ‖E x‖²);
- ``cosine`` between mean g_μ and mean g_π;
- 95% intervals of both from ``BOOTSTRAP`` resamples of the batches (Gram matrices make a resample cost K² flops);
- the realised mismatch on the μ batches (``rollout_corr/k3_kl``, token mean) and the mean response length T.

The ratio does not depend on how the loss normalises tokens (both gradients scale alike); ``bias_abs`` (‖mean d‖)
does, and ``loss_agg: token_mean`` divides by the token count, so its exponent in T is one less than that of a
summed loss (paper 003's bound is for the sum).

A zero mismatch gives a zero bias bit for bit: both paths are the same computation, so every ``d_k`` is exactly 0
(``tests/map/test_bias_meter.py``). ``vexact meter SPEC.yaml`` runs a grid of horizons x sources (a meter file, below),
writes ``meter.json`` after every cell (a re-run skips finished cells) and ``meter.png``, and fits the growth with T
per source (``fit_growth``): the exponent β of bias_ratio ∝ T^β with a bootstrap interval.

A meter file::

    name: horizon_meter
    base: horizon_scaling.yaml        # a run config (relative to this file): the policy, task, algorithm
    horizons: [8, 16, 32, 64, 128]    # scratchpad lengths L of the ``horizon`` task (vexact.rl.horizon_task)
    batches: 16                       # K batches of prompts_per_step x samples_per_prompt responses
    set: {threads: 1}                 # overrides for every cell (optional)
    sources:                          # name -> inject overrides
      noise_0.3: {inject.mode: logit_noise, inject.value: 0.3}
      bf16_all: {inject.mode: precision, inject.precision: bfloat16, inject.sites: [linear, attention, norm, logits]}
    output_dir: runs/meter/horizon_meter   # optional; default runs/meter/<name>
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.devices import DeviceError, resolve_device
from ..metric_keys import ABS_DLOGP_MEAN, K3_KL, TAIL_MASS_MEAN, TAIL_RESPONSE_FRAC, TAIL_TOKEN_FRAC
from ..records.atomic import publish
from ..records.metrics_log import decode_non_finite
from ..records.runlog import json_safe, run_lock, write_json_atomic
from ..rl.config import ConfigError, config_from_dict, config_hash, read_yaml
from ..rl.config_schema import RunConfig
from ..rl.horizon_task import horizon_overrides
from ..rl.inject import Injector
from ..rl.metrics import mismatch_metrics
from ..rl.objective import compute_advantages
from ..rl.validate import read_text_file

__all__ = ["BOOTSTRAP", "MeterSpec", "fit_growth", "load_meter_spec", "measure_bias", "noise_bias_split",
           "noise_bias_table", "run_meter", "split_cell"]

BOOTSTRAP = 500
RESOLVED_SIGMAS = 2.0
"""A cell's ratio is *resolved* when ‖mean d‖ and ‖mean g_π‖ each exceed this many times their Monte-Carlo noise
sqrt(tr Cov / K); otherwise the plug-in ratio is mostly noise and only its upper interval end means something."""
BOOTSTRAP_SEED = 0
SPEC_KEYS = {"name", "base", "horizons", "batches", "set", "sources", "output_dir"}


# ----------------------------------------------------------------------------- one cell


def _flat_gradient(trainer: Any, batch: Any) -> Tensor:
    """The policy gradient the trainer's first (on-policy) mini-batch pass would take from ``batch``: its
    advantages, its old-log-prob anchors, the whole batch as one mini-batch; flat float32 (zeros for unused)."""
    alg = trainer.cfg.algorithm
    advantages = compute_advantages(batch.rewards, trainer.cfg.rollout.samples_per_prompt, alg.advantage,
                                    alg.std_normalize, alg)
    anchors = trainer.objective.anchors(trainer.compute, batch, lambda: trainer.compute)
    part = trainer.objective.minibatch_loss(trainer.compute, batch, list(range(len(batch.responses))), advantages,
                                            anchors, check_exact=False)
    params = list(trainer.compute.parameters())
    grads = torch.autograd.grad(part.loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                      for g, p in zip(grads, params)])  # float32: the gradients' own precision, half the memory


def _trainer_at_warm_start(cfg: RunConfig) -> Any:
    """A trainer holding ``cfg``'s warm-started policy (cached like any run's warm start)."""
    from rich.console import Console

    from ..rl.trainer import Trainer
    from ..rl.warmstart import warm_start

    trainer = Trainer(cfg, console=Console(quiet=True))
    warm_start(trainer.master, cfg, trainer.task, log=lambda _: None)
    trainer.load_policy(trainer.master.state_dict())
    return trainer


@dataclass
class _Gradients:
    """Per-batch exact gradients of one horizon (shared by every source), with their batches' lengths."""

    grads: list[Tensor]
    lengths: list[float]
    rewards: list[float]
    tails: list[dict[str, float]] = field(default_factory=list)  # tail_metrics per batch (task.distractors > 0)


def exact_gradients(cfg: RunConfig, batches: int, trainer: Any | None = None) -> _Gradients:
    """``g_π,k`` for k < ``batches``: rollouts on the exact path (no injection) of the trainer's steps 0..K-1."""
    trainer = trainer or _trainer_at_warm_start(cfg)
    plan = Injector(type(cfg.inject)(), cfg.seed, cfg.backend, cfg.dtype, cfg.rollout.backend, cfg.rollout.dtype,
                    trainer.master.device).plan(0)
    out = _Gradients([], [], [])
    for k in range(batches):
        batch = trainer.rollout(k, plan)
        out.grads.append(_flat_gradient(trainer, batch))
        out.lengths.append(sum(batch.lengths) / len(batch.lengths))
        out.rewards.append(float(batch.rewards.mean()))
        if batch.tail_mass is not None:
            out.tails.append(batch.tail_metrics())
    return out


def measure_bias(cfg: RunConfig, batches: int = 16, exact: _Gradients | None = None) -> dict[str, Any]:
    """The gradient bias of ``cfg``'s rollout path (its ``inject`` section) at its warm-started policy.

    ``exact``: the exact-path gradients of the same config without injection (computed when None; pass them to
    share one set between sources). Returns the cell's JSON object (see the module docstring)."""
    if batches < 2:
        raise ValueError(f"the meter needs at least 2 batches for an error bar, got {batches}")
    start = time.perf_counter()
    trainer = _trainer_at_warm_start(cfg)
    if exact is None:
        exact = exact_gradients(cfg, batches, trainer)
    if len(exact.grads) < batches:
        raise ValueError(f"{len(exact.grads)} exact gradients for {batches} batches")
    diffs, k3, abs_dlogp, lengths, tails = [], [], [], [], []
    for k in range(batches):
        plan = trainer.injector.plan(k)
        batch = trainer.rollout(k, plan)
        diffs.append((_flat_gradient(trainer, batch).double() - exact.grads[k].double()).float())
        metrics = mismatch_metrics(trainer.objective.score(trainer.compute, batch), batch.logprobs)
        k3.append(metrics[K3_KL])
        abs_dlogp.append(metrics[ABS_DLOGP_MEAN])
        lengths.append(sum(batch.lengths) / len(batch.lengths))
        if batch.tail_mass is not None:
            tails.append(batch.tail_metrics())
    d = torch.stack(diffs)
    stats = bias_statistics(torch.stack(exact.grads[:batches]), d)
    tail = _tail_summary(tails, exact.tails[:batches]) if tails else {}  # no keys without a vocabulary tail
    return {**stats, "batches": batches, "k3_kl": sum(k3) / batches, "abs_dlogp_mean": sum(abs_dlogp) / batches,
            "horizon_mean": sum(lengths) / batches, "horizon_mean_exact": sum(exact.lengths[:batches]) / batches,
            "reward_mean_exact": sum(exact.rewards[:batches]) / batches,
            "old_logprobs": cfg.algorithm.old_logprobs, "inject_mode": cfg.inject.mode,
            "inject_value": cfg.inject.value, **tail,
            "responses_per_batch": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
            "noise_bias": noise_bias_split(d),
            "seconds": round(time.perf_counter() - start, 1)}


def _tail_summary(mismatched: list[dict[str, float]], exact: list[dict[str, float]]) -> dict[str, float]:
    """Batch means of the rollouts' ``tail/*`` metrics (``vexact.rl.vocab_tail``): ``tail_mass_mean``,
    ``tail_token_frac`` and ``tail_response_frac`` of the mismatched rollouts, and ``tail_mass_mean_exact`` of the
    exact ones."""
    def mean(rows: list[dict[str, float]], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    keys = {"tail_mass_mean": TAIL_MASS_MEAN, "tail_token_frac": TAIL_TOKEN_FRAC,
            "tail_response_frac": TAIL_RESPONSE_FRAC}
    out = {name: mean(mismatched, key) for name, key in keys.items()}
    if exact:
        out["tail_mass_mean_exact"] = mean(exact, TAIL_MASS_MEAN)
    return out


def bias_statistics(g: Tensor, d: Tensor, bootstrap: int = BOOTSTRAP) -> dict[str, Any]:
    """Bias ratio and cosine of mean(g + d) against mean(g) with bootstrap intervals over the K rows.

    ``g`` [K, P]: exact-path gradients; ``d`` [K, P]: mismatched minus exact, batch by batch."""
    k = g.shape[0]
    g, d = g.double(), d.double()
    gg, dd, gd = g @ g.T, d @ d.T, g @ d.T
    full = {"gg": gg, "dd": dd, "gd": gd}
    est = _estimates(full, torch.full((k,), 1.0 / k, dtype=torch.float64))
    rng = random.Random(BOOTSTRAP_SEED)
    ratios, cosines = [], []
    for _ in range(bootstrap):
        counts = torch.zeros(k, dtype=torch.float64)
        for i in rng.choices(range(k), k=k):
            counts[i] += 1.0
        e = _estimates(full, counts / k)
        ratios.append(e["bias_ratio"])
        cosines.append(e["cosine"])
    d_trace = (torch.diagonal(dd).sum() - k * est["bias_abs"] ** 2) / (k - 1)
    g_trace = (torch.diagonal(gg).sum() - k * est["grad_norm"] ** 2) / (k - 1)
    bias_sq = est["bias_abs"] ** 2 - float(d_trace) / k
    grad_sq = est["grad_norm"] ** 2 - float(g_trace) / k
    debiased = math.sqrt(max(bias_sq, 0.0) / grad_sq) if grad_sq > 0 else None
    out = {
        "bias_ratio": est["bias_ratio"], "bias_ratio_ci": _percentiles(ratios),
        "bias_ratio_debiased": debiased, "cosine": est["cosine"], "cosine_ci": _percentiles(cosines),
        "bias_abs": est["bias_abs"], "bias_abs_noise": math.sqrt(max(float(d_trace), 0.0) / k),
        "grad_norm": est["grad_norm"], "grad_norm_noise": math.sqrt(max(float(g_trace), 0.0) / k),
        "exactly_zero": bool(torch.count_nonzero(d) == 0),
    }
    out["resolved"] = resolved(out)
    return out


def resolved(cell: dict[str, Any]) -> bool:
    """Both norms of the ratio stand above their Monte-Carlo noise (``RESOLVED_SIGMAS``): ‖mean d‖ and ‖mean g_π‖."""
    return (cell["bias_abs"] > RESOLVED_SIGMAS * cell["bias_abs_noise"]
            and cell["grad_norm"] > RESOLVED_SIGMAS * cell["grad_norm_noise"])


def _estimates(gram: dict[str, Tensor], w: Tensor) -> dict[str, float]:
    """Norms and cosine of the w-weighted means, from Gram matrices: ‖Σ w_k x_k‖² = wᵀ X Xᵀ w."""
    gg = float(w @ gram["gg"] @ w)
    dd = float(w @ gram["dd"] @ w)
    gd = float(w @ gram["gd"] @ w)
    mu_sq = gg + 2.0 * gd + dd  # ‖mean(g + d)‖²
    grad, bias = math.sqrt(max(gg, 0.0)), math.sqrt(max(dd, 0.0))
    cosine = (gg + gd) / math.sqrt(gg * mu_sq) if gg > 0 and mu_sq > 0 else math.nan
    return {"grad_norm": grad, "bias_abs": bias, "bias_ratio": bias / grad if grad > 0 else math.nan,
            "cosine": cosine}


def _percentiles(values: list[float]) -> list[float | None]:
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < len(values) * 0.95:
        return [None, None]
    n = len(finite)
    return [finite[int(0.025 * (n - 1))], finite[int(0.975 * (n - 1))]]


# ----------------------------------------------------------------------------- the growth with T


def fit_growth(cells: list[dict[str, Any]], key: str = "bias_ratio") -> dict[str, Any]:
    """Exponent β of ``key`` ∝ T^β over cells of one source (T = the mismatched batches' mean response length):
    least squares in log-log, with a 95% interval from the cells' own bootstrap intervals (each cell's log value
    drawn from a normal matching its interval; ``BOOTSTRAP`` draws). Says which of 1, 1.5, 2 the interval holds.
    Cells whose bias is not resolved (``RESOLVED_SIGMAS``) are left out and listed."""
    unresolved = [c for c in cells if "bias_abs_noise" in c and not resolved(c)]
    pts = [(c["horizon_mean"], c[key], c.get(f"{key}_ci")) for c in cells
           if _positive(c.get("horizon_mean")) and _positive(c.get(key)) and c not in unresolved]
    out: dict[str, Any] = {"metric": key, "exponent": None, "ci_low": None, "ci_high": None, "horizons": len(pts),
                           "unresolved_horizons": [c.get("horizon") for c in unresolved]}
    if len({round(t, 6) for t, _, _ in pts}) < 2:
        return {**out, "status": "insufficient",
                "note": f"{len(pts)} horizon(s) with a resolved positive {key} ({len(unresolved)} below the noise "
                        "floor): an exponent needs at least two"}
    xs = [math.log(t) for t, _, _ in pts]
    beta = _slope(xs, [math.log(v) for _, v, _ in pts])
    if any(not (ci and _positive(ci[0]) and _positive(ci[1])) for _, _, ci in pts):
        return {**out, "status": "fitted", "exponent": beta, "holds": [],
                "note": f"{key} ∝ T^{beta:.2f} over {len(pts)} horizons, no interval: the cells carry no bootstrap "
                        f"interval for {key}"}
    rng = random.Random(BOOTSTRAP_SEED)
    draws = []
    for _ in range(BOOTSTRAP):
        ys = []
        for _, v, ci in pts:
            sd = (math.log(ci[1]) - math.log(ci[0])) / 3.92
            ys.append(math.log(v) + rng.gauss(0.0, sd))
        draws.append(_slope(xs, ys))
    low, high = _percentiles(draws)
    held = [p for p in (1.0, 1.5, 2.0) if low is not None and low <= p <= high]
    span = f"T = {min(t for t, _, _ in pts):.0f} .. {max(t for t, _, _ in pts):.0f}"
    note = (f"{key} ∝ T^{beta:.2f} [{low:.2f}, {high:.2f}] over {len(pts)} horizons ({span}); the interval holds "
            + (", ".join(f"T^{p:g}" for p in held) if held else "none of T, T^1.5, T^2"))
    return {**out, "status": "fitted", "exponent": beta, "ci_low": low, "ci_high": high,
            "holds": [f"T^{p:g}" for p in held], "note": note}


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# ----------------------------------------------------------------------------- noise against bias

SPLIT_BLOCKS = (1, 2, 4, 8)
"""Batch counts n of the block-mean check of ``noise_bias_split`` (those with at least two disjoint blocks)."""


def noise_bias_split(d: Tensor) -> dict[str, Any]:
    """Split the gradient deviation of K batches into the part that averages out with more samples (noise) and the
    part that does not (bias).

    ``d`` [K, P]: per-batch gradient deviations d_k = g_μ,k − g_π,k (common random numbers), independent draws of
    one distribution with mean b (the bias: E g_μ − E g_π) and covariance Σ. The deviation of the mean gradient over
    n batches then has ``E ‖mean_n d‖² = ‖b‖² + tr Σ / n`` -- d(N)² = b² + s²/N with N = n batches and s² = tr Σ
    the spread of one batch's deviation. The estimator is the pair of moments that is unbiased for the two terms
    from all K batches at once:

    - ``noise_sq`` = tr S, S the sample covariance of the rows (divisor K − 1): unbiased for s² = tr Σ;
    - ``bias_sq`` = ‖mean d‖² − tr S / K: unbiased for ‖b‖² (it can come out negative when b is buried in noise).

    Chosen over fitting d(N)² at several N because it uses every pair of batches (a fit over block means uses only
    pairs inside a block, and its points share data); the fit is kept as a check that the noise really falls as
    1/N: ``by_count`` lists, for n in ``SPLIT_BLOCKS`` with at least two blocks, the mean of ‖block mean‖² over
    ⌊K/n⌋ disjoint blocks of n consecutive batches, and ``by_count_fit`` is the least-squares line D(n) = b² + s²/n
    through them (weights equal). ``crossover_batches`` = noise_sq / bias_sq is the batch count whose mean carries
    as much noise as bias: averaging more batches than that leaves the deviation mostly bias (None when bias_sq
    <= 0). Norms are in the gradient's units; divide by ‖E g_π‖ for ratios (``bias_statistics`` does)."""
    if d.dim() != 2 or d.shape[0] < 2:
        raise ValueError(f"noise_bias_split needs a [K, P] tensor with K >= 2 batches, got shape {tuple(d.shape)}")
    d = d.double()
    k = d.shape[0]
    gram = d @ d.T
    mean_sq = float(gram.sum()) / k ** 2
    noise_sq = (float(torch.diagonal(gram).sum()) - k * mean_sq) / (k - 1)
    bias_sq = mean_sq - noise_sq / k
    by_count = []
    for n in SPLIT_BLOCKS:
        blocks = k // n
        if blocks < 2:
            break
        sums = [float(gram[i * n:(i + 1) * n, i * n:(i + 1) * n].sum()) / n ** 2 for i in range(blocks)]
        by_count.append([n, sum(sums) / blocks])
    fit = None
    if len(by_count) >= 2:
        slope, intercept = _line([1.0 / n for n, _ in by_count], [v for _, v in by_count])
        fit = {"bias_sq": intercept, "noise_sq": slope}
    return {"batches": k, "bias_sq": bias_sq, "noise_sq": noise_sq,
            "crossover_batches": noise_sq / bias_sq if bias_sq > 0 else None,
            "by_count": by_count, "by_count_fit": fit}


def split_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """``noise_bias_split``'s two terms, relative to ‖E g_π‖, from a meter cell's stored statistics (cells written
    before the split was recorded carry what it needs: ``bias_abs`` = ‖mean d‖, ``bias_abs_noise`` = sqrt(tr S / K),
    ``grad_norm`` and ``grad_norm_noise`` likewise for g_π, ``batches`` = K). ``bias_ratio_debiased`` and
    ``noise_ratio`` (one batch's deviation spread over ‖E g_π‖, debiased) and ``crossover_batches``."""
    k = cell["batches"]
    noise_sq = cell["bias_abs_noise"] ** 2 * k
    bias_sq = cell["bias_abs"] ** 2 - cell["bias_abs_noise"] ** 2
    grad_sq = cell["grad_norm"] ** 2 - cell["grad_norm_noise"] ** 2
    ok = grad_sq > 0
    return {"bias_sq": bias_sq, "noise_sq": noise_sq, "grad_sq": grad_sq,
            "bias_ratio_debiased": math.sqrt(max(bias_sq, 0.0) / grad_sq) if ok else None,
            "noise_ratio": math.sqrt(noise_sq / grad_sq) if ok else None,
            "crossover_batches": noise_sq / bias_sq if bias_sq > 0 else None}


def noise_bias_table(result: dict[str, Any]) -> str:
    """The meter's cells split into bias and noise (``split_cell``) as a Markdown table: ‖E d‖ (debiased) and one
    batch's noise sqrt(tr Cov d) in gradient units, the crossover batch count, the 1/N check where the cell kept it
    (``noise_bias.by_count_fit``), and both parts over ‖E g_π‖ only where that norm is resolved (above twice its
    noise; else the ratios are mostly the denominator's noise). Then per source the growth of each part with T
    (log-log slope over the horizons where the part is positive; no interval)."""
    lines = ["| L | T | source | realised k3 | bias ‖E d‖ | noise per batch | crossover (batches) | "
             "1/N check: bias, noise | bias ratio | noise ratio |",
             "|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|"]
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for c in result["cells"]:
        s = split_cell(c)
        bias, noise = math.sqrt(max(s["bias_sq"], 0.0)), math.sqrt(max(s["noise_sq"], 0.0))
        rows.setdefault(c["source"], []).append((c["horizon_mean"], bias, noise))
        fit = (c.get("noise_bias") or {}).get("by_count_fit")
        check = (f"{math.sqrt(max(fit['bias_sq'], 0.0)):.3g}, {math.sqrt(max(fit['noise_sq'], 0.0)):.3g}"
                 if fit else "—")
        signal = c["grad_norm"] > RESOLVED_SIGMAS * c["grad_norm_noise"]
        lines.append(f"| {c['horizon']} | {c['horizon_mean']:.1f} | {c['source']} | {c['k3_kl']:.2e} | {bias:.3g} | "
                     f"{noise:.3g} | {_num(s['crossover_batches'])} | {check} | "
                     f"{_num(s['bias_ratio_debiased'] if signal else None)} | "
                     f"{_num(s['noise_ratio'] if signal else None)} |")
    lines.append("")
    for source, pts in rows.items():
        parts = []
        for i, name in ((1, "bias"), (2, "noise")):
            xy = [(math.log(p[0]), math.log(p[i])) for p in pts if _positive(p[i]) and _positive(p[0])]
            parts.append(f"{name} ∝ T^{_slope([x for x, _ in xy], [y for _, y in xy]):.2f}"
                         if len({x for x, _ in xy}) >= 2 else f"{name}: fewer than two horizons")
        lines.append(f"- {source}: " + ", ".join(parts) + f" ({len(pts)} horizons, no interval)")
    return "\n".join(lines) + "\n"


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g}"


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


# ----------------------------------------------------------------------------- meter files and the grid


@dataclass
class MeterSpec:
    name: str
    base: dict[str, Any]
    horizons: list[int]
    batches: int
    common: dict[str, Any]
    sources: dict[str, dict[str, Any]]
    output_dir: Path


def load_meter_spec(path: str | Path, output_dir: str | Path | None = None) -> MeterSpec:
    """Read and check a meter file (one error line naming the file and key on bad input)."""
    path = Path(path)
    spec = read_yaml(path, "meter file")  # missing, a directory, binary: one error naming it
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a mapping with keys {sorted(SPEC_KEYS)}")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; expected {sorted(SPEC_KEYS)}")
    for key in ("name", "base", "horizons", "sources"):
        if key not in spec:
            raise ValueError(f"{path}: '{key}' is missing")
    horizons = spec["horizons"]
    if not isinstance(horizons, list) or not horizons or not all(isinstance(h, int) and not isinstance(h, bool)
                                                                 and h >= 1 for h in horizons):
        raise ValueError(f"{path}: 'horizons' must be a non-empty list of positive integers, got {horizons!r}")
    twice = sorted({h for h in horizons if horizons.count(h) > 1})
    if twice:  # one cell per (horizon, source): a second would be the same measurement, counted twice by the fit
        raise ValueError(f"{path}: 'horizons' must not repeat a horizon, got {', '.join(map(str, twice))} more than "
                         f"once in {horizons!r}")
    batches = spec.get("batches", 16)
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 2:
        raise ValueError(f"{path}: 'batches' must be an integer >= 2, got {batches!r}")
    sources = spec["sources"]
    if not isinstance(sources, dict) or not sources or not all(isinstance(v, dict) for v in sources.values()):
        raise ValueError(f"{path}: 'sources' must map names to mappings of dotted inject keys")
    common = spec.get("set") or {}
    if not isinstance(common, dict):
        raise ValueError(f"{path}: 'set' must be a mapping of dotted config keys")
    base_path = path.parent / str(spec["base"])
    base = read_yaml(base_path, "base config") if base_path.is_file() else None
    if not isinstance(base, dict):
        raise ValueError(f"{path}: base config '{base_path}' not found or not a mapping")
    out = Path(output_dir or spec.get("output_dir") or Path("runs") / "meter" / str(spec["name"]))
    meter = MeterSpec(str(spec["name"]), base, list(horizons), batches, dict(common),
                      {str(k): dict(v) for k, v in sources.items()}, out)
    for h in meter.horizons:  # validate every cell's config before any work
        for name in meter.sources:
            cell_config(meter, h, name)
    return meter


def cell_config(spec: MeterSpec, horizon: int, source: str) -> RunConfig:
    """The run config of one cell: base + ``set`` + the horizon's task/rollout/model lengths + the source."""
    overrides = {**spec.common, **horizon_overrides(horizon), **spec.sources[source]}
    try:
        return config_from_dict(spec.base, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    except ConfigError as e:
        raise ValueError(f"meter {spec.name!r}, horizon {horizon}, source {source!r}: {e}") from None


def _decoded(cell: dict[str, Any]) -> dict[str, Any]:
    """A cell read back from meter.json: its NaN/Inf (json_safe's strings "nan", "inf": a cosine of a zero exact
    gradient, say) floats again, as a cell just measured has them; the source's name stays as written."""
    return {k: v if k == "source" else decode_non_finite(v) for k, v in cell.items()}


def run_meter(spec: MeterSpec, log: Any = print) -> dict[str, Any]:
    """Every (horizon, source) cell, ``meter.json`` rewritten after each (finished cells are skipped on a re-run),
    then the growth fits and ``meter.png``. Returns the meter.json object.

    The output directory is locked for the call (``run_lock``, as a sweep's): a second meter there -- which would
    rewrite meter.json without the first one's cells -- is refused with ``RunLocked`` naming the holder's pid.
    Finished cells measured with other ``batches`` are refused, naming both counts (they are never dropped)."""
    for horizon in spec.horizons:  # every cell's config and device checked before any work or file
        for source in spec.sources:
            cfg = cell_config(spec, horizon, source)
            try:
                resolve_device(cfg.device)
            except DeviceError as e:
                raise ValueError(f"meter {spec.name!r}, horizon {horizon}, source {source!r}: {e}") from None
    with run_lock(spec.output_dir, who=f"meter {spec.name!r}", again="a meter runs once at a time in its directory "
                  "(re-running the same command afterwards measures anything unfinished)"):
        return _run_locked(spec, log)


def _run_locked(spec: MeterSpec, log: Any) -> dict[str, Any]:
    path = spec.output_dir / "meter.json"
    done, recorded_sources = {}, {}
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
            cells = recorded.get("cells", [])
            done = {(c["horizon"], c["source"]): _decoded(c) for c in cells}
            # a cell written without its count: the file's (the meter writes both)
            measured_with = {c.get("batches", recorded.get("batches")) for c in cells}
            sources = recorded.get("sources")
            recorded_sources = sources if isinstance(sources, dict) else {}
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is damaged ({e}); move it away to start the meter afresh") from None
        other = sorted("unrecorded" if b is None else str(b) for b in measured_with - {spec.batches})
        if other:  # finished cells: never dropped (they were, silently), and never mixed with cells of another count
            raise ValueError(f"meter {spec.name!r}: batches {', '.join(other)} -> {spec.batches}: {path} holds cells "
                             f"measured with batches {', '.join(other)}, which do not mix with cells of "
                             f"{spec.batches}; move {path} away to measure afresh, or choose another output_dir")
    _check_done_cells(spec, done, recorded_sources, path)
    cells = list(done.values())
    for horizon in spec.horizons:
        todo = [s for s in spec.sources if (horizon, s) not in done]
        if not todo:
            continue
        base_cfg = cell_config(spec, horizon, todo[0])
        log(f"meter: L = {horizon}: {spec.batches} exact-path gradients")
        exact = exact_gradients(base_cfg, spec.batches)
        for source in todo:
            cfg = cell_config(spec, horizon, source)
            cell = measure_bias(cfg, spec.batches, exact)
            cell = {"horizon": horizon, "source": source, "config_hash": config_hash(cfg.to_dict()), **cell}
            log(f"meter: L = {horizon}, {source}: T = {cell['horizon_mean']:.1f}, k3 = {cell['k3_kl']:.2e}, "
                f"bias ratio = {cell['bias_ratio']:.3g} {_ci_text(cell['bias_ratio_ci'])}, "
                f"cosine = {cell['cosine']:.4f} ({cell['seconds']} s)")
            cells.append(cell)
            write_json_atomic(path, json_safe(_result(spec, cells)))
    result = _result(spec, cells)
    write_json_atomic(path, json_safe(result))
    try:
        plot_meter(result, spec.output_dir / "meter.png")
    except ImportError as e:
        log(f"plot skipped: {e}")
    return result


def _check_done_cells(spec: MeterSpec, done: dict[tuple, dict[str, Any]], recorded_sources: dict[str, Any],
                      path: Path) -> None:
    """A re-run skips the cells meter.json (``path``) holds: each must have been measured with the config its cell has
    now (its ``config_hash``; a cell written before the hash was kept: its source's settings, where the file records
    them in ``recorded_sources``), or the edited meter file or base config would be reported with the old cells'
    numbers."""
    for (horizon, source), cell in done.items():
        if source not in spec.sources or horizon not in spec.horizons:
            continue  # a cell the meter file no longer asks for: kept in meter.json, not measured again
        recorded = cell.get("config_hash")
        same = (recorded == config_hash(cell_config(spec, horizon, source).to_dict()) if recorded is not None
                else recorded_sources.get(source, spec.sources[source]) == spec.sources[source])
        if not same:
            raise ValueError(f"meter {spec.name!r}: {path} holds the cell L = {horizon}, source {source!r} measured "
                             "with another config (the meter file or its base config changed since); move it away "
                             "to measure afresh, or choose another output_dir")


def _result(spec: MeterSpec, cells: list[dict[str, Any]]) -> dict[str, Any]:
    order = {(h, s): i for i, (h, s) in enumerate((h, s) for h in spec.horizons for s in spec.sources)}
    cells = sorted(cells, key=lambda c: order.get((c["horizon"], c["source"]), len(order)))
    for c in cells:  # one definition of "resolved", also for cells written by an earlier version
        if "bias_abs_noise" in c:
            c["resolved"] = resolved(c)
    fits = {s: {"bias_ratio": fit_growth([c for c in cells if c["source"] == s]),
                "bias_abs": fit_growth([c for c in cells if c["source"] == s], "bias_abs")}
            for s in spec.sources}
    return {"name": spec.name, "batches": spec.batches, "horizons": spec.horizons, "sources": spec.sources,
            "definition": "bias_ratio = ||mean(g_mu - g_pi)|| / ||mean(g_pi)|| over batches with common random "
                          "numbers; T = mean response length of the mismatched rollouts",
            "cells": cells, "growth": fits}


def _ci_text(ci: list[float | None]) -> str:
    return "[?]" if ci[0] is None else f"[{ci[0]:.3g}, {ci[1]:.3g}]"


def plot_meter(result: dict[str, Any], path: Path) -> Path:
    """``meter.png``: bias ratio (with its interval) against T, one line per source, log-log; and cosine vs T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("tab10")
    for i, source in enumerate(result["sources"]):
        cells = [c for c in result["cells"] if c["source"] == source and _positive(c.get("bias_ratio"))]
        if not cells:
            continue
        ts = [c["horizon_mean"] for c in cells]
        fit = result["growth"][source]["bias_ratio"]
        label = source + (f" (β = {fit['exponent']:.2f} [{fit['ci_low']:.2f}, {fit['ci_high']:.2f}])"
                          if fit["status"] == "fitted" and fit["ci_low"] is not None else "")
        # a bootstrap percentile interval of a biased estimator can lie beside its point estimate: clip at 0
        lo = [max(c["bias_ratio"] - (c["bias_ratio_ci"][0] or c["bias_ratio"]), 0.0) for c in cells]
        hi = [max((c["bias_ratio_ci"][1] or c["bias_ratio"]) - c["bias_ratio"], 0.0) for c in cells]
        ax.errorbar(ts, [c["bias_ratio"] for c in cells], yerr=[lo, hi], color=cmap(i % 10), marker="o",
                    capsize=3, label=label)
        weak = [c for c in cells if not resolved(c)]  # hollow: below the noise floor (an upper bound)
        ax.scatter([c["horizon_mean"] for c in weak], [c["bias_ratio"] for c in weak], s=36, zorder=3,
                   facecolors="white", edgecolors=cmap(i % 10))
        bx.plot(ts, [c["cosine"] for c in cells], color=cmap(i % 10), marker="o", label=source)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("horizon T (mean response length)")
    ax.set_ylabel("||E g_mu - E g_pi|| / ||E g_pi||")
    ax.set_title(f"{result['name']}: gradient bias vs horizon\n({result['batches']} batches, 95% bootstrap; "
                 "hollow = not resolved)", fontsize=10)
    ax.legend(fontsize=7)
    bx.set_xscale("log")
    bx.set_xlabel("horizon T (mean response length)")
    bx.set_ylabel("cosine(E g_mu, E g_pi)")
    bx.set_title("direction")
    for a in (ax, bx):
        a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:  # published whole, as meter.json: no half image, the old one kept on failure
        publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: Any) -> None:
    """``vexact meter`` arguments (the CLI calls this)."""
    parser.add_argument("spec", type=Path, metavar="METER_FILE", help="meter YAML: base config, horizons, sources")
    parser.add_argument("--output-dir", type=Path, default=None, help="override the meter file's output_dir")


def meter_table(result: dict[str, Any]) -> str:
    """The cells as a Markdown table, then one line per source with its growth fit."""
    tail = any("tail_mass_mean" in c for c in result["cells"])  # a vocabulary tail: two more columns
    head = ("| L | T | source | realised k3 | bias ratio [95%] | debiased | resolved | cosine [95%] | "
            "reward (exact) |" + (" tail mass μ (exact) | tail tokens |" if tail else ""))
    lines = [head, "|---:|---:|:---|---:|---:|---:|:---|---:|---:|" + ("---:|---:|" if tail else "")]
    for c in result["cells"]:
        cos_ci = c["cosine_ci"]
        cos = f"{c['cosine']:.4f}" + (f" [{cos_ci[0]:.4f}, {cos_ci[1]:.4f}]" if cos_ci[0] is not None else "")
        deb = "—" if c["bias_ratio_debiased"] is None else f"{c['bias_ratio_debiased']:.3g}"
        lines.append(f"| {c['horizon']} | {c['horizon_mean']:.1f} | {c['source']} | {c['k3_kl']:.2e} | "
                     f"{c['bias_ratio']:.3g} {_ci_text(c['bias_ratio_ci'])} | {deb} | "
                     f"{'yes' if resolved(c) else 'no'} | {cos} | {c['reward_mean_exact']:.2f} |"
                     + (_tail_cells(c) if tail else ""))
    lines.append("")
    for source, fits in result["growth"].items():
        lines.append(f"- {source}: {fits['bias_ratio']['note']}")
    return "\n".join(lines) + "\n"


def _tail_cells(c: dict[str, Any]) -> str:
    if "tail_mass_mean" not in c:
        return " — | — |"
    return (f" {c['tail_mass_mean']:.2e} ({c.get('tail_mass_mean_exact', math.nan):.2e}) | "
            f"{c['tail_token_frac']:.2e} |")


def main(args: Any) -> int:
    spec = load_meter_spec(args.spec, args.output_dir)
    if getattr(args, "device", None):  # --device X: every cell's config gets device: X
        resolve_device(args.device, "--device")  # no CUDA for --device cuda: one error before any work
        spec.common["device"] = args.device
    result = run_meter(spec)
    print(meter_table(result), end="")
    print(f"meter written to {spec.output_dir}: meter.json, meter.png")
    return 0


def _main(argv: list[str] | None = None) -> int:
    """``python -m vexact.sweeps.bias_meter noise-bias METER_JSON``: the noise / bias table of a meter's cells."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m vexact.sweeps.bias_meter", description=(
        "noise-bias: split each meter cell's gradient deviation into bias (does not average out) and noise "
        "(falls as 1/N with N batches), from meter.json"))
    sub = parser.add_subparsers(dest="command", required=True)
    split = sub.add_parser("noise-bias", help="print the noise / bias table of a meter.json")
    split.add_argument("meter", type=Path, metavar="METER_JSON")
    args = parser.parse_args(argv)
    try:
        text = read_text_file(args.meter, f"meter file '{args.meter}'")  # missing, a directory, binary
        try:
            result = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"'{args.meter}' is not valid JSON: {err}") from None
        needed = ("horizon", "source", "batches", "bias_abs", "bias_abs_noise", "grad_norm", "grad_norm_noise",
                  "horizon_mean", "k3_kl")
        cells = result.get("cells") if isinstance(result, dict) else None
        if not isinstance(cells, list) or not cells or not all(isinstance(c, dict) and all(k in c for k in needed)
                                                               for c in cells):
            raise ValueError(f"'{args.meter}' is not a vexact meter result: expected 'cells' each with "
                             f"{', '.join(needed)}")
        print(noise_bias_table(result), end="")
        return 0
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(_main())
