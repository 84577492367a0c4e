"""Tiny checkpoints: small random-init Hugging Face models of every architecture ``vexact.real.pretrained`` loads,
a local character-level tokenizer, and how closely vexact reproduces transformers' logits on them.

Public, not test-only: ``vexact measure``'s module runs them (``python -m vexact.real.measure --parity-tiny``, and
``--make-tiny-checkpoint DIR --arch llama``, which writes a checkpoint for the README's and the tutorials'
measurements), and the testing tutorial wraps ``make_tiny_hf_model`` as a path to measure. The tests use them as
fixtures. Needs ``transformers`` (and ``tokenizers`` for ``char_tokenizer``), imported when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.inputs import padded_with_mask
from ..engine.model import Transformer
from .hf_config import SUPPORTED_ARCHITECTURES
from .pretrained import from_pretrained

__all__ = ["PARITY_PROMPTS", "TINY_VARIANTS", "char_tokenizer", "make_tiny_checkpoint", "make_tiny_hf_model",
           "parity_with_transformers"]


TINY_HEADS = 4
"""The tiny models' attention heads (2 key/value heads): a hidden size must hold them at an even head size (RoPE)."""


def _tiny_hf_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, tie: bool | None,
                    rope_scaling: bool) -> Any:
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size + 16,
                  num_hidden_layers=num_layers, num_attention_heads=TINY_HEADS, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if rope_scaling else None
        return transformers.LlamaConfig(**common, tie_word_embeddings=True if tie is None else tie,
                                        rope_parameters=rope)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=bool(tie),
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=bool(tie))
    if arch == "qwen3":  # explicit head_dim != hidden_size / heads, as in real Qwen3 models
        return transformers.Qwen3Config(**common, head_dim=2 * hidden_size // 4, tie_word_embeddings=bool(tie))
    if arch == "qwen3_moe":  # 4 experts, top-2, renormalised; the last layer a dense MLP (mlp_only_layers)
        return transformers.Qwen3MoeConfig(**common, head_dim=2 * hidden_size // 4, tie_word_embeddings=bool(tie),
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                                           norm_topk_prob=True, mlp_only_layers=[num_layers - 1])
    if arch == "qwen2_moe":  # 4 experts, top-2, weights not renormalised, a shared expert with its sigmoid gate
        return transformers.Qwen2MoeConfig(**common, tie_word_embeddings=bool(tie), num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                                           shared_expert_intermediate_size=hidden_size, norm_topk_prob=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, vocab_size: int = 128, hidden_size: int = 64,
                       num_layers: int = 2, tie: bool | None = None, rope_scaling: bool = False) -> Any:
    """A small random-init ``transformers`` causal LM of a supported architecture, in eval mode.

    Norm weights and biases are randomised too (transformers initialises them to 1 / 0), so a
    mis-mapped norm or bias cannot hide in a parity test. ``initializer_range`` 0.2 gives
    peaked next-token distributions, like a trained model's, so greedy decoding has clear winners.
    """
    import transformers

    config = _tiny_hf_config(arch, vocab_size, hidden_size, num_layers, tie, rope_scaling)
    torch.manual_seed(seed)
    model = getattr(transformers, SUPPORTED_ARCHITECTURES[arch])(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


# The tiny variants the parity tests (and ``python -m vexact.real.measure --parity-tiny``) check: every supported
# architecture, tied and untied heads, and Llama-3 RoPE scaling. Prompts are ragged, up to 40 tokens.
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {}),
    "llama3-rope-untied": ("llama", {"rope_scaling": True, "tie": False}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen3-moe": ("qwen3_moe", {}),
}
PARITY_PROMPTS: list[list[int]] = [[5, 6, 7, 8, 9], [40], list(range(10, 50)), [100, 3, 99, 4, 98, 5, 97]]


@torch.no_grad()
def parity_with_transformers(hf_model: Any, prompts: list[list[int]]) -> dict[str, float]:
    """How closely vexact reproduces transformers' logits for ``hf_model`` (an fp32 ``*ForCausalLM``) on ``prompts``.

    ``fp32_max_abs_exact`` / ``fp32_max_abs_native``: max |vexact logit - transformers logit| in fp32.
    bf16 cannot be compared directly (the two round at different places), so it is judged against
    transformers' fp32 logits: ``bf16_mean_abs_err_vexact`` vs ``bf16_mean_abs_err_transformers``
    (transformers' own bf16 error), plus ``bf16_max_abs_vs_transformers`` = max |vexact bf16 -
    transformers bf16|. ``logit_max_abs``: the size of the logits, for scale.
    """
    import copy

    ids, mask = padded_with_mask(prompts)
    valid = mask.bool()

    def hf_logits(model: Any) -> Tensor:
        return model(input_ids=ids, attention_mask=mask).logits.float()[valid]

    def vexact_logits(model: Transformer) -> Tensor:
        return model.logits(model(ids)).float()[valid]

    reference = hf_logits(hf_model)
    hf_bf16 = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16))
    ours_bf16 = vexact_logits(from_pretrained(hf_model, backend="exact", dtype=torch.bfloat16))
    out = {f"fp32_max_abs_{b}": float((vexact_logits(from_pretrained(hf_model, backend=b)) - reference).abs().max())
           for b in ("exact", "native")}
    out.update(bf16_mean_abs_err_vexact=float((ours_bf16 - reference).abs().mean()),
               bf16_mean_abs_err_transformers=float((hf_bf16 - reference).abs().mean()),
               bf16_max_abs_vs_transformers=float((ours_bf16 - hf_bf16).abs().max()),
               logit_max_abs=float(reference.abs().max()))
    return out


def char_tokenizer() -> Any:
    """A local character-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then printable ASCII and newline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_tiny_checkpoint(directory: str | Path, arch: str = "llama", seed: int = 0, tokenizer: bool = True,
                         **model_kwargs: Any) -> Path:
    """Save ``make_tiny_hf_model(arch, seed, ...)`` (and, with ``tokenizer``, ``char_tokenizer()``) in ``directory``."""
    directory = Path(directory)
    model = make_tiny_hf_model(arch, seed, **model_kwargs)
    tok = char_tokenizer() if tokenizer else None
    if tok is not None and len(tok) > model.config.vocab_size:  # checked before writing: no half checkpoint
        raise ValueError(f"vocab_size {model.config.vocab_size} is smaller than the tokenizer ({len(tok)})")
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if tok is not None:
        tok.save_pretrained(directory)
    return directory
