"""Named sites of a forward recorded outside vexact's kernel ops, content hashes, and locate dumps.

``vexact locate`` records vexact's own paths op by op (``op_plan.OpRecorder``). A transformers model runs its own
modules, so this module records it with forward hooks at the **same site names** wherever the model has a module
(or a module's input) that holds the same tensor:

- ``embed`` (the embedding's output);
- per layer ``layer i / input_norm``, ``q_proj``, ``k_proj``, ``v_proj`` (``q_norm``, ``k_norm``), ``attention``
  (the input of ``o_proj``: the attention's output, heads concatenated), ``o_proj``, ``resid_attn`` (the input of
  ``post_attention_layernorm``), ``post_norm``, ``gate_proj``, ``up_proj``, ``silu_mul`` (the input of
  ``down_proj``), ``down_proj``, ``resid_mlp`` (the decoder layer's output);
- ``final_norm`` and ``logits``.

Every other leaf module with parameters inside a layer is recorded under its own module name (a fused
``qkv_proj`` or ``gate_up_proj``: module granularity). RoPE runs inside transformers' attention, not in a module,
so ``q_rope`` and ``k_rope`` have no hf site; locate compares the sites both paths have.

**Hash.** ``site_hash``: sha256 of ``float32;`` + the shape + the tensor's bytes widened to float32 (bf16 widens
exactly), so two sites hash equal exactly when locate's bitwise comparison calls them equal, whatever dtypes the
two paths ran in; the dtype is stored beside the hash.

**Dump** (``vexact locate --dump DIR``): ``DIR/locate.json`` (``DUMP_FILE``) holds the path, the model (its
ModelConfig), the token sequences, prompt lengths, prefill and compared rows, and per site its name, group,
module, feature shape, dtype, hash, and summary stats (``abs_max``, ``abs_mean``, ``nonfinite``);
``DIR/sites.safetensors`` (``TENSORS_FILE``) holds the site tensors themselves ([rows, features], the path's dtype)
unless ``--hash`` asked for hashes only. Two dumps compare site by site: bit by bit with |Δ| where both hold
tensors, by hash otherwise.

**Weights.** A recording also keeps a digest of the weights it ran (``weights_digest``; the dump's ``weights``
key, null in dumps written before it was recorded -- they read as before). Two recordings of one config but other
weights (another checkpoint, a model after an optimizer step) differ from the first layer on, so a report would
blame that layer for what is another model: ``compare_weights`` tells, and ``locate`` refuses unless told
(``--allow-different-weights``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.inputs import padded_with_mask
from ..rl.plugins import load_entry_points

DUMP_FILE = "locate.json"
TENSORS_FILE = "sites.safetensors"
DUMP_FORMAT = "vexact-locate-dump"
DUMP_VERSION = 1
MAX_DUMP_TENSOR_BYTES = 512 * 2**20  # above this, --dump asks for --hash or fewer --positions

_LAYER_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")
_SITE_NAMES = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_norm"}
"""transformers' module names that vexact's op plan shortens (the same map as ``locate``'s parameter names)."""
_INPUT_SITES = {"o_proj": "attention", "down_proj": "silu_mul", "post_attention_layernorm": "resid_attn"}
"""Modules whose input is a site of the op plan: the attention's output, silu(gate) * up, the residual stream."""


@dataclass
class SiteSpec:
    """One recorded site: ``name`` (as in the op plan), ``group`` (``embed``, ``layer i``, ``head``), ``module``
    (what produced it: a kernel op or an hf module's class), ``recorded`` (``output`` or ``input``) and the
    per-position ``feature_shape``."""

    name: str
    group: str
    module: str
    recorded: str
    feature_shape: tuple[int, ...]

    @property
    def features(self) -> int:
        n = 1
        for d in self.feature_shape:
            n *= d
        return n


@dataclass
class Sites:
    """One path's recording: ``specs`` in forward order, ``tensors`` (name -> [rows, features]; empty for a
    hash-only dump), ``hashes`` (name -> ``site_hash``), ``dtypes`` (name -> dtype name), ``stats`` (name ->
    abs_max, abs_mean, nonfinite) and what was run: ``path``, ``model``, ``config``, ``tokens``,
    ``prompt_lengths``, ``prefill``, ``rows`` ((sequence, position) of each row), ``weights`` (``weights_digest``
    of the model; None where not recorded: a dump from before vexact recorded it, or from another tool)."""

    path: str
    specs: list[SiteSpec]
    tensors: dict[str, Tensor]
    hashes: dict[str, str]
    dtypes: dict[str, str]
    stats: dict[str, dict[str, float]]
    rows: list[tuple[int, int]]
    tokens: list[list[int]] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    model: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the dump directory it was read from, "" when recorded in this process
    weights: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]


