"""Test helpers for *your* rollout engine and trainer: is rollout log-prob == training log-prob, bit for bit?

Functions usable from any test framework (this module never imports pytest; the pytest fixture ``vexact_exact``
of ``vexact.pytest_plugin`` hands out the same ones):

``assert_logprobs_equal(rollout, train, *, tokens=None, mask=None)``
    Compares the bit patterns of two sets of per-token log-probs and raises ``AssertionError`` with a report
    when any differ: how many tokens of how many, the first mismatch (sequence, position, token, both values
    with their stored bits in hex), max |Δ| and the k3 KL estimate. Returns None when every token is
    bitwise equal.

``check_paths(generate_fn, score_fn, prompts, ...)``
    Runs your generate function in several batch arrangements and your scoring function in several
    micro-batch arrangements (the matrix of ``vexact check``) and asserts that everything agrees bitwise.

``record_sites(model, sequences, kind=...)`` and ``assert_sites_equal(engine, trainer)``
    Where two forwards part: ``record_sites`` records every named site of a forward (embed, per layer the
    norms, projections, attention and MLP, final norm, logits -- ``vexact locate``'s sites) of a vexact model or a
    transformers model; ``assert_sites_equal`` takes two recordings, two ``vexact locate --dump`` directories or
    callables returning either, and raises ``AssertionError`` naming the first divergent site (sequence,
    position, feature, both values and bits) and |Δ| site by site. A certified zero-mismatch switch in CI.
    ``record_vllm_sites(model_dir, sequences, ...)`` records vLLM's forward (its CPU build) at the same sites.

Bitwise means bit patterns: ``-0.0`` and ``0.0`` differ, and two NaNs are equal exactly when their bits
are (NaNs and infinities are counted in the report). Tensors are compared in the dtype they come in; the
two sides must share one floating dtype (float16, bfloat16, float32 or float64), since values of two
dtypes can never be bitwise equal -- cast one side yourself if you want values compared.

Errors: ``ValueError`` means the inputs cannot be compared (lengths, shapes, dtypes, a mask that does not
fit, a callable that broke its contract) and names the sequence or arrangement; ``AssertionError`` means
they were compared and differ.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .engine.inputs import check_token_lists, tensor_from_numpy
from .real.check import DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES  # the arrangements vexact check uses
from .real.compare import Mismatch  # one class for both: compare reports its first mismatch too
from .real.sites import Sites
from .rl.metrics import BITS_VIEW, float_bits, mismatch_summary

__all__ = ["LogprobComparison", "Mismatch", "Sites", "assert_logprobs_equal", "assert_sites_equal", "check_paths",
           "compare_logprobs", "float_bits", "record_sites", "record_vllm_sites"]

_DTYPE_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}
_MAX_SEQUENCES_LISTED = 8  # the "mismatched tokens by sequence" line stops after this many
_MAX_FAILURES_DETAILED = 6  # check_paths reports this many failed checks in full, the rest in one line each


# --------------------------------------------------------------------------- bits and values as text
def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# --------------------------------------------------------------------------- inputs -> one tensor per sequence
@dataclass
class _Sequences:
    """Log-probs (or token ids) as one 1-D CPU tensor per sequence; ``columns[i]`` are the columns the tokens
    of sequence i came from when the input was a padded [B, T] tensor (None for a list)."""

    items: list[Tensor]
    columns: list[Tensor] | None = None


def _as_tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().cpu()
    if hasattr(x, "__array__") and not isinstance(x, (list, tuple)):  # numpy arrays keep their dtype
        return tensor_from_numpy(x, what)
    if isinstance(x, (list, tuple)):
        try:  # plain Python numbers are float64 (that is what they are)
            return torch.tensor(x, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{what} must be a 1-D tensor, array or list of numbers") from None
    raise ValueError(f"{what} must be a tensor, an array or a list, got {type(x).__name__}")


def _mask_tensor(mask: Any, shape: torch.Size, name: str) -> Tensor:
    if isinstance(mask, (list, tuple)):
        try:  # keep bools and ints as they are (_as_tensor would make Python numbers float64)
            mask = torch.tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("mask must be a [B, T] tensor, array or nested list of bools or 0/1") from None
    m = _as_tensor(mask, "mask")
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(m.shape)} but {name} has shape {tuple(shape)}")
    if m.dtype != torch.bool:
        if m.is_floating_point() or m.is_complex():  # its values may well be 0/1: the dtype is what is refused
            raise ValueError(f"mask must be bool or 0/1 integers, got dtype {m.dtype} (for a 0/1 float mask pass "
                             "mask.bool())")
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError(f"mask must be bool or 0/1 integers, got {m.dtype} values other than 0 and 1")
        m = m.bool()
    return m


def _is_padded(x: Any) -> bool:
    """A [B, T] tensor or array (what ``mask`` applies to)."""
    return not isinstance(x, (list, tuple)) and getattr(x, "ndim", None) == 2


def _sequences(x: Any, name: str, mask: Any | None) -> _Sequences:
    """``x`` as one 1-D tensor per sequence: a list/tuple of 1-D tensors, arrays or lists; a padded [B, T]
    tensor/array (``mask`` picks each row's tokens; without one every position counts); a 1-D tensor/array is
    one sequence."""
    if isinstance(x, (list, tuple)):
        if mask is not None:
            raise ValueError(f"mask applies to a padded [B, T] tensor, but {name} is a list of sequences")
        items = []
        for i, item in enumerate(x):
            t = _as_tensor(item, f"{name} sequence {i}")
            if t.dim() != 1:
                raise ValueError(f"{name} sequence {i} must be 1-D, got shape {tuple(t.shape)}")
            items.append(t)
        return _Sequences(items)
    t = _as_tensor(x, name)
    if t.dim() == 1:
        if mask is not None:
            raise ValueError(f"mask applies to a padded [B, T] tensor, but {name} is 1-D")
        return _Sequences([t])
    if t.dim() != 2:
        raise ValueError(f"{name} must be a list of 1-D sequences or a padded [B, T] tensor, got shape "
                         f"{tuple(t.shape)}")
    m = torch.ones(t.shape, dtype=torch.bool) if mask is None else _mask_tensor(mask, t.shape, name)
    columns = [row.nonzero().flatten() for row in m]
    return _Sequences([t[b, cols] for b, cols in enumerate(columns)], columns)


def _token_lists(tokens: Any, mask: Any | None) -> list[list[int]]:
    seqs = _sequences(tokens, "tokens", mask)
    out = []
    for i, t in enumerate(seqs.items):
        if t.is_floating_point() and not bool((t == t.round()).all()):
            raise ValueError(f"tokens sequence {i} must hold integer token ids, got {t.dtype} values")
        out.append([int(v) for v in t.tolist()])
    return out


# --------------------------------------------------------------------------- the comparison
@dataclass(frozen=True)
class LogprobComparison:
    """What ``compare_logprobs`` found. ``equal``: every token bitwise equal. ``max_abs_diff`` and ``k3`` are
    float64 over the ``finite`` tokens whose two values are both finite (all of them, normally), with
    r = train - rollout: max |r| and mean(exp(r) - r - 1) (``vexact.rl.metrics.mismatch_summary``); NaN
    when no token is finite on both sides."""

    names: tuple[str, str]
    dtype: torch.dtype
    tokens: int
    mismatched: int
    first: Mismatch | None
    max_abs_diff: float
    k3: float
    finite: int
    nans: tuple[int, int]  # NaN values on each side (rollout, train)
    infs: tuple[int, int]  # ±inf values on each side
    mismatched_by_sequence: dict[int, int] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return self.mismatched == 0

    def message(self) -> str:
        """The report ``assert_logprobs_equal`` raises (one line when equal)."""
        dtype = _DTYPE_NAME[self.dtype]
        if self.equal:
            return f"log-probs are bitwise equal: {_count(self.tokens, 'token')} ({dtype})"
        lines = [f"log-probs are not bitwise equal: {self.mismatched} of {self.tokens} tokens mismatched ({dtype})"]
        if self.first is not None:
            lines.append("first mismatch: " + self.first.describe(self.names))
        over = f"the {_count(self.finite, 'token')}"
        if self.finite != self.tokens:
            over += " where both are finite"
        lines.append(f"max |Δ| = {self.max_abs_diff:.6g}, k3 = {self.k3:.6g} "
                     f"(float64 over {over}, r = {self.names[1]} - {self.names[0]})")
        if any(self.nans) or any(self.infs):
            lines.append(f"NaN: {self.nans[0]} {self.names[0]}, {self.nans[1]} {self.names[1]}; "
                         f"±inf: {self.infs[0]} {self.names[0]}, {self.infs[1]} {self.names[1]}")
        by_seq = list(self.mismatched_by_sequence.items())
        listed = ", ".join(f"{i}: {n}" for i, n in by_seq[:_MAX_SEQUENCES_LISTED])
        more = f", ... ({len(by_seq) - _MAX_SEQUENCES_LISTED} more sequences)" if len(by_seq) > _MAX_SEQUENCES_LISTED \
            else ""
        lines.append(f"mismatched tokens by sequence: {listed}{more}")
        return "\n".join(lines)


def compare_logprobs(rollout: Any, train: Any, *, tokens: Any | None = None, mask: Any | None = None,
                     names: tuple[str, str] = ("rollout", "training")) -> LogprobComparison:
    """Compare two sets of per-token log-probs bitwise and return the findings (never raises on a mismatch).

    ``rollout`` and ``train``: each a list of per-sequence 1-D tensors / numpy arrays / lists of floats (Python
    floats are float64), or a padded [B, T] tensor/array, or a 1-D tensor (one sequence). ``mask``: a [B, T] bool
    or 0/1 tensor/array selecting the real tokens of whichever argument is padded (both, if both are; without it
    every position counts). ``tokens``: optional token ids in the same layout (a list of lists, or [B, T] with the
    same mask), shown in the report. ``names`` label the two sides in the report.

    Raises ValueError naming the sequence when the inputs cannot be compared: different numbers of sequences or
    lengths, a dtype that is not float16/bfloat16/float32/float64, or two dtypes.
    """
    if not (isinstance(names, (tuple, list)) and len(names) == 2 and all(isinstance(n, str) for n in names)):
        raise ValueError(f"names must be two strings (the rollout side's, the training side's), got {names!r}")
    names = (names[0], names[1])
    padded = [x for x in (rollout, train, tokens) if _is_padded(x)]
    if mask is not None and not padded:
        raise ValueError("mask applies to a padded [B, T] tensor, but no argument is one")
    roll = _sequences(rollout, names[0], mask if _is_padded(rollout) else None)
    tr = _sequences(train, names[1], mask if _is_padded(train) else None)
    if len(roll.items) != len(tr.items):
        raise ValueError(f"{names[0]} has {len(roll.items)} sequences but {names[1]} has {len(tr.items)}")
    if not roll.items:
        raise ValueError("no sequences to compare")
    token_ids = _token_lists(tokens, mask if _is_padded(tokens) else None) if tokens is not None else None
    if token_ids is not None and len(token_ids) != len(roll.items):
        raise ValueError(f"tokens has {len(token_ids)} sequences but the log-probs have {len(roll.items)}")
    dtype = roll.items[0].dtype
    for i, (a, b) in enumerate(zip(roll.items, tr.items)):
        for side, t in ((names[0], a), (names[1], b)):
            if t.dtype not in BITS_VIEW:
                raise ValueError(f"sequence {i}: {side} log-probs are {t.dtype}; expected float16, bfloat16, "
                                 "float32 or float64")
            if t.dtype != dtype:
                raise ValueError(f"sequence {i}: {side} log-probs are {_DTYPE_NAME[t.dtype]}, {names[0]} sequence 0 "
                                 f"is {_DTYPE_NAME[dtype]}: values of two dtypes are never bitwise equal; cast one "
                                 "side (e.g. .float()) if you mean to compare values")
        if a.numel() != b.numel():
            raise ValueError(f"sequence {i}: {names[0]} has {a.numel()} log-probs but {names[1]} has {b.numel()}")
        if token_ids is not None and len(token_ids[i]) != a.numel():
            raise ValueError(f"sequence {i}: tokens has {len(token_ids[i])} ids but the log-probs have {a.numel()}")
    if not any(a.numel() for a in roll.items):  # equal, vacuously: a gate that asserts nothing (vexact compare too)
        raise ValueError("no tokens to compare: every sequence is empty")
    return _compare(roll, tr, token_ids, dtype, names)


def _compare(roll: _Sequences, tr: _Sequences, token_ids: list[list[int]] | None, dtype: torch.dtype,
             names: tuple[str, str]) -> LogprobComparison:
    lengths = [t.numel() for t in roll.items]
    flat_r, flat_t = torch.cat(roll.items), torch.cat(tr.items)
    differ = flat_r.view(BITS_VIEW[dtype]) != flat_t.view(BITS_VIEW[dtype])  # bit patterns, not ==
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    by_seq = torch.bincount(seq_of[differ], minlength=len(lengths))
    first = None
    if bool(differ.any()):
        k = int(differ.nonzero()[0])
        seq = int(seq_of[k])
        pos = k - sum(lengths[:seq])
        columns = roll.columns if roll.columns is not None else tr.columns
        first = Mismatch(seq, pos, int(columns[seq][pos]) if columns is not None else None,
                         token_ids[seq][pos] if token_ids is not None else None, flat_r[k], flat_t[k])
    finite_r, finite_t = torch.isfinite(flat_r), torch.isfinite(flat_t)
    both = finite_r & finite_t
    stats = mismatch_summary(flat_t[both], flat_r[both])  # float64, r = train - rollout
    return LogprobComparison(
        names=names, dtype=dtype, tokens=flat_r.numel(), mismatched=int(differ.sum()), first=first,
        max_abs_diff=stats["abs_dlogp_max"], k3=stats["k3_kl"], finite=int(both.sum()),
        nans=(int(flat_r.isnan().sum()), int(flat_t.isnan().sum())),
        infs=(int(flat_r.isinf().sum()), int(flat_t.isinf().sum())),
        mismatched_by_sequence={i: int(n) for i, n in enumerate(by_seq.tolist()) if n},
    )


def assert_logprobs_equal(rollout: Any, train: Any, *, tokens: Any | None = None, mask: Any | None = None) -> None:
    """Assert that rollout and training log-probs are bitwise equal, token by token; return None if they are.

    Inputs as in ``compare_logprobs``: lists of 1-D tensors (numpy arrays, lists of floats), or padded [B, T]
    tensors with ``mask=`` ([B, T], bool or 0/1) marking the real tokens; ``tokens`` (same layout) puts the token
    id into the report. Bit patterns are compared: -0.0 != 0.0, NaNs with the same bits are equal.

    Raises AssertionError when any token differs, with the count mismatched out of the total, the first mismatch
    (sequence, position, token, both values and their bits in hex, in the stored dtype), max |Δ| and k3 =
    mean(exp(r) - r - 1), r = train - rollout, in float64, and the mismatch count per sequence, e.g.::

        log-probs are not bitwise equal: 1 of 5 tokens mismatched (float32)
        first mismatch: sequence 1, position 0: rollout -1.0 (0xbf800000) vs training -0.5 (0xbf000000), Δ = 0.5
        max |Δ| = 0.5, k3 = 0.0297443 (float64 over the 5 tokens, r = training - rollout)
        mismatched tokens by sequence: 1: 1

    Raises ValueError (naming the sequence) when the two cannot be compared: a different number of sequences,
    different lengths, non-float or two different dtypes, a mask that does not fit.
    """
    __tracebackhide__ = True  # pytest then shows the caller's line, not this one (a plain local otherwise)
    result = compare_logprobs(rollout, train, tokens=tokens, mask=mask)
    if not result.equal:
        raise AssertionError(result.message())


# --------------------------------------------------------------------------- check_paths
GenerateFn = Callable[[list[list[int]], int | None], tuple[Sequence[Sequence[int]], Sequence[Any]]]
"""``generate_fn(prompts, batch_size) -> (tokens, logprobs)``; see ``check_paths``."""
ScoreFn = Callable[[list[list[int]], list[list[int]], int | None], Sequence[Any]]
"""``score_fn(prompts, responses, micro_batch_size) -> logprobs``; see ``check_paths``."""


@dataclass
class _Rollout:
    """One generation arrangement's output, in the order of the original prompts."""

    name: str
    tokens: list[list[int]]
    logprobs: list[Tensor]


def check_paths(generate_fn: GenerateFn, score_fn: ScoreFn, prompts: Sequence[Sequence[int]], *,
                batch_sizes: Sequence[int | None] = DEFAULT_BATCH_SIZES,
                micro_batch_sizes: Sequence[int | None] = DEFAULT_MICRO_BATCH_SIZES,
                permute: bool = False, threads: Sequence[int] = ()) -> dict[str, Any]:
    """Check your rollout path against your training path, and each against itself under other batchings.

    The callables (yours):

    * ``generate_fn(prompts, batch_size) -> (tokens, logprobs)``: sample a continuation of every prompt
      (``prompts`` is a list of token-id lists), ``batch_size`` prompts at a time (None: all at once).
      ``tokens[i]`` is prompt i's generated ids (a list of ints or a 1-D tensor), ``logprobs[i]`` the 1-D
      log-prob of each, as your rollout engine recorded them; both in the order of ``prompts``. Seed it
      yourself, the same way every call: the check calls it several times and expects the same samples.
    * ``score_fn(prompts, responses, micro_batch_size) -> logprobs``: your training path's log-prob of each
      response token given the prompt and the response before it (teacher forcing), ``micro_batch_size``
      sequences per forward (None: all at once); one 1-D tensor per sequence, in order.

    Generation arrangements: one per entry of ``batch_sizes`` (the first is the reference); with ``permute``,
    the prompts in a fixed shuffled order (``random.Random(0)``) at the last batch size, outputs put back in the
    original order -- this needs sampling that does not depend on a prompt's place in the call (greedy, or a
    per-prompt seed; vexact's own ``generate`` keys its sampler on the index, so use temperature 0 there);
    and one (all at once) per entry of ``threads`` (torch thread counts). Scoring arrangements: each
    ``micro_batch_sizes`` entry, and again under each ``threads`` count. The thread count is restored after.

    Asserted, bitwise: every generation arrangement's tokens equal the reference's, and (where the tokens
    agree) so do its rollout log-probs; and for every generation arrangement, every scoring arrangement's
    log-probs equal that arrangement's rollout log-probs. All checks run, then one AssertionError lists every
    failed one: which arrangement against which, and ``assert_logprobs_equal``'s report (first mismatch with
    bits, max |Δ|, k3) or the first differing token.

    Returns a report dict: ``prompts``, ``response_tokens`` (of the reference), ``generation`` and ``scoring``
    (the arrangement names), ``checks`` (comparisons made), ``tokens_compared`` and ``seconds``.
    Raises ValueError for bad arguments or when a callable returns the wrong number of sequences or lengths
    (naming the arrangement).
    """
    __tracebackhide__ = True  # see assert_logprobs_equal
    start = time.perf_counter()
    prompt_lists = check_token_lists("prompts", list(prompts), 2**63 - 1)
    if not batch_sizes or not micro_batch_sizes:
        raise ValueError("batch_sizes and micro_batch_sizes need at least one entry each (None = all at once)")
    for name, values in (("batch_sizes", batch_sizes), ("micro_batch_sizes", micro_batch_sizes)):
        if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1) for v in values):
            raise ValueError(f"{name} entries must be positive ints or None, got {tuple(values)}")
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in threads):
        raise ValueError(f"threads entries must be positive ints, got {tuple(threads)}")

    own_threads = torch.get_num_threads()
    try:
        rollouts = _generate_all(generate_fn, prompt_lists, batch_sizes, permute, threads)
        if not any(rollouts[0].tokens):  # every check would pass with nothing compared
            raise ValueError(f"generate_fn (arrangement {rollouts[0].name}) returned no response token for any "
                             "prompt: no tokens to compare")
        scorings = [(f"micro_batch_size={m}", m, None) for m in micro_batch_sizes]
        scorings += [(f"micro_batch_size={m}, threads={t}", m, t) for t in threads for m in micro_batch_sizes]
        failures, checks, compared = [], 0, 0
        reference = rollouts[0]
        for other in rollouts[1:]:
            checks += 1
            problem, n = _compare_rollouts(reference, other)
            compared += n
            if problem:
                failures.append(f"generate {other.name} vs generate {reference.name} (reference): {problem}")
        for rollout in rollouts:
            for name, micro, n_threads in scorings:
                torch.set_num_threads(n_threads or own_threads)
                scored = _score(score_fn, prompt_lists, rollout, micro, name)
                checks += 1
                try:
                    result = compare_logprobs(rollout.logprobs, scored, tokens=rollout.tokens)
                except ValueError as err:  # a length or dtype the contract does not allow
                    raise ValueError(f"score_fn (arrangement {name}, generate {rollout.name}): {err}") from None
                compared += result.tokens
                if not result.equal:
                    failures.append(f"score {name} of generate {rollout.name}: {result.message()}")
    finally:
        torch.set_num_threads(own_threads)
    if failures:
        raise AssertionError(_failure_report(failures, checks, len(prompt_lists), reference.name))
    return {
        "prompts": len(prompt_lists),
        "response_tokens": sum(len(t) for t in reference.tokens),
        "generation": [r.name for r in rollouts],
        "scoring": [name for name, _, _ in scorings],
        "checks": checks,
        "tokens_compared": compared,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _failure_report(failures: list[str], checks: int, prompts: int, reference: str) -> str:
    """Every failed check numbered; the first ``_MAX_FAILURES_DETAILED`` in full, the rest by their first line."""
    lines = [f"check_paths: {len(failures)} of {checks} checks failed ({prompts} prompts; reference: generate "
             f"{reference})"]
    for i, text in enumerate(failures):
        text = text if i < _MAX_FAILURES_DETAILED else text.split("\n")[0]
        lines.append(f"[{i + 1}] " + text.replace("\n", "\n    "))
    return "\n".join(lines)


def _generate_all(generate_fn: GenerateFn, prompts: list[list[int]], batch_sizes: Sequence[int | None],
                  permute: bool, threads: Sequence[int]) -> list[_Rollout]:
    own_threads = torch.get_num_threads()
    runs: list[tuple[str, int | None, list[int], int]] = [
        (f"batch_size={b}", b, list(range(len(prompts))), own_threads) for b in batch_sizes]
    if permute:
        order = list(range(len(prompts)))
        random.Random(0).shuffle(order)
        if order == sorted(order):  # two prompts can shuffle to themselves
            order.reverse()
        runs.append((f"batch_size={batch_sizes[-1]}, shuffled", batch_sizes[-1], order, own_threads))
    runs += [(f"batch_size=None, threads={t}", None, list(range(len(prompts))), t) for t in threads]
    rollouts = []
    for name, batch_size, order, n_threads in runs:
        torch.set_num_threads(n_threads)
        tokens, logprobs = _generated(generate_fn([prompts[i] for i in order], batch_size), len(prompts), name)
        back = [0] * len(order)  # output row j belongs to prompt order[j]
        for j, i in enumerate(order):
            back[i] = j
        rollouts.append(_Rollout(name, [tokens[j] for j in back], [logprobs[j] for j in back]))
    return rollouts


def _generated(out: Any, n: int, name: str) -> tuple[list[list[int]], list[Tensor]]:
    """Validate generate_fn's return value (ValueError naming the arrangement)."""
    where = f"generate_fn (arrangement {name})"
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"{where} must return (tokens, logprobs), got {type(out).__name__}")
    tokens_in, logprobs_in = out
    if len(tokens_in) != n or len(logprobs_in) != n:
        raise ValueError(f"{where} returned {len(tokens_in)} token lists and {len(logprobs_in)} log-prob sequences "
                         f"for {n} prompts")
    tokens = check_token_lists(f"{where} tokens", list(tokens_in), 2**63 - 1, allow_empty_items=True)
    logprobs = _sequences(list(logprobs_in), f"{where} logprobs", None).items
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if len(t) != lp.numel():
            raise ValueError(f"{where}: sequence {i} has {len(t)} tokens but {lp.numel()} log-probs")
    return tokens, logprobs


