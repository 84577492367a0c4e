"""The kernel-op contract: the functions every backend provides, with their signatures -- the one source of op names.

A backend is any object with these functions (a module such as ``native`` / ``cpu_exact`` / ``triton_exact``, a
``cpu_exact.with_host(...)`` namespace, the injector's ``precision_ops``, ``locate``'s ``OpRecorder``).
``OP_NAMES`` is derived from this class, so adding an op means adding it here, then to every backend: the test
``tests/kernels/test_kernel_contract.py`` fails for a backend that lacks it or spells its signature differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class KernelOps(Protocol):
    """The ops ``Transformer.forward`` / ``logits`` and scoring call (see each backend for its invariance contract)."""

    def embedding(self, tokens: Tensor, weight: Tensor) -> Tensor:
        """Rows of ``weight`` [V, D] picked by ``tokens`` -> [..., D]."""
        ...

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., K] @ weight[N, K].T (+ bias) -> [..., N]."""
        ...

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """Llama RMSNorm over the last dim."""
        ...

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        """silu(gate) * up, elementwise."""
        ...

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary embedding (rotate-half)."""
        ...

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
        """Causal grouped-query attention of new queries against a KV cache."""
        ...

    def log_softmax(self, logits: Tensor) -> Tensor:
        """log_softmax over the last dim, fp32."""
        ...

    def token_logprobs(self, logits: Tensor, targets: Tensor) -> Tensor:
        """log p(target) per row, fp32."""
        ...

    def entropy(self, log_probs: Tensor) -> Tensor:
        """-sum(p log p) of a log_softmax output, per row."""
        ...


OP_NAMES: tuple[str, ...] = tuple(name for name in vars(KernelOps) if not name.startswith("_")
                                  and callable(vars(KernelOps)[name]))


class FusedOps(Protocol):
    """Ops a backend may offer beside the contract's: each gives the bits of the contract's calls it stands for, in
    fewer calls. A caller reaches them through the functions below, which make the contract's calls where a backend
    lacks them -- so a wrapper of a backend that offers only the contract's ops (the injector's, a recorder) still
    sees every call."""

    def linears(self, x: Tensor, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """``tuple(linear(x, w) for w in weights)`` (no biases), bit for bit."""
        ...


FUSED_OP_NAMES: tuple[str, ...] = tuple(name for name in vars(FusedOps) if not name.startswith("_")
                                        and callable(vars(FusedOps)[name]))


def linears(ops: KernelOps, x: Tensor, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Linear layers of one input (no biases): ``ops.linears`` where the backend offers it, else ``ops.linear`` per
    weight -- the same bits."""
    fused = getattr(ops, "linears", None)
    return fused(x, weights) if fused is not None else tuple(ops.linear(x, w) for w in weights)
