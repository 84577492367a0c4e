"""Linear layers of one input in one GEMM, where that gives each layer its own bits (``cpu_exact.linears``).

A decode step multiplies a layer's normed hidden state by three weights (q, k, v) and the MLP's input by two (gate,
up): five GEMMs of a few rows where two would do, as vLLM's fused projections do. oneDNN's linear on the weights packed
as one ([N_1 + N_2 + ..., K]) computes each output column from x and that column's weight row, as the separate calls
do; whether its bits are theirs is a property of the host's oneDNN, so it is checked at first use, per (tiles, K, the
weights' widths, dtype, thread count), on seeded operands (as ``gemm_arrangements._packed_agrees`` checks one packed
weight), and the fused call runs only where it passed.

It runs where each weight's call like this one is remembered (``linear_repeats``: a decode loop's, with no gradient
recorded), each such call's plan runs oneDNN's linear on its weight packed once (``TiledPlan.packed``), with the same
tiles for every weight, and gives the plan's own bits (``PackedLinear.agrees``) -- and, as one weight packs, after
``PACK_AFTER_CALLS`` calls of the group on the weights' current versions, at one call shape and thread count (a
short rollout packs nothing). Elsewhere ``run`` returns None and the caller runs each linear. No bit depends on which
ran.

The weights packed as one are kept per group (the weights, the guard, the GEMM's dtype) while every weight is unchanged
(its version counter, storage and view), counted against ``gemm_arrangements.ARRANGED_BYTES_MAX`` with the operands
laid out there, and dropped with any of the weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from . import compiled_loops, linear_repeats
from . import gemm_arrangements as gemm
from .host_guard import HostGuard, onednn_linear, onednn_packed

GROUPS_MAX = 1024
"""Groups kept at most (then afresh): one per (weights, guard, dtype) -- a model's q/k/v and gate/up per layer."""


class _Shape(NamedTuple):
    """What a group's fused call of one x shape runs (each weight's packed plan) and what that was decided under: the
    guard's state, the thread count and the process switches (``gemm_arrangements.plan_switches``) -- with the
    weights unchanged, the parts of each weight's remembered call (``linear_repeats.remembered``)."""

    epoch: int
    threads: int
    switches: tuple
    plans: tuple[gemm.PackedLinear, ...]


@dataclass
class _Group:
    """One group of weights: the calls counted on their current versions (per x shape and thread count), their packed
    concatenation once made, and the x shapes whose fused call was decided (``shapes``)."""

    weights: tuple[weakref.ref, ...]
    layouts: tuple[tuple, ...]  # each weight's (version, data pointer, shape, strides) the count and packing are for
    calls: dict[tuple, int] = field(default_factory=dict)  # (x's shape, thread count) -> calls counted
    packed: Tensor | None = None
    nbytes: int = 0
    shapes: dict[torch.Size, _Shape] = field(default_factory=dict)


_GROUPS: dict[tuple, _Group] = {}
_FUSED_CHECKS: dict[tuple, bool] = {}


def _layout(weight: Tensor) -> tuple:
    return weight._version, weight.data_ptr(), weight.shape, weight.stride()


def run(x: Tensor, weights: Sequence[Tensor], host: HostGuard) -> tuple[Tensor, ...] | None:
    """``tuple(linear(x, w) for w in weights)`` (no biases) in one GEMM on the weights packed as one, where that is
    allowed (the module's docstring); else None."""
    if (len(weights) < 2 or not isinstance(x, Tensor)
            or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))):
        return None  # (a GEMM autograd records: each linear's own, never packed)
    loops = compiled_loops.library()
    group = _GROUPS.get((tuple(map(id, weights)), id(host), x.dtype))
    if (group is not None and group.packed is not None and (shape := group.shapes.get(x.shape)) is not None
            and shape.epoch == host.epoch and shape.threads == torch.get_num_threads() and x.is_cpu
            and _holds(group, weights) and gemm.plan_switches(x.dtype, loops) == shape.switches):
        return _fused_call(x, group.packed, shape.plans, loops)  # a call like one decided before: nothing changed
    return _decided_run(x, weights, host, loops)