SiteRecorder = Callable[..., tuple[list[list[int]], list[dict[str, Any]], dict[str, Tensor]]]
"""An outside engine's recorder: ``(checkpoint_dir, dtype, kind, sequences, **options)`` -> (the sequences run, site
specs in forward order, site name -> rows of every position)."""
SITE_RECORDERS: dict[str, SiteRecorder] = {}
"""Engine name -> its recorder. Engines that live above this layer (``vllm``: ``vexact.integrations.vllm_sites``)
register through the ``vexact.plugins`` entry-point group, as the vLLM rollout engine does."""


def register_site_recorder(engine: str, recorder: SiteRecorder) -> None:
    """Make ``engine``'s recorder available to ``vexact locate`` and ``vexact.testing``."""
    SITE_RECORDERS[engine] = recorder


def site_recorder(engine: str) -> SiteRecorder:
    """``engine``'s registered recorder (the entry points loaded first); ValueError naming the engines known."""
    load_entry_points()
    if engine not in SITE_RECORDERS:
        known = ", ".join(sorted(SITE_RECORDERS)) or "none"
        raise ValueError(f"no site recorder for engine {engine!r} (registered: {known})")
    return SITE_RECORDERS[engine]


def site_hash(tensor: Tensor) -> str:
    """sha256 of ``float32;`` + the shape + the tensor's float32 bytes (see the module docstring)."""
    t = tensor.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(f"float32;{list(t.shape)};".encode())
    digest.update(t.view(torch.int32).numpy().tobytes())
    return digest.hexdigest()


def site_stats(tensor: Tensor) -> dict[str, float]:
    """abs_max, abs_mean over the finite values (0 if none) and the count of non-finite values."""
    t = tensor.detach().double()
    finite = torch.isfinite(t)
    values = t[finite].abs()
    return {"abs_max": float(values.max()) if values.numel() else 0.0,
            "abs_mean": float(values.mean()) if values.numel() else 0.0, "nonfinite": int((~finite).sum())}


def make_sites(path: str, specs: list[SiteSpec], tensors: dict[str, Tensor], rows: list[tuple[int, int]],
               weights: dict[str, Any] | None = None, **run: Any) -> Sites:
    """A ``Sites`` of recorded tensors: hashes, dtypes and stats computed here; ``weights``: the model's
    ``weights_digest``."""
    dtype_names = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    return Sites(path, specs, tensors, {name: site_hash(t) for name, t in tensors.items()}, dtype_names,
                 {name: site_stats(t) for name, t in tensors.items()}, rows, **run, weights=weights)


# --------------------------------------------------------------------------- the weights' digest
WEIGHT_DIGEST_DTYPES = ("float32", "float16", "bfloat16")
"""The dtypes a weights digest can be taken in, finest first: two recordings compare by the finest both hold."""


