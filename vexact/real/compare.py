"""``vexact compare ROLLOUT [TRAIN]``: log-probs dumped by the user's own engine and trainer, compared bitwise.

``vexact measure`` runs both paths itself; ``compare`` takes the per-token log-probs your own stack wrote --
the rollout engine's (vLLM, SGLang, transformers' ``generate``) and the trainer's recomputation (verl's
``old_log_probs``, an HF forward) -- and prints the same report: every ``rollout_corr/*``, ``training/*`` and
``mismatch/*`` key of ``vexact.rl.metrics.mismatch_metrics``, |Δlogp| by token probability and by response
position (``measure.mismatch_report`` / ``print_report``, one source for both commands), then the first mismatched token
(``Mismatch``, the class ``vexact.testing`` reports with: id, position, column, token, both values and their bits;
``first_mismatch`` in the JSON). With ``--fail-on-mismatch``, ``--max-k3`` and ``--max-abs-dlogp`` it is a CI gate
(exit 1, naming the gate and the numbers). ``--map`` takes an optional FILE, so a bare ``--map`` goes after the dumps;
a dump given as its FILE (``--map R.jsonl T.jsonl``) is refused, naming the order that works.
The report also has the raw importance ratios before any clamp or mask (``mismatch/ratio_*``,
``vexact.rl.raw_ratios``). ``--floor DUMP`` adds the trainer's own noise floor: DUMP is the trainer's second scoring of
the same sequences in another batch arrangement (read under the training key, matched by id), and the report says
whether the k3 is distinguishable from k3(train vs DUMP) (``vexact.real.floor``: the rule and why).

Inputs (the format follows the file name: ``.safetensors``; ``.pt`` / ``.pth`` / ``.bin`` read with the
weights-only unpickler, ``runlog.load_tensor_file``; anything else is JSON Lines):

* Two files, ROLLOUT and TRAIN: one sequence per JSON line, ``{"id": ..., "logprobs": [...], "tokens": [...]}``
  (``tokens`` optional; ``id`` a string or an integer, unique in its file). Sequences are matched by id in any
  order; where both sides have tokens they must be equal. The log-prob key is ``logprobs`` unless
  ``--rollout-key`` / ``--train-key`` name another.
* One file (TRAIN left out): each line holds both sides, ``{"id": ..., "rollout_log_probs": [...],
  "old_log_probs": [...]}`` -- verl's batch keys by default, others with ``--rollout-key`` / ``--train-key``.
* Tensor files (either mode): a dict of padded [B, T] tensors -- the log-probs (same keys as above), a mask
  (``--mask-key``, default ``response_mask``; else the last T columns of ``attention_mask``, as verl derives
  its response mask; ``none``: every position), optionally token ids (``--tokens-key``, default ``responses``)
  and full-vocabulary log-probs [B, T, V] (``--rollout-full-key`` / ``--train-full-key``). Row b is id b.
* slime's debug dumps (``.pt`` holding ``{"rollout_id": ..., "samples": [one dict per sample], ...}``;
  ``dump_files.SLIME_*``): ragged per-sample 1-D tensors (or lists). One file defaults to
  ``--save-debug-train-data``'s keys: the engine's ``rollout_log_probs`` and the Megatron actor's ``log_probs``,
  both over the response, masked by the response's ``loss_masks`` as a tensor file's rows are by ``response_mask``
  (``--mask-key`` as there); ``tokens`` (prompt + response) gives the response's token ids, its last
  ``len(log-probs)`` entries. Sample i is id i.

Values are compared as the floats that were written. A JSON number parses (correctly rounded) to a Python float,
i.e. float64, and the two sides' float64 values are compared exactly (``==``, as ``mismatch_metrics`` does: a
1-ulp difference is a mismatch; -0.0 equals 0.0). For float32 (or bf16) log-probs x this means:

* written as the repr of x's float64 value (``json.dumps(t.tolist())``: ``tolist`` widens exactly) -- parses back
  to exactly x: equality and |Δlogp| are exact;
* written with 9 significant digits (``%.9g``, enough to tell any two float32 apart) -- parses to the float64
  nearest that decimal, which is within half a float32 ulp of x but usually not x. Both sides written this way
  still compare exactly (equal float32 values give equal strings, different ones different strings); |Δlogp| is
  then off by less than one float32 ulp. Sides written in different ways (repr vs ``%.9g``) need ``--float32``,
  which rounds every parsed value to the nearest float32 first: then any format with >= 9 significant digits
  (or numpy's shortest float32 repr) gives back exactly x;
* written with fewer digits (``%.6g``) -- different float32 values can print alike: a mismatch can hide.

Tensor files are compared in their own dtype, widened exactly to float64 (rounded to float32 with ``--float32``).

Memory: JSON Lines are read line by line; the ROLLOUT side is held (8 bytes per token, plus tokens) while TRAIN
streams past it, and the metrics need a few float64 copies of the N tokens (``benchmarks/compare.py`` measures
the peak). Bad input -- malformed JSON, a missing or duplicate id, tokens or lengths that differ, a value that is
not a number or not finite, a mask of the wrong shape, an empty file -- is one ValueError naming the file, the
line (or row) and the id.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vexact_kernels.host_guard import torch_threads

from ..cli_base import EXIT_FAILED, EXIT_OK, check_outputs, positive_int
from ..metric_keys import ABS_DLOGP_MAX, ABS_DLOGP_MEAN, K3_KL, KL
from ..rl.metrics import float_bits, full_vocab_rows, full_vocab_summary
from .dump_files import (
    ATTENTION_MASK_KEY,
    JSONL_TOKENS_KEY,
    MASK_KEY,
    NO_MASK,
    ONE_FILE_KEYS,
    SLIME_KEYS,
    SLIME_MASK_KEY,
    TENSOR_TOKENS_KEY,
    TORCH_SUFFIXES,
    TWO_FILE_KEY,
    ReadOptions,
    Record,
    is_tensor_file,
    load_torch,
    read_dump,
    slime_samples,
)
from .floor import floor_verdict
from .measure import check_report_methods, mismatch_report, plot_report, print_report, write_report_json

DEFAULT_MAP = "default"  # --map without a file: the map shipped with vexact (vexact.map.verdict.load_map(None))

DESCRIPTION = """\
Compare the per-token log-probs your rollout engine and your trainer wrote for the same tokens, and print
vexact measure's report (rollout_corr/*, mismatch/*, |Δlogp| by probability and position).

  vexact compare rollout.jsonl train.jsonl     two files, one {"id", "logprobs", "tokens"?} per line,
                                               matched by id in any order
  vexact compare dump.jsonl                    one file holding both sides (--rollout-key, --train-key;
                                               default verl's rollout_log_probs / old_log_probs)
  vexact compare batch.safetensors             padded [B, T] tensors + --mask-key (also .pt, weights-only)
  vexact compare train_0.pt                    slime's --save-debug-train-data dump (rollout_log_probs,
                                               log_probs, loss_masks per sample)

