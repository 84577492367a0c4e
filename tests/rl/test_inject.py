"""The perturbation injector: each mode changes what it claims, magnitude 0 is a bitwise no-op,
injection is batch-invariant, calibration hits its target."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, tiny_model, warm_start_cache
from rich.console import Console
from test_trainer import EXPERIMENT, _short, _without_timing

from vexact import generate, token_logprobs
from vexact.engine.model import Transformer
from vexact.records.runlog import read_metrics
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.inject import Injector, RolloutPlan, round_to
from vexact.rl.inject_modes import INJECT_MODES
from vexact.rl.trainer import Trainer
from vexact_kernels import get_ops


def _injector(**inject) -> Injector:
    return Injector(config_from_dict({"inject": inject}).inject, seed=0)


def _rollout(model, hook, prompts, batch_size=None):
    return generate(model, prompts, max_new_tokens=8, seed=1, batch_size=batch_size, logits_hook=hook)


def _dlogp(model, prompts, out) -> torch.Tensor:
    trained = token_logprobs(model, prompts, out.tokens)
    return torch.cat(out.logprobs) - torch.cat(trained).detach()


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    with torch.no_grad():  # peakier logits than random init, so truncation and scaling matter
        model.lm_head.weight.mul_(40)
    return model, random_prompts(12, 10, seed=3)


def test_magnitude_zero_installs_nothing():
    for mode in ("logit_noise", "logit_scale", "logprob_only"):
        assert _injector(mode=mode, **{INJECT_MODES[mode].knob_name: 0.0}).plan(5).logits_hook is None
    assert _injector(mode="top_p", top_p=1.0).plan(0).logits_hook is None
    assert _injector(mode="top_k", top_k=0).plan(0).logits_hook is None
    assert not _injector(mode="none").plan(0).active


def test_magnitude_zero_run_is_bitwise_identical_to_no_injector(tmp_path):
    plain = _short(tmp_path, "plain", "steps=3")
    zero = _short(tmp_path, "zero", "steps=3", "inject.mode=logit_noise", "inject.sigma=0.0")
    for cfg in (plain, zero):
        Trainer(cfg, Console(quiet=True)).run()
    a = _without_timing(read_metrics(tmp_path / "plain" / "metrics.jsonl"))
    b = [{k: v for k, v in r.items() if not k.startswith("inject/")}
         for r in _without_timing(read_metrics(tmp_path / "zero" / "metrics.jsonl"))]
    assert a == b
    assert all(r["mismatch/bitwise_equal_frac"] == 1.0 for r in b)


def test_logit_noise_perturbs_sampling_and_records(setup):
    model, prompts = setup
    clean = _rollout(model, None, prompts)
    noisy = _rollout(model, _injector(mode="logit_noise", sigma=1.0).plan(0).logits_hook, prompts)
    assert noisy.tokens != clean.tokens
    d = _dlogp(model, prompts, noisy)
    assert (d != 0).float().mean() > 0.9 and d.abs().mean() > 0.1


def test_logit_scale_sharper_and_flatter():
    z = torch.tensor([[3.0, 1.0, 0.0, -2.0]])
    seq = pos = torch.zeros(1, dtype=torch.long)

    def entropy(logits):
        p = torch.softmax(logits, -1)
        return float(-(p * p.log()).sum())

    sharp, _ = _injector(mode="logit_scale", epsilon=0.5).plan(0).logits_hook(z, seq, pos)
    flat, _ = _injector(mode="logit_scale", epsilon=-0.5).plan(0).logits_hook(z, seq, pos)
    assert torch.equal(sharp, z * 1.5) and torch.equal(flat, z * 0.5)
    assert entropy(sharp) < entropy(z) < entropy(flat)


def test_logprob_only_keeps_sampling_exact(setup):
    model, prompts = setup
    clean = _rollout(model, None, prompts)
    out = _rollout(model, _injector(mode="logprob_only", sigma=0.5).plan(0).logits_hook, prompts)
    assert out.tokens == clean.tokens
    assert (_dlogp(model, prompts, out) != 0).any()


def test_top_k_one_is_greedy_with_logprob_zero(setup):
    model, prompts = setup
    out = _rollout(model, _injector(mode="top_k", top_k=1).plan(0).logits_hook, prompts)
    greedy = generate(model, prompts, max_new_tokens=8, temperature=0.0)
    assert out.tokens == greedy.tokens
    assert torch.equal(torch.cat(out.logprobs), torch.zeros(12 * 8))


def test_top_p_samples_inside_the_nucleus(setup):
    model, prompts = setup
    out = _rollout(model, _injector(mode="top_p", top_p=0.5).plan(0).logits_hook, prompts)
    d = _dlogp(model, prompts, out)
    assert (d >= 0).all() and (d > 0).any()  # renormalised nucleus: recorded log-prob >= full-distribution one


def test_precision_mode_rounds_activations(setup):
    model, prompts = setup
    for fmt, sites in (("bfloat16", ["logits"]), ("fp8_e4m3", ["linear", "attention", "norm", "logits"])):
        plan = _injector(mode="precision", precision=fmt, sites=sites).plan(0)
        out = generate(model, prompts, max_new_tokens=8, seed=1, logits_hook=plan.logits_hook, ops=plan.ops)
        assert (_dlogp(model, prompts, out) != 0).any(), fmt
        assert model.ops is get_ops("exact"), "the plan's ops are passed in; the model is never switched"
    activations = _injector(mode="precision", precision="bfloat16", sites=["linear"]).plan(0)
    assert activations.logits_hook is None and activations.ops is not get_ops("exact")
    assert activations.active and not activations.matches_training
    x = torch.tensor([1.0 + 2**-10, 1000.0])
    assert torch.equal(round_to(x, "bfloat16"), torch.tensor([1.0, 1000.0]))
    assert round_to(torch.tensor([1e6]), "fp8_e4m3").item() == 448.0  # saturates, never inf/NaN


def test_the_plan_carries_the_rollout_ops_and_dtype_and_no_model_is_switched(tmp_path, monkeypatch):
    """The rollout mode is a value: the plan names the ops and weight dtype, and a whole step runs without
    changing the backend of any existing model (constructing a copy in another dtype is not a switch)."""
    cfg = _short(tmp_path, "plan", "steps=1", "inject.mode=kernel", "inject.kernel_backend=native",
                 "inject.kernel_dtype=bfloat16")
    trainer = Trainer(cfg, Console(quiet=True))
    plan = trainer.injector.plan(0)
    assert plan.ops is get_ops("native") and plan.dtype == torch.bfloat16
    assert plan.active and not plan.matches_training
    clean = Injector(cfg.inject, seed=0).plan_for_value(0.0, step=0)
    assert clean.ops is get_ops("exact") and clean.dtype == torch.float32 and clean.matches_training

    switches = []
    backend = Transformer.backend

    def record(model, name):
        if hasattr(model, "_backend"):
            switches.append((model._backend, name))
        backend.fset(model, name)

    monkeypatch.setattr(Transformer, "backend", property(backend.fget, record))
    row = trainer.step(0)
    assert switches == []
    assert row["mismatch/bitwise_equal_frac"] < 1.0 and row["inject/active"] == 1.0


def test_kernel_mode_uses_the_other_backend(tmp_path):
    cfg = _short(tmp_path, "kernel", "steps=1", "inject.mode=kernel", "inject.kernel_backend=native")
    Trainer(cfg, Console(quiet=True)).run()
    row = read_metrics(tmp_path / "kernel" / "metrics.jsonl")[0]
    assert row["mismatch/bitwise_equal_frac"] < 1.0 and row["rollout_corr/k3_kl"] < 1e-6


def test_scopes_and_schedule():
    z = torch.tensor([[8.0, 0.0, -1.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    seq, pos = torch.tensor([0, 1]), torch.tensor([0, 0])
    hook = _injector(mode="logit_noise", sigma=1.0, scope="low_prob", prob_threshold=0.5).plan(0).logits_hook
    changed, _ = hook(z, seq, pos)
    assert changed[0, 0] == z[0, 0] and (changed[0, 1:] != z[0, 1:]).all()  # the 0.99-probability entry kept
    assert (changed[1] != z[1]).all()  # every entry of a uniform row is below 0.5
    frac = _injector(mode="logit_noise", sigma=1.0, scope="fraction", fraction=0.3).plan(0).logits_hook
    rows = torch.zeros(4000, 5)
    out, _ = frac(rows, torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    assert 0.25 < (out != 0).any(-1).float().mean() < 0.35
    ramp = _injector(mode="logit_noise", sigma=2.0, onset_step=10, ramp_steps=4)
    assert [ramp.value_at(s) for s in (9, 10, 11, 13, 20)] == [0.0, 0.5, 1.0, 2.0, 2.0]
    assert not ramp.plan(9).active and ramp.plan(10).active


def test_a_truncation_ramp_grows_the_truncation():
    """The ramp took the knob linearly from 0, and for top_p / top_k 0 cuts the most: the first steps of a ramp
    injected the largest mismatch. It now starts from the knob that cuts nothing (p = 1, k large)."""
    top_p = _injector(mode="top_p", top_p=0.9, ramp_steps=4)
    assert [top_p.value_at(s) for s in range(5)] == pytest.approx([0.975, 0.95, 0.925, 0.9, 0.9])
    top_k = _injector(mode="top_k", top_k=8, ramp_steps=4)  # k below the vocabulary's 22; the ramp's from above it
    assert [top_k.value_at(s) for s in range(5)] == [32.0, 16.0, 11.0, 8.0, 8.0]


@pytest.mark.parametrize("mode", ["precision", "none"])
def test_a_ramp_for_a_mode_without_a_knob_is_refused(mode):
    with pytest.raises(ConfigError, match=f"inject.ramp_steps.*mode '{mode}' has none"):
        config_from_dict({"inject": {"mode": mode, "ramp_steps": 10}})


@pytest.mark.parametrize("inject", [{"mode": "top_p", "top_p": 0.9}, {"mode": "top_k", "top_k": 8},
                                    {"mode": "precision"}, {"mode": "none"}])
def test_a_scope_for_a_mode_that_does_not_read_it_is_refused(inject):
    """These modes never call ``injector.scoped``: the run was accepted and injected into every token."""
    with pytest.raises(ConfigError, match=f"inject.scope.*mode '{inject['mode']}' does not read inject.scope"):
        config_from_dict({"inject": {**inject, "scope": "low_prob"}})
    assert config_from_dict({"inject": {**inject, "scope": "all"}}).inject.scope == "all"
    scoped = config_from_dict({"inject": {"mode": "logit_scale", "epsilon": 0.1, "scope": "low_prob"}})
    assert scoped.inject.scope == "low_prob"


def test_injected_rollout_is_batch_invariant(setup):
    model, prompts = setup
    hook = _injector(mode="logit_noise", sigma=1.0, scope="fraction", fraction=0.5).plan(0).logits_hook
    a, b = _rollout(model, hook, prompts), _rollout(model, hook, prompts, batch_size=5)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("mode,metric,target", [("logit_noise", "rollout_corr/k3_kl", 0.05),
                                                ("logit_scale", "mismatch/abs_dlogp_mean", 0.1)])
def test_calibration_hits_target(tmp_path, mode, metric, target):
    cfg = load_config(EXPERIMENT, [f"output_dir={tmp_path / 'cal'}",
                                   f"warm_start.cache_dir={warm_start_cache(tmp_path)}", "warm_start.steps=30",
                                   "rollout.prompts_per_step=4", f"inject.mode={mode}",
                                   "inject.epsilon=-0.1" if mode == "logit_scale" else "inject.sigma=1.0",
                                   f"inject.target={{metric: {metric}, value: {target}}}",
                                   "inject.calibration_prompts=8", "inject.calibration_tolerance=0.05"])
    trainer = Trainer(cfg, Console(quiet=True))
    trainer._calibrate(None)
    cal = trainer.calibration
    assert abs(cal.achieved - target) <= 0.05 * target, cal.evaluations  # stated tolerance: 5% relative
    assert trainer.injector.value == cal.value
    if mode == "logit_scale":
        assert cal.value < 0  # direction kept from the configured sign


def test_a_target_the_mode_cannot_reach_is_refused(tmp_path):
    """A k3 of 1000 by top_p: calibration kept the closest knob it tried (k3 1.9) and trained on it, silently."""
    cfg = load_config(EXPERIMENT, [f"output_dir={tmp_path / 'cal'}",
                                   f"warm_start.cache_dir={warm_start_cache(tmp_path)}", "warm_start.steps=30",
                                   "rollout.prompts_per_step=4", "inject.mode=top_p", "inject.top_p=0.9",
                                   "inject.target={metric: rollout_corr/k3_kl, value: 1000}",
                                   "inject.calibration_prompts=4"])
    with pytest.raises(ValueError, match=r"inject.target: mode 'top_p' does not reach rollout_corr/k3_kl = 1000 "
                                         r"within inject.calibration_tolerance 0.05 .* the closest of \d+ knobs tried"):
        Trainer(cfg, Console(quiet=True))._calibrate(None)


@pytest.mark.parametrize("short,full", [("k3_kl", "rollout_corr/k3_kl"), ("abs_dlogp_mean", "mismatch/abs_dlogp_mean")])
def test_a_short_target_metric_name_is_a_deprecated_alias_of_its_full_key(short, full):
    with pytest.warns(FutureWarning, match=f"inject.target.metric: '{short}' is deprecated; use the full metric key "
                                           f"'{full}'"):
        cfg = load_config(EXPERIMENT, ["inject.mode=logit_noise", "inject.sigma=1.0",
                                       f"inject.target={{metric: {short}, value: 0.05}}"])
    assert cfg.inject.target.metric == full


def test_plan_value_reports_the_magnitude():
    plan = _injector(mode="logit_scale", epsilon=-0.3).plan(0)
    assert isinstance(plan, RolloutPlan) and plan.value == -0.3 and plan.active


def test_recomputed_old_logprobs_keep_ratio_exact_under_injection(tmp_path):
    """Injection changes what was sampled, but recomputed old log-probs come from the exact training
    path: the first mini-batch's PPO ratio is still exactly 1 while the rollout log-probs mismatch."""
    cfg = _short(tmp_path, "rec", "steps=1", "inject.mode=logit_scale", "inject.epsilon=-0.5",
                 "algorithm.old_logprobs=recompute")
    assert Trainer(cfg, Console(quiet=True)).run()["status"] == "completed"
    row = read_metrics(tmp_path / "rec" / "metrics.jsonl")[0]
    assert row["mismatch/first_minibatch_ratio_exact"] == 1.0
    assert row["mismatch/bitwise_equal_frac"] < 1.0 and row["rollout_corr/k3_kl"] > 0