def _digest_dtypes(held: set[str]) -> tuple[str, ...]:
    """The dtypes a model holding ``held`` is digested in: float32 weights in float32 and rounded to bfloat16 (what a
    bf16 engine holds of them); weights with any bfloat16 (and otherwise float32) in bfloat16; one other dtype in
    that dtype; anything else (float16 with float32, quantized weights) in none."""
    if held == {"float32"}:
        return "float32", "bfloat16"
    if held <= {"float32", "bfloat16"}:
        return ("bfloat16",)
    return tuple(held) if len(held) == 1 and next(iter(held)) in WEIGHT_DIGEST_DTYPES else ()


def _tensor_sha256(tensor: Tensor, held: torch.dtype, dtypes: tuple[str, ...]) -> list[str]:
    out = []
    for dtype in dtypes:
        t = tensor.detach().to(held).to(getattr(torch, dtype)).to("cpu").contiguous().reshape(-1)
        out.append(hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest())  # hashlib lets go of the GIL
    return out


def weights_digest(named: Iterable[tuple[str, Tensor]], held: torch.dtype | None = None) -> dict[str, Any]:
    """A deterministic digest of a model's weights (``model.named_parameters()``, or a checkpoint's tensors with
    ``held``, the dtype an engine holds them in -- it casts them as it loads them; each tensor is cast as it is
    hashed, so no cast copy of the whole model is made):
    ``{"held": the parameters' dtypes joined by "+", "tensors": their count, "sha256": {DTYPE: hex}}``.

    Per DTYPE: sha256 over one line per tensor in name order -- its name (transformers' ``model.`` prefix dropped,
    so a transformers model and the vexact model of its weights name theirs alike), its shape and the sha256 of its
    bytes in DTYPE. A one-bit change to any element, a renamed or reshaped tensor changes it; the thread count
    changes nothing (each tensor on its own, the lines joined in name order; rounding is elementwise).

    **Dtypes.** An engine often holds the trainer's weights in another dtype (bf16 engine, fp32 trainer), so one
    digest of the bytes held would call the same weights different. A model is digested in the dtypes its weights
    can be compared in (``_digest_dtypes``): float32 weights in float32 and rounded to bfloat16 (round to nearest
    even, as ``.to(torch.bfloat16)`` and the engines' loaders cast), bfloat16 weights in bfloat16.
    ``compare_weights`` compares the finest both record: float32 when both hold float32 (an update below
    bfloat16's resolution is caught), else bfloat16 -- where one side holds bfloat16 weights, weights that round
    to the same bfloat16 run the same model there, and no digest could tell them apart. float16 is digested only
    on its own (rounding to it can overflow and flush, so no fair float32 -> float16 digest is taken); a model
    that mixes it, or quantized weights, records no digest and the check says it cannot tell.

    **Cost.** Every byte is read once per digest dtype (float32 weights: their bytes, then half as many rounded).
    sha256 runs at about 1.7 GB/s per core with SHA extensions. Measured on a shared 2-core AMD EPYC, one thread:
    the ``llama100m`` preset (SmolLM2-135M's shape) 0.57 s in float32 and 0.21 s in bfloat16, ``qwen3_0_6b``
    2.8 s and 0.87 s. At that rate a 30B model takes about 140 s in float32 (120 GB) and 45 s in bfloat16; tensors
    are hashed in parallel on ``torch.get_num_threads()`` threads (hashlib lets go of the GIL), which divides that
    by up to the core count where memory bandwidth allows (not measured here: two cores). Tensors on a GPU are
    rounded there and copied to the host one at a time.
    """
    items = sorted(((name.removeprefix("model."), t) for name, t in named), key=lambda item: item[0])
    held_as = {name: held or t.dtype for name, t in items}
    dtypes_held = {str(d).removeprefix("torch.") for d in held_as.values()}
    dtypes = _digest_dtypes(dtypes_held)
    workers = max(1, min(torch.get_num_threads(), len(items)))
    if workers == 1:
        per_tensor = [_tensor_sha256(t, held_as[name], dtypes) for name, t in items]
    else:
        with ThreadPoolExecutor(workers) as pool:
            per_tensor = list(pool.map(lambda item: _tensor_sha256(item[1], held_as[item[0]], dtypes), items))
    sha256 = {}
    for i, dtype in enumerate(dtypes):
        digest = hashlib.sha256(f"vexact-weights;{dtype}\n".encode())
        for (name, t), hexes in zip(items, per_tensor):
            digest.update(f"{name};{list(t.shape)};{hexes[i]}\n".encode())
        sha256[dtype] = digest.hexdigest()
    return {"held": "+".join(sorted(dtypes_held)), "tensors": len(items), "sha256": sha256}