def _score(score_fn: ScoreFn, prompts: list[list[int]], rollout: _Rollout, micro_batch_size: int | None,
           name: str) -> list[Tensor]:
    """score_fn's log-probs for this rollout's tokens (ValueError naming the arrangement if the count is off;
    per-sequence lengths are checked by compare_logprobs)."""
    out = score_fn(prompts, [list(t) for t in rollout.tokens], micro_batch_size)
    if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
        got = f"{len(out)} sequences" if isinstance(out, (list, tuple)) else type(out).__name__
        raise ValueError(f"score_fn (arrangement {name}, generate {rollout.name}) returned {got} for "
                         f"{len(prompts)} prompts; expected one 1-D tensor per sequence")
    return list(out)


def _compare_rollouts(reference: _Rollout, other: _Rollout) -> tuple[str | None, int]:
    """(what differs, or None; tokens compared). Tokens first; log-probs only where every token agrees."""
    differing = [i for i, (a, b) in enumerate(zip(reference.tokens, other.tokens)) if a != b]
    if differing:
        i = differing[0]
        a, b = reference.tokens[i], other.tokens[i]
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        show = lambda seq: str(seq[pos]) if pos < len(seq) else "(ended)"  # noqa: E731
        hint = (" -- does your sampler depend on a prompt's place in the call? Then use greedy decoding or leave "
                "permute off" if other.name.endswith("shuffled") else "")
        return (f"tokens differ in {len(differing)} of {len(reference.tokens)} sequences; first: sequence {i}, "
                f"position {pos}: token {show(b)} vs {show(a)} in the reference (lengths {len(b)} vs {len(a)}){hint}"
                ), 0
    try:
        result = compare_logprobs(reference.logprobs, other.logprobs, tokens=reference.tokens,
                                  names=("reference", other.name))
    except ValueError as err:  # e.g. the log-probs of one arrangement come in another dtype
        raise ValueError(f"generate_fn (arrangement {other.name}): {err}") from None
    return (None if result.equal else "rollout " + result.message()), result.tokens


