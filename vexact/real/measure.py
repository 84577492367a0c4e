"""``vexact measure``: natural TIM between two computation paths on a real checkpoint.

Not to be confused with ``vexact meter`` (``vexact.sweeps.bias_meter``), which measures what an injected mismatch
does to the RL policy gradient on the testbed; ``measure`` measures the log-probs' mismatch itself, no RL.

``vexact check`` proves the guarantee on a random model; ``measure`` answers the user's question
"how much mismatch does *my* stack have?": load a checkpoint, generate with the rollout path,
rescore the same tokens with the training path, and report the mismatch metrics of
``vexact.rl.metrics`` (k1/k3 KL, |Δlogp| mean/max/p99, log_ppl_abs_diff, bitwise-equal fraction,
|Δlogp| by token probability) plus |Δlogp| by response position, and the full-vocabulary comparison
(``mismatch/full_vocab_*``: KL, total variation, argmax flips and top-k overlap of the two paths' whole next-token
distributions at every response position; see ``full_vocab_comparison``). The report part (``mismatch_report``,
``print_report``, ``write_report_json``, ``plot_report``) is shared with ``vexact compare``.

A path is ``backend:dtype``: backend ``exact`` | ``native`` | ``triton`` (vexact's model on that
kernel backend) or ``hf`` (transformers' own ``generate`` / forward, as a user's inference stack
would run it); dtype ``fp32`` | ``bf16``. Both paths see the same weights (from the same files).

The ``hf`` rollout samples with transformers' ``generate`` (multinomial sampling seeded with
``torch.manual_seed(seed)``, or greedy at temperature 0) with top-k/top-p and every other logits
processor switched off, and records log_softmax(raw logits / temperature) of each sampled token
from ``output_logits``; a guard checks that the processed scores it sampled from are exactly those
raw logits / temperature (so nothing truncated the distribution). vexact paths sample with
vexact's counter-based Gumbel sampler (``vexact.engine.generation.generate``).

Broken or hostile checkpoints: the checkpoint is read and checked once by
``hf_checkpoint.read_checkpoint`` (see its module docstring: weights-only unpickling, config sizes
checked against the safetensors headers or the file sizes before anything is allocated, finite
weights) before any path is built -- also before transformers reads the files for an ``hf`` path,
so every path refuses what vexact refuses, with the same one-line error. The RoPE table is sized
for the longest measured sequence, not max_position_embeddings. Non-finite log-probs (or, on the
``hf`` path, logits) are refused too, naming the path ("rollout path native:bf16 produced
non-finite log-probs ..."): the weights are finite, so that is an activation overflow, and a
table of NaN would measure nothing.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import vexact_kernels
from vexact_kernels.host_guard import torch_threads

from ..cli_base import positive_int
from ..engine.devices import resolve_device
from ..engine.generation import generate
from ..engine.inputs import check_temperature, check_token_lists, padded_with_mask, scale_logits
from ..engine.model import DTYPES, ModelConfig, Transformer, dtype_names_text, short_dtype_name
from ..engine.scoring import full_logprobs, token_logprobs
from ..metric_keys import (
    ABS_DLOGP_MAX,
    ABS_DLOGP_MEAN,
    ABS_DLOGP_P99,
    BITWISE_EQUAL_FRAC,
    CHI2_TOKEN,
    FULL_VOCAB_ARGMAX_FLIP_FRAC,
    FULL_VOCAB_KL_MAX,
    FULL_VOCAB_KL_MEAN,
    FULL_VOCAB_POSITIONS,
    FULL_VOCAB_TV_MAX,
    FULL_VOCAB_TV_MEAN,
    K3_KL,
    KL,
    LOG_PPL_ABS_DIFF,
    MISMATCH_TOKENS,
    RAW_RATIO_MAX,
    RAW_RATIO_MIN,
    RAW_RATIO_QUANTILES,
    ROLLOUT_PROBS_DIFF_MAX,
    full_vocab_overlap_key,
    raw_ratio_affected_key,
    raw_ratio_quantile_key,
)
from ..records.atomic import publish
from ..rl.config_schema import CorrectionSection
from ..rl.corrections import check_every_method
from ..rl.metrics import DEFAULT_BUCKETS, bucket_name, full_vocab_rows, full_vocab_summary, mismatch_metrics
from ..rl.raw_ratios import raw_ratio_metrics
from ..rl.validate import read_text_file
from .hf_checkpoint import Checkpoint, read_checkpoint, read_checkpoint_config
from .hf_config import SUPPORTED_ARCHITECTURES, eos_token_id_of, model_config_from_hf
from .pretrained import build_model, from_pretrained, load_tokenizer
from .tiny import (
    PARITY_PROMPTS,
    TINY_HEADS,
    TINY_VARIANTS,
    make_tiny_checkpoint,
    make_tiny_hf_model,
    parity_with_transformers,
)

PATH_BACKENDS = ("exact", "native", "triton", "hf")


@dataclass(frozen=True)
class PathSpec:
    """One computation path: a kernel backend (or ``hf``) and a dtype."""

    backend: str
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"{self.backend}:{short_dtype_name(self.dtype)}"


def parse_path(spec: str) -> PathSpec:
    """``"native:bf16"`` -> PathSpec; a bad spec is one ValueError naming what is allowed."""
    backend, sep, dtype = str(spec).partition(":")
    allowed = f"expected BACKEND:DTYPE with BACKEND in {', '.join(PATH_BACKENDS)} and DTYPE in {dtype_names_text()}"
    if not sep or backend not in PATH_BACKENDS or dtype not in DTYPES:
        raise ValueError(f"bad path spec {spec!r}: {allowed}")
    return PathSpec(backend, DTYPES[dtype])


@dataclass
class MeasureSettings:
    """Everything ``run_measure`` needs; the CLI fills it from its flags."""

    model: Path
    rollout: str = "native:bf16"
    train: str = "exact:fp32"
    prompts_file: Path | None = None
    random_prompts: int | None = None
    max_prompt_len: int = 16  # for --random-prompts
    token_ids: bool = False  # read the prompts file as token ids even when the checkpoint has a tokenizer
    max_new_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    batch_size: int | None = None
    micro_batch_size: int | None = None
    threads: int | None = None
    full_vocab: bool = True  # also compare the full next-token distributions (``full_vocab_comparison``)
    full_vocab_top_k: int = 5
    device: str = "cpu"  # where the models run (``vexact.engine.devices``: cpu, cuda, cuda:N, auto)


@dataclass
class MeasureResult:
    """``summary``: the JSON-able report. Per-token tensors (all response tokens, concatenated) feed the plots."""

    summary: dict[str, Any]
    logp_roll: Tensor
    logp_train: Tensor
    positions: Tensor
    samples: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- prompts
def load_prompts(settings: MeasureSettings, vocab_size: int, tokenizer: Any | None) -> list[list[int]]:
    """Token-id prompts from ``--prompts FILE`` or ``--random-prompts N``.

    FILE holds one prompt per non-empty line: text (encoded with the checkpoint's tokenizer) when
    the checkpoint has one and ``token_ids`` is off, otherwise whitespace-separated token ids.
    ``--random-prompts N``: N prompts of 1..max_prompt_len ids drawn uniformly (seeded) from the vocabulary
    (the tokenizer's part of it when there is one: rows past it are often untrained padding).
    """
    if (settings.prompts_file is None) == (settings.random_prompts is None):
        raise ValueError("give exactly one of --prompts FILE and --random-prompts N")
    if settings.random_prompts is not None:
        if settings.random_prompts < 1 or settings.max_prompt_len < 1:
            raise ValueError("--random-prompts and --max-prompt-len must be positive")
        high = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        rng = random.Random(settings.seed)
        return [[rng.randrange(high) for _ in range(rng.randint(1, settings.max_prompt_len))]
                for _ in range(settings.random_prompts)]
    path = Path(settings.prompts_file)
    text = read_text_file(path, f"--prompts file '{path}'")  # missing, a directory, binary: one error naming it
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise ValueError(f"prompts file {path} has no non-empty lines")
    prompts = []
    for number, line in lines:
        if tokenizer is not None and not settings.token_ids:
            ids = list(tokenizer(line)["input_ids"])
        else:
            try:
                ids = [int(tok) for tok in line.split()]
            except ValueError:
                hint = "" if tokenizer is not None else " (this checkpoint has no tokenizer, so prompts are token ids)"
                raise ValueError(f"{path}:{number}: expected whitespace-separated token ids{hint}, "
                                 f"got {line.strip()[:40]!r}") from None
        if not ids:
            raise ValueError(f"{path}:{number}: prompt encodes to no tokens")
        prompts.append(ids)
    return check_token_lists(f"prompts from {path}", prompts, vocab_size)


# --------------------------------------------------------------------------- the two kinds of path
class VexactPath:
    """vexact's ``Transformer`` on one backend: KV-cache ``generate`` / full-sequence ``token_logprobs``.

    Two paths may share one model (same weights and dtype); each passes its own kernel ops."""

    def __init__(self, model: Transformer, backend: str):
        self.model, self.backend = model, backend
        self.ops = vexact_kernels.get_ops(backend, model.device)

    def generate(self, prompts: list[list[int]], s: MeasureSettings, eos: int | None) -> tuple[list, list[Tensor]]:
        out = generate(self.model, prompts, max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=s.seed,
                       batch_size=s.batch_size, eos_token_id=eos, ops=self.ops)
        return out.tokens, out.logprobs

    def score(self, prompts: list[list[int]], responses: list[list[int]], s: MeasureSettings) -> list[Tensor]:
        with torch.no_grad():
            return token_logprobs(self.model, prompts, responses, temperature=s.temperature,
                                  micro_batch_size=s.micro_batch_size, ops=self.ops)

    def full_logprobs(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> Tensor:
        """[N, V] fp32 log_softmax(logits / T) at every response position (N = all response tokens, in order): one
        full-sequence forward of these sequences on this path's ops and dtype, as ``token_logprobs`` runs it."""
        with torch.no_grad():
            return full_logprobs(self.model, prompts, responses, temperature, ops=self.ops).cpu()


class HFPath:
    """transformers' own model: ``generate`` (left-padded batches) / teacher-forced forward (right-padded)."""

    def __init__(self, hf_model: Any, name: str = "hf"):
        self.model, self.name = hf_model, name
        self.pad = 0

    def generate(self, prompts: list[list[int]], s: MeasureSettings, eos: int | None) -> tuple[list, list[Tensor]]:
        from transformers import GenerationConfig

        step = s.batch_size or len(prompts)
        tokens: list[list[int]] = []
        logprobs: list[Tensor] = []
        sample = s.temperature > 0
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=sample,
                                  temperature=s.temperature if sample else 1.0, top_k=0, top_p=1.0,
                                  eos_token_id=eos, pad_token_id=self.pad, output_logits=True, output_scores=True,
                                  return_dict_in_generate=True)
        # A fresh default config, so the checkpoint's generation_config.json (top_p, min_p, penalties...)
        # cannot slip in: transformers fills every unset option from the model's. Only this path generates
        # with the model, so it is set, not swapped in and back.
        self.model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=self.pad)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(s.seed)
            for start in range(0, len(prompts), step):
                t, lp = self._generate_batch(prompts[start : start + step], config, s.temperature, eos)
                tokens += t
                logprobs += lp
        return tokens, logprobs

    def _generate_batch(self, prompts: list[list[int]], config: Any, temperature: float,
                        eos: int | None) -> tuple[list, list[Tensor]]:
        ids, mask = padded_with_mask(prompts, self.pad, left=True)  # every prompt ends where generation starts
        width = ids.shape[1]
        try:
            out = self.model.generate(ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                                      generation_config=config)
        except RuntimeError as err:  # torch.multinomial refuses NaN/Inf probabilities
            if "probability tensor contains" not in str(err):
                raise
            raise ValueError(f"rollout path {self.name} produced non-finite logits (transformers' sampler refused "
                             "its probabilities): the activations overflow on this path, e.g. in bf16") from None
        generated = out.sequences[:, width:].cpu()
        step_logprobs = []
        for t, (raw, processed) in enumerate(zip(out.logits, out.scores)):
            if not torch.isfinite(raw).all():  # before the guard below, which NaN would fail misleadingly
                raise ValueError(f"rollout path {self.name} produced non-finite logits at generation step {t}: the "
                                 "activations overflow on this path, e.g. in bf16")
            scaled = scale_logits(raw.cpu(), temperature)
            if not torch.allclose(processed.float().cpu(), scaled, rtol=1e-6, atol=1e-6):
                raise ValueError(f"hf path: transformers' generate changed the logits at step {t} beyond the "
                                 "temperature (a logits processor is active); cannot record clean log-probs")
            step_logprobs.append(vexact_kernels.native.token_logprobs(scaled, generated[:, t]))
        logprobs_all = torch.stack(step_logprobs, dim=1) if step_logprobs else torch.zeros(len(prompts), 0)
        tokens, logprobs = [], []
        for b in range(len(prompts)):
            seq = generated[b].tolist()
            n = seq.index(eos) + 1 if eos is not None and eos in seq else len(seq)
            tokens.append(seq[:n])
            logprobs.append(logprobs_all[b, :n].clone())
        return tokens, logprobs

    def score(self, prompts: list[list[int]], responses: list[list[int]], s: MeasureSettings) -> list[Tensor]:
        step = s.micro_batch_size or len(prompts)
        out: list[Tensor] = []
        for start in range(0, len(prompts), step):
            out += self._score_batch(prompts[start : start + step], responses[start : start + step], s.temperature)
        return out

    def _score_batch(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[Tensor]:
        return [vexact_kernels.native.token_logprobs(rows, torch.tensor(r, dtype=torch.long))
                for rows, r in zip(self._response_logits(prompts, responses, temperature), responses)]

    def _response_logits(self, prompts: list[list[int]], responses: list[list[int]],
                         temperature: float) -> list[Tensor]:
        """Per sequence, the fp32 logits / T that predict each response token (teacher-forced, right-padded)."""
        inputs = [p + r[:-1] for p, r in zip(prompts, responses)]
        ids, mask = padded_with_mask(inputs, self.pad)
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device)).logits
        logits = logits.cpu()
        return [scale_logits(logits[b, len(p) - 1 : len(p) - 1 + len(r)], temperature)
                for b, (p, r) in enumerate(zip(prompts, responses))]

    def full_logprobs(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> Tensor:
        """[N, V] fp32 log_softmax(logits / T) at every response position, from transformers' own forward."""
        return vexact_kernels.native.log_softmax(torch.cat(self._response_logits(prompts, responses, temperature)))


class CheckpointLoader:
    """Reads and checks the checkpoint once (``hf_checkpoint.read_checkpoint``: plain tensors only, shapes and dtypes as
    the config implies, finite weights), then builds each (kind, dtype) once; vexact backends share one model per
    dtype. The ``hf`` path is loaded by transformers only after those checks passed, so a hostile pickle or an
    absurd config never reaches transformers' loader either; ``paths`` builds vexact models first and drops the
    checked tensors before transformers reads the files, so the two never sit in memory together."""

    def __init__(self, directory: Path, max_seq_len: int | None = None, device: torch.device | str = "cpu"):
        self.directory, self.max_seq_len, self.device = directory, max_seq_len, torch.device(device)
        self._checkpoint: Checkpoint | None = None
        self._checked = False
        self._models: dict[tuple[str, torch.dtype], Any] = {}

    def checkpoint(self) -> Checkpoint:
        if self._checkpoint is None:
            self._checkpoint = read_checkpoint(self.directory, self.max_seq_len)
            self._checked = True
        return self._checkpoint

    def release(self) -> None:
        """Drop the checked tensors (built models hold their own copies; a later vexact path reads them again)."""
        self._checkpoint = None

    def paths(self, *specs: PathSpec) -> list[VexactPath | HFPath]:
        """``path`` of each spec, in order; vexact ones are built first, and the tensors released after them."""
        built: dict[int, VexactPath | HFPath] = {}
        for i in sorted(range(len(specs)), key=lambda i: specs[i].backend == "hf"):
            built[i] = self.path(specs[i])
        self.release()
        return [built[i] for i in range(len(specs))]

    def path(self, spec: PathSpec) -> VexactPath | HFPath:
        kind = "hf" if spec.backend == "hf" else "vexact"
        key = (kind, spec.dtype)
        if key not in self._models:
            if kind == "vexact":
                self._models[key] = build_model(self.checkpoint(), backend=spec.backend, dtype=spec.dtype,
                                                device=self.device)
            else:
                if not self._checked:
                    self.checkpoint()
                self.release()
                self._models[key] = self.hf_model(spec)
        model = self._models[key]
        return VexactPath(model, spec.backend) if kind == "vexact" else HFPath(model, spec.name)

    def hf_model(self, spec: PathSpec) -> Any:
        """transformers' own model of the directory in ``spec.dtype`` (uncached: ``path`` caches it), refused in one
        line if transformers cannot load it or a weight overflows the dtype."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the report readable
        try:
            model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=spec.dtype, local_files_only=True,
                                                         trust_remote_code=False).eval().to(self.device)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as err:
            first = (str(err).strip().splitlines() or [""])[0][:160]
            raise ValueError(f"{spec.name} path: transformers could not load {self.directory} "
                             f"({type(err).__name__}: {first})") from None
        for name, param in model.named_parameters():
            if not torch.isfinite(param).all():  # finite in the files (checked), so it overflowed the cast
                raise ValueError(f"{spec.name} path: tensor {name!r} of {self.directory} overflows "
                                 f"{short_dtype_name(spec.dtype)} as transformers loaded it")
        return model


def model_checkpoint_config(directory: Path) -> tuple[dict[str, Any], ModelConfig]:
    """The checkpoint's config.json (read here too: the ``hf`` path, the prompts and the eos id need it) and its
    ``ModelConfig``, every field vexact reads checked by the loader's own rules (``model_config_from_hf``,
    ``eos_token_id_of``) before the tokenizer loads: transformers' tokenizer loader reads config.json too, and
    reported a bad field as its own failure. A missing or unreadable config names ``--model``."""
    try:
        hf_config = read_checkpoint_config(directory)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    source = str(directory / "config.json")
    config = model_config_from_hf(hf_config, source=source)
    eos_token_id_of(hf_config, source)
    return hf_config, config


# --------------------------------------------------------------------------- measure
def position_bins(max_len: int) -> list[tuple[int, int]]:
    """Response-position bins [lo, hi): 0, 1, 2-3, 4-7, ... (powers of two) up to ``max_len``."""
    bins, lo = [], 0
    while lo < max_len:
        hi = min(max(1, 2 * lo), max_len)
        bins.append((lo, hi))
        lo = hi
    return bins


def response_positions(lengths: list[int]) -> Tensor:
    """Each token's position in its response (0, 1, ..., T_i - 1 per sequence), concatenated; int64 [sum(lengths)]."""
    counts = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)


