"""The canonical linear arrangement lays each weight out once per weight version, with the bits of laying it out per
call (``gemm_laid_out.arranged_weight``), and in bf16 copies no weight at all where the class's tiles take the
operand as a transposed batch (``operand_per_tile``).

What changed: the canonical tiles of ``tiled_matmul`` copied the weight on every call -- an input gradient's W.T
made contiguous, a padded or cast weight, and (bf16) the contiguous copy oneDNN's ``bmm`` makes of the shared,
transposed operand before its GEMM. Now each such copy is made once per weight version and kept, and a bf16 class
whose ``bmm`` would copy the shared operand multiplies it once per tile as a transposed batch, which oneDNN takes as
it is. Checked here, in mode ``canonical`` (what a host whose ``same_bits`` probes fail runs), forward and backward,
fp32 and bf16:

- the outputs and gradients equal, bit for bit, those of laying the weight out per call (nothing kept), before and
  after an in-place update of the weight;
- each weight is laid out once per version (counted), and an in-place update lays it out again;
- counter-test: an operand kept whatever the version (stale after the update) is caught;
- after a write the version counter misses (a ``fused=True`` optimizer step), ``forget_weight`` empties every cache
  kept for the weight, and the next calls give a fresh copy's bits;
- torch's bf16 ``bmm`` does copy the shared canonical operand where ``bmm_copies_operand`` says it does (the profiler
  sees the copy), and fp32's does not; it copies no operand as the weight is stored.

Several bf16 forward tiles of a transposed-batch class (``laid_out_tiles``) run as the canonical call (small
operands) or one GEMM per tile on the weight's own matrix, spread over the threads in one compiled call
(``_tile_gemms``): checked bitwise against the canonical call (the guard's
per-tile class, ``HostGuard.bmm``) at 1 and 2 threads, on this host and on the emulated rows-in-call host, with a
counter-test (per-tile GEMMs one ulp off are caught at first use).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import num_threads, recorded_returns
from test_host_guard import emulated_guard
from torch.profiler import ProfilerActivity, profile

from vexact_kernels import (
    compiled_loops,
    cpu_exact,
    forget_weight,
    fused_linears,
    gemm_laid_out,
    gemm_linear,
    gemm_packed,
    linear_repeats,
)
from vexact_kernels.host_guard import FASTER_PATH, SAME_BITS, SINGLE_THREAD_PATH, HostGuard

DTYPES = (torch.float32, torch.bfloat16)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _steps(dtype: torch.dtype, rows: int = 150, k: int = 64, n: int = 40, ops=None) -> list[torch.Tensor]:
    """Two forward + backward passes of a canonical linear layer (N = 40: column padding), an in-place update of
    its weight, then a third: every output and gradient. ``ops``: the exact ops (default: a fresh canonical guard's)."""
    if ops is None:
        ops = cpu_exact.ops_in_mode("canonical")
    weight = _randn(n, k, dtype=dtype, seed=1, scale=0.1).requires_grad_()
    results = []
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                weight.mul_(1.5)  # in place: the version counter moves on
        x = _randn(rows, k, dtype=dtype, seed=10 + step).requires_grad_()
        y = ops.linear(x, weight)
        grads = torch.autograd.grad(y, [x, weight], _randn(rows, n, dtype=dtype, seed=20 + step))
        results += [y.detach(), *grads]
    return results


def _per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lay every operand out per call: nothing kept (the arrangement before)."""
    monkeypatch.setattr(gemm_laid_out, "ARRANGED_BYTES_MAX", 0)


def _with_threads(threads: int, fn):
    with num_threads(threads):
        return fn()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kept_operands_give_the_bits_of_laying_out_per_call(dtype):
    kept = _steps(dtype)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _per_call(monkeypatch)
        fresh = _steps(dtype)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(kept, fresh))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_each_weight_is_laid_out_once_per_version(dtype, monkeypatch):
    made = []
    real = gemm_laid_out.arranged_weight

    def counting(weight, form, make):
        def counted():
            made.append(form[0])
            return make()
        return real(weight, form, counted)
    monkeypatch.setattr(gemm_laid_out, "arranged_weight", counting)
    _steps(dtype)
    # per version (once for the first, over two passes; once after the update), in fp32: the forward's weight
    # transposed and padded, row-major (``canonical_class``: a class below ROW_MAJOR_SHARED_MAX; the input
    # gradient's operand is W itself, row-major); where a bf16 class computes in fp32, that and W's fp32 copy,
    # row-major; in a bf16 shared class, the forward's padded weight; in bf16 where the classes take their operand
    # once per tile as the weight is stored (operand_per_tile), the forward's padded weight, then each operand once
    # per tile for the canonical call of the three tiles
    host = cpu_exact.ops_in_mode("canonical").host
    upcast = gemm_linear.tiled_dtype(torch.empty(150, 40, dtype=dtype), torch.empty(40, 64, dtype=dtype).t(),
                                     host) != dtype
    expected = ["row-major", "row-major"] if upcast else ["row-major"] if dtype == torch.float32 else ["canonical"]
    if dtype == torch.bfloat16 and gemm_laid_out.operand_per_tile(dtype, 64, 48):
        expected = ["canonical", "per tile", "per tile"]
    assert made == expected * 2, made


def test_an_operand_kept_whatever_the_version_is_caught(monkeypatch):
    """Counter-test: keyed without the version counter, the update is missed and the third pass differs."""
    real = gemm_laid_out.arranged_weight
    stale = {}

    def ignore_version(weight, form, make):
        key = (id(weight if weight._base is None else weight._base), form, weight.stride())
        if key not in stale:
            stale[key] = real(weight, form, make)
        return stale[key]
    monkeypatch.setattr(gemm_laid_out, "arranged_weight", ignore_version)
    kept = _steps(torch.float32)
    monkeypatch.undo()
    with pytest.MonkeyPatch.context() as per_call:
        _per_call(per_call)
        fresh = _steps(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(kept[:6], fresh[:6]))
    assert not all(torch.equal(a, b) for a, b in zip(kept[6:], fresh[6:]))


def _kept_for(weight: torch.Tensor) -> list[str]:
    """The caches holding something for ``weight`` (``weight_versions``: what ``forget_weight`` empties)."""
    held = {"laid out": bool(gemm_laid_out._ARRANGED.get(weight)),
            "plans": id(weight) in gemm_linear._PLANS and gemm_linear._PLANS[id(weight)].owner() is weight,
            "remembered calls": any(kept.weight() is weight for kept in linear_repeats._REMEMBERED.values()),
            "fused groups": any(any(r() is weight for r in group.weights) for group in fused_linears._GROUPS.values())}
    return [name for name, kept in held.items() if kept]


@pytest.mark.parametrize("mode", ["auto", "canonical"])
def test_forget_weight_after_a_fused_optimizer_step_gives_the_new_weights_bits(mode):
    """torch 2.13's ``fused=True`` AdamW writes the weights without bumping their version counters, so what the kernels
    kept for the old values looks current (``cpu_exact.linear``'s precondition); ``forget_weight`` drops it from every
    cache (laid-out operands, plans, a decode loop's remembered calls, fused groups): the next calls, with and without a
    gradient, alone and through ``linears``, give the bits of the same calls on fresh copies of the new weights."""
    ops = cpu_exact.ops_in_mode(mode)
    w1, w2 = (torch.nn.Parameter(_randn(n, 80, dtype=torch.float32, seed=n)) for n in (96, 48))
    x_train, x_decode = _randn(5, 80, dtype=torch.float32, seed=3), _randn(3, 80, dtype=torch.float32, seed=4)

    def calls(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        out = [ops.linear(x_train, a).detach()]  # (a gradient recorded where a is the parameter)
        with torch.no_grad():
            for _ in range(gemm_packed.PACK_AFTER_CALLS + 2):  # a decode loop's: remembered, grouped
                decode = [ops.linear(x_decode, a), *ops.linears(x_decode, [a, b])]
        return out + decode

    calls(w1, w2)
    (ops.linear(x_train, w1).sum() + ops.linear(x_train, w2).sum()).backward()  # operands laid out for the backward
    assert _kept_for(w1)
    versions = (w1._version, w2._version)
    torch.optim.AdamW([w1, w2], lr=0.1, fused=True).step()
    assert (w1._version, w2._version) == versions  # the write the precondition names: the counters did not move
    forget_weight(w1)
    forget_weight(w2[:10])  # a view: its storage's owner is forgotten
    assert _kept_for(w1) == _kept_for(w2) == []
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes()
    got, fresh = calls(w1, w2), calls(w1.detach().clone(), w2.detach().clone())
    assert all(torch.equal(a, b) for a, b in zip(got, fresh, strict=True))


@pytest.mark.parametrize("handle", ["data", "parameter's source"])
def test_forget_weight_takes_any_tensor_on_the_weights_memory(handle):
    """The write ``forget_weight`` exists for goes through ``w.data``, so users pass it; and a parameter made from a
    tensor shares that tensor's memory: either reaches what the kernels keep for the weight (it did nothing: both
    are other tensor objects than the weight, and neither is a view of it)."""
    source = _randn(256, 64, dtype=torch.float32, seed=7)
    w = torch.nn.Parameter(source)
    x = _randn(1, 64, dtype=torch.float32, seed=8)
    with torch.no_grad():
        for _ in range(gemm_packed.PACK_AFTER_CALLS + 2):
            cpu_exact.linear(x, w)
        w.data.mul_(2)  # no version bump
        forget_weight(w.data if handle == "data" else source)
        assert _kept_for(w) == []
        assert torch.equal(cpu_exact.linear(x, w), cpu_exact.linear(x, w.detach().clone()))


def test_forget_weight_beside_the_kernels_on_other_threads():
    """``forget_weight`` on two threads while a third runs the kernels on the weight (the kept-bytes count is shared
    by every thread): no error, and once the weight is gone the count is what the other weights hold."""
    import sys
    import threading

    w, x = _randn(64, 32, dtype=torch.float32, seed=9), _randn(1, 32, dtype=torch.float32, seed=10)
    errors, stop = [], threading.Event()

    def loop(work) -> None:
        try:
            while not stop.is_set():
                work()
        except Exception as error:  # noqa: BLE001 -- any error is the finding
            errors.append(error)
            stop.set()

    def kernels() -> None:
        with torch.no_grad():
            w.add_(0.0)  # a new version: laid out again
            cpu_exact.linear(x, w)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the interleavings the race needs
    try:
        threads = [threading.Thread(target=loop, args=(f,)) for f in (kernels, lambda: forget_weight(w),
                                                                      lambda: forget_weight(w))]
        for t in threads:
            t.start()
        stop.wait(2.0)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert errors == []
    forget_weight(w)
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes()


def test_every_loop_over_a_kept_cache_survives_a_thread_switch_inside_it():
    """The race the threaded test above samples, made certain: at every line run inside a loop over a kept cache (a
    generator or comprehension in the kernels, or torch's weak dictionary's own loops), another thread's work runs
    -- a new weight laid out and run, the previous one forgotten -- as a thread switch there would. A loop over the
    cache itself then sees it change size (RuntimeError); every loop goes over ``kept_snapshot`` of its cache."""
    import sys
    from pathlib import Path

    import torch.utils.weak

    loop_files = {str(Path(gemm_laid_out.__file__).parent), str(Path(torch.utils.weak.__file__))}
    loop_frames = {"<genexpr>", "<listcomp>", "<dictcomp>", "keys", "values", "items", "copy"}
    x = _randn(1, 32, dtype=torch.float32, seed=10)
    w, up = _randn(64, 32, dtype=torch.float32, seed=9), _randn(48, 32, dtype=torch.float32, seed=11)
    others: list[torch.Tensor] = []
    switches, switching = [0], [False]

    def another_thread() -> None:
        others.append(_randn(64, 32, dtype=torch.float32, seed=100 + len(others)))
        cpu_exact.linear(x, others[-1])  # an owner, a plan, a remembered call added
        if len(others) > 1:
            forget_weight(others.pop(0))  # and popped

    def in_loop(frame, event, arg):
        if event == "line" and not switching[0]:
            switching[0] = True
            try:
                another_thread()
                switches[0] += 1
            finally:
                switching[0] = False
        return in_loop

    def on_call(frame, event, arg):
        code = frame.f_code
        looping = code.co_name in loop_frames and any(code.co_filename.startswith(f) for f in loop_files)
        return in_loop if looping and not switching[0] else None

    sys.settrace(on_call)
    try:
        for _ in range(3):
            with torch.no_grad():
                w.add_(0.0)  # a new version: laid out again
                up.add_(0.0)
            for _ in range(gemm_packed.PACK_AFTER_CALLS + 2):  # past packing: every cache holds the weights
                cpu_exact.linear(x, w)
                cpu_exact.linears(x, [w, up])
            forget_weight(w)
    finally:
        sys.settrace(None)
    assert switches[0] > 0  # the loops ran, and switched inside
    for weight in others:
        forget_weight(weight)
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes()


def test_forget_weight_names_a_non_tensor():
    with pytest.raises(TypeError, match="forget_weight: weight must be a torch.Tensor, got list"):
        forget_weight([1.0])


SMALL_AND_LARGE_LAYERS = [(64, 176, True), (176, 64, True), (576, 192, True), (576, 576, False), (1536, 576, False)]
"""(K, N, below ROW_MAJOR_SHARED_MAX): the default model's and llama100m's layer shapes either side of the bound."""


@pytest.mark.parametrize("k, n, row_major", SMALL_AND_LARGE_LAYERS)
def test_a_small_input_gradient_multiplies_the_weight_as_stored(k, n, row_major, monkeypatch):
    """An fp32 input gradient's shared class below ROW_MAJOR_SHARED_MAX takes W [N, K] as stored (row-major, no copy);
    from the bound, W's transposed copy (the layout in which an fp32 class tries oneDNN's linear), laid out once."""
    monkeypatch.setattr(gemm_laid_out, "operand_per_tile", lambda *args: False)  # a shared class on any host
    weight = _randn(n, k, dtype=torch.float32, seed=3)
    given = weight.t()  # what tiled_matmul gets for an input gradient: W.T, a view of the contiguous W
    shared, transposed = gemm_laid_out.canonical_class(given, torch.float32, n, k)
    assert shared and transposed is not row_major
    assert (n * k < gemm_laid_out.ROW_MAJOR_SHARED_MAX) is row_major
    made = _arranged_forms(monkeypatch)
    x = _randn(130, n, dtype=torch.float32, seed=4)
    out = cpu_exact.ops_in_mode("canonical").linear(x, given)
    assert made == ([] if row_major else ["canonical"])
    reference = x.double() @ weight.double()  # tolerance: fp32 accumulation over n <= 576 products of N(0, 1) values
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-3 * n ** 0.5)


@pytest.mark.parametrize("k, n, row_major", SMALL_AND_LARGE_LAYERS)
def test_a_small_forward_multiplies_the_weight_transposed_once(k, n, row_major, monkeypatch):
    """An fp32 forward's shared class below ROW_MAJOR_SHARED_MAX takes W [N, K] transposed into a row-major copy
    [K, N], laid out once per weight version (MKL's fp32 ``bmm`` on a shared row-major operand: about the time of one
    GEMM on the stacked tiles, on a transposed one about 1.2x); from the bound, W itself seen transposed (no copy)."""
    monkeypatch.setattr(gemm_laid_out, "operand_per_tile", lambda *args: False)  # a shared class on any host
    weight = _randn(n, k, dtype=torch.float32, seed=5)
    shared, transposed = gemm_laid_out.canonical_class(weight, torch.float32, k, n)
    assert shared and transposed is not row_major
    # a bf16 class keeps the weight as stored, transposed
    assert gemm_laid_out.canonical_class(weight.bfloat16(), torch.bfloat16, k, n) == (True, True)
    made = _arranged_forms(monkeypatch)
    x = _randn(130, k, dtype=torch.float32, seed=6)
    ops = cpu_exact.ops_in_mode("canonical")
    out = ops.linear(x, weight)
    assert torch.equal(ops.linear(x, weight), out)
    assert made == (["row-major"] if row_major else [])  # once: the second call reuses it
    reference = x.double() @ weight.double().t()  # tolerance: fp32 accumulation over k <= 1536 N(0, 1) products
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-3 * k ** 0.5)


def _arranged_forms(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The forms ``arranged_weight`` is asked to lay out from now on, in order (a list filled as it is asked)."""
    made = []
    real = gemm_laid_out.arranged_weight
    monkeypatch.setattr(gemm_laid_out, "arranged_weight",
                        lambda w, form, make: made.append(form[0]) or real(w, form, make))
    return made


def test_the_bound_keeps_nothing_beyond_it(monkeypatch):
    monkeypatch.setattr(gemm_laid_out, "ARRANGED_BYTES_MAX", 0)
    weight = _randn(40, 64, dtype=torch.float32, seed=1)
    operand = gemm_laid_out.canonical_operand(weight, torch.float32, 48)
    assert weight not in gemm_laid_out._ARRANGED
    assert torch.equal(operand[0, :, :40], weight.t()) and not operand[0, :, 40:].any()


def _held_bytes() -> int:
    return sum(t.nbytes for kept in gemm_laid_out._ARRANGED.values() for _, t in kept.values())


def test_the_bound_counts_the_bytes_held_as_operands_come_and_go():
    """The bytes ``room_for`` weighs against ``ARRANGED_BYTES_MAX`` are those the kept operands hold, counted as
    they come and go rather than summed on every call: a weight's first operand, a second form of it, a new version
    replacing the old, and the weight gone (its operands with it)."""
    import gc

    gc.collect()  # an earlier test's weights in reference cycles go now, not at the collection below (start moved)
    start = gemm_laid_out._HELD_BYTES.total
    assert start == _held_bytes()
    weight = _randn(40, 64, dtype=torch.float32, seed=1)
    gemm_laid_out.canonical_operand(weight, torch.float32, 48)
    one = gemm_laid_out._HELD_BYTES.total
    assert one == _held_bytes() == start + 64 * 48 * 4
    gemm_laid_out.canonical_operand(weight, torch.float32, 64)  # another form: kept beside the first
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes() == one + 64 * 64 * 4
    with torch.no_grad():
        weight.mul_(2.0)  # a new version: its operand replaces the old one of that form
    gemm_laid_out.canonical_operand(weight, torch.float32, 48)
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes() == one + 64 * 64 * 4
    del weight
    gc.collect()
    assert gemm_laid_out._HELD_BYTES.total == _held_bytes() == start


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_bmm_copies_the_canonical_operand_where_the_rule_says(dtype):
    """What ``bmm_copies_operand`` claims of torch, seen by the profiler: one 64-row tile against the canonical
    operand (a weight [96, 128] seen transposed) copies a [1, 128, 96] operand in bf16 where the rule says so."""
    x = _randn(1, 64, 128, dtype=dtype, seed=3)
    operand = _randn(96, 128, dtype=dtype, seed=4).t().unsqueeze(0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.bmm(x, operand)
    copies = [e for e in prof.events() if e.name == "aten::copy_" and list(e.input_shapes[0]) == [1, 128, 96]]
    assert bool(copies) == gemm_laid_out.bmm_copies_operand(dtype, 64, 128, 96)
    if dtype == torch.float32:
        assert not copies


@pytest.mark.parametrize("layout", ["forward", "input gradient"])
def test_bmm_copies_no_operand_as_stored(layout):
    """The operand of an ``operand_per_tile`` class's tile as the weight is stored (``stored_operand``: a forward's
    weight [96, 128] as a transposed batch, strides (128 x 96, 1, 128); an input gradient's W [128, 96] row-major)
    reaches torch's bf16 ``bmm`` without a copy (the profiler sees none), where the class is one; and has the bits of
    the canonical call of one tile (``per_tile_operand``)."""
    if not gemm_laid_out.operand_per_tile(torch.bfloat16, 128, 96):
        pytest.skip("torch's bf16 bmm does not run oneDNN here: no per-tile class")
    x = _randn(1, 64, 128, dtype=torch.bfloat16, seed=3)
    if layout == "forward":
        stored = _randn(96, 128, dtype=torch.bfloat16, seed=4)
        weight, strides = stored, (96 * 128, 1, 128)
    else:
        stored = _randn(128, 96, dtype=torch.bfloat16, seed=4)  # W of a layer 96 -> 128; the weight given is W.T
        weight, strides = stored.t(), (128 * 96, 96, 1)
    operand = gemm_laid_out.stored_operand(weight, torch.bfloat16, 96)
    assert operand.data_ptr() == stored.data_ptr() and operand.stride() == strides
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = torch.bmm(x, operand)
    assert not [e for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert torch.equal(_bits(out), _bits(torch.bmm(x, gemm_laid_out.per_tile_operand(operand, 1))))


TILE_HOSTS = ("this-host", "rows-in-call")


def _tile_host(name: str, monkeypatch: pytest.MonkeyPatch) -> HostGuard:
    if name == "this-host":
        return HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
    return emulated_guard(name, monkeypatch, mode="canonical")


# --------------------------------------------------------------------------- several forward tiles, laid out
# (rows, K, N): three 64-row tiles (N = 40: column padding), five (llama-like widths, smaller), 62 (the default
# model's training batch)
FORWARD_SHAPES = [(150, 64, 40), (300, 96, 176), (3968, 64, 64)]


def _forward_tiles(rows: int, k: int, n: int, host: HostGuard) -> torch.Tensor:
    x = _randn(rows, k, dtype=torch.bfloat16, seed=rows + k)
    weight = _randn(n, k, dtype=torch.bfloat16, seed=rows + n + 1, scale=0.1)
    return gemm_linear.tiled_matmul(x, weight, host)


def _laid_out_forms(monkeypatch: pytest.MonkeyPatch, laid_out: bool, call_max: int | None = None,
                    rows: int = 0) -> list[str]:
    """Make every bf16 forward class a transposed-batch class (``operand_per_tile`` answering yes on any
    host) and take its laid-out forward tiles wherever the first-use check allows them (``laid_out``) or never (the
    canonical call, through the guard's ``bmm``), with ``LAID_OUT_CALL_MAX`` = ``call_max`` (0: one GEMM per tile;
    large: the canonical call itself); the forms run on ``rows`` rows (not the first-use check's), recorded."""
    monkeypatch.setattr(gemm_laid_out, "operand_per_tile", lambda *args: True)
    monkeypatch.setattr(gemm_laid_out, "_LAID_OUT_CHECKS", {})
    if not laid_out:
        monkeypatch.setattr(gemm_laid_out, "laid_out_agrees", lambda *args, **kwargs: False)
    if call_max is not None:
        monkeypatch.setattr(gemm_laid_out, "LAID_OUT_CALL_MAX", call_max)
    forms = []
    real = gemm_laid_out.laid_out_tiles

    def recorded(*args, **kwargs):
        if args[0].shape[0] == rows:
            forms.append(args[5])  # the form
        return real(*args, **kwargs)
    monkeypatch.setattr(gemm_laid_out, "laid_out_tiles", recorded)
    if (loops := compiled_loops.library()) is not None:
        class Recorded:  # the canonical call itself, compiled (``bmm_linears``): the form ``one call``
            def __getattr__(self, name):
                return getattr(loops, name)

            def bmm_linears(self, x, *args):
                if x.numel() // x.shape[-1] == rows:
                    forms.append(gemm_laid_out.LAID_OUT_FORMS[1])
                return loops.bmm_linears(x, *args)
        monkeypatch.setattr(compiled_loops, "library", lambda: Recorded())
    return forms


@pytest.mark.parametrize("host_name", TILE_HOSTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form,call_max", [("one call", 1 << 40), ("per tile", 0)])
@pytest.mark.parametrize("rows,k,n", FORWARD_SHAPES)
def test_bf16_forward_tiles_on_a_transposed_batch_are_the_canonical_call(rows, k, n, form, call_max, threads,
                                                                           host_name, monkeypatch):
    """Several bf16 forward tiles of a transposed-batch class, as the canonical call itself or one GEMM per tile on
    the weight's own matrix (at 2 threads the tiles spread over the threads, each GEMM on one thread:
    ``_tile_gemms``): the bits of the canonical call through the guard's ``bmm``, on this host and on the emulated
    host whose GEMM accumulates by the rows in the call."""
    with num_threads(threads):
        with pytest.MonkeyPatch.context() as canonical:
            forms = _laid_out_forms(canonical, laid_out=False, rows=rows)
            expected = _forward_tiles(rows, k, n, _tile_host(host_name, canonical))
            assert not forms
        forms = _laid_out_forms(monkeypatch, laid_out=True, call_max=call_max, rows=rows)
        out = _forward_tiles(rows, k, n, _tile_host(host_name, monkeypatch))
    assert forms == [form]
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert torch.equal(_bits(out), _bits(expected))


def _watched_tile_gemms(monkeypatch: pytest.MonkeyPatch, loops, column_blocks_off: bool = False
                        ) -> list[tuple[int, int, bool, int]]:
    """The compiled loops with their ``tile_gemms`` calls recorded as (tiles, column blocks, one thread, leading whole
    tiles);
    ``column_blocks_off``: a call that splits tiles into column blocks returns one ulp off (a host whose GEMM rounds a
    column block otherwise)."""
    calls = []

    class Watched:
        def __getattr__(self, name):
            return getattr(loops, name)

        def tile_gemms(self, tiles, operand, column_blocks, one_thread=False, whole_tiles=0):
            calls.append((tiles.shape[0], column_blocks, one_thread, whole_tiles))
            out = loops.tile_gemms(tiles, operand, column_blocks, one_thread=one_thread, whole_tiles=whole_tiles)
            if column_blocks_off and column_blocks > 1:
                out = torch.nextafter(out, torch.full_like(out, float("inf")))
            return out
    monkeypatch.setattr(compiled_loops, "library", lambda: Watched())
    return calls


def test_tile_gemms_spread_over_threads_where_the_loops_run(monkeypatch):
    """At 2 threads, tiles go to the compiled loops' ``tile_gemms`` (one call for all): by whole tiles where the
    threads get even shares, else each tile's GEMM in two column blocks (``tile_column_blocks``: five tiles, ten
    pairs; one tile, two); at 1 thread they do not (one ``mm`` after another); and every way, one after another
    included, has the bits of one ``bmm`` per tile at 1 thread."""
    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("the compiled loops are not built here")
    calls = _watched_tile_gemms(monkeypatch, loops)
    tiles = _randn(5, 64, 96, dtype=torch.bfloat16, seed=7)
    operand = _randn(1, 96, 175, dtype=torch.bfloat16, seed=8)  # an odd N: column blocks of 88 and 87
    with num_threads(1):
        expected = torch.cat([torch.bmm(tiles[t : t + 1], operand) for t in range(5)])
        assert torch.equal(gemm_laid_out._tile_gemms(tiles, operand), expected)
    assert calls == []
    with num_threads(2):
        uneven = gemm_laid_out._tile_gemms(tiles, operand)
        one = gemm_laid_out._tile_gemms(tiles[:1], operand)
        even = gemm_laid_out._tile_gemms(tiles[:4], operand)
        one_after_another = gemm_laid_out._tile_gemms(tiles, operand, spread=False)
        one_thread = gemm_laid_out._tile_gemms(tiles, operand, one_thread=True)
    assert calls == [(5, 2, False, 4), (1, 2, False, 0), (4, 1, False, 4), (5, 2, True, 4)]
    assert all(torch.equal(_bits(got), _bits(want))
               for got, want in ((uneven, expected), (one, expected[:1]), (even, expected[:4]),
                                 (one_after_another, expected), (one_thread, expected)))


@pytest.mark.parametrize("one_thread", [False, True])
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("count", [1, 3, 5, 6, 9])
def test_tiles_left_over_run_in_column_blocks_beside_whole_ones(count, threads, one_thread):
    """The compiled spread call with its leading tiles whole and the rest in column blocks (``whole_tiles``: the
    tiles left over after even shares of whole ones, five at 2 threads: four whole, the fifth in two blocks) has the
    bits of one ``mm`` per tile at 1 thread, whatever the split, thread count or blocks; and ``_tile_gemms`` takes that
    split for an uneven count (recorded)."""
    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("the compiled loops are not built here")
    tiles = _randn(count, 64, 96, dtype=torch.bfloat16, seed=count)
    operand = _randn(1, 96, 175, dtype=torch.bfloat16, seed=9)  # an odd N: uneven column blocks
    with num_threads(1):
        expected = torch.stack([torch.mm(tiles[t], operand[0]) for t in range(count)])
    with num_threads(threads):
        for whole in range(count + 1):
            for blocks in (2, 3, 4):
                got = loops.tile_gemms(tiles, operand, blocks, one_thread=one_thread, whole_tiles=whole)
                assert torch.equal(_bits(got), _bits(expected)), (whole, blocks)
        with pytest.MonkeyPatch.context() as patch:
            made = _watched_tile_gemms(patch, loops)
            got = gemm_laid_out._tile_gemms(tiles, operand, one_thread=one_thread)
    assert torch.equal(_bits(got), _bits(expected))
    left_over = count % threads
    if left_over:
        assert made == [(count, threads // math.gcd(left_over, threads), one_thread, count - left_over)]
    else:
        assert made == ([(count, 1, one_thread, count)] if count > 1 else [])


@pytest.mark.parametrize("k,n", [(1536, 576), (4096, 576)])
def test_one_thread_tile_gemms_are_the_one_thread_call(k, n):
    """A ``blas-1-thread`` class's whole tiles spread over 2 threads (``tile_gemms(..., one_thread=True)``: each GEMM
    inside the compiled loops' parallel region, with OpenMP's and MKL's thread-local counts 1) have the bits of the
    same ``mm`` per tile at 1 thread: the library sees the one thread it runs on. (Whether that is the canonical call's
    bits is the first-use check's question, per host; column blocks are other GEMM shapes, checked apart.) Without
    the thread-local counts, oneDNN planned a call inside the region for the process's 2 threads: on an Intel Xeon with
    AMX its bf16 GEMMs of these shapes (an MLP's and an LM head's input gradient, [64, K] @ [K, 576] as stored) then
    summed K as the 2-thread call does, and the first-use check sent those classes to the canonical call, which
    copies the weight once per tile."""
    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("the compiled loops are not built here")
    tiles = _randn(3, 64, k, dtype=torch.bfloat16, seed=11)
    operand = _randn(1, k, n, dtype=torch.bfloat16, seed=12)
    with num_threads(1):
        expected = torch.stack([torch.mm(tiles[t], operand[0]) for t in range(3)])
    with num_threads(2):
        got = loops.tile_gemms(tiles, operand, 1, one_thread=True)
    assert torch.equal(_bits(got), _bits(expected))


def test_tile_column_blocks_give_the_threads_even_shares():
    """``tile_column_blocks``: 1 where the tiles divide evenly, else a divisor of the threads that makes the tiles
    left over after even shares of whole ones, in that many blocks each, a multiple of the threads, at most N;
    ``tile_gemm_ways`` lists every such count."""
    blocks = gemm_laid_out.tile_column_blocks
    assert [blocks(count, 2, 1536) for count in (1, 2, 3, 4, 5, 8, 9)] == [2, 1, 2, 1, 2, 1, 2]
    assert [blocks(count, 4, 1536) for count in (1, 2, 3, 4, 6)] == [4, 2, 4, 1, 2]
    assert blocks(3, 1, 1536) == 1 and blocks(1, 4, 3) == 3
    assert gemm_laid_out.tile_gemm_ways(2, 1536, one_thread=False) == ((True, 1), (True, 2), (False, 1))
    assert gemm_laid_out.tile_gemm_ways(4, 1536, one_thread=True) == ((True, 1), (True, 2), (True, 4))
    assert gemm_laid_out.tile_gemm_ways(1, 1536, one_thread=False) == ((True, 1), (False, 1))


@pytest.mark.parametrize("threads", [1, 2])
def test_forward_tiles_made_one_ulp_off_are_caught(threads, monkeypatch):
    """Counter-test: per-tile GEMMs made one ulp off are caught by the first-use check (``laid_out_agrees``), and
    the canonical call runs (its bits); without the check they would have been used."""
    with num_threads(threads):
        with pytest.MonkeyPatch.context() as canonical:
            _laid_out_forms(canonical, laid_out=False)
            expected = _forward_tiles(300, 96, 176, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
        real = gemm_laid_out._tile_gemms

        def off(*args, **kwargs):
            out = real(*args, **kwargs)
            return torch.nextafter(out, torch.full_like(out, float("inf")))
        monkeypatch.setattr(gemm_laid_out, "_tile_gemms", off)
        forms = _laid_out_forms(monkeypatch, laid_out=True, call_max=0, rows=300)
        out = _forward_tiles(300, 96, 176, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
        assert forms == [] and torch.equal(_bits(out), _bits(expected))
        monkeypatch.setattr(gemm_laid_out, "laid_out_agrees", lambda *args, **kwargs: True)
        wrong = _forward_tiles(300, 96, 176, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))
    assert forms == ["per tile"] and not torch.equal(_bits(wrong), _bits(expected))


@pytest.mark.parametrize("rows,tiles,form,call_max", [(48, 1, "one tile", None), (300, 5, "per tile", 0)])
def test_column_blocks_with_other_bits_leave_the_form_to_whole_tiles(rows, tiles, form, call_max, monkeypatch):
    """On a host whose GEMM rounds a tile's column blocks otherwise (emulated: the compiled loops' ``tile_gemms`` one
    ulp off wherever it splits a tile into column blocks, as oneDNN's AMX GEMM does for some classes of an Intel
    Xeon), the first-use checks keep the form (``laid_out_agrees`` by whole tiles) and refuse its column blocks
    (``column_blocks_agree``): the form runs whole tiles with the canonical call's bits -- one tile (a decode step's
    call) or five tiles, where two threads would take column blocks. Counter-check: had the column blocks' check
    passed, the form would have run them and given other bits."""
    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("the compiled loops are not built here: no column blocks")

    def run() -> torch.Tensor:
        return _forward_tiles(rows, 96, 176, HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical"))

    with num_threads(2):
        with pytest.MonkeyPatch.context() as canonical:
            _laid_out_forms(canonical, laid_out=False)
            expected = run()
        calls = _watched_tile_gemms(monkeypatch, loops, column_blocks_off=True)
        forms = _laid_out_forms(monkeypatch, laid_out=True, call_max=call_max, rows=rows)
        out = run()
        assert forms == [form] and torch.equal(_bits(out), _bits(expected))
        split = [count for count, blocks, _, _ in calls if blocks > 1]
        assert split and tiles not in split  # the column blocks' check split its tiles; the form's call did not
        monkeypatch.setattr(gemm_laid_out, "_LAID_OUT_CHECKS", {})
        monkeypatch.setattr(gemm_laid_out, "column_blocks_agree", lambda *args, **kwargs: True)
        wrong = run()
    assert not torch.equal(_bits(wrong), _bits(expected))


@pytest.mark.parametrize("stored", ["forward", "input gradient"])
@pytest.mark.parametrize("rows,form", [(48, "one tile"), (192, "one call"), (320, "per tile")])
def test_a_warm_bf16_linear_copies_no_weight(rows, form, stored, monkeypatch):
    """A bf16 linear layer's repeated call (a decode loop's steps; a training step's input gradient, given W.T) on a
    per-tile class copies nothing in each form (the profiler sees no copy): the one tile and the per-tile GEMMs
    multiply the weight as stored, and the canonical call's once-per-tile operand is laid out once per weight version
    and tile count (``laid_out_operand``). The rows fill whole tiles, so the input is not padded either."""
    if not gemm_laid_out.operand_per_tile(torch.bfloat16, 64, 176):
        pytest.skip("torch's bf16 bmm does not run oneDNN here: no transposed-batch class")
    forms = _laid_out_forms(monkeypatch, laid_out=True, call_max=0 if form == "per tile" else None, rows=rows)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
    x = _randn(rows, 64, dtype=torch.bfloat16, seed=5)
    weight = _randn(176, 64, dtype=torch.bfloat16, seed=6)
    if stored == "input gradient":
        weight = _randn(64, 176, dtype=torch.bfloat16, seed=6).t()
    first = gemm_linear.tiled_matmul(x, weight, host)  # probes, checks and the plan, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        warm = gemm_linear.tiled_matmul(x, weight, host)
    # the first call and the warm one took the form (so did the first-use check, where its rows are these: one tile)
    assert forms[-2:] == [form, form] and set(forms) == {form}
    assert not [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert torch.equal(_bits(warm), _bits(first))


def _one_thread_classes(monkeypatch: pytest.MonkeyPatch, host: HostGuard) -> None:
    """Every bf16 GEMM class of ``host`` runs torch's GEMM with 1 thread (``blas-1-thread``), as an Intel Xeon's do
    at 2 threads: the guard's decision, forced after its probe on any host."""
    real = host._gemm_record

    def one_thread(dtype, *args, **kwargs):
        record = real(dtype, *args, **kwargs)
        if dtype == torch.bfloat16:
            record.path = SINGLE_THREAD_PATH
        return record
    monkeypatch.setattr(host, "_gemm_record", one_thread)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stored", ["forward", "input gradient"])
@pytest.mark.parametrize("rows,form,call_max", [(48, "one tile", None), (192, "one call", 1 << 40),
                                                (320, "per tile", 0)])
def test_a_one_thread_class_lays_its_tiles_out_with_the_canonical_bits(rows, form, call_max, stored, threads,
                                                                       monkeypatch):
    """A bf16 linear class the guard runs with 1 thread (``blas-1-thread``) takes the laid-out forms too, each GEMM
    on one thread (at 2 threads the per-tile GEMMs spread over the threads): the bits of its canonical call through
    the guard's ``bmm`` (one call with 1 thread on the operand copied per tile), and a warm call copies no weight."""
    x = _randn(rows, 64, dtype=torch.bfloat16, seed=5)
    weight = _randn(176, 64, dtype=torch.bfloat16, seed=6)
    if stored == "input gradient":
        weight = _randn(64, 176, dtype=torch.bfloat16, seed=6).t()
    with num_threads(threads):
        with pytest.MonkeyPatch.context() as canonical:
            forms = _laid_out_forms(canonical, laid_out=False, rows=rows)
            host = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
            _one_thread_classes(canonical, host)
            expected = gemm_linear.tiled_matmul(x, weight, host)
            gemm_paths = {r.path for r in host._records.values() if r.property != SAME_BITS}
            assert not forms and gemm_paths == {SINGLE_THREAD_PATH}
        forms = _laid_out_forms(monkeypatch, laid_out=True, call_max=call_max, rows=rows)
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode="canonical")
        _one_thread_classes(monkeypatch, host)
        first = gemm_linear.tiled_matmul(x, weight, host)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            warm = gemm_linear.tiled_matmul(x, weight, host)
    assert forms[-2:] == [form, form] and set(forms) == {form}
    assert not [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert torch.equal(_bits(first), _bits(expected)) and torch.equal(_bits(warm), _bits(expected))


@pytest.mark.parametrize("mode", ["auto", "canonical"])
@pytest.mark.parametrize("tiles", [2, 3, 5])
def test_a_one_thread_class_at_two_threads_shares_its_tiles_out_with_the_one_thread_bits(tiles, mode, monkeypatch):
    """A bf16 class the guard runs with 1 thread (``blas-1-thread``), at 2 threads: the guard's ``bmm`` has the bits
    of the 1-thread call; in ``auto``, where the class's ``same_bits`` check passed, through the tiles shared out
    between the threads (``loops.split_bmm``: each thread's bmm sees one thread); in ``canonical`` (no ``same_bits``
    arrangement) never through them."""
    loops = compiled_loops.library()
    if loops is None:
        pytest.skip("no compiled loops on this host")
    a = _randn(tiles, 64, 96, dtype=torch.bfloat16, seed=7)
    b = _randn(96, 176, dtype=torch.bfloat16, seed=8).expand(tiles, 96, 176).contiguous()  # one operand per tile
    with num_threads(2):
        expected = _with_threads(1, lambda: torch.bmm(a, b))
        host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
        _one_thread_classes(monkeypatch, host)
        calls = recorded_returns(monkeypatch, loops, "split_bmm")
        got = host.bmm(a, b, op="linear", shared_operand=False)
    split = [r for r in host._records.values() if r.property == SAME_BITS]
    assert torch.equal(_bits(got), _bits(expected))
    if mode == "canonical":
        assert not any(c is got for c in calls)
    else:  # the check ran (the probe's own calls), and its verdict decided the path
        assert len(split) == 1 and calls
        assert any(c is got for c in calls) == (split[0].path == FASTER_PATH)
