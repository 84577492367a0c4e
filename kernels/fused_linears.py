"""Linear layers of one input in one GEMM, where that gives each layer its own bits (``cpu_exact.linears``).

A decode step multiplies a layer's normed hidden state by three weights (q, k, v) and the MLP's input by two (gate,
up): five GEMMs of a few rows where two would do, as vLLM's fused projections do. oneDNN's linear on the weights packed
as one ([N_1 + N_2 + ..., K]) computes each output column from x and that column's weight row, as the separate calls
do; whether its bits are theirs is a property of the host's oneDNN, so it is checked at first use, per (tiles, K, the
weights' widths, dtype, thread count), on seeded operands (as ``gemm_packed.packed_agrees`` checks one packed
weight), and the fused call runs only where it passed.

It runs where each weight's call like this one is remembered (``linear_repeats``: a decode loop's, with no gradient
recorded), each such call's plan runs oneDNN's linear on its weight packed once (``TiledPlan.packed``), with the same
tiles for every weight, and gives the plan's own bits (``PackedLinear.agrees``) -- or, where no plan packs, each runs
the canonical call of a decode step's tiles as one GEMM call on the weight as stored (``TiledPlan.laid_out``: a
guard in mode ``canonical``, or a host whose ``same_bits`` probes fail, on weights too small to pack over several
tiles); the same check then compares the GEMM on the weights laid out as one with each weight's own call. Either
from the call at which one weight would pack: after ``PACK_AFTER_CALLS`` calls of the group on the weights' current
versions, at one call shape and thread count (a short rollout fuses nothing). Elsewhere ``run`` returns None and the
caller runs each linear. No bit depends on which ran.

The weights packed (or laid out) as one are kept per group (the weights, the guard, the GEMM's dtype) and call form
while every weight is unchanged (its version counter, storage and view), counted against
``gemm_laid_out.ARRANGED_BYTES_MAX`` with the operands laid out there, and dropped with any of the weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from . import compiled_loops, gemm_laid_out, gemm_linear, gemm_packed, gemm_tiles, linear_repeats
from .host_guard import ONEDNN_MIN_WEIGHT, HostGuard, onednn_packed, onednn_packing
from .weight_versions import keeps_per_weight, kept_snapshot

GROUPS_MAX = 1024
"""Groups kept at most (then afresh): one per (weights, guard, dtype) -- a model's q/k/v and gate/up per layer."""


FusedPlan = gemm_packed.PackedLinear | gemm_packed.LaidOutLinear
"""A weight's plan as the fused call runs it: on the weights packed as one, or laid out as one."""


class _Shape(NamedTuple):
    """What a group's fused call of one x shape runs (each weight's plan, the group's operand for it) and what that
    was decided under: the guard's state, the thread count and the process switches
    (``gemm_linear.plan_switches``) -- with the weights unchanged, the parts of each weight's remembered call
    (``linear_repeats.remembered``)."""

    epoch: int
    threads: int
    switches: tuple
    plans: tuple[FusedPlan, ...]
    operand: Tensor


@dataclass
class _Group:
    """One group of weights: the calls counted on their current versions (per x shape and thread count), their
    concatenation as each call form multiplies it once made (``operands``: packed, or laid out per tile count), and
    the x shapes whose fused call was decided (``shapes``)."""

    weights: tuple[weakref.ref, ...]
    layouts: tuple[tuple, ...]  # each weight's (version, data pointer, shape, strides) the count and packing are for
    calls: dict[tuple, int] = field(default_factory=dict)  # (x's shape, thread count) -> calls counted
    operands: dict[tuple, Tensor] = field(default_factory=dict)  # _call_form(plan) -> the weights as one
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
    if (group is not None and (shape := group.shapes.get(x.shape)) is not None
            and shape.epoch == host.epoch and shape.threads == torch.get_num_threads() and x.is_cpu
            and _holds(group, weights) and gemm_linear.plan_switches(x.dtype, loops) == shape.switches):
        return _fused_call(x, shape.operand, shape.plans, loops)  # a call like one decided before: nothing changed
    return _decided_run(x, weights, host, loops)


def _decided_run(x: Tensor, weights: Sequence[Tensor], host: HostGuard, loops: object) -> tuple[Tensor, ...] | None:
    """``run`` where no decision for this call is kept: each weight's remembered plan asked, the group's calls counted,
    the checks made, the weights packed (or laid out) as one -- and the decision kept for the next call of x's
    shape."""
    group = _group(weights, host, x.dtype)
    if not group.operands:  # every call counted (the first too), per call shape and thread count, as a plan counts
        count = (x.shape, torch.get_num_threads())
        group.calls[count] = calls = group.calls.get(count, 0) + 1
        if calls <= gemm_packed.PACK_AFTER_CALLS:
            return None
    kept = [linear_repeats.remembered(x, weight, host) for weight in weights]
    if any(call is None for call in kept):
        return None
    plans = _group_plans([call.plan for call in kept], x.shape[-1])
    if plans is None:
        return None
    first, k = plans[0], x.shape[-1]
    if not all(p.agrees(k) for p in plans) or not _fused_agrees(plans, k):
        return None
    operand = group.operands.get(key := _call_form(first))
    if operand is None:
        matrices = [p.operand(w) for p, w in zip(plans, weights)]
        with torch.no_grad():
            operand = prepared(first, torch.cat(matrices))
        nbytes = operand.numel() * operand.element_size() if not operand.is_mkldnn else sum(
            m.numel() * m.element_size() for m in matrices)
        if not gemm_laid_out.room_for(nbytes + sum(g.nbytes for _, g in kept_snapshot(_GROUPS))):
            return None
        group.operands[key] = operand
        group.nbytes += nbytes
    group.shapes[x.shape] = _Shape(host.epoch, torch.get_num_threads(), gemm_linear.plan_switches(x.dtype, loops),
                                   tuple(plans), operand)
    return _fused_call(x, operand, tuple(plans), loops)


