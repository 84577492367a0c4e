"""``vexact check``: does the exactness guarantee hold on this machine?

Builds a random model, generates from random ragged prompts in several batch arrangements,
rescores in several micro-batch arrangements, and compares every generated token's rollout
log-prob with its training log-prob -- for the exact backend and, side by side, native.
With a mixture-of-experts model (``--preset small_moe`` or ``--num-experts N``) it also compares the experts the
rollout routed every position to with the training path's own routing (``routing_flip_rate``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

import torch

from vexact_kernels import kernel_paths
from vexact_kernels.host_guard import torch_threads

from ..engine.generation import generate
from ..engine.model import ModelConfig, Transformer, resolve_dtype, short_dtype_name
from ..engine.presets import MODEL_PRESETS
from ..engine.scoring import token_logprobs, token_routing
from ..metric_keys import ABS_DLOGP_MAX, ABS_DLOGP_MEAN, BITWISE_EQUAL_FRAC, K3_KL, KL, ROUTING_FLIP_RATE
from ..progress import StepReporter
from ..rl.metrics import mismatch_summary, routing_metrics

DEFAULT_BATCH_SIZES: tuple[int | None, ...] = (None, 1, 3)
"""Generation arrangements checked by default (None: all at once): by ``vexact check`` and by
``vexact.testing.check_paths``, which uses these."""
DEFAULT_MICRO_BATCH_SIZES: tuple[int | None, ...] = (None, 1, 5)
"""Scoring arrangements checked by default, by ``vexact check`` and ``vexact.testing.check_paths``."""

CHECK_PRESET = "small"
_SHAPE = MODEL_PRESETS[CHECK_PRESET]  # the random model's default shape (max_seq_len: prompt + new tokens)


@dataclass
class CheckSettings:
    vocab_size: int = _SHAPE["vocab_size"]
    hidden_size: int = _SHAPE["hidden_size"]
    num_layers: int = _SHAPE["num_layers"]
    num_heads: int = _SHAPE["num_heads"]
    num_kv_heads: int = _SHAPE["num_kv_heads"]
    intermediate_size: int = _SHAPE["intermediate_size"]
    tie_embeddings: bool = _SHAPE.get("tie_embeddings", False)
    num_experts: int = _SHAPE.get("num_experts", 0)  # > 0: a mixture-of-experts model (preset small_moe)
    num_experts_per_tok: int = _SHAPE.get("num_experts_per_tok", 2)
    moe_intermediate_size: int | None = _SHAPE.get("moe_intermediate_size")
    # what the real-size presets (qwen3_*) set too; the defaults are ModelConfig's (the small presets' shapes)
    head_dim: int | None = None
    qk_norm: bool = False
    rope_theta: float = 10000.0
    norm_topk_prob: bool = True
    num_prompts: int = 24
    max_prompt_len: int = 40
    max_new_tokens: int = 32
    temperature: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    scoring_threads: tuple[int, ...] = ()  # thread counts the scoring runs at (empty: the generation's)
    batch_sizes: tuple[int | None, ...] = DEFAULT_BATCH_SIZES
    micro_batch_sizes: tuple[int | None, ...] = DEFAULT_MICRO_BATCH_SIZES


WIDE_HIDDEN = 512
"""``vexact check``'s second model by default (``--wide-hidden``): one layer of this hidden size (``wide_settings``).
The check's small models (hidden 128: K <= 352) run a host's GEMM at widths where its kernels may not switch:
oneDNN's bf16 GEMM on an Intel Xeon with AMX ran a call of at most 32 rows on another kernel than taller calls, which
broke exactness at hidden size 512 (95 of 1,152 tokens of this model differed before the host guard learned to see it)
and never at 128."""
WIDE_HEAD_DIM = 64
"""The wide model's head size: hidden / 64 query heads, half as many key/value heads (grouped-query attention)."""
WIDE_PROMPTS, WIDE_NEW_TOKENS = 8, 16
"""The wide model's prompts and new tokens, at most (fewer where the check's own are fewer): a decode batch of up to 8
rows against training's tiles, in a few seconds."""


def wide_settings(settings: CheckSettings, hidden: int) -> CheckSettings | None:
    """The check's second model (``WIDE_HIDDEN``): a dense one-layer model of hidden size ``hidden`` (MLP twice as
    wide) with ``settings``' vocabulary, dtype, sampling, threads and arrangements; None where ``hidden`` is 0 or the
    checked model is as wide already."""
    if hidden % (2 * WIDE_HEAD_DIM):
        raise ValueError(f"--wide-hidden {hidden}: expected a multiple of {2 * WIDE_HEAD_DIM} (heads of "
                         f"{WIDE_HEAD_DIM}, two query heads per key/value head), or 0 for no wide model")
    if hidden == 0 or settings.hidden_size >= hidden:
        return None
    return dataclasses.replace(
        settings, hidden_size=hidden, num_layers=1, num_heads=hidden // WIDE_HEAD_DIM,
        num_kv_heads=hidden // (2 * WIDE_HEAD_DIM), intermediate_size=2 * hidden, head_dim=None, qk_norm=False,
        num_experts=0, moe_intermediate_size=None, num_prompts=min(settings.num_prompts, WIDE_PROMPTS),
        max_new_tokens=min(settings.max_new_tokens, WIDE_NEW_TOKENS))


METRIC_KEYS = {"bitwise_equal_frac": BITWISE_EQUAL_FRAC, "abs_dlogp_mean": ABS_DLOGP_MEAN,
               "abs_dlogp_max": ABS_DLOGP_MAX, "kl": KL, "k3_kl": K3_KL}