# --------------------------------------------------------------------------- sites: where two forwards part
def _site_sequences(sequences: Any, vocab_size: Any) -> list[list[int]]:
    """``record_sites``' token sequences: int lists (or a 2-D integer tensor), each non-empty, every id in the
    vocabulary where the model names its size -- a float id was truncated to another token before."""
    if isinstance(sequences, Tensor):
        if sequences.dim() != 2 or sequences.is_floating_point() or sequences.is_complex() or \
                sequences.dtype == torch.bool:
            raise ValueError(f"sequences must be lists of int token ids or a 2-D integer tensor, got a "
                             f"{str(sequences.dtype).removeprefix('torch.')} tensor of shape {tuple(sequences.shape)}")
        sequences = sequences.tolist()
    bound = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else 2**63
    return check_token_lists("sequences", sequences, bound)


def _site_prefills(prefill: Any, seqs: list[list[int]]) -> list[int]:
    """``prefill`` for each sequence: an int, or one per sequence, each in [1, the sequence's length]."""
    prefills = [prefill if prefill is not None else 1] * len(seqs) if not isinstance(prefill, Sequence) \
        else list(prefill)
    if len(prefills) != len(seqs) or any(not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= len(s)
                                         for k, s in zip(prefills, seqs)):
        raise ValueError(f"prefill must be an int or one int per sequence, each in [1, the sequence's length], "
                         f"got {prefill!r}")
    return prefills


