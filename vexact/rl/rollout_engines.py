"""Who samples the rollout batch (``rollout.engine``): vexact's own rollout path, or an outside inference engine.

An engine is an extension like a task or a log backend: a ``RolloutEngine`` registered in ``ROLLOUT_ENGINES``
(``register_rollout_engine``) under its name, with its own ``rollout.*`` settings. The trainer checks the engine
can run here when it is built (``check_available``: a missing package is one error naming its pip line, before the
warm start), opens a session at the first rollout (``open``), hands it the policy's current weights at every step
(``RolloutSession.collect``, which returns the ``RolloutBatch``) and closes it when the run ends, each through
``RolloutEngine.session``: a raise, or a result that breaks its contract (``check_batch``), is one error naming
the engine.

* ``vexact`` (the default) is ``collect_rollouts`` itself, on the step's ``RolloutPlan``: selecting it changes no
  bit of any run.
* ``vllm`` (``vexact.integrations.vllm_rollout``) samples with vLLM, whose log-probs become the rollout's: the
  hybrid-engine mismatch of real RL systems, as a source.

An engine that is not vexact's training path (``runs_training_path = False``) never claims a rollout bitwise equal
to training (the plan's ``matches_training`` is cleared), so the exactness check of the first mini-batch is not
asked of it.
"""

from __future__ import annotations

import importlib.util
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import Tensor

from ..registry import PluginCodeError, a_type, call_entry, entry_code, install_line
from .collect import RolloutBatch, collect_rollouts
from .config import ConfigError
from .registries import ROLLOUT_ENGINES

if TYPE_CHECKING:
    from ..engine.model import Transformer
    from .config_schema import RolloutSection, RunConfig
    from .inject import RolloutPlan
    from .tasks import CharTokenizer, Problem, Task

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "RolloutSession", "VexactEngine", "check_batch", "check_session",
           "register_rollout_engine"]


class RolloutSession(Protocol):
    """An open engine: samples each step's batch from the weights it is given, and is closed once."""

    def collect(self, model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                ) -> RolloutBatch: ...

    def close(self) -> None: ...


class RolloutEngine:
    """One ``rollout.engine`` entry: ``package``, the module it needs (None: nothing to install) and ``install``,
    the line that installs it (empty: ``pip install PACKAGE``); ``settings``, a dataclass of its own ``rollout.*``
    keys; ``runs_training_path``, whether it samples on vexact's own rollout path (the injector's plan applies to
    it); ``open``, its session."""

    name: ClassVar[str] = ""
    package: ClassVar[str | None] = None
    install: ClassVar[str] = ""
    settings: ClassVar[type | None] = None
    runs_training_path: ClassVar[bool] = False

    def check(self, world_size: int = 1) -> None:
        """Whether the engine can run here, for ``world_size`` data-parallel ranks: a ConfigError at
        ``rollout.engine`` naming the install line when ``package`` is missing (looked up, not imported)."""
        if self.package is not None and importlib.util.find_spec(self.package) is None:
            raise ConfigError(f"rollout engine {self.name!r} needs the {self.package!r} package, which is not "
                              f"installed in this Python environment: {install_line(self.package, self.install)}",
                              "rollout.engine")

    def open(self, cfg: RunConfig, run_dir: Path, world_size: int) -> RolloutSession:
        raise NotImplementedError

    def session(self, cfg: RunConfig, run_dir: Path, world_size: int) -> RolloutSession:
        """The session the trainer uses: ``open``'s (``check_session``), with ``open``, ``collect`` and ``close``
        called through ``call_entry`` and each batch checked (``check_batch``). Not for an engine to override (only the
        built-in ``vexact`` engine, vexact's own code, skips the checks)."""
        opened = call_entry(ROLLOUT_ENGINES.what, self.name, "open", self.open, cfg, run_dir, world_size)
        return _CheckedSession(self.name, check_session(self.name, opened))


def check_session(engine: str, session: object) -> RolloutSession:
    """``session``, what rollout engine ``engine``'s ``open`` returned, unless it lacks ``collect`` or ``close``:
    then one ``PluginCodeError`` naming the engine."""
    if not all(callable(getattr(session, f, None)) for f in ("collect", "close")):
        raise PluginCodeError(f"{entry_code(ROLLOUT_ENGINES.what, engine, 'open')} returned "
                              f"{a_type(session)}: expected a session with collect() and close()")
    return session  # type: ignore[return-value]


