"""Hostile or broken checkpoints: every problem is one ValueError naming the file (and tensor or config key),
raised before anything is allocated for weights that do not match -- never a traceback, never torch's or
safetensors' own message, and a hostile pickle never runs.

Every checkpoint is a tiny random-init one (``make_tiny_checkpoint``, 88k parameters) that the test then breaks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import zipfile
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file

from vexact import Transformer, from_pretrained
from vexact.cli import main
from vexact.real import hf_checkpoint, hf_config, pretrained
from vexact.real.hf_checkpoint import read_checkpoint_config
from vexact.real.hf_config import model_config_from_hf
from vexact.real.locate import LocateSettings, run_locate
from vexact.real.measure import MeasureSettings, run_measure
from vexact.real.pretrained import load_tokenizer
from vexact.real.tiny import TINY_VARIANTS, make_tiny_checkpoint, make_tiny_hf_model
from vexact.records import runlog
from vexact.records.runlog import load_tensor_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

EMBED = "model.embed_tokens.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama with an untied head and no tokenizer (token-id prompts)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src"), "llama", seed=4, tokenizer=False, tie=False)


@pytest.fixture
def ckpt(source, tmp_path):
    """A fresh copy of ``source`` for the test to break."""
    return shutil.copytree(source, tmp_path / "ckpt")


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _as_bin(directory, tensors):
    """Replace the safetensors weights with a pytorch_model.bin holding ``tensors``."""
    (directory / "model.safetensors").unlink()
    torch.save(tensors, directory / "pytorch_model.bin")
    return directory / "pytorch_model.bin"


def _cli(capsys, directory, *args) -> tuple[int, str]:
    code = main(["measure", "--model", str(directory), "--random-prompts", "2", "--max-new-tokens", "2", *args])
    return code, " ".join(capsys.readouterr().err.split())  # rich wraps long lines


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fail the test if a Transformer is constructed (i.e. parameters allocated)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Transformer was built for a checkpoint that should have been refused")

    monkeypatch.setattr(pretrained, "Transformer", refuse)


# --------------------------------------------------------------------------- 1. hostile pickles
class _Payload:
    """Unpickling this runs ``touch MARKER`` -- unless the unpickler refuses it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hostile_pickle_is_refused_and_never_runs(ckpt, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    bin_path = _as_bin(ckpt, _source_tensors(ckpt) | {"evil": _Payload(marker)})
    message = _error(from_pretrained, ckpt)
    assert message == (f"refusing to unpickle {bin_path}: not a plain tensor file (it names "
                       f"{os.system.__module__}.system)")
    assert "weights_only=False" not in message and "unsafe" not in message.lower()
    # measure refuses it too, also when both paths are transformers' own (its loader never sees the file)
    for paths in (["--rollout", "exact:fp32", "--train", "exact:fp32"], ["--rollout", "hf:fp32", "--train", "hf:fp32"]):
        code, err = _cli(capsys, ckpt, *paths)
        assert code == 2 and "refusing to unpickle" in err and "not a plain tensor file" in err
        assert "weights_only" not in err and "Traceback" not in err
    assert not marker.exists()


def test_tensor_file_errors_name_what_is_wrong(tmp_path):
    """A truncated file, bytes that are no pickle and a long torch message each get their own reason, whole words."""
    path = tmp_path / "t.pt"
    torch.save({"w": torch.zeros(4)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:40])  # the legacy format cut short: torch raises a bare EOFError
    assert _error(load_tensor_file, path) == (f"{path}: not a readable torch tensor file (it ends early: empty or "
                                              "truncated)")
    path.write_bytes(b"")
    assert _error(load_tensor_file, path).endswith("(it ends early: empty or truncated)")
    path.write_bytes(b"hello, not a pickle\n")  # torch's legacy reader meets this with a bare KeyError('101')
    assert _error(load_tensor_file, path) == (f"{path}: cannot be read as a plain tensor file (damaged, or not saved "
                                              "by torch.save of tensors)")
    assert runlog._gist(RuntimeError("a " + "wordy " * 40 + "end. Advice follows.")) == "a " + "wordy " * 26 + "..."
    assert runlog._gist(RuntimeError("zip failed: no directory. This is an internal error.")) == (
        "zip failed: no directory")


def _source_tensors(directory):
    return load_file(directory / "model.safetensors")


def test_bin_files_that_are_not_named_tensors(ckpt):
    tensors = _source_tensors(ckpt)
    bin_path = _as_bin(ckpt, tensors)
    assert torch.equal(from_pretrained(ckpt).embed_tokens.weight, tensors[EMBED])  # a plain .bin still loads
    torch.save(list(tensors.values()), bin_path)
    assert _error(from_pretrained, ckpt) == f"{bin_path}: expected a dict of tensor names to tensors, got a list"
    torch.save(tensors | {"step": 3}, bin_path)
    assert _error(from_pretrained, ckpt) == f"{bin_path}: entry 'step' is a int, not a named tensor"
    torch.save(tensors | {EMBED: torch.empty(tensors[EMBED].shape, device="meta")}, bin_path)  # was Tensor.item()
    assert _error(from_pretrained, ckpt) == (f"{bin_path}: tensor {EMBED!r} is on the meta device, with a shape but "
                                             "no values (saved from a model not yet materialised); vexact loads "
                                             "weights with values")
    torch.save(tensors, bin_path)
    bin_path.write_bytes(bin_path.read_bytes()[: bin_path.stat().st_size // 2])
    # torch's first sentence, whole; its advice after it (and a cut mid-word at 120 characters) left out
    assert _error(from_pretrained, ckpt) == (f"{bin_path}: not a readable torch tensor file (PytorchStreamReader "
                                             "failed reading zip archive: failed finding central directory)")


# --------------------------------------------------------------------------- 2. non-finite weights and activations
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_at_load(ckpt, fmt, value, capsys):
    tensors = _source_tensors(ckpt)
    tensors[DOWN][3, 5] = value
    if fmt == "bin":
        path = _as_bin(ckpt, tensors)
    else:
        path = ckpt / "model.safetensors"
        save_file(tensors, path)
    message = _error(from_pretrained, ckpt)
    counts = "1 NaN, 0 Inf" if value != value else "0 NaN, 1 Inf"
    assert message == (f"{path}: tensor {DOWN!r} has non-finite weights ({counts} of 9,216 values); refusing to "
                       "load a checkpoint that is not finite")
    code, err = _cli(capsys, ckpt, "--rollout", "hf:fp32", "--train", "exact:fp32")
    assert code == 2 and "has non-finite weights" in err


def test_weights_that_overflow_the_cast_are_refused(ckpt):
    tensors = _source_tensors(ckpt)
    tensors["lm_head.weight"][0, 0] = torch.finfo(torch.float32).max  # finite in fp32, inf in bf16
    save_file(tensors, ckpt / "model.safetensors")
    from_pretrained(ckpt, dtype=torch.float32)  # fine in fp32
    message = _error(from_pretrained, ckpt, dtype=torch.bfloat16)
    assert message == (f"{ckpt / 'model.safetensors'}: tensor 'lm_head.weight' is finite but overflows bf16 "
                       "(max |value| 3.4e+38); load it in float32")
    # transformers' own bf16 load of it (the hf path) is refused the same way
    settings = MeasureSettings(model=ckpt, rollout="hf:bf16", train="hf:fp32", random_prompts=2, max_new_tokens=2)
    assert _error(run_measure, settings) == (f"hf:bf16 path: tensor 'lm_head.weight' of {ckpt} overflows bf16 as "
                                             "transformers loaded it")


@pytest.mark.parametrize("rollout", ["native:bf16", "exact:fp32", "hf:bf16"])
def test_measure_refuses_non_finite_log_probs(ckpt, rollout):
    """Finite weights whose logits overflow: every path gives NaN; measure names the path, no table of NaN."""
    tensors = _source_tensors(ckpt)
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], 1e38)
    save_file(tensors, ckpt / "model.safetensors")
    settings = MeasureSettings(model=ckpt, rollout=rollout, train="exact:fp32", random_prompts=2, max_new_tokens=3)
    message = _error(run_measure, settings)
    what = "logits" if rollout.startswith("hf") else "log-probs"
    assert message.startswith(f"rollout path {rollout} produced non-finite {what}")


# --------------------------------------------------------------------------- 3. absurd sizes
@pytest.mark.parametrize("key,value,tensor,shapes", [
    ("vocab_size", 10**12, EMBED, "has shape (128, 64), the config implies (1000000000000, 64) = "
                                  "(vocab_size, hidden_size)"),
    ("hidden_size", 1 << 40, EMBED, "has shape (128, 64), the config implies (128, 1099511627776) = "
                                    "(vocab_size, hidden_size)"),
    ("intermediate_size", 100, "model.layers.0.mlp.gate_proj.weight",
     "has shape (144, 64), the config implies (100, 64) = (intermediate_size, hidden_size)"),
])
def test_config_sizes_are_checked_against_the_safetensors_header(ckpt, nothing_is_built, key, value, tensor, shapes):
    _config(ckpt, **{key: value})
    message = _error(from_pretrained, ckpt)
    assert message == (f"{ckpt / 'config.json'}: {key}={value} disagrees with the weights: tensor {tensor!r} in "
                       f"{ckpt / 'model.safetensors'} {shapes}")


def test_absurd_layer_count_and_context_length(ckpt, nothing_is_built, monkeypatch):
    _config(ckpt, num_hidden_layers=10**9)
    assert _error(from_pretrained, ckpt) == (f"{ckpt / 'config.json'}: num_hidden_layers=1000000000 disagrees with "
                                             f"the weights: checkpoint {ckpt} holds tensors of layers 0..1")
    _config(ckpt, num_hidden_layers=2, max_position_embeddings=10**12)
    assert "would make vexact's RoPE table 1,000,000,000,000 positions" in _error(from_pretrained, ckpt)
    monkeypatch.undo()  # build it now: with max_seq_len the table is small and the checkpoint loads
    assert from_pretrained(ckpt, max_seq_len=64).config.max_seq_len == 64
    # measure only needs the longest measured sequence
    s = run_measure(MeasureSettings(model=ckpt, rollout="exact:fp32", train="exact:fp32", random_prompts=2,
                                    max_new_tokens=3, ignore_eos=True)).summary
    assert s["tokens"] == 6 and s["bitwise_equal"] == 6


def test_bin_checkpoints_are_bounded_by_their_size_before_unpickling(ckpt, monkeypatch):
    bin_path = _as_bin(ckpt, _source_tensors(ckpt))

    def refuse(path):
        raise AssertionError(f"{path} was unpickled")

    monkeypatch.setattr(hf_checkpoint, "load_tensor_file", refuse)
    _config(ckpt, vocab_size=10**12)
    message = _error(from_pretrained, ckpt)
    assert message.startswith(f"{ckpt / 'config.json'} implies 128,000,000,080,192 parameters (vocab_size="
                              "1000000000000, hidden_size=64, intermediate_size=144, num_hidden_layers=2,")
    with zipfile.ZipFile(bin_path) as archive:
        data = sum(info.file_size for info in archive.infolist())
    assert message.endswith(f"but the weight file(s) hold only {data:,} bytes of data: the config does not describe "
                            "these weights")
    # a zip whose records unpack to far more than the config's parameters (a zip bomb)
    _config(ckpt, vocab_size=128)
    with zipfile.ZipFile(bin_path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data/999", bytes(32 << 20))
    assert bin_path.stat().st_size < 1 << 20
    assert "records unpack to 33," in _error(from_pretrained, ckpt)


def test_bin_shape_mismatch_is_found_before_building(ckpt, nothing_is_built):
    _as_bin(ckpt, _source_tensors(ckpt))
    _config(ckpt, intermediate_size=100)
    assert _error(from_pretrained, ckpt) == (
        f"{ckpt / 'config.json'}: intermediate_size=100 disagrees with the weights: tensor "
        f"'model.layers.0.mlp.gate_proj.weight' in {ckpt / 'pytorch_model.bin'} has shape (144, 64), the config "
        "implies (100, 64) = (intermediate_size, hidden_size)")


# --------------------------------------------------------------------------- 4. corrupt files
def test_corrupt_and_truncated_safetensors(ckpt, nothing_is_built):
    path = ckpt / "model.safetensors"
    good = path.read_bytes()
    prefix = f"{path}: corrupt or truncated safetensors file"
    cases = {
        good[:-100]: "needs bytes up to",
        good[:5]: "(5 bytes, shorter than the 8-byte header length)",
        b"\x00" * 64: "(its header is not valid JSON)",
        struct.pack("<Q", 1 << 40) + good[8:]: "its header claims 1,099,511,627,776 bytes",
        good + b"junk": "(4 bytes after the last tensor)",
        os.urandom(4096): "",
    }
    for content, detail in cases.items():
        path.write_bytes(content)
        message = _error(from_pretrained, ckpt)
        assert message.startswith(prefix) and detail in message, message
    # a header entry whose byte span disagrees with its dtype and shape
    header_len = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8 : 8 + header_len])
    header[EMBED]["shape"] = [64, 64]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + good[8 + header_len :])
    assert _error(from_pretrained, ckpt) == (f"{prefix} (tensor {EMBED!r} of shape (64, 64) and dtype F32 needs "
                                             "16,384 bytes, its data_offsets span 32,768)")


