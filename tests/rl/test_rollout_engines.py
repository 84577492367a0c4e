"""A rollout engine's code is called through ``call_entry`` and what it returns is checked against the
``RolloutBatch`` contract: a plugin engine's mistake is one error naming it, not a traceback deep in the step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rich.console import Console
from test_trainer import _short

from vexact.cli_base import Terminated
from vexact.registry import PluginCodeError
from vexact.rl.collect import RolloutBatch
from vexact.rl.registries import ROLLOUT_ENGINES
from vexact.rl.rollout_engines import RolloutEngine, VexactEngine, check_batch, register_rollout_engine
from vexact.rl.trainer import Trainer

VOCAB = 8  # the model's vocabulary the batches below are checked against: ids 0 to 7


def _batch() -> RolloutBatch:
    """2 problems x 2 samples, responses of 3, 1, 0 and 2 tokens, every id in [0, VOCAB)."""
    responses = [[1, 2, 3], [4], [], [5, 6]]
    return RolloutBatch(["p0", "p0", "p1", "p1"], [[7]] * 4, responses,
                        [-torch.arange(1.0, len(r) + 1) for r in responses], [True, True, False, True],
                        torch.tensor([1.0, 0.0, 0.0, 1.0]))


@pytest.mark.parametrize("mutate, says", [
    (lambda b: None, "returned None: expected a RolloutBatch"),
    (lambda b: dataclasses.asdict(b), "returned a dict: expected a RolloutBatch"),
    (lambda b: b.subset([0, 1, 2]), "returned 3 problems: expected a list of 4 (2 problems x 2 samples_per_prompt)"),
    (lambda b: dataclasses.replace(b, rewards=b.rewards[:1]),
     "returned rewards of shape (1,), torch.float32: expected a float tensor of shape (4,)"),
    (lambda b: dataclasses.replace(b, rewards=[1.0] * 4), "returned rewards of a list"),
    (lambda b: dataclasses.replace(b, logprobs=[lp[:-1] for lp in b.logprobs]),
     "returned log-probs of shape (2,), torch.float32 for sequence 0: expected a 1-D float tensor of its 3"),
    (lambda b: dataclasses.replace(b, logprobs=[lp.long() for lp in b.logprobs]), "torch.int64 for sequence 0"),
    (lambda b: dataclasses.replace(b, logprobs=[lp.abs() if i == 3 else lp for i, lp in enumerate(b.logprobs)]),
     "returned log-probs > 0 (sequence 3): expected log-probabilities, each <= 0"),
    (lambda b: dataclasses.replace(b, responses=[[1, 2, 8], [4], [], [5, 6]]),
     "returned responses with token ids in [1, 8]: expected ids of the model's vocabulary, in [0, 8)"),
    (lambda b: dataclasses.replace(b, responses=[[1, 2, 3], [-1], [], [5, 6]]),
     "returned responses with token ids in [-1, 6]: expected ids of the model's vocabulary, in [0, 8)"),
    (lambda b: dataclasses.replace(b, prompts=[[7], [7], [7], [9]]),
     "returned prompts with token ids in [7, 9]: expected ids of the model's vocabulary, in [0, 8)"),
    (lambda b: dataclasses.replace(b, responses=[[1, 2, 3], ["4"], [], [5, 6]]),
     "returned responses whose sequence 1 is a list holding a str: expected a list of int token ids"),
    (lambda b: dataclasses.replace(b, responses=[[1, 2, 3], [4.0], [], [5, 6]]),
     "returned responses whose sequence 1 is a list holding a float: expected a list of int token ids"),
    (lambda b: dataclasses.replace(b, prompts=[[7], (7,), [7], [7]]),
     "returned prompts whose sequence 1 is a tuple: expected a list of int token ids"),
])
def test_an_engines_batch_breaking_the_contract_is_one_error_naming_it(mutate, says):
    assert check_batch("eng_x", _batch(), 2, 2, VOCAB) is not None  # the well-formed batch passes
    with pytest.raises(PluginCodeError) as e:
        check_batch("eng_x", mutate(_batch()), 2, 2, VOCAB)
    assert str(e.value).startswith("rollout engine 'eng_x' (collect) returned ") and says in str(e.value)


def test_float64_log_probs_and_non_finite_ones_are_left_to_the_run():
    b = _batch()
    b.logprobs = [lp.double() for lp in b.logprobs]
    b.logprobs[0][0] = float("nan")  # the step stops the run on it (RunStopped), as for the built-in engine
    check_batch("eng_x", b, 2, 2, VOCAB)


class _Session:
    def __init__(self, collect=None, close=None):
        self._collect, self._close = collect, close

    def collect(self, *args, **kwargs):
        batch = VexactEngine().open(None, None, 1).collect(*args, **kwargs)
        return self._collect(batch) if self._collect else batch

    def close(self):
        if self._close:
            self._close()


def _boom(what):
    def raise_():
        raise RuntimeError(f"boom in {what}")
    return raise_


@pytest.mark.parametrize("opens, says", [
    (_boom("open"), "rollout engine 'eng_x' (open) raised RuntimeError: boom in open"),
    (lambda: None, "rollout engine 'eng_x' (open) returned None: expected a session with collect() and close()"),
    (lambda: _Session(collect=lambda b: dataclasses.replace(b, logprobs=[lp[:-1] for lp in b.logprobs])),
     "rollout engine 'eng_x' (collect) returned log-probs of shape"),
    (lambda: _Session(close=_boom("close")), "rollout engine 'eng_x' (close) raised RuntimeError: boom in close"),
    (lambda: _Session(collect=lambda b: dataclasses.replace(
        b, responses=[[10**6, *r[1:]] if r else r for r in b.responses])),
     "rollout engine 'eng_x' (collect) returned responses with token ids in ["),  # a kernel's error, unnamed, before
])
def test_a_run_on_an_engine_that_fails_is_one_error_naming_it(tmp_path, opens, says):
    class Engine(RolloutEngine):
        name = "eng_x"

        def open(self, cfg, run_dir, world_size):
            return opens()

    register_rollout_engine(Engine())
    try:
        cfg = _short(tmp_path, "run", "rollout.engine=eng_x", "warm_start.steps=0", "steps=1",
                     "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "task.eval_prompts=2")
        with pytest.raises(PluginCodeError) as e:
            Trainer(cfg, Console(quiet=True)).run()
    finally:
        ROLLOUT_ENGINES.remove("eng_x")
    assert says in str(e.value)


@pytest.mark.parametrize("install, line", [("", "pip install no_such_pkg_zz"),
                                           ("pip install 'zz-tools[gpu]'", "pip install 'zz-tools[gpu]'")])
def test_an_engines_missing_package_names_its_install_line(install, line):
    """An engine that sets ``package`` and no ``install`` is told ``pip install PACKAGE``, not nothing."""
    from vexact.rl.config import ConfigError

    class Missing(RolloutEngine):
        name = "eng_missing"
        package = "no_such_pkg_zz"

    Missing.install = install
    with pytest.raises(ConfigError) as e:
        Missing().check()
    assert e.value.key == "rollout.engine" and e.value.problem == (
        "rollout engine 'eng_missing' needs the 'no_such_pkg_zz' package, which is not installed in this Python "
        f"environment: {line}")


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (Terminated, 143)], ids=["ctrl_c", "sigterm"])
def test_an_engine_failing_to_close_after_an_interrupt_leaves_the_interrupts_exit_code(tmp_path, capsys, stop, code):
    """Ctrl-C (or SIGTERM) while the engine samples, and then its close fails: the exit code stays the interrupt's,
    which a job scheduler acts on (it was 2, the close's error, before), and the close's failure is one stderr line
    naming the engine."""
    import yaml

    from vexact.cli import main

    def interrupt(batch):
        raise stop

    class Engine(RolloutEngine):
        name = "eng_x"

        def open(self, cfg, run_dir, world_size):
            return _Session(collect=interrupt, close=_boom("close"))

    register_rollout_engine(Engine())
    try:
        cfg = _short(tmp_path, "run", "rollout.engine=eng_x", "warm_start.steps=0", "steps=1",
                     "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "task.eval_prompts=2")
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(cfg.to_dict()))
        assert main(["run", str(config)]) == code
    finally:
        ROLLOUT_ENGINES.remove("eng_x")
    err = capsys.readouterr().err
    assert "error: rollout engine 'eng_x' (close) raised RuntimeError: boom in close\n" in err, err
