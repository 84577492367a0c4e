"""The vocabulary tail: ``task.distractors`` adds tokens the warm start teaches the policy to
avoid; a response using one earns 0; the ``tail/*`` metrics measure the rollout distribution's mass on them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from rich.console import Console

from vexact.engine.generation import generate
from vexact.engine.scoring import full_logprobs
from vexact.rl.collect import collect_rollouts, step_problems
from vexact.rl.config import ConfigError, config_from_dict
from vexact.rl.horizon_task import horizon_overrides
from vexact.rl.tasks import (
    CHAR_VOCAB_SIZE,
    EOS_ID,
    TASKS,
    CharTokenizer,
    encode_prompt,
    encode_target,
    make_task,
    training_problems,
)
from vexact.rl.trainer import Trainer
from vexact.rl.vocab_tail import NO_CHARACTER, TailProbe, TailTokenizer, tail_metrics
from vexact.rl.warmstart import warm_start_key

BUILTIN_TASKS = TASKS.names()  # at collection, before any test registers a task of its own

MASS_RTOL = 1e-12
"""Probe vs a direct float64 softmax of the same logits: the same formula up to summation order."""
ROLLOUT_MASS_ATOL = 1e-6
"""Probe (KV-cache rollout) vs a teacher-forced forward's full distribution: float32 logits of two forwards."""


def _cfg(distractors: int = 0, *extra: str):
    overrides = [f"{k}={v}" for k, v in horizon_overrides(2).items()]
    return config_from_dict({"task": {"name": "horizon", "distractors": distractors}, "threads": 1,
                             "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2}},
                            [*overrides, *extra])


def test_vocabulary_size():
    assert CHAR_VOCAB_SIZE == CharTokenizer().vocab_size == 22
    task = make_task("horizon", 4, 4, distractors=1002)
    assert task.tokenizer.vocab_size == 1024 and isinstance(task.tokenizer, TailTokenizer)
    trainer = Trainer(_cfg(1002), Console(quiet=True))
    assert trainer.model_config.vocab_size == 1024 and trainer.tokenizer is trainer.task.tokenizer
    assert trainer.master.embed_tokens.weight.shape[0] == 1024


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_distractors_never_in_prompts_or_targets(name):
    task = make_task(name, 2, 4, distractors=50)
    for p in training_problems(task, 200, run_seed=0, step=0):
        ids = encode_prompt(task.tokenizer, p) + encode_target(task.tokenizer, p)
        assert max(ids) < CHAR_VOCAB_SIZE
    with pytest.raises(ValueError, match="not in the vocabulary"):  # no text encodes to a distractor
        task.tokenizer.encode(NO_CHARACTER)


def test_a_distractor_decodes_to_no_character_and_earns_zero():
    task = make_task("horizon", 3, 3, distractors=10)
    tok = task.tokenizer
    p = task.problem("123", "aba")
    right = encode_target(tok, p)
    assert task.reward(p, right) == 1.0  # counter-case: the same response without a distractor
    in_scratch = right[:3] + [CHAR_VOCAB_SIZE + 4] + right[4:]  # the scratchpad is free, a distractor is not
    assert task.reward(p, in_scratch) == 0.0
    assert tok.decode(in_scratch) == "6:a" + NO_CHARACTER + "a"
    assert task.reward(p, right + [CHAR_VOCAB_SIZE]) == 1.0  # after EOS: ignored, like any token there
    with pytest.raises(ValueError, match="outside the vocabulary"):
        task.reward(p, right[:-1] + [tok.vocab_size, EOS_ID])
    partial = make_task("reverse", 3, 3, partial_credit=True, distractors=10)
    q = partial.sample(random.Random(0))
    near = encode_target(partial.tokenizer, q)[:-2] + [EOS_ID]
    assert 0.0 < partial.reward(q, near) < 1.0  # counter-case: partial credit without a distractor
    assert partial.reward(q, near[:-1] + [CHAR_VOCAB_SIZE + 9, EOS_ID]) == 0.0
    without = make_task("horizon", 3, 3)  # no tail: such an id is outside the vocabulary, as before
    with pytest.raises(ValueError, match="outside the vocabulary"):
        without.reward(p, in_scratch)


def test_tail_mass_on_a_hand_made_case():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, CHAR_VOCAB_SIZE + 5, generator=gen)
    logits[:, CHAR_VOCAB_SIZE:] -= torch.tensor([[2.0], [6.0], [30.0]])  # a tail from ~1e-1 down to ~1e-13
    probe = TailProbe(None, CHAR_VOCAB_SIZE, rows=3, max_new_tokens=2, first_index=10)
    sample, record = probe(logits, torch.tensor([10, 11, 12]), torch.tensor([1, 1, 1]))
    assert sample is logits and record is logits  # the probe changes nothing the rollout samples
    direct = torch.softmax(logits.double(), dim=-1)[:, CHAR_VOCAB_SIZE:].sum(-1)
    torch.testing.assert_close(probe.mass[:, 1], direct, rtol=MASS_RTOL, atol=0.0)
    assert direct[2] < 1e-10  # a tail this small survives (it would not as 1 - head mass in float32)
    rows = probe.per_sequence([[3, 4], [5], [CHAR_VOCAB_SIZE + 1, 6]])
    metrics = tail_metrics(rows, [[3, 4], [5], [CHAR_VOCAB_SIZE + 1, 6]])
    values = [0.0, float(direct[0]), 0.0, 0.0, float(direct[2])]  # position 0 was never written: 0
    assert metrics["tail/mass_mean"] == pytest.approx(sum(values) / 5, rel=MASS_RTOL)
    assert metrics["tail/mass_max"] == pytest.approx(max(values), rel=MASS_RTOL)
    assert metrics["tail/token_frac"] == 1 / 5 and metrics["tail/response_frac"] == 1 / 3
    wrong = TailProbe(None, CHAR_VOCAB_SIZE - 1, rows=3, max_new_tokens=2, first_index=10)  # counter-case
    wrong(logits, torch.tensor([10, 11, 12]), torch.tensor([1, 1, 1]))
    assert not torch.allclose(wrong.mass[:, 1], direct, rtol=1e-3)
    with pytest.raises(ValueError, match="tail-mass values"):
        tail_metrics(rows, [[3], [5], [6]])