def test_corrupt_sharded_checkpoints(source, tmp_path):
    sharded = tmp_path / "sharded"
    make_tiny_hf_model("llama", seed=4, tie=False).save_pretrained(sharded, max_shard_size="100KB")
    index = sharded / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    expected = from_pretrained(source).state_dict()
    assert all(torch.equal(from_pretrained(sharded).state_dict()[k], v) for k, v in expected.items())

    def broken(content, message):
        index.write_text(content if isinstance(content, str) else json.dumps(content))
        assert _error(from_pretrained, sharded) == message.format(index=index, dir=sharded)

    broken("{oops", "{index} is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
                    "(char 1)")
    broken({"metadata": {}}, "{index}: malformed index: expected a JSON object with a non-empty \"weight_map\" of "
                             "tensor names to shard files")
    broken({"weight_map": weight_map | {EMBED: "../src/model.safetensors"}},
           f"{{index}}: malformed index: tensor {EMBED!r} maps to '../src/model.safetensors', not a file name in the "
           "checkpoint directory")
    broken({"weight_map": weight_map | {EMBED: "pytorch_model.bin"}},
           "{index}: malformed index: shard 'pytorch_model.bin' is not a .safetensors file")
    broken({"weight_map": weight_map | {EMBED: "model-00009-of-00009.safetensors"}},
           "{index} lists shard files that do not exist: model-00009-of-00009.safetensors")
    wrong_shard = next(s for s in shards if s != weight_map[EMBED])
    broken({"weight_map": weight_map | {EMBED: wrong_shard}},
           f"{{index}}: lists tensor {EMBED!r} in {wrong_shard}, but {{dir}}/{wrong_shard} does not hold it")
    # the same tensor in two shards
    index.write_text(json.dumps({"weight_map": weight_map}))
    other = sharded / wrong_shard
    save_file(load_file(other) | {EMBED: load_file(sharded / weight_map[EMBED])[EMBED]}, other)
    first, second = sorted([sharded / weight_map[EMBED], other])
    assert _error(from_pretrained, sharded) == f"tensor {EMBED!r} is stored twice: in {first} and in {second}"


