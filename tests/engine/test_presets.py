"""Named model presets (``model.preset``): one table used by the config, ``vexact check``, locate and benchmarks."""

from __future__ import annotations

import pytest

from vexact.cli import _check_shape, build_parser
from vexact.engine.model import ModelConfig
from vexact.engine.presets import MODEL_PRESETS, PRESET_NAMES, UnknownPresetError, preset_config, preset_values
from vexact.real.check import CHECK_PRESET, CheckSettings
from vexact.real.locate import RANDOM_MODEL
from vexact.rl.config import ConfigError, config_from_dict
from vexact.rl.config_schema import MODEL_DEFAULTS
from vexact.rl.warmstart import warm_start_key


def test_issue_names_are_presets():
    assert {"tiny", "testbed", "llama100m"} <= set(PRESET_NAMES)
    for name in PRESET_NAMES:  # every preset is a valid shape once given a vocabulary and a length
        preset_config(name, **{"vocab_size": 7, "max_seq_len": 16})


def test_config_preset_fills_and_explicit_keys_win():
    cfg = config_from_dict({"model": {"preset": "tiny", "num_layers": 3}})
    assert cfg.model.preset == "tiny"
    assert cfg.model.num_layers == 3  # explicit wins
    assert cfg.model.hidden_size == MODEL_PRESETS["tiny"]["hidden_size"] == 32
    over = config_from_dict({"model": {"preset": "tiny"}}, ["model.hidden_size=64"])
    assert over.model.hidden_size == 64  # --set is explicit too
    by_set = config_from_dict({}, ["model.preset=tiny"])
    assert by_set.model.intermediate_size == MODEL_PRESETS["tiny"]["intermediate_size"]


def test_unknown_preset_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"preset": "huge"}})
    assert e.value.key == "model.preset" and "tiny" in str(e.value) and "huge" in str(e.value)
    with pytest.raises(UnknownPresetError):
        preset_values("huge")


def test_default_model_is_the_testbed_preset_and_round_trips():
    cfg = config_from_dict({})
    assert cfg.model.preset is None
    assert {k: getattr(cfg.model, k) for k in MODEL_DEFAULTS} == preset_values("testbed")
    named = config_from_dict({"model": {"preset": "testbed"}})
    assert config_from_dict(named.to_dict()) == named  # a saved config (preset + every key) loads to itself
    # the preset only names values: the warm-start cache key is that of the same shape written out
    assert warm_start_key(named) == warm_start_key(cfg)
    assert warm_start_key(config_from_dict({"model": {"preset": "tiny"}})) != warm_start_key(cfg)


def test_check_locate_and_benchmarks_read_the_table():
    assert CHECK_PRESET in PRESET_NAMES
    small = MODEL_PRESETS[CHECK_PRESET]
    assert {k: getattr(CheckSettings(), k) for k in RANDOM_MODEL} == RANDOM_MODEL
    assert RANDOM_MODEL == {k: small[k] for k in RANDOM_MODEL}
    parser = build_parser()
    assert _check_shape(parser.parse_args(["check"]))["hidden_size"] == small["hidden_size"]
    shape = _check_shape(parser.parse_args(["check", "--preset", "tiny", "--num-layers", "3"]))
    assert shape["num_layers"] == 3 and shape["hidden_size"] == MODEL_PRESETS["tiny"]["hidden_size"]
    from benchmarks.common import shapes

    named = shapes()
    assert named["tiny"].model == preset_config("tiny")
    assert named["llama100m"].model == preset_config("llama100m")
    default = named["default"].model
    assert default == ModelConfig(**{**preset_values("testbed"), "vocab_size": default.vocab_size, "max_seq_len": 48})


# The public model cards' figures (Qwen3-0.6B, Qwen3-1.7B, Qwen3-30B-A3B on Hugging Face), in billions: total
# parameters, non-embedding parameters, and (MoE) activated per token. The cards round (and 3.35B activated reads
# 3.3B there), so the counts are compared within CARD_TOLERANCE.
QWEN3_CARDS = {"qwen3_0_6b": (0.6, 0.44, None), "qwen3_1_7b": (1.7, 1.4, None), "qwen3_30b_a3b": (30.5, 29.9, 3.3)}
CARD_TOLERANCE = 0.02  # relative


@pytest.mark.parametrize("name", list(QWEN3_CARDS))
def test_real_size_presets_match_the_public_counts(name):
    """Arithmetic (``parameter_count``) at the full depth against the model card; then the model itself built with
    num_layers=1 on the meta device (shapes only: no memory, the 151,936-token embedding included) has exactly that
    count's parameters, and the shapes the public config gives."""
    from vexact.engine.model import Transformer, parameter_count

    config = preset_config(name)
    total, non_embedding, active = QWEN3_CARDS[name]
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    count = parameter_count(config)
    assert count / 1e9 == pytest.approx(total, rel=CARD_TOLERANCE)
    assert (count - embeddings) / 1e9 == pytest.approx(non_embedding, rel=CARD_TOLERANCE)
    if active is not None:  # all but top-k of each layer's experts idle
        idle = len(config.moe_layers) * (config.num_experts - config.num_experts_per_tok) * 3 * \
            config.expert_intermediate_size * config.hidden_size
        assert (count - idle) / 1e9 == pytest.approx(active, rel=CARD_TOLERANCE)

    one = preset_config(name, num_layers=1)
    model = Transformer(one, device="meta")
    assert model.device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == parameter_count(one)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (one.num_heads * 128, one.hidden_size)  # head_dim 128, apart from hidden
    assert attn.k_proj.weight.shape == (one.num_kv_heads * 128, one.hidden_size)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (128,)  # qk-norm
    assert model.embed_tokens.weight.shape == (151936, one.hidden_size)
    assert hasattr(model, "lm_head") == (name == "qwen3_30b_a3b")  # the dense two tie their embeddings
    assert one.rope_theta == 1e6
    if one.num_experts:
        block = model.layers[0].mlp
        assert len(block.experts) == 128 and one.num_experts_per_tok == 8 and one.norm_topk_prob
        assert block.experts[0].gate_proj.weight.shape == (768, one.hidden_size)
        assert block.gate.weight.shape == (128, one.hidden_size)


def test_real_size_preset_structure_is_exact_on_cpu():
    """The presets' structure (qk-norm, head_dim apart from hidden / heads, tied head, MoE top-8 of many) computes
    exactly on the CPU: narrowed to a small vocabulary and one layer, the rollout's and the training path's
    log-probs are equal bit for bit."""
    from vexact.real.check import CheckSettings, mismatched, run_check

    for name in ("qwen3_0_6b", "qwen3_30b_a3b"):
        shape = {k: v for k, v in preset_values(name).items() if k in CheckSettings.__dataclass_fields__}
        shape.update(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=64)
        if shape.get("num_experts"):
            shape.update(num_experts=16, moe_intermediate_size=16)
        settings = CheckSettings(**shape, num_prompts=4, max_prompt_len=5, max_new_tokens=3, batch_sizes=(None, 1),
                                 micro_batch_sizes=(None, 3))
        (row,) = run_check(settings, backends=("exact",))
        assert row["tokens"] > 0 and mismatched(row) == 0, name