def _group_plans(plans: list[gemm_linear.TiledPlan], k: int) -> list[FusedPlan] | None:
    """How the group's call runs its weights' plans: the packed call where every plan packs alike; else, where every
    plan runs the canonical call of its tiles (``TiledPlan.laid_out``: some weights too small to pack alone over
    several tiles, as llama100m's k/v beside its q, or all of them), that call packed, one oneDNN call per tile, where
    the weights together are large enough to pack (``ONEDNN_MIN_WEIGHT``), else laid out as one; None where the plans
    differ."""
    for calls in ([p.packed for p in plans], [p.laid_out for p in plans]):
        if all(calls) and all(_call_form(c) == _call_form(calls[0]) for c in calls[1:]):
            break
    else:
        return None
    if (isinstance(calls[0], gemm_packed.LaidOutLinear) and onednn_packing(calls[0].dtype)
            and sum(c.n_pad for c in calls) * k >= ONEDNN_MIN_WEIGHT):
        return [c.packed() for c in calls]
    return calls


def _call_form(plan: FusedPlan) -> tuple:
    """What must be equal across a group's plans for one call to serve them all, and what its operand is kept by: the
    plan's kind and form, dtype and tiles (and how the tiles are called)."""
    extra = plan.calls if isinstance(plan, gemm_packed.PackedLinear) else plan.whole_tiles
    return type(plan).__name__, plan.form, plan.dtype, plan.block, plan.blocks, extra


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


@keeps_per_weight
def _forget_groups(shares_memory: Callable[[Tensor], bool]) -> None:
    """``forget_weight``'s part here: every group holding a weight on the given memory (its weights as one, its
    decisions and call counts)."""
    for key, group in kept_snapshot(_GROUPS):
        if any((weight := ref()) is not None and shares_memory(weight) for ref in group.weights):
            _GROUPS.pop(key, None)


def _fused_call(x: Tensor, operand: Tensor, plans: tuple[FusedPlan, ...], loops: object) -> tuple[Tensor, ...]:
    """The plans' call (x's rows padded to the tiles, the GEMM) once on the weights packed or laid out as one
    (``operand``), each weight's first ``n`` columns of its ``n_pad`` cut out as its output (a contiguous copy) -- in
    one compiled call where the loops are built (``packed_linears``, ``bmm_linears``: the same steps)."""
    first, k = plans[0], x.shape[-1]
    packed = isinstance(first, gemm_packed.PackedLinear)
    if (loops is not None and (packed or first.form == gemm_laid_out.LAID_OUT_FORMS[1])
            and (given := gemm_tiles.loop_input(x, first.blocks * first.block))):
        widths, pads = [p.n for p in plans], [p.n_pad for p in plans]
        if not packed:  # the canonical call of the tiles, one bmm (``bmm_linears``)
            return tuple(loops.bmm_linears(x, given.buffer, operand, first.blocks, widths, pads))
        tiles, each_tile = first.loop_arguments()
        return tuple(loops.packed_linears(x, given.buffer, operand, tiles, widths, pads, each_tile))
    x_rows = x.reshape(-1, k)
    rows = x_rows.shape[0]
    out = first.call(x_rows, operand)
    outputs, start = [], 0
    for plan in plans:
        outputs.append(out[:rows, start:start + plan.n].contiguous().view(*x.shape[:-1], plan.n))
        start += plan.n_pad
    return tuple(outputs)


def _fused_agrees(plans: list[FusedPlan], k: int) -> bool:
    """Whether the plans' call on weights packed (or laid out) as one gives, for the plans' call form, K and widths at
    the current thread count, each weight's columns the bits of its own call: checked once per key on seeded
    operands."""
    first = plans[0]
    widths = tuple(p.n_pad for p in plans)
    rows = first.blocks * first.block

    def check() -> bool:
        x, w = gemm_tiles.probe_operands(first.dtype, (rows, k), (sum(widths), k))
        fused = first.call(x, prepared(first, w))
        parts = [first.call(x, first.prepared(part.contiguous())) for part in w.split(widths)]  # as the plans run
        return torch.equal(fused, torch.cat(parts, dim=1))

    key = (widths, _call_form(first), k, torch.get_num_threads())
    return gemm_tiles.checked_once(_FUSED_CHECKS, key, check)


def prepared(plan: FusedPlan, matrix: Tensor) -> Tensor:
    """``plan.prepared(matrix)`` with the packing op this module calls (so a test may swap the fused packing alone)."""
    if isinstance(plan, gemm_packed.PackedLinear):
        return onednn_packed(matrix)
    return plan.prepared(matrix)