def record_sites(model: Any, sequences: Sequence[Sequence[int]], *, kind: str = "train",
                 prefill: int | Sequence[int] | None = None, name: str | None = None) -> Sites:
    """Record every named site of one forward path of ``model`` on ``sequences`` (all positions), for
    ``assert_sites_equal`` or a dump (``vexact.real.sites.write_dump``).

    ``model``: a vexact ``Transformer`` (recorded op by op through its own kernel ops, ``vexact locate``'s op plan)
    or a transformers causal LM (forward hooks at the same site names: ``vexact.real.sites``). ``kind``:
    ``train`` (one full-sequence forward over the right-padded batch) or ``rollout`` (a KV cache: each sequence's
    first ``prefill`` tokens in one forward, then one forward per token; ``prefill`` an int for every sequence or
    one per sequence, default 1). ``name`` labels the recording (default: what it ran).

    Raises ValueError for an unknown ``kind``, a ``prefill`` that does not fit, empty sequences, or a model that is
    neither (or a mixture-of-experts model: its sites depend on the routing)."""
    from .engine.model import Transformer
    from .real.hf_config import model_config_from_hf
    from .real.op_plan import KINDS, capture, op_plan
    from .real.sites import SiteSpec, capture_hf, make_sites, weights_digest

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    seqs = _site_sequences(sequences, getattr(getattr(model, "config", None), "vocab_size", None))
    prefills = _site_prefills(prefill, seqs)
    rows = [(b, p) for b, s in enumerate(seqs) for p in range(len(s))]
    if isinstance(model, Transformer):
        config = model.config
        specs = [SiteSpec(s.name, s.group, s.kernel_op, s.recorded, s.feature_shape) for s in op_plan(config)]
        store = capture(model, model.ops, kind, seqs, prefills, rows)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        label = f"vexact {model.backend}:{dtype}:{kind}"
    elif hasattr(model, "config") and hasattr(model.config, "to_dict"):
        config = model_config_from_hf(model.config.to_dict())
        op_plan(config)  # a mixture-of-experts model is refused here
        specs, store = capture_hf(model, kind, seqs, prefills, rows)
        label = f"{type(model).__name__} {str(next(model.parameters()).dtype).removeprefix('torch.')}:{kind}"
    else:
        raise ValueError(f"record_sites needs a vexact Transformer or a transformers causal LM, got "
                         f"{type(model).__name__}")
    return make_sites(name or label, specs, store, rows, weights=weights_digest(model.named_parameters()),
                      tokens=seqs, prompt_lengths=[len(s) for s in seqs], prefill=prefills,
                      model=type(model).__name__, config=config.to_dict())