ONE_LOAD = "one_load"
"""The ``weights`` key of a recording whose run loaded both compared paths from one checkpoint (or seed), its value
naming it: the same weights by construction, not digested (``locate.run_locate`` without ``--dump``)."""


def _where(s: Sites) -> str:
    """How messages name a recording: its dump's manifest, or the path it ran."""
    return str(Path(s.source) / DUMP_FILE) if s.source else f"path {s.path}"


def compare_weights(a: Sites, b: Sites) -> dict[str, Any]:
    """Did two recordings run the same weights? ``{"same": True, False or None (not checked), "dtype": the digest
    compared (the finest both record, ``WEIGHT_DIGEST_DTYPES``) or None, "a" / "b": each side's sha256 of it or
    None, "note": why it was not checked, else ""}``."""
    unchecked = {"same": None, "dtype": None, "a": None, "b": None}
    missing = [_where(s) for s in (a, b) if s.weights is None]
    if missing:
        return {**unchecked, "note": f"{' and '.join(missing)} record{'s' if len(missing) == 1 else ''} no weights "
                                     "digest (a dump written before vexact recorded one, or by another tool)"}
    if ONE_LOAD in a.weights or ONE_LOAD in b.weights:
        if a.weights == b.weights:
            return {**unchecked, "same": True, "note": f"both paths loaded {a.weights[ONE_LOAD]} in this run (the "
                                                       "same weights by construction: not digested)"}
        return {**unchecked, "note": "one side was not digested (recorded by a run that compared its own paths)"}
    common = [d for d in WEIGHT_DIGEST_DTYPES if d in a.weights["sha256"] and d in b.weights["sha256"]]
    if not common:
        return {**unchecked, "note": f"a holds {a.weights['held']} weights and b {b.weights['held']}: no digest "
                                     "both record (see sites.weights_digest)"}
    ha, hb = a.weights["sha256"][common[0]], b.weights["sha256"][common[0]]
    return {"same": ha == hb, "dtype": common[0], "a": ha, "b": hb, "note": ""}


def different_weights_error(a: Sites, b: Sites, weights: dict[str, Any]) -> ValueError:
    """The refusal of two recordings whose weights digests differ (``compare_weights``), naming both."""
    return ValueError(f"{_where(a)} and {_where(b)} ran different weights (sha256 of their {weights['dtype']} "
                      f"weights: {weights['a']} vs {weights['b']}): another checkpoint, or a model after an optimizer "
                      "step, differs from the first layer on, and the report would blame that layer for it; record "
                      "both from the same weights, or compare them knowingly with --allow-different-weights "
                      "(allow_different_weights=True)")