Precision: JSON numbers are parsed to float64 and the two sides are compared exactly (==, no tolerance).
A float32 log-prob written as the repr of its float64 value (json.dumps(tensor.tolist())) parses back exactly.
Written with >= 9 significant digits (%.9g) it parses to a float64 within half a float32 ulp of it: two sides
written the same way still compare exactly; sides written in different ways need --float32 (round every value
to float32 first). Fewer digits (%.6g) can hide a mismatch.
"""


@dataclass
class CompareSettings:
    """What ``run_compare`` reads; ``None`` keys mean the documented defaults for the mode and format."""

    rollout: Path
    train: Path | None = None  # None: one file holds both sides
    rollout_key: str | None = None
    train_key: str | None = None
    tokens_key: str | None = None
    mask_key: str | None = None
    rollout_full_key: str | None = None
    train_full_key: str | None = None
    full_vocab_top_k: int = 5
    float32: bool = False  # round every parsed value to float32 before comparing (``dump_files``)
    threads: int | None = None  # torch threads to set for the metrics (None: leave them; the CLI's default is 1)
    floor: Path | None = None  # a second dump of the trainer's log-probs of the same tokens (``--floor``)

    def read_options(self) -> ReadOptions:
        """What the dump readers take of these settings."""
        return ReadOptions(tokens_key=self.tokens_key, mask_key=self.mask_key, float32=self.float32)


@dataclass
class CompareResult:
    """``summary``: the JSON-able report; flat float64 per-token log-probs (sequences concatenated) feed the plot."""

    summary: dict[str, Any]
    logp_train: Tensor
    logp_roll: Tensor
    first_mismatch: Mismatch | None = None  # also in ``summary["first_mismatch"]``, as JSON


# --------------------------------------------------------------------------- the first mismatch
def _value_text(value: Tensor) -> str:
    """The shortest decimal that reads back as this value in its own dtype (numpy's float formatting;
    bfloat16 is printed as the float32 it widens to exactly)."""
    v = float(value)
    if value.dtype == torch.float64:
        return repr(v)
    return str(np.float16(v)) if value.dtype == torch.float16 else str(np.float32(v))


@dataclass(frozen=True)
class Mismatch:
    """One token whose two log-probs differ: in their bits (``vexact.testing``) or as float64 values (``vexact
    compare``, where -0.0 equals 0.0). ``position`` counts the sequence's compared tokens from 0; ``column`` is the
    column of a padded input (None for lists); ``token`` is None without token ids; ``id`` is the sequence's id in a
    compared file (None: the sequence is named by its index)."""

    sequence: int
    position: int
    column: int | None
    token: int | None
    rollout: Tensor
    train: Tensor
    id: Hashable | None = None

    def describe(self, names: tuple[str, str]) -> str:
        where = f"sequence {self.sequence}" if self.id is None else f"id {self.id!r}"
        where += f", position {self.position}"
        if self.column is not None and self.column != self.position:
            where += f" (column {self.column})"
        if self.token is not None:
            where += f", token {self.token}"
        delta = float(self.train.double() - self.rollout.double())
        return (f"{where}: {names[0]} {_value_text(self.rollout)} ({float_bits(self.rollout)}) vs "
                f"{names[1]} {_value_text(self.train)} ({float_bits(self.train)}), Δ = {delta:.6g}")

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (the two log-probs as floats and as their bits in hex)."""
        return {"id": self.id, "sequence": self.sequence, "position": self.position, "column": self.column,
                "token": self.token, "rollout": float(self.rollout), "train": float(self.train),
                "rollout_bits": float_bits(self.rollout), "train_bits": float_bits(self.train),
                "delta": float(self.train.double() - self.rollout.double())}