def record_vllm_sites(model_dir: str | Any, sequences: Sequence[Sequence[int]], *, dtype: str = "bf16",
                      kind: str = "train", max_new_tokens: int = 0, temperature: float = 1.0, seed: int = 0,
                      timeout_s: float | None = None) -> Sites:
    """Record every named site of vLLM's forward on checkpoint directory ``model_dir`` (vLLM's CPU build, its
    modules hooked inside its worker; ``vexact.integrations.vllm_sites``). ``kind`` ``train``: each sequence in one
    prefill. ``rollout``: ``sequences`` are prompts; vLLM prefills each and samples ``max_new_tokens`` more
    (``temperature``, seed ``seed + i`` for prompt i), and the recording's ``tokens`` are those sequences -- score
    them with your trainer (``record_sites(trainer, engine.tokens)``). ``dtype``: fp32 | bf16. Raises ValueError
    when vLLM is not installed (naming the pip line) or cannot run the model."""
    from pathlib import Path

    from .engine.model import resolve_dtype
    from .real.hf_checkpoint import read_checkpoint, read_checkpoint_config
    from .real.hf_config import model_config_from_hf
    from .real.op_plan import KINDS, op_plan
    from .real.sites import SiteSpec, make_sites, site_recorder, weights_digest

    record_vllm = site_recorder("vllm")  # vexact.integrations.vllm_sites, registered through the entry points

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    config = model_config_from_hf(read_checkpoint_config(Path(model_dir)))
    seqs = _site_sequences(sequences, config.vocab_size)
    op_plan(config)  # a mixture-of-experts model is refused here
    ran, specs, store = record_vllm(Path(model_dir), dtype, kind, seqs, max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed, timeout_s=timeout_s)
    rows = [(b, p) for b, s in enumerate(ran) for p in range(len(s))]
    # what vLLM holds: the checkpoint's tensors cast to dtype, as its loader casts them (copy_)
    weights = weights_digest(read_checkpoint(Path(model_dir)).tensors.items(), held=resolve_dtype(dtype))
    return make_sites(f"vllm {dtype}:{kind}", [SiteSpec(s["name"], s["group"], s["module"], s["recorded"],
                                                        tuple(s["feature_shape"])) for s in specs], store, rows,
                      weights=weights, tokens=ran, prompt_lengths=[len(s) for s in seqs],
                      prefill=[len(s) for s in seqs], model=str(model_dir), config=config.to_dict())