# --------------------------------------------------------------------------- transformers' modules by hooks
def _hf_sites(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, str]]:
    """(module, name, group, recorded) of every hooked site of a transformers causal LM (module docstring)."""
    found: list[tuple[torch.nn.Module, str, str, str]] = []
    for qualified, module in model.named_modules():
        leaf = not any(True for _ in module.children())
        own_params = any(True for _ in module.parameters(recurse=False))
        last = qualified.rpartition(".")[2]
        if (match := _LAYER.search(qualified)) is not None:
            found.append((module, f"layer {match[1]} / resid_mlp", f"layer {match[1]}", "output"))
        elif (match := _LAYER_MODULE.search(qualified)) is not None:
            if not (leaf and own_params):
                continue
            group = f"layer {match[1]}"
            if last in _INPUT_SITES:
                found.append((module, f"{group} / {_INPUT_SITES[last]}", group, "input"))
            found.append((module, f"{group} / {_SITE_NAMES.get(last, last)}", group, "output"))
        elif last == "embed_tokens":
            found.append((module, "embed", "embed", "output"))
        elif last == "norm" and leaf:
            found.append((module, "final_norm", "head", "output"))
        elif last == "lm_head":
            found.append((module, "logits", "head", "output"))
    names = [name for _, name, _, _ in found]
    if not any(name == "embed" for name in names) or "logits" not in names or not any("resid_mlp" in n for n in names):
        raise ValueError(f"{type(model).__name__}: not a transformers causal LM locate can hook (it needs "
                         "embed_tokens, layers.N and lm_head modules)")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{type(model).__name__}: two modules would record the site {duplicates[0]!r}; locate "
                         "records one module per site name (a mixture-of-experts layer has no fixed sites)")
    return found


class _HookRecorder:
    """Forward hooks on every site of ``_hf_sites``: each call keeps the rows ``begin`` asked for, in the same
    [rows, features] layout ``op_plan.OpRecorder`` stores, and the first forward fixes the sites' order."""

    def __init__(self, model: torch.nn.Module, rows: int):
        self.rows = rows
        self.store: dict[str, Tensor] = {}
        self.specs: dict[str, SiteSpec] = {}  # insertion order = forward order of the first forward
        self._keep: tuple[Tensor, Tensor, Tensor] | None = None
        self._handles = []
        for module, name, group, recorded in _hf_sites(model):
            kind = type(module).__name__
            if recorded == "input":
                hook = self._hook(name, group, kind, recorded, lambda args, out: args[0])
                self._handles.append(module.register_forward_pre_hook(lambda m, args, h=hook: h(args, None)))
            else:
                hook = self._hook(name, group, kind, recorded,
                                  lambda args, out: out[0] if isinstance(out, (tuple, list)) else out)
                self._handles.append(module.register_forward_hook(lambda m, args, out, h=hook: h(args, out)))

    def _hook(self, name: str, group: str, kind: str, recorded: str,
              pick: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], None]:
        def record(args: Any, out: Any) -> None:
            if self._keep is None:
                return
            tensor = pick(args, out).detach()
            batch, length = tensor.shape[:2]
            if name not in self.specs:
                self.specs[name] = SiteSpec(name, group, kind, recorded, tuple(tensor.shape[2:]))
            spec = self.specs[name]
            keep_batch, keep_time, dest = self._keep
            rows = tensor.reshape(batch, length, spec.features)[keep_batch, keep_time]
            if name not in self.store:
                self.store[name] = torch.zeros(self.rows, spec.features, dtype=tensor.dtype)
            self.store[name][dest] = rows.cpu()
        return record

    def begin(self, keep: list[tuple[int, int, int]]) -> None:
        index = torch.tensor(keep, dtype=torch.long).reshape(-1, 3)
        self._keep = (index[:, 0], index[:, 1], index[:, 2])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._keep = None


