"""Every backend satisfies the ``KernelOps`` contract: each op of ``OP_NAMES`` exists, with the contract's parameters.

A backend that lacks an op, or names or orders its parameters differently, would fail at run time inside a model
forward; here it fails by name. The counter-test shows the check catches a missing op and a changed signature.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from conftest import require_optional

import vexact_kernels
from vexact.engine.model import ModelConfig, Transformer
from vexact.real.op_plan import OpRecorder, _PlanTracer
from vexact.rl.inject import precision_ops
from vexact_kernels import FUSED_OP_NAMES, OP_NAMES, KernelOps, cpu_exact, native


def _contract_violations(ops: object) -> list[str]:
    """What ``ops`` gets wrong against the contract (empty: it satisfies it)."""
    problems = []
    for name in OP_NAMES:
        fn = getattr(ops, name, None)
        if fn is None or not callable(fn):
            problems.append(f"{name}: missing")
            continue
        want = [p for p in inspect.signature(getattr(KernelOps, name)).parameters if p != "self"]
        try:
            params = inspect.signature(fn).parameters.values()
        except ValueError:  # a C function or lambda without a signature: presence is all that can be checked
            continue
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            continue  # a wrapper that forwards *args (precision_ops' rounding) takes whatever the op takes
        have = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if have[: len(want)] != want:
            problems.append(f"{name}: parameters {have} instead of {want}")
    return problems


def _backends() -> dict[str, object]:
    backends = {"native": native, "cpu_exact": cpu_exact,
                "cpu_exact.with_host": cpu_exact.ops_in_mode("fixed-order"),
                "precision_ops": precision_ops(cpu_exact, "bfloat16", ["linear", "attention", "norm"]),
                "OpRecorder": OpRecorder(cpu_exact, [], rows=1),
                "op_plan's tracer": _PlanTracer(Transformer(ModelConfig(vocab_size=8, hidden_size=8, num_layers=1,
                                                                        num_heads=2, num_kv_heads=1,
                                                                        intermediate_size=8, max_seq_len=4)))}
    # triton is an optional extra: without it the case is listed and skipped (require_optional), not left out
    backends["triton_exact"] = vexact_kernels.get_ops("triton") if vexact_kernels.triton_installed() else None
    return backends


@pytest.mark.parametrize("name", list(_backends()))
def test_backend_satisfies_the_kernel_ops_contract(name):
    if name == "triton_exact":
        require_optional("triton", vexact_kernels.TRITON_PIP)
    ops = _backends()[name]
    assert isinstance(ops, KernelOps), f"{name} lacks an op of {OP_NAMES}"
    assert _contract_violations(ops) == []


def test_op_names_come_from_the_contract():
    assert OP_NAMES == ("embedding", "linear", "rms_norm", "silu_mul", "rope", "attention", "log_softmax",
                        "token_logprobs", "entropy")
    assert set(cpu_exact.HOST_PROPERTIES) == set(OP_NAMES)  # the exact backend reports a path for every op


def test_the_contract_check_catches_a_missing_op_and_a_changed_signature():
    missing = SimpleNamespace(**{n: getattr(native, n) for n in OP_NAMES if n != "entropy"})
    assert not isinstance(missing, KernelOps)
    assert _contract_violations(missing) == ["entropy: missing"]

    def linear(weight, x, bias=None):  # parameters swapped
        return native.linear(x, weight, bias)

    swapped = SimpleNamespace(**{**{n: getattr(native, n) for n in OP_NAMES}, "linear": linear})
    assert _contract_violations(swapped) == ["linear: parameters ['weight', 'x', 'bias'] instead of ['x', 'weight', "
                                             "'bias']"]


EXACT_OPS_BEYOND_THE_CONTRACT = {"cpu_exact": (), "triton_exact": ("exp",),
                                 "moe_exact": ("rank_experts", "routing_weights", "combine")}
"""Per exact module, its public functions outside ``OP_NAMES`` and ``FUSED_OP_NAMES`` whose results the model's
outputs rest on: the MoE routing's exp on CUDA tensors, and the routing itself (``moe_exact``, no backend's op)."""


@pytest.mark.parametrize("name", list(EXACT_OPS_BEYOND_THE_CONTRACT))
def test_every_exact_op_states_its_invariance_contract(name):
    """Each op of an exact backend -- the contract's, the fused ones it offers (``FUSED_OP_NAMES``) and the routing's
    -- says in its docstring what its output may depend on and what not ("Invariance contract:"), which the op-level
    tests (tests/kernels/test_kernels.py, test_triton_kernels.py, tests/engine/test_moe.py) check; an op without one
    promises nothing a reader can test."""
    if name == "triton_exact":
        require_optional("triton", vexact_kernels.TRITON_PIP)
    from importlib import import_module

    module = import_module(f"vexact_kernels.{name}")
    backend_ops = () if name == "moe_exact" else (*OP_NAMES, *(op for op in FUSED_OP_NAMES if hasattr(module, op)))
    ops = (*backend_ops, *EXACT_OPS_BEYOND_THE_CONTRACT[name])
    assert [op for op in ops if "Invariance contract:" not in (getattr(module, op).__doc__ or "")] == []
    if name == "cpu_exact":  # the exact CPU backend offers every fused op (its docstring is the docs' text for it)
        assert all(hasattr(module, op) for op in FUSED_OP_NAMES)
