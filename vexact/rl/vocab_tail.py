"""A vocabulary tail: distractor tokens the policy learns to avoid (``task.distractors``).

Real vocabularies hold 50k–150k tokens, and most of them are, at any position, very unlikely: a long tail of small
probabilities. Mismatch lives there too (a flatter or noisier rollout distribution moves mass into the tail, and
a token sampled from the tail has a log-prob the two paths may disagree on by a lot). vexact's character vocabulary
has 22 tokens, all of them used by some task, so it has no such tail. ``task.distractors: N`` adds one:

- **N distractor ids** ``22 .. 22 + N - 1`` after the character vocabulary (``TailTokenizer``), so the model's
  vocabulary is 22 + N (N = 1002: V = 1024). They never occur in a prompt or a target, so the supervised warm start
  pushes their logits down through the softmax (every target token's cross-entropy gradient lowers all the other
  logits): the warm-started policy puts a small but non-zero mass on each of them. That is the tail.
- **A distractor is no character.** It decodes to ``NO_CHARACTER`` (U+FFFD, the replacement character, which no
  task's text contains), and a response holding one before its EOS earns reward 0.0 (``Task.reward``, also with
  partial credit, and also in a free scratchpad): the response is malformed, as a real one with a garbage token
  would be. Ids beyond the vocabulary still raise ``ValueError``.
- **The tail's mass is measured**, not assumed: ``TailProbe`` wraps the rollout's logits hook and records, for every
  generated token, the probability the rollout distribution μ (the logits actually sampled from, after any
  injected mismatch and the temperature) gives the distractors together. ``tail_metrics`` turns that into the
  ``tail/*`` metric keys a run logs each step and ``vexact meter`` reports per cell.

``task.distractors: 0`` (the default) is the character vocabulary itself: no new id, no probe, no new metric key,
and the warm-start cache key of every existing config is unchanged, so every existing run keeps its bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..metric_keys import TAIL_MASS_MAX, TAIL_MASS_MEAN, TAIL_RESPONSE_FRAC, TAIL_TOKEN_FRAC
from .vocab import (  # the tail's tokenizer lives with the character vocabulary; named here too
    CHAR_VOCAB_SIZE,
    MAX_DISTRACTORS,
    NO_CHARACTER,
    CharTokenizer,
    TailTokenizer,
    check_distractors,
    tokenizer_for,
)

__all__ = ["MAX_DISTRACTORS", "NO_CHARACTER", "TailProbe", "TailTokenizer", "check_distractors", "tail_metrics",
           "tail_probe", "tokenizer_for"]

Hook = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


class TailProbe:
    """A logits hook that records the distractors' total probability under the distribution sampled from.

    It calls the rollout's own hook (``inner``, or none) and returns what that returns, unchanged, so sampling and
    the recorded log-probs are those of the unprobed rollout; it only reads ``sample_logits``. The mass at each
    (sequence, position) is exp(logsumexp(tail) − logsumexp(all)), computed in float64 so that a tail mass of
    1e-12 is not lost to the rounding of 1 − (head mass)."""

    def __init__(self, inner: Hook | None, first_tail_id: int, rows: int, max_new_tokens: int, first_index: int):
        self.inner = inner
        self.first_tail_id = first_tail_id
        self.first_index = first_index
        self.mass = torch.zeros(rows, max_new_tokens, dtype=torch.float64)

    def __call__(self, logits: Tensor, sequence_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        sample, record = (logits, logits) if self.inner is None else self.inner(logits, sequence_ids, positions)
        wide = sample.detach().to(torch.float64)
        log_mass = torch.logsumexp(wide[:, self.first_tail_id:], dim=-1) - torch.logsumexp(wide, dim=-1)
        rows = (sequence_ids - self.first_index).to(self.mass.device)
        self.mass[rows, positions.to(self.mass.device)] = log_mass.exp().to(self.mass.device)
        return sample, record

    def per_sequence(self, responses: list[list[int]]) -> list[Tensor]:
        """Each response's per-token tail mass (float64, one value per generated token, EOS included)."""
        return [self.mass[i, : len(r)].clone() for i, r in enumerate(responses)]


def tail_probe(tokenizer: CharTokenizer, inner: Hook | None, rows: int, max_new_tokens: int, first_index: int
               ) -> tuple[Hook | None, TailProbe | None]:
    """The logits hook a rollout should use, and the probe in it: ``(inner, None)`` when the vocabulary has no
    tail (so a run without distractors samples exactly as before), else a ``TailProbe`` around ``inner``."""
    if not isinstance(tokenizer, TailTokenizer) or tokenizer.distractors == 0:
        return inner, None
    probe = TailProbe(inner, tokenizer.first_distractor, rows, max_new_tokens, first_index)
    return probe, probe


def tail_metrics(tail_mass: list[Tensor], responses: list[list[int]], first_tail_id: int = CHAR_VOCAB_SIZE
                 ) -> dict[str, float]:
    """The ``tail/*`` keys of one rollout batch:

    - ``tail/mass_mean``: token mean over the generated tokens of μ(distractors), the probability the rollout
      distribution put on the tail at that position;
    - ``tail/mass_max``: its largest value at one position;
    - ``tail/token_frac``: fraction of generated tokens that are distractors (what the mass turned into);
    - ``tail/response_frac``: fraction of responses holding a distractor (each of them earned reward 0)."""
    if len(tail_mass) != len(responses):
        raise ValueError(f"{len(tail_mass)} tail-mass rows for {len(responses)} responses")
    flat = torch.cat([m.reshape(-1).to(torch.float64) for m in tail_mass]) if tail_mass else torch.zeros(0)
    tokens = [t for r in responses for t in r]
    if flat.numel() != len(tokens):
        raise ValueError(f"{flat.numel()} tail-mass values for {len(tokens)} generated tokens")
    if not tokens:
        return {TAIL_MASS_MEAN: 0.0, TAIL_MASS_MAX: 0.0, TAIL_TOKEN_FRAC: 0.0, TAIL_RESPONSE_FRAC: 0.0}
    return {
        TAIL_MASS_MEAN: float(flat.mean()),
        TAIL_MASS_MAX: float(flat.max()),
        TAIL_TOKEN_FRAC: sum(t >= first_tail_id for t in tokens) / len(tokens),
        TAIL_RESPONSE_FRAC: sum(any(t >= first_tail_id for t in r) for r in responses) / len(responses),
    }
