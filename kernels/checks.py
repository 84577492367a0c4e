"""Input checks of the exact kernels' public ops, shared by every exact backend (``cpu_exact``, ``triton_exact``) and
the MoE routing (``moe_exact``): one contract, one source of its dtypes, shapes and messages.

Bad input is one TypeError (a dtype, a non-tensor) or ValueError (a shape, a device, a value) naming the op -- as
its caller passes it, e.g. ``"triton_exact.linear"`` -- and the argument, raised before any kernel runs: never a
deep error from inside a kernel, never a result (an integer input truncated, an fp64 one computed in fp32, a Triton
kernel reading past a too-short operand).

Each ``<op>`` check first tests the usual case -- what every model call passes -- with a few attribute reads and no
names (a decode step makes hundreds of op calls: the naming checks, run on each, cost 4% of a small model's CPU
step). Only when that test fails does it look again, to name what is wrong; a False is "look closer", not "wrong"
(mixed dtypes where an op allows them take the long way). All of it reads metadata only (dtype, shape, device): no
tensor op, so no bit moves and, on a GPU, no synchronisation. The two value checks (``ids_in_range``,
``query_starts``) read values and so skip CUDA tensors (see there).
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of the ops' floating operands, and so the dtypes the model computes in. Anything else (fp16,
fp64, an integer or bool tensor) is one TypeError naming the op and the argument: the kernels compute in fp32 and
round once to the input's dtype, so an fp64 input would silently lose its precision and an integer one be truncated
(and the Triton kernels' bits are audited, ``triton_audit``, for these two dtypes only)."""
INDEX_DTYPES = (torch.int64, torch.int32)


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensors(op: str, dtypes: tuple[torch.dtype, ...], **named: object) -> None:
    """One TypeError naming ``op`` and the argument unless each of ``named`` is a tensor of one of ``dtypes``; one
    ValueError unless they are all on one device."""
    device = None
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{op}: {name} has dtype {name_of(t.dtype)}; expected {' or '.join(map(name_of, dtypes))}")
        if device is None:
            device = (name, t.device)
        elif t.device != device[1]:
            raise ValueError(f"{op}: {name} is on {t.device} but {device[0]} on {device[1]}")


def same_dtype(op: str, **named: Tensor) -> None:
    """One TypeError unless ``named`` share one dtype (the native twin's torch op refuses mixed dtypes too)."""
    (first, a), *rest = named.items()
    for name, t in rest:
        if t.dtype != a.dtype:
            raise TypeError(f"{op}: {name} has dtype {name_of(t.dtype)} but {first} {name_of(a.dtype)}; "
                            "expected one dtype")


def same_device(op: str, **named: Tensor) -> None:
    """One ValueError unless ``named`` lie on one device."""
    (first, a), *rest = named.items()
    for name, t in rest:
        if t.device != a.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} on {a.device}")


def shape_error(op: str, text: str, **named: Tensor) -> ValueError:
    shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in named.items())
    return ValueError(f"{op}: {text} (got {shapes})")


def last_dim(op: str, name: str, t: Tensor) -> None:
    """One ValueError unless ``t`` has a last dimension of at least one element (a row to reduce)."""
    if t.dim() == 0 or t.shape[-1] == 0:
        raise shape_error(op, f"{name} needs a last dimension of at least one element", **{name: t})


# --------------------------------------------------------------------------- value checks (CPU tensors only)
# Reading a CUDA tensor's values (.item(), aminmax) synchronises the device, and these ops run per layer per decode
# step: there the values go unchecked, and what a bad value does is the kernel's (stated where it is called).
def ids_in_range(op: str, ids: Tensor, size: int, what: str, bound: tuple[str, str]) -> None:
    """One ValueError unless the ids of a CPU ``ids`` lie in [0, size) (torch's own error names no id): ``what``
    names the ids (``token``), ``bound`` the size's letter and where it comes from (``("V", "weight's rows")``)."""
    if ids.numel() and not ids.is_cuda:
        first, last = (int(bound) for bound in torch.aminmax(ids))
        if first < 0 or last >= size:
            letter, source = bound
            raise ValueError(f"{op}: {what} ids must lie in [0, {letter}), {letter} = {size} ({source}), got ids in "
                             f"[{first}, {last}]")


