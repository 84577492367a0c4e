"""The surge mechanism on a reduced setting: RL grows the response length when the reward favours the
worked trace, and not when it does not.

The real surge needs the warm-started policy to *learn* that the trace pays (a 3-layer model, minutes of CPU:
``experiments/surge_testbed.yaml``, measured in docs/results/surge.md). Here a one-layer model with a 40-step warm
start cannot add well either way, so the trace's advantage is given directly: the reward is 1 for a terminated
response in the rewarded form (the trace for the surge case, the direct answer for the counter-case) and 0 else.
Everything else is the real loop: the task's prompts and mixture warm start, GRPO, the collapse detector's surge
rule and the length-triggered LR schedule. The two cases differ only in which form the reward favours.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from vexact.records.runlog import read_metrics
from vexact.rl.config import config_from_dict
from vexact.rl.surge_task import SurgeTask
from vexact.rl.tasks import EOS_ID, Problem
from vexact.rl.trainer import Trainer


def _form_reward(trace_pays: bool):
    """A stand-in for the learned advantage: 1.0 for a terminated response in the rewarded form, else 0.0. The
    trace form is a whole trace (one digit per input digit, ``=``, a digit), the direct form ``=`` and a digit;
    the digits' values are not checked."""
    tok = SurgeTask(1, 1).tokenizer

    def reward(self: SurgeTask, problem: Problem, response_ids) -> float:
        ids = [int(i) for i in response_ids]
        if EOS_ID not in ids:
            return 0.0
        text = tok.decode(ids)
        digits = len(problem.prompt) - len("c:=")
        body, equals, answer = text.rpartition("=")
        form_ok = bool(equals) and len(answer) == 1 and body.isdigit() == bool(body)
        return float(form_ok and len(body) == (digits if trace_pays else 0))

    return reward


def _run(tmp_path: Path, name: str) -> tuple[dict, list[dict]]:
    cfg = config_from_dict({
        "name": name, "output_dir": str(tmp_path / name), "seed": 0, "steps": 40, "threads": 1,
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
                  "max_seq_len": 32},
        "task": {"name": "surge", "min_len": 8, "max_len": 8, "eval_prompts": 8},
        "warm_start": {"steps": 200, "lr": 1e-2, "batch_size": 32, "trace_fraction": 0.1,
                       "cache_dir": str(tmp_path / "cache")},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 16},
        "optimizer": {"lr": 2e-4, "warmup_steps": 0},
        "lr_schedule": {"kind": "length_triggered"},
        "logging": {"eval_every": 100, "checkpoint_every": 100, "live": False},
    })
    summary = Trainer(cfg, Console(quiet=True)).run()
    return summary, read_metrics(tmp_path / name / "metrics.jsonl")


def _lengths(rows: list[dict]) -> list[float]:
    return [r["response_length/mean"] for r in rows]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize("trace_pays", [True, False], ids=["trace_pays", "direct_pays"])
def test_length_surges_only_when_the_trace_pays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               trace_pays: bool) -> None:
    monkeypatch.setattr(SurgeTask, "reward", _form_reward(trace_pays))
    summary, rows = _run(tmp_path, "run")
    lengths = _lengths(rows)
    start, end = sum(lengths[:3]) / 3, sum(lengths[-5:]) / 5
    surge = summary["collapse"]["length_surge_step"]
    schedule = summary["lr_schedule"]
    if trace_pays:
        assert end >= 2 * start, (start, end)  # the mean length grew >= 2x ...
        # ... with the reward (from about 0.01: to 0.77 on the AMD host's library bits, 0.26 on fixed-order's, whose
        # other bits make another trajectory of the same run, its surge at step 16 rather than 26)
        assert _mean(rows[-5:], "reward/mean") > _mean(rows[:3], "reward/mean") + 0.2
        assert surge is not None  # ... the detector saw it ...
        assert schedule["trigger_step"] == surge and schedule["decay_period"] == round(1.8 * surge)  # ... and fired
        assert rows[-1]["actor/lr"] < rows[surge]["actor/lr"] or schedule["decay_period"] + surge > 40
    else:
        assert end < 1.5 * start, (start, end)  # the counter-case: no growth ...
        assert surge is None and schedule["trigger_step"] is None  # ... nothing for the detector or the schedule
