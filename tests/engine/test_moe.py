"""Mixture-of-experts layers: exact routing, routing mismatch on purpose (``routing_flip``) and router replay.

Exactness is asserted bitwise: an MoE model's rollout (KV-cache generate) and training (token_logprobs) log-probs
are torch.equal at every batch arrangement, micro-batching and thread count, fp32 and bf16; a token's MoE output
does not change when other tokens share (or stop sharing) its experts -- and on native ops it does, the
counter-test. The routing-flip hook is keyed by (seed, sequence, position, layer), and router replay makes the
training path reproduce a flipped rollout bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import num_threads, random_prompts
from rich.console import Console

from vexact import ModelConfig, Transformer, generate, token_logprobs
from vexact.engine.model import MOE_FIELDS, ModelConfigError, Routing, parameter_count
from vexact.engine.sampling import counter_uniform
from vexact.engine.scoring import token_routing
from vexact.records.runlog import read_metrics
from vexact.rl.collect import RolloutBatch
from vexact.rl.config import config_from_dict
from vexact.rl.inject import Injector
from vexact.rl.inject_modes import INJECT_MODES, flip_hook
from vexact.rl.metrics import routing_metrics
from vexact.rl.objective import Objective
from vexact.rl.trainer import Trainer
from vexact.rl.validate import ConfigError
from vexact_kernels import moe_exact

MOE = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
           max_seq_len=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
EOS = 3


def moe_model(backend: str = "exact", dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """A tiny MoE model whose router is scaled up (logits of order 1, like a trained router's), so routing varies
    from token to token, and whose EOS logit varies with context (responses end anywhere)."""
    model = Transformer(ModelConfig(**{**MOE, **overrides}), backend=backend, dtype=dtype, init_seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for layer in model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(40.0)
        model.lm_head.weight[EOS] = (torch.randn(model.config.hidden_size, generator=g) * 0.15).to(dtype)
    return model


def _equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y.detach()) for x, y in zip(a, b))


# --- the block ------------------------------------------------------------------------------------------------


def test_dense_default_and_moe_layers():
    dense = ModelConfig(**{**MOE, "num_experts": 0})
    assert dense.moe_layers == () and set(MOE_FIELDS) <= set(dense.to_dict())
    names = {n for n, _ in Transformer(dense).named_parameters()}
    assert not any("experts" in n or n.endswith("mlp.gate.weight") for n in names)
    assert "layers.1.mlp.gate_proj.weight" in names
    cfg = ModelConfig(**{**MOE, "num_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe_layers == (1,)  # (i + 1) % 2 == 0 -> 1, 3; 3 is listed as dense (HF's rule)
    names = {n for n, _ in Transformer(cfg).named_parameters()}
    assert "layers.1.mlp.experts.3.down_proj.weight" in names and "layers.1.mlp.gate.weight" in names
    assert "layers.3.mlp.gate_proj.weight" in names and "layers.0.mlp.up_proj.weight" in names
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # mlp_only_layers round-trips (a list in dicts)


@pytest.mark.parametrize("overrides", [dict(num_experts=0), {}, dict(shared_expert_intermediate_size=24, qkv_bias=True),
                                       dict(decoder_sparse_step=2, qk_norm=True), dict(mlp_only_layers=(0,))])
def test_parameter_count_counts_the_experts(overrides):
    """The memory guard's arithmetic (``parameter_count``) counts what an MoE Transformer builds: router, experts,
    shared expert and its gate, dense layers where a layer is not MoE."""
    config = ModelConfig(**{**MOE, **overrides})
    assert parameter_count(config) == sum(p.numel() for p in Transformer(config).parameters())


def test_rank_experts_breaks_ties_to_the_lowest_index():
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.1], [0.2, 0.2, 0.2, 0.2]])
    assert moe_exact.rank_experts(scores).tolist() == [[1, 2, 0, 3], [0, 1, 2, 3]]
    # in the model: experts 1 and 2 tied for second place -> the token goes to 1, never 2
    model = moe_model()
    with torch.no_grad():
        gate = model.layers[0].mlp.gate.weight
        gate[0] = 10.0 * gate[3]
        gate[1] = gate[2] = 5.0 * gate[3]
        gate[3] = 0.0
    record: list[torch.Tensor] = []
    h = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)).abs() * torch.sign(gate[0])  # 0 wins
    model._moe(h, model.layers[0].mlp, model.ops, Routing(record=record), 0, torch.zeros(2, 9, dtype=torch.long))
    assert record[0].tolist() == [[[0, 1]] * 9] * 2


def _block_outputs(model: Transformer, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(MoE block output, chosen experts) of layer 0's block for ``rows`` [N, D] as one batch."""
    record: list[torch.Tensor] = []
    out = model._moe(rows[None], model.layers[0].mlp, model.ops, Routing(record=record), 0,
                     torch.zeros(1, rows.shape[0], dtype=torch.long))
    return out[0], record[0][0]


def _regroupings(model: Transformer, pool: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches of 24 rows, token ``token`` first: with 23 neighbours sharing its first expert, and with 23 that
    share none of its experts."""
    _, chosen = _block_outputs(model, pool)
    mine = set(chosen[token].tolist())
    share = [i for i in range(len(pool)) if i != token and int(chosen[token, 0]) in chosen[i].tolist()][:23]
    apart = [i for i in range(len(pool)) if i != token and not mine & set(chosen[i].tolist())][:23]
    assert len(share) == len(apart) == 23, "the pool should hold enough tokens of each kind"
    return pool[[token, *share]], pool[[token, *apart]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_output_does_not_depend_on_who_shares_its_experts(dtype):
    model = moe_model(dtype=dtype)
    pool = torch.randn(400, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    for token in (0, 1, 2):
        crowded, alone = _regroupings(model, pool, token)
        out_crowded, chosen_crowded = _block_outputs(model, crowded)
        out_alone, chosen_alone = _block_outputs(model, alone)
        expert = int(chosen_crowded[0, 0])
        # not vacuous: the token's expert runs on 24 rows in one grouping and on 1 in the other
        assert int((chosen_crowded == expert).sum()) == 24 and int((chosen_alone == expert).sum()) == 1
        assert torch.equal(out_crowded[0], out_alone[0])
        assert torch.equal(out_crowded[0], _block_outputs(model, crowded[:1])[0][0])  # and alone in the batch


def test_native_ops_change_a_tokens_output_with_its_grouping():
    """Counter-test: the same regrouping on native ops (torch's GEMM picks kernels by the row count) changes the
    bits of some token's output -- the batch dependence the exact routing removes."""
    model = moe_model("native")
    pool = torch.randn(400, 64, generator=torch.Generator().manual_seed(2))
    differs = 0
    for token in range(12):
        crowded, alone = _regroupings(model, pool, token)
        differs += not torch.equal(_block_outputs(model, crowded)[0][0], _block_outputs(model, alone)[0][0])
    assert differs > 0


# --- rollout == training --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_moe_rollout_logprobs_equal_training_logprobs(dtype, threads):
    model = moe_model(dtype=dtype)
    prompts = random_prompts(16, 30, seed=threads)
    with num_threads(threads):
        rollouts = [generate(model, prompts, max_new_tokens=24, seed=7, batch_size=bs, eos_token_id=EOS)
                    for bs in (None, 3, 1)]
        lengths = [len(t) for t in rollouts[0].tokens]
        assert min(lengths) < 24 and max(lengths) == 24  # ragged responses
        for rollout in rollouts[1:]:  # batch size changes nothing: tokens, log-probs, routing
            assert rollout.tokens == rollouts[0].tokens
            assert _equal_lists(rollout.logprobs, rollouts[0].logprobs)
            assert _equal_lists(rollout.routing, rollouts[0].routing)
        for micro_batch_size in (None, 5, 1):
            scored = token_logprobs(model, prompts, rollouts[0].tokens, micro_batch_size=micro_batch_size)
            assert _equal_lists(rollouts[0].logprobs, scored)
            routed = token_routing(model, prompts, rollouts[0].tokens, micro_batch_size=micro_batch_size)
            assert _equal_lists(rollouts[0].routing, routed)
    # not vacuous: tokens go to every expert
    assert torch.cat(rollouts[0].routing).unique().tolist() == [0, 1, 2, 3]


def _ending_by_position(logits, sequence_ids, positions):
    """A logits hook that makes EOS all but certain from a position each row reaches at its own step (3 to 9), so
    every row finishes before ``max_new_tokens`` and the loop's early stop is what is exercised."""
    forced = logits.clone()
    forced[positions >= 3 + sequence_ids % 7, EOS] = 50.0
    return forced, forced


@pytest.mark.parametrize("make", [lambda: moe_model(), lambda: moe_model(num_experts=0)], ids=["moe", "dense"])
def test_the_eos_check_interval_changes_no_bit(make):
    """``generate(eos_check_every=k)`` (a GPU checks every 8th step, not to sync the host each step) decodes up to
    k - 1 steps past the last EOS; the tokens, log-probs, finished flags and routing are the same bits for every k."""
    model = make()
    prompts = random_prompts(10, 20, seed=3)
    outs = [generate(model, prompts, max_new_tokens=24, seed=7, eos_token_id=EOS, logits_hook=_ending_by_position,
                     eos_check_every=k) for k in (1, 3, 8, 64)]
    assert all(outs[0].finished) and max(len(t) for t in outs[0].tokens) < 24  # every row stopped early
    assert len({len(t) for t in outs[0].tokens}) > 1  # at different steps
    for out in outs[1:]:
        assert out.tokens == outs[0].tokens and out.finished == outs[0].finished
        assert _equal_lists(out.logprobs, outs[0].logprobs)
        assert (out.routing is None) == (outs[0].routing is None)
        if out.routing is not None:
            assert _equal_lists(out.routing, outs[0].routing)


def test_native_moe_mismatches():
    """Counter-check: the same pipeline on native ops finds mismatched tokens."""
    model = moe_model("native")
    prompts = random_prompts(16, 30, seed=1)
    out = generate(model, prompts, max_new_tokens=24, seed=7, batch_size=3, eos_token_id=EOS)
    scored = token_logprobs(model, prompts, out.tokens, micro_batch_size=5)
    assert not _equal_lists(out.logprobs, scored)


@pytest.mark.parametrize("variant", [{"norm_topk_prob": False}, {"shared_expert_intermediate_size": 32},
                                     {"num_experts": 6, "num_experts_per_tok": 3, "mlp_only_layers": [1]}],
                         ids=["softmax_weights", "shared_expert", "top3_mixed_layers"])
def test_moe_variants_are_exact(variant):
    model = moe_model(dtype=torch.bfloat16, **variant)
    prompts = random_prompts(9, 20, seed=4)
    out = generate(model, prompts, max_new_tokens=12, seed=3, batch_size=4)
    assert _equal_lists(out.logprobs, token_logprobs(model, prompts, out.tokens, micro_batch_size=2))


def test_moe_backward_is_thread_count_invariant():
    model = moe_model(shared_expert_intermediate_size=32)
    prompts = random_prompts(6, 20, seed=5)
    responses = random_prompts(6, 10, seed=6)
    grads = []
    for threads in (1, 2):
        model.zero_grad()
        with num_threads(threads):
            torch.cat(token_logprobs(model, prompts, responses)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0]["layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns through the weights
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# --- routing flips and router replay ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["near_tie", "random"])
def test_flip_hook_flips_where_its_keyed_draw_says(kind):
    ranked = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(i)) for i in range(40)])
    ranked = ranked.view(4, 10, 6)
    seq, pos = torch.tensor([3, 4, 5, 6]), torch.arange(10).expand(4, 10) + 7
    chosen = flip_hook(0.4, kind, seed=11)(ranked, 2, seq, pos, 1)
    top = ranked[..., :2]
    flipped = (chosen != top).any(-1)
    draws = counter_uniform((11 + 0x2545F491 * 2) & 0x7FFFFFFFFFFF, seq[:, None].expand(4, 10).reshape(-1),
                            pos.reshape(-1), 3)[:, 0].view(4, 10)
    assert torch.equal(flipped, draws < 0.4) and 0 < int(flipped.sum()) < 40
    for b, t in flipped.nonzero().tolist():
        kept = set(chosen[b, t].tolist()) & set(top[b, t].tolist())
        assert len(kept) == 1 and len(set(chosen[b, t].tolist())) == 2  # one expert replaced, by an unchosen one
        if kind == "near_tie":
            assert chosen[b, t].tolist() == [int(ranked[b, t, 0]), int(ranked[b, t, 2])]
    # keyed by (sequence, position): the same rows in another batch arrangement flip the same way
    again = flip_hook(0.4, kind, seed=11)(ranked[2:3], 2, seq[2:3], pos[2:3], 1)
    assert torch.equal(again[0], chosen[2])


def test_router_replay_reproduces_a_flipped_rollout_bit_for_bit():
    model = moe_model()
    prompts = random_prompts(10, 20, seed=8)
    hook = flip_hook(0.3, "near_tie", seed=5)
    out = generate(model, prompts, max_new_tokens=12, seed=2, batch_size=4, eos_token_id=EOS, routing_hook=hook)
    own = token_routing(model, prompts, out.tokens)
    flips = routing_metrics(out.routing, own)
    assert 0.2 < flips["routing/flip_rate"] < 0.9 and flips["routing/token_flip_frac"] > 0.2
    assert not _equal_lists(out.logprobs, token_logprobs(model, prompts, out.tokens))  # the mismatch is there
    for micro_batch_size in (None, 3):
        replayed = token_logprobs(model, prompts, out.tokens, micro_batch_size=micro_batch_size, routing=out.routing)
        assert _equal_lists(out.logprobs, replayed)  # R3 removes it exactly
    # and generation itself is batch-invariant with the hook
    again = generate(model, prompts, max_new_tokens=12, seed=2, batch_size=1, eos_token_id=EOS, routing_hook=hook)
    assert again.tokens == out.tokens and _equal_lists(again.logprobs, out.logprobs)


def test_the_routing_flip_mode_plans_a_route_hook():
    cfg = config_from_dict({"model": {"preset": "tiny", "num_experts": 4},
                            "inject": {"mode": "routing_flip", "flip_rate": 0.25}})
    injector = Injector.for_run(cfg)
    plan = injector.plan(0)
    assert plan.routing_hook is not None and plan.logits_hook is None and plan.active and not plan.matches_training
    assert injector.plan_for_value(0.0, 0).routing_hook is None  # 0 is a bitwise no-op: no hook at all
    assert INJECT_MODES["routing_flip"].calibratable and INJECT_MODES["routing_flip"].knob_search(1.0, 2).upper == 1.0


def test_a_training_run_records_flips_and_replay_removes_their_mismatch(tmp_path):
    def run(name: str, *overrides: str) -> list[dict]:
        cfg = config_from_dict({}, [f"output_dir={tmp_path / name}", f"warm_start.cache_dir={tmp_path / 'cache'}",
                                    "model.preset=tiny", "model.max_seq_len=64", "model.num_experts=4",
                                    "warm_start.steps=5", "steps=2", "rollout.prompts_per_step=4",
                                    "rollout.samples_per_prompt=4", "task.eval_prompts=4", "logging.live=false",
                                    *(overrides if any(o.startswith("threads=") for o in overrides) else
                                      ("threads=1", *overrides))])
        summary = Trainer(cfg, Console(quiet=True)).run()
        assert summary["status"] == "completed", summary
        return read_metrics(tmp_path / name / "metrics.jsonl")

    clean = run("clean")
    assert all(r["routing/flip_rate"] == 0.0 and r["rollout_corr/k3_kl"] == 0.0 for r in clean)
    flipped = run("flip", "inject.mode=routing_flip", "inject.flip_rate=0.2")
    assert all(r["routing/flip_rate"] > 0.1 and r["rollout_corr/k3_kl"] > 0 for r in flipped)
    again = run("flip_again", "inject.mode=routing_flip", "inject.flip_rate=0.2", "threads=2")  # same config and seed
    assert [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in again] == [
        {k: v for k, v in r.items() if not k.startswith("timing/")} for r in flipped]
    replayed = run("r3", "inject.mode=routing_flip", "inject.flip_rate=0.2", "algorithm.router_replay=true")
    assert all(r["routing/flip_rate"] > 0.1 and r["mismatch/bitwise_equal_frac"] == 1.0 for r in replayed)
    assert replayed[0]["routing/flip_rate"] == flipped[0]["routing/flip_rate"]  # same rollout at step 0


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field, says", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok", "between 1 and num_experts (4)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok", "positive integer"),
    ({"num_experts": -1}, "num_experts", "non-negative"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size", "positive integer"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers", "[0, 2)"),
])
def test_an_expert_count_or_top_k_that_does_not_fit_is_one_clear_error(fields, field, says):
    with pytest.raises(ModelConfigError) as e:
        ModelConfig(**{**MOE, **fields})
    assert e.value.field == field and says in str(e.value)
    with pytest.raises(ConfigError) as c:  # and in a run config, at the model key
        config_from_dict({"model": {"num_experts": 4, **fields}})
    assert c.value.key == f"model.{field}"


