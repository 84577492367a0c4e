"""``vexact locate``'s ``vllm`` paths: vLLM's modules hooked inside its worker, at the op plan's site names.

``record_vllm`` starts ``vllm.LLM`` in a child process (as ``vexact.integrations.vllm`` does, for the same reasons:
vLLM's CPU worker binds threads and seeds global RNGs; no engine may outlive the call). There, ``collective_rpc``
runs ``_install`` in the worker, which registers forward hooks on the model the worker runs, then the requests run
one at a time (so each forward holds one request's tokens, in order: a prefill over its first tokens, then one
token per decode step), and ``collective_rpc(_collect)`` brings the recorded tensors back. The sites:

- ``embed`` (``embed_tokens``); per layer ``input_norm`` (the norm's output), ``q_proj``, ``k_proj``, ``v_proj``
  (the fused ``qkv_proj``'s output, split at vLLM's own q/kv sizes: a split is exact), ``attention`` (the input of
  ``o_proj``), ``o_proj``, ``resid_attn`` (the residual that ``post_attention_layernorm``'s fused add returns),
  ``post_norm``, ``gate_proj``, ``up_proj`` (``gate_up_proj`` split in halves), ``silu_mul`` (``act_fn``'s
  output), ``down_proj``, ``resid_mlp`` (the residual the next norm's fused add returns: the layer's output);
  ``final_norm``; ``logits``: ``compute_logits`` of vLLM's model over every row of each forward's final norm
  (vLLM itself computes logits only for the rows it samples from). RoPE runs inside vLLM's attention: no
  ``q_rope`` / ``k_rope``.

Kinds: ``rollout`` is vLLM's own generation: the prompt in one prefill, then ``max_new_tokens`` decode steps whose
tokens vLLM samples (seed ``seed + i`` for request i, EOS ignored); the sequences are vLLM's, so a rollout path comes
first (``--a``) and the other path runs its tokens. ``train`` runs each whole sequence as one prefill.

Needs vLLM (``vexact.integrations.vllm.VLLM_INSTALL``); without it, one ValueError naming the install line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..real.sites import register_site_recorder
from ..records.atomic import write_text_atomic
from .vllm import (
    VLLM_DTYPES,
    WORKER_ENV,
    _last_line,
    _run_child,
    error_line,
    read_child_result,
    require_vllm,
    start_llm,
)

_STATE: dict[str, Any] = {}  # the worker's recorder (the worker runs in vLLM's engine process)


# --------------------------------------------------------------------------- inside vLLM's worker
def _install(worker: Any) -> int:
    """Register the hooks on the worker's model; returns how many (``collective_rpc`` calls it in the worker)."""
    import re

    model = worker.model_runner.model
    state: dict[str, Any] = {"rows": {}, "specs": {}, "handles": [], "position": 0, "sequence": 0, "forward": []}
    _STATE.clear()
    _STATE.update(state)
    layer_of = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
    modules = dict(model.named_modules())
    layers = sorted({int(m[1]) for name in modules if (m := layer_of.search(name))})

    def keep(name: str, group: str, module: str, recorded: str, tensor: Any) -> None:
        if name not in _STATE["specs"]:
            _STATE["specs"][name] = {"name": name, "group": group, "module": module, "recorded": recorded,
                                     "feature_shape": list(tensor.shape[1:]),
                                     "dtype": str(tensor.dtype).removeprefix("torch.")}
        _STATE["forward"].append((name, tensor.detach().float().cpu().clone()))

    def first(out: Any) -> Any:
        return out[0] if isinstance(out, (tuple, list)) else out

    def hook(module: Any, fn: Any, pre: bool = False) -> None:
        if pre:
            _STATE["handles"].append(module.register_forward_pre_hook(lambda m, args: fn(args[0])))
        else:
            _STATE["handles"].append(module.register_forward_hook(lambda m, args, out: fn(out)))

    def on_embed(out: Any) -> None:
        _STATE["forward"] = []  # a forward starts
        keep("embed", "embed", "VocabParallelEmbedding", "output", first(out))

    hook(modules["model.embed_tokens"], on_embed)
    for i in layers:
        g = f"layer {i}"
        prefix = next(name for name in modules if name.endswith(f"layers.{i}"))
        attn, mlp = modules[f"{prefix}.self_attn"], modules[f"{prefix}.mlp"]
        norm_in, norm_post = modules[f"{prefix}.input_layernorm"], modules[f"{prefix}.post_attention_layernorm"]

        def on_input_norm(out: Any, g: str = g, i: int = i) -> None:
            if isinstance(out, (tuple, list)):  # the fused add: out[1] is the residual stream, layer i-1's output
                keep(f"layer {i - 1} / resid_mlp", f"layer {i - 1}", "RMSNorm (residual)", "output", out[1])
            keep(f"{g} / input_norm", g, "RMSNorm", "output", first(out))

        def on_qkv(out: Any, g: str = g, attn: Any = attn) -> None:
            q, k, v = first(out).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            for site, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                keep(f"{g} / {site}", g, "QKVParallelLinear", "output", t)

        def on_post_norm(out: Any, g: str = g) -> None:
            keep(f"{g} / resid_attn", g, "RMSNorm (residual)", "output", out[1])
            keep(f"{g} / post_norm", g, "RMSNorm", "output", out[0])

        def on_gate_up(out: Any, g: str = g) -> None:
            gate, up = first(out).chunk(2, dim=-1)
            keep(f"{g} / gate_proj", g, "MergedColumnParallelLinear", "output", gate)
            keep(f"{g} / up_proj", g, "MergedColumnParallelLinear", "output", up)

        hook(norm_in, on_input_norm)
        hook(attn.qkv_proj, on_qkv)
        hook(attn.o_proj, lambda x, g=g: keep(f"{g} / attention", g, "Attention", "input", x), pre=True)
        hook(attn.o_proj, lambda out, g=g: keep(f"{g} / o_proj", g, "RowParallelLinear", "output", first(out)))
        hook(norm_post, on_post_norm)
        hook(mlp.gate_up_proj, on_gate_up)
        hook(mlp.down_proj, lambda x, g=g: keep(f"{g} / silu_mul", g, "SiluAndMul", "input", x), pre=True)
        hook(mlp.down_proj, lambda out, g=g: keep(f"{g} / down_proj", g, "RowParallelLinear", "output", first(out)))

    last = f"layer {layers[-1]}"

    def on_final_norm(out: Any) -> None:
        keep(f"{last} / resid_mlp", last, "RMSNorm (residual)", "output", out[1])
        keep("final_norm", "head", "RMSNorm", "output", out[0])
        keep("logits", "head", "LogitsProcessor", "output", model.compute_logits(out[0]))
        _finish_forward()

    hook(modules["model.norm"], on_final_norm)
    return len(_STATE["handles"])


