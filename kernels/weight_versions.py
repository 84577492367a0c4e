"""What the exact CPU kernels keep per weight, and ``forget_weight``, which drops it.

A linear layer's weight is laid out, planned and packed once and reused while it is unchanged: its laid-out operands
(``gemm_laid_out.arranged_weight``), its plans and what they hold (``gemm_linear.kept_plan``), a decode loop's
remembered calls (``linear_repeats``) and the weights packed as one (``fused_linears``). "Unchanged" is read from the
tensor's identity, its view (shape, strides, data pointer: rebinding ``param.data`` is seen) and its version counter
(``Tensor._version``), which autograd-visible in-place ops bump (``copy_`` under no_grad, ``load_state_dict``, torch's
for-loop and foreach optimizers, vexact's ``ExactAdamW``). Writes that leave the counter as it was are not seen: torch's
``fused=True`` optimizers (torch 2.13's fused Adam, AdamW and SGD), ``param.data.copy_(...)`` and other writes through
``.data``, writes through ``param.numpy()`` or another tensor on the same memory. After such a write the kernels would
compute with the weight's old values; ``forget_weight(weight)`` drops everything kept for it, so the next call lays
it out afresh (the bits of a call on a fresh copy of the weight).

Each module that keeps something per weight registers its forgetter here (``keeps_per_weight``), so
``forget_weight`` reaches every such cache without naming them; a weight is matched by its memory (its storage),
so the tensor passed to ``forget_weight`` need not be the one passed to the kernels. Every loop over a kept cache
goes over ``kept_snapshot`` of it: the kernels and ``forget_weight`` may run on several Python threads at once.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_FORGETTERS: list[Callable[[Callable[[Tensor], bool]], None]] = []


def kept_snapshot(kept: dict | WeakIdKeyDictionary) -> list[tuple]:
    """The (key, value) pairs of a cache the kernels keep, taken in one step, to loop over while other Python threads
    add or pop entries (the kernels, ``forget_weight``) and a weak key's death pops one (a collection's callback).
    A loop over the cache itself may see it change size (``RuntimeError: dictionary changed size during
    iteration``); ``dict.copy`` copies it in C without calling back into Python, so no other thread runs in between.
    A weakly keyed cache (``WeakIdKeyDictionary``) gives its live keys."""
    if isinstance(kept, WeakIdKeyDictionary):
        return [(key, value) for ref, value in kept.data.copy().items() if (key := ref()) is not None]
    return list(kept.copy().items())


def keeps_per_weight(forget: Callable[[Callable[[Tensor], bool]], None]) -> Callable[[Callable[[Tensor], bool]], None]:
    """Register ``forget(shares_memory)`` (a decorator): drops what its module keeps for every weight ``w`` with
    ``shares_memory(w)`` true. A forgetter pops its entries one by one (``dict.pop(key, None)``), so that it may run
    beside the kernels on another Python thread, and two forgetters at once, without an error or a miscount."""
    _FORGETTERS.append(forget)
    return forget


def forget_weight(weight: Tensor) -> None:
    """Drop every operand, plan and packed copy the exact CPU kernels keep for a weight on ``weight``'s memory (the
    weight itself, ``weight.data``, a view of it, the tensor an ``nn.Parameter`` was made from: whatever shares its
    storage), so its next call computes from its current values.

    Needed only after a write that does not bump the weight's version counter (the module's docstring: a torch
    ``fused=True`` optimizer step, a write through ``.data`` or ``.numpy()``); harmless otherwise (the next call lays
    the weight out again: the same bits). ``weight``: a tensor, typically an ``nn.Parameter``."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"forget_weight: weight must be a torch.Tensor, got {type(weight).__name__}")
    storage = weight.untyped_storage().data_ptr()

    def shares_memory(kept: Tensor) -> bool:
        return kept.untyped_storage().data_ptr() == storage

    for forget in _FORGETTERS:
        forget(shares_memory)
