"""The exact CPU kernels' cheaper passes over memory ("the price" of exactness) changed no bit.

What was optimised: the weight gradient's GEMM operands (each token chunk transposed, zero-padded) are laid out in
one transposing copy, or seen as a view where no padding is needed, where a pad-then-transpose composition copied
the data twice; attention masks only the visible keys (one mask for a batch whose sequences all start at the same
position) and its backward zeroes only the padding of the tensors it writes; the norm's backward reuses one
scratch tensor; SwiGLU's backward takes the forward's 1 + exp(-gate) and
silu instead of computing them again. Then (benchmarks_price_fp32.md): the attention softmax writes exp's +0.0 for
masked keys instead of computing exp(-inf) and widens its rows to a multiple of 16 keys; padding is zeroed only where
it is (``zero_padded``), and the attention backward passes its zero-padded buffers as GEMM operands; the weight
gradients of layers sharing an input reuse its laid-out operand, and run one GEMM call per row tile instead of
copying the operand per row tile. The claim is stronger than "same outputs on this host":
every GEMM tile gets the same operands -- values, shapes, strides and 64-byte alignment -- as the straightforward
composition the kernels used before (kept below as the reference, verbatim), so the library computes the same
thing on any host where the guard's probes pass (a tile's rows not depending on how many tiles share its call is one
of them).

How it is checked, per op and dtype, forward and backward:
- both versions run under a ``RecordingGuard`` (the process guard's fast paths, recording each GEMM call) and under
  ``poisoned_allocations`` (every fresh float tensor starts as NaN: padding that is not explicitly zeroed shows);
- the GEMM tiles computed must be the same, tile by tile (each tile's operands: shapes, strides, alignment, raw bits;
  how tiles are grouped into calls is left out, as a tile's rows do not depend on it -- a probed property), and so
  must every output and gradient (raw bits: torch.equal alone would call -0.0 and +0.0 equal).
A counter-test shows the check fails when the padding is left unzeroed.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vexact_kernels import (
    cpu_attention,
    cpu_exact,
    gemm_batched,
    gemm_laid_out,
    gemm_linear,
    gemm_tiles,
    gemm_weight_gradient,
)
from vexact_kernels.cpu_attention import KEY_BLOCK
from vexact_kernels.cpu_elementwise import unary
from vexact_kernels.cpu_exact import _tree_sum
from vexact_kernels.gemm_tiles import COL_BLOCK, ceil_to, fp32, row_block
from vexact_kernels.gemm_weight_gradient import _reduction_block, last_chunk_length
from vexact_kernels.host_guard import HostGuard

DTYPES = (torch.float32, torch.bfloat16)
_FRESH = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_like.default}


class poisoned_allocations(TorchDispatchMode):  # noqa: N801 (used as a context manager)
    """Every fresh floating-point tensor (``empty`` and its variants) starts filled with NaN, so memory a kernel
    reads without writing it first (e.g. padding it forgot to zero) cannot pass for zeros by luck."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FRESH and out.is_floating_point():
            out.fill_(float("nan"))
        return out


class RecordingGuard(HostGuard):
    """The default guard (probes, torch's primitives) that also records every GEMM call's operands."""

    def __init__(self) -> None:
        super().__init__(cpu_exact.ROW_BLOCKS, mode="auto")
        self.calls: list[tuple] = []

    def bmm(self, a: torch.Tensor, b: torch.Tensor, op: str, shared_operand: bool, *,
            one_thread: bool = False) -> torch.Tensor:
        self.calls.append([(op, shared_operand, _tile(a, t), _tile(b, t)) for t in range(a.shape[0])])
        return super().bmm(a, b, op, shared_operand, one_thread=one_thread)


def _tile(operand: torch.Tensor, t: int) -> tuple:
    """What the library sees of tile ``t`` of a bmm operand: its shape, strides, the operand's tile stride, its
    64-byte alignment and its values (a digest of the raw bits)."""
    tile = operand[t]
    digest = hashlib.blake2b(_bits(tile.detach()).numpy().tobytes(), digest_size=16).hexdigest()
    return tuple(tile.shape), tile.stride(), operand.stride(0), tile.data_ptr() % gemm_tiles.ALIGNMENT, digest