def check_batch(engine: str, batch: object, problems: int, samples_per_prompt: int, vocab: int) -> RolloutBatch:
    """``batch``, what rollout engine ``engine``'s ``collect`` returned for ``problems`` problems, unless it breaks
    the ``RolloutBatch`` contract; then one ``PluginCodeError`` naming the engine and what was expected:
    N = ``problems`` x ``samples_per_prompt`` sequences (problems, prompts, responses, logprobs, finished, each of
    length N), each prompt and response a list of Python int token ids in [0, ``vocab``) (the model's vocabulary: one
    min and max over the batch), rewards a float tensor of shape (N,), and each sequence's log-probs a 1-D float
    tensor with one value per response token. Log-probs on the CPU are also checked to be <= 0 (one reduction over
    the batch); on a device only their metadata is (no read back). Non-finite log-probs pass here: the step stops the
    run on them."""
    code = entry_code(ROLLOUT_ENGINES.what, engine, "collect")
    n = problems * samples_per_prompt
    if not isinstance(batch, RolloutBatch):
        raise PluginCodeError(f"{code} returned {a_type(batch)}: expected a RolloutBatch")
    for field in ("problems", "prompts", "responses", "logprobs", "finished"):
        got = getattr(batch, field)
        if not isinstance(got, list) or len(got) != n:
            size = f"{len(got)} {field}" if isinstance(got, list) else f"{field} as {a_type(got)}"
            raise PluginCodeError(f"{code} returned {size}: expected a list of {n} ({problems} problems x "
                                  f"{samples_per_prompt} samples_per_prompt)")
    for field in ("prompts", "responses"):  # an id outside the vocabulary would fail deep in the next forward
        sequences = getattr(batch, field)
        wrong = next((i for i, seq in enumerate(sequences) if not isinstance(seq, list)
                      or any(type(t) is not int for t in seq)), None)  # (bool and numpy ints are not token ids)
        if wrong is not None:
            seq = sequences[wrong]
            got = (a_type(seq) if not isinstance(seq, list)
                   else f"a list holding {a_type(next(t for t in seq if type(t) is not int))}")
            raise PluginCodeError(f"{code} returned {field} whose sequence {wrong} is {got}: expected a list of int "
                                  "token ids")
        ids = list(chain.from_iterable(sequences))
        low, high = (min(ids), max(ids)) if ids else (0, 0)
        if low < 0 or high >= vocab:
            raise PluginCodeError(f"{code} returned {field} with token ids in [{low}, {high}]: expected ids of the "
                                  f"model's vocabulary, in [0, {vocab})")
    rewards = batch.rewards
    if not isinstance(rewards, Tensor) or rewards.shape != (n,) or not rewards.dtype.is_floating_point:
        got = (f"shape {tuple(rewards.shape)}, {rewards.dtype}" if isinstance(rewards, Tensor)
               else a_type(rewards))
        raise PluginCodeError(f"{code} returned rewards of {got}: expected a float tensor of shape ({n},)")
    on_cpu = True
    for i, (lp, response) in enumerate(zip(batch.logprobs, batch.responses)):
        if not (isinstance(lp, Tensor) and lp.dim() == 1 and lp.dtype.is_floating_point
                and lp.numel() == len(response)):
            got = f"shape {tuple(lp.shape)}, {lp.dtype}" if isinstance(lp, Tensor) else a_type(lp)
            raise PluginCodeError(f"{code} returned log-probs of {got} for sequence {i}: expected a 1-D float tensor "
                                  f"of its {len(response)} response tokens' log-probs")
        on_cpu = on_cpu and lp.device.type == "cpu"
    flat = torch.cat(batch.logprobs) if on_cpu and n else None
    # one reduction over the batch (a NaN max passes: the step's finite check stops the run on it)
    if flat is not None and flat.numel() and bool(flat.max() > 0):
        ends = torch.tensor(batch.lengths).cumsum(0)
        first = int(torch.searchsorted(ends, int((flat > 0).nonzero()[0, 0]), right=True))
        raise PluginCodeError(f"{code} returned log-probs > 0 (sequence {first}): expected log-probabilities, "
                              "each <= 0")
    return batch


class _CheckedSession:
    """An engine's session whose every call names the engine when it fails (``RolloutEngine.session``)."""

    def __init__(self, engine: str, session: RolloutSession):
        self.engine, self.session = engine, session

    def collect(self, model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                ) -> RolloutBatch:
        batch = call_entry(ROLLOUT_ENGINES.what, self.engine, "collect", self.session.collect, model, plan, task,
                           tokenizer, problems, settings, seed, first_problem=first_problem)
        return check_batch(self.engine, batch, len(problems), settings.samples_per_prompt, model.config.vocab_size)

    def close(self) -> None:
        call_entry(ROLLOUT_ENGINES.what, self.engine, "close", self.session.close)


def register_rollout_engine(engine: RolloutEngine, replace: bool = False) -> RolloutEngine:
    """Register a rollout engine (a ``RolloutEngine`` instance) under its ``name``: ``rollout.engine: NAME`` selects
    it. A name already taken is an error unless ``replace``."""
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"register_rollout_engine needs a RolloutEngine instance, got {engine!r}")
    return ROLLOUT_ENGINES.add(engine.name, engine, replace=replace)


class _VexactSession:
    def collect(self, model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                ) -> RolloutBatch:
        return collect_rollouts(model, plan, task, tokenizer, problems, settings, seed, first_problem)

    def close(self) -> None:
        pass


class VexactEngine(RolloutEngine):
    """``vexact``: vexact's own rollout path (KV-cache generation on the step's plan: its kernels, dtype and
    injection); the default."""

    name = "vexact"
    runs_training_path = True

    def open(self, cfg: RunConfig, run_dir: Path, world_size: int) -> RolloutSession:
        return _VexactSession()

    def session(self, cfg: RunConfig, run_dir: Path, world_size: int) -> RolloutSession:
        """``collect_rollouts`` itself, unwrapped: vexact's own batch needs no contract check, and the check (a
        concatenation and a reduction of every log-prob) would cost every step of the default engine."""
        return self.open(cfg, run_dir, world_size)


register_rollout_engine(VexactEngine())
