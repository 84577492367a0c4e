"""Who samples the rollout batch (``rollout.engine``): vexact's own rollout path, or an outside inference engine.

An engine is an extension like a task or a log backend: a ``RolloutEngine`` registered in ``ROLLOUT_ENGINES``
(``register_rollout_engine``) under its name, with its own ``rollout.*`` settings. The trainer checks the engine
can run here when it is built (``check_available``: a missing package is one error naming its pip line, before the
warm start), opens a session at the first rollout (``open``), hands it the policy's current weights at every step
(``RolloutSession.collect``, which returns the ``RolloutBatch``) and closes it when the run ends.

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
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from .collect import RolloutBatch, collect_rollouts
from .config import ConfigError
from .registries import ROLLOUT_ENGINES

if TYPE_CHECKING:
    from ..engine.model import Transformer
    from .config_schema import RolloutSection, RunConfig
    from .inject import RolloutPlan
    from .tasks import CharTokenizer, Problem, Task

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "RolloutSession", "VexactEngine", "register_rollout_engine"]


class RolloutSession(Protocol):
    """An open engine: samples each step's batch from the weights it is given, and is closed once."""

    def collect(self, model: Transformer, plan: RolloutPlan, task: Task, tokenizer: CharTokenizer,
                problems: list[Problem], settings: RolloutSection, seed: int, first_problem: int = 0
                ) -> RolloutBatch: ...

    def close(self) -> None: ...


class RolloutEngine:
    """One ``rollout.engine`` entry: ``package``, the module it needs (None: nothing to install) and ``install``,
    the line that installs it; ``settings``, a dataclass of its own ``rollout.*`` keys; ``runs_training_path``,
    whether it samples on vexact's own rollout path (the injector's plan applies to it); ``open``, its session."""

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
                              f"installed in this Python environment: {self.install}", "rollout.engine")

    def open(self, cfg: RunConfig, run_dir: Path, world_size: int) -> RolloutSession:
        raise NotImplementedError


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


register_rollout_engine(VexactEngine())
