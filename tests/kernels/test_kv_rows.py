"""The rows ``kv_rows`` keeps for a KV cache between the exact CPU attention's calls: after every write the rows it
hands out are those a fresh layout of the cache gives (bitwise), they are reused while nothing else wrote the cache,
laid out afresh where anything else did, and a decode with them gives the bits of one without them."""

from __future__ import annotations

import pytest
import torch
from test_compiled_loops import _values
from test_exact_price_bits import _bits

from vexact import Transformer, generate
from vexact.engine.presets import preset_config
from vexact_kernels import compiled_loops, cpu_attention, cpu_exact, kv_rows

BATCH, LENGTH, HEADS, DIM = 3, 150, 2, 8


def _cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(BATCH, LENGTH, HEADS, DIM, dtype=dtype)


def _write(cache: torch.Tensor, starts: list[int], length: int, seed: int) -> int:
    """The model's write of ``length`` new positions per sequence from ``starts``; returns the keys then visible."""
    positions = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]
    values = _values((BATCH, length, HEADS, DIM), torch.float64, seed).to(cache.dtype)
    kv_rows.write(cache, torch.arange(BATCH)[:, None], positions, values)
    return max(starts) + length


def _fresh(cache: torch.Tensor, key_len: int) -> torch.Tensor:
    """The layout the attention makes without kept rows (``_AttentionTiles._key_rows``)."""
    tiles = cpu_attention._AttentionTiles(torch.zeros(BATCH, 1, HEADS, DIM, dtype=cache.dtype), cache, cache,
                                      torch.tensor([key_len - 1] * BATCH), 1.0, cpu_exact.HOST)
    assert tiles.key_len == key_len
    return tiles._key_rows(cache)


def _key_len(visible: int) -> int:
    return -(-visible // 64) * 64


@pytest.fixture(params=["compiled", "python"])
def loops_or_not(request, monkeypatch):
    """With the compiled loops (where built) and with the torch ops alone."""
    if request.param == "compiled":
        if compiled_loops.library() is None:
            pytest.skip("no compiled loops on this host")
    else:
        monkeypatch.setattr(compiled_loops, "library", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_kept_rows_are_a_fresh_layout_after_every_write(dtype, loops_or_not):
    """A ragged prefill, then decode steps across two 64-key tiles: after each write the rows handed out equal a fresh
    layout bit for bit (special values included), and while the length holds they are the same rows, kept."""
    cache = _cache(dtype)
    starts = [0, 5, 2]
    visible = _write(cache, starts, 40, seed=1)  # a prefill: 40 positions per sequence from ragged starts
    lay_out = lambda c: _fresh(c, _key_len(visible))  # noqa: E731
    first = kv_rows.rows(cache, _key_len(visible), lay_out)
    assert torch.equal(_bits(first), _bits(_fresh(cache, _key_len(visible))))
    kept = first
    ends = [s + 40 for s in starts]
    for step in range(90):  # one new position per sequence, past the 64- and 128-key tile ends
        visible = _write(cache, ends, 1, seed=100 + step)
        ends = [e + 1 for e in ends]
        key_len = _key_len(visible)
        got = kv_rows.rows(cache, key_len, lambda c, n=key_len: _fresh(c, n))
        assert torch.equal(_bits(got), _bits(_fresh(cache, key_len))), f"step {step}"
        if got.shape == kept.shape:
            assert got is kept, f"step {step}: the rows were laid out afresh, not kept"
        kept = got


def test_a_write_not_through_kv_rows_lays_the_rows_out_afresh():
    """A write that bypasses ``kv_rows.write`` (any in-place op on the cache or a view of it) is seen through the
    version counter: the next rows are a fresh layout, whether a tracked write follows it or not."""
    cache = _cache(torch.float32)
    visible = _write(cache, [0, 0, 0], 10, seed=2)
    key_len = _key_len(visible)
    lay_out = lambda c: _fresh(c, key_len)  # noqa: E731
    kept = kv_rows.rows(cache, key_len, lay_out)
    cache[1, 3] = 7.0  # not through kv_rows: kept rows would be stale here
    got = kv_rows.rows(cache, key_len, lay_out)
    assert got is not kept and torch.equal(got, _fresh(cache, key_len))
    cache[:, :5].mul_(2.0)  # through a view, then a tracked write elsewhere
    _write(cache, [10, 10, 10], 1, seed=3)
    after = kv_rows.rows(cache, key_len, lay_out)
    assert after is not got and torch.equal(after, _fresh(cache, key_len))


def test_rows_are_laid_out_per_call_past_the_bound_and_for_caches_not_written_through_kv_rows(monkeypatch):
    """Nothing kept beyond ``ROWS_BYTES_MAX``, nor for a tensor ``kv_rows.write`` never wrote (a training step's
    keys): a fresh layout per call, the same values."""
    written, plain = _cache(torch.float32), _values((BATCH, LENGTH, HEADS, DIM), torch.float64, 4).float()
    _write(written, [0, 0, 0], 3, seed=5)
    monkeypatch.setattr(kv_rows, "ROWS_BYTES_MAX", 0)
    for cache in (written, plain):
        once = kv_rows.rows(cache, 64, lambda c: _fresh(c, 64))
        again = kv_rows.rows(cache, 64, lambda c: _fresh(c, 64))
        assert once is not again and torch.equal(once, again)
    monkeypatch.undo()
    once = kv_rows.rows(plain, 64, lambda c: _fresh(c, 64))
    assert kv_rows.rows(plain, 64, lambda c: _fresh(c, 64)) is not once


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_decode_with_kept_rows_is_the_decode_without_them_bit_for_bit(dtype, monkeypatch):
    """A rollout of ragged prompts past two 64-key tile ends: the same tokens and log-probs with the rows kept as with
    every call laying them out afresh (``ROWS_BYTES_MAX`` 0)."""
    config = preset_config("tiny", vocab_size=64, max_seq_len=160)
    model = Transformer(config, backend="exact", dtype=dtype, init_seed=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]

    layouts = []
    lay_out = cpu_attention._AttentionTiles._key_rows

    def counted(tiles, cache):
        layouts.append(cache.shape)
        return lay_out(tiles, cache)

    monkeypatch.setattr(cpu_attention._AttentionTiles, "_key_rows", counted)

    def rollout():
        layouts.clear()
        out = generate(model, prompts, max_new_tokens=130, temperature=1.0, seed=3)
        return out, len(layouts)

    kept, kept_layouts = rollout()
    monkeypatch.setattr(kv_rows, "ROWS_BYTES_MAX", 0)
    fresh, fresh_layouts = rollout()
    # without kept rows every call (the prefill, 129 decode steps) lays its keys and values out; with them only the
    # calls whose keys reach a new 64-key tile: the prefill's 64 keys, then 128 and 192 (the longest prompt's 7 + 129)
    assert fresh_layouts == 2 * config.num_layers * 130 and kept_layouts == 2 * config.num_layers * 3
    assert kept.tokens == fresh.tokens
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(kept.logprobs, fresh.logprobs))