def _first_mismatch(index: int, train: np.ndarray, roll: np.ndarray, records: tuple[Record, ...]) -> Mismatch | None:
    """The first position where a pair's two float64 log-probs differ as values (as ``mismatch_metrics`` counts),
    named by the sequence's id, its tensor column and its token where the files have them."""
    differ = np.flatnonzero(train != roll)
    if not differ.size:
        return None
    j = int(differ[0])
    columns = next((r.columns for r in records if r.columns is not None), None)
    tokens = next((r.tokens for r in records if r.tokens is not None), None)
    return Mismatch(index, j, int(columns[j]) if columns is not None else None,
                    int(tokens[j]) if tokens is not None else None, torch.tensor(roll[j]), torch.tensor(train[j]),
                    id=records[0].id)


# --------------------------------------------------------------------------- the two sides matched
@dataclass
class _Pairs:
    """The matched sequences, in the order they were paired, and what was checked."""

    train: list[np.ndarray] = field(default_factory=list)
    roll: list[np.ndarray] = field(default_factory=list)
    full_rows: list[dict[str, Tensor]] = field(default_factory=list)
    tokens_checked: int = 0
    first: Mismatch | None = None  # the first mismatched token, in pairing order
    where: list[str] = field(default_factory=list)  # how errors name each sequence (``Record.where``)
    keep_tokens: bool = False  # ``--floor``: hold each pair's id, tokens and columns to match the floor dump to
    ids: list[Hashable] = field(default_factory=list)
    tokens: list[np.ndarray | None] = field(default_factory=list)
    columns: list[np.ndarray | None] = field(default_factory=list)

    def add(self, train: np.ndarray, roll: np.ndarray, *records: Record) -> None:
        """One matched sequence (``records``: where it was read, the one that names it first)."""
        if self.first is None:  # each pair is compared until the first mismatch is found
            self.first = _first_mismatch(len(self.train), train, roll, records)
        self.train.append(train)
        self.roll.append(roll)
        self.where.append(records[0].where)
        if self.keep_tokens:
            self.ids.append(records[0].id)
            self.tokens.append(next((r.tokens for r in records if r.tokens is not None), None))
            self.columns.append(records[0].columns)


def _read_one_file(s: CompareSettings, rk: str, tk: str, loaded: Any = None) -> _Pairs:
    pairs = _Pairs(keep_tokens=s.floor is not None)
    full_keys = _full_keys(s)
    seen: dict[Hashable, str] = {}
    for record in read_dump(s.rollout, (rk, tk), s.read_options(), full_keys, loaded):
        _check_new_id(record, seen)
        pairs.add(record.values[tk], record.values[rk], record)
        if full_keys:
            pairs.full_rows.append(_full_vocab_pair(record.full[full_keys[1]], record.full[full_keys[0]],
                                                    record, s.full_vocab_top_k))
    return pairs


def _check_new_id(record: Record, seen: dict[Hashable, str]) -> None:
    """Refuse an id seen before in the same file (``seen``: id -> where it was first)."""
    first = seen.get(record.id)
    if first is not None:
        raise ValueError(f"{record.where}: duplicate id (first on {first})")
    seen[record.id] = record.place