def test_rollout_tail_mass_matches_the_policy_and_leaves_sampling_alone():
    trainer = Trainer(_cfg(40), Console(quiet=True))
    plan = trainer.injector.plan(0)
    batch = trainer.rollout(0, plan)
    assert batch.tail_mass is not None and [len(m) for m in batch.tail_mass] == batch.lengths
    full = full_logprobs(trainer.compute, batch.prompts, batch.responses).double()
    direct = full[:, CHAR_VOCAB_SIZE:].exp().sum(-1)
    torch.testing.assert_close(torch.cat(batch.tail_mass), direct, rtol=0.0, atol=ROLLOUT_MASS_ATOL)
    # The same rollout without the probe (the generate call collect_rollouts made before the knob): same bits.
    plain = generate(trainer.compute, batch.prompts, max_new_tokens=trainer.cfg.rollout.max_new_tokens,
                     seed=_step_seed(trainer, 0), eos_token_id=EOS_ID, logits_hook=plan.logits_hook, ops=plan.ops)
    assert plain.tokens == batch.responses
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, batch.logprobs))
    metrics = trainer.step(0)
    assert 0.0 < metrics["tail/mass_mean"] <= metrics["tail/mass_max"] <= 1.0


def _step_seed(trainer: Trainer, step: int) -> int:
    from vexact.rl.trainer import _step_seed as seed_of

    return seed_of(trainer.cfg.seed, step)


@pytest.mark.parametrize("bad", [-1, 1.5, "many", True, None, 10**9])
def test_bad_values_name_the_key(bad):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": {"distractors": bad}})
    assert "task.distractors" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, [f"task.distractors={json.dumps(bad)}"])
    assert "task.distractors" in str(e.value)


def test_zero_distractors_is_the_old_behaviour_bitwise(monkeypatch):
    cfg = _cfg(0)
    assert type(make_task("horizon", 2, 2, distractors=0).tokenizer) is CharTokenizer
    # The warm-start key of a config without the knob (the config before it existed) is the key of distractors 0,
    # and a tail changes it.
    key = warm_start_key(cfg)
    assert warm_start_key(_cfg(5)) != key
    plain_dict = type(cfg).to_dict

    def without_knob(self):
        d = plain_dict(self)
        del d["task"]["distractors"]
        return d

    monkeypatch.setattr(type(cfg), "to_dict", without_knob)
    assert warm_start_key(cfg) == key
    monkeypatch.undo()
    # The rollout: no probe, no tail metric; the same tokens and log-probs as the generate call before the knob.
    trainer = Trainer(cfg, Console(quiet=True))
    plan = trainer.injector.plan(0)
    problems = step_problems(trainer.task, cfg.rollout, cfg.seed, 0)
    batch = collect_rollouts(trainer.compute, plan, trainer.task, trainer.tokenizer, problems, cfg.rollout,
                             _step_seed(trainer, 0))
    assert batch.tail_mass is None
    plain = generate(trainer.compute, batch.prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                     seed=_step_seed(trainer, 0), eos_token_id=EOS_ID, logits_hook=plan.logits_hook, ops=plan.ops)
    assert plain.tokens == batch.responses
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, batch.logprobs))
    assert not any(k.startswith("tail/") for k in trainer.step(0))


