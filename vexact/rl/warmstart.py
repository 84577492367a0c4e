"""Supervised warm start: teach the task a little so RL starts from a policy with non-zero
but imperfect reward. Deterministic (exact kernels, counter-seeded data) and cached on disk
(safetensors) keyed by everything that determines the weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..engine.model import Transformer
from ..engine.scoring import score_tokens
from .config import RunConfig, config_hash
from .runlog import apply_umask
from .tasks import Task, encode_prompt, encode_target, training_problems

WARM_START_SEED_OFFSET = 1_000_003  # keeps warm-start data apart from the RL prompt stream
CACHE_VERSION = 2  # bump whenever kernel numerics change: warm-start weights are bitwise products of them


def warm_start_key(cfg: RunConfig) -> str:
    """Hash of what determines warm-start weights (not the cache location or RL settings)."""
    plain = cfg.to_dict()
    plain["warm_start"].pop("cache_dir", None)
    plain["warm_start"].pop("seed", None)  # folded into "seed" below
    plain["task"].pop("eval_prompts", None)
    return config_hash({"version": CACHE_VERSION, "model": plain["model"], "task": plain["task"],
                        "warm_start": plain["warm_start"], "seed": cfg.policy_seed, "backend": cfg.backend})[:16]


def warm_start_cache_path(cfg: RunConfig) -> Path:
    """Where the warm start of ``cfg`` is cached (whether or not it is there yet)."""
    cache_dir = Path(cfg.warm_start.cache_dir or Path("runs") / ".warmstart_cache")
    return cache_dir / f"warmstart-{warm_start_key(cfg)}.safetensors"


def warm_start(model: Transformer, cfg: RunConfig, task: Task, log: Callable[[str], None] = print) -> Path | None:
    """Load cached warm-start weights into ``model`` (fp32 master), or train and cache them."""
    if cfg.warm_start.steps == 0:
        return None
    path = warm_start_cache_path(cfg)
    cache_dir = path.parent
    if path.exists():
        model.load_state_dict(load_file(str(path)))
        log(f"warm start: loaded {path}")
        return path
    log(f"warm start: no cache at {path}; training {cfg.warm_start.steps} supervised steps (cached afterwards)")
    _train(model, cfg, task)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    apply_umask(tmp)  # safetensors writes 0600; the cache is shared like any other file
    tmp.replace(path)
    log(f"warm start: cached {path}")
    return path


def _train(model: Transformer, cfg: RunConfig, task: Task) -> None:
    ws = cfg.warm_start
    tokenizer = task.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.99), weight_decay=0.0)
    for step in range(ws.steps):
        problems = training_problems(task, ws.batch_size, cfg.policy_seed + WARM_START_SEED_OFFSET, step)
        prompts = [encode_prompt(tokenizer, p) for p in problems]
        targets = [encode_target(tokenizer, p) for p in problems]
        # Linear decay to 10% keeps the end of warm start calm.
        for group in optimizer.param_groups:
            group["lr"] = ws.lr * (1.0 - 0.9 * step / max(ws.steps - 1, 1))
        logprobs, _ = score_tokens(model, prompts, targets)
        loss = -torch.cat(logprobs).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