def _read_two_files(s: CompareSettings, rk: str, tk: str) -> _Pairs:
    """Hold the ROLLOUT file's sequences by id, then stream TRAIN past them (pairs in TRAIN's order)."""
    assert s.train is not None
    roll_full, train_full = _full_keys(s) or (None, None)
    held: dict[Hashable, Record] = {}
    first_seen: dict[Hashable, str] = {}
    for record in read_dump(s.rollout, (rk,), s.read_options(), (roll_full,) if roll_full else ()):
        _check_new_id(record, first_seen)
        held[record.id] = record
    del first_seen
    pairs = _Pairs(keep_tokens=s.floor is not None)
    seen: dict[Hashable, str] = {}
    for record in read_dump(s.train, (tk,), s.read_options(), (train_full,) if train_full else ()):
        _check_new_id(record, seen)
        other = held.pop(record.id, None)
        if other is None:
            raise ValueError(f"{record.where}: no sequence with this id in {s.rollout}")
        _check_pair(other, record, rk, tk)
        pairs.tokens_checked += other.tokens is not None and record.tokens is not None
        pairs.add(record.values[tk], other.values[rk], record, other)
        if roll_full and train_full:
            pairs.full_rows.append(_full_vocab_pair(record.full[train_full], other.full[roll_full], record,
                                                    s.full_vocab_top_k))
    if held:
        first = next(iter(held.values()))
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        raise ValueError(f"{first.where}: no sequence with this id in {s.train}{more}")
    return pairs


def _read_floor(s: CompareSettings, tk: str, pairs: _Pairs) -> Tensor:
    """``--floor``: the trainer's second scoring of the same sequences, matched by id to the compared pairs and in
    their order, as one flat float64 tensor. Read under the training key (``tk``) in either format; every sequence
    must be there with the same tokens (length, token ids where both have them, masked columns of tensor rows)."""
    assert s.floor is not None
    index = {ident: i for i, ident in enumerate(pairs.ids)}
    found: list[np.ndarray | None] = [None] * len(pairs.ids)
    seen: dict[Hashable, str] = {}
    for record in read_dump(s.floor, (tk,), s.read_options(), ()):
        _check_new_id(record, seen)
        i = index.get(record.id)
        if i is None:
            raise ValueError(f"{record.where}: --floor dump has a sequence that is not among the compared ones "
                             "(the floor must score the same tokens)")
        values, there = record.values[tk], pairs.where[i]
        if len(values) != len(pairs.train[i]):
            raise ValueError(f"{record.where}: --floor dump has {len(values)} log-probs here but {there} has "
                             f"{len(pairs.train[i])} (the floor must score the same tokens)")
        mine = pairs.tokens[i]
        if record.tokens is not None and mine is not None and not np.array_equal(record.tokens, mine):
            j = int(np.flatnonzero(record.tokens != mine)[0])
            raise ValueError(f"{record.where}: --floor dump's tokens differ from {there} at position {j} "
                             f"({int(record.tokens[j])} here, {int(mine[j])} there)")
        columns = pairs.columns[i]
        if record.columns is not None and columns is not None and not np.array_equal(record.columns, columns):
            raise ValueError(f"{record.where}: --floor dump's mask selects other positions than {there}")
        found[i] = values
    missing = [i for i, values in enumerate(found) if values is None]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{pairs.where[missing[0]]}: no sequence with this id in the --floor dump {s.floor}{more}")
    return torch.from_numpy(np.concatenate(found))  # type: ignore[arg-type]


def _check_pair(roll: Record, train: Record, rk: str, tk: str) -> None:
    """The two sides of one sequence describe the same tokens: same length, same ids where both have them,
    same masked columns where both are tensor rows."""
    n_train, n_roll = len(train.values[tk]), len(roll.values[rk])
    there = f"{roll.path}:{roll.line}" if roll.row is None else f"{roll.path} {roll.place}"
    if n_train != n_roll:
        raise ValueError(f"{train.where}: {n_train} log-probs here but {n_roll} in {there} (lengths differ)")
    if train.tokens is not None and roll.tokens is not None and not np.array_equal(train.tokens, roll.tokens):
        j = int(np.flatnonzero(train.tokens != roll.tokens)[0])
        raise ValueError(f"{train.where}: tokens differ from {there} at position {j} "
                         f"({int(train.tokens[j])} here, {int(roll.tokens[j])} there)")
    if train.columns is not None and roll.columns is not None and not np.array_equal(train.columns, roll.columns):
        raise ValueError(f"{train.where}: the mask selects other positions than in {there}")


def _full_keys(s: CompareSettings) -> tuple[str, str] | tuple[()]:
    if (s.rollout_full_key is None) != (s.train_full_key is None):
        raise ValueError("give both --rollout-full-key and --train-full-key (or neither)")
    return (s.rollout_full_key, s.train_full_key) if s.rollout_full_key is not None else ()


def _full_vocab_pair(train: Tensor, roll: Tensor, record: Record, top_k: int) -> dict[str, Tensor]:
    if train.shape != roll.shape:
        raise ValueError(f"{record.where}: full-vocabulary log-probs have shape {list(train.shape)} on the training "
                         f"side but {list(roll.shape)} on the rollout side")
    if top_k > train.shape[1]:
        raise ValueError(f"--full-vocab-top-k {top_k} exceeds the vocabulary ({train.shape[1]})")
    return full_vocab_rows(train, roll, top_k)