@pytest.mark.parametrize("returns, says", [
    (lambda z: (z[..., :-1], z[..., :-1]),
     "returned sample_from of shape (3, 96), torch.float32 on cpu"),
    (lambda z: z + 1.0, "returned a Tensor"),
    (lambda z: (z, z.double()), "returned record of shape (3, 97), torch.float64"),
    (lambda z: (z, None), "returned None as record"),
    (lambda z: 1 / 0, "raised ZeroDivisionError"),
])
def test_a_modes_hook_result_is_checked_at_each_call_naming_the_mode(returns, says):
    """A plugin mode's hook that returns anything but a pair of tensors of the logits' shape, dtype and device (or
    raises) is one error naming the mode and the hook: not a silent narrower vocabulary, nor a traceback."""
    from vexact.registry import PluginCodeError
    from vexact.rl.inject_modes import InjectMode, register_inject_mode

    class Bad(InjectMode):
        name = "inj_bad"
        knob = "something"

        def logits_hook(self, injector, value, step):
            return lambda z, seq, pos: returns(z)

    register_inject_mode(Bad())
    try:
        plan = _injector(mode="inj_bad", value=1.0).plan(0)
        with pytest.raises(PluginCodeError) as e:
            _rollout(tiny_model(), plan.logits_hook, random_prompts(3, 4, seed=0))
    finally:
        INJECT_MODES.remove("inj_bad")
    assert str(e.value).startswith("injection mode 'inj_bad' (logits_hook's hook) ") and says in str(e.value)
