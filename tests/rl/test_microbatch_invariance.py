"""``algorithm.grad_unit``: a mini-batch's gradient whose bits do not depend on ``algorithm.micro_batch_size``.

What micro-batch invariance means here: with ``grad_unit`` set, runs that differ only in ``micro_batch_size`` (null,
1, 3) write the same metrics.jsonl (timing aside), the same checkpoint tensors and the same optimizer state, bit
for bit (``torch.equal``) -- after updates with 2 mini-batches x 2 PPO epochs, logit noise, token TIS and an
entropy bonus (test_data_parallel's TINY run), and again in bf16 with a KL term.

Counter-cases show the check can fail: without ``grad_unit`` the same three runs differ from each other, and the
reason is in the kernels (a sequence's gradient through a shared forward depends on where its rows fall among the
weight gradient's fixed reduction chunks), so a gradient unit must be a forward of its own.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_data_parallel import _config_file, _result, _same, _vexact_run

from vexact.engine.model import Transformer
from vexact.engine.scoring import score_tokens
from vexact.records.runlog import latest_checkpoint
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.data_parallel import tree_sum
from vexact.rl.objective import Objective
from vexact.rl.trainer import Trainer, _tree_sum_of

# TINY's mini-batch is 8 sequences; 2 leaves of 4, so a unit of 2 puts two units in every leaf
LEAVES = {"distributed.leaves": 2}
MICRO_BATCH_SIZES = (None, 1, 3)  # 3 splits a leaf of 4 into 3 + 1: no micro-batch lines up with a unit
BF16_KL = {"dtype": "bfloat16", "algorithm.kl_coef": 0.05, "algorithm.old_logprobs": "recompute"}


def _run(tmp_path: Path, **changes) -> tuple[list[dict], dict, dict]:
    """A TINY run in this process (``threads: 1``): metrics without timing, last weights, last optimizer state."""
    tmp_path.mkdir(parents=True)
    config = _config_file(tmp_path, threads=1, **{**LEAVES, **changes})
    run_dir = tmp_path / "run"
    Trainer(load_config(config, [f"output_dir={run_dir}"]), console=Console(quiet=True)).run()
    metrics, weights = _result(run_dir)
    optimizer = torch.load(latest_checkpoint(run_dir) / "optimizer.pt", weights_only=True)
    return metrics, weights, optimizer


def _equal(a, b) -> bool:
    """Nested containers of tensors and plain values, tensors compared with ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _identical(a: tuple, b: tuple) -> bool:
    return _same(a[:2], b[:2]) and _equal(a[2], b[2])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The TINY run at every micro-batch size, without and with ``grad_unit: 2``, and with a unit of a whole leaf."""
    root = tmp_path_factory.mktemp("microbatch")
    out = {}
    for unit in (None, 2):
        for size in MICRO_BATCH_SIZES:
            out[unit, size] = _run(root / f"u{unit}_m{size}", **{"algorithm.grad_unit": unit,
                                                                 "algorithm.micro_batch_size": size})
    out["leaf", 3] = _run(root / "leaf_m3", **{"algorithm.grad_unit": 4, "algorithm.micro_batch_size": 3})
    return out


def test_with_grad_unit_every_micro_batch_size_gives_the_same_run(runs):
    reference = runs[2, None]
    metrics = reference[0]
    assert len(metrics) == 3 and all(row["actor/grad_norm"] > 0 for row in metrics), "the policy must move"
    assert reference[2]["state"], "the optimizer state is compared"
    for size in MICRO_BATCH_SIZES[1:]:
        assert _identical(runs[2, size], reference), f"grad_unit 2: micro_batch_size {size} differs from null"


def test_without_grad_unit_the_micro_batching_shows_in_the_bits(runs):
    """The counter-case: today's default, where the micro-batches of a leaf share its backward."""
    a, b, c = (runs[None, size] for size in MICRO_BATCH_SIZES)
    assert not _same(a[:2], b[:2]) and not _same(a[:2], c[:2]) and not _same(b[:2], c[:2])


def test_a_unit_of_a_whole_leaf_is_the_run_without_micro_batches(runs):
    """``grad_unit`` equal to the leaf size keeps the bits of a config without micro-batches."""
    assert _identical(runs["leaf", 3], runs[None, None])
    assert not _same(runs["leaf", 3][:2], runs[2, None][:2])  # the unit is part of the numbers


def test_bf16_with_kl_and_recompute_is_micro_batch_invariant_too(tmp_path):
    results = [_run(tmp_path / f"m{size}", **BF16_KL, **{"algorithm.grad_unit": 1, "algorithm.micro_batch_size": size})
               for size in MICRO_BATCH_SIZES]
    assert all(row["actor/grad_norm"] > 0 and row["actor/kl_loss"] > 0 for row in results[0][0][1:])
    assert _identical(results[1], results[0]) and _identical(results[2], results[0])


def test_activation_checkpointing_changes_no_bit(tmp_path, runs):
    """``algorithm.activation_checkpointing`` forwards each gradient unit twice (first without a graph, then with
    one right before its backward): a memory knob, the same run bit for bit, with units and without."""
    on = {"algorithm.activation_checkpointing": True}
    assert _identical(_run(tmp_path / "leaf", **on), runs[None, None])
    assert _identical(_run(tmp_path / "u2_m1", **on, **{"algorithm.grad_unit": 2, "algorithm.micro_batch_size": 1}),
                      runs[2, None])
    bf16 = {**BF16_KL, "algorithm.grad_unit": 1}
    assert _identical(_run(tmp_path / "bf16_on", **bf16, **on), _run(tmp_path / "bf16_off", **bf16))