class _Pieces(Sequence[Tensor]):
    """``flat`` cut into consecutive pieces of ``lengths``, as a sequence of views made on demand: a list of views
    would hold one tensor object (~600 bytes) per sequence for as long as the metrics run."""

    def __init__(self, flat: Tensor, lengths: list[int]):
        self.flat, self.offsets = flat, [0, *itertools.accumulate(lengths)]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Tensor:  # type: ignore[override] -- no slices: mismatch_metrics only indexes
        n = len(self.offsets) - 1
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[Tensor]:
        flat = self.flat
        return (flat[a:b] for a, b in zip(self.offsets, self.offsets[1:]))


def check_report_methods() -> None:
    """Every registered correction method's default plan, which ``mismatch_report`` resolves for its
    ``mismatch/ratio_affected_frac/*`` keys: a broken plugin method is one ``PluginCodeError`` before the work
    (``vexact measure``, ``vexact compare``, a ``LiveMonitor``), not after it."""
    check_every_method(CorrectionSection())


def mismatch_report(logp_train: Tensor, logp_roll: Tensor, lengths: list[int], max_len: int) -> dict[str, Any]:
    """The report ``measure`` and ``compare`` share: ``tokens``, ``bitwise_equal``, ``metrics`` (every key of
    ``vexact.rl.metrics.mismatch_metrics`` and of ``vexact.rl.raw_ratios.raw_ratio_metrics``), ``by_probability``
    and ``by_position``.

    ``logp_train`` / ``logp_roll``: every response token's log-prob, sequences concatenated (flat tensors of one
    dtype, compared as they are: ``bitwise_equal`` counts ``==``); ``lengths``: the tokens of each sequence.
    ``by_probability``: token count and mean |Δlogp| per training-path probability bucket (``DEFAULT_BUCKETS``).
    ``by_position``: count, mean and max |Δlogp| per response-position bin of ``position_bins(max_len)``; a bin
    with no tokens has None. Memory: besides the inputs, a few float64 copies of the N tokens (8 bytes each).
    """
    if logp_train.shape != logp_roll.shape or logp_train.dim() != 1 or sum(lengths) != logp_train.numel():
        raise ValueError(f"log-probs of {tuple(logp_train.shape)} (training) and {tuple(logp_roll.shape)} (rollout) "
                         f"do not match {len(lengths)} sequences of {sum(lengths)} tokens")
    metrics = mismatch_metrics(_Pieces(logp_train, lengths), _Pieces(logp_roll, lengths))
    metrics.update(raw_ratio_metrics(logp_train, logp_roll, lengths))
    by_probability = []
    for lo, hi in zip(DEFAULT_BUCKETS, DEFAULT_BUCKETS[1:]):
        name = bucket_name(lo, hi)
        by_probability.append({"bucket": name, "tokens": int(metrics[f"mismatch/tokens_bucket/{name}"]),
                               "abs_dlogp_mean": metrics.get(f"mismatch/abs_dlogp_bucket/{name}")})
    positions = response_positions(lengths)
    abs_r = (logp_train.double() - logp_roll.double()).abs()
    by_position = []
    for lo, hi in position_bins(max_len):
        in_bin = (positions >= lo) & (positions < hi)
        count = int(in_bin.sum())
        by_position.append({"positions": f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}", "tokens": count,
                            "abs_dlogp_mean": float(abs_r[in_bin].mean()) if count else None,
                            "abs_dlogp_max": float(abs_r[in_bin].max()) if count else None})
    return {"tokens": int(metrics[MISMATCH_TOKENS]), "bitwise_equal": int((logp_train == logp_roll).sum()),
            "metrics": metrics, "by_probability": by_probability, "by_position": by_position}


