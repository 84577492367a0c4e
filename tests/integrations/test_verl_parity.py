"""Parity with verl 0.9.1's own functions: under a verl name, vexact computes verl's definition.

verl imports ray, tensordict and omegaconf when its package loads, so this test does not import the package: it
loads the four files the compared functions live in (``rollout_corr_helper``, ``core_algos``,
``utils/torch_functional``, ``utils/debug/metrics``, plus the pure-Python ``base_config`` and
``trainer/config/algorithm`` for the presets) from the installed wheel (``pip install --no-deps verl==0.9.1``), with
stand-ins for the modules they import but the compared functions never call (DataProto, tokenizers, devices,
config classes). Inputs are float64, and verl gets the mask its pipeline passes, an integer response mask (a slice of
the attention mask), with which its masked means divide by the count exactly, as vexact's do; with a float mask
(also compared, away from zero mismatch) verl divides by count + 1e-8, a relative difference below 1e-8 / N.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import require_optional

from vexact.rl.config_schema import AlgorithmSection, CorrectionSection
from vexact.rl.corrections import PRESETS, plan_for, rollout_correction
from vexact.rl.metrics import mismatch_metrics
from vexact.rl.objective import Objective, aggregate, ppo_token_loss

VERL_VERSION = "0.9.1"
VERL_PIP = f"pip install --no-deps verl=={VERL_VERSION} (.ci/run does)"
pytestmark = pytest.mark.needs_package("verl", VERL_PIP)  # without verl: one skip for the file (tests/conftest.py)
REL, ABS = 1e-7, 1e-9  # float64 inputs; sums in another order (verl's padded rows, vexact's flat tokens)
MASKS = {"int_mask": torch.int64, "float_mask": torch.float64}  # int64: what verl's pipeline passes
# scales of the rollout's log-prob noise: 0 is zero mismatch (rollout == training bit for bit)
SCALES = [(0.0, "int_mask"), (1e-6, "int_mask"), (0.05, "int_mask"), (0.4, "int_mask"), (0.4, "float_mask")]


def _verl_dir() -> Path:
    require_optional("verl", VERL_PIP)
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    root = Path(next(iter(spec.submodule_search_locations)))
    version = (root / "version" / "version").read_text().strip()
    if version != VERL_VERSION:
        pytest.fail(f"the parity test is written against verl {VERL_VERSION}, found {version}")
    return root


class _DataProto:
    """Stand-in for verl.protocol.DataProto: the compared functions only build one and read ``.batch``."""

    def __init__(self, batch: dict):
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict) -> _DataProto:
        return cls(dict(tensors))


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture(scope="module")
def verl() -> types.SimpleNamespace:
    root = _verl_dir()
    stand_ins = {
        "verl": _module("verl"),
        "verl.protocol": _module("verl.protocol", DataProto=_DataProto),
        "verl.utils": _module("verl.utils", as_torch_index=None, group_mean_std=None),
        "verl.utils.device": _module("verl.utils.device", get_device_name=lambda: "cpu",
                                     get_torch_device=lambda: torch.cpu),
        "verl.utils.import_utils": _module("verl.utils.import_utils",
                                           deprecated=lambda *a, **k: (lambda f: f)),
        "verl.utils.debug": _module("verl.utils.debug"),
        "verl.trainer": _module("verl.trainer"),
        "verl.trainer.ppo": _module("verl.trainer.ppo"),
        "verl.workers": _module("verl.workers"),
        "verl.workers.config": _module("verl.workers.config", ActorConfig=type("ActorConfig", (), {})),
        "verl.workers.config.actor": _module("verl.workers.config.actor",
                                             PolicyLossConfig=type("PolicyLossConfig", (), {})),
        "tensordict": _module("tensordict", TensorDict=dict),
        "transformers": _module("transformers", PreTrainedTokenizer=object),
        "omegaconf": _module("omegaconf", DictConfig=dict, open_dict=None),
    }
    saved = {name: sys.modules.get(name) for name in stand_ins}
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(stand_ins)

        def load(name: str, relative: str) -> types.ModuleType:
            spec = importlib.util.spec_from_file_location(name, root / relative)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
            return module

        load("verl.utils.torch_functional", "utils/torch_functional.py")
        load("verl.base_config", "base_config.py")
        algorithm = load("verl.trainer.config.algorithm", "trainer/config/algorithm.py")
        sys.modules["verl.trainer.config"] = _module("verl.trainer.config", AlgoConfig=algorithm.AlgoConfig)
        helper = load("verl.trainer.ppo.rollout_corr_helper", "trainer/ppo/rollout_corr_helper.py")
        core = load("verl.trainer.ppo.core_algos", "trainer/ppo/core_algos.py")
        debug = load("verl.utils.debug.metrics", "utils/debug/metrics.py")
    finally:  # leave sys.modules as it was: other tests may import the real transformers
        for name in list(stand_ins) + list(loaded) + ["verl.trainer.config"]:
            if saved.get(name) is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
    return types.SimpleNamespace(helper=helper, core=core, debug=debug, algorithm=algorithm)


def _batch(seed: int, scale: float, mask: str = "int_mask") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       list[int]]:
    """Padded [B, T] float64 log-probs (training, rollout) and mask (``MASKS[mask]``); ragged rows, one empty."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 0, 12, 5, 12, 3, 9]
    T = max(lengths)
    train = -torch.rand(len(lengths), T, generator=gen, dtype=torch.float64) * 4
    roll = train + scale * torch.randn(len(lengths), T, generator=gen, dtype=torch.float64)
    roll = roll.clamp(max=0.0)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(MASKS[mask])
    return train, roll, mask, lengths


