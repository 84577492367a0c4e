"""The rollout path: KV-cache generation (prefill, then one token per step), recording the
log-prob of every sampled token as the sampler saw it -- the numbers an RL trainer would
otherwise get from its inference engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .decode_graph import CudaGraphRecorder, DecodeStep, Recorder
from .inputs import (
    check_batch_size,
    check_model,
    check_temperature,
    check_token_lists,
    pad_right,
    scale_logits,
)
from .model import KernelOps, KVCache, RouteHook, Routing, Transformer
from .sampling import sample_tokens
from .seeds import check_seed

CACHE_BLOCK = 64  # cache length rounded up to whole attention tiles
# Decode steps between checks whether every row has finished (only with an EOS). The check reads a flag back to the
# host: free on the CPU, so every step there; on a GPU a sync that drains the launch queue each step, so every
# GPU_EOS_CHECK_EVERY-th step, at the price of up to GPU_EOS_CHECK_EVERY - 1 steps past the last EOS. No bit
# depends on it: each row is cut at its own EOS, and a finished row decodes padding that is dropped.
GPU_EOS_CHECK_EVERY = 8


def eos_check_interval(device: torch.device) -> int:
    """``generate``'s default ``eos_check_every`` on ``device``: 1 on the CPU, else ``GPU_EOS_CHECK_EVERY``."""
    return 1 if device.type == "cpu" else GPU_EOS_CHECK_EVERY

# (scaled fp32 logits [B, V], sequence ids [B], response positions [B]) ->
# (logits to sample from, logits whose log-prob of the sampled token is recorded)
LogitsHook = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class GenerateOutput:
    """``tokens[i]``: generated ids for prompt i (EOS included when hit);
    ``logprobs[i]``: float32 log-prob of each under the temperature-scaled sampling distribution."""

    tokens: list[list[int]]
    logprobs: list[Tensor]
    finished: list[bool] = field(default_factory=list)  # True where EOS was produced
    # MoE models: per sequence, the experts each MoE layer used at every position the model read (prompt, then
    # each generated token but the last), int64 [positions, n_moe_layers, k] ascending; None for a dense model
    routing: list[Tensor] | None = None


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 1.0,
             seed: int = 0, batch_size: int | None = None, eos_token_id: int | None = None,
             logits_hook: LogitsHook | None = None, ops: KernelOps | None = None, first_index: int = 0,
             routing_hook: RouteHook | None = None, eos_check_every: int | None = None,
             cuda_graphs: bool = False) -> GenerateOutput:
    """Sample continuations of ``prompts`` with a KV cache.

    Sampling is counter-based (see ``vexact.engine.sampling``): prompt i's tokens depend only on
    (seed, i, position) and its logits, so ``batch_size`` (None = all at once) changes speed,
    never results. ``temperature=0`` is greedy (log-probs then under temperature 1).
    Generation of a sequence stops after ``eos_token_id`` (if given) or ``max_new_tokens``.
    ``logits_hook`` (rollout-side mismatch injection, see ``vexact.rl.inject``) may replace the
    logits that are sampled from and those the recorded log-prob is taken under.
    ``ops``: the kernel ops the rollout path runs (default ``model.ops``); the injector's
    ``RolloutPlan`` carries them, so the model itself is never switched.
    ``first_index``: the index of ``prompts[0]`` in the whole batch, when this call generates one shard of it
    (data-parallel ranks): prompt i is keyed as ``first_index + i``, so the shards give the whole batch's tokens.
    ``routing_hook`` (MoE models; rollout-side routing mismatch, see ``vexact.rl.inject_modes``) changes the experts
    the router chose; its draws are keyed by (sequence index, position, layer). An MoE model's routing is recorded
    in ``GenerateOutput.routing`` (what router replay gives the training path: ``token_logprobs(..., routing=)``).
    ``eos_check_every``: with an EOS, look whether every row has finished once in this many steps (None: the
    device's ``eos_check_interval``); a speed knob only, the outputs are the same bits whatever it is.
    ``cuda_graphs``: on a GPU, record the decode step once in a CUDA graph and replay it each step
    (``vexact.engine.decode_graph``): the same kernels on the same buffers, so the same bits, without the launch
    overhead of an eager step. A dense model on a CUDA device only (an MoE model records its routing on the host).
    """
    check_model(model, ops)
    cfg = model.config
    prompts = check_token_lists("prompts", prompts, cfg.vocab_size)
    temperature = check_temperature(temperature)
    check_seed(seed)
    check_batch_size("batch_size", batch_size)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len ({cfg.max_seq_len})"
        )
    if not isinstance(first_index, int) or isinstance(first_index, bool) or first_index < 0:
        raise ValueError(f"first_index must be a non-negative int, got {first_index!r}")
    if eos_token_id is not None and (not isinstance(eos_token_id, int) or isinstance(eos_token_id, bool)):
        raise ValueError(f"eos_token_id must be a token id (an int) or None, got {eos_token_id!r}")
    if eos_token_id is not None and not 0 <= eos_token_id < cfg.vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary [0, {cfg.vocab_size})")
    check_batch_size("eos_check_every", eos_check_every)  # a positive int or None, as a batch size
    if eos_check_every is None:
        eos_check_every = eos_check_interval(model.device)

    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and cfg.moe_layers:
        raise ValueError("cuda_graphs=True: an MoE model's decode step records its routing on the host each step, "
                         "which a CUDA graph cannot replay; use cuda_graphs=False")
    if cuda_graphs and model.device.type != "cuda":
        raise ValueError(f"cuda_graphs=True records the decode step in a CUDA graph: it needs a model on a CUDA "
                         f"device, not {model.device}")
    recorder = CudaGraphRecorder(model.device) if cuda_graphs else None
    if routing_hook is not None and not cfg.moe_layers:
        raise ValueError("routing_hook changes an MoE model's routing, but this model has no MoE layers "
                         "(ModelConfig.num_experts is 0)")
    step = batch_size or len(prompts)
    tokens: list[list[int]] = []
    logprobs: list[Tensor] = []
    finished: list[bool] = []
    routing: list[Tensor] | None = [] if cfg.moe_layers else None
    for start in range(0, len(prompts), step):
        chunk = _generate_batch(model, prompts[start : start + step], first_index + start, max_new_tokens,
                                temperature, seed, eos_token_id, logits_hook, model.ops if ops is None else ops,
                                routing_hook, eos_check_every, recorder)
        tokens += chunk.tokens
        logprobs += chunk.logprobs
        finished += chunk.finished
        if routing is not None and chunk.routing is not None:
            routing += chunk.routing
    return GenerateOutput(tokens, logprobs, finished, routing)