FULL_VOCAB_BUDGET = 1 << 24
"""Vocabulary entries (response tokens x V) one forward of ``full_vocab_comparison`` holds per path (64 MiB fp32)."""


def full_vocab_comparison(rollout: VexactPath | HFPath, train: VexactPath | HFPath, prompts: list[list[int]],
                          responses: list[list[int]], s: MeasureSettings, vocab_size: int) -> dict[str, float]:
    """``mismatch/full_vocab_*`` (``vexact.rl.metrics.full_vocab_metrics``) of the two paths on the measured tokens.

    Each path's full next-token distribution log_softmax(logits / T) at every response position comes from a
    full-sequence (teacher-forced) forward of that path over the same prompt + response tokens: vexact paths on
    their own kernel ops and dtype (``VexactPath.full_logprobs``), ``hf`` paths from transformers' forward
    (``HFPath.full_logprobs``). For the rollout path this is its training-style forward, not its KV-cache decode
    steps: on an exact backend the two are bitwise identical (the guarantee ``vexact check`` tests); on native
    or ``hf`` paths they can differ at rounding level, so these keys measure the paths' forwards, while the
    sampled-token metrics measure what the rollout actually produced. Sequences go through in chunks of at most
    ``FULL_VOCAB_BUDGET`` vocabulary entries (and ``--micro-batch-size`` sequences), so memory stays bounded.
    """
    rows: list[dict[str, Tensor]] = []
    for chunk in _full_vocab_chunks(responses, vocab_size, s.micro_batch_size):
        p, r = [prompts[i] for i in chunk], [responses[i] for i in chunk]
        roll_full = rollout.full_logprobs(p, r, s.temperature)
        train_full = train.full_logprobs(p, r, s.temperature)
        for what, full in (("rollout", roll_full), ("training", train_full)):
            if torch.isnan(full).any() or torch.isposinf(full).any():
                raise ValueError(f"{what} path produced non-finite full-vocabulary log-probs: its activations "
                                 "overflow (e.g. in bf16)")
        rows.append(full_vocab_rows(train_full, roll_full, s.full_vocab_top_k))
    merged = {key: torch.cat([part[key] for part in rows]) for key in rows[0]} if rows else {"kl": torch.zeros(0)}
    return full_vocab_summary(merged, s.full_vocab_top_k)