# --------------------------------------------------------------------------- the reference (the kernels before)
def _transposed_matmul_reference(a, b, host, op, b_source=None):
    rows, n = a.shape
    k = b.shape[1]
    block = _reduction_block(rows, a.dtype)  # bf16: one chunk up to LIBRARY_REDUCE_MAX tokens
    if last_chunk_length(rows, block, a.dtype) < block:  # the definition's one change since: a short last chunk
        parts = [_transposed_matmul_reference(a[i : i + block], b[i : i + block], host, op)  # is its own reduction
                 for i in range(0, rows, block)]
        return _tree_sum(torch.stack(parts), dim=0)
    chunks = -(-rows // block)
    padded = chunks * block
    k_pad = ceil_to(k, COL_BLOCK)
    a_t = torch.constant_pad_nd(a, (0, 0, 0, padded - rows)).view(chunks, block, n).transpose(1, 2)
    b_t = torch.constant_pad_nd(b, (0, k_pad - k, 0, padded - rows)).view(chunks, block, k_pad).transpose(1, 2)
    b_t = b_t.contiguous()
    height = row_block(n, host.tile_heights(a.dtype, b_t[:1].transpose(1, 2), False, op))
    row_tiles = -(-n // height)
    a_tiles = torch.constant_pad_nd(a_t, (0, 0, 0, row_tiles * height - n)).reshape(chunks * row_tiles, height, block)
    b_tiles = b_t.unsqueeze(1).expand(chunks, row_tiles, k_pad, block).reshape(chunks * row_tiles, k_pad, block)
    out = host.bmm(a_tiles, b_tiles.transpose(1, 2), op=op, shared_operand=False)
    parts = out.view(chunks, row_tiles * height, k_pad)[:, :n, :k]
    return parts[0] if chunks == 1 else _tree_sum(parts, dim=0)


def _tiled_matmul_reference(x, weight, host, op="linear"):
    rows, k = x.shape
    n = weight.shape[0]
    n_pad = ceil_to(n, COL_BLOCK)
    w = weight.to(x.dtype)  # x's dtype is the GEMM's (fp32, or bf16 where the guard admits the host's bf16 GEMM)
    w = torch.constant_pad_nd(w, (0, 0, 0, n_pad - n)) if n_pad != n else gemm_tiles.aligned_contiguous(w)
    operand = w.t().unsqueeze(0)
    # a bf16 class whose bmm would copy the shared operand takes it once per tile in the layout the weight is stored
    # in (the canonical class since operand_per_tile: the operand's layout, not a price optimisation): a forward's
    # as a transposed batch, an input gradient's (the weight given as W.T) row-major
    shared = not gemm_laid_out.operand_per_tile(x.dtype, k, n_pad)
    # a shared class below ROW_MAJOR_SHARED_MAX takes its operand row-major (the canonical class since session 66 for
    # an input gradient's W, as stored; since session 67 for an fp32 forward's W, transposed into a copy: MKL's bmm
    # multiplies a shared row-major operand faster than a transposed one)
    small = k * n_pad < gemm_laid_out.ROW_MAJOR_SHARED_MAX
    row_major = (gemm_laid_out.stored_row_major(weight) if not shared
                 else small and (gemm_laid_out.stored_row_major(weight) or x.dtype == torch.float32))
    if row_major:
        given = weight.t().to(x.dtype)
        operand = gemm_tiles.aligned_contiguous(torch.constant_pad_nd(given, (0, n_pad - n))).unsqueeze(0)
    block = row_block(rows, host.tile_heights(x.dtype, operand, shared, op))
    blocks = -(-rows // block)
    if blocks * block != rows:
        x = torch.constant_pad_nd(x, (0, 0, 0, blocks * block - rows))
    else:
        x = gemm_tiles.aligned_contiguous(x)
    if shared:
        right = operand.expand(blocks, k, n_pad)
    elif row_major:
        right = operand.expand(blocks, k, n_pad).contiguous()
    else:
        right = w.expand(blocks, n_pad, k).contiguous().transpose(1, 2)
    out = host.bmm(x.view(blocks, block, k), right, op=op, shared_operand=shared)
    out = out.view(blocks * block, n_pad)
    return out[:rows] if n_pad == n else out[:rows, :n]


def _batched_matmul_reference(a, b, host, op, a_full=None, b_full=None):
    batch, rows, k = a.shape
    n = b.shape[2]
    k_pad, n_pad = ceil_to(k, COL_BLOCK), ceil_to(n, COL_BLOCK)
    b = torch.constant_pad_nd(b, (0, n_pad - n, 0, k_pad - k))
    block = row_block(rows, host.tile_heights(a.dtype, b[:1], False, op))
    row_tiles = -(-rows // block)
    a = torch.constant_pad_nd(a, (0, k_pad - k, 0, row_tiles * block - rows)).view(batch * row_tiles, block, k_pad)
    b = b.unsqueeze(1).expand(batch, row_tiles, k_pad, n_pad).reshape(batch * row_tiles, k_pad, n_pad)
    out = host.bmm(a, b, op=op, shared_operand=False).view(batch, row_tiles * block, n_pad)
    return out[:, :rows, :n]


def _query_rows_reference(self, q):
    batch, q_len, kv_heads, head_dim = self.batch, self.q_len, self.kv_heads, self.head_dim
    q_rows = torch.zeros(batch, kv_heads, self.row_len, head_dim, dtype=torch.float32, device=q.device)
    torch.mul(q.view(batch, q_len, kv_heads, self.group, head_dim).permute(0, 2, 1, 3, 4), self.scale,
              out=q_rows[:, :, : self.rows].view(batch, kv_heads, q_len, self.group, head_dim))
    return q_rows.view(batch * kv_heads, self.row_len, head_dim)


def _key_rows_reference(self, cache):
    batch, kv_heads, head_dim = self.batch, self.kv_heads, self.head_dim
    kept = min(self.cache_len, self.key_len)
    alloc = torch.zeros if kept < self.key_len else torch.empty
    out = alloc(batch, kv_heads, self.key_len, head_dim, dtype=torch.float32, device=cache.device)
    out[:, :, :kept] = cache[:, :kept].permute(0, 2, 1, 3)
    return out.view(batch * kv_heads, self.key_len, head_dim)


def _from_output_reference(self, grad):
    b, h, t, g, d = self.batch, self.kv_heads, self.q_len, self.group, self.head_dim
    out = torch.zeros(b, h, self.row_len, d, dtype=torch.float32, device=grad.device)
    out[:, :, : self.rows].view(b, h, t, g, d).copy_(grad.view(b, t, h, g, d).permute(0, 2, 1, 3, 4))
    return out.view(b * h, self.row_len, d)


def _to_cache_reference(self, keys, dtype):
    b, h, d = self.batch, self.kv_heads, self.head_dim
    out = torch.zeros(b, self.cache_len, h, d, dtype=dtype, device=keys.device)
    kept = min(self.cache_len, keys.shape[1])
    out[:, :kept] = keys.view(b, h, keys.shape[1], d)[:, :, :kept].permute(0, 2, 1, 3)
    return out


def _attention_probs_reference(tiles, loops=None, normalized=False):  # torch ops only, whatever ``loops`` says
    b, h, rb, kb, block, vis = tiles.batch, tiles.kv_heads, tiles.row_blocks, tiles.key_blocks, tiles.block, \
        tiles.visible
    scores = tiles.host.bmm(tiles.row_tiles(tiles.q), tiles.key_tiles(tiles.k).transpose(1, 2), op="attention",
                             shared_operand=False)
    scores = scores.view(b, h, rb, kb, block, KEY_BLOCK).permute(0, 1, 2, 4, 3, 5)
    real = tiles.rows if rb == 1 else block
    row_t = tiles.row_t.view(rb, block)[:, :real]
    query_pos = tiles.q_start.view(b, 1, 1, 1, 1, 1) + row_t.view(1, 1, rb, real, 1, 1)
    key_pos = torch.arange(tiles.key_len, device=scores.device).view(1, 1, 1, 1, kb, KEY_BLOCK)
    masked = torch.empty(b, h, rb, real, kb, KEY_BLOCK, device=scores.device)
    torch.where(key_pos <= query_pos, scores[:, :, :, :real], scores.new_full((), float("-inf")), out=masked)
    masked = masked.view(b, h, rb, real, tiles.key_len)
    row_max = masked.amax(dim=-1, keepdim=True)
    window = masked[..., :vis]
    probs = unary("exp", window - row_max, tiles.host, "attention")
    full_tiles, last = vis // KEY_BLOCK, vis % KEY_BLOCK
    parts = []
    if full_tiles:
        parts.append(_tree_sum(probs[..., : full_tiles * KEY_BLOCK].reshape(b, h, rb, real, full_tiles, KEY_BLOCK)))
    if last:
        parts.append(_tree_sum(probs[..., full_tiles * KEY_BLOCK :]).unsqueeze(-1))
    per_tile = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    denom = (_tree_sum(per_tile) if kb > 1 else per_tile[..., 0]).unsqueeze(-1)
    alloc = torch.empty if (real == block and vis == tiles.key_len) else torch.zeros
    tiles_out = alloc(b, h, rb, kb, block, KEY_BLOCK, device=scores.device)
    as_rows = tiles_out.permute(0, 1, 2, 4, 3, 5)[:, :, :, :real]
    if full_tiles:
        as_rows[..., :full_tiles, :] = probs[..., : full_tiles * KEY_BLOCK].view(b, h, rb, real, full_tiles,
                                                                                 KEY_BLOCK)
    if last:
        as_rows[..., full_tiles, :last] = probs[..., full_tiles * KEY_BLOCK :]
    denom_rows = denom if real == block else torch.nn.functional.pad(denom, (0, 0, 0, block - real), value=1.0)
    return tiles_out.view(-1, block, KEY_BLOCK), denom_rows, probs / denom if normalized else probs, denom


def _attention_grad_scores_reference(d_p, d_out, out_rows, p):
    return (d_p - _tree_sum(d_out * out_rows).unsqueeze(-1)) * p


def _rms_norm_vjp_reference(saved, grad, needs):
    xf, inv_rms, weight, dtype = saved
    g = fp32(grad)
    grad_x = grad_w = None
    if needs[0]:
        gw = g * fp32(weight)
        dot = _tree_sum(gw * xf).div_(xf.shape[-1]).unsqueeze(-1)
        grad_x = (inv_rms * (gw - xf * (inv_rms * inv_rms) * dot)).to(dtype)
    if needs[1]:
        grad_w = _tree_sum((g * xf * inv_rms).reshape(-1, xf.shape[-1]), dim=0).to(weight.dtype)
    return grad_x, grad_w


def _silu_mul_with_saved_reference(gate, up, host):
    return cpu_exact._silu_mul_exact(gate, up, host), (gate, up, host)


def _silu_mul_vjp_reference(saved, grad, needs):
    gate, up, host = saved
    gf, g = fp32(gate), fp32(grad)
    denom = unary("exp", gf.neg(), host, "silu_mul", inplace=True).add_(1.0)
    grad_gate = grad_up = None
    if needs[0]:
        s = torch.reciprocal(denom)
        ds = (1.0 - s).mul_(gf).add_(1.0).mul_(s)
        grad_gate = ds.mul_(g).mul_(fp32(up)).to(gate.dtype)
    if needs[1]:
        silu = torch.div(gf, denom)
        grad_up = fp32(silu.to(gate.dtype)).mul_(g).to(up.dtype)
    return grad_gate, grad_up


def _use_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put the reference compositions in place of the optimised ones (for the rest of the test)."""
    monkeypatch.setattr(gemm_weight_gradient, "transposed_matmul", _transposed_matmul_reference)
    monkeypatch.setattr(gemm_linear, "tiled_matmul", _tiled_matmul_reference)
    monkeypatch.setattr(gemm_batched, "batched_matmul", _batched_matmul_reference)
    monkeypatch.setattr(cpu_attention._AttentionTiles, "_query_rows", _query_rows_reference)
    monkeypatch.setattr(cpu_attention._AttentionTiles, "_key_rows", _key_rows_reference)
    monkeypatch.setattr(cpu_attention, "_attention_probs", _attention_probs_reference)
    monkeypatch.setattr(cpu_attention, "_attention_grad_scores", _attention_grad_scores_reference)
    monkeypatch.setattr(cpu_exact, "_rms_norm_vjp", _rms_norm_vjp_reference)
    monkeypatch.setattr(cpu_attention._AttentionTiles, "from_output", _from_output_reference)
    monkeypatch.setattr(cpu_attention._AttentionTiles, "to_cache", _to_cache_reference)
    monkeypatch.setattr(cpu_exact, "_silu_mul_with_saved", _silu_mul_with_saved_reference)
    monkeypatch.setattr(cpu_exact, "_silu_mul_vjp", _silu_mul_vjp_reference)


# --------------------------------------------------------------------------- the cases
def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _linear_case(dtype, rows, k, n, bias):
    def run(host):
        x = _randn(rows, k, dtype=dtype, seed=1).requires_grad_(True)
        w = _randn(n, k, dtype=dtype, seed=2, scale=0.1).requires_grad_(True)
        b = _randn(n, dtype=dtype, seed=3).requires_grad_(True) if bias else None
        y = cpu_exact.linear(x, w, b, host=host)
        inputs = [t for t in (x, w, b) if t is not None]
        return [y, *torch.autograd.grad(y, inputs, _randn(*y.shape, dtype=dtype, seed=4))]
    return run


def _attention_case(dtype, batch, q_len, q_heads, kv_heads, head_dim, cache_len, starts):
    def run(host):
        q = _randn(batch, q_len, q_heads, head_dim, dtype=dtype, seed=5).requires_grad_(True)
        k = _randn(batch, cache_len, kv_heads, head_dim, dtype=dtype, seed=6).requires_grad_(True)
        v = _randn(batch, cache_len, kv_heads, head_dim, dtype=dtype, seed=7).requires_grad_(True)
        y = cpu_exact.attention(q, k, v, torch.tensor(starts), head_dim**-0.5, host=host)
        with torch.no_grad():
            decode = cpu_exact.attention(q[:, -1:], k, v, torch.tensor(starts) + q_len - 1, head_dim**-0.5, host=host)
        return [y, decode, *torch.autograd.grad(y, [q, k, v], _randn(*y.shape, dtype=dtype, seed=8))]
    return run


def _rms_norm_case(dtype, shape, only):
    def run(host):
        x = _randn(*shape, dtype=dtype, seed=12).requires_grad_(only != "weight")
        w = (_randn(shape[-1], dtype=dtype, seed=13) + 1.0).requires_grad_(only != "x")
        y = cpu_exact.rms_norm(x, w, 1e-6, host=host)
        inputs = [t for t in (x, w) if t.requires_grad]
        return [y, *torch.autograd.grad(y, inputs, _randn(*y.shape, dtype=dtype, seed=14))]
    return run


def _silu_mul_case(dtype, shape, only):
    def run(host):
        gate = _randn(*shape, dtype=dtype, seed=15, scale=4.0).requires_grad_(only != "up")
        up = _randn(*shape, dtype=dtype, seed=16).requires_grad_(only != "gate")
        y = cpu_exact.silu_mul(gate, up, host=host)
        inputs = [t for t in (gate, up) if t.requires_grad]
        return [y, *torch.autograd.grad(y, inputs, _randn(*y.shape, dtype=dtype, seed=17))]
    return run


def _transposed_case(rows, n, k, layout):
    """``_transposed_matmul`` on its own, with inputs of unusual layout (transposed, offset, sliced)."""
    def run(host):
        a, b = _randn(rows, n, seed=9, dtype=torch.float32), _randn(rows, k, seed=10, dtype=torch.float32)
        if layout == "transposed":
            a, b = a.t().contiguous().t(), b.t().contiguous().t()
        elif layout == "offset":  # contiguous, not 64-byte aligned
            a, b = torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view(rows, n), b
        elif layout == "sliced":
            a = torch.cat([a, a], dim=1)[:, :n]
        return [gemm_weight_gradient.transposed_matmul(a, b, host, "linear")]
    return run


CASES = {
    **{f"linear-{rows}x{k}x{n}-{'bias' if bias else 'nobias'}": (_linear_case, rows, k, n, bias)
       for rows, k, n, bias in [(1, 64, 64, False), (37, 176, 64, True), (130, 64, 22, False), (256, 64, 176, False),
                                (300, 96, 32, True), (520, 64, 1536, False), (700, 40, 24, True)]},
    **{f"attention-{b}x{t}x{hq}x{hkv}x{hd}x{cache}-{starts}": (_attention_case, b, t, hq, hkv, hd, cache, starts)
       for b, t, hq, hkv, hd, cache, starts in [(3, 20, 4, 2, 16, 20, [0, 0, 0]), (2, 70, 9, 3, 64, 70, [0, 0]),
                                                (4, 3, 4, 2, 16, 64, [5, 60, 0, 30]), (2, 5, 3, 1, 32, 150, [100, 7]),
                                                (1, 64, 2, 2, 16, 64, [0])]},
}
ROW_WISE = {f"rms_norm-{shape}-{only}": (_rms_norm_case, shape, only)
            for shape in [(1, 64), (5, 7, 64), (300, 96), (2, 3, 1), (33, 576)] for only in ("both", "x", "weight")}
ROW_WISE |= {f"silu_mul-{shape}-{only}": (_silu_mul_case, shape, only)
             for shape in [(1, 176), (5, 7, 176), (300, 1536), (33,)] for only in ("both", "gate", "up")}
TRANSPOSED = [(rows, n, k, layout) for rows, n, k in [(64, 64, 64), (300, 176, 64), (4000, 64, 176), (256, 1536, 64),
                                                      (700, 128, 64), (512, 192, 40)]
              for layout in ("contiguous", "transposed", "offset", "sliced")]


def _run_both(run, monkeypatch) -> tuple[tuple[list, list], tuple[list, list]]:
    """(calls, outputs) of ``run`` with the optimised kernels, then with the reference compositions."""
    results = []
    for reference in (False, True):
        with contextlib.ExitStack() as stack:
            if reference:
                patch = stack.enter_context(monkeypatch.context())
                _use_reference(patch)
            stack.enter_context(poisoned_allocations())
            host = RecordingGuard()
            outputs = run(host)
        results.append((host.calls, [t.detach() for t in outputs]))
    return results[0], results[1]


_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float64: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal calls -0.0 and +0.0 equal; these do not)."""
    return t.contiguous().view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _differences(new: tuple[list, list], reference: tuple[list, list]) -> list[str]:
    """What differs between two runs: the GEMM tiles computed (each tile's op, operand form, shapes, strides,
    alignment and values, as a multiset: how tiles are grouped into calls is not compared -- a tile's rows do not
    depend on it, a probed property) and the outputs (raw bits)."""
    (calls, outputs), (ref_calls, ref_outputs) = new, reference
    found = []
    tiles = Counter(tile for call in calls for tile in call)
    ref_tiles = Counter(tile for call in ref_calls for tile in call)
    if tiles != ref_tiles:
        extra, missing = tiles - ref_tiles, ref_tiles - tiles
        found.append(f"GEMM operand tiles: {sum(extra.values())} not in the reference, {sum(missing.values())} of the "
                     f"reference's missing (first: {next(iter(extra), None)} vs {next(iter(missing), None)})")
    for i, (out, ref) in enumerate(zip(outputs, ref_outputs)):
        if out.dtype != ref.dtype or out.shape != ref.shape or not _same_bits(out, ref):
            found.append(f"output {i} differs")
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_same_gemm_calls_and_bits_as_the_reference(case, dtype, monkeypatch):
    make, *shape = CASES[case]
    new, reference = _run_both(make(dtype, *shape), monkeypatch)
    assert new[0], "the case must make GEMM calls"
    assert _differences(new, reference) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(ROW_WISE))
def test_row_wise_backward_bits_as_the_reference(case, dtype, monkeypatch):
    """The norm's backward writes its steps into one scratch tensor, SwiGLU's keeps the forward's 1 + exp(-gate) and
    silu instead of computing them again: the same ops in the same order on the same values, the same bits."""
    make, *shape = ROW_WISE[case]
    new, reference = _run_both(make(dtype, *shape), monkeypatch)
    assert _differences(new, reference) == []


@pytest.mark.parametrize("calls_from", [0, gemm_tiles.ROW_TILE_CALLS_FROM], ids=["per-row-tile", "default"])
@pytest.mark.parametrize("rows,n,k,layout", TRANSPOSED)
def test_weight_gradient_layout_matches_the_reference(rows, n, k, layout, calls_from, monkeypatch):
    """Both forms of the weight gradient over several chunks and row tiles (one GEMM call, or one per row tile) give
    the reference's tiles and bits."""
    monkeypatch.setattr(gemm_tiles, "ROW_TILE_CALLS_FROM", calls_from)
    new, reference = _run_both(_transposed_case(rows, n, k, layout), monkeypatch)
    assert _differences(new, reference) == []


def test_the_check_catches_padding_left_unzeroed(monkeypatch):
    """Counter-test: a layout that forgets to zero its padding differs from the reference (NaN in the operands)."""
    def lazy(src, block, chunks, width):
        out = src.new_empty(chunks, width, block)  # no zeros: padding keeps whatever the allocation held
        full, tail = divmod(src.shape[0], block)
        out[:full, : src.shape[1]].copy_(src[: full * block].view(full, block, src.shape[1]).transpose(1, 2))
        if tail:
            out[full, : src.shape[1], :tail].copy_(src[full * block :].t())
        return out
    monkeypatch.setattr(gemm_weight_gradient, "_chunks_transposed", lazy)
    new, reference = _run_both(_transposed_case(300, 176, 64, "contiguous"), monkeypatch)
    assert any("operand" in found for found in _differences(new, reference))


def test_the_check_catches_operand_padding_left_unzeroed(monkeypatch):
    """Counter-test for ``zero_padded`` (the linear, weight-gradient and attention-backward operands): padding it
    forgets to zero shows as NaN operands and outputs that differ from constant_pad_nd's."""
    def lazy(x, shape):
        out = x.new_empty(shape)
        out[tuple(slice(0, size) for size in x.shape)].copy_(x)
        return out
    monkeypatch.setattr(gemm_tiles, "zero_padded", lazy)
    for make, *shape in (CASES["linear-37x176x64-bias"], CASES["attention-3x20x4x2x16x20-[0, 0, 0]"]):
        new, reference = _run_both(make(torch.float32, *shape), monkeypatch)
        assert any("operand" in found for found in _differences(new, reference))


def _shared_input_case(dtype):
    """Three linear layers on one input (q, k and v), then one on the same input changed in place: the weight
    gradients reuse one laid-out operand while the input is unchanged, and lay it out afresh after the change."""
    def run(host):
        x = _randn(400, 64, dtype=dtype, seed=18)  # a last chunk of 144 tokens, padded to a whole one
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1.0  # a non-leaf input, as a norm's output
        weights = [_randn(n, 64, dtype=dtype, seed=19 + i, scale=0.1).requires_grad_(True)
                   for i, n in enumerate((64, 32, 32))]
        outs = [cpu_exact.linear(h, w, host=host) for w in weights]
        loss = sum((o.float() * _randn(*o.shape, dtype=torch.float32, seed=30 + i)).sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, weights)
        with torch.no_grad():
            h.mul_(2.0)  # in place: the version counter moves on
        w = weights[0]
        y = cpu_exact.linear(h, w, host=host)
        return [*grads, *torch.autograd.grad(y, [w], _randn(*y.shape, dtype=dtype, seed=40))]
    return run


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_shared_input_operand_reused_with_the_same_bits(dtype, monkeypatch):
    """The weight gradients of layers sharing an input get the same GEMM operands and bits as a fresh layout per
    layer (the reference), and the layout is reused: fewer transposing copies."""
    new, reference = _run_both(_shared_input_case(dtype), monkeypatch)
    assert _differences(new, reference) == []
    calls, fresh, inside = [], [], []
    real_operand, real_layout = gemm_weight_gradient._reduction_operand, gemm_weight_gradient._chunks_transposed

    def operand(*args):
        calls.append(args[0].shape)
        inside.append(True)
        try:
            return real_operand(*args)
        finally:
            inside.pop()

    def layout(src, *args):
        if inside:  # a right operand laid out afresh
            fresh.append(src.shape)
        return real_layout(src, *args)
    monkeypatch.setattr(gemm_weight_gradient, "_reduction_operand", operand)
    monkeypatch.setattr(gemm_weight_gradient, "_chunks_transposed", layout)
    _shared_input_case(dtype)(RecordingGuard())
    assert len(calls) == 4  # four weight gradients
    assert len(fresh) == 2  # the input laid out once for the three layers, once after the in-place change


def test_shared_input_operand_follows_an_in_place_change(monkeypatch):
    """Counter-test: an operand kept whatever the version (a stale layout after the in-place change) is caught."""
    real = gemm_weight_gradient._reduction_operand
    stale = {}

    def ignore_version(b, block, chunks, k_pad, row_tiles, source):
        if source is not None and id(source) in stale:
            return stale[id(source)]
        out = real(b, block, chunks, k_pad, row_tiles, source)
        if source is not None:
            stale[id(source)] = out
        return out
    monkeypatch.setattr(gemm_weight_gradient, "_reduction_operand", ignore_version)
    new, reference = _run_both(_shared_input_case(torch.float32), monkeypatch)
    assert any("differs" in found for found in _differences(new, reference))


def test_the_check_catches_a_row_tile_layout_left_unzeroed(monkeypatch):
    """Counter-test for the weight gradient's one-call-per-row-tile path (several chunks and row tiles): a layout whose
    last, partial row tile is not zero-padded shows as operand tiles the reference does not have."""
    real = gemm_weight_gradient._row_tiles_transposed
    used = []

    def lazy(a, block, chunks, row_tiles, height):
        used.append(True)
        out = real(a, block, chunks, row_tiles, height)
        out[-1, :, a.shape[1] % height :] = float("nan")
        return out
    monkeypatch.setattr(gemm_weight_gradient, "_row_tiles_transposed", lazy)
    monkeypatch.setattr(gemm_tiles, "ROW_TILE_CALLS_FROM", 0)
    new, reference = _run_both(_transposed_case(400, 176, 64, "contiguous"), monkeypatch)  # two chunks, one partial
    assert used and any("operand" in found for found in _differences(new, reference))


def test_batched_matmul_takes_a_transposed_operand_with_nothing_to_pad():
    """Regression: attention's backward multiplies p.T (a transposed view); with rows a multiple of the 64-row tile
    (several tiles) and K a multiple of 16 there is nothing to pad, the operand kept p.T's strides, and merging it
    into row tiles raised (a run at 512 positions failed in its first update). The result is bitwise the one of
    the same values laid out contiguously, and close to torch's."""
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode="fixed-order")
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(2, 48, 128, generator=gen)  # [batch, keys, queries]: p.T has 128 rows = two 64-row tiles
    d_out = torch.randn(2, 48, 32, generator=gen)
    transposed = p.transpose(1, 2)
    out = gemm_batched.batched_matmul(transposed, d_out, host, "attention")
    assert torch.equal(out, gemm_batched.batched_matmul(transposed.contiguous(), d_out, host, "attention"))
    torch.testing.assert_close(out, torch.bmm(transposed, d_out), rtol=1e-5, atol=1e-5)  # fp32 reordering only
