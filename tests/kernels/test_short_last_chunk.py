"""A weight gradient's last chunk of at most half a chunk is reduced at its own length.

The canonical weight gradient (``gemm_weight_gradient.transposed_matmul``) cuts the tokens into ``REDUCE_BLOCK``-token
chunks and adds their partial products by a halving tree. The last chunk used to be zero-padded to a whole chunk:
llama100m's 312-token update multiplied 512 tokens' worth. Now a last chunk whose own ``_reduction_block`` is shorter
(at most 128 tokens) is padded to that length only (``last_chunk_length``). Checked here:

- the definition: the weight gradient over M tokens is, bit for bit, the halving tree of each chunk's own weight
  gradient (one chunk each), in every guard mode, on this host and on the emulated rows-in-call host, at 1 and 2
  threads; a last chunk over half a chunk is still padded to a whole one (the explicit padded composition);
- the lengths ``last_chunk_length`` gives;
- the chunked LM head's backward multiplies its last group at that length too (so its gradient is the exact
  kernels' on any host).
(The GEMM tiles' shapes against a reference composition: ``test_exact_price_bits``.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads
from test_host_guard import emulated_guard

from vexact_kernels import cpu_exact, gemm_weight_gradient
from vexact_kernels.compiled_loops import tree_sum
from vexact_kernels.gemm_tiles import REDUCE_BLOCK
from vexact_kernels.gemm_weight_gradient import last_chunk_length, transposed_matmul
from vexact_kernels.host_guard import HostGuard

MODES = ("auto", "canonical", "fixed-order")
# (tokens, output rows N, input width K): last chunks of 56 (llama100m's update), 1, 128 (3,968: a training batch
# of the default model) and 64 tokens, one with N over a slab of VIEW_SLAB_ROWS
SHORT = [(312, 130, 40), (257, 64, 17), (3968, 176, 64), (576, 4100, 16)]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _host(mode: str, emulated: bool, monkeypatch: pytest.MonkeyPatch) -> HostGuard:
    if emulated:
        return emulated_guard("rows-in-call", monkeypatch, mode=mode)
    return HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)


def test_last_chunk_length():
    assert REDUCE_BLOCK == 256
    cases = {312: 64, 257: 64, 320: 64, 321: 128, 384: 128, 385: 256, 400: 256, 512: 256, 3968: 128, 256: 256}
    for rows, length in cases.items():
        assert last_chunk_length(rows, REDUCE_BLOCK, torch.float32) == length, rows


@pytest.mark.parametrize("emulated", [False, True], ids=["this-host", "rows-in-call"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,n,k", SHORT)
def test_a_short_last_chunk_is_its_own_reduction(rows, n, k, mode, emulated, monkeypatch):
    """The weight gradient equals the tree of its chunks' own weight gradients, at 1 and 2 threads."""
    a, b = _randn(rows, n, seed=rows), _randn(rows, k, seed=rows + 1)
    host = _host(mode, emulated, monkeypatch)
    assert last_chunk_length(rows, REDUCE_BLOCK, a.dtype) < REDUCE_BLOCK
    chunks = [(a[i : i + REDUCE_BLOCK], b[i : i + REDUCE_BLOCK]) for i in range(0, rows, REDUCE_BLOCK)]
    expected = tree_sum(torch.stack([transposed_matmul(x, y, host, "linear") for x, y in chunks]), 0)
    for threads in (1, 2):
        with num_threads(threads):
            out = transposed_matmul(a, b, host, "linear")
        assert out.shape == (n, k) and torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())
    torch.testing.assert_close(out, a.t() @ b, rtol=1e-4, atol=1e-4)  # and it is a.T @ b (fp32 rounding)


@pytest.mark.parametrize("mode", MODES)
def test_a_longer_last_chunk_is_still_padded_to_a_whole_one(mode):
    """Counter-part: a last chunk of 144 tokens (over half a chunk) is zero-padded to 256, as before."""
    rows, n, k = 400, 96, 32
    a, b = _randn(rows, n, seed=5), _randn(rows, k, seed=6)
    host = HostGuard(cpu_exact.ROW_BLOCKS, mode=mode)
    pad = REDUCE_BLOCK * 2 - rows
    padded_a, padded_b = torch.cat([a, a.new_zeros(pad, n)]), torch.cat([b, b.new_zeros(pad, k)])
    parts = [transposed_matmul(padded_a[i : i + REDUCE_BLOCK], padded_b[i : i + REDUCE_BLOCK], host, "linear")
             for i in (0, REDUCE_BLOCK)]
    assert torch.equal(transposed_matmul(a, b, host, "linear"), tree_sum(torch.stack(parts), 0))


def test_the_chunked_head_multiplies_its_last_group_at_that_length(monkeypatch):
    """The LM head's backward in groups (``vexact.engine.head``) over 1,300 tokens: five whole groups and the last
    of 20 tokens, which it pads to 64 rows, as the exact kernels pad their last chunk."""
    from vexact.engine.head import head_scores

    seen: list[int] = []
    real = gemm_weight_gradient.transposed_matmul

    def recording(a, b, *args, **kwargs):
        seen.append(a.shape[0])
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(gemm_weight_gradient, "transposed_matmul", recording)
    rows, width, vocab = 1300, 16, 64
    hidden = _randn(rows, width, seed=1).requires_grad_(True)
    weight = (0.1 * _randn(vocab, width, seed=2)).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3))
    ops = cpu_exact.ops_in_mode("auto")
    logp, _ = head_scores(hidden, weight, targets, 1.0, ops, False, 300)
    logp.sum().backward()
    assert sorted(seen) == [64] + [REDUCE_BLOCK] * 5  # (the tree asks for the groups in bit-reversed order)