def _flat(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([row[:n] for row, n in zip(x, lengths)])


IS_CHOICES = [(None, 2.0), ("token", 2.0), ("token", 1.3), ("token", "0.5_5.0"), ("token", "0.9_1.2"),
              ("sequence", 2.0), ("sequence", 5.0), ("sequence", "0.5_3.0")]
RS_CHOICES = [(None, None), ("token_k1", "0.8_1.25"), ("token_k2", 0.02), ("token_k3", 0.02),
              ("seq_sum_k1", 2.0), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1), ("seq_mean_k1", "0.95_1.05"),
              ("seq_mean_k2", 0.01), ("seq_mean_k3", 0.01), ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
              ("token_k1,seq_mean_k3,seq_max_k2", "0.8_1.25,0.01,0.05")]
CASES = [(rollout_is, is_thr, normalize, rs, rs_thr)
         for (rollout_is, is_thr), normalize, (rs, rs_thr) in itertools.product(IS_CHOICES, (False, True), RS_CHOICES)
         if rollout_is is not None or (rs is not None and not normalize)]


@pytest.mark.parametrize("scale,mask", SCALES)
@pytest.mark.parametrize("rollout_is,is_thr,normalize,rs,rs_thr", CASES)
def test_rollout_corr_metrics_weights_and_masks_equal_verls(verl, rollout_is, is_thr, normalize, rs, rs_thr, scale,
                                                            mask):
    train, roll, mask, lengths = _batch(seed=len(CASES), scale=scale, mask=mask)
    proto, verl_mask, verl_metrics = verl.helper.compute_rollout_correction_and_rejection_mask(
        train, roll, mask, rollout_is=rollout_is, rollout_is_threshold=is_thr,
        rollout_is_batch_normalize=normalize, rollout_rs=rs, rollout_rs_threshold=rs_thr)
    cfg = CorrectionSection(rollout_is=rollout_is, rollout_is_threshold=is_thr, rollout_is_batch_normalize=normalize,
                            rollout_rs=rs, rollout_rs_threshold=rs_thr)
    flat_train, flat_roll = _flat(train, lengths), _flat(roll, lengths)
    ours = rollout_correction(flat_train, flat_roll, lengths, cfg)
    ours_metrics = {**ours.metrics, **mismatch_metrics(list(train_row[:n] for train_row, n in zip(train, lengths)),
                                                       list(roll_row[:n] for roll_row, n in zip(roll, lengths)))}
    missing = sorted(set(verl_metrics) - set(ours_metrics))
    assert not missing, f"verl logs {missing}, vexact does not"
    spread_tol = _float_mask_spread(mask, lengths)
    differing = {k: (verl_metrics[k], ours_metrics[k]) for k in verl_metrics
                 if not _close(verl_metrics[k], ours_metrics[k], spread_tol if _is_spread(k) else ABS)}
    assert not differing, differing
    ours_extra = {k for k in ours.metrics if k.startswith("rollout_corr/")} - set(verl_metrics)
    assert not ours_extra, f"vexact logs {sorted(ours_extra)} in verl's namespace, verl does not"
    assert torch.equal(_flat(verl_mask, lengths).bool(), ours.keep)
    if proto is not None:
        verl_weights = _flat(proto.batch["rollout_is_weights"] * verl_mask, lengths)
        torch.testing.assert_close(ours.weights, verl_weights, rtol=REL, atol=ABS)