@pytest.mark.parametrize("content,message", [
    (b"{not json", "is not valid JSON: Expecting property name enclosed in double quotes"),
    (b"\xff\xfe{}", "is not valid JSON: not UTF-8 text"),
    (b"[" * 100_000, "is not valid JSON: nested too deeply"),
    (b"[1, 2]", ": expected a JSON object (a Hugging Face config), got list"),
], ids=["not-json", "not-utf8", "nested", "list"])
def test_config_that_is_not_a_json_object(ckpt, content, message):
    (ckpt / "config.json").write_bytes(content)
    assert _error(from_pretrained, ckpt).startswith(f"{ckpt / 'config.json'}{' ' if message[0] != ':' else ''}"
                                                    f"{message}")


@pytest.mark.parametrize("changes,message", [
    ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"num_hidden_layers": -2}, "num_hidden_layers must be a positive integer, got -2"),
    ({"intermediate_size": 14.5}, "intermediate_size must be a positive integer, got 14.5"),
    ({"max_position_embeddings": [128]}, "max_position_embeddings must be a positive integer, got [128]"),
    ({"num_key_value_heads": 3}, "num_heads (4) must be divisible by num_kv_heads (3) (config key "
                                 "'num_attention_heads')"),
    ({"head_dim": 15}, "head_dim must be a positive even integer, got 15 (config key 'head_dim')"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),  # not "absent" (null is)
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),  # was read as absent: hidden_size / heads
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite positive number, got nan"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_theta must be a finite positive number, got inf"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10**400}},
     "rope_theta must be a finite positive number, got 1000"),
    ({"rope_parameters": "default"}, "rope_parameters / rope_scaling must be a JSON object, got 'default'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false, got 0"),
    ({"mlp_bias": "false"}, "mlp_bias must be true or false, got 'false'"),  # was "mlp_bias is True"
    ({"attention_bias": "false"}, "attention_bias must be true or false, got 'false'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 64}},
     "llama3 RoPE scaling needs high_freq_factor != low_freq_factor, got both 1.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": "big", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}, "factor must be a finite positive number"),
])
def test_config_values_of_the_wrong_type_or_range(ckpt, changes, message):
    _config(ckpt, **changes)
    assert _error(from_pretrained, ckpt).startswith(f"{ckpt / 'config.json'}: {message}")