"""``mismatch_summary``'s name -> the metric key (``vexact.metric_keys``) a check row's ``metrics`` uses for it."""


def mismatched(row: dict) -> int:
    """Tokens of a check row whose rollout and training log-probs differ in any bit."""
    return row["tokens"] - row["bitwise_equal"]


def check_units(settings: CheckSettings) -> int:
    """Units of work ``run_check`` reports per backend: each generation arrangement, then each rescoring (a scoring
    thread count x a rollout x a micro-batch arrangement)."""
    rescorings = max(1, len(settings.scoring_threads)) * len(settings.batch_sizes) * len(settings.micro_batch_sizes)
    return len(settings.batch_sizes) + rescorings


def run_check(settings: CheckSettings, backends: tuple[str, ...] = ("exact", "native"),
              device: torch.device | str = "cpu", progress: StepReporter | None = None) -> list[dict]:
    """One result row per backend: tokens compared / bitwise equal, max |Δlogp|, k3 KL, batch invariance,
    and ``kernel_paths``: the path each op took (for the exact CPU kernels: what the host probes found).
    ``device``: where the model runs (``"cuda"``: the exact backend is then the compiled Triton kernels);
    ``progress`` hears of each of ``check_units`` units per backend (``vexact.progress``)."""
    with torch_threads(settings.threads):  # the caller's count back after the check
        cfg = ModelConfig(vocab_size=settings.vocab_size, hidden_size=settings.hidden_size,
                          num_layers=settings.num_layers, num_heads=settings.num_heads,
                          num_kv_heads=settings.num_kv_heads, intermediate_size=settings.intermediate_size,
                          tie_embeddings=settings.tie_embeddings, num_experts=settings.num_experts,
                          num_experts_per_tok=settings.num_experts_per_tok,
                          moe_intermediate_size=settings.moe_intermediate_size, head_dim=settings.head_dim,
                          qk_norm=settings.qk_norm, rope_theta=settings.rope_theta,
                          norm_topk_prob=settings.norm_topk_prob,
                          max_seq_len=settings.max_prompt_len + settings.max_new_tokens)
        rng = random.Random(settings.seed)
        prompts = [[rng.randrange(settings.vocab_size) for _ in range(rng.randint(1, settings.max_prompt_len))]
                   for _ in range(settings.num_prompts)]
        rows = []
        for backend in backends:
            model = Transformer(cfg, backend=backend, dtype=resolve_dtype(settings.dtype), device=device,
                                init_seed=settings.seed)
            rows.append(_check_backend(model, prompts, settings, progress or _Silent()))
        return rows


class _Silent:
    """The ``StepReporter`` of a check nobody watches."""

    def running(self, text: str) -> None:
        pass

    def advance(self, said: str | None = None, always: bool = False) -> None:
        pass


def _arrangement(size: int | None) -> str:
    return "all at once" if size is None else f"{size} at a time"


def _check_backend(model: Transformer, prompts: list[list[int]], s: CheckSettings, progress: StepReporter) -> dict:
    start = time.perf_counter()
    path = f"{model.backend}/{short_dtype_name(model.dtype)}"
    rollouts = []
    for bs in s.batch_sizes:
        progress.running(f"{path}: generating {_arrangement(bs)}")
        rollouts.append(generate(model, prompts, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                 seed=s.seed, batch_size=bs))
        progress.advance()
    reference = rollouts[0]
    tokens_invariant = all(r.tokens == reference.tokens for r in rollouts)
    roll_all, train_all = [], []
    routed_roll, routed_train = [], []  # MoE: the experts of every position read, rollout vs training router
    generation_threads = torch.get_num_threads()
    scoring_threads = s.scoring_threads or (generation_threads,)
    for threads in scoring_threads:
        torch.set_num_threads(threads)
        for rollout in rollouts:
            for mbs in s.micro_batch_sizes:
                progress.running(f"{path}: rescoring {_arrangement(mbs)} at {threads} thread(s)")
                with torch.no_grad():
                    scored = token_logprobs(model, prompts, rollout.tokens, temperature=s.temperature,
                                            micro_batch_size=mbs)
                roll_all += rollout.logprobs
                train_all += scored
                if rollout.routing is not None:
                    routed_roll += rollout.routing
                    routed_train += token_routing(model, prompts, rollout.tokens, micro_batch_size=mbs)
                progress.advance()
    torch.set_num_threads(generation_threads)
    stats = mismatch_summary(torch.cat(train_all), torch.cat(roll_all))
    flips = routing_metrics(routed_roll, routed_train)[ROUTING_FLIP_RATE] if routed_roll else None
    return {
        "backend": model.backend,
        "dtype": str(model.dtype).removeprefix("torch."),
        "hidden_size": model.config.hidden_size,  # which model: the checked one, or the wide one (``wide_settings``)
        "num_layers": model.config.num_layers,
        "threads": generation_threads,
        "scoring_threads": list(scoring_threads),
        # the keys of vexact measure's and compare's --json report: token counts, then metrics by their full keys
        "tokens": stats["tokens"],
        "bitwise_equal": stats["bitwise_equal"],
        "metrics": {key: stats[short] for short, key in METRIC_KEYS.items()},
        "sampling_batch_invariant": tokens_invariant,
        # MoE models: fraction of router decisions (position x MoE layer) whose experts differ; None when dense
        "routing_flip_rate": flips,
        "seconds": round(time.perf_counter() - start, 3),
        # which path each op took, and (exact CPU kernels) what the host probes found
        "kernel_paths": kernel_paths(model.backend, model.device),
    }
