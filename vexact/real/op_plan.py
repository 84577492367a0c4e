"""The op plan of ``vexact locate`` and ``vexact.testing``: vexact's forward as named op sites, one path's ops
recorded along it, and two recordings compared bit for bit.

``op_plan`` derives the plan from the forward itself (one traced forward of a weightless model); ``OpRecorder`` wraps
a backend's kernel ops and keeps each call's output under its plan name, refusing a call the plan does not have
(``OpStructureError``); ``capture`` runs one path (``rollout``: prefill then one-token decodes on a KV cache;
``train``: one full-sequence forward) through it; ``compare_captures``, ``first_divergence`` and ``layer_summary``
compare two captures. The command itself, its paths and settings: ``vexact.real.locate``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engine.generation import CACHE_BLOCK
from ..engine.inputs import pad_right
from ..engine.model import KernelOps, ModelConfig, Transformer
from ..rl.metrics import float_bits

KINDS = ("rollout", "train")
"""The kinds of path: ``rollout`` (the KV-cache path of ``generate``), ``train`` (that of ``token_logprobs``)."""


# --------------------------------------------------------------------------- the op plan
@dataclass(frozen=True)
class OpSlot:
    """One recorded tensor of a forward (+ logits): ``name``, the kernel op that produces or reads it, ``recorded``
    (``output``; ``input`` for the residual stream a norm reads), its ``group`` and per-position feature shape."""

    name: str
    kernel_op: str
    group: str
    feature_shape: tuple[int, ...]
    recorded: str = "output"

    @property
    def features(self) -> int:
        return math.prod(self.feature_shape)


def op_plan(config: ModelConfig) -> list[OpSlot]:
    """Every tensor recorded in one ``Transformer.forward`` plus ``Transformer.logits``, in call order.

    Derived from the forward itself, not kept beside it: one forward of a weightless model (``meta`` device) over one
    token runs through ``_PlanTracer``, which names each kernel op call by the parameter it uses (``layers.0.
    self_attn.q_proj.weight`` -> ``layer 0 / q_proj``) or, for an op without one, by where its input came from
    (RoPE on q_proj's output -> ``q_rope``). A norm that reads the residual stream also records that input, named by
    the block whose output was added to it last (``resid_attn`` after o_proj, ``resid_mlp`` after down_proj;
    ``embed`` for the embeddings). So a change to the forward changes the plan with it.
    A mixture-of-experts model is refused (ValueError): which expert ops run, and on how many rows, depends on the
    routing, so its forward has no fixed plan of op calls to compare path by path."""
    if config.moe_layers:
        raise ValueError(f"locate compares two paths op by op along a fixed plan of op calls, and a mixture-of-experts "
                         f"model ({config.num_experts} experts) has none: its expert calls depend on the routing; "
                         "compare its paths' log-probs with vexact measure instead")
    with torch.device("meta"):
        model = Transformer(config, backend="native", device="meta", init_seed=None)
    tracer = _PlanTracer(model)
    tokens = torch.zeros(1, 1, dtype=torch.long, device="meta")
    model.logits(model(tokens, ops=tracer), ops=tracer)
    return tracer.plan


_SITE_NAMES = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_norm"}
"""Parameter module names that read better shortened in a report; every other site keeps its module's name."""
_RESIDUAL_AFTER = {"o_proj": "resid_attn", "down_proj": "resid_mlp"}
"""The residual stream a norm reads, named by the block output that was added to it last."""


class _PlanTracer:
    """Kernel ops that compute nothing (empty outputs of the right shape, on ``meta``) and write ``plan``: one
    ``OpSlot`` per call of the forward, named by ``op_plan``'s rules."""

    def __init__(self, model: Transformer):
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.plan: list[OpSlot] = []
        # id(output) -> (the output, kept alive so that no later tensor reuses its id; (group, site) of the op that
        # made it; its index in plan, None for the embedding, which has no slot)
        self.made: dict[int, tuple[Tensor, tuple[str, str], int | None]] = {}
        self.last_block: tuple[str, str] | None = None  # (group, site) of the last linear, for the residual's name

    def _site(self, weight: Tensor) -> tuple[str, str]:
        """(group, site) of a parameter: ``layers.3.mlp.up_proj.weight`` -> ("layer 3", "up_proj")."""
        parts = self.param_names[id(weight)].split(".")
        if parts[0] == "layers":
            return f"layer {parts[1]}", _SITE_NAMES.get(parts[-2], parts[-2])
        return "head", "final_norm" if parts[0] == "norm" else "logits"

    def _source(self, x: Tensor) -> tuple[str, str] | None:
        made = self.made.get(id(x._base if x._base is not None else x))
        return None if made is None else made[1]

    def _emit(self, group: str, site: str, kernel_op: str, out: Tensor, recorded: str = "output",
              *inputs: Tensor) -> Tensor:
        for x in inputs:  # an input that is a per-head view of a recorded output: report that output per head
            slot = self.made[id(x._base)][2] if x._base is not None and id(x._base) in self.made else None
            if slot is not None:
                self.plan[slot] = dataclasses.replace(self.plan[slot], feature_shape=tuple(x.shape[2:]))
        name = site if group in ("head", "embed") else f"{group} / {site}"
        self.plan.append(OpSlot(name, kernel_op, group, tuple(out.shape[2:]), recorded))
        if recorded == "output":
            self.made[id(out)] = (out, (group, site), len(self.plan) - 1)
        return out

    def embedding(self, tokens: Tensor, weight: Tensor) -> Tensor:
        out = weight.new_empty(*tokens.shape, weight.shape[1])
        self.made[id(out)] = (out, ("embed", "embed"), None)  # a gather, exact everywhere: no slot of its own
        return out

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        group, site = self._site(weight)
        self.last_block = (group, site)
        return self._emit(group, site, "linear", x.new_empty(*x.shape[:-1], weight.shape[0]))

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        source = self._source(x)
        if source is None or source == ("embed", "embed"):  # the residual stream: record what the norm reads
            group, block = ("embed", "embed") if source else self.last_block
            self._emit(group, block if source else _RESIDUAL_AFTER[block], "rms_norm", x, "input")
        return self._emit(*self._site(weight), "rms_norm", torch.empty_like(x), "output", x)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        group, site = self._source(x)
        return self._emit(group, f"{site[0]}_rope", "rope", torch.empty_like(x), "output", x)  # q_proj -> q_rope

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
        return self._emit(self._source(q)[0], "attention", "attention", torch.empty_like(q), "output", q, k_cache,
                          v_cache)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return self._emit(self._source(gate)[0], "silu_mul", "silu_mul", torch.empty_like(gate), "output", gate, up)

    # Not called by a forward or its logits (scoring's ops): shapes only, no slot.
    def log_softmax(self, logits: Tensor) -> Tensor:
        return torch.empty_like(logits)

    def token_logprobs(self, logits: Tensor, targets: Tensor) -> Tensor:
        return logits.new_empty(targets.shape)

    def entropy(self, log_probs: Tensor) -> Tensor:
        return log_probs.new_empty(log_probs.shape[:-1])


class OpStructureError(RuntimeError):
    """The model called its ops in an order its plan does not describe: the plan was traced from another config
    than the model's, or the model's forward is not ``Transformer.forward`` (a bug in vexact, not bad input)."""


_PLAN_MISMATCH = "the model's forward is not the one the plan was traced from (pass op_plan(model.config))"


class OpRecorder:
    """Kernel ops that run ``ops`` unchanged and keep each output named by ``plan``.

    Pass it as ``ops=`` to ``Transformer.forward`` and ``Transformer.logits``. Between ``begin`` and ``finish`` (one
    forward plus its logits) it expects exactly the calls of ``plan``; a call that does not match raises
    ``OpStructureError``. ``begin`` says which rows of this forward to keep and where they go in ``store``
    (name -> [rows, features] tensor in the op's dtype, allocated at the first call)."""

    def __init__(self, ops: KernelOps, plan: list[OpSlot], rows: int):
        self.ops, self.plan, self.rows = ops, plan, rows
        self.store: dict[str, Tensor] = {}
        self._next: int | None = None
        self._keep: tuple[int, int, Tensor, Tensor, Tensor] | None = None

    def begin(self, batch: int, length: int, keep_batch: Tensor, keep_time: Tensor, dest: Tensor) -> None:
        """A forward over [batch, length] tokens starts; its rows (keep_batch[i], keep_time[i]) go to dest[i]."""
        self._next, self._keep = 0, (batch, length, keep_batch, keep_time, dest)

    def finish(self) -> None:
        """The forward and its logits are done: every slot of the plan must have been recorded."""
        if self._next != len(self.plan):
            missing = self.plan[self._next].name if self._next is not None else "(begin was not called)"
            raise OpStructureError(f"the forward ended before {missing!r} (slot {self._next} of {len(self.plan)}): "
                                   f"{_PLAN_MISMATCH}")
        self._next = self._keep = None

    # The kernel op functions (the names and signatures of vexact_kernels' backends).
    def embedding(self, tokens: Tensor, weight: Tensor) -> Tensor:
        return self.ops.embedding(tokens, weight)  # a gather, exact on every backend: not a slot of the plan

    def entropy(self, log_probs: Tensor) -> Tensor:
        return self.ops.entropy(log_probs)  # not part of a forward's plan (scoring's entropy only)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return self._run("linear", x, weight, bias)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._run("rms_norm", x, weight, eps)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return self._run("silu_mul", gate, up)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self._run("rope", x, cos, sin)

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, q_start: Tensor, scale: float) -> Tensor:
        return self._run("attention", q, k_cache, v_cache, q_start, scale)

    def log_softmax(self, logits: Tensor) -> Tensor:
        return self._run("log_softmax", logits)

    def token_logprobs(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self._run("token_logprobs", logits, targets)

    def _run(self, kernel_op: str, *args: Any) -> Tensor:
        while self._slot(kernel_op).recorded == "input":  # the residual stream this norm reads
            self._record(args[0])
        self._slot(kernel_op)
        out = getattr(self.ops, kernel_op)(*args)
        self._record(out)
        return out

    def _slot(self, kernel_op: str) -> OpSlot:
        """The slot this call must fill; OpStructureError if the call is not the one the plan expects."""
        if self._next is None:
            raise OpStructureError(f"{kernel_op} called outside begin/finish")
        if self._next >= len(self.plan):
            raise OpStructureError(f"an extra {kernel_op} call after the last slot {self.plan[-1].name!r}: "
                                   f"{_PLAN_MISMATCH}")
        slot = self.plan[self._next]
        if slot.kernel_op != kernel_op:
            raise OpStructureError(f"the forward called {kernel_op} where op_plan expects {slot.kernel_op} for "
                                   f"{slot.name!r} (slot {self._next}): {_PLAN_MISMATCH}")
        return slot

    def _record(self, tensor: Tensor) -> None:
        slot = self.plan[self._next]
        batch, length, keep_batch, keep_time, dest = self._keep
        if tensor.numel() != batch * length * slot.features:
            raise OpStructureError(f"{slot.name!r} (slot {self._next}) has shape {tuple(tensor.shape)}, op_plan "
                                   f"expects {slot.features} features for each of {batch}x{length} tokens: "
                                   f"{_PLAN_MISMATCH}")
        rows = tensor.detach().reshape(batch, length, slot.features)[keep_batch, keep_time]
        if slot.name not in self.store:
            self.store[slot.name] = torch.zeros(self.rows, slot.features, dtype=tensor.dtype)
        self.store[slot.name][dest] = rows.cpu()
        self._next += 1


# --------------------------------------------------------------------------- running a path
@torch.no_grad()
def capture(model: Transformer, ops: KernelOps, kind: str, sequences: list[list[int]], prefill: list[int],
            rows: list[tuple[int, int]]) -> dict[str, Tensor]:
    """Every op's output of one path: name -> [len(rows), features], row i = (sequence, position) ``rows[i]``.

    ``kind`` ``train``: one forward over all sequences (right-padded), no cache. ``rollout``: sequence b's first
    ``prefill[b]`` tokens in one forward that fills a KV cache (of ``generate``'s length), then each later token
    in a one-token forward at its position; a sequence that is done decodes padding, which is never kept."""
    plan = op_plan(model.config)
    recorder = OpRecorder(ops, plan, len(rows))
    device = model.device

    def forward(tokens: Tensor, keep: list[tuple[int, int, int]], **kwargs: Any) -> None:
        """One forward + logits, keeping (batch row, time, destination row) triples."""
        index = torch.tensor(keep, dtype=torch.long).reshape(-1, 3)
        recorder.begin(tokens.shape[0], tokens.shape[1], index[:, 0], index[:, 1], index[:, 2])
        hidden = model(tokens, ops=recorder, **kwargs)
        model.logits(hidden if tokens.shape[1] > 1 else hidden[:, 0], ops=recorder)  # decode: [B, D] as generate
        recorder.finish()

    if kind == "train":
        forward(pad_right(sequences, device), [(b, p, i) for i, (b, p) in enumerate(rows)])
        return recorder.store
    if kind != "rollout":
        raise ValueError(f"unknown path kind {kind!r}; expected one of {', '.join(KINDS)}")
    lengths = [len(s) for s in sequences]
    steps = max(n - k for n, k in zip(lengths, prefill))
    cache = model.new_cache(len(sequences), -(-(max(prefill) + steps) // CACHE_BLOCK) * CACHE_BLOCK)
    forward(pad_right([s[:k] for s, k in zip(sequences, prefill)], device),
            [(b, p, i) for i, (b, p) in enumerate(rows) if p < prefill[b]], cache=cache)
    for t in range(steps):
        tokens = [s[k + t] if k + t < len(s) else 0 for s, k in zip(sequences, prefill)]
        q_start = torch.tensor(prefill, dtype=torch.long, device=device) + t
        forward(torch.tensor(tokens, dtype=torch.long, device=device)[:, None],
                [(b, 0, i) for i, (b, p) in enumerate(rows) if p == prefill[b] + t], q_start=q_start, cache=cache)
    return recorder.store


# --------------------------------------------------------------------------- comparing
def _differs(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise: do the float32 bit patterns differ (bf16 widened exactly)?"""
    return a.float().view(torch.int32) != b.float().view(torch.int32)


def compare_captures(plan: list[OpSlot], a: dict[str, Tensor], b: dict[str, Tensor],
                     rows: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """One row per slot of ``plan``: bitwise differences and |Δ| statistics between the two captures."""
    out = []
    for index, slot in enumerate(plan):
        x, y = a[slot.name], b[slot.name]
        differs = _differs(x, y)
        delta = torch.where(differs, (x.double() - y.double()).abs(), 0.0)
        scale = float(y.double().abs().max()) if y.numel() else 0.0
        n_diff = int(differs.sum())
        row: dict[str, Any] = {
            "index": index, "name": slot.name, "group": slot.group, "kernel_op": slot.kernel_op,
            "recorded": slot.recorded, "features": slot.features, "elements": x.numel(),
            "elements_differing": n_diff, "positions_differing": int(differs.any(dim=1).sum()),
            "bitwise_equal": n_diff == 0, "abs_diff_max": 0.0, "abs_diff_mean": 0.0, "rel_diff_max": 0.0,
            "max_at": None,
        }
        if n_diff:
            flat = int(torch.nan_to_num(delta, nan=math.inf).argmax())
            peak = float(delta.reshape(-1)[flat])
            sequence, position = rows[flat // slot.features]
            row.update(abs_diff_max=peak, abs_diff_mean=float(delta.mean()),
                       rel_diff_max=peak / scale if scale > 0 else math.nan if math.isnan(scale) else math.inf,
                       max_at={"sequence": sequence, "position": position, "feature": flat % slot.features})
        out.append(row)
    return out


def first_divergence(plan: list[OpSlot], a: dict[str, Tensor], b: dict[str, Tensor],
                     rows: list[tuple[int, int]], ops: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first slot (forward order) with differing bits, at its first differing element (rows in order, then
    features): where, both values and their bit patterns; None if every slot is bitwise equal."""
    for slot, row in zip(plan, ops):
        if row["bitwise_equal"]:
            continue
        x, y = a[slot.name], b[slot.name]
        flat = int(_differs(x, y).reshape(-1).nonzero()[0, 0])
        r, feature = divmod(flat, slot.features)
        va, vb = x[r, feature], y[r, feature]
        sequence, position = rows[r]
        return {"op": slot.name, "index": row["index"], "group": slot.group, "sequence": sequence,
                "position": position, "feature": feature,
                "feature_index": [int(i) for i in torch.unravel_index(torch.tensor(feature), slot.feature_shape)],
                "a": float(va), "b": float(vb), "a_bits": float_bits(va), "b_bits": float_bits(vb),
                "abs_diff": abs(float(va) - float(vb)), "elements_differing": row["elements_differing"],
                "positions_differing": row["positions_differing"]}
    return None


def _nan_max(values: list[float]) -> float:
    """The largest value, NaN if any is NaN (Python's ``max`` keeps whichever came first)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def layer_summary(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per group (``embed``, ``layer 0`` ..., ``head``): ops differing, the largest |Δ| of any of its ops,
    and |Δ| of its output (embed; the layer's ``resid_mlp``; logits) -- how the difference grows layer by layer."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in ops:
        groups.setdefault(row["group"], []).append(row)
    out = []
    for group, rows in groups.items():
        output = rows[-1]  # embed, layer i / resid_mlp, logits
        peaks = [r["abs_diff_max"] for r in rows]
        out.append({"group": group, "ops": len(rows), "ops_differing": sum(not r["bitwise_equal"] for r in rows),
                    "abs_diff_max": None if None in peaks else _nan_max(peaks), "output": output["name"],
                    "output_abs_diff_max": output["abs_diff_max"], "output_abs_diff_mean": output["abs_diff_mean"]})
    return out