# --------------------------------------------------------------------------- the comparison
def resolve_keys(s: CompareSettings, slime: bool = False) -> tuple[str, str]:
    """(rollout key, training key): as given, else with one file verl's batch keys (``slime``: the file is a slime
    debug dump, slime's keys), and ``logprobs`` with two."""
    default = (SLIME_KEYS if slime else ONE_FILE_KEYS) if s.train is None else (TWO_FILE_KEY, TWO_FILE_KEY)
    rk, tk = s.rollout_key or default[0], s.train_key or default[1]
    if s.train is None and rk == tk:
        raise ValueError(f"--rollout-key and --train-key are both {rk!r}: one file needs two keys")
    return rk, tk


def run_compare(s: CompareSettings) -> CompareResult:
    """Read both sides, match them, and build ``measure``'s report of the mismatch (plus the files and keys)."""
    if isinstance(s.full_vocab_top_k, bool) or not isinstance(s.full_vocab_top_k, int) or s.full_vocab_top_k < 1:
        raise ValueError(f"--full-vocab-top-k must be a positive integer, got {s.full_vocab_top_k!r}")
    check_report_methods()
    with torch_threads(s.threads):  # the caller's count back after the comparison
        start = time.perf_counter()
        # one torch file: read once, here, since its structure picks the default keys (a slime dump: slime's)
        loaded = (load_torch(Path(s.rollout)) if s.train is None and Path(s.rollout).suffix in TORCH_SUFFIXES
                  and Path(s.rollout).is_file() else None)
        rk, tk = resolve_keys(s, slime=slime_samples(loaded) is not None)
        pairs = _read_one_file(s, rk, tk, loaded) if s.train is None else _read_two_files(s, rk, tk)
        del loaded  # the whole file (a slime dump holds far more than the log-probs): not held through the metrics
        read_s = time.perf_counter() - start

        start = time.perf_counter()
        lengths = [len(t) for t in pairs.train]
        sources = str(s.rollout) if s.train is None else f"{s.rollout} and {s.train}"
        if sum(lengths) == 0:
            raise ValueError(f"{sources}: no tokens to compare: every sequence is empty")
        floor_flat = _read_floor(s, tk, pairs) if s.floor is not None else None
        train_flat = torch.from_numpy(np.concatenate(pairs.train))
        pairs.train = []  # the flat copy replaces the per-sequence arrays
        roll_flat = torch.from_numpy(np.concatenate(pairs.roll))
        pairs.roll = []
        report = mismatch_report(train_flat, roll_flat, lengths, max(lengths))
        _require_finite_metrics(report["metrics"], train_flat, roll_flat, lengths, pairs.where)
        if pairs.full_rows:
            merged = {key: torch.cat([rows[key] for rows in pairs.full_rows]) for key in pairs.full_rows[0]}
            if merged["kl"].numel():
                report["metrics"].update(full_vocab_summary(merged, s.full_vocab_top_k))
        summary = {
            "rollout": str(s.rollout),
            "train": str(s.rollout if s.train is None else s.train),
            "mode": "one file" if s.train is None else "two files, matched by id",
            "rollout_key": rk,
            "train_key": tk,
            "sequences": len(lengths),
            "sequences_with_tokens_checked": pairs.tokens_checked,
            **report,
            "first_mismatch": pairs.first.to_json() if pairs.first is not None else None,
            **({"floor": floor_verdict(train_flat, roll_flat, floor_flat, lengths, s.floor)}
               if floor_flat is not None else {}),
            "seconds": {"read": round(read_s, 3), "metrics": round(time.perf_counter() - start, 3)},
        }
        return CompareResult(summary, train_flat, roll_flat, pairs.first)


FINITE_METRICS = (K3_KL, KL, ABS_DLOGP_MEAN, ABS_DLOGP_MAX)
"""Metrics that finite log-probs of a sane size keep finite: an infinite one means a log-prob no token can have."""


def _require_finite_metrics(metrics: dict[str, float], train: Tensor, roll: Tensor, lengths: list[int],
                            where: list[str]) -> None:
    """One ValueError, before any report is printed, when a metric overflowed float64 (k3's e^r for a log-ratio r
    above 709, sums of values near 1e308), naming the token with the largest |Δlogp| and both of its values."""
    bad = [key for key in FINITE_METRICS if not math.isfinite(metrics[key])]
    if not bad:
        return
    i = int((train - roll).abs().argmax())
    sequence = int(np.searchsorted(np.cumsum(lengths), i, side="right"))
    position = i - int(sum(lengths[:sequence]))
    raise ValueError(f"{', '.join(bad)} overflowed float64 ({bad[0]} = {metrics[bad[0]]}): {where[sequence]}, position "
                     f"{position} has the training log-prob {float(train[i]):.6g} and the rollout log-prob "
                     f"{float(roll[i]):.6g}; a log-prob that far below 0 is a probability no sampled token has -- a "
                     "mask's fill value (e.g. torch.finfo(dtype).min) instead of a log-prob?")


