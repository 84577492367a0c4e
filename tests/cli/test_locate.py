"""``vexact locate``: the first op whose bits differ between two paths (tiny random models, no downloads).

What must hold: exact rollout vs exact train records every op bitwise equal (no divergence); native vs exact
diverges, at the op a hand-run lockstep of both backends' ops finds first; fp32 vs bf16 diverges at the
embedding with the values and bits computed by hand; the recorded names follow the model structure (qk_norm +
qkv_bias) and a forward the plan does not describe fails loudly; recording changes no bit; the JSON report has
its documented keys; a from_pretrained checkpoint works; bad input is one error line and exit code 2.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import TINY

import vexact_kernels
from vexact import ModelConfig, Transformer
from vexact.cli import main
from vexact.real.locate import (
    RUN_DEFAULTS,
    LocateSettings,
    OpRecorder,
    OpStructureError,
    capture,
    op_plan,
    run_locate,
)
from vexact.real.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

SHAPE = {k: v for k, v in TINY.items() if k != "max_seq_len"}
EQUAL_LENGTH_PROMPTS = [[5, 17, 3, 90, 41, 8, 66, 2, 13, 77, 29, 50], [60, 1, 44, 9, 31, 72, 18, 85, 4, 36, 55, 23]]
SIZE_ARGS = [arg for k, v in SHAPE.items() for arg in ("--" + k.replace("_", "-"), str(v))]


def _locate(a: str, b: str, **kwargs) -> dict:
    return run_locate(LocateSettings(a=a, b=b, random_model=dict(SHAPE), **kwargs)).summary


@pytest.mark.parametrize("dtype, prefill", [("fp32", None), ("fp32", 1), ("bf16", None)])
def test_exact_rollout_vs_exact_train_has_no_divergence(dtype, prefill):
    s = _locate(f"exact:{dtype}", f"exact:{dtype}", random_prompts=3, max_new_tokens=6, prefill=prefill)
    assert (s["a"], s["b"]) == (f"exact:{dtype}:rollout", f"exact:{dtype}:train")
    assert s["positions"] == sum(map(len, s["tokens"])) == sum(s["prompt_lengths"]) + 3 * 6
    assert s["prefill"] == ([1, 1, 1] if prefill else s["prompt_lengths"])
    assert not s["diverged"] and s["first_divergence"] is None
    assert len(s["ops"]) == len(op_plan(ModelConfig(**SHAPE)))
    for row in s["ops"]:
        assert row["bitwise_equal"] and row["elements_differing"] == 0 and row["abs_diff_max"] == 0.0, row["name"]
        assert row["elements"] == s["positions"] * row["features"]


def test_recording_changes_no_bit_and_keeps_the_rows_asked_for():
    model = Transformer(ModelConfig(**TINY), init_seed=1)
    ops = vexact_kernels.get_ops("exact")
    sequences = [[3, 4, 5, 6, 7], [8, 9]]
    rows = [(0, 1), (0, 4), (1, 0), (1, 1)]
    store = capture(model, ops, "train", sequences, [5, 2], rows)
    with torch.no_grad():
        hidden = model(torch.tensor([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0]]), ops=ops)
        logits = model.logits(hidden, ops=ops)
    index = torch.tensor(rows)
    assert torch.equal(store["final_norm"], hidden[index[:, 0], index[:, 1]])
    assert torch.equal(store["logits"], logits[index[:, 0], index[:, 1]])
    assert torch.equal(store["embed"], model.embed_tokens.weight[[4, 7, 8, 9]])


def _first_difference_by_hand(model: Transformer, tokens: torch.Tensor) -> tuple[str, int, int, int, float, float]:
    """Layer 0 run with native and with exact ops side by side, each path on its own previous outputs (as two
    separate forwards would): the first op whose outputs differ bitwise, its first differing (sequence, position,
    feature) and both values."""
    c, layer = model.config, model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    batch, length = tokens.shape
    cos, sin = model.rope_cos[:length].expand(batch, -1, -1), model.rope_sin[:length].expand(batch, -1, -1)
    q_start = torch.zeros(batch, dtype=torch.long)
    x = model.embed_tokens(tokens)
    steps = [
        ("input_norm", lambda o, s: o.rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)),
        ("q_proj", lambda o, s: o.linear(s["input_norm"], attn.q_proj.weight).view(batch, length, 4, -1)),
        ("k_proj", lambda o, s: o.linear(s["input_norm"], attn.k_proj.weight).view(batch, length, 2, -1)),
        ("v_proj", lambda o, s: o.linear(s["input_norm"], attn.v_proj.weight).view(batch, length, 2, -1)),
        ("q_rope", lambda o, s: o.rope(s["q_proj"], cos, sin)),
        ("k_rope", lambda o, s: o.rope(s["k_proj"], cos, sin)),
        ("attention", lambda o, s: o.attention(s["q_rope"], s["k_rope"], s["v_proj"], q_start, c.head_dim ** -0.5)),
        ("o_proj", lambda o, s: o.linear(s["attention"].reshape(batch, length, -1), attn.o_proj.weight)),
        ("resid_attn", lambda o, s: x + s["o_proj"]),
        ("post_norm", lambda o, s: o.rms_norm(s["resid_attn"], layer.post_attention_layernorm.weight, c.rms_norm_eps)),
        ("gate_proj", lambda o, s: o.linear(s["post_norm"], mlp.gate_proj.weight)),
    ]
    native, exact = {}, {}
    with torch.no_grad():
        for name, step in steps:
            native[name], exact[name] = step(vexact_kernels.native, native), step(vexact_kernels.cpu_exact, exact)
            a, b = native[name].reshape(batch, length, -1), exact[name].reshape(batch, length, -1)
            differs = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
            if len(differs):
                seq, pos, feature = map(int, differs[0])
                return f"layer 0 / {name}", seq, pos, feature, float(a[seq, pos, feature]), float(b[seq, pos, feature])
    raise AssertionError("native and exact agree on layer 0's first ops: pick other tokens")


# On the development host the first differing op is the input norm for the first prompts and attention for the
# second (native and exact agree bitwise on the norm and the projections there); the hand-run lockstep decides.
@pytest.mark.parametrize("prompts", [EQUAL_LENGTH_PROMPTS, [[56, 63, 70, 29], [44, 29, 86, 28]]])
def test_native_vs_exact_diverges_at_the_first_op_that_really_differs(prompts):
    s = _locate("native:fp32:train", "exact:fp32:train", prompt_tokens=prompts, max_new_tokens=0)
    first = s["first_divergence"]
    assert s["diverged"] and first is not None
    model = Transformer(ModelConfig(**{**SHAPE, "max_seq_len": len(prompts[0])}), init_seed=0)
    op, seq, pos, feature, a, b = _first_difference_by_hand(model, torch.tensor(prompts))
    assert (first["op"], first["sequence"], first["position"], first["feature"]) == (op, seq, pos, feature)
    assert (first["a"], first["b"]) == (a, b) and a != b
    assert first["a_bits"] == "0x" + struct.pack(">f", a).hex() and first["b_bits"] == "0x" + struct.pack(">f", b).hex()
    names = [row["name"] for row in s["ops"]]
    assert all(row["bitwise_equal"] for row in s["ops"][: names.index(op)])
    assert not s["ops"][names.index(op)]["bitwise_equal"]


def test_fp32_vs_bf16_diverges_at_the_embedding_with_its_values_and_bits():
    s = _locate("exact:fp32:train", "exact:bf16:train", prompt_tokens=EQUAL_LENGTH_PROMPTS, max_new_tokens=0)
    first = s["first_divergence"]
    assert first["op"] == "embed" and first["index"] == 0
    weight = Transformer(ModelConfig(**{**SHAPE, "max_seq_len": 12}), init_seed=0).embed_tokens.weight.detach()
    # The first embedding value whose bf16 rounding changes it: token 5 (sequence 0, position 0), some feature.
    row = weight[5]
    feature = int((row.to(torch.bfloat16).float() != row).nonzero()[0])
    value = float(row[feature])
    rounded = float(row[feature].to(torch.bfloat16))
    assert (first["sequence"], first["position"], first["feature"]) == (0, 0, feature)
    assert (first["a"], first["b"]) == (value, rounded)
    assert first["a_bits"] == "0x" + struct.pack(">f", value).hex()
    assert first["b_bits"] == "0x" + struct.pack(">f", rounded).hex()[:4]  # bf16 = the top half of its fp32 bits
    assert all(not row["bitwise_equal"] for row in s["ops"])  # nothing re-converges in bf16


def test_recorded_ops_follow_a_qk_norm_qkv_bias_model():
    shape = {**SHAPE, "qk_norm": True, "qkv_bias": True}
    s = run_locate(LocateSettings(random_model=shape, random_prompts=2, max_new_tokens=3)).summary
    layer = ["input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "q_rope", "k_rope", "attention",
             "o_proj", "resid_attn", "post_norm", "gate_proj", "up_proj", "silu_mul", "down_proj", "resid_mlp"]
    expected = ["embed"] + [f"layer {i} / {name}" for i in range(2) for name in layer] + ["final_norm", "logits"]
    assert [row["name"] for row in s["ops"]] == expected
    features = {row["name"]: row["features"] for row in s["ops"]}
    assert features["layer 1 / q_norm"] == 64 and features["layer 1 / k_norm"] == 32 and features["logits"] == 97
    assert [row["group"] for row in s["layers"]] == ["embed", "layer 0", "layer 1", "head"]
    assert not s["diverged"]


@pytest.mark.parametrize("plan_config, model_config, message", [
    ({"qk_norm": True}, {}, "called rope where op_plan expects rms_norm for 'layer 0 / q_norm'"),
    ({}, {"qk_norm": True}, "called rms_norm where op_plan expects rope for 'layer 0 / q_rope'"),
    ({"intermediate_size": 96}, {}, "'layer 0 / gate_proj' (slot 11) has shape (1, 3, 160)"),
    ({"num_layers": 1}, {}, "'logits' (slot 17) has shape (1, 3, 64)"),  # layer 1's q_proj, taken for the head
])
def test_a_forward_the_plan_does_not_describe_fails_loudly(plan_config, model_config, message):
    model = Transformer(ModelConfig(**{**TINY, **model_config}), init_seed=0)
    recorder = OpRecorder(vexact_kernels.get_ops("exact"), op_plan(ModelConfig(**{**TINY, **plan_config})), 3)
    recorder.begin(1, 3, torch.zeros(3, dtype=torch.long), torch.arange(3), torch.arange(3))
    with pytest.raises(OpStructureError, match="the plan was traced from") as err, torch.no_grad():
        model.logits(model(torch.tensor([[1, 2, 3]]), ops=recorder), ops=recorder)
        recorder.finish()
    assert message in str(err.value)


SUMMARY_KEYS = {"a", "b", "model", "config", "tokens", "prompt_lengths", "prefill", "positions", "max_new_tokens",
                "temperature", "seed", "threads", "diverged", "first_divergence", "ops", "layers", "seconds",
                "compared_by", "sites_only_in_a", "sites_only_in_b", "weights"}
WEIGHTS_KEYS = {"same", "dtype", "a", "b", "note"}
OP_KEYS = {"index", "name", "group", "kernel_op", "recorded", "features", "elements", "elements_differing",
           "positions_differing", "bitwise_equal", "abs_diff_max", "abs_diff_mean", "rel_diff_max", "max_at"}
FIRST_KEYS = {"op", "index", "group", "sequence", "position", "feature", "feature_index", "a", "b", "a_bits",
              "b_bits", "abs_diff", "elements_differing", "positions_differing", "by"}
LAYER_KEYS = {"group", "ops", "ops_differing", "abs_diff_max", "output", "output_abs_diff_max",
              "output_abs_diff_mean"}


def test_cli_json_png_and_exit_codes(tmp_path, capsys):
    out_json, out_png = tmp_path / "l.json", tmp_path / "l.png"
    argv = ["locate", *SIZE_ARGS, "--random-prompts", "2", "--max-new-tokens", "3", "--fail-on-divergence"]
    assert main([*argv, "--json", str(out_json), "--png", str(out_png)]) == 0
    assert "no divergence: all 33 compared sites bitwise equal" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert set(report) == SUMMARY_KEYS and report["first_divergence"] is None
    assert set(report["weights"]) == WEIGHTS_KEYS and report["weights"]["same"] is True  # one model, both paths
    assert all(set(row) == OP_KEYS for row in report["ops"]) and all(set(r) == LAYER_KEYS for r in report["layers"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main([*argv, "--a", "native:fp32", "--b", "exact:fp32", "--positions", "2-4,9-", "--json",
                 str(out_json)]) == 1
    captured = capsys.readouterr()
    assert "first divergence: layer 0 /" in captured.out and "diverged: first at layer 0 /" in captured.err
    report = json.loads(out_json.read_text())
    assert report["a"] == "native:fp32:rollout" and report["b"] == "exact:fp32:train"
    assert set(report["first_divergence"]) == FIRST_KEYS
    assert report["positions"] == sum(len([p for p in range(len(t)) if 2 <= p <= 4 or p >= 9])
                                      for t in report["tokens"])
    assert main([*argv[:-1], "--a", "native:fp32", "--b", "exact:fp32"]) == 0  # without the gate: a report


def test_run_flags_left_out_take_their_documented_defaults(tmp_path):
    """--max-prompt-len, --max-new-tokens, --temperature, --seed and --device are None until the paths run (so that
    where a dump brings the sequences a value given is refused, not ignored); left out, the run is the one their
    documented defaults (RUN_DEFAULTS, which --help prints) give by hand: the same tokens and the same bits."""
    out, by_hand = tmp_path / "default.json", tmp_path / "by_hand.json"
    argv = ["locate", *SIZE_ARGS, "--random-prompts", "2", "--a", "native:fp32", "--b", "exact:fp32"]
    assert main([*argv, "--json", str(out)]) == 0
    given = [arg for key, value in RUN_DEFAULTS.items() for arg in ("--" + key.replace("_", "-"), str(value))]
    assert main([*argv, *given, "--json", str(by_hand)]) == 0
    report, expected = json.loads(out.read_text()), json.loads(by_hand.read_text())
    report.pop("seconds"), expected.pop("seconds")
    assert report == expected and report["diverged"]  # every |Δ| too: the same bits on both runs
    assert {key: report[key] for key in ("max_new_tokens", "temperature", "seed")} == {
        "max_new_tokens": 8, "temperature": 1.0, "seed": 0}  # as the docs say
    assert max(map(len, report["tokens"])) <= 16 + 8  # --max-prompt-len 16


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Tiny Qwen3 (q/k norms, head_dim != hidden / heads) without a tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3, tokenizer=False)


def test_a_from_pretrained_checkpoint(qwen3_dir, tmp_path, capsys):
    out = tmp_path / "l.json"
    argv = ["locate", "--model", str(qwen3_dir), "--prompt-tokens", "5 6 7 8", "--prompt-tokens", "40,41",
            "--max-new-tokens", "4", "--fail-on-divergence", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(qwen3_dir) and report["config"]["qk_norm"] and report["config"]["head_dim"] == 32
    assert report["positions"] == 4 + 2 + 2 * 4 and not report["diverged"]
    assert "layer 1 / k_norm" in [row["name"] for row in report["ops"]]
    assert main([*argv, "--a", "native:fp32", "--b", "exact:bf16"]) == 1
    assert json.loads(out.read_text())["first_divergence"]["op"] == "embed"
    capsys.readouterr()


@pytest.mark.parametrize("args, message", [
    (["--a", "native:fp64"], "--a: bad path 'native:fp64': expected BACKEND:DTYPE[:KIND]"),
    (["--b", "exact:fp32:decode"], "--b: bad path 'exact:fp32:decode'"),
    (["--model", "MISSING"], "--model: checkpoint directory not found"),
    (["--model", "MISSING", "--hidden-size", "32"], "--hidden-size: size flags describe the random model"),
    (["--positions", "5-2"], "--positions: expected a comma list"),
    (["--positions", "500-"], "--positions 500- selects no position"),
    (["--prompt-tokens", "1 x"], "--prompt-tokens: expected whitespace- or comma-separated token ids"),
    (["--prompt-tokens", "1 97"], "--prompt-tokens[0] has token id 97 outside the vocabulary [0, 97)"),
    (["--hidden-size", "60"], "hidden_size / num_heads = 15 is the head dim and must be even"),
])
def test_bad_input_is_one_error_line(args, message, tmp_path, capsys):
    args = [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    sizes = [] if "--model" in args or "--hidden-size" in args else SIZE_ARGS
    assert main(["locate", *sizes, *args, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_the_op_plan_is_derived_from_the_forward(monkeypatch):
    """op_plan traces the forward, so a change to the forward changes the plan (no mirror to keep in step): here
    the head gains a second norm, and the plan gains its slot in the same place."""
    config = ModelConfig(**{**TINY, "qk_norm": True})
    plan = op_plan(config)
    names = [slot.name for slot in plan]
    assert names[:2] == ["embed", "layer 0 / input_norm"] and names[-3:] == ["layer 1 / resid_mlp", "final_norm",
                                                                          "logits"]
    by_name = {slot.name: slot for slot in plan}
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    assert by_name["layer 0 / q_proj"].feature_shape == (heads, head_dim)  # reported per head, as attention reads it
    assert by_name["layer 0 / k_norm"].feature_shape == (kv_heads, head_dim)
    assert by_name["layer 1 / resid_attn"].recorded == "input" and by_name["layer 1 / resid_attn"].group == "layer 1"
    real_logits = Transformer.logits

    def logits_with_an_extra_norm(self, hidden, ops=None):
        ops = self.ops if ops is None else ops
        return real_logits(self, ops.rms_norm(hidden, self.norm.weight, self.config.rms_norm_eps), ops=ops)

    monkeypatch.setattr(Transformer, "logits", logits_with_an_extra_norm)
    changed = [slot.name for slot in op_plan(config)]
    assert changed == names[:-1] + ["final_norm", "logits"]
