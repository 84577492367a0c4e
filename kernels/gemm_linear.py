"""The exact CPU kernels' matrix products: fixed GEMM tile arrangements, and the faster ones the guard admits.

Three products serve the ops of ``cpu_exact``:

- ``tiled_matmul``: x @ W.T, a linear layer's forward and its input gradient (rows = tokens);
- ``transposed_matmul``: a.T @ b, a linear layer's weight gradient (a reduction over the tokens);
- ``batched_matmul``: a @ b per batch entry, attention's backward products.

Each has a *canonical arrangement*: rows zero-padded to whole row tiles (``row_block``), output columns to a
multiple of ``COL_BLOCK``, a reduction over tokens cut into fixed chunks added by a halving tree, every operand
contiguous and ``ALIGNMENT``-aligned -- so an output element's reduction runs through the same GEMM kernel in the
same order whatever the batch, provided the host's GEMM gives a row the same bits for every tile height, position
and tile count (the guard's ``gemm_rows`` probe, per shape class; where it fails, ``host.bmm`` runs the fixed-order
GEMM). A large fp32 linear layer's class may run torch's oneDNN linear op instead of ``torch.bmm`` (the guard's
``onednn_rows``, probed the same way): through ``host.bmm``, in the canonical tiles, since the faster arrangements
below are arrangements of ``torch.bmm``'s calls. Why these tile shapes, with the measurements behind them:
docs/reference/kernels.md, "Why these tiles".

The canonical arrangement copies no weight per call: ``gemm_laid_out`` lays each copy it needs out once per weight
version.
Nor does ``tiled_matmul`` decide anew on every call: its decisions (the
guard's answers, the arrangement, the tile height, the operand) are made once per call key and kept (``TiledPlan``),
so a decode step's linear layer costs a lookup and its GEMM (``tests/kernels/test_tiled_plans.py``).

A *faster arrangement* of the same library calls (fewer copies, one GEMM instead of many) runs only where the
guard's ``same_bits`` probe found that it gives the canonical arrangement's bits for the class
(``HostGuard.arrangement_agrees``), so no result depends on it:

- ``tiled_matmul``'s tiles stacked into one GEMM (``_stacked_matmul``), with the weight as stored where it is an
  input gradient's (no transposing copy); where the last tile is partial and the weight small, the whole tiles
  multiplied where x holds them and the last tile apart (``_split_mm``: no copy of every row);
- ``transposed_matmul``'s chunk GEMMs on views of its inputs (``_transposed_matmul_views``), the last chunk on its
  real rows where that length agrees too.

bf16 operands: where the guard admitted the host's bf16 GEMM for the class (``HostGuard.compute_dtype``, asked through
``tiled_dtype`` / ``transposed_dtype``), ``tiled_matmul`` and ``transposed_matmul`` run their canonical arrangement on
the bf16 operands as they are, each output rounded once to bf16 by the GEMM; elsewhere the caller upcasts them and
they compute in fp32. The faster arrangements below are probed in fp32 and run for fp32 only.

Where the compiled loops are built and the class runs torch's own GEMM (``HostGuard.library_gemm``), the steps
around the GEMM run in one compiled call on the same operands (``compiled_loops``).

The modules, each with one job, lowest first (each imports only those above it in this list):

- ``gemm_tiles``: the tile shapes, where an arrangement pays, the ``same_bits`` probes' inputs, the operands' padding
  and alignment, and the guard's answers and first-use checks kept once;
- ``gemm_laid_out``: weights laid out once per version (``arranged_weight``), and the canonical tiles of an
  ``operand_per_tile`` class (``laid_out_tiles``) with their first-use checks;
- ``gemm_packed``: oneDNN's GEMM on a weight packed once (``PackedLinear``), and a plan's GEMM as ``fused_linears``
  runs it on several weights;
- ``gemm_linear`` (this module): ``tiled_matmul``, its plans (``TiledPlan``) and its tiles stacked in one GEMM;
- ``gemm_weight_gradient``: ``transposed_matmul``;
- ``gemm_batched``: ``batched_matmul``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import compiled_loops, gemm_laid_out, gemm_packed, gemm_tiles
from .host_guard import LIBRARY_DTYPES, HostGuard
from .weight_versions import keeps_per_weight, kept_snapshot

# --------------------------------------------------------------------------- x @ W.T: a linear layer's rows
_DTYPE_PLANS: dict[tuple, torch.dtype] = {}


def tiled_dtype(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> torch.dtype:
    """The dtype ``tiled_matmul`` computes x [M, K] @ weight [N, K].T in, for x and weight in their own dtypes: theirs
    where both are bf16 and the guard admitted the host's bf16 GEMM for the canonical class (K, N padded, the weight
    transposed and shared by every tile; or once per tile in the layout the weight is stored in, where
    ``operand_per_tile``), else fp32. The caller passes x in that dtype.

    The guard's answer is kept per (guard state: ``HostGuard.epoch``, dtype, K, N, the weight's layout, op, thread
    count), as ``tiled_matmul`` keeps its plans: the same answer, asked once."""
    dtype = x.dtype
    if dtype != weight.dtype or dtype not in LIBRARY_DTYPES:  # (compute_dtype's own first answer, without asking)
        return torch.float32
    row_major = gemm_laid_out.stored_row_major(weight)
    key = (host.epoch, dtype, x.shape[1], weight.shape[0], row_major, op, torch.get_num_threads())

    def ask() -> torch.dtype:
        k, n_pad = x.shape[1], gemm_tiles.ceil_to(weight.shape[0], gemm_tiles.COL_BLOCK)
        shared, transposed = gemm_laid_out.canonical_class(weight, dtype, k, n_pad)
        return host.compute_dtype(dtype, gemm_tiles.gemm_class(k, n_pad, transposed=transposed), shared, op)
    return gemm_tiles.asked_once(_DTYPE_PLANS, key, host, ask)


@dataclass(frozen=True)
class TiledPlan:
    """``tiled_matmul``'s decisions for one call key, made once: which arrangement runs (``TILED_ARRANGEMENTS``), its
    tile height and count, and the right operand where it can be held -- ``run(x, weight, host, loops)`` then does
    only the per-call work (x's padding, the GEMM call(s), the slice).

    A plan is a cache of decisions, nothing more: it is made by the very code that decided on every call before
    (``_tiled_plan``), from the same questions to the guard, and is used only where every input of those decisions
    is what it was (the call key: x's shape and dtype; the weight's identity, shape, strides, data pointer and dtype;
    the guard's state, ``HostGuard.epoch``; the op; the thread count; whether the compiled loops and oneDNN are on;
    which ``torch.bmm`` is installed). No decision reads the weight's values, so a plan outlives an in-place update
    of the weight (a training step's new version: the same decisions, made once per weight and call shape rather than
    once per step); what it holds for one version does not. So no bit depends on whether a plan was made or found
    (``tests/kernels/test_tiled_plans.py``).

    The operands it keeps (the weight's own memory, detached: a plan holds no reference to the weight, so the weight
    is freed as before; or the layout ``arranged_weight`` keeps for this weight version; a packed weight) are made at
    the first call on each weight version and kept in ``_WeightPlans.held``, which a new version empties; an operand
    laid out per call (beyond ``ARRANGED_BYTES_MAX``, or a weight whose gradient is being recorded) is made per
    call. Plans are kept per weight (``_PLANS``: dropped with the weight), at most ``PLANS_PER_WEIGHT`` each."""

    arrangement: str
    block: int
    blocks: int
    run: Callable[[Tensor, Tensor, HostGuard, object], Tensor]
    any_rows: bool = False
    """Whether ``run`` takes x [..., K] as it is (and returns [..., n]), not only its rows [M, K]: a plan that switches
    to a weight packed once (``packed_after_use``), whose compiled call copies x's rows itself (``packed_linear``)."""
    packed: gemm_packed.PackedLinear | None = None
    """The packed GEMM the plan switches to (``packed_after_use``), where it has one: what ``fused_linears`` needs to
    run it on several weights packed as one."""
    laid_out: gemm_packed.LaidOutLinear | None = None
    """A ``laid out`` plan's canonical call of a decode step's tiles, where it is one GEMM call on the weight as stored:
    what ``fused_linears`` needs to run it on several weights laid out as one (where not every weight's plan packs)."""


TILED_ARRANGEMENTS = ("stacked, weight as given", "stacked", "laid out", "compiled tiles", "tiles")
"""``TiledPlan.arrangement``: the tiles stacked into one GEMM on the weight as stored, or on the canonical operand;
the tiles on the operand as ``bmm`` lays it out; the canonical tiles in one compiled call; the canonical tiles through
the guard's ``bmm`` (``tiled_matmul``)."""
PLANS_PER_WEIGHT = 64
"""Plans kept per weight (then its plans start afresh): one per (rows, dtype, op, thread count, ...) seen -- a decode
loop needs a few, a training step one per leaf shape and direction, kept from one step's weight version to the
next."""


class _WeightPlans:
    """One weight's plans, and what they keep for its current ``version`` (``held``: operands laid out from it, packed
    runs; emptied when the version moves on, so nothing laid out from an older version is used or kept); dropped with
    the weight (a weak reference's callback)."""

    __slots__ = ("owner", "version", "plans", "held")

    def __init__(self, owner: Tensor, version: int):
        self.owner = weakref.ref(owner, functools.partial(_forget, _PLANS, id(owner)))
        self.version = version
        self.plans: dict[tuple, TiledPlan] = {}
        self.held: dict[int, object] = {}


_PLANS: dict[int, _WeightPlans] = {}  # id(weight owning its storage) -> its plans (a dict by id: a weak-keyed
# dictionary's lookup cost more than the rest of a warm call)


def _forget(plans: dict[int, _WeightPlans], key: int, ref: weakref.ref) -> None:
    """A weight's plans go with it (its weak reference's callback; a new weight under the same id keeps its own).
    ``plans`` is ``_PLANS``, bound in the callback: a weight that outlives the module's globals (one held by a
    script's own globals, freed at interpreter exit) still finds it."""
    kept = plans.get(key)
    if kept is not None and kept.owner is ref:
        del plans[key]


@keeps_per_weight
def _forget_plans(shares_memory: Callable[[Tensor], bool]) -> None:
    """``forget_weight``'s part here: the plans of a weight on the given memory and what they hold (operands, a
    packed weight)."""
    for key, kept in kept_snapshot(_PLANS):
        if (owner := kept.owner()) is not None and shares_memory(owner):
            _PLANS.pop(key, None)


def tiled_matmul(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] through [R, K] x [K, N_pad] GEMM tiles, R = ``row_block(M)``, in x's dtype:
    fp32, or bf16 where ``tiled_dtype`` says so (the weight is cast to it; a bf16 GEMM rounds each output once).

    Canonically one ``host.bmm`` over ceil(M / R) zero-padded row tiles, the (column-padded) weight shared by every
    tile in its class's layout (``gemm_laid_out.canonical_class``: transposed, or below ``ROW_MAJOR_SHARED_MAX``
    elements row-major, laid out once per weight version where that is a copy): each output element's K-reduction
    runs through the same GEMM kernel whatever M is (BLAS or oneDNN where the probe passed, else the fixed-order
    GEMM). Both operands are contiguous and aligned, as in the probe, so a view into a larger tensor never reaches the
    GEMM.

    Where the class runs torch's own GEMM: the tiles stacked into one GEMM where the guard found their bits
    (``_stacked_agrees``) -- first on the weight as given, where it is row-major already (an input gradient's W,
    whose canonical operand is its transposed copy from ``ROW_MAJOR_SHARED_MAX`` elements, else W itself) -- else the
    canonical steps in one compiled call.

    The choice is made once per call key and kept (``TiledPlan``): a repeated call of one class looks its plan up
    and runs the GEMM."""
    if x.shape[0] == 0:  # an empty batch of rows: nothing to arrange (a plan's tile count would be 0)
        return x.new_empty(0, weight.shape[0])
    loops = compiled_loops.library()
    plan = kept_plan(x, weight, host, op, loops)
    if plan is None:  # a plan for this call alone
        plan = _tiled_plan(x, weight, host, op, loops, held=None)
    return plan.run(x, weight, host, loops)


def kept_plan(x: Tensor, weight: Tensor, host: HostGuard, op: str, loops: object) -> TiledPlan | None:
    """``tiled_matmul``'s plan for this call, found or made and kept for the weight (``_PLANS``); None where none is
    kept: an inference tensor (no version counter to key a plan on), a weight whose GEMM autograd records (the
    GEMM on the weight itself, per call), or an x of no rows (a plan of 0 tiles fails in its GEMM; ``tiled_matmul``
    never plans one). ``loops``: ``compiled_loops.library()``."""
    if x.shape[0] == 0:
        return None
    owner = weight._base
    if owner is None:
        owner = weight
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor
        return None
    if weight.requires_grad and torch.is_grad_enabled():
        return None
    key = (host.epoch, op, x.shape, x.dtype, weight.shape, weight.stride(), weight.data_ptr(), weight.dtype,
           torch.get_num_threads(), plan_switches(x.dtype, loops))
    kept = _PLANS.get(id(owner))
    if kept is None or kept.owner() is not owner:  # a new weight
        kept = _PLANS[id(owner)] = _WeightPlans(owner, version)
    elif kept.version != version:  # a new version of it: its plans stay, what they held for the last version goes
        kept.version = version
        kept.held.clear()
    if (plan := kept.plans.get(key)) is not None:
        return plan
    if len(kept.plans) >= PLANS_PER_WEIGHT:
        kept.plans.clear()
        kept.held.clear()
    plan = _tiled_plan(x, weight, host, op, loops, kept.held)
    kept.plans[(host.epoch, *key[1:])] = plan  # the epoch after deciding (a check made in asking may change it)
    return plan


def plan_switches(dtype: torch.dtype, loops: object) -> tuple:
    """The process switches a plan's choice reads, part of its key: whether the compiled loops are built
    (``loops``: ``compiled_loops.library()``), the installed ``torch.bmm``, and for bf16 oneDNN's switch
    (``bmm_copies_operand``'s)."""
    return loops is None, torch.bmm, dtype == torch.bfloat16 and torch.backends.mkldnn.enabled


def tiled_rows(x: Tensor, weight: Tensor, host: HostGuard, op: str = "linear") -> int:
    """The rows ``tiled_matmul`` multiplies for x [M, K] @ weight [N, K].T (x in the dtype ``tiled_dtype`` gives):
    M padded to whole tiles of the height the guard allows for the class (``row_block``). A benchmark's question --
    what the padding costs on a host whose GEMM keeps a row's bits only at taller tiles; it asks the guard as
    ``tiled_matmul`` does (the same probes at first use) and computes nothing."""
    plan = _tiled_plan(x, weight, host, op, compiled_loops.library(), held=None)
    return plan.block * plan.blocks


def _held(weight: Tensor, operand: Tensor) -> bool:
    """Whether ``operand`` is the weight's own memory or a layout ``arranged_weight`` keeps for it (which a plan may
    hold without holding more than ``ARRANGED_BYTES_MAX``)."""
    if operand.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return True
    return gemm_laid_out.kept_for(weight, operand)


def _operand_of(weight: Tensor, get: Callable[[Tensor], Tensor], held: dict | None) -> Callable[[Tensor], Tensor]:
    """weight -> the operand ``get(weight)``: made once per weight version and kept (detached) in ``held`` (the
    weight's ``_WeightPlans.held``, which ``tiled_matmul`` empties when the version moves on) where ``_held`` allows,
    else made per call (``held`` None: a plan made for one call)."""
    if held is None or not _held(weight, operand := get(weight)):
        return get
    slot = gemm_packed.new_held_slot()
    held[slot] = operand.detach()

    def this_version(w: Tensor) -> Tensor:
        operand = held.get(slot)
        if operand is None:  # the first call on a new version of the weight: laid out from it again
            operand = get(w)
            if _held(w, operand):
                held[slot] = operand = operand.detach()
        return operand
    return this_version


def _tiled_plan(x: Tensor, weight: Tensor, host: HostGuard, op: str, loops: object, held: dict | None
                ) -> TiledPlan:
    """The decisions of ``tiled_matmul`` for this call (the guard's questions, the arrangement, the tile height), as a
    ``TiledPlan``; ``held``: where the plan may keep its operands for the weight's current version
    (``_operand_of``), None for a plan made for one call."""
    rows, k = x.shape
    n = weight.shape[0]
    n_pad = gemm_tiles.ceil_to(n, gemm_tiles.COL_BLOCK)
    dtype = x.dtype
    shared, transposed = gemm_laid_out.canonical_class(weight, dtype, k, n_pad)
    per_tile = not shared
    # the canonical operand [1, K, N_pad] in the class's layout: as the weight is stored where the class takes it so
    # (once per tile, or an input gradient's W row-major), else the weight transposed (padded, cast)
    operand_of = (gemm_laid_out.stored_operand if per_tile
                  else gemm_laid_out.canonical_operand if transposed else gemm_laid_out.row_major_operand)
    given = weight.t()  # [K, N]: an input gradient's weight W, contiguous, which the canonical operand copies
    if (loops is not None and n_pad == n and dtype == weight.dtype and given.is_contiguous()
            and given.data_ptr() % gemm_tiles.ALIGNMENT == 0 and rows * k * n <= gemm_tiles.STACKED_MACS_MAX):
        if (record := host.library_gemm(dtype, gemm_tiles.gemm_class(k, n, transposed=transposed), shared, op)
                ) is not None:
            block = gemm_tiles.row_block(rows, record.tile_heights)
            blocks = -(-rows // block)
            if _stacked_agrees(blocks, block, k, n, transposed=transposed, row_major=True, host=host, op=op,
                               dtype=dtype, per_tile=per_tile):
                as_given = _operand_of(weight, lambda w: w.t(), held)  # (the operand [1, K, N]'s matrix)
                apart = _last_tile_apart(rows, blocks, block, k, n, transposed=transposed, row_major=True, host=host,
                                         op=op, dtype=dtype, per_tile=per_tile)

                def stacked_as_given(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                    return _stacked_mm(x, as_given(w), blocks * block, n, apart)
                return TiledPlan(TILED_ARRANGEMENTS[0], block, blocks, stacked_as_given)

    def canonical() -> Callable[[Tensor], Tensor]:  # the canonical operand [1, K, N_pad], in the class's layout
        return _operand_of(weight, lambda w: operand_of(w, dtype, n_pad), held)

    # the class of the canonical operand [1, K, N_pad]: the weight transposed (and padded, cast), a K-contiguous view;
    # or, once per tile, row-major where the weight is stored so (an input gradient's W)
    if (record := host.library_gemm(dtype, gemm_tiles.gemm_class(k, n_pad, transposed=transposed), shared, op)
            ) is not None:
        block = gemm_tiles.row_block(rows, record.tile_heights)
        blocks = -(-rows // block)
        # bf16: one tile too (the host's bf16 bmm took 4x as long as its matmul on a shared, transposed operand)
        if (loops is not None and (blocks > 1 or dtype != torch.float32)
                and blocks * block * k * n_pad <= gemm_tiles.STACKED_MACS_MAX
                and _stacked_agrees(blocks, block, k, n_pad, transposed=transposed and k > 1, row_major=False,
                                    host=host, op=op, dtype=dtype, per_tile=per_tile)):
            matrix = _operand_of(weight, lambda w: operand_of(w, dtype, n_pad)[0], held)
            apart = _last_tile_apart(rows, blocks, block, k, n_pad, transposed=transposed and k > 1, row_major=False,
                                     host=host, op=op, dtype=dtype, per_tile=per_tile)

            def stacked(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                return _stacked_mm(x, matrix(w), blocks * block, n, apart)
            packs = (held is not None and dtype == torch.bfloat16 and not gemm_laid_out.stored_row_major(weight)
                     and gemm_packed.packable(k, n_pad, dtype, blocks * block))
            packed = gemm_packed.PackedLinear(gemm_packed.PACKED_FORMS[0], dtype, block, blocks, n, n_pad,
                                              gemm_packed.PACKED_CALLS[0]) if packs else None
            if packed:  # (bf16's torch.mm is oneDNN's GEMM; a forward's weight, not an input gradient's W)
                stacked = gemm_packed.packed_after_use(stacked, packed, k, held)
            return TiledPlan(TILED_ARRANGEMENTS[1], block, blocks, stacked, any_rows=packs, packed=packed)
        if per_tile and (plan := _laid_out_plan(weight, dtype, k, n, n_pad, block, blocks, transposed, held)):
            return plan
        if loops is not None and shared:  # the library GEMM: the steps below in one compiled call, on the same operands
            operand = canonical()

            def compiled_tiles(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
                return loops.tiled_matmul(x, operand(w), block, n)
            return TiledPlan(TILED_ARRANGEMENTS[3], block, blocks, compiled_tiles)
    if per_tile and (record := host.single_thread_gemm(dtype, gemm_tiles.gemm_class(k, n_pad, transposed=transposed),
                                                         shared, op)) is not None:
        # a class the guard runs with 1 thread (``blas-1-thread``: an Intel host's bf16 GEMMs at 2 threads): the
        # canonical call's forms as above, each GEMM on one thread, so the canonical call's once-per-tile operand is
        # laid out once per weight version or not at all (its copy per call was most of llama100m's bf16 input
        # gradients on that host)
        block = gemm_tiles.row_block(rows, record.tile_heights)
        blocks = -(-rows // block)
        if plan := _laid_out_plan(weight, dtype, k, n, n_pad, block, blocks, transposed, held, one_thread=True):
            return plan
    operand = canonical()
    block = gemm_tiles.row_block(rows, host.tile_heights(dtype, operand(weight), shared, op))
    blocks = -(-rows // block)

    def tiles(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:
        x = gemm_tiles.padded_or_aligned(x, (blocks * block, k)).view(blocks, block, k)
        right = gemm_laid_out.per_tile_operand(operand(w), blocks) if per_tile else operand(w).expand(blocks, k, n_pad)
        out = host.bmm(x, right, op=op, shared_operand=shared).view(blocks * block, n_pad)
        return out[:rows] if n_pad == n else out[:rows, :n]
    packs = (held is not None and shared and gemm_packed.packable(k, n_pad, dtype)
             and host.onednn_gemm(dtype, operand(weight), shared, op) is not None)
    packed = gemm_packed.PackedLinear(gemm_packed.PACKED_FORMS[1], dtype, block, blocks, n, n_pad,
                                      gemm_packed.PACKED_CALLS[1]) if packs else None
    if packed:
        tiles = gemm_packed.packed_after_use(tiles, packed, k, held)
    return TiledPlan(TILED_ARRANGEMENTS[4], block, blocks, tiles, any_rows=packs, packed=packed)


def _laid_out_plan(weight: Tensor, dtype: torch.dtype, k: int, n: int, n_pad: int, block: int, blocks: int,
                   transposed: bool, held: dict | None, one_thread: bool = False) -> TiledPlan | None:
    """The ``laid out`` plan of an ``operand_per_tile`` class (``laid_out_tiles`` in its form, on
    ``laid_out_operand``) where the first-use check found the form's bits the canonical call's
    (``laid_out_agrees``), else None. ``one_thread``: a ``blas-1-thread`` class, every GEMM on one thread. A decode
    step's call (one tile, or a few) runs on the weight packed once after ``PACK_AFTER_CALLS`` calls, one oneDNN call
    per tile, where ``packable`` and the first-use check (``packed_agrees``, form ``canonical call``) allow."""
    form = gemm_laid_out.laid_out_form(blocks, k, n_pad)
    if not gemm_laid_out.laid_out_agrees(block, k, n_pad, dtype, form, transposed, one_thread=one_thread):
        return None
    laid = _operand_of(weight, lambda w: gemm_laid_out.laid_out_operand(w, dtype, n_pad, blocks, form), held)
    # a tile's GEMM in column blocks only where they, too, give the canonical call's bits (else whole tiles)
    whole_tiles = form != gemm_laid_out.LAID_OUT_FORMS[1] and not gemm_laid_out.column_blocks_agree(
        block, k, n_pad, dtype, transposed, one_thread=one_thread)

    def rows_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [M, K] -> [M, n]
        return gemm_laid_out.laid_out_tiles(x, laid(w), block, blocks, n, form, one_thread=one_thread,
                                             whole_tiles=whole_tiles)

    def compiled_run(x: Tensor, w: Tensor, host: HostGuard, loops: object) -> Tensor:  # x [..., K] -> [..., n]
        if loops is not None and (given := gemm_tiles.loop_input(x, blocks * block)):
            # rows_run's steps in one compiled call (a decode step's: the same copy and bmm, the same bits)
            return loops.bmm_linears(x, given.buffer, laid(w), blocks, [n], [n_pad])[0]
        return gemm_packed.on_rows(rows_run, x, w, host, loops)
    compiled = form == gemm_laid_out.LAID_OUT_FORMS[1] and not one_thread  # the canonical call itself: one bmm
    laid_out = compiled_run if compiled else rows_run
    # a forward's weight, kept
    forward = held is not None and not one_thread and not gemm_laid_out.stored_row_major(weight)
    # several tiles only on a weight of at least ONEDNN_MIN_WEIGHT elements: a smaller one's calls, one per tile, cost
    # more than the canonical call's one (the default model's 64 x 176 weights, 128 rows: 1.5x; llama100m's 576 x
    # 1536 ones, 2 to 5 tiles: 0.89-0.94x; the journal, session 59)
    packs = forward and (gemm_packed.packable(k, n_pad, dtype, block) if blocks == 1
                         else gemm_packed.packable(k, n_pad, dtype))
    packed = gemm_packed.PackedLinear(gemm_packed.PACKED_FORMS[2], dtype, block, blocks, n, n_pad,
                                      gemm_packed.PACKED_CALLS[2]) if packs else None
    if packed:
        # a decode loop's tiles (where no stacked arrangement runs: a guard in mode ``canonical``, or a host whose
        # ``same_bits`` probe failed): oneDNN's linear on the weight packed once, one call per tile (calls of one
        # shape, whatever the rows), where it gives the canonical call's bits (the call oneDNN's bmm makes reorders
        # the weight every time: llama100m's LM head, 8 rows in a 48-row tile, bf16, on an Intel Xeon with AMX: 10.6
        # ms a call unpacked, 4.4 packed, the journal, session 38; the default model's 128 rows in two 64-row tiles,
        # session 59)
        laid_out = gemm_packed.packed_after_use(laid_out, packed, k, held)
    call = None  # (also where the plan packs: a group of weights some of which pack and some not fuses as this call)
    if forward and form != gemm_laid_out.LAID_OUT_FORMS[2]:
        call = gemm_packed.LaidOutLinear(form, dtype, block, blocks, n, n_pad, whole_tiles)
    return TiledPlan(TILED_ARRANGEMENTS[2], block, blocks, laid_out, any_rows=packs or compiled, packed=packed,
                     laid_out=call)


# --------------------------------------------------------------------------- the tiles stacked in one GEMM
def _stacked_agrees(blocks: int, block: int, k: int, n_pad: int, *, transposed: bool, row_major: bool,
                    host: HostGuard, op: str, dtype: torch.dtype = torch.float32, per_tile: bool = False,
                    last_apart: bool = False) -> bool:
    """Whether one GEMM over ``blocks`` stacked ``block``-row tiles gives the tiles' own bits (the one ``bmm`` call of
    ``tiled_matmul``, each tile multiplying the shared operand [1, K, N_pad], ``transposed`` or row-major; where
    ``per_tile``, the operand once per tile in that layout: ``per_tile_operand``) for this class on this host;
    ``row_major``: with the operand's values in the row-major layout (an input gradient's weight as it is, where the
    canonical operand is its transposed copy). A ``same_bits`` probe at first use per (tile count, tile height, K,
    N_pad, layouts, ``dtype``: fp32 or bf16), on seeded inputs (``probe_operands``).

    The tiles keep a row's bits independent of the row count; one GEMM packs the shared operand once instead of
    once per tile (llama's LM head: a 113 MB weight, 5 tiles for 312 tokens), and the weight as it is saves a
    transposing copy of it. Where the library's result for a row would differ, the probe sees it and the tiles
    run.

    ``last_apart``: the same GEMM with its last tile in a GEMM of its own (``_split_mm``), for a call whose last tile
    is partial -- probed on ``blocks * block - 1`` rows (the last tile one row short, as the tiles zero-pad it)."""
    rows = blocks * block - (1 if last_apart else 0)

    def inputs(layout_transposed: bool) -> tuple[Tensor, Tensor]:
        x, w = gemm_tiles.probe_operands(dtype, (blocks * block, k), (n_pad, k))  # w: the weight's values, [N_pad, K]
        x[rows:] = 0  # (the tiles' zero padding)
        return x, (w.t() if layout_transposed else w.t().contiguous()).unsqueeze(0)

    def tiles() -> Tensor:
        x, w = inputs(transposed)
        right = gemm_laid_out.per_tile_operand(w, blocks) if per_tile else w.expand(blocks, k, n_pad)
        return torch.bmm(x.view(blocks, block, k), right).view(blocks * block, n_pad)[:rows]

    def stacked() -> Tensor:
        x, w = inputs(transposed and not row_major)
        if last_apart:
            return _split_mm(x[:rows], w[0], blocks * block, n_pad, block)
        return _stacked_matmul(x, w, blocks * block, n_pad)

    layout = ("transposed" if transposed else "row-major") + (" batch" if per_tile else "")
    given = ", the weight as given (row-major)" if row_major else ""
    name = "linear tiles stacked in one GEMM" + (", the last tile apart" if last_apart else "")
    return host.arrangement_agrees(
        name, f"{blocks}x{block} rows K={k} N={n_pad} {layout}{given} {gemm_tiles.dtype_label(dtype)}", tiles, stacked,
        op)


def _last_tile_apart(rows: int, blocks: int, block: int, k: int, n_pad: int, *, transposed: bool, row_major: bool,
                     host: HostGuard, op: str, dtype: torch.dtype, per_tile: bool) -> int:
    """The tile height where a stacked GEMM of ``rows`` rows (a class whose ``_stacked_agrees`` passed) multiplies its
    last, partial tile apart (``_split_mm``), else 0: where that tile is partial and there are whole tiles before it,
    the weight is small (``APART_WEIGHT_BYTES_MAX``), the class fp32 and the guard found the split's bits the tiles'
    (the same probe, ``last_apart``). Not bf16: on the Intel Xeon with AMX every bf16 class's probe refused it (the
    last tile's GEMM at 2 threads gave other bits than at 1), so asking would only cost the probes."""
    if (blocks < 2 or rows % block == 0 or dtype != torch.float32
            or k * n_pad * dtype.itemsize > gemm_tiles.APART_WEIGHT_BYTES_MAX
            or not _stacked_agrees(blocks, block, k, n_pad, transposed=transposed, row_major=row_major, host=host,
                                   op=op, dtype=dtype, per_tile=per_tile, last_apart=True)):
        return 0
    return block


def _stacked_matmul(x: Tensor, operand: Tensor, padded_rows: int, n: int) -> Tensor:
    """``tiled_matmul``'s tiles as one GEMM: x zero-padded to ``padded_rows`` (the tiles' rows) @ operand[0], sliced
    to [M, n]. Used only where ``_stacked_agrees`` found the tiles' bits."""
    return _stacked_mm(x, operand[0], padded_rows, n)


def _stacked_mm(x: Tensor, operand: Tensor, padded_rows: int, n: int, last_apart: int = 0) -> Tensor:
    """``_stacked_matmul`` on its operand's matrix [K, N_pad] (which a ``TiledPlan`` holds), the output sliced only
    where it has more rows or columns than [M, n]; ``last_apart`` (a tile height, from ``_last_tile_apart``): a
    partial last tile in a GEMM of its own (``_split_mm``)."""
    rows, k = x.shape
    if last_apart and rows % last_apart:
        return _split_mm(x, operand, padded_rows, n, last_apart)
    out = torch.mm(gemm_tiles.padded_rows_input(x, padded_rows), operand)
    if out.shape[1] != n:
        return out[:rows, :n]
    return out if rows == padded_rows else out[:rows]


def _split_mm(x: Tensor, operand: Tensor, padded_rows: int, n: int, block: int) -> Tensor:
    """``_stacked_mm`` with its last, partial tile apart: one GEMM over the whole tiles where x holds them (no copy of
    their rows), one over the last tile zero-padded to ``block`` rows, each into its own rows of one output. Used only
    where ``_stacked_agrees(..., last_apart=True)`` found the tiles' bits."""
    rows, k = x.shape
    x = gemm_tiles.aligned_contiguous(x)
    body = rows - rows % block
    out = x.new_empty(padded_rows, operand.shape[1])
    torch.mm(x[:body], operand, out=out[:body])
    torch.mm(gemm_tiles.zero_padded(x[body:], (block, k)), operand, out=out[body:])
    return out[:rows] if out.shape[1] == n else out[:rows, :n]