def _close(a: float, b: float, abs_tol: float = ABS) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(float(a), float(b), rel_tol=REL, abs_tol=abs_tol)


def _is_spread(key: str) -> bool:
    return key.endswith("_std") or key.endswith("_deviation")


def _float_mask_spread(mask: torch.Tensor, lengths: list[int]) -> float:
    """How far a std may be off when verl gets a float mask: its means of a constant c come out c·N/(N + 1e-8), so
    E[x²] - E[x]² is c²·1e-8/N instead of 0, a std of c·sqrt(1e-8/N) (c <= 1 here: clamped weights and statistics).
    With the integer mask of verl's pipeline there is no such term: ABS."""
    return math.sqrt(1e-8 / sum(lengths)) if mask.is_floating_point() else ABS


@pytest.mark.parametrize("scale,mask", SCALES)
def test_debug_metrics_equal_verls(verl, scale, mask):
    train, roll, mask, lengths = _batch(seed=3, scale=scale, mask=mask)
    data = _DataProto({"rollout_log_probs": roll, "old_log_probs": train, "response_mask": mask,
                       "responses": torch.zeros_like(mask, dtype=torch.long)})
    theirs = verl.debug.calculate_debug_metrics(data)
    ours = mismatch_metrics([t[:n] for t, n in zip(train, lengths)], [r[:n] for r, n in zip(roll, lengths)])
    assert set(theirs) <= set(ours)
    assert {k: v for k, v in theirs.items() if not _close(v, ours[k])} == {}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_verls_factories(verl, name):
    factory = verl.algorithm.RolloutCorrectionConfig.disabled if name == "disabled" else getattr(
        verl.algorithm.RolloutCorrectionConfig, name)
    theirs = factory()
    fields = {k: getattr(theirs, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                              "rollout_rs", "rollout_rs_threshold", "loss_type")}
    # verl's mode default (decoupled) is not implied by "disabled": vexact's algorithm.old_logprobs decides
    bypass_mode = None if name == "disabled" else theirs.bypass_mode
    assert plan_for(CorrectionSection(preset=name)) == plan_for(CorrectionSection(**fields), bypass_mode)