def test_the_meter_reports_the_tail_and_keeps_zero_bias_bitwise(tmp_path):
    from vexact.sweeps.bias_meter import exact_gradients, measure_bias, meter_table

    tiny = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=64", "warm_start.steps=3", "warm_start.batch_size=4",
            f"warm_start.cache_dir={tmp_path}", "rollout.samples_per_prompt=4"]
    cfg = _cfg(30, *tiny)
    exact = exact_gradients(cfg, batches=2)
    cell = measure_bias(cfg, batches=2, exact=exact)
    assert cell["exactly_zero"] is True  # the probe leaves the exact path's bits alone
    assert cell["tail_mass_mean"] == cell["tail_mass_mean_exact"] > 0.0
    noisy = measure_bias(_cfg(30, *tiny, "inject.mode=logit_noise", "inject.sigma=1.0"), batches=2, exact=exact)
    assert noisy["tail_mass_mean"] != noisy["tail_mass_mean_exact"] == cell["tail_mass_mean_exact"]
    table = meter_table({"cells": [{"horizon": 2, "source": "exact", **cell}], "growth": {}})
    assert "tail mass μ (exact)" in table and f"{cell['tail_mass_mean']:.2e}" in table
    plain = measure_bias(_cfg(0, *tiny), batches=2)  # no tail: no tail keys, the table as before
    assert not any(k.startswith("tail") for k in plain)
    assert "tail" not in meter_table({"cells": [{"horizon": 2, "source": "exact", **plain}], "growth": {}})


def test_tail_compare_matches_cells_and_lists_the_rest(tmp_path, capsys):
    from tools.studies.tail_compare import main

    def cell(h, s, ratio, k3, **tail):
        return {"horizon": h, "source": s, "bias_ratio": ratio, "bias_ratio_ci": [ratio / 2, ratio * 2], "k3_kl": k3,
                "bias_abs": 1.0, "bias_abs_noise": 0.1, "grad_norm": 1.0, "grad_norm_noise": 0.1,
                "reward_mean_exact": 0.5, **tail}

    tail = {"cells": [cell(1, "noise", 0.3, 1e-2, tail_mass_mean=2e-3, tail_mass_mean_exact=1e-3),
                      cell(16, "noise", 0.4, 2e-2, tail_mass_mean=3e-3, tail_mass_mean_exact=1e-3)]}
    base = {"cells": [cell(1, "noise", 0.1, 5e-3), cell(4, "noise", 0.2, 6e-3)]}
    (tmp_path / "t.json").write_text(json.dumps(tail))
    (tmp_path / "b.json").write_text(json.dumps(base))
    assert main([str(tmp_path / "t.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert ("| 1 | noise | 5.00e-03 | 1.00e-02 | 0.1 [0.05, 0.2] | 0.3 [0.15, 0.6] | 1 ± 0.1 / 1 ± 0.1 | "
            "1 ± 0.1 / 1 ± 0.1 | 2.00e-03 | 1.00e-03 |") in out
    assert "L = 4 noise (V = 22 only), L = 16 noise (tail only)" in out
    assert main([str(tmp_path / "t.json"), str(tmp_path / "missing.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_sweep_tail_table_averages_seeds_and_skips_points_without_a_tail(tmp_path, capsys):
    from tools.studies.tail_compare import main

    def point(name, overrides, rows, status="completed"):
        d = tmp_path / "points" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(rows)))
        return {"dir": f"points/{name}", "name": name, "overrides": overrides, "status": status}

    def tail(mass, frac):
        return {"tail/mass_mean": mass, "tail/response_frac": frac}

    points = [point("a0", {"inject.value": -0.3, "seed": 0}, [tail(0.1, 0.2), tail(0.3, 0.4)]),
              point("a1", {"inject.value": -0.3, "seed": 1}, [tail(0.3, 0.0), tail(0.5, 1.0)]),
              point("b0", {"inject.value": 0.0, "seed": 0}, [{"reward/mean": 1.0}]),  # no tail: left out
              point("c0", {"inject.value": -0.5, "seed": 0}, [tail(0.9, 0.9)], status="running")]  # unfinished
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    assert main(["--sweep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # first step: mean(0.1, 0.3); last: mean(0.3, 0.5); run mean: mean(0.2, 0.4); fractions: 0.1 / 0.7
    assert "| inject.value=-0.3 | 2 | 2 | 2.00e-01 | 4.00e-01 | 3.00e-01 | 0.100 / 0.700 |" in out
    assert "inject.value=0.0" not in out and "inject.value=-0.5" not in out
    assert main(["--sweep", str(tmp_path / "nope")]) == 2