@pytest.mark.parametrize("name, value", [("num_experts_per_tok", 4), ("moe_intermediate_size", 64),
                                         ("shared_expert_intermediate_size", 32), ("norm_topk_prob", False),
                                         ("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_an_moe_key_on_a_dense_run_config_is_refused_at_its_key(name, value):
    """``vexact run`` built the dense model and silently ignored the key (``vexact check`` refuses the flags)."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {name: value}})
    assert e.value.key == f"model.{name}" and "the model has none (num_experts is 0)" in str(e.value)
    config_from_dict({"model": {"num_experts": 4, name: value}})  # counter-case: an MoE model reads it
    ModelConfig(**{**MOE, name: value, "num_experts": 0})  # the engine's dense twin of an MoE shape stays allowed


def test_a_dense_twin_of_an_moe_preset_keeps_the_presets_moe_keys():
    assert config_from_dict({"model": {"preset": "moe_testbed", "num_experts": 0}}).model.moe_intermediate_size == 176
    with pytest.raises(ConfigError, match="leave moe_intermediate_size at 176") as e:
        config_from_dict({"model": {"preset": "moe_testbed", "num_experts": 0, "moe_intermediate_size": 100}})
    assert e.value.key == "model.moe_intermediate_size"


def test_a_flip_rate_outside_0_1_and_routing_flip_on_a_dense_model_are_config_errors():
    for value in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"flip_rate in \[0, 1\]") as e:
            config_from_dict({"model": {"num_experts": 4}, "inject": {"mode": "routing_flip", "flip_rate": value}})
        assert e.value.key == "inject.flip_rate"
    with pytest.raises(ConfigError, match="dense") as e:
        config_from_dict({"inject": {"mode": "routing_flip", "flip_rate": 0.1}})
    assert e.value.key == "inject.mode"
    with pytest.raises(ConfigError, match="unchosen expert"):
        config_from_dict({"model": {"num_experts": 2}, "inject": {"mode": "routing_flip", "flip_rate": 0.1}})
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"num_experts": 4}, "inject": {"mode": "routing_flip", "flip_rate": 0.1,
                                                                  "flip_kind": "worst"}})
    assert e.value.key == "inject.flip_kind"


def test_router_replay_without_recorded_routing_is_one_clear_error():
    with pytest.raises(ConfigError, match="a dense model records none") as e:
        config_from_dict({"algorithm": {"router_replay": True}})
    assert e.value.key == "algorithm.router_replay"
    cfg = config_from_dict({"model": {"num_experts": 4}, "algorithm": {"router_replay": True}})
    objective = Objective(cfg.algorithm, cfg.correction, 1.0, exact_training=True)
    batch = RolloutBatch([None], [[5, 6]], [[7]], [torch.zeros(1)], [True], torch.zeros(1))  # routing not recorded
    with pytest.raises(ValueError, match="recorded no routing"):
        objective.score(moe_model(), batch)
    # calibration measures the source before the remedy: scoring without replay needs no recorded routing
    assert torch.equal(objective.score(moe_model(), batch, replay=False)[0], token_logprobs(moe_model(), [[5, 6]],
                                                                                            [[7]])[0])
    dense = moe_model(num_experts=0)
    with pytest.raises(ValueError, match="no MoE layers"):
        token_logprobs(dense, [[5, 6]], [[7, 8]], routing=[torch.zeros(2, 2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2\), expected \(3, 2, 2\)"):
        token_logprobs(moe_model(), [[5, 6]], [[7, 8]], routing=[torch.zeros(2, 2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="names one expert twice"):
        token_logprobs(moe_model(), [[5, 6]], [[7, 8]], routing=[torch.zeros(3, 2, 2, dtype=torch.long)])
    recorded = generate(moe_model(), [[5, 6]], max_new_tokens=2).routing[0]
    with pytest.raises(ValueError, match=r"^routing of sequence 0 is torch.float64; expected integer expert ids"):
        token_logprobs(moe_model(), [[5, 6]], [[7, 8]], routing=[recorded.double() + 0.4])  # was floored: replayed
    with pytest.raises(ValueError, match="no MoE layers"):
        generate(dense, [[5]], max_new_tokens=2, routing_hook=flip_hook(0.5, "near_tie", 0))


def test_token_routing_checks_its_inputs_as_token_logprobs_does():
    """token_routing took its inputs unchecked: one prompt with two responses gave one sequence's routing (zip
    truncated), no prompts a range() error, an out-of-vocab id or an over-long sequence an error deep in the
    forward. Now each is the one ValueError token_logprobs gives."""
    model = moe_model()
    cases = [(([[5, 6]], [[7], [8]]), {}, "got 1 prompts but 2 responses"),
             (([], []), {}, "prompts must be a non-empty list"),
             (([[5, 6]], [[7, 97]]), {}, r"responses\[0\]"),
             (([[5] * 100], [[7] * 40]), {}, "exceeds max_seq_len"),
             (([[5, 6]], [[7]]), {"micro_batch_size": 0}, "micro_batch_size must be a positive int or None")]
    for (prompts, responses), kwargs, says in cases:
        with pytest.raises(ValueError, match=says) as scored:
            token_logprobs(model, prompts, responses, **kwargs)
        with pytest.raises(ValueError, match=says) as routed:
            token_routing(model, prompts, responses, **kwargs)
        assert str(routed.value) == str(scored.value)
    with pytest.raises(ValueError, match="must be a vexact Transformer"):
        token_routing(object(), [[5, 6]], [[7]])
    # counter-case: good inputs give one [prompt + response - 1, n_moe_layers, k] routing per sequence
    routing = token_routing(model, [[5, 6], [9]], [[7, 8], []], micro_batch_size=1)
    assert [tuple(r.shape) for r in routing] == [(3, 2, 2), (1, 2, 2)]


_SHAPE = r"expected \(2, 2, 2\) \(\[B, T, k\]"
_BAD_HOOKS = {"k + 1": (lambda ranked, k, *_: ranked[..., : k + 1], rf"has shape \(2, 2, 3\), {_SHAPE}"),
              "k - 1": (lambda ranked, k, *_: ranked[..., : k - 1], rf"has shape \(2, 2, 1\), {_SHAPE}"),
              "None": (lambda ranked, k, *_: None, r"is None, expected a tensor of expert ids of shape \(2, 2, 2\)"),
              "float": (lambda ranked, k, *_: ranked[..., :k].float(), "is torch.float32; expected integer expert ids"),
              "twice": (lambda ranked, k, *_: ranked[..., :1].expand(*ranked.shape[:-1], k), "names one expert twice"),
              "outside": (lambda ranked, k, *_: ranked[..., :k] + 4, r"names experts outside \[0, 4\)")}
_GOOD = torch.tensor([0, 1]).expand(2, 3, 2, 2)
_BAD_REPLAYS = {"one MoE layer short": (_GOOD[:, :, :1], r"^Routing.replay has shape \(2, 3, 1, 2\), expected "
                                                         r"\(2, 3, 2, 2\) \(\[B, T, n_moe_layers, k\]"),
                "k + 1": (torch.tensor([0, 1, 2]).expand(2, 3, 2, 3), r"^Routing.replay has shape \(2, 3, 2, 3\)"),
                "twice": (_GOOD.clone().index_fill_(2, torch.tensor([1]), 1),
                          "^Routing.replay of MoE layer 1 names one expert twice"),
                "outside": (_GOOD + 6, r"^Routing.replay of MoE layer 0 names experts outside \[0, 4\)")}


@pytest.mark.parametrize("bad", _BAD_HOOKS)
def test_a_route_hooks_experts_that_do_not_fit_are_one_clear_error(bad):
    """The experts a routing_hook returned went in unchecked: k+1 of them was an IndexError in the expert loop, k-1 a
    reshape error, None an AttributeError, and one expert twice at a position was run and counted twice, silently.
    Now each is one ValueError naming the hook, its MoE layer and the shape it should return."""
    hook, says = _BAD_HOOKS[bad]
    with pytest.raises(ValueError, match=rf"^routing_hook's result for MoE layer 0 {says}"):
        generate(moe_model(), [[5, 6], [9]], max_new_tokens=2, routing_hook=hook)


@pytest.mark.parametrize("bad", _BAD_REPLAYS)
def test_a_routing_replay_that_does_not_fit_is_one_clear_error(bad):
    """A Routing.replay one MoE layer short was an IndexError, one of k+1 experts an IndexError in the expert loop,
    one naming an expert twice ran silently: now one ValueError naming the replay (and its MoE layer)."""
    replay, says = _BAD_REPLAYS[bad]
    with pytest.raises(ValueError, match=says):
        moe_model()(torch.tensor([[5, 6, 7], [9, 8, 7]]), routing=Routing(replay=replay))


def test_a_route_hook_or_replay_of_the_routers_own_choice_changes_no_bit():
    """The counter-case of the two above: the checks refuse nothing that fits and change no bit."""
    model, prompts = moe_model(), [[5, 6], [9]]
    plain = generate(model, prompts, max_new_tokens=4, seed=1)
    for dtype in (torch.int64, torch.int32):
        def top_k(ranked, k, *_, dtype=dtype):
            return ranked[..., :k].to(dtype)

        hooked = generate(model, prompts, max_new_tokens=4, seed=1, routing_hook=top_k)
        assert hooked.tokens == plain.tokens and _equal_lists(hooked.logprobs, plain.logprobs)
    tokens, record = torch.tensor([[5, 6, 7], [9, 8, 7]]), []
    own = model(tokens, routing=Routing(record=record))
    assert torch.equal(model(tokens, routing=Routing(replay=torch.stack(record, dim=2))), own)


def test_locate_refuses_an_moe_model_with_one_clear_error():
    """locate compares paths op by op along a fixed plan of calls; an MoE forward's expert calls follow the routing."""
    from vexact.real.locate import op_plan

    with pytest.raises(ValueError, match="mixture-of-experts model \\(4 experts\\)"):
        op_plan(ModelConfig(**MOE))
    assert op_plan(ModelConfig(**{**MOE, "num_experts": 0}))  # counter-case: the dense model has its plan


@pytest.mark.parametrize("model, key", [({"num_experts": 4, "decoder_sparse_step": 5}, "decoder_sparse_step"),
                                        ({"num_experts": 4, "mlp_only_layers": [0, 1]}, "mlp_only_layers")])
def test_experts_with_no_moe_layer_are_one_error_not_a_silent_dense_run(model, key):
    """``num_experts: 4`` on the 2-layer testbed with ``decoder_sparse_step: 5`` made no layer MoE: a dense run
    that looked like an MoE one. routing_flip on it said "set num_experts > 0", which it was."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": model})
    assert e.value.key == f"model.{key}" and "no layer is a mixture of experts" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": model, "inject": {"mode": "routing_flip", "flip_rate": 0.1}})
    assert e.value.key == f"model.{key}" and "set model.num_experts > 0" not in str(e.value)
    assert config_from_dict({"model": {"num_experts": 4, "decoder_sparse_step": 2}}).model.num_experts == 4