@torch.no_grad()
def capture_hf(model: torch.nn.Module, kind: str, sequences: list[list[int]], prefill: list[int],
               rows: list[tuple[int, int]]) -> tuple[list[SiteSpec], dict[str, Tensor]]:
    """Every site of a transformers causal LM on ``sequences``: (specs in forward order, name -> [len(rows),
    features]), row i = (sequence, position) ``rows[i]``, the layout of ``op_plan.capture``.

    ``train``: one forward over all sequences, right-padded with an attention mask, no cache. ``rollout``: each
    sequence on its own: its first ``prefill[b]`` tokens in one forward that fills transformers' KV cache, then
    one forward per later token with that cache (positions follow from the cache)."""
    device = next(model.parameters()).device
    recorder = _HookRecorder(model, len(rows))
    try:
        if kind == "train":
            ids, mask = padded_with_mask(sequences)
            recorder.begin([(b, p, i) for i, (b, p) in enumerate(rows)])
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        elif kind == "rollout":
            from transformers import DynamicCache

            # transformers renamed the argument (past_key_values -> cache); the cache object fills in place
            key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            for b, (seq, k) in enumerate(zip(sequences, prefill)):
                cache = DynamicCache()
                recorder.begin([(0, p, i) for i, (s, p) in enumerate(rows) if s == b and p < k])
                model(input_ids=torch.tensor([seq[:k]], device=device), use_cache=True, **{key: cache})
                for p in range(k, len(seq)):
                    recorder.begin([(0, 0, i) for i, (s, q) in enumerate(rows) if s == b and q == p])
                    model(input_ids=torch.tensor([[seq[p]]], device=device), use_cache=True, **{key: cache})
        else:
            raise ValueError(f"unknown path kind {kind!r}; expected rollout or train")
    finally:
        recorder.close()
    return list(recorder.specs.values()), recorder.store


# --------------------------------------------------------------------------- dumps
def is_dump(text: str | Path) -> bool:
    """Does ``text`` name a directory holding a locate dump?"""
    return Path(text).is_dir() and (Path(text) / DUMP_FILE).is_file()


def write_dump(sites: Sites, directory: Path, tensors: bool) -> Path:
    """``sites`` as a dump in ``directory`` (created): ``DUMP_FILE``, and ``TENSORS_FILE`` when ``tensors``.
    Refuses (ValueError) to store more than ``MAX_DUMP_TENSOR_BYTES`` of tensors, and a directory that holds
    files other than a dump's."""
    from safetensors.torch import save_file

    from ..records.runlog import write_json_atomic

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--dump {directory}: exists and is not a directory")
    if directory.is_dir():
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in (DUMP_FILE, TENSORS_FILE))
        if foreign:
            raise ValueError(f"--dump {directory}: the directory holds other files ({foreign[0]}, ...); give a new "
                             "or an earlier dump's directory")
    size = sum(t.numel() * t.element_size() for t in sites.tensors.values())
    if tensors and size > MAX_DUMP_TENSOR_BYTES:
        raise ValueError(f"--dump: the site tensors take {size / 2**20:.0f} MiB, over the "
                         f"{MAX_DUMP_TENSOR_BYTES // 2**20} MiB a dump stores; add --hash (hashes only) or select "
                         "fewer --positions")
    directory.mkdir(parents=True, exist_ok=True)
    if tensors:
        save_file({name: t.contiguous() for name, t in sites.tensors.items()}, str(directory / TENSORS_FILE))
    else:
        (directory / TENSORS_FILE).unlink(missing_ok=True)
    write_json_atomic(directory / DUMP_FILE, {
        "format": DUMP_FORMAT, "version": DUMP_VERSION, "path": sites.path, "model": sites.model,
        "config": sites.config, "tokens": sites.tokens, "prompt_lengths": sites.prompt_lengths,
        "prefill": sites.prefill, "rows": [list(r) for r in sites.rows],
        "tensors": TENSORS_FILE if tensors else None, "weights": sites.weights,
        "sites": [{"name": s.name, "group": s.group, "module": s.module, "recorded": s.recorded,
                   "feature_shape": list(s.feature_shape), "dtype": sites.dtypes[s.name],
                   "sha256": sites.hashes[s.name], **sites.stats[s.name]} for s in sites.specs]})
    return directory


