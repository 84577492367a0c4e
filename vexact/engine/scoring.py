"""The training path: teacher-forced full-sequence forward giving each response token's
log-prob -- what an RL trainer recomputes for its loss. Differentiable when grad is on."""

from __future__ import annotations

import torch
from torch import Tensor

from .head import head_scores
from .inputs import check_batch_size, check_model, check_temperature, check_token_lists, pad_right, scale_logits
from .model import KernelOps, Routing, Transformer, check_expert_ids, check_expert_shape


def token_logprobs(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
                   temperature: float = 1.0, micro_batch_size: int | None = None, ops: KernelOps | None = None,
                   routing: list[Tensor] | None = None) -> list[Tensor]:
    """log p(response[i][j] | prompt[i], response[i][:j]) for every response token, float32.

    One forward per micro-batch of ``micro_batch_size`` sequences (None = all at once) over
    prompt + response; ``temperature`` scales logits as in ``generate`` (0 = unscaled);
    ``ops``: the kernel ops to run (default ``model.ops``).
    ``routing`` (MoE models: router replay): per sequence, the experts every MoE layer uses at each position the
    forward reads, as ``GenerateOutput.routing`` records them, instead of the router's own choice.
    Returns one tensor per sequence (empty for an empty response).
    """
    prompts, responses = check_sequences(model, prompts, responses, micro_batch_size, ops)
    temperature = check_temperature(temperature)
    return score_tokens(model, prompts, responses, temperature, micro_batch_size, ops=ops, routing=routing)[0]


def check_sequences(model: Transformer, prompts: object, responses: object, micro_batch_size: int | None,
                    ops: KernelOps | None) -> tuple[list[list[int]], list[list[int]]]:
    """The training path's inputs (``token_logprobs``, ``token_routing``): the model and ``ops`` (``check_model``),
    ``prompts`` non-empty token-id lists, ``responses`` token-id lists (possibly empty), one response per prompt,
    each prompt + response within ``max_seq_len``, ``micro_batch_size`` a positive int or None. One ValueError naming
    what is wrong; else (prompts, responses) as lists of int lists."""
    check_model(model, ops)
    cfg = model.config
    prompts = check_token_lists("prompts", prompts, cfg.vocab_size)
    responses = check_token_lists("responses", responses, cfg.vocab_size, allow_empty_items=True)
    check_batch_size("micro_batch_size", micro_batch_size)
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > cfg.max_seq_len:
            raise ValueError(f"sequence {i}: prompt ({len(p)}) + response ({len(r)}) exceeds max_seq_len "
                             f"({cfg.max_seq_len})")
    return prompts, responses


def check_routing(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
                  routing: list[Tensor] | None) -> None:
    """A ValueError naming what is wrong unless ``routing`` (router replay) fits the model and the sequences: one
    [positions read, n_moe_layers, k] tensor of expert ids per sequence."""
    if routing is None:
        return
    cfg = model.config
    if not cfg.moe_layers:
        raise ValueError("routing (router replay) was given, but the model has no MoE layers "
                         "(ModelConfig.num_experts is 0)")
    if len(routing) != len(prompts):
        raise ValueError(f"routing holds {len(routing)} sequences, expected one per prompt ({len(prompts)})")
    for i, (p, r, chosen) in enumerate(zip(prompts, responses, routing)):
        what, k = f"routing of sequence {i}", cfg.num_experts_per_tok
        # any integer dtype: _replay converts the ids to int64
        check_expert_shape(chosen, what, (_positions_read(p, r), len(cfg.moe_layers), k),
                           "positions read = prompt + response - 1, MoE layers, num_experts_per_tok")
        check_expert_ids(chosen, what, cfg.num_experts, k, on_device=True)  # once per call, before any forward


def _positions_read(prompt: list[int], response: list[int]) -> int:
    """Positions the training forward reads: the prompt and every response token but the last (only a target)."""
    return len(prompt) + max(len(response) - 1, 0)


def score_tokens(model: Transformer, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0,
                 micro_batch_size: int | None = None, with_entropy: bool = False, ops: KernelOps | None = None,
                 routing: list[Tensor] | None = None) -> tuple[list[Tensor], list[Tensor] | None]:
    """``token_logprobs`` (inputs already validated) plus, optionally, the entropy of the
    temperature-scaled distribution at every response position (for ``actor/entropy``)."""
    check_routing(model, prompts, responses, routing)
    step = micro_batch_size or len(prompts)
    ops = model.ops if ops is None else ops
    logprobs: list[Tensor] = []
    entropies: list[Tensor] | None = [] if with_entropy else None
    for start in range(0, len(prompts), step):
        part = None if routing is None else routing[start : start + step]
        lp, ent = _score_batch(model, prompts[start : start + step], responses[start : start + step], temperature,
                               with_entropy, ops, part)
        logprobs += lp
        if entropies is not None:
            entropies += ent
    return logprobs, entropies