def prefill(model: Transformer, prompts: Tensor, lengths: Tensor, cache: KVCache, ops: KernelOps,
            routing: Routing | None = None) -> Tensor:
    """The prompts' forward: fills ``cache`` and gives the first next-token logits.

    Takes the right-padded prompts [B, T] (int64), each prompt's length ``lengths`` [B], a fresh ``cache`` of at
    least T positions, the kernel ``ops`` and the MoE ``routing`` of this forward (None for a dense model). Writes
    every prompt position's keys and values into ``cache`` (a padded slot only into its own row, where the decode
    overwrites it) and returns the logits [B, V] (model dtype, unscaled) at each prompt's last token.

    Bit-identical to the training path because it is the training path's forward: the same
    ``Transformer.forward`` and ``Transformer.logits`` on the same ops, whose every op gives a row the same bits
    whatever the other rows, the batch size and the sequence length hold (the exact ops' contract); the cache
    only stores the keys and values the forward computed.
    """
    hidden = model(prompts, cache=cache, ops=ops, routing=routing)
    last = hidden[torch.arange(len(lengths), device=hidden.device), lengths - 1]
    return model.logits(last, ops)


def decode_one_token(model: Transformer, token: Tensor, positions: Tensor, cache: KVCache, ops: KernelOps,
                     routing: Routing | None = None) -> Tensor:
    """One token's forward from the cache: gives the logits of the token after it.

    Takes the token just sampled per row, ``token`` [B] (int64), its absolute position ``positions`` [B], the
    ``cache`` the prefill and earlier decode steps filled, the kernel ``ops`` and this forward's MoE ``routing``.
    Writes the token's keys and values at ``positions`` and returns the logits [B, V] (model dtype, unscaled)
    for the token after it. The positions are not checked against the cache here (``generate`` checks them where the
    rollout starts), so a step reads no value back from its tensors.

    Bit-identical to the training path for the same reason as ``prefill``: it is the same
    ``Transformer.forward`` (a query length of 1 and ``q_start=positions``) and ``Transformer.logits``; the exact
    attention sums over fixed key tiles from position 0 and masks every position after the query's, so a token's
    logits do not depend on whether its context came from the cache or from the same forward, nor on the
    cache's length.
    """
    hidden = model(token[:, None], q_start=positions, cache=cache, ops=ops, routing=routing,
                   q_start_checked=True)[:, 0]  # (generate checks the positions where the rollout starts)
    return model.logits(hidden, ops)


