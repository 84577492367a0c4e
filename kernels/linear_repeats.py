"""A decode loop's repeated linear calls, without their per-call questions (``cpu_exact.linear``).

A decode step calls every linear layer once, with the shapes of the step before. Each call of ``cpu_exact.linear``
checks its inputs, asks the dtype its GEMM runs in (``gemm_linear.tiled_dtype``) and looks its plan up
(``tiled_matmul``: a key of twelve parts) before the plan runs -- in a decode step, where the GEMMs themselves ran at
native's speed, a share of the step's excess: llama100m's bf16 step (8 rows, an Intel Xeon with AMX, 2 threads) took
0.98x its time with these calls remembered (the journal, session 48).

So a call with no gradient to record and no bias, whose GEMM runs in the inputs' own dtype, is remembered per
(weight, guard, x's shape): the plan it ran. The next such call runs that plan at once where everything the plan's
choice and the input check read is as it was: the same weight tensor (its version counter, storage, shape and
strides), x's dtype and device, the guard's state (``HostGuard.epoch``: one counter for every guard, so it names the
guard as well), the thread count and the process switches (``gemm_linear.plan_switches``) -- the parts of
``tiled_matmul``'s key, and what ``checks.linear`` reads (so inputs that passed it pass again). No bit depends
on it: the same plan runs on the same operands."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import compiled_loops, gemm_linear
from .host_guard import HostGuard
from .weight_versions import keeps_per_weight, kept_snapshot

REMEMBERED_MAX = 4096
"""Calls remembered at most (then afresh): one per (weight, guard, x's shape) -- a model's linear layers under one
guard at a decode step's shape, and at its prefill's, and an MoE expert's at each row count its tokens come in."""
OP = "linear"
"""The op whose calls are remembered (the guard's name for a linear layer's GEMMs)."""


class _Remembered(NamedTuple):
    """A remembered call: what ``run`` compares (the weight's and x's, the guard's state, the switches) and the plan."""

    weight: weakref.ref
    version: int
    storage: int
    shape: torch.Size
    strides: tuple[int, ...]
    dtype: torch.dtype
    epoch: int
    threads: int
    switches: tuple  # gemm_linear.plan_switches
    plan: gemm_linear.TiledPlan
    rows: torch.Size  # x as the plan takes it: [M, K]
    out_shape: torch.Size


_REMEMBERED: dict[tuple[int, int, torch.Size], _Remembered] = {}  # (id(weight), id(host), x's shape) -> its last
# call; dropped with the weight (its weak reference's callback): a remembered plan holds what it laid out for it


def run(x: Tensor, weight: Tensor, host: HostGuard) -> Tensor | None:
    """``linear(x, weight)`` (no bias) by the plan a call like this one ran, where one was remembered and nothing it
    rests on changed; else None (the caller takes the whole path, then ``remember``)."""
    if (kept := remembered(x, weight, host)) is None:
        return None
    loops = compiled_loops.library()
    if kept.plan.any_rows:  # (a plan on a weight packed once: x's rows copied in by its compiled call, no views here)
        return kept.plan.run(x, weight, host, loops)
    return kept.plan.run(x.reshape(kept.rows), weight, host, loops).view(kept.out_shape)


def remembered(x: Tensor, weight: Tensor, host: HostGuard) -> _Remembered | None:
    """The call like ``linear(x, weight)`` (no bias) remembered, where nothing it rests on changed since (so its plan
    is the plan this call would run, and x and the weight pass ``checks.linear``); else None."""
    if not isinstance(x, Tensor) or (kept := _REMEMBERED.get((id(weight), id(host), x.shape))) is None:
        return None
    if (kept.weight() is not weight or x.dtype is not kept.dtype or weight._version != kept.version
            or host.epoch != kept.epoch or torch.get_num_threads() != kept.threads or not x.is_cpu
            or weight.data_ptr() != kept.storage or weight.shape != kept.shape or weight.stride() != kept.strides
            or gemm_linear.plan_switches(kept.dtype, compiled_loops.library()) != kept.switches
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    return kept


def remember(x: Tensor, weight: Tensor, host: HostGuard, out: Tensor) -> None:
    """Keep the plan the call ``out = linear(x, weight)`` (no bias, checked) ran, where ``run`` may run it again: no
    gradient recorded, CPU tensors, the GEMM in x's dtype (no conversion around it), a plan ``tiled_matmul`` keeps
    for the weight (not an inference tensor), x with rows (an empty batch runs no plan: ``tiled_matmul`` returns before
    planning, and a plan of 0 tiles fails in its GEMM)."""
    if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or not (x.is_cpu and weight.is_cpu):
        return
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] == 0:
        return
    if gemm_linear.tiled_dtype(x2d, weight, host, OP) != x.dtype:
        return
    loops = compiled_loops.library()
    if (plan := gemm_linear.kept_plan(x2d, weight, host, OP, loops)) is None:
        return
    if len(_REMEMBERED) >= REMEMBERED_MAX:
        _REMEMBERED.clear()
    key = (id(weight), id(host), x.shape)
    _REMEMBERED[key] = _Remembered(
        weakref.ref(weight, functools.partial(_forget, _REMEMBERED, key)), weight._version,
        weight.data_ptr(), weight.shape, weight.stride(), x.dtype, host.epoch, torch.get_num_threads(),
        gemm_linear.plan_switches(x.dtype, loops), plan, x2d.shape, out.shape)


def _forget(remembered: dict, key: tuple[int, int, torch.Size], ref: weakref.ref) -> None:
    """A weight's remembered call goes with it (its weak reference's callback; ``remembered`` is ``_REMEMBERED``, bound
    in the callback, as ``gemm_linear._forget`` binds its dictionary)."""
    kept = remembered.get(key)
    if kept is not None and kept.weight is ref:
        del remembered[key]


@keeps_per_weight
def _forget_calls(shares_memory: Callable[[Tensor], bool]) -> None:
    """``forget_weight``'s part here: the calls remembered on a weight on the given memory."""
    for key, kept in kept_snapshot(_REMEMBERED):
        if (weight := kept.weight()) is not None and shares_memory(weight):
            _REMEMBERED.pop(key, None)
