"""Shared helpers: tiny random models (no downloads) and a thread-count context."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from vexact import ModelConfig, Transformer

TINY = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
            max_seq_len=128)


def tiny_model(backend: str = "exact", dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    return Transformer(ModelConfig(**{**TINY, **overrides}), backend=backend, dtype=dtype, init_seed=0)


def random_prompts(n: int, max_len: int, vocab: int = 97, seed: int = 0, min_len: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_torch_thread():
    """One torch thread: tiny models gain nothing from two, and on a busy 2-core machine OpenMP's barrier
    waits made each small matmul ~500x slower. (Thread-count invariance is tested in test_exactness.)"""
    with num_threads(1):
        yield
