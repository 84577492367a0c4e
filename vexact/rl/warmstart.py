"""Supervised warm start: teach the task a little so RL starts from a policy with non-zero
but imperfect reward. Deterministic (exact kernels, counter-seeded data) and cached on disk
(safetensors) keyed by everything that determines the weights; trained once per key however many processes ask
at once (``warm_start``)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

import vexact_kernels

from ..engine.devices import device_kind
from ..engine.model import MOE_FIELDS, Transformer
from ..engine.scoring import score_tokens
from ..records.atomic import publish, write_file
from ..registry import mounts
from .config import config_hash
from .config_schema import DEFAULT_WARMSTART_CACHE, RunConfig
from .optim import ExactAdamW, clip_gradients_
from .tasks import (
    Problem,
    Task,
    encode_prompt,
    encode_target,
    task_free_span,
    task_of,
    task_warm_start_problems,
    training_problems,
)

WARM_START_SEED_OFFSET = 1_000_003  # keeps warm-start data apart from the RL prompt stream
CACHE_VERSION = 4  # bump whenever kernel numerics change: warm-start weights are bitwise products of them
# (4: a GEMM class right only at 1 thread takes the single-thread library path instead of the fixed-order one)


def save_file(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """safetensors' ``save_file``, written by ``atomic.write_file``: a write that fails (a full disk, a file-size
    limit) is an OSError naming the file, not the library's own error."""
    write_file(filename, save_tensors(tensors))


def warm_start_key(cfg: RunConfig) -> str:
    """Hash of what determines warm-start weights (not the cache location or RL settings): the config's model,
    task and warm-start settings, the task's data (``task_data_fingerprint``), and the device kind and kernel
    settings (``vexact_kernels.bit_settings``) where they are not the CPU's defaults."""
    plain = cfg.to_dict()
    plain["warm_start"].pop("cache_dir", None)
    plain["warm_start"].pop("seed", None)  # folded into "seed" below
    for section in ("task", "warm_start"):  # an extension's setting at its default: the key of a tree without it
        for key, mount in mounts(type(getattr(cfg, section))).items():
            if plain[section].get(key) == _saved_default(mount.field) or _reward_only(mount):
                plain[section].pop(key, None)
    if plain["warm_start"].get("free_weight") is None:
        plain["warm_start"].pop("free_weight", None)  # likewise
    plain["task"].pop("eval_prompts", None)
    plain["task"].pop("partial_credit", None)  # read by Task.reward alone: the warm start imitates the same targets
    if not plain["task"].get("distractors"):
        plain["task"].pop("distractors", None)  # no vocabulary tail: the same key as before the knob existed
    plain["model"].pop("preset", None)  # a name for values already in the other model keys
    if not plain["model"].get("num_experts"):
        for key in MOE_FIELDS:  # a dense model: the same key as before the MoE knobs existed
            plain["model"].pop(key, None)
    # a GPU trains other bits than the CPU: its own entry (a CPU run's key is the one from before devices existed);
    # so does a kernel setting that changes bits (VEXACT_CPU_EXACT_PATH=fixed-order, VEXACT_CPU_ONEDNN=off), only
    # where set: the defaults' key is the one from before it entered
    kind = device_kind(cfg.device)
    settings = vexact_kernels.bit_settings(cfg.backend, kind)
    return config_hash({"version": CACHE_VERSION, "model": plain["model"], "task": plain["task"],
                        "task_data": task_data_fingerprint(cfg), "warm_start": plain["warm_start"],
                        "seed": cfg.policy_seed, "backend": cfg.backend,
                        **({} if kind == "cpu" else {"device": kind}),
                        **({"kernel_settings": settings} if settings else {})})[:16]


def task_data_fingerprint(cfg: RunConfig) -> str:
    """What the task's code feeds the warm start, which its config does not say: the class (``module:qualname``)
    and a hash of the first warm-start batch as trained on (prompt and target ids, and the free spans where
    ``warm_start.free_weight`` weights them). A task name is no identity: a plugin edited, or another module's task
    registered under the same name, trains other weights from the same config. One batch tells tasks apart;
    drawing every step's batch would cost seconds at long inputs for every key."""
    task = task_of(cfg)
    digest = hashlib.sha256()
    for problem in _batch(cfg, task, 0):
        target = encode_target(task.tokenizer, problem)
        span = task_free_span(task, problem, len(target)) if cfg.warm_start.free_weight is not None else None
        digest.update(repr((encode_prompt(task.tokenizer, problem), target, span)).encode())
    cls = type(task)
    return f"{cls.__module__}:{cls.__qualname__}:{digest.hexdigest()}"


def _batch(cfg: RunConfig, task: Task, step: int) -> list[Problem]:
    """The warm start's examples at ``step``."""
    ws = cfg.warm_start
    problems = training_problems(task, ws.batch_size, cfg.policy_seed + WARM_START_SEED_OFFSET, step)
    return task_warm_start_problems(task, problems, ws, step * ws.batch_size, ws.steps * ws.batch_size)


def _reward_only(mount: Any) -> bool:
    """Whether every settings class that declares this key says ``reward_only``: read by the reward alone, so the
    warm start (imitation of the task's targets) is the same whatever the key says."""
    return all(getattr(settings, "reward_only", False) for _, settings in mount.owners)