def _actor_config(verl) -> types.SimpleNamespace:
    cfg = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, global_batch_info={})
    cfg.get = lambda key, default=None: {"clip_ratio_c": 1e9}.get(key, default)  # no dual clip: vexact has none
    return cfg


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("preset,old_logprobs", [("decoupled_token_icepop", "recompute"),
                                                  ("decoupled_seq_is_rs", "recompute"),
                                                  ("decoupled_geo_rs_token_tis", "recompute"),
                                                  ("bypass_pg_token_icepop", "rollout"),
                                                  ("bypass_pg_geo_rs_seq_tis", "rollout"),
                                                  ("bypass_pg_geo_rs", "rollout")])  # rejection only: w = 1
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_policy_loss_equals_verls(verl, preset, old_logprobs, loss_agg, mask):
    """The loss vexact backpropagates equals verl's on the same tokens: IS weights on the per-token loss, IcePop's
    zeroed tokens kept in the denominator, rejected tokens removed from it."""
    train, roll, mask, lengths = _batch(seed=11, scale=0.3, mask=mask)
    gen = torch.Generator().manual_seed(5)
    logp = (train + 0.05 * torch.randn(train.shape, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(len(lengths), 1, generator=gen, dtype=torch.float64).expand_as(train).contiguous()
    # geometric presets at verl's ±0.1% would reject every sequence of this batch (verl's loss is then 0/0 = NaN,
    # vexact's 0: a documented difference); a wider band keeps some
    override = {"rs_threshold": "0.8_1.25"} if "geo_rs" in preset else {}
    factory = getattr(verl.algorithm.RolloutCorrectionConfig, preset)(**override)
    proto, verl_mask, _ = verl.helper.compute_rollout_correction_and_rejection_mask(
        train if old_logprobs == "recompute" else logp, roll, mask, rollout_is=factory.rollout_is,
        rollout_is_threshold=factory.rollout_is_threshold, rollout_rs=factory.rollout_rs,
        rollout_rs_threshold=factory.rollout_rs_threshold)
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    mode = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}[loss_agg]
    if old_logprobs == "recompute":
        theirs, _ = verl.core.compute_policy_loss_vanilla(train, logp, adv, verl_mask, loss_agg_mode=mode,
                                                          config=_actor_config(verl), rollout_is_weights=weights)
    else:
        theirs, _ = verl.core.compute_policy_loss_reinforce(roll, logp, adv, verl_mask, loss_agg_mode=mode,
                                                            config=_actor_config(verl), rollout_is_weights=weights)

    cfg = CorrectionSection(preset=preset, rollout_rs_threshold=override.get("rs_threshold"))
    objective = Objective(AlgorithmSection(old_logprobs=old_logprobs, loss_agg=loss_agg), cfg, 1.0, True)
    flat_logp, flat_adv = _flat(logp, lengths), _flat(adv, lengths)
    pre = _flat(train if old_logprobs == "recompute" else logp, lengths)
    correction = rollout_correction(pre, _flat(roll, lengths), lengths, cfg)
    anchor = pre if old_logprobs == "recompute" else _flat(roll, lengths)
    per_token, _ = objective._pg_loss(flat_logp, anchor, flat_adv, pre, correction)
    keep = correction.keep
    kept_lengths = [int(k.sum()) for k in keep.split(lengths)]
    ours = aggregate(per_token[keep], kept_lengths, loss_agg)
    assert math.isclose(float(ours), float(theirs), rel_tol=REL, abs_tol=ABS), (float(ours), float(theirs))
    plain, _ = ppo_token_loss(flat_logp, anchor, flat_adv, 0.2, 0.28)
    assert not torch.equal(per_token, plain)  # the correction did something, so the comparison can fail


@pytest.mark.parametrize("rollout_is,rs,rs_thr", [("token", None, None), ("sequence", None, None),
                                                   ("token", "token_k1,seq_mean_k3,seq_max_k2", "0.8_1.25,0.01,0.05")])
def test_zero_mismatch_dispersion_is_exactly_zero_with_verls_integer_mask(verl, rollout_is, rs, rs_thr):
    """Rollout == training bit for bit: with the integer response mask of verl's pipeline, verl's rollout_corr/*
    stds and deviations are exactly 0, and so are vexact's. With a float mask, verl's own are not (count + 1e-8 in
    float64): the mask's dtype is what this test is about."""
    train, _, mask, lengths = _batch(seed=5, scale=0.0)
    keep = [i for i, n in enumerate(lengths) if n]  # an empty row's mean is 0 for verl: a real spread
    train, mask, lengths = train[keep], mask[keep], [lengths[i] for i in keep]

    def spread(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if k.endswith("_std") or k.endswith("_deviation")}

    kwargs = dict(rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rs, rollout_rs_threshold=rs_thr)
    _, _, theirs = verl.helper.compute_rollout_correction_and_rejection_mask(train, train.clone(), mask, **kwargs)
    ours = rollout_correction(_flat(train, lengths), _flat(train, lengths), lengths, CorrectionSection(**kwargs))
    assert spread(theirs) and set(spread(theirs)) == {k for k in spread(ours.metrics) if k.startswith("rollout_corr/")}
    assert all(v == 0.0 for v in spread(theirs).values()), spread(theirs)
    assert all(v == 0.0 for v in spread(ours.metrics).values()), spread(ours.metrics)
    _, _, float_mask = verl.helper.compute_rollout_correction_and_rejection_mask(train, train.clone(),
                                                                                mask.double(), **kwargs)
    assert float_mask["rollout_corr/rollout_is_std"] > 0.0  # verl fed a float mask: the 1e-8 shows