def read_dump(directory: str | Path, flag: str) -> Sites:
    """A dump written by ``write_dump``; one ValueError naming ``flag`` and the file for a missing or bad one."""
    from safetensors.torch import load_file

    directory = Path(directory)
    manifest = directory / DUMP_FILE
    if not directory.is_dir():
        raise ValueError(f"{flag}: dump directory {directory} not found")
    if not manifest.is_file():
        raise ValueError(f"{flag}: {directory} holds no locate dump ({DUMP_FILE} missing); write one with "
                         "vexact locate --dump DIR")
    try:
        data = json.loads(manifest.read_text())
        if data.get("format") != DUMP_FORMAT or data.get("version") != DUMP_VERSION:
            raise ValueError(f"not a {DUMP_FORMAT} version {DUMP_VERSION}")
        specs = [SiteSpec(s["name"], s["group"], s["module"], s["recorded"], tuple(s["feature_shape"]))
                 for s in data["sites"]]
        sites = Sites(data["path"], specs, {}, {s["name"]: s["sha256"] for s in data["sites"]},
                      {s["name"]: s["dtype"] for s in data["sites"]},
                      {s["name"]: {k: s[k] for k in ("abs_max", "abs_mean", "nonfinite")} for s in data["sites"]},
                      [tuple(r) for r in data["rows"]], data["tokens"], data["prompt_lengths"], data["prefill"],
                      data["model"], data["config"], str(directory), _dump_weights(data.get("weights")))
        tensors_file = data["tensors"]
        if tensors_file is not None and not isinstance(tensors_file, str):
            raise TypeError(f"'tensors' must be a file name or null, got {tensors_file!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{flag}: {manifest} is not a locate dump ({type(err).__name__}: {err})") from None
    if tensors_file is not None:
        path = directory / tensors_file
        if not path.is_file():
            raise ValueError(f"{flag}: {path} missing ({DUMP_FILE} says the dump holds its tensors there)")
        try:
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{flag}: {path} cannot be read ({type(err).__name__}: {err})") from None
        for spec in specs:
            t = tensors.get(spec.name)
            shape = (len(sites.rows), spec.features)
            if t is None or tuple(t.shape) != shape or site_hash(t) != sites.hashes[spec.name]:
                raise ValueError(f"{flag}: {path}: site {spec.name!r} is missing or does not match its hash in "
                                 f"{DUMP_FILE}")
            sites.tensors[spec.name] = t
    return sites


def _dump_weights(value: Any) -> dict[str, Any] | None:
    """A dump's ``weights``: None (absent: a dump from before it was recorded) or ``weights_digest``'s dict."""
    if value is None:
        return None
    sha256 = value.get("sha256") if isinstance(value, dict) else None
    if not (isinstance(sha256, dict) and isinstance(value.get("held"), str)
            and all(d in WEIGHT_DIGEST_DTYPES and isinstance(h, str) for d, h in sha256.items())):
        raise TypeError(f"'weights' must be null or a weights digest (held, sha256 per dtype), got {value!r}"[:200])
    return value


def check_comparable(a: Sites, b: Sites) -> None:
    """One ValueError when two recordings ran different models or token sequences (nothing to compare). Their
    weights are ``compare_weights``'."""
    def where(s: Sites) -> str:
        return s.source or f"path {s.path}"

    # max_seq_len is the capacity a run allocated (its longest sequence for a random model), not the model
    keys = [k for k in dict.fromkeys([*a.config, *b.config]) if k != "max_seq_len"]
    key = next((k for k in keys if a.config.get(k) != b.config.get(k)), None)
    if key is not None:
        raise ValueError(f"{where(a)} and {where(b)} ran different models ({key}: {a.config.get(key)!r} vs "
                         f"{b.config.get(key)!r}); compare dumps of the same model")
    if a.tokens != b.tokens or a.rows != b.rows:
        if len(a.tokens) != len(b.tokens):
            what = f"{len(a.tokens)} vs {len(b.tokens)} sequences"
        else:
            s = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
            what = "different positions (--positions)" if s is None else f"sequence {s} differs"
        raise ValueError(f"{where(a)} and {where(b)} ran different token sequences ({what}); dump the second with "
                         f"--tokens-from {a.source or 'DIR'} (or the same --prompt-tokens and --max-new-tokens 0)")