def _full_vocab_chunks(responses: list[list[int]], vocab_size: int, micro_batch: int | None) -> list[list[int]]:
    """Indices of the sequences with tokens, grouped so that each group's tokens x V stays within the budget."""
    per_chunk = max(1, FULL_VOCAB_BUDGET // max(vocab_size, 1))
    chunks: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, r in enumerate(responses):
        if not r:
            continue
        if current and (tokens + len(r) > per_chunk or (micro_batch is not None and len(current) >= micro_batch)):
            chunks.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += len(r)
    return chunks + ([current] if current else [])


def run_measure(settings: MeasureSettings) -> MeasureResult:
    """Generate with the rollout path, rescore with the training path, and summarise the mismatch."""
    rollout_spec, train_spec = parse_path(settings.rollout), parse_path(settings.train)
    if not isinstance(settings.max_new_tokens, int) or settings.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {settings.max_new_tokens!r}")
    check_temperature(settings.temperature)
    check_report_methods()
    with torch_threads(settings.threads):  # the caller's count back after the run
        directory = Path(settings.model)
        hf_config, config = model_checkpoint_config(directory)  # before the tokenizer: see there
        vocab_size, limit = config.vocab_size, config.max_seq_len
        tokenizer = load_tokenizer(directory)
        prompts = load_prompts(settings, vocab_size, tokenizer)
        eos = None if settings.ignore_eos else _eos_id(hf_config, tokenizer, str(directory / "config.json"))

        # The RoPE table only needs the longest sequence measured, not max_position_embeddings (same values either way).
        needed = max(map(len, prompts)) + settings.max_new_tokens

        seconds: dict[str, float] = {}
        start = time.perf_counter()
        loader = CheckpointLoader(directory, max_seq_len=min(needed, limit),
                                  device=resolve_device(settings.device, "--device"))
        rollout, train = loader.paths(rollout_spec, train_spec)
        seconds["load"] = time.perf_counter() - start

        start = time.perf_counter()
        responses, logp_roll = rollout.generate(prompts, settings, eos)
        require_finite_logprobs(f"rollout path {rollout_spec.name}", logp_roll)
        seconds["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        logp_train = train.score(prompts, responses, settings)
        require_finite_logprobs(f"training path {train_spec.name}", logp_train)
        seconds["train"] = time.perf_counter() - start

        roll_flat = torch.cat([lp.float() for lp in logp_roll])
        train_flat = torch.cat([lp.float() for lp in logp_train])
        lengths = [len(r) for r in responses]
        report = mismatch_report(train_flat, roll_flat, lengths, settings.max_new_tokens)
        if settings.full_vocab:
            start = time.perf_counter()
            report["metrics"].update(full_vocab_comparison(rollout, train, prompts, responses, settings, vocab_size))
            seconds["full_vocab"] = time.perf_counter() - start

        summary = {
            "model": str(directory),
            "architecture": (hf_config.get("architectures") or [hf_config.get("model_type")])[0],
            "rollout": rollout_spec.name,
            "train": train_spec.name,
            "prompts": len(prompts),
            "prompt_source": (f"random {settings.random_prompts}" if settings.random_prompts
                              else str(settings.prompts_file)),
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "seed": settings.seed,
            "eos_token_id": eos,
            "threads": torch.get_num_threads(),
            **report,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
        }
        samples = []
        if tokenizer is not None:
            samples = [repr(tokenizer.decode(p)) + " → " + repr(tokenizer.decode(r))
                       for p, r in zip(prompts, responses)]
        return MeasureResult(summary, roll_flat, train_flat, response_positions(lengths), samples)


def require_finite_logprobs(what: str, logprobs: list[Tensor]) -> None:
    """Non-finite log-probs would make every metric NaN: refuse them, naming the path and the first bad token.
    The weights were checked finite at load, so this is an activation overflow (e.g. in bf16) on that path."""
    for i, lp in enumerate(logprobs):
        bad = ~torch.isfinite(lp)
        if bad.any():
            count = sum(int((~torch.isfinite(x)).sum()) for x in logprobs)
            raise ValueError(f"{what} produced non-finite log-probs ({count} of {sum(map(len, logprobs))} tokens, "
                             f"first in prompt {i} at response position {int(bad.nonzero()[0, 0])}); the weights "
                             "are finite, so its activations overflow (e.g. in bf16): no mismatch to measure")


def _eos_id(hf_config: dict[str, Any], tokenizer: Any | None, source: str) -> int | None:
    """The checkpoint's end-of-sequence id (first one if a list), else the tokenizer's, else None."""
    eos = eos_token_id_of(hf_config, source)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


# --------------------------------------------------------------------------- output
def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}"
    return str(value)


def print_measure(result: MeasureResult, console: Any) -> None:
    """The report as rich tables: headline metrics, |Δlogp| by token probability and by position."""
    s = result.summary
    print_report(s, console, title=f"vexact measure: rollout {s['rollout']} → train {s['train']}",
                 caption=f"{s['architecture']} from {s['model']}; {s['prompts']} prompts ({s['prompt_source']}), "
                         f"≤ {s['max_new_tokens']} new tokens, temperature {s['temperature']:g}, seed {s['seed']}")
    for sample in result.samples[:2]:
        console.print(f"sample: {sample}", markup=False)


CHI2_FOOTNOTE = ("† χ² token: the token mean of ρ² − 1 (ρ = p_train / p_roll), an estimate of E[ρ²] − 1 ≥ 0; when "
                 "the paths barely differ it can come out slightly negative (sampling noise, not an error)")


def print_report(report: dict[str, Any], console: Any, title: str, caption: str) -> None:
    """Print a ``mismatch_report`` (``measure``'s and ``compare``'s): the headline metrics, |Δlogp| by training-path
    token probability and by response position, and, when the metrics have ``mismatch/full_vocab_*`` keys, the
    full-vocabulary comparison."""
    from rich.table import Table

    m = report["metrics"]
    table = Table(title=title, caption=caption)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("tokens compared", report["tokens"]),
        ("bitwise equal", f"{report['bitwise_equal']} ({m[BITWISE_EQUAL_FRAC]:.1%})"),
        ("k1 KL (rollout_corr/kl)", m[KL]),
        ("k3 KL (rollout_corr/k3_kl)", m[K3_KL]),
        ("|Δlogp| mean", m[ABS_DLOGP_MEAN]),
        ("|Δlogp| p99", m[ABS_DLOGP_P99]),
        ("|Δlogp| max", m[ABS_DLOGP_MAX]),
        ("log_ppl_abs_diff", m[LOG_PPL_ABS_DIFF]),
        ("χ² token †", m[CHI2_TOKEN]),
        ("max |p_train − p_roll|", m[ROLLOUT_PROBS_DIFF_MAX]),
    ]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    console.print(table)
    console.print(CHI2_FOOTNOTE, soft_wrap=True, markup=False, highlight=False)

    buckets = Table(title="|Δlogp| by training-path token probability")
    for col in ("p bucket", "tokens", "mean |Δlogp|"):
        buckets.add_column(col, justify="right")
    for row in report["by_probability"]:
        buckets.add_row(row["bucket"], str(row["tokens"]), _fmt(row["abs_dlogp_mean"]))
    positions = Table(title="|Δlogp| by response position")
    for col in ("positions", "tokens", "mean |Δlogp|", "max |Δlogp|"):
        positions.add_column(col, justify="right")
    for row in report["by_position"]:
        positions.add_row(row["positions"], str(row["tokens"]), _fmt(row["abs_dlogp_mean"]), _fmt(row["abs_dlogp_max"]))
    console.print(buckets)
    console.print(positions)
    console.print(_raw_ratio_table(m))
    if FULL_VOCAB_POSITIONS in m:
        console.print(_full_vocab_table(m))