def check_gates(summary: dict[str, Any], fail_on_mismatch: bool, max_k3: float | None,
                max_abs_dlogp: float | None) -> list[dict[str, Any]]:
    """The requested gates, each ``{"gate", "limit", "value", "passed", "message"}``, in flag order."""
    m = summary["metrics"]
    gates = []
    if fail_on_mismatch:
        differ = summary["tokens"] - summary["bitwise_equal"]
        gates.append({"gate": "--fail-on-mismatch", "limit": 0, "value": differ, "passed": differ == 0,
                      "message": f"{differ} of {summary['tokens']} tokens are not bitwise equal"})
    for flag, key, limit in (("--max-k3", K3_KL, max_k3),
                             ("--max-abs-dlogp", ABS_DLOGP_MAX, max_abs_dlogp)):
        if limit is not None:
            value = m[key]
            passed = value <= limit  # NaN fails
            gates.append({"gate": flag, "limit": limit, "value": value, "passed": bool(passed),
                          "message": f"{key} = {value:.6g} {'<=' if passed else '>'} {limit:g}"})
    return gates


# --------------------------------------------------------------------------- command line
def _limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _vocab_size(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"expected a vocabulary size (an integer >= 2), got {text!r}")
    return int(text)


def _policy_lag(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a policy lag (optimizer steps, an integer >= 0), got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (the CLI calls this)."""
    parser.description = DESCRIPTION  # laid out by hand: the CLI keeps its lines (and wraps the epilog)
    parser.add_argument("rollout", type=Path, nargs="?", default=None, metavar="ROLLOUT",  # required: main says so
                        help="the rollout engine's dump (.jsonl, .safetensors, .pt); alone: a file holding both sides")
    parser.add_argument("train", type=Path, nargs="?", default=None, metavar="TRAIN",
                        help="the trainer's dump of the same sequences (omit when ROLLOUT holds both)")
    parser.add_argument("--rollout-key", default=None, metavar="KEY",
                        help=f"rollout log-probs key (default {ONE_FILE_KEYS[0]} with one file, {TWO_FILE_KEY} "
                             "with two)")
    parser.add_argument("--train-key", default=None, metavar="KEY",
                        help=f"training log-probs key (default {ONE_FILE_KEYS[1]} with one file, {SLIME_KEYS[1]} "
                             f"with one slime debug dump, {TWO_FILE_KEY} with two)")
    parser.add_argument("--tokens-key", default=None, metavar="KEY",
                        help=f"token ids, checked equal where both sides have them (default {JSONL_TOKENS_KEY} in "
                             f"JSON Lines and slime dumps (there prompt + response: the response is its tail), "
                             f"{TENSOR_TOKENS_KEY} in tensor files, used when present; given: required)")
    parser.add_argument("--mask-key", default=None, metavar="KEY",
                        help=f"tensor files: [B, T] mask of the token positions (default {MASK_KEY}, else the last "
                             f"T columns of {ATTENTION_MASK_KEY}; a slime debug dump's samples: {SLIME_MASK_KEY}; "
                             f"'{NO_MASK}': every position)")
    parser.add_argument("--rollout-full-key", default=None, metavar="KEY",
                        help="tensor files: rollout full-vocabulary log-probs [B, T, V] (adds mismatch/full_vocab_*)")
    parser.add_argument("--train-full-key", default=None, metavar="KEY",
                        help="tensor files: training full-vocabulary log-probs [B, T, V]")
    parser.add_argument("--full-vocab-top-k", type=positive_int, default=None, metavar="K",  # None: refused if moot
                        help="k of mismatch/full_vocab_top{k}_overlap_mean (default "
                             f"{CompareSettings.full_vocab_top_k})")
    parser.add_argument("--float32", action="store_true",
                        help="round every value to the nearest float32 before comparing: for float32 log-probs "
                             "written in different formats (repr, %%.9g, numpy's shortest float32 repr)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help="torch threads for the metrics (default 1: elementwise passes and short sums, which "
                             "more threads barely speed up and, on a busy machine, can slow down many times over)")
    parser.add_argument("--floor", type=Path, default=None, metavar="DUMP",
                        help="the stack's noise floor: a second dump of your trainer's log-probs of the same tokens "
                             "in another batch arrangement (batch size, order, padding), read under the training key; "
                             "reports k3 between the two trainer scorings and whether your k3 is distinguishable "
                             "from it (a paired bootstrap over sequences, one-sided 95%%)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the report to this JSON")
    parser.add_argument("--png", type=Path, default=None, metavar="OUT",
                        help="also plot the Δlogp histogram and |Δlogp| vs probability")
    parser.add_argument("--fail-on-mismatch", action="store_true", help="gate: exit 1 unless every token is "
                        "bitwise equal")
    parser.add_argument("--max-k3", type=_limit, default=None, metavar="X",
                        help="gate: exit 1 if rollout_corr/k3_kl > X")
    parser.add_argument("--max-abs-dlogp", type=_limit, default=None, metavar="X",
                        help="gate: exit 1 if mismatch/abs_dlogp_max > X")
    parser.add_argument("--map", nargs="?", const=DEFAULT_MAP, default=None, metavar="FILE",
                        help="place the dump's k3 and mean response length on a collapse map (a scaling.json; "
                             "without FILE: the map shipped with vexact). Before the dumps, write --map=FILE or "
                             "--map last: a space-separated value is taken as the map file")
    parser.add_argument("--verbose", action="store_true",
                        help="with --map: print the placement in full (the threshold and its interval, the "
                             "extrapolation, the curve's bounds, the assumptions, the curve); default: one verdict "
                             "line (the --json report holds the map's keys either way)")
    parser.add_argument("--correction", default=None, metavar="NAME|CONFIG",
                        help="with --map: the correction your trainer runs, whose curve gives the verdict: a name "
                             "(bypass, recompute, token_tis = recompute + token-level TIS, bypass_token_tis = "
                             "bypass + token-level TIS, ...) or a config file (.yaml/.json: verl's "
                             "algorithm.rollout_correction, a TRL GRPOConfig, a vexact config); default: bypass, "
                             "said so in the verdict; a correction the map has no curve for gets one sentence saying "
                             "so")
    parser.add_argument("--source", default=None, metavar="NAME",
                        help="with --map: the mismatch source whose curves give the verdict, one of the map's "
                             "sources (e.g. routing_flip:near_tie, MoE routing mismatch); default: the map's first "
                             "(logit_scale on the shipped map)")
    parser.add_argument("--vocab", type=_vocab_size, default=None, metavar="N",
                        help="with --map (no FILE): your model's vocabulary size; picks the shipped map whose "
                             "testbed vocabulary is nearest (the tail map, 1,024 tokens, for any real LLM "
                             "vocabulary; the main map, 22 tokens, otherwise); default: the main map, said so")
    parser.add_argument("--policy-lag", type=_policy_lag, default=None, metavar="K",
                        help="with --map: how many optimizer steps your rollouts' policy is behind the trained one "
                             "(asynchronous RL); the verdict comes from the curve measured at that lag, and a lag the "
                             "map has no curve for is an error saying so; default: 0 (on-policy)")



def map_verdict_line(placed: dict[str, Any]) -> str:
    """``compare --map``'s one line without ``--verbose``: the point, the correction and the verdict's first clause
    (its qualifications, the curve and the assumptions are ``--verbose``'s), and the extrapolation once, where the
    horizon lies beyond the curve's measured ones and the clause does not say so already."""
    verdict = str(placed["verdict"])
    head = verdict.split("; ")[0]
    assumed = " (assumed: --correction names yours)" if "correction assumed" in verdict else ""
    line = (f"map: k3 = {placed['k3']:.3g} at T = {placed['horizon']:.1f} tokens, correction "
            f"{placed['correction']}{assumed}: {head}")
    factor = placed.get("extrapolation_factor")
    if isinstance(factor, (int, float)) and factor > 1 and "extrapolat" not in head:
        line += f"; extrapolated: T is {factor:.3g}x outside the curve's measured horizons"
    return line + " (--verbose: the details)"


def _is_dump(path: Path) -> bool:
    """Whether ``path`` is a log-prob dump (a tensor file, or JSON Lines whose first line is an object with an
    ``id``) rather than a map (a ``scaling.json``: one JSON object, no ``id``)."""
    if is_tensor_file(path):
        return True
    try:
        with open(path, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
        row = json.loads(first)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(row, dict) and "id" in row


def _check_paths_and_map(args: argparse.Namespace) -> None:
    """ROLLOUT is given, and ``--map`` did not swallow a dump: ``--map R.jsonl T.jsonl`` parses R.jsonl as the map
    file (argparse gives an optional value the next word) -- refused, with the order that means what was meant."""
    fix = ("for the map shipped with vexact put --map after the dumps (vexact compare ROLLOUT [TRAIN] --map); name a "
           "map file after the dumps (--map FILE) or as --map=FILE")
    if args.map not in (None, DEFAULT_MAP) and Path(args.map).is_file() and _is_dump(Path(args.map)):
        raise ValueError(f"--map took {args.map} as its map file, but it is a log-prob dump, not a scaling.json: {fix}")
    if args.rollout is None:
        raise ValueError("no ROLLOUT dump given" + (f" (--map took {args.map} as its map file: {fix})"
                                                     if args.map not in (None, DEFAULT_MAP) else ""))


def main(args: argparse.Namespace) -> int:
    """Run the command from parsed arguments; returns the exit code (0 passed, 1 a gate failed)."""
    from rich.console import Console
    from rich.markup import escape

    from ..map.verdict import choose_correction, compare_map, load_map

    _check_paths_and_map(args)  # before the map is read: a dump given as the map file is named as one
    check_outputs({"--json": args.json, "--png": args.png}, {
        "ROLLOUT": args.rollout, "TRAIN": args.train, "--floor": args.floor,
        "--map": None if args.map in (None, DEFAULT_MAP) else Path(args.map),
        "--correction": None if args.correction is None else Path(args.correction)})  # a name, or a file
    for flag, value in (("--correction", args.correction), ("--source", args.source), ("--vocab", args.vocab),
                        ("--policy-lag", args.policy_lag)):
        if value is not None and args.map is None:
            raise ValueError(f"{flag} chooses a curve of the collapse map: give --map too")
    if args.vocab is not None and args.map not in (None, DEFAULT_MAP):  # load_map ignored it for a file
        raise ValueError(f"--vocab picks one of the maps shipped with vexact, and --map={args.map} names its own map "
                         "file: give one of them (--vocab with --map alone, no FILE)")
    if args.verbose and args.map is None:
        raise ValueError("--verbose prints the --map placement in full: give --map too")
    if args.full_vocab_top_k is not None and args.rollout_full_key is None and args.train_full_key is None:
        raise ValueError("--full-vocab-top-k sets k of the full-vocabulary comparison, which reads --rollout-full-key "
                         "and --train-full-key: give them too")
    dumps = [Path(path) for path in (args.rollout, args.train, args.floor) if path is not None]
    if args.mask_key is not None and not any(map(is_tensor_file, dumps)):
        raise ValueError(f"--mask-key says which positions of a tensor file hold tokens, and no dump here is one "
                         f"({', '.join(('.safetensors', *TORCH_SUFFIXES))}): JSON Lines list only the tokens")
    if args.map is not None:  # the map, the correction and the source are checked before the dumps are read
        scaling_map = load_map(None if args.map == DEFAULT_MAP else args.map, args.vocab)
        correction = choose_correction(scaling_map, args.correction, args.source, args.policy_lag or 0)
    settings = CompareSettings(rollout=args.rollout, train=args.train, rollout_key=args.rollout_key,
                               train_key=args.train_key, tokens_key=args.tokens_key, mask_key=args.mask_key,
                               rollout_full_key=args.rollout_full_key, train_full_key=args.train_full_key,
                               full_vocab_top_k=args.full_vocab_top_k or CompareSettings.full_vocab_top_k,
                               float32=args.float32,
                               threads=args.threads, floor=args.floor)
    result = run_compare(settings)
    s = result.summary
    gates = check_gates(s, args.fail_on_mismatch, args.max_k3, args.max_abs_dlogp)
    s["gates"] = gates
    probe = Console()  # wide when not a terminal (CI logs), as the CLI's other commands print
    console = probe if probe.is_terminal else Console(width=160)
    sides = (f"{s['rollout']}: {s['rollout_key']} → {s['train_key']}" if settings.train is None
             else f"{s['rollout']} ({s['rollout_key']}) → {s['train']} ({s['train_key']})")
    checked = f"; tokens checked on {s['sequences_with_tokens_checked']}" if settings.train is not None else ""
    print_report(s, console, title=escape(f"vexact compare: {sides}"),  # titles are rich markup; paths are not
                 caption=f"{s['sequences']} sequences ({s['mode']}{checked}); values compared exactly as float64")
    if result.first_mismatch is not None:  # which token to look at first, as vexact.testing reports it
        console.print("first mismatch: " + result.first_mismatch.describe(("rollout", "training")), markup=False,
                      highlight=False, soft_wrap=True)
    if "floor" in s:  # the user's k3 against the trainer's own noise
        console.print(s["floor"]["verdict"], markup=False, highlight=False, soft_wrap=True)
    if args.map is not None:  # where this k3 and horizon sit on the collapse map
        s["map"], map_text = compare_map(s, scaling_map, correction, args.source, args.vocab, args.policy_lag or 0)
        console.print("\n".join(map_text) if args.verbose else map_verdict_line(s["map"]), markup=False,
                      highlight=False, soft_wrap=True)
    written = [write_report_json(s, args.json)] if args.json else []
    if args.png:
        written.append(plot_report(result.logp_train, result.logp_roll, args.png,
                                   f"vexact compare: {sides} ({s['tokens']} tokens)"))
    if written:
        console.print("wrote " + ", ".join(str(path) for path in written), markup=False)
    failed = [g for g in gates if not g["passed"]]
    for gate in gates:
        if gate["passed"]:
            console.print(f"gate passed: {gate['gate']}: {gate['message']}", markup=False)
    err = Console(stderr=True, soft_wrap=True)
    for gate in failed:
        err.print(f"gate failed: {gate['gate']}: {gate['message']}", markup=False, highlight=False)
    return EXIT_FAILED if failed else EXIT_OK