def _saved_default(f: dataclasses.Field) -> Any:
    """A field's default as ``to_dict`` writes it (lists, not tuples)."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return list(value) if isinstance(value, tuple) else value


def warm_start_cache_path(cfg: RunConfig) -> Path:
    """Where the warm start of ``cfg`` is cached (whether or not it is there yet)."""
    cache_dir = Path(cfg.warm_start.cache_dir or DEFAULT_WARMSTART_CACHE)
    return cache_dir / f"warmstart-{warm_start_key(cfg)}.safetensors"


LOCK_POLL_SECONDS = 0.2


def warm_start_lock_path(cfg: RunConfig) -> Path:
    """The lock file beside the cache entry: whoever holds it checks, trains and publishes that entry."""
    path = warm_start_cache_path(cfg)
    return path.with_name(path.name.removesuffix(".safetensors") + ".lock")


def warm_start(model: Transformer, cfg: RunConfig, task: Task, log: Callable[[str], None] = print) -> Path | None:
    """Load cached warm-start weights into ``model`` (fp32 master), or train and cache them -- once per key.

    Processes that share a cache (sweep workers, Ray tasks, ``--nproc`` ranks, separate ``vexact run``s) take a
    file lock on the entry around check -> train -> publish: the first trains and publishes the weights
    (``atomic.publish``: unique temp file, fsync, rename), every other one says in its log that it waits, and then
    loads what the first published. The lock is ``flock``-based (the ``filelock`` package): the OS releases it when
    its holder dies, however it dies, and the next waiter then trains. Loading needs no lock once the entry exists:
    it only ever appears whole. An entry that does not load (cut short, overwritten, not this model's) is rebuildable:
    one log line names it, and it is trained again under the lock and republished, the same bits as a cold cache."""
    if cfg.warm_start.steps == 0:
        return None
    path = warm_start_cache_path(cfg)
    damaged = None
    if path.exists():
        damaged = _try_load(model, path, log, "loaded")
        if damaged is None:
            return path
        log(f"warm start: {path} is damaged ({damaged}); retraining it")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(warm_start_lock_path(cfg))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"warm start: waiting for {path}: another process holds {lock.lock_file} and is training it")
        lock.acquire(poll_interval=LOCK_POLL_SECONDS)
    try:
        if path.exists():  # published while this process waited (or retrained over the damaged entry)
            failure = _try_load(model, path, log, "loaded (trained by the process this one waited for)")
            if failure is None:
                return path
            if damaged is None:  # damaged since this process looked (or found damaged only now): say so once
                log(f"warm start: {path} is damaged ({failure}); retraining it")
        else:
            log(f"warm start: no cache at {path}; training {cfg.warm_start.steps} supervised steps "
                "(cached afterwards)")
        _train(model, cfg, task)
        weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        publish(path, lambda tmp: save_file(weights, str(tmp)))
        log(f"warm start: trained here and cached {path}")
        return path
    finally:
        lock.release()


def free_token_weights(task: Task, problem: Problem, target_tokens: int, free_weight: float) -> torch.Tensor:
    """Per-token loss weights of one warm-start target: 1 for every token the reward reads, and ``free_weight``
    shared equally by the free span (``task.free_span``), so that span weighs the same whatever its length."""
    weights = torch.ones(target_tokens)
    span = task_free_span(task, problem, target_tokens)
    if span is not None and span[1] > span[0]:
        weights[span[0]:span[1]] = free_weight / (span[1] - span[0])
    return weights


def _try_load(model: Transformer, path: Path, log: Callable[[str], None], how: str) -> str | None:
    """Load the cached entry into ``model``: None, or why the entry is damaged, with ``model`` untouched (so a
    retrain starts from the same initial weights as on a cold cache)."""
    try:
        tensors = load_file(str(path))
    except Exception as error:  # noqa: BLE001 -- SafetensorError is neither OSError nor ValueError; any is damage
        return f"{type(error).__name__}: {error}"
    expected = model.state_dict()
    if tensors.keys() != expected.keys():
        return f"its tensors are not this model's ({len(tensors)} tensors, {len(expected)} expected)"
    for key, value in expected.items():
        if tensors[key].shape != value.shape or tensors[key].dtype != value.dtype:
            return (f"tensor {key} is {tuple(tensors[key].shape)} {tensors[key].dtype}, expected "
                    f"{tuple(value.shape)} {value.dtype}")
    try:
        model.load_state_dict(tensors)
    except Exception as error:  # checked above: not expected; the model may be half loaded, so no retrain here
        raise ValueError(f"warm start: {path} did not load ({type(error).__name__}: {error}); delete it and run "
                         "again (it is retrained)") from error
    log(f"warm start: {how} {path}")
    return None


def _train(model: Transformer, cfg: RunConfig, task: Task) -> None:
    ws = cfg.warm_start
    tokenizer = task.tokenizer
    optimizer = ExactAdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.99), weight_decay=0.0)
    for step in range(ws.steps):
        problems = _batch(cfg, task, step)
        prompts = [encode_prompt(tokenizer, p) for p in problems]
        targets = [encode_target(tokenizer, p) for p in problems]
        # Linear decay to 10% keeps the end of warm start calm.
        for group in optimizer.param_groups:
            group["lr"] = ws.lr * (1.0 - 0.9 * step / max(ws.steps - 1, 1))
        logprobs, _ = score_tokens(model, prompts, targets)
        if ws.free_weight is None:
            loss = -torch.cat(logprobs).mean()
        else:
            weights = torch.cat([free_token_weights(task, problem, len(target), ws.free_weight)
                                 for problem, target in zip(problems, targets)])
            weights = weights.to(model.device)  # built on the CPU; the model may be on a GPU
            loss = -(torch.cat(logprobs) * weights).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients_(list(model.parameters()), 1.0)
        optimizer.step()