def _decided_run(x: Tensor, weights: Sequence[Tensor], host: HostGuard, loops: object) -> tuple[Tensor, ...] | None:
    """``run`` where no decision for this call is kept: each weight's remembered plan asked, the group's calls counted,
    the checks made, the weights packed as one -- and the decision kept for the next call of x's shape."""
    group = _group(weights, host, x.dtype)
    if group.packed is None:  # every call counted, per call shape and thread count, as a weight's plan counts its own
        count = (x.shape, torch.get_num_threads())
        group.calls[count] = calls = group.calls.get(count, 0) + 1
        if calls <= gemm.PACK_AFTER_CALLS:
            return None
    plans = []
    for weight in weights:
        kept = linear_repeats.remembered(x, weight, host)
        if kept is None or kept.plan.packed is None:
            return None
        plans.append(kept.plan.packed)
    first, k = plans[0], x.shape[-1]
    if any((p.dtype, p.block, p.blocks, p.tiled) != (first.dtype, first.block, first.blocks, first.tiled)
           for p in plans[1:]):
        return None
    if not all(p.agrees(k) for p in plans) or not _fused_agrees(plans, k):
        return None
    if group.packed is None:
        nbytes = sum(p.n_pad for p in plans) * k * first.dtype.itemsize
        if not gemm._room_for(nbytes + sum(g.nbytes for g in _GROUPS.values())):
            return None
        with torch.no_grad():
            group.packed = onednn_packed(torch.cat([p.operand(w) for p, w in zip(plans, weights)]))
        group.nbytes = nbytes
    group.shapes[x.shape] = _Shape(host.epoch, torch.get_num_threads(), gemm.plan_switches(x.dtype, loops),
                                   tuple(plans))
    return _fused_call(x, group.packed, tuple(plans), loops)


def _group(weights: Sequence[Tensor], host: HostGuard, dtype: torch.dtype) -> _Group:
    """The group of these weights for this guard and dtype (whatever x's row count: one packed concatenation serves
    every call shape, as one packed weight does): found, or made afresh where a weight is new or changed (its packed
    concatenation and decisions dropped, its calls counted from none)."""
    key = (tuple(map(id, weights)), id(host), dtype)
    group = _GROUPS.get(key)
    if group is not None and _holds(group, weights):
        return group
    if len(_GROUPS) >= GROUPS_MAX:
        _GROUPS.clear()
    forget = _forgetter(key)
    group = _GROUPS[key] = _Group(tuple(weakref.ref(w, forget) for w in weights), tuple(map(_layout, weights)))
    return group


def _holds(group: _Group, weights: Sequence[Tensor]) -> bool:
    """Whether ``group`` is these weights as they are now (the same tensors, unchanged since it counted them)."""
    return group.layouts == tuple(map(_layout, weights)) and all(r() is w for r, w in zip(group.weights, weights))


def _forgetter(key: tuple):
    """A weight's weak-reference callback: its groups go with it (``_GROUPS`` bound in the callback, as
    ``linear_repeats._forget`` binds its dictionary)."""
    def forget(ref: weakref.ref, groups: dict = _GROUPS) -> None:
        kept = groups.get(key)
        if kept is not None and ref in kept.weights:
            del groups[key]
    return forget


def _fused_call(x: Tensor, packed: Tensor, plans: tuple[gemm.PackedLinear, ...], loops: object
                ) -> tuple[Tensor, ...]:
    """The plans' packed call (``gemm_arrangements._packed_run``'s steps: x's rows padded to the tiles, oneDNN's linear)
    once on the weights packed as one, each weight's first ``n`` columns of its ``n_pad`` cut out as its output (a
    contiguous copy) -- in one compiled call where the loops are built (``packed_linears``: the same steps)."""
    first, k = plans[0], x.shape[-1]
    rows_padded = first.blocks * first.block
    if loops is not None:
        buffer = gemm._kept_buffer(x, rows_padded)
        if buffer is not None or x.numel() // k == rows_padded:
            return tuple(loops.packed_linears(x, buffer, packed, first.blocks if first.tiled else 0,
                                              [p.n for p in plans], [p.n_pad for p in plans]))
    x_rows = x.reshape(-1, k)
    rows = x_rows.shape[0]
    out = first.call(x_rows, packed)
    outputs, start = [], 0
    for plan in plans:
        outputs.append(out[:rows, start:start + plan.n].contiguous().view(*x.shape[:-1], plan.n))
        start += plan.n_pad
    return tuple(outputs)


def _fused_agrees(plans: list[gemm.PackedLinear], k: int) -> bool:
    """Whether oneDNN's linear on weights packed as one gives, for the plans' tiles, K, widths and dtype at the current
    thread count, each weight's columns the bits of its own packed call: checked once per key on seeded operands."""
    first = plans[0]
    widths = tuple(p.n_pad for p in plans)
    rows = first.blocks * first.block

    def check() -> bool:
        x, w = gemm._probe_operands(first.dtype, (rows, k), (sum(widths), k))
        tiles = x.view(first.blocks, first.block, k) if first.tiled else x
        fused = onednn_linear(tiles, onednn_packed(w)).reshape(rows, -1)
        parts = [onednn_linear(tiles, gemm.onednn_packed(part.contiguous())).reshape(rows, -1)  # as the plans pack
                 for part in w.split(widths)]
        return torch.equal(fused, torch.cat(parts, dim=1))

    key = (widths, first.blocks, first.block, first.tiled, k, first.dtype, torch.get_num_threads())
    return gemm._checked_once(_FUSED_CHECKS, key, check)