ODD_VALUES = (None, 0, -1, 1, 2, 3, 7, 1.5, 0.0, 1e30, float("nan"), "x", "", True, False, [], [1], {}, {"a": 1}, 2**40)
"""What a mutated config.json key may hold: JSON's every type, zero, negatives, integral and huge floats."""


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_mutated_configs_are_a_model_config_or_one_value_error(variant):
    """A seeded fuzz over what the table above names one key at a time: each supported architecture's config with
    one or two keys (or a key of a nested section) set to one of ``ODD_VALUES`` or removed, 60 times. Each is one
    ValueError of one line -- never another exception from inside -- or a ``ModelConfig`` holding every size the
    file gave as the file gave it (a value read as absent, as ``head_dim`` and ``num_key_value_heads`` of 0 were,
    fails here)."""
    arch, settings = TINY_VARIANTS[variant]
    base = make_tiny_hf_model(arch, **settings).config.to_dict()
    rng = random.Random(variant)
    for _ in range(60):
        config = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 2)):
            key = rng.choice(sorted(config))
            if rng.random() < 0.2:
                del config[key]
            elif isinstance(config[key], dict) and config[key] and rng.random() < 0.6:
                config[key][rng.choice(sorted(config[key]))] = rng.choice(ODD_VALUES)
            else:
                config[key] = rng.choice(ODD_VALUES)
        try:
            accepted = model_config_from_hf(config)
        except ValueError as refused:
            assert "\n" not in str(refused), config
            continue
        for field, key in hf_config._HF_KEYS.items():
            given = config.get(key)
            if given is not None and key in base:
                assert getattr(accepted, field) == (tuple(given) if isinstance(given, list) else given), (key, config)