def query_starts(op: str, q_start: Tensor) -> tuple[int, int]:
    """(min, max) of a CPU ``q_start``; one ValueError if a query would sit before position 0 (it would see no key:
    its softmax has nothing to normalise)."""
    first, last = (int(bound) for bound in torch.aminmax(q_start))
    if first < 0:
        raise ValueError(f"{op}: q_start must be >= 0 (a query before position 0 sees no key), got q_start in "
                         f"[{first}, {last}]")
    return first, last


# --------------------------------------------------------------------------- the ops' checks
def embedding(op: str, tokens: Tensor, weight: Tensor) -> None:
    if not (isinstance(tokens, Tensor) and isinstance(weight, Tensor) and tokens.dtype in INDEX_DTYPES
            and weight.dtype in FLOAT_DTYPES and weight.dim() == 2 and tokens.device == weight.device):
        tensors(op, INDEX_DTYPES, tokens=tokens)
        tensors(op, FLOAT_DTYPES, weight=weight)
        if weight.dim() != 2:
            raise shape_error(op, "weight must be [V, D]", weight=weight)
        if tokens.device != weight.device:
            raise ValueError(f"{op}: tokens are on {tokens.device} but weight on {weight.device}")
    ids_in_range(op, tokens, weight.shape[0], "token", ("V", "weight's rows"))


def number(op: str, name: str, value: object) -> None:
    """One TypeError unless ``value`` is a Python number (``eps``, ``scale``: a tensor or None reached each backend's
    kernel and failed there, differently)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a Python float, got {type(value).__name__} {value!r}"[:200])


def rms_norm(op: str, x: Tensor, weight: Tensor, eps: float) -> None:
    if not (isinstance(x, Tensor) and isinstance(weight, Tensor) and x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype
            and x.dim() and weight.shape == x.shape[-1:] and weight.shape[0] and x.device == weight.device
            and type(eps) is float):
        number(op, "eps", eps)
        tensors(op, FLOAT_DTYPES, x=x, weight=weight)
        last_dim(op, "x", x)
        if weight.shape != x.shape[-1:]:
            raise shape_error(op, "weight must be [D], D = x's last dimension", x=x, weight=weight)


def linear(op: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    if not (isinstance(x, Tensor) and isinstance(weight, Tensor) and x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and x.dim() and 0 < x.shape[-1] == weight.shape[1] and weight.shape[0] > 0
            and x.device == weight.device
            and (bias is None or (isinstance(bias, Tensor) and bias.dtype == x.dtype and bias.device == x.device
                                  and bias.shape == weight.shape[:1]))):
        operands = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
        tensors(op, FLOAT_DTYPES, **operands)
        same_dtype(op, **operands)
        last_dim(op, "x", x)
        if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
            raise shape_error(op, "weight must be [N, K], K = x's last dimension", x=x, weight=weight)
        if weight.shape[0] == 0:
            raise shape_error(op, "weight needs at least one row (N >= 1 output features)", weight=weight)
        if bias is not None and bias.shape != weight.shape[:1]:
            raise shape_error(op, "bias must be [N], N = weight's first dimension", weight=weight, bias=bias)


def rope(op: str, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """cos and sin may broadcast over x's batch and time dimensions (a [1, T, hd/2] table for every sequence)."""
    if not (isinstance(x, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor) and x.dtype in FLOAT_DTYPES
            and cos.dtype in FLOAT_DTYPES and sin.dtype == cos.dtype and x.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape and cos.shape[-1] * 2 == x.shape[-1] and cos.shape[0] in (1, x.shape[0])
            and cos.shape[1] in (1, x.shape[1]) and x.device == cos.device == sin.device):
        tensors(op, FLOAT_DTYPES, x=x, cos=cos, sin=sin)
        if (x.dim() != 4 or x.shape[-1] % 2 or cos.dim() != 3 or cos.shape != sin.shape
                or cos.shape[-1] * 2 != x.shape[-1] or cos.shape[0] not in (1, x.shape[0])
                or cos.shape[1] not in (1, x.shape[1])):
            raise shape_error(op, "x must be [B, T, H, hd] with hd even, cos and sin [B, T, hd/2] (B and T may be 1)",
                              x=x, cos=cos, sin=sin)