def _raw_ratio_table(m: dict[str, Any]) -> Any:
    """The raw token ratio ρ = π_train / μ_roll before any clamp or mask, and what each correction would cut."""
    from rich.table import Table

    table = Table(title="raw ratio ρ = exp(logp_train − logp_roll), before any clamp or mask")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("min", RAW_RATIO_MIN), *((f"p{round(q * 100):02d}", raw_ratio_quantile_key(q))
                                     for q in RAW_RATIO_QUANTILES), ("max", RAW_RATIO_MAX)]
    for name, key in rows:
        table.add_row(name, f"{m[key]:.9g}")  # 9 digits: a ratio 1 ± 1e-7 must not print as 1
    prefix = raw_ratio_affected_key("")
    for key in (k for k in m if k.startswith(prefix)):
        table.add_row(f"{key.removeprefix(prefix)}: tokens truncated or masked", f"{m[key]:.2%}")
    return table


def _full_vocab_table(m: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="full-vocabulary comparison (rollout μ vs training π)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    prefix, suffix = full_vocab_overlap_key("<k>").split("<k>")
    overlap = next(key for key in m if key.startswith(prefix) and key.endswith(suffix))
    k = overlap.removeprefix(prefix).removesuffix(suffix)
    rows = (("positions", FULL_VOCAB_POSITIONS), ("KL(μ‖π) mean", FULL_VOCAB_KL_MEAN),
            ("KL(μ‖π) max", FULL_VOCAB_KL_MAX), ("total variation mean", FULL_VOCAB_TV_MEAN),
            ("total variation max", FULL_VOCAB_TV_MAX),
            ("argmax flip fraction", FULL_VOCAB_ARGMAX_FLIP_FRAC), (f"top-{k} overlap mean", overlap))
    for name, key in rows:
        table.add_row(name, _fmt(m[key]))
    return table


def write_json(result: MeasureResult, path: Path) -> Path:
    """The summary as JSON (NaN/Inf as strings, see ``runlog.json_safe``)."""
    return write_report_json(result.summary, path)


def write_report_json(summary: dict[str, Any], path: Path) -> Path:
    """A report summary as indented JSON (NaN/Inf as strings, see ``runlog.json_safe``); returns the path."""
    from ..records.atomic import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, summary, sort_keys=False)