def full_logprobs(model: Transformer, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0,
                  ops: KernelOps | None = None) -> Tensor:
    """[N, V] float32 log-softmax of the temperature-scaled logits at every response position (N = all response
    tokens, in order): one forward of these (validated) sequences, the same forward ``token_logprobs`` runs, for
    comparing whole next-token distributions. [0, V] when every response is empty."""
    ops = model.ops if ops is None else ops
    logits = _response_logits(model, prompts, responses, temperature, ops)
    if logits is None:
        return torch.zeros(0, model.config.vocab_size, device=model.device)
    return ops.log_softmax(logits)


def token_routing(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
                  micro_batch_size: int | None = None, ops: KernelOps | None = None) -> list[Tensor]:
    """The experts the training path's own router chooses (MoE models): per sequence, int64 [positions read,
    n_moe_layers, k], ascending, laid out as ``GenerateOutput.routing`` -- to compare with the rollout's routing.
    Inputs as ``token_logprobs``'s (``check_sequences``)."""
    prompts, responses = check_sequences(model, prompts, responses, micro_batch_size, ops)
    if not model.config.moe_layers:
        raise ValueError("token_routing needs an MoE model; this one has no MoE layers (ModelConfig.num_experts is 0)")
    ops = model.ops if ops is None else ops
    step = micro_batch_size or len(prompts)
    out: list[Tensor] = []
    with torch.no_grad():
        for start in range(0, len(prompts), step):
            inputs = [p + r[:-1] for p, r in zip(prompts[start : start + step], responses[start : start + step])]
            record: list[Tensor] = []
            model(pad_right(inputs, model.device), ops=ops, routing=Routing(record=record))
            chosen = torch.stack(record, dim=2)  # [B, T, n_moe_layers, k]
            out += [chosen[b, : len(seq)] for b, seq in enumerate(inputs)]
    return out


def _replay(routing: list[Tensor], lengths: list[int], k: int, device: torch.device) -> Tensor:
    """[B, T, n_moe_layers, k] replay tensor of per-sequence routing, right-padded with experts 0..k-1 (padding
    positions only change padding rows)."""
    layers = routing[0].shape[1]
    replay = torch.arange(k, device=device).expand(len(routing), max(lengths), layers, k).clone()
    for b, chosen in enumerate(routing):
        replay[b, : chosen.shape[0]] = chosen.to(device=device, dtype=torch.long)
    return replay


def _response_logits(model: Transformer, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                     ops: KernelOps, routing: list[Tensor] | None = None) -> Tensor | None:
    """Scaled logits [N, V] predicting every response token, in order; None when there are none."""
    hidden = _response_hidden(model, prompts, responses, ops, routing)
    return None if hidden is None else scale_logits(model.logits(hidden, ops), temperature)


def _response_hidden(model: Transformer, prompts: list[list[int]], responses: list[list[int]], ops: KernelOps,
                     routing: list[Tensor] | None = None) -> Tensor | None:
    """The final hidden states [N, D] predicting every response token, in order; None when there are none."""
    device = model.device
    # The last response token is only a target, never an input.
    inputs = [p + r[:-1] for p, r in zip(prompts, responses)]
    replay = None
    if routing is not None:
        replay = Routing(replay=_replay(routing, [len(s) for s in inputs], model.config.num_experts_per_tok, device))
    hidden = model(pad_right(inputs, device), ops=ops, routing=replay)
    # Response token j of sequence b is predicted at position len(prompt_b) - 1 + j.
    rows = [(b, len(p) - 1 + j) for b, (p, r) in enumerate(zip(prompts, responses)) for j in range(len(r))]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=device)
    return hidden[index[:, 0], index[:, 1]]


def _score_batch(model: Transformer, prompts: list[list[int]], responses: list[list[int]],
                 temperature: float, with_entropy: bool, ops: KernelOps, routing: list[Tensor] | None = None
                 ) -> tuple[list[Tensor], list[Tensor]]:
    """One forward's log-probs and (optionally) entropies, per sequence. The head and its log-softmax run over
    row passes (``head.head_scores``): memory bounded whatever the vocabulary and length, the same bits."""
    device = model.device
    hidden = _response_hidden(model, prompts, responses, ops, routing)
    if hidden is None:
        empty = [torch.zeros(0, device=device) for _ in prompts]
        return empty, empty
    lengths = [len(r) for r in responses]
    targets = torch.tensor([t for r in responses for t in r], dtype=torch.long, device=device)
    flat, entropy = head_scores(hidden, model.head_weight, targets, temperature, ops, with_entropy)
    return list(flat.split(lengths)), list(entropy.split(lengths)) if entropy is not None else []
