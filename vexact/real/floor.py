"""``vexact compare --floor``: the stack's own noise floor, and whether the user's k3 stands above it.

The floor is k3 between two scorings of the same tokens by the same trainer in two batch arrangements (another
batch size, another order, another padding): k3_floor = token mean of e^f − f − 1, f_t = logp_train − logp_train2.
It is what the trainer alone moves a log-prob by, with no rollout engine involved; a k3 between rollout and trainer
of that size says nothing about the engine. On a batch-invariant trainer (vexact's exact backend) the two scorings
are bitwise equal and the floor is exactly 0.

The rule (``FLOOR_RULE``): a paired bootstrap over sequences. Each of ``FLOOR_RESAMPLES`` resamples draws the
sequences with replacement (a fixed seed: the same dumps give the same verdict) and takes, on the same draw, the
difference d = k3 − k3_floor (token means over the drawn sequences). The k3 is distinguishable from the floor when
the ``FLOOR_QUANTILE`` quantile of d is above 0: one-sided, 95%. Why this rule: a k3 is a token mean that a few
tokens can dominate, and the tokens of one sequence are not independent (one context, one sampled path), so the
sequence is the unit resampled; both k3 are taken on the same tokens, so pairing them on one draw cancels the
variation they share; and a fixed ratio (say 2×) would call a k3 twice the floor distinguishable on one sequence as
on a million. When the floor is exactly 0 the verdict needs no bootstrap: any k3 > 0 is above it, and a k3 of
exactly 0 equals it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..rl.metrics import k3_terms

FLOOR_RESAMPLES = 1000
FLOOR_QUANTILE = 0.05
FLOOR_SEED = 0
FLOOR_RULE = (f"paired bootstrap over sequences ({FLOOR_RESAMPLES} resamples, seed {FLOOR_SEED}): distinguishable "
              f"when the {FLOOR_QUANTILE:g}-quantile of k3 − k3_floor is above 0 (one-sided 95%); a floor of "
              "exactly 0 makes any k3 > 0 distinguishable")
_CHUNK = 64  # resamples drawn at once: bounds the [chunk, S] index tensor


def _k3_terms(a: Tensor, b: Tensor) -> Tensor:
    return k3_terms(a.double() - b.double())


def floor_verdict(train: Tensor, roll: Tensor, floor: Tensor, lengths: list[int], floor_path: Path | str
                  ) -> dict[str, Any]:
    """The ``floor`` object of compare's summary. ``train`` / ``roll`` / ``floor``: flat per-token log-probs of the
    same tokens (sequences concatenated, ``lengths`` tokens each): the trainer's, the rollout's, and the trainer's
    in the second batch arrangement."""
    user_terms, floor_terms = _k3_terms(train, roll), _k3_terms(train, floor)
    n = sum(lengths)
    k3, k3_floor = float(user_terms.mean()), float(floor_terms.mean())  # as mismatch_metrics takes k3
    out: dict[str, Any] = {"dump": str(floor_path), "k3": k3, "k3_floor": k3_floor,
                           "bitwise_equal_frac": int((train == floor).sum()) / n,
                           "ratio": k3 / k3_floor if k3_floor > 0 else None,  # no multiple of a zero floor
                           "rule": FLOOR_RULE}
    if k3_floor <= 0:  # (k3 terms are never below 0: a floor of 0 exactly)
        out.update(distinguishable=k3 > 0, d_quantile=None)
    else:
        out["d_quantile"] = _bootstrap_quantile(user_terms, floor_terms, lengths)
        out["distinguishable"] = out["d_quantile"] > 0
    out["verdict"] = floor_text(out)
    return out


def _bootstrap_quantile(user_terms: Tensor, floor_terms: Tensor, lengths: list[int]) -> float:
    """The ``FLOOR_QUANTILE`` quantile over resamples of sequences of (Σ user − Σ floor) / Σ tokens."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    per_seq_d = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq, user_terms - floor_terms)
    per_seq_n = torch.tensor(lengths, dtype=torch.float64)
    gen = torch.Generator().manual_seed(FLOOR_SEED)
    draws = []
    for start in range(0, FLOOR_RESAMPLES, _CHUNK):
        idx = torch.randint(len(lengths), (min(_CHUNK, FLOOR_RESAMPLES - start), len(lengths)), generator=gen)
        tokens = per_seq_n[idx].sum(1)
        draws.append(per_seq_d[idx].sum(1) / tokens.clamp(min=1))  # a draw of empty sequences only: d = 0
    return float(torch.quantile(torch.cat(draws), FLOOR_QUANTILE))


def floor_text(v: dict[str, Any]) -> str:
    """The report's line: ``your k3 X is N× the floor Y: distinguishable ...`` or ``... indistinguishable ...``."""
    head = f"floor ({v['dump']}): k3 between the two training scorings = {v['k3_floor']:.3g}"
    if v["k3_floor"] <= 0:
        why = ("bitwise equal: the trainer is batch-invariant" if v["bitwise_equal_frac"] == 1 else
               f"{1 - v['bitwise_equal_frac']:.3g} of the tokens differ, by too little to move k3 off 0")
        if v["distinguishable"]:
            return (f"{head} ({why}); your k3 {v['k3']:.3g} is above it: distinguishable from the floor")
        return f"{head} ({why}); your k3 is 0 too: indistinguishable from the floor"
    ratio = f"{v['ratio']:.3g}× the floor"
    rule = f"the {FLOOR_QUANTILE:g}-quantile of k3 − k3_floor over {FLOOR_RESAMPLES} sequence resamples is " \
           f"{v['d_quantile']:.3g}"
    if v["distinguishable"]:
        return f"{head}; your k3 {v['k3']:.3g} is {ratio}: distinguishable from the floor ({rule} > 0)"
    return f"{head}; your k3 {v['k3']:.3g} ({ratio}) is indistinguishable from the floor ({rule} ≤ 0)"