def _finish_forward() -> None:
    """One forward's tensors ([tokens, ...] each) go to the rows of the positions it covered."""
    tokens = {t.shape[0] for _, t in _STATE["forward"]}
    if len(tokens) != 1:
        raise RuntimeError(f"the sites of one forward cover different token counts {sorted(tokens)}")
    n = tokens.pop()
    start, b = _STATE["position"], _STATE["sequence"]
    for name, tensor in _STATE["forward"]:
        for offset in range(n):
            _STATE["rows"].setdefault(name, {})[(b, start + offset)] = tensor[offset].reshape(-1)
    _STATE["position"] += n
    _STATE["forward"] = []


def _start_sequence(worker: Any, b: int) -> None:
    _STATE["sequence"], _STATE["position"] = b, 0


def _collect(worker: Any) -> dict[str, Any]:
    """The recorded sites (name -> {(sequence, position): features}) and their specs; removes the hooks."""
    for handle in _STATE["handles"]:
        handle.remove()
    return {"specs": list(_STATE["specs"].values()), "rows": _STATE["rows"]}


# --------------------------------------------------------------------------- the child process
def _worker(request_path: str, result_path: str) -> int:
    """Start vLLM, hook its worker, run the requests one at a time, write the sites (safetensors) and the result."""
    request = json.loads(Path(request_path).read_text())
    try:
        import torch
        from safetensors.torch import save_file
        from vllm import SamplingParams

        llm = start_llm(request["model"], request["dtype"], request["max_model_len"], "processed_logprobs",
                        request["seed"])
        llm.collective_rpc(_install)
        sequences = []
        for b, tokens in enumerate(request["sequences"]):
            llm.collective_rpc(_start_sequence, args=(b,))
            if request["kind"] == "rollout":
                # one token more than kept: its decode step runs the last kept token (vLLM samples after a forward)
                params = SamplingParams(temperature=request["temperature"], max_tokens=request["max_new_tokens"] + 1,
                                        ignore_eos=True, detokenize=False, seed=request["seed"] + b)
            else:  # the whole sequence in one prefill; the one sampled token is not kept
                params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
            out = llm.generate([{"prompt_token_ids": tokens}], [params], use_tqdm=False)[0]
            new = list(out.outputs[0].token_ids)[:request["max_new_tokens"]] if request["kind"] == "rollout" else []
            sequences.append(list(tokens) + new)
        recorded = llm.collective_rpc(_collect)[0]
        rows = [(b, p) for b, s in enumerate(sequences) for p in range(len(s))]
        tensors = {}
        for spec in recorded["specs"]:
            by_row = recorded["rows"][spec["name"]]
            missing = [r for r in rows if r not in by_row]
            if missing:
                raise RuntimeError(f"site {spec['name']!r} was not recorded at sequence {missing[0][0]}, position "
                                   f"{missing[0][1]} (vLLM ran fewer forwards than expected)")
            tensors[spec["name"]] = torch.stack([by_row[r] for r in rows])
        save_file(tensors, str(Path(result_path).with_suffix(".safetensors")))
        result = {"sequences": sequences, "specs": recorded["specs"], "dtype": request["dtype"]}
    except Exception as err:  # vLLM raises many kinds (ValueError, RuntimeError, pydantic's ValidationError...)
        result = {"error": error_line(err)}
    write_text_atomic(result_path, json.dumps(result))  # whole or absent: the parent never reads half a result
    return 0