def attention(op: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> None:
    """Metadata only; q_start's values are checked where the kernel reads them (``query_starts``)."""
    if not (isinstance(q, Tensor) and isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor)
            and isinstance(q_start, Tensor) and q.dtype in FLOAT_DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and q_start.dtype in INDEX_DTYPES and q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and q_start.shape == q.shape[:1] and k_cache.shape[0] == q.shape[0] > 0 and k_cache.shape[1] > 0
            and k_cache.shape[3] == q.shape[3] > 0 and k_cache.shape[2] > 0 and q.shape[2] % k_cache.shape[2] == 0
            and q.device == k_cache.device == v_cache.device == q_start.device and type(scale) is float):
        number(op, "scale", scale)
        tensors(op, FLOAT_DTYPES, q=q, k_cache=k_cache, v_cache=v_cache)
        same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
        tensors(op, INDEX_DTYPES, q_start=q_start)
        shapes = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "q_start": q_start}
        if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise shape_error(op, "q must be [B, T, Hq, hd], k_cache and v_cache one shape [B, L, Hkv, hd]", **shapes)
        (batch, _, q_heads, head_dim), (_, _, kv_heads, _) = q.shape, k_cache.shape
        if (k_cache.shape[0] != batch or k_cache.shape[3] != head_dim or q_start.shape != (batch,) or kv_heads == 0
                or q_heads % kv_heads or head_dim == 0):
            raise shape_error(op, "q [B, T, Hq, hd], k_cache and v_cache [B, L, Hkv, hd] with Hq a multiple of Hkv, "
                              "q_start [B]", **shapes)
        if batch == 0:
            raise shape_error(op, "no sequences", **shapes)
        if k_cache.shape[1] == 0:  # every query sees at least key 0
            raise shape_error(op, "the cache holds no position (L = 0): every query sees at least key 0", **shapes)
        if q_start.device != q.device:
            raise ValueError(f"{op}: q_start is on {q_start.device} but q on {q.device}")


def silu_mul(op: str, gate: Tensor, up: Tensor) -> None:
    if not (isinstance(gate, Tensor) and isinstance(up, Tensor) and gate.dtype in FLOAT_DTYPES
            and up.dtype == gate.dtype and gate.shape == up.shape and gate.device == up.device):
        tensors(op, FLOAT_DTYPES, gate=gate, up=up)
        same_dtype(op, gate=gate, up=up)
        if gate.shape != up.shape:
            raise shape_error(op, "gate and up must have one shape", gate=gate, up=up)


def rows(op: str, name: str, t: Tensor) -> None:
    """``t`` [..., V]: floating rows of at least one element (log_softmax's logits, entropy's log-probs)."""
    if not (isinstance(t, Tensor) and t.dtype in FLOAT_DTYPES and t.dim() and t.shape[-1]):
        tensors(op, FLOAT_DTYPES, **{name: t})
        last_dim(op, name, t)


def token_logprobs(op: str, logits: Tensor, targets: Tensor) -> None:
    if not (isinstance(logits, Tensor) and isinstance(targets, Tensor) and logits.dtype in FLOAT_DTYPES
            and targets.dtype == torch.int64 and logits.dim() and logits.shape[-1]
            and targets.shape == logits.shape[:-1] and targets.device == logits.device):
        tensors(op, FLOAT_DTYPES, logits=logits)
        tensors(op, (torch.int64,), targets=targets)
        last_dim(op, "logits", logits)
        if targets.device != logits.device:
            raise ValueError(f"{op}: targets are on {targets.device} but logits on {logits.device}")
        if targets.shape != logits.shape[:-1]:
            raise shape_error(op, "targets must be logits' shape without its last dimension", logits=logits,
                              targets=targets)
    ids_in_range(op, targets, logits.shape[-1], "target", ("V", "logits' last dimension"))