def _generate_batch(model: Transformer, prompts: list[list[int]], first_index: int, max_new_tokens: int,
                    temperature: float, seed: int, eos_token_id: int | None,
                    logits_hook: LogitsHook | None, ops: KernelOps, routing_hook: RouteHook | None = None,
                    eos_check_every: int = 1, recorder: Recorder | None = None) -> GenerateOutput:
    """One batch of ``generate``: ``prefill``, then sample and ``decode_one_token`` until every row stopped;
    with a ``recorder`` (a dense model), each decode step after the first replays the first one's recording."""
    device = model.device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    sequence_ids = torch.arange(first_index, first_index + batch, device=device)
    cache_len = -(-(int(lengths.max()) + max_new_tokens) // CACHE_BLOCK) * CACHE_BLOCK
    cache = model.new_cache(batch, cache_len)
    moe = bool(model.config.moe_layers)
    records: list[list[Tensor]] = []  # per forward (prefill, then each decode step): each MoE layer's experts

    def routing() -> Routing | None:
        if not moe:
            return None
        records.append([])
        return Routing(hook=routing_hook, sequence_ids=sequence_ids, record=records[-1])

    out_tokens = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    n_steps = 0
    recorded = None if recorder is None else DecodeStep(
        lambda token, positions: decode_one_token(model, token, positions, cache, ops), batch, device, recorder)
    next_logits = prefill(model, pad_right(prompts, device), lengths, cache, ops, routing())
    for t in range(max_new_tokens):
        logits = scale_logits(next_logits, temperature)
        positions = torch.full((batch,), t, dtype=torch.long, device=device)
        sample_logits = record_logits = logits
        if logits_hook is not None:
            sample_logits, record_logits = logits_hook(logits, sequence_ids, positions)
        token = sample_tokens(sample_logits, seed, sequence_ids, positions, greedy=temperature == 0.0)
        if eos_token_id is not None:
            token = torch.where(done, 0, token)  # finished rows keep decoding padding, ignored
        out_tokens[:, t] = token
        out_logprobs[:, t] = ops.token_logprobs(record_logits, token)
        n_steps = t + 1
        if t == max_new_tokens - 1:
            break
        if eos_token_id is not None:  # without an EOS no row finishes early: no check (a host sync) per step
            done |= token == eos_token_id
            if (t + 1) % eos_check_every == 0 and bool(done.all()):
                break
        if recorded is not None:
            next_logits = recorded(token, lengths + t)
        else:
            next_logits = decode_one_token(model, token, lengths + t, cache, ops, routing())
    return _outputs(prompts, out_tokens[:, :n_steps], out_logprobs, eos_token_id, records if moe else None)


def _outputs(prompts: list[list[int]], out_tokens: Tensor, out_logprobs: Tensor, eos_token_id: int | None,
             records: list[list[Tensor]] | None) -> GenerateOutput:
    """Each row's tokens and log-probs up to and including its EOS, and (MoE) the routing of the positions read."""
    tokens, logprobs, finished = [], [], []
    for b in range(len(prompts)):
        seq = out_tokens[b].tolist()
        n = len(seq)
        if eos_token_id is not None and eos_token_id in seq:
            n = seq.index(eos_token_id) + 1
        tokens.append(seq[:n])
        logprobs.append(out_logprobs[b, :n].clone())
        finished.append(eos_token_id is not None and n > 0 and seq[n - 1] == eos_token_id)
    if records is None:
        return GenerateOutput(tokens, logprobs, finished)
    # [B, positions read, n_moe_layers, k]: the prefill's positions, then one per decode step
    read = torch.cat([torch.stack(layers, dim=2) for layers in records], dim=1)
    prompt_len = read.shape[1] - (len(records) - 1)  # the padded prompt length
    routing = [torch.cat([read[b, : len(p)], read[b, prompt_len : prompt_len + max(len(seq) - 1, 0)]])
               for b, (p, seq) in enumerate(zip(prompts, tokens))]
    return GenerateOutput(tokens, logprobs, finished, routing)