def write_png(result: MeasureResult, path: Path) -> Path:
    """Two panels: histogram of Δlogp = logp_train − logp_roll, and |Δlogp| vs training-path token probability."""
    s = result.summary
    return plot_report(result.logp_train, result.logp_roll, path,
                       f"vexact measure: rollout {s['rollout']} → train {s['train']} ({s['architecture']}, "
                       f"{s['tokens']} tokens)")


def plot_report(logp_train: Tensor, logp_roll: Tensor, path: Path, title: str) -> Path:
    """The report's plot (``measure --png``, ``compare --png``) of flat per-token log-probs: a histogram of
    Δlogp = logp_train − logp_roll, and |Δlogp| vs training-path token probability; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    r = (logp_train.double() - logp_roll.double()).cpu().numpy()
    prob = logp_train.double().exp().cpu().numpy()
    zero = r == 0
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    fig.suptitle(title)
    ax1.hist(r, bins=61, color="tab:blue")
    ax1.set_yscale("log")
    ax1.set_xlabel("Δlogp = logp_train − logp_roll")
    ax1.set_ylabel("tokens")
    ax1.set_title(f"{int(zero.sum())} of {len(r)} tokens bitwise equal (Δ = 0)")
    if (~zero).any():
        ax2.scatter(prob[~zero], abs(r[~zero]), s=6, alpha=0.5, color="tab:red")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
    else:
        ax2.text(0.5, 0.5, "no mismatched tokens", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("token probability under the training path")
    ax2.set_ylabel("|Δlogp|")
    ax2.set_title(f"|Δlogp| vs token probability ({int(zero.sum())} zeros not shown)")
    fig.tight_layout()
    try:  # --png: a PNG whatever the name ends in; published whole (no half image, the old one kept on failure)
        publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def _main(argv: list[str] | None = None) -> int:
    """``python -m vexact.real.measure --make-tiny-checkpoint DIR [--arch ARCH]`` writes a checkpoint to measure;
    ``--parity-tiny`` prints the parity-with-transformers table of the README (the tests' variants and prompts)."""
    parser = argparse.ArgumentParser(prog="python -m vexact.real.measure",
                                     description="Tiny random-init Hugging Face checkpoints (no downloads).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--make-tiny-checkpoint", type=Path, metavar="DIR", help="write a tiny checkpoint to DIR")
    action.add_argument("--parity-tiny", action="store_true", help="vexact vs transformers logits, tiny variants")
    parser.add_argument("--arch", choices=sorted(SUPPORTED_ARCHITECTURES), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=positive_int, default=64)
    parser.add_argument("--num-layers", type=positive_int, default=2)
    parser.add_argument("--no-tokenizer", action="store_true", help="token-id prompts only")
    args = parser.parse_args(argv)
    if args.hidden_size % (2 * TINY_HEADS):
        parser.error(f"--hidden-size must be a multiple of {2 * TINY_HEADS} ({TINY_HEADS} heads of an even size), "
                     f"got {args.hidden_size}")
    if args.parity_tiny:
        print("| variant | fp32 max |Δlogit| exact / native | bf16 mean |err| vs fp32: vexact / transformers "
              "| bf16 max |vexact − transformers| | max |logit| |")
        for name, (arch, kwargs) in TINY_VARIANTS.items():
            r = parity_with_transformers(make_tiny_hf_model(arch, seed=args.seed, **kwargs), PARITY_PROMPTS)
            print(f"| {name} | {r['fp32_max_abs_exact']:.1e} / {r['fp32_max_abs_native']:.1e} | "
                  f"{r['bf16_mean_abs_err_vexact']:.3f} / {r['bf16_mean_abs_err_transformers']:.3f} | "
                  f"{r['bf16_max_abs_vs_transformers']:.2f} | {r['logit_max_abs']:.1f} |")
        return 0
    try:
        path = make_tiny_checkpoint(args.make_tiny_checkpoint, args.arch, args.seed, tokenizer=not args.no_tokenizer,
                                    hidden_size=args.hidden_size, num_layers=args.num_layers)
        n_params = sum(p.numel() for p in from_pretrained(path).parameters())
    except (ValueError, OSError) as err:  # a path that exists or cannot be written, a size the model cannot take
        print(f"error: --make-tiny-checkpoint {args.make_tiny_checkpoint}: {err}", file=sys.stderr)
        return 2
    print(f"wrote a tiny random {args.arch} checkpoint ({n_params} parameters, {math.ceil(n_params * 4 / 1024)} KiB "
          f"fp32) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