def _as_sites(x: Any, name: str) -> Sites:
    from pathlib import Path

    from .real.sites import read_dump

    if callable(x) and not isinstance(x, Sites):
        x = x()
    if isinstance(x, Sites):
        return x
    if isinstance(x, (str, Path)):
        return read_dump(x, name)
    raise ValueError(f"{name} must be a record_sites(...) recording, a dump directory or a callable returning one, "
                     f"got {type(x).__name__}")


def assert_sites_equal(a: Any, b: Any, *, names: tuple[str, str] = ("engine", "trainer"),
                       allow_different_weights: bool = False) -> None:
    """Assert that two forwards are bitwise equal at every site both record; return None if they are.

    ``a`` and ``b``: each a ``record_sites`` recording, the directory of a ``vexact locate --dump`` (with tensors
    or hashes only), or a callable taking no argument that returns either -- your engine and your trainer. Sites
    are compared as ``vexact locate`` compares them (float32 bit patterns; by hash where a dump holds no tensors).

    Raises AssertionError when any site differs: the first divergent site in forward order (sequence, position,
    feature, both values and their bits), then every shared site with its positions differing and max |Δ|.
    Raises ValueError when the two ran different models or token sequences, or share no site; or different
    weights (their weights digests differ: ``vexact.real.sites.weights_digest``) unless ``allow_different_weights``
    -- such models differ from the first layer on."""
    __tracebackhide__ = True
    from .real.locate import compare_sites
    from .real.locate_report import verdict, weights_line

    sa, sb = _as_sites(a, names[0]), _as_sites(b, names[1])
    result = compare_sites(sa, sb, allow_different_weights)
    if not result["diverged"]:
        return
    summary = {**result, "a": f"{names[0]} {sa.path}", "b": f"{names[1]} {sb.path}", "positions": len(sa.rows)}
    differing = sum(not row["bitwise_equal"] for row in result["ops"])
    width = max(len(row["name"]) for row in result["ops"])
    lines = [f"sites are not bitwise equal: {differing} of {len(result['ops'])} shared sites differ "
             f"({summary['a']} vs {summary['b']}, {len(sa.rows)} positions)", verdict(summary),
             *([weights_line(summary)] if result["weights"]["same"] is not True else []),
             "site by site (positions differing, max |Δ|):"]
    for row in result["ops"]:
        count = "-" if row["positions_differing"] is None else row["positions_differing"]
        peak = "-" if row["abs_diff_max"] is None else f"{row['abs_diff_max']:.3g}"
        lines.append(f"  {row['name']:<{width}}  {count} / {len(sa.rows)}  {peak}")
    raise AssertionError("\n".join(lines))