def record_vllm(model: Path, dtype: str, kind: str, sequences: list[list[int]], *, max_new_tokens: int = 0,
                temperature: float = 1.0, seed: int = 0, log_file: Path | None = None,
                timeout_s: float | None = None) -> tuple[list[list[int]], list[dict[str, Any]], dict[str, Any]]:
    """Run ``sequences`` (prompts, for ``rollout``) through vLLM on checkpoint directory ``model`` and record every
    site: (the sequences run, site specs in forward order, name -> [all positions of all sequences, features] in
    float32, rows sequence by sequence). ``dtype``: fp32 | bf16. One ValueError for vLLM missing or failing."""
    import torch
    from safetensors.torch import load_file

    require_vllm()
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(VLLM_DTYPES)}, got {dtype!r}")
    request = {"model": str(Path(model).resolve()), "dtype": VLLM_DTYPES[dtype], "kind": kind,
               "sequences": sequences, "max_new_tokens": max_new_tokens if kind == "rollout" else 0,
               "temperature": temperature, "seed": seed,
               "max_model_len": max(map(len, sequences)) + (max_new_tokens + 1 if kind == "rollout" else 1)}
    log_path = Path(log_file) if log_file is not None else Path(os.devnull)
    with tempfile.TemporaryDirectory(prefix="vexact-vllm-locate-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**WORKER_ENV, **os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        start = time.perf_counter()
        with open(log_path, "wb") as log:
            code = _run_child([sys.executable, "-m", "vexact.integrations.vllm_sites", str(req), str(res)], env, log,
                              timeout_s)
        result = read_child_result(res)
        if result is None or "error" in result:
            where = f" (its output: {log_file}; last line: {_last_line(log_path)})" if log_file is not None else ""
            what = result["error"] if result else f"its process exited with code {code} before returning a result"
            raise ValueError(f"vllm path: vLLM could not run {model}: {what}{where}")
        tensors = load_file(str(res.with_suffix(".safetensors")))
    # recorded as float32 copies of vLLM's tensors; each site's own dtype widens exactly, so narrowing back is exact
    store = {spec["name"]: tensors[spec["name"]].to(getattr(torch, spec["dtype"])) for spec in result["specs"]}
    result["seconds"] = time.perf_counter() - start
    return result["sequences"], result["specs"], store


register_site_recorder("vllm", record_vllm)  # loaded through the vexact.plugins entry points (pyproject.toml)

if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