def test_rope_scaling_that_disagrees_with_rope_parameters_is_refused(ckpt):
    """Model cards tell users to add a rope_scaling (yarn) to config.json; a transformers-5 config already has
    rope_parameters, which vexact read alone: plain RoPE where transformers scales. Both saying the same loads."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    _config(ckpt, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_scaling={"type": "yarn", "factor": 4.0})
    assert _error(from_pretrained, ckpt) == (
        f"{ckpt / 'config.json'}: rope_scaling {{'type': 'yarn', 'factor': 4.0}} and rope_parameters "
        "{'rope_type': 'default', 'rope_theta': 10000.0} disagree on rope_type, factor: transformers uses "
        "rope_scaling where both are set; remove the one that is not meant")
    _config(ckpt, rope_parameters={**llama3, "rope_theta": 10000.0}, rope_scaling={**llama3, "factor": 4.0})
    assert "disagree on factor:" in _error(from_pretrained, ckpt)
    _config(ckpt, rope_parameters={**llama3, "rope_theta": 10000.0}, rope_scaling=llama3)
    assert from_pretrained(ckpt).config.rope_scaling == llama3


def test_config_lacking_a_required_key_and_odd_types_elsewhere(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    del config["intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert _error(from_pretrained, ckpt) == (f"{ckpt / 'config.json'} lacks 'intermediate_size', which vexact needs "
                                             "to build the model")
    base = make_tiny_hf_model("qwen2").config.to_dict()
    for changes in ({"model_type": ["llama"]}, {"quantization_config": "gptq"}, {"hidden_act": {"a": 1}},
                    {"use_sliding_window": True, "sliding_window": 8, "layer_types": 3},
                    {"use_sliding_window": True, "sliding_window": "8", "layer_types": None}):
        _error(model_config_from_hf, base | changes)  # a ValueError, not a TypeError/AttributeError


def test_broken_tokenizer_is_one_error(ckpt):
    (ckpt / "tokenizer.json").write_text("{ this is not a tokenizer")
    assert _error(load_tokenizer, ckpt).startswith(f"{ckpt}: cannot load its tokenizer (")


# --------------------------------------------------------------------------- 5. dtypes, shapes, duplicates, extras
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_integer_weights_are_refused(ckpt, fmt, nothing_is_built):
    tensors = _source_tensors(ckpt)
    tensors[DOWN] = tensors[DOWN].to(torch.int32)
    path = _as_bin(ckpt, tensors) if fmt == "bin" else ckpt / "model.safetensors"
    if fmt == "safetensors":
        save_file(tensors, path)
    assert _error(from_pretrained, ckpt) == (f"checkpoint {ckpt}: tensor {DOWN!r} in {path} has dtype I32; vexact "
                                             "loads floating-point weights (F32, BF16, F16, F64), not integer, "
                                             "boolean or 8-bit (quantised) tensors")


def test_one_tensor_of_the_wrong_shape_names_it_and_both_shapes(ckpt, nothing_is_built):
    tensors = _source_tensors(ckpt)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:16].clone()
    save_file(tensors, ckpt / "model.safetensors")
    assert _error(from_pretrained, ckpt) == (
        f"{ckpt / 'config.json'}: num_key_value_heads=2, head_dim=16 disagree with the weights: tensor {name!r} in "
        f"{ckpt / 'model.safetensors'} has shape (16, 64), the config implies (32, 64) = "
        "(num_key_value_heads x head_dim, hidden_size)")


def test_extra_and_doubly_named_tensors(ckpt, source):
    tensors = _source_tensors(ckpt)
    save_file(tensors | {"model.layers.0.mlp.extra": torch.zeros(2)}, ckpt / "model.safetensors")
    assert _error(from_pretrained, ckpt) == (f"checkpoint {ckpt} does not match its config: unexpected 1 tensor(s): "
                                             "layers.0.mlp.extra")
    save_file(tensors | {"norm.weight": tensors["model.norm.weight"].clone()}, ckpt / "model.safetensors")
    assert _error(from_pretrained, ckpt) == (f"checkpoint {ckpt}: tensors 'model.norm.weight' and 'norm.weight' are "
                                             "both 'norm.weight'")
    # what loads today still loads: RoPE inv_freq buffers are dropped
    save_file(tensors | {"model.rotary_emb.inv_freq": torch.ones(8)}, ckpt / "model.safetensors")
    assert torch.equal(from_pretrained(ckpt).lm_head.weight, from_pretrained(source).lm_head.weight)


def test_a_tied_config_with_its_own_stored_head_loads_as_transformers_loads_it(ckpt):
    """tie_word_embeddings true and a stored lm_head.weight unlike embed_tokens: transformers 5 keeps the stored head
    ("both are present ... we will NOT tie them"); vexact dropped it and tied, another model (k3 2.44 between the hf
    and exact fp32 runs of one checkpoint). A stored head equal to embed_tokens bit for bit (or one tensor under both
    names, as torch.save of a tied model stores it) is tied."""
    import transformers

    _config(ckpt, tie_word_embeddings=True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.tensor([list(range(10, 50))])
    with torch.no_grad():
        reference = hf_model(input_ids=ids).logits
    tensors = _source_tensors(ckpt)
    for model in (from_pretrained(ckpt), from_pretrained(hf_model)):
        assert not model.config.tie_embeddings and torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
        with torch.no_grad():  # fp32 parity, test_pretrained's tolerance (FP32_TOL, 5e-5)
            torch.testing.assert_close(model.logits(model(ids)), reference, rtol=0, atol=5e-5)
    save_file(tensors | {"lm_head.weight": tensors[EMBED].clone()}, ckpt / "model.safetensors")
    assert not hasattr(from_pretrained(ckpt), "lm_head")
    _as_bin(ckpt, tensors | {"lm_head.weight": tensors[EMBED]})
    assert not hasattr(from_pretrained(ckpt), "lm_head")


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_expected_shapes_are_the_transformers_parameters(variant):
    """The header check computes the parameters' shapes without building a model: they must be Transformer's."""
    arch, kwargs = TINY_VARIANTS[variant]
    config = model_config_from_hf(make_tiny_hf_model(arch, **kwargs).config.to_dict())
    model = Transformer(config, init_seed=None)
    assert {n: s for n, (s, _) in hf_checkpoint._expected_shapes(config).items()} == {
        n: tuple(p.shape) for n, p in model.named_parameters()}
    assert hf_checkpoint._param_count(config) == sum(p.numel() for p in model.parameters())
    assert hf_checkpoint._tensor_count(config) == len(hf_checkpoint._expected_shapes(config))


def test_experts_are_counted_only_in_the_layers_that_have_them(tmp_path):
    """The guard against a hostile layer index charged num_experts' tensors to every layer: a valid Qwen3-MoE with
    experts in one of 16 layers was refused ("config.json implies 3,248+ tensors, the weights hold 368")."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=16,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=64,
                                         num_experts_per_tok=2, moe_intermediate_size=8,
                                         mlp_only_layers=list(range(15)), tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    assert from_pretrained(tmp_path / "moe").config.moe_layers == (15,)
    # the guard still stops a layer index far past what the tensors can be (before anything enumerates it)
    tensors = load_file(tmp_path / "moe" / "model.safetensors")
    save_file(tensors | {"model.layers.99999.input_layernorm.weight": torch.ones(16)},
              tmp_path / "moe" / "model.safetensors")
    _config(tmp_path / "moe", num_hidden_layers=100000, mlp_only_layers=[])
    assert _error(from_pretrained, tmp_path / "moe") == (
        f"checkpoint {tmp_path / 'moe'} does not match its config: {tmp_path / 'moe' / 'config.json'} implies "
        f"{3 + 100000 * (8 + 1 + 3 * 64):,} tensors, the weights hold {len(tensors) + 1:,}")