def test_activation_checkpointing_stops_a_run_whose_second_forward_differs(tmp_path, monkeypatch):
    """The guard can fire: a forward that is not deterministic (here a nudge on the forward that carries grad) would
    give gradients that are not the loss's, so the run stops with the reason, as an outcome."""
    original = Objective.policy_forward

    def nudged(self, model, batch, idx, micro_batch_size):
        logp, entropy = original(self, model, batch, idx, micro_batch_size)
        return ([t + 1e-3 for t in logp] if torch.is_grad_enabled() else logp), entropy

    monkeypatch.setattr(Objective, "policy_forward", nudged)
    config = _config_file(tmp_path, threads=1, **LEAVES, **{"algorithm.activation_checkpointing": True})
    summary = Trainer(load_config(config, [f"output_dir={tmp_path / 'run'}"]), console=Console(quiet=True)).run()
    assert summary["status"] == "stopped" and "activation_checkpointing" in summary["reason"]


@pytest.mark.slow
def test_ranks_still_do_not_change_the_bits(tmp_path, runs):
    """Units live inside leaves, so ``--nproc 2`` (one leaf per rank) gives the one-process run."""
    config = _config_file(tmp_path, threads=1, **LEAVES, **{"algorithm.grad_unit": 2, "algorithm.micro_batch_size": 1})
    _vexact_run(config, tmp_path / "n2", "--nproc=2")
    assert _same(_result(tmp_path / "n2"), runs[2, None][:2])


def test_a_unit_that_does_not_divide_a_leaf_is_one_config_error():
    base = {"rollout": {"prompts_per_step": 4, "samples_per_prompt": 4}, "algorithm": {"mini_batches": 2},
            "distributed": {"leaves": 2}}
    config_from_dict(base, ["algorithm.grad_unit=4", "algorithm.micro_batch_size=3"])  # a leaf of 4: fine
    with pytest.raises(ConfigError) as info:
        config_from_dict(base, ["algorithm.grad_unit=3"])
    assert info.value.key == "algorithm.grad_unit"
    assert "a leaf of 4 sequences" in str(info.value) and "divisor of 4" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config_from_dict(base, ["algorithm.grad_unit=0"])
    assert info.value.key == "algorithm.grad_unit"


@pytest.mark.slow
def test_the_cli_refuses_a_bad_unit_with_exit_2(tmp_path):
    config = _config_file(tmp_path, **LEAVES)
    done = subprocess.run([sys.executable, "-m", "vexact", "run", str(config), f"--set=output_dir={tmp_path / 'run'}",
                           "--set=algorithm.grad_unit=3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: config error at 'algorithm.grad_unit': a leaf of 4 sequences")
    assert not (tmp_path / "run").exists()


def test_a_sequence_gradient_in_a_shared_forward_depends_on_its_place():
    """Why a unit must be a forward of its own: the exact weight gradients reduce over the forward's token rows in
    fixed chunks (``_transposed_matmul``), so a sequence whose rows straddle a chunk boundary in a batch is rounded
    differently than alone -- while its log-probs are the same bits (the forward is batch-invariant)."""
    model = Transformer(config_from_dict({}).model.to_model_config(40), backend="exact", dtype=torch.float32,
                        init_seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randint(3, 10))] for _ in range(40)]
    responses = [[rng.randrange(1, 40) for _ in range(rng.randint(2, 12))] for _ in range(40)]
    params = list(model.parameters())

    def gradient(j: int, ps: list, rs: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logp, _ = score_tokens(model, ps, rs)
        grads = torch.autograd.grad(logp[j].sum(), params, allow_unused=True)
        return logp[j].detach(), [g for g in grads if g is not None]

    width = max(len(p) + len(r) - 1 for p, r in zip(prompts, responses))  # the batch's padded length
    last_row = [j * width + len(p) + len(r) - 2 for j, (p, r) in enumerate(zip(prompts, responses))]
    straddles = next(j for j in range(40) if (j * width) // 256 != last_row[j] // 256)  # 256-row chunks
    alone_logp, alone = gradient(0, prompts[straddles : straddles + 1], responses[straddles : straddles + 1])
    batch_logp, batched = gradient(straddles, prompts, responses)
    assert torch.equal(alone_logp, batch_logp)
    assert not all(torch.equal(a, b) for a, b in zip(alone, batched))


def test_the_lazy_tree_is_tree_sum():
    """A leaf's units are summed by ``tree_sum``'s own tree, made one unit at a time."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, generator=gen) * 10.0 ** torch.randint(-3, 4, (64,), generator=gen) for _ in range(9)]
    made = []
    for count in range(1, 10):
        made.clear()
        total = _tree_sum_of(count, lambda i: made.append(i) or parts[i])
        assert torch.equal(total, tree_sum(parts[:count])) and made == list(range(count))
    assert not torch.equal(tree_sum(parts), sum(parts[1:], parts[0]))  # the order shows in float32
