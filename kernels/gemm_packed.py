"""oneDNN's GEMM on a weight packed once, and a plan's GEMM described for ``fused_linears``' call on several
weights (the overview of the matrix products: ``gemm_linear``).

A plan that runs oneDNN's linear op (an fp32 ``onednn_rows`` class's canonical tiles; a bf16 class's ``stacked``
arrangement, whose ``torch.mm`` is oneDNN's) runs it, after ``PACK_AFTER_CALLS`` calls of one weight version, on the
weight packed once in oneDNN's own layout (``host_guard.onednn_packed``): the same GEMM without laying the weight out
per call, used only where a first-use check found its bits equal to the call it replaces (``packed_agrees``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import gemm_laid_out, gemm_tiles
from .host_guard import ONEDNN_MIN_WEIGHT, HostGuard, onednn_linear, onednn_packed, onednn_packing

# --------------------------------------------------------------------------- oneDNN's GEMM on a weight packed once
PACK_AFTER_CALLS = 16
"""Calls of one plan (one weight version, one call shape: a decode loop's steps) after which a GEMM that runs oneDNN's
linear (an fp32 class on ``onednn_rows``; a bf16 class's ``stacked`` arrangement, whose ``torch.mm`` is oneDNN's; a
bf16 ``operand_per_tile`` class's canonical call, whose ``bmm`` is oneDNN's) runs it on the weight packed once
(``host_guard.onednn_packed``) instead of the weight as stored. Packing costs about as much as 10-45 calls save (on an
Intel Xeon with AMX: 0.2-0.55 ms per llama100m layer weight, 25-45 ms for its LM head, against about 1 ms saved per LM
head call; ``vexact bench decode_profile --gemm``), so a weight version pays for it only over a rollout's many steps:
a rollout of fewer steps packs nothing, a longer one repays the layers' packing within 10-15 further steps and the LM
head's within 25-45; a training step alone (one forward per version) never packs, but one that follows a rollout on
the same weight version (the RL step's scoring and update) runs on what the rollout packed (``packed_after_use``)."""
PACKED_FORMS = ("stacked", "tiles", "canonical call")
"""What ``packed_agrees`` compares the packed call with: the ``stacked`` arrangement's one ``torch.mm``, the
canonical tiles' oneDNN linear on the weight as stored (``tiles``, an fp32 ``onednn_rows`` class), or the canonical
call of the tiles of an ``operand_per_tile`` class (``canonical call``: one ``bmm`` of the tiles, the weight as stored
once per tile, a transposed batch; the packed call one per tile)."""
_PACKED_CHECKS: dict[tuple, bool] = {}


PACKED_CALLS = ("rows", "tiles", "each tile")
"""How ``PackedLinear.call`` gives x's padded rows to oneDNN's linear: stacked, [T x block, K], in one call; as the
tiles [T, block, K] in one call; one call per tile [block, K] (calls of one fixed shape whatever the row count: what a
host whose GEMM's bits follow the rows in a call gives each tile the one-tile call's bits by construction)."""


@dataclass(frozen=True)
class _WeightCall:
    """A plan's GEMM on a forward's weight, described for a call on several weights stacked as one
    (``fused_linears``): ``blocks`` tiles of ``block`` rows against the weight's operand [N_pad, K] in ``dtype``, its
    first ``n`` of ``n_pad`` columns kept; ``form``: which call of the plan it is."""

    form: str
    dtype: torch.dtype
    block: int
    blocks: int
    n: int
    n_pad: int

    def operand(self, weight: Tensor) -> Tensor:
        """The weight's operand [N_pad, K] in the plan's dtype (the canonical operand's matrix)."""
        return gemm_laid_out.canonical_operand(weight, self.dtype, self.n_pad)[0].t()


@dataclass(frozen=True)
class PackedLinear(_WeightCall):
    """A plan's GEMM on the weight packed once (``_packed_run``): oneDNN's linear on x padded to the tiles (given to
    it as ``calls`` says: ``PACKED_CALLS``) against the weight's ``operand`` packed. ``form``: what ``packed_agrees``
    compares it with (``PACKED_FORMS``)."""

    calls: str

    def agrees(self, k: int) -> bool:
        """Whether the packed call gives the plan's own bits (``packed_agrees``: checked once per key)."""
        return packed_agrees(self.form, self.blocks, self.block, k, self.n_pad, self.dtype)

    @property
    def packed_form(self) -> tuple:
        """``arranged_weight``'s form of the packed weight: one per (dtype, N_pad), whatever the plan's rows."""
        return "onednn packed", self.dtype, self.n_pad

    def prepared(self, matrix: Tensor) -> Tensor:
        """``matrix`` [N, K] (operands stacked) as the plan's call multiplies it: packed once."""
        return onednn_packed(matrix)

    def loop_arguments(self) -> tuple[int, bool]:
        """How the compiled calls (``packed_linear``, ``packed_linears``) are told ``calls``: (tiles, one call each)."""
        return (0 if self.calls == PACKED_CALLS[0] else self.blocks), self.calls == PACKED_CALLS[2]

    def call(self, x: Tensor, packed: Tensor) -> Tensor:
        """The packed call on x's rows [M, K]: padded to the plan's tiles (``padded_rows_input``), then oneDNN's linear
        on ``packed`` over them as ``calls`` says -> [blocks x block, N] (every column ``packed`` has)."""
        return packed_calls(gemm_tiles.padded_rows_input(x, self.blocks * self.block), packed, self.blocks, self.calls)


@dataclass(frozen=True)
class LaidOutLinear(_WeightCall):
    """A ``laid out`` plan's GEMM in form ``one tile`` or ``one call`` (``laid_out_tiles``: one ``mm`` of the tile,
    or one ``bmm`` of the tiles, on the weight's ``operand`` seen as a transposed batch, ``stored_operand``), as
    ``fused_linears`` runs it on several weights laid out as one; ``whole_tiles`` as the plan runs its tiles
    (``column_blocks_agree``)."""

    whole_tiles: bool

    def packed(self) -> PackedLinear:
        """The same tiles on the weight packed once, one oneDNN call per tile (form ``canonical call``: checked
        against this call's bits before use, ``PackedLinear.agrees``): what a group of weights too small to pack
        alone over several tiles runs where their concatenation is large enough (``fused_linears``)."""
        return PackedLinear(PACKED_FORMS[2], self.dtype, self.block, self.blocks, self.n, self.n_pad, PACKED_CALLS[2])

    def agrees(self, k: int) -> bool:
        """The plan's own form was checked against the canonical call when it was made (``laid_out_agrees``)."""
        return True

    def prepared(self, matrix: Tensor) -> Tensor:
        """``matrix`` [N, K] (operands stacked) as the plan's call multiplies it: a transposed batch [1, K, N], once
        per tile for ``one call`` (``per_tile_operand``)."""
        operand = gemm_laid_out.transposed_batch(matrix.t().unsqueeze(0))
        return (gemm_laid_out.per_tile_operand(operand, self.blocks) if self.form == gemm_laid_out.LAID_OUT_FORMS[1]
                else operand)

    def call(self, x: Tensor, prepared: Tensor) -> Tensor:
        """The plan's call on x's rows [M, K] against ``prepared`` -> [M, N] (every column ``prepared`` has)."""
        return gemm_laid_out.laid_out_tiles(x, prepared, self.block, self.blocks, prepared.shape[2], self.form,
                               whole_tiles=self.whole_tiles)


def packed_calls(rows: Tensor, packed: Tensor, blocks: int, calls: str) -> Tensor:
    """oneDNN's linear on ``packed`` over ``rows`` [blocks x block, K] given to it as ``calls`` says
    (``PACKED_CALLS``) -> [blocks x block, N]: the op calls of ``PackedLinear.call`` and of the first-use checks."""
    if calls == PACKED_CALLS[0]:
        return onednn_linear(rows, packed)  # 2-D in, 2-D out: no view to make per call
    if calls == PACKED_CALLS[1]:
        return onednn_linear(rows.view(blocks, -1, rows.shape[1]), packed).view(rows.shape[0], -1)
    tiles = [onednn_linear(tile, packed) for tile in rows.chunk(blocks)]
    return tiles[0] if blocks == 1 else torch.cat(tiles)


_SLOTS = itertools.count()


def new_held_slot() -> int:
    """A key of a weight's ``_WeightPlans.held`` that no other plan uses: one per operand (or packed run) a plan keeps
    for the weight's current version."""
    return next(_SLOTS)


def packable(k: int, n_pad: int, dtype: torch.dtype, rows: int = 0) -> bool:
    """Whether a class may run on a weight packed once: oneDNN's linear with its packing op here, and a weight of at
    least ``ONEDNN_MIN_WEIGHT`` elements (below it oneDNN's per-call overhead outweighs its kernel) -- or a bf16 GEMM
    of ``rows`` rows that torch runs on oneDNN already (``onednn_bf16_bmm``), where packing only spares the per-call
    reorder of the weight (llama100m's k/v projections, 576 x 192: its bf16 decode step on an Intel Xeon with AMX
    took 0.95x its time unpacked at 1 thread, 0.98x at 2; the journal, session 34)."""
    if not onednn_packing(dtype):  # (bf16 only where this CPU has oneDNN's bf16 kernels)
        return False
    return k * n_pad >= ONEDNN_MIN_WEIGHT or gemm_laid_out.onednn_bf16_bmm(dtype, rows * k * n_pad)


def packed_after_use(unpacked: Callable, plan: PackedLinear, k: int, held: dict) -> Callable:
    """A plan's run: ``unpacked`` for the first ``PACK_AFTER_CALLS`` calls on a weight version, then -- where
    ``plan.agrees(k)`` (the first-use check that the packed call gives the unpacked one's bits for the class) -- the
    packed run (``_packed_run``) made once per version (given the weight at that call: a plan holds no reference to
    it), or ``unpacked`` for the rest of the version where it makes none (no room under ``ARRANGED_BYTES_MAX``). From
    the first call where the weight is packed for this version already (by another plan of it: a decode loop's, whose
    version a training forward or a scoring pass then multiplies at other row counts): the packing costs nothing more.
    The count and the packed run are kept in ``held`` (the weight's ``_WeightPlans.held``: emptied with each new
    version). No bit depends on which ran."""
    slot = new_held_slot()

    def after_use(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K]
        state = held.get(slot)
        if state is None:  # this version's first call: [calls, the packed run]
            state = held[slot] = [0, None]
        if state[1] is None:
            state[0] += 1
            if ((state[0] <= PACK_AFTER_CALLS and gemm_laid_out.kept_operand(w, plan.packed_form) is None)
                    or not plan.agrees(k)):
                return on_rows(unpacked, x, w, host, loops)
            state[1] = _packed_run(w, plan) or functools.partial(on_rows, unpacked)
        return state[1](x, w, host, loops)
    return after_use


def on_rows(run: Callable, x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
    """``run`` (a plan's run on rows [M, K]) on x [..., K]: on x's rows, its output viewed back as [..., n]."""
    if x.dim() == 2:
        return run(x, w, host, loops)
    out = run(x.reshape(-1, x.shape[-1]), w, host, loops)
    return out.view(*x.shape[:-1], out.shape[-1])


def _packed_run(weight: Tensor, plan: PackedLinear) -> Callable[[Tensor, Tensor, HostGuard, object], Tensor] | None:
    """The plan's GEMM on the weight packed once (laid out once per weight version, ``arranged_weight``): x padded to
    the plan's tiles as before, then oneDNN's linear as ``plan.calls`` says (``PACKED_CALLS``). None where the packed
    copy would not fit under ``ARRANGED_BYTES_MAX`` beside what is laid out already (a packed weight held by a plan
    counts against the bound as every laid-out operand does: a model bigger than the bound is not doubled silently)."""
    n, form = plan.n, plan.packed_form
    if (gemm_laid_out.kept_operand(weight, form) is None
            and not gemm_laid_out.room_for(weight.numel() * plan.dtype.itemsize)):
        return None
    packed = gemm_laid_out.arranged_weight(weight, form, lambda: onednn_packed(plan.operand(weight)))
    if gemm_laid_out.kept_operand(weight, form) is not packed:  # (laid out, but over the bound after all: not kept)
        return None
    rows_padded = plan.blocks * plan.block
    tiles, each_tile = plan.loop_arguments()

    def run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K] -> [..., n]
        if loops is not None and (buffer := gemm_tiles.kept_buffer(x, rows_padded)) is not None:
            # the steps below in one compiled call (a decode step's: the same copy and op calls, the same bits)
            return loops.packed_linear(x, buffer, packed, tiles, n, each_tile)
        return on_rows(rows_run, x, w, host, loops)

    def rows_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
        rows = x.shape[0]
        out = plan.call(x, packed)
        if out.shape[1] != n:
            return out[:rows, :n]
        return out if rows == rows_padded else out[:rows]
    return run


def packed_agrees(form: str, blocks: int, block: int, k: int, n_pad: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear on a weight packed once gives, for ``blocks`` tiles of ``block`` rows of the class (K,
    N_pad, ``dtype``) at the current thread count, the bits of the call it replaces (``PACKED_FORMS``): checked once
    per key on seeded operands (``probe_operands``), as the canonical path's other forms are (``checked_once``)."""

    def check() -> bool:
        x, w = gemm_tiles.probe_operands(dtype, (blocks * block, k), (n_pad, k))
        packed = onednn_packed(w)
        if form == PACKED_FORMS[0]:
            return torch.equal(onednn_linear(x, packed), torch.mm(x, w.t()))
        if form == PACKED_FORMS[2]:  # the canonical call, on the canonical operand [1, K, N_pad] of w [N_pad, K]
            operand = gemm_laid_out.transposed_batch(w.t().unsqueeze(0))  # (as ``stored_operand``)
            return torch.equal(packed_calls(x, packed, blocks, PACKED_CALLS[2]),
                               gemm_laid_out.canonical_tiles_call(x, operand, blocks, block))
        tiles = x.view(blocks, block, k)
        return torch.equal(onednn_linear(tiles, packed), onednn_linear(tiles, w))

    return gemm_tiles.checked_once(_PACKED_CHECKS, (form, blocks, block, k, n_pad, dtype, torch.get_num_threads()),
                                    check)