def test_a_hub_id_is_answered_with_how_to_get_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at its import
    with pytest.raises(ValueError) as info:
        read_checkpoint_config(Path("Qwen/Qwen2.5-0.5B"))
    message = str(info.value)
    assert message.startswith("checkpoint directory not found: Qwen/Qwen2.5-0.5B")
    assert "downloads nothing at run time" in message
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B" in message
    assert "--model models/Qwen2.5-0.5B" in message and "cache" not in message
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")  # what huggingface_hub writes with a download
    with pytest.raises(ValueError, match=f"a copy is in your Hugging Face cache: --model {snapshot}"):
        read_checkpoint_config(Path("Qwen/Qwen2.5-0.5B"))
    with pytest.raises(ValueError) as info:  # an absolute path is no hub id
        read_checkpoint_config(tmp_path / "missing")
    assert str(info.value) == f"checkpoint directory not found: {tmp_path / 'missing'}"


def test_the_path_of_config_json_is_named_a_file_not_a_missing_directory(source):
    with pytest.raises(ValueError) as info:
        from_pretrained(source / "config.json")
    assert str(info.value) == (f"{source / 'config.json'} is a file, not a checkpoint directory; pass the directory "
                               f"that holds it ({source})")


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"eos_token_id": "1"}, "eos_token_id must be a non-negative integer (or a list of them), got '1'"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be a non-negative integer (or a list of them), got [1, '2']"),
    # vexact reads 128.0 as 128 (from_pretrained loads it); transformers' config check, which its tokenizer loader
    # runs, refuses it: named as config.json's field, not as the tokenizer's failure
    ({"vocab_size": 128.0}, "transformers refuses it, so its tokenizer cannot be loaded (Field 'vocab_size' expected "
                            "int, got float (value: 128.0))"),
    ({"pad_token_id": "0"}, "transformers refuses it, so its tokenizer cannot be loaded (Field 'pad_token_id' with "
                            "value '0' doesn't match any type in (<class 'int'>, <class 'NoneType'>))"),
])
def test_a_bad_config_field_is_named_as_such_where_there_is_a_tokenizer(tmp_path, changes, message):
    """transformers' tokenizer loader validates config.json too, and ran first: a bad field was reported as 'cannot
    load its tokenizer (StrictDataclassFieldValidationError ...)', by measure and by locate."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=4, tokenizer=True)
    _config(ckpt, **changes)
    assert _error(run_measure, MeasureSettings(model=ckpt, random_prompts=2, max_new_tokens=2)) == (
        f"{ckpt / 'config.json'}: {message}")
    assert _error(run_locate, LocateSettings(model=ckpt, random_prompts=2, max_new_tokens=2)) == (
        f"{ckpt / 'config.json'}: {message}")


def test_an_integral_float_vocab_size_loads_alike_everywhere(ckpt):
    """vocab_size 128.0 (integral floats are sizes to model_config_from_hf): from_pretrained loaded it, measure
    refused it ("has no integer vocab_size") by a check of its own."""
    _config(ckpt, vocab_size=128.0)
    assert from_pretrained(ckpt).config.vocab_size == 128
    s = run_measure(MeasureSettings(model=ckpt, rollout="exact:fp32", train="exact:fp32", random_prompts=2,
                                    max_new_tokens=2, ignore_eos=True)).summary
    assert s["tokens"] == 4 and s["bitwise_equal"] == 4
    assert run_locate(LocateSettings(model=ckpt, random_prompts=2, max_new_tokens=2)) is not None


def test_a_tiny_checkpoint_too_small_for_its_tokenizer_is_refused_before_anything_is_written(tmp_path):
    """make_tiny_checkpoint compared vocab_size with the tokenizer after writing the model: a half checkpoint
    (config.json and weights, no tokenizer) was left behind."""
    with pytest.raises(ValueError, match=r"^vocab_size 64 is smaller than the tokenizer \(99\)$"):
        make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=64)
    assert not (tmp_path / "small").exists()
    assert (make_tiny_checkpoint(tmp_path / "ids", "llama", vocab_size=64, tokenizer=False) / "config.json").is_file()
