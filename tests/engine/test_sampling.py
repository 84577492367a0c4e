"""The sampler's bits: the int32-lane hash and the in-place Gumbel steps give what the int64 formula gives."""

from __future__ import annotations

import pytest
import torch

from vexact.engine import sampling
from vexact_kernels.cpu_exact import elementwise

MASK = 0xFFFFFFFF


def reference_uniform(seed: int, sequence_ids: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The counter-based uniform as first defined: every step in int64 lanes, out of place."""
    key = sampling._mix32(torch.full_like(sequence_ids, seed & MASK) ^ 0x9E3779B9)
    key = sampling._mix32(key ^ (sequence_ids & MASK))
    key = sampling._mix32(key ^ (positions & MASK))
    columns = torch.arange(width, dtype=torch.int64)
    bits = sampling._mix32(sampling._mix32(key[:, None] ^ columns[None, :]) ^ (seed >> 32 & MASK))
    return (bits.double() + 0.5) / 2.0**32


SEEDS = [0, 1, 12345, 2**31 + 5, 2**32 + 7, 0xDEADBEEFCAFE, 2**63 - 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_counter_uniform_equals_the_int64_formula(seed):
    ids = torch.tensor([0, 1, 5, 2**31, 2**32 - 1, 123456789, 2**40 + 3])
    positions = torch.tensor([0, 3, 2**20, 7, 31, 2**33, 2**31 - 1])
    for width in (1, 7, 4099):
        got = sampling.counter_uniform(seed, ids, positions, width)
        assert got.dtype == torch.float64 and got.shape == (len(ids), width)
        assert torch.equal(got, reference_uniform(seed, ids, positions, width))


def test_int32_lanes_cover_every_bit_pattern_class():
    """Lanes whose hash passes through negative int32 values (bit 31 set) in every step: the masks after the
    arithmetic shifts matter; the full 32-bit range of keys is hit."""
    keys = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x80000001, 0xFFFF0000, 0x0000FFFF])
    expected = sampling._mix32(keys)
    lanes = (keys - ((keys >> 31) << 32)).to(torch.int32)
    got = sampling._mix32_lanes_(lanes, torch.empty_like(lanes)).to(torch.int64) & MASK
    assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", [0, 2**32 + 7])
def test_sampled_tokens_equal_the_out_of_place_formula(seed):
    torch.manual_seed(0)
    vocab = 4099
    logits = torch.randn(6, vocab) * 3.0
    ids, positions = torch.arange(10, 16), torch.tensor([0, 1, 2, 3, 40, 500])
    uniform = reference_uniform(seed, ids, positions, vocab)
    noise = -elementwise("log", -elementwise("log", uniform))
    assert torch.equal(sampling.gumbel_noise(seed, ids, positions, vocab), noise)
    expected = (logits.double() + noise).argmax(dim=-1)
    tokens = sampling.sample_tokens(logits, seed, ids, positions, greedy=False)
    assert torch.equal(tokens, expected)
    assert len(set(tokens.tolist())) > 1  # the noise decides: not every row's plain argmax
    assert not torch.equal(tokens, logits.argmax(dim=-1))


class _UnusedHost:
    """A host guard that fails if asked: a GPU tensor must not reach the CPU's probes or compiled loops."""

    def elementwise(self, *args, **kwargs):
        raise AssertionError("the CPU host guard was asked about a tensor that is not on the CPU")


@pytest.mark.parametrize("name", ["exp", "log", "cos", "sqrt"])
def test_elementwise_off_the_cpu_takes_torch_op_not_the_cpu_guard(name):
    """The sampler and the optimizer call ``elementwise`` on the model's device. Off the CPU (here the meta device,
    which stands for a GPU: shapes only) it must be torch's own op, never the CPU guard's path or the CPU-only
    compiled loop (which refuses a CUDA tensor)."""
    x = torch.empty(3, 5, dtype=torch.float64, device="meta")
    out = elementwise(name, x, host=_UnusedHost())
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == x.dtype
    with pytest.raises(AssertionError, match="not on the CPU"):
        elementwise(name, torch.rand(3, 5, dtype=torch.float64), host=_UnusedHost())
