"""The RL loop end to end on a shortened zero-mismatch experiment."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from conftest import interrupt_trainer_at, warm_start_cache
from rich.console import Console
from safetensors.torch import load_file

from vexact.cli import main
from vexact.records.runlog import latest_checkpoint, read_metrics
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.trainer import Trainer

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"


def _short(tmp_path: Path, name: str, *overrides: str):
    base = [f"output_dir={tmp_path / name}", f"warm_start.cache_dir={warm_start_cache(tmp_path)}",
            "warm_start.steps=30", "steps=6", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "task.eval_prompts=16", "logging.eval_every=3", "logging.checkpoint_every=2", "logging.live=false"]
    return load_config(EXPERIMENT, base + list(overrides))


def _run(cfg, resume: bool = False) -> dict:
    return Trainer(cfg, Console(quiet=True)).run(resume=resume)


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


def test_zero_mismatch_every_step_and_deterministic(tmp_path):
    first = _run(_short(tmp_path, "a"))
    assert first["status"] == "completed" and first["steps_completed"] == 6
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        assert r["mismatch/bitwise_equal_frac"] == 1.0
        assert r["rollout_corr/k3_kl"] == 0.0 and r["rollout_corr/kl"] == 0.0
        assert r["mismatch/first_minibatch_ratio_exact"] == 1.0
        assert r["actor/ratio_max"] == 1.0 and r["actor/ratio_min"] == 1.0
        for key in ("reward/mean", "reward/std", "reward/accuracy", "response_length/mean", "response_length/max",
                    "actor/entropy", "actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac",
                    "rollout_corr/log_ppl_abs_diff", "training/rollout_probs_diff_max", "timing/step"):
            assert key in r, key
    assert {"eval/reward_mean", "eval/greedy_accuracy"} <= set(rows[0])
    # Same config + seed: identical metrics apart from timings (the warm start comes from the cache now).
    _run(_short(tmp_path, "b"))
    assert _without_timing(read_metrics(tmp_path / "b" / "metrics.jsonl")) == _without_timing(rows)
    run_dir = tmp_path / "a"
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"} <= {p.name for p in run_dir.iterdir()}
    assert (latest_checkpoint(run_dir) / "checkpoint.safetensors").is_file()
    assert load_config(run_dir / "config.yaml") == _short(tmp_path, "a")


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_several_minibatches_and_epochs(tmp_path, old_logprobs):
    cfg = _short(tmp_path, old_logprobs, f"algorithm.old_logprobs={old_logprobs}", "algorithm.mini_batches=2",
                 "algorithm.ppo_epochs=2", "steps=2")
    assert _run(cfg)["status"] == "completed"
    for r in read_metrics(tmp_path / old_logprobs / "metrics.jsonl"):
        assert r["mismatch/bitwise_equal_frac"] == 1.0 and r["rollout_corr/k3_kl"] == 0.0
        assert r["mismatch/first_minibatch_ratio_exact"] == 1.0  # both sources: ratio exactly 1 before updates
        assert r["actor/ratio_max"] >= 1.0  # later mini-batches see updated weights


def test_resume_after_interrupt_loses_nothing(tmp_path, monkeypatch):
    _run(_short(tmp_path, "full"))
    reference = _without_timing(read_metrics(tmp_path / "full" / "metrics.jsonl"))

    cfg = _short(tmp_path, "cut")
    real_step = interrupt_trainer_at(monkeypatch, 5)
    summary = _run(cfg)
    assert summary["status"] == "interrupted" and summary["steps_completed"] == 5
    monkeypatch.setattr(Trainer, "step", real_step)
    summary = _run(cfg, resume=True)  # last checkpoint after step 3; steps 4.. recomputed
    assert summary["status"] == "completed"
    assert _without_timing(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == reference


def test_existing_run_dir_needs_resume(tmp_path):
    cfg = _short(tmp_path, "x", "steps=1")
    _run(cfg)
    with pytest.raises(ValueError, match="--resume"):
        _run(cfg)


def test_non_finite_values_end_the_run_cleanly(tmp_path, monkeypatch):
    cfg = _short(tmp_path, "nan", "steps=3")
    trainer = Trainer(cfg, Console(quiet=True))
    real_update = Trainer._update

    def poisoned(self, step, *args, **kwargs):
        if step == 1:
            weights = dict(self.master.state_dict())
            weights["layers.0.mlp.up_proj.weight"] = torch.full_like(weights["layers.0.mlp.up_proj.weight"], math.nan)
            self.load_policy(weights)
        return real_update(self, step, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_update", poisoned)
    summary = trainer.run()
    assert summary["status"] == "stopped" and "non-finite" in summary["reason"]
    assert summary["steps_completed"] == 1
    saved = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert saved["status"] == "stopped"


def test_a_last_update_that_breaks_the_logits_stops_the_run_at_its_evaluation(tmp_path, monkeypatch):
    """No rollout follows the last step's update: its evaluation is what sees the non-finite logits (it used to
    score them as a poor policy and end "completed"). The step's training row is written all the same, without
    eval keys (it was lost, while a step without evaluation whose update blows up keeps its row); the stopped run
    is finished: --resume does nothing."""
    cfg = _short(tmp_path, "nan_eval", "steps=2")
    real_update = Trainer._update

    def poisoned(self, step, *args, **kwargs):
        out = real_update(self, step, *args, **kwargs)
        if step == 1:
            weights = dict(self.master.state_dict())
            weights["layers.0.mlp.up_proj.weight"] = torch.full_like(weights["layers.0.mlp.up_proj.weight"], math.inf)
            self.load_policy(weights)
        return out

    monkeypatch.setattr(Trainer, "_update", poisoned)
    summary = _run(cfg)
    assert summary["status"] == "stopped"
    assert summary["reason"] == "non-finite eval log-probs (logits) at step 1"
    assert summary["steps_completed"] == 2 and summary["stopped_at_step"] == 1
    log = tmp_path / "nan_eval" / "metrics.jsonl"
    rows = read_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    assert {"actor/grad_norm", "actor/lr", "actor/ratio_max", "timing/step"} <= set(rows[1])
    assert not any(k.startswith("eval/") for k in rows[1]) and "timing/eval" not in rows[1]
    assert summary["last_step_metrics"]["step"] == 1
    written = log.read_bytes()
    assert _run(cfg, resume=True)["status"] == "stopped" and log.read_bytes() == written


@pytest.mark.parametrize("overrides", [
    ("algorithm.advantage=rloo", "algorithm.loss_agg=seq_mean"),
    ("algorithm.advantage=reinforce", "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01"),
    ("dtype=bfloat16",),
])
def test_algorithm_variants_keep_zero_mismatch(tmp_path, overrides):
    cfg = _short(tmp_path, "v", "steps=2", *overrides)
    assert _run(cfg)["status"] == "completed"
    rows = read_metrics(tmp_path / "v" / "metrics.jsonl")
    assert all(r["mismatch/bitwise_equal_frac"] == 1.0 for r in rows)
    if "algorithm.kl_coef=0.1" in overrides:
        assert "actor/kl_loss" in rows[0]


def test_native_backend_shows_mismatch(tmp_path):
    cfg = _short(tmp_path, "native", "backend=native", "steps=2")
    assert _run(cfg)["status"] == "completed"
    rows = read_metrics(tmp_path / "native" / "metrics.jsonl")
    assert any(r["mismatch/bitwise_equal_frac"] < 1.0 for r in rows)
    assert all("mismatch/first_minibatch_ratio_exact" not in r for r in rows)  # not asserted off the exact path


def test_cli_run_and_config_errors(tmp_path, capsys):
    args = ["run", str(EXPERIMENT), "--set", f"output_dir={tmp_path / 'cli'}", "--set",
            f"warm_start.cache_dir={warm_start_cache(tmp_path)}", "--set", "warm_start.steps=5", "--set", "steps=1",
            "--set", "task.eval_prompts=4", "--set", "rollout.prompts_per_step=2"]
    assert main(args) == 0
    assert (tmp_path / "cli" / "summary.json").exists()
    assert main(["run", str(EXPERIMENT), "--set", "rollout.temprature=1.0"]) == 2
    err = capsys.readouterr().err
    assert "rollout.temprature" in err and "Traceback" not in err
    assert main(["run", str(EXPERIMENT), "--set", "model.max_seq_len=16"]) == 2
    assert "model.max_seq_len" in capsys.readouterr().err


def test_config_defaults_make_a_valid_trainer():
    cfg = config_from_dict({"name": "defaults"})
    trainer = Trainer(cfg, Console(quiet=True))
    assert trainer.model_config.vocab_size == trainer.tokenizer.vocab_size


def _common(rows_a: list[dict], rows_b: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rows restricted to the keys both runs log, without timings."""
    keys = set(rows_a[0]) & set(rows_b[0])
    strip = [{k: v for k, v in r.items() if k in keys} for r in _without_timing(rows_a)]
    return strip, [{k: v for k, v in r.items() if k in keys} for r in _without_timing(rows_b)]


@pytest.mark.parametrize("mode,methods", [
    ("rollout", ["token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_rs"]),
    ("recompute", ["token_tis", "geo_rs"]),
])
def test_zero_mismatch_corrections_are_bitwise_no_ops(tmp_path, mode, methods):
    """With zero mismatch every ρ is exactly 1, so a corrected run equals the uncorrected run bit for bit:
    every logged metric and the final weights, in bypass and in decoupled mode (two mini-batches there)."""
    extra = [f"algorithm.old_logprobs={mode}", "steps=3", "logging.checkpoint_every=3"]
    if mode == "recompute":
        extra.append("algorithm.mini_batches=2")
    _run(_short(tmp_path, "plain", *extra))
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    plain_weights = load_file(str(latest_checkpoint(tmp_path / "plain") / "checkpoint.safetensors"))
    for method in methods:
        _run(_short(tmp_path, method, *extra, f"correction.method={method}", "correction.batch_normalize=true"))
        rows = read_metrics(tmp_path / method / "metrics.jsonl")
        # what the loss applied: every weight exactly 1 (verl's rollout_is_mean divides by N + 1e-8), nothing cut
        assert all(r.get("correction/weight_mean", 1.0) == 1.0 and r["correction/rejected_token_frac"] == 0
                   and r["correction/zeroed_token_frac"] == 0 for r in rows), method
        a, b = _common(plain, rows)
        assert a == b, method
        weights = load_file(str(latest_checkpoint(tmp_path / method) / "checkpoint.safetensors"))
        assert all(torch.equal(plain_weights[k], weights[k]) for k in plain_weights), method


def test_correction_and_triggered_schedule_under_injection(tmp_path):
    """Under injected mismatch the correction acts (weights != 1, truncation counted) and a mismatch-triggered
    schedule fires, is logged per step and lands in summary.json with its reason."""
    summary = _run(_short(tmp_path, "inj", "inject.mode=logit_scale", "inject.epsilon=-0.5",
                          "correction.method=token_tis", "lr_schedule.kind=mismatch_triggered",
                          "lr_schedule.mismatch_threshold=0.01", "lr_schedule.mismatch_window=2",
                          "lr_schedule.decay_period=2", "optimizer.warmup_steps=0"))
    rows = read_metrics(tmp_path / "inj" / "metrics.jsonl")
    assert any(r["correction/truncated_token_frac"] > 0 for r in rows)
    assert all(r["rollout_corr/rollout_is_max"] <= 2.0 for r in rows)
    sched = summary["lr_schedule"]
    assert sched["kind"] == "mismatch_triggered" and sched["trigger_step"] == 1 and sched["decay_period"] == 2
    assert "rollout_corr/k3_kl" in sched["trigger_reason"]
    assert [r["lr_schedule/triggered"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    base = rows[0]["actor/lr"]
    assert [r["actor/lr"] for r in rows] == [base, base, base / 2, base / 2, base / 4, base / 4]


def test_warm_start_seed_fixes_the_starting_policy_across_run_seeds():
    """warm_start.seed decouples the starting policy (init + warm-start data) from the RL seed."""
    from vexact.rl.warmstart import warm_start_key

    plain0, plain1 = config_from_dict({"seed": 0}), config_from_dict({"seed": 1})
    fixed1 = config_from_dict({"seed": 1, "warm_start": {"seed": 0}})
    assert warm_start_key(fixed1) == warm_start_key(plain0) != warm_start_key(plain1)
    assert fixed1.policy_seed == 0 and plain1.policy_seed == 1
    a, b = Trainer(fixed1, Console(quiet=True)), Trainer(plain0, Console(quiet=True))
    assert all(torch.equal(x, y) for x, y in zip(a.master.state_dict().values(), b.master.state_dict().values()))


def test_a_task_with_other_data_under_the_same_name_gets_its_own_warm_start():
    """Two tasks registered in turn as "echo" (a plugin edited, or another module's), one config: the warm-start
    key was the config's alone, so the second run loaded the weights trained on the first task's answers."""
    import random

    from test_tasks import DigitsTask

    from vexact.rl.tasks import TASKS, Problem
    from vexact.rl.warmstart import warm_start_key

    class Echo(DigitsTask):
        name = "echo_twice"

        def max_answer_len(self) -> int:
            return self.max_len + 1

    class EchoReversed(Echo):  # the same prompts, other answers
        def sample(self, rng: random.Random) -> Problem:
            digits = self.digits(rng)
            return Problem(self._prompt(digits), digits[::-1] + "0")

    class EchoAgain(Echo):  # the same data from another class
        pass

    def key(cls: type) -> str:
        TASKS.add(cls.name, cls, replace=True)
        try:
            return warm_start_key(config_from_dict({"task": {"name": cls.name}}))
        finally:
            TASKS.remove(cls.name)

    assert key(Echo) == key(Echo)
    assert len({key(Echo), key(EchoReversed), key(EchoAgain)}) == 3


def test_partial_credit_runs_share_the_warm_start(tmp_path):
    """task.partial_credit is read by the reward alone: the warm start (imitation of the targets) trains the same
    bits either way, so it is not in the key (it was: a partial-credit run retrained an identical warm start)."""
    from vexact.rl.warmstart import warm_start_key

    def cfg(partial: bool, cache: str):
        return config_from_dict({"threads": 1, "model": {"preset": "tiny"}, "task": {"partial_credit": partial},
                                 "warm_start": {"steps": 2, "batch_size": 4, "cache_dir": str(tmp_path / cache)}})

    exact, partial = cfg(False, "a"), cfg(True, "b")
    assert warm_start_key(exact) == warm_start_key(partial)
    a, b = Trainer(exact, Console(quiet=True)), Trainer(partial, Console(quiet=True))  # each trains its own
    assert all(torch.equal(x, y) for x, y in zip(a.master.state_dict().values(), b.master.state_dict().values()))


def test_a_kernel_setting_that_changes_bits_gets_its_own_warm_start_key(monkeypatch):
    """``VEXACT_CPU_EXACT_PATH=fixed-order`` and ``VEXACT_CPU_ONEDNN=off`` train other bits than the defaults: a
    warm start cached under the default's key, loaded by such a run, gave it other bits than its cold start (the
    key ignored them). The settings that compute the defaults' bits (``canonical``, the loops' modes) and every
    backend they do not touch keep the key from before."""
    from vexact.rl.warmstart import warm_start_key
    from vexact_kernels import cpu_exact

    exact = config_from_dict({"model": {"preset": "tiny"}})
    native = config_from_dict({"model": {"preset": "tiny"}, "backend": "native"})
    default_exact, default_native = warm_start_key(exact), warm_start_key(native)
    keys = {}
    for mode, onednn in (("canonical", True), ("fixed-order", True), ("auto", False), ("fixed-order", False)):
        monkeypatch.setattr(cpu_exact.HOST, "mode", mode)
        monkeypatch.setattr(cpu_exact.HOST, "onednn", onednn)
        keys[mode, onednn] = warm_start_key(exact)
        assert warm_start_key(native) == default_native
    assert keys["canonical", True] == default_exact
    assert len({default_exact, keys["fixed-order", True], keys["auto", False], keys["fixed-order", False]}) == 4


def test_a_runs_summary_names_the_settings_and_warm_start_behind_its_bits(tmp_path):
    """Two runs of one config on one host differ only through these: the versions, the kernels' process settings
    and the warm start they loaded; ``summary.json`` recorded none of them."""
    import vexact_kernels
    from vexact.rl.warmstart import warm_start_key
    from vexact.version import __version__

    cfg = config_from_dict({"threads": 1, "steps": 1, "model": {"preset": "tiny"}, "output_dir": str(tmp_path / "r"),
                            "warm_start": {"steps": 2, "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
                            "logging": {"live": False}})
    summary = _run(cfg)
    assert summary["versions"] == {"vexact": __version__, "torch": torch.__version__}
    assert summary["kernel_settings"] == vexact_kernels.kernel_settings()
    assert set(summary["kernel_settings"]) == {"VEXACT_CPU_EXACT_PATH", "VEXACT_CPU_ONEDNN", "VEXACT_CPU_LOOPS"}
    assert summary["warm_start_key"] == warm_start_key(cfg)
    assert (tmp_path / "cache" / f"warmstart-{summary['warm_start_key']}.safetensors").is_file()
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["warm_start_key"] == summary["warm_start_key"]


def test_a_resume_under_other_bit_changing_kernel_settings_is_refused(tmp_path, monkeypatch):
    """A run started with the defaults and resumed under ``VEXACT_CPU_EXACT_PATH=fixed-order`` continued with other
    bits -- matching neither setting's uninterrupted run -- and its summary named only the last setting. The
    checkpoint records ``kernel_bits``; a resume under others is one error naming both, before any step."""
    from vexact_kernels import cpu_exact

    def cfg(steps: int):
        return config_from_dict({"threads": 1, "steps": steps, "model": {"preset": "tiny"},
                                 "output_dir": str(tmp_path / "r"), "logging": {"live": False, "checkpoint_every": 1},
                                 "warm_start": {"steps": 2, "batch_size": 4, "cache_dir": str(tmp_path / "cache")}})

    assert _run(cfg(1))["status"] == "completed"
    state = json.loads((latest_checkpoint(tmp_path / "r") / "trainer_state.json").read_text())
    assert state["kernel_bits"] == {}
    lines = len(read_metrics(tmp_path / "r" / "metrics.jsonl"))
    monkeypatch.setattr(cpu_exact.HOST, "mode", "fixed-order")
    with pytest.raises(ValueError, match=r"cannot resume .* under other kernel settings: its steps were computed "
                                         r"with the defaults \(none of them set\), this process has "
                                         r"VEXACT_CPU_EXACT_PATH=fixed-order; resume it with the same"):
        Trainer(cfg(2), Console(quiet=True)).run(resume=True, allow_changes=("steps",))
    assert len(read_metrics(tmp_path / "r" / "metrics.jsonl")) == lines  # refused before any step
    monkeypatch.undo()  # (the process's guard as every other test finds it: nothing ran under fixed-order)
    assert Trainer(cfg(2), Console(quiet=True)).run(resume=True, allow_changes=("steps",))["steps_completed"] == 2


def _step_path(trainer: Trainer, step: int) -> list[str]:
    """The vexact/rl modules ``trainer.step(step)`` enters, in order: each call from trainer.py into another rl
    module, or from another module back into trainer.py, once per call site (a loop's later passes repeat it);
    consecutive calls into one module are one visit. data_parallel's rank primitives are left out: the ranks object
    serves the rollout's share, the gradient pass's gather and the leaves' sum, as a value every stage holds."""
    import sys

    rl = str(Path(__file__).resolve().parents[2] / "vexact" / "rl") + "/"
    seen, path = set(), []

    def rl_caller(frame):
        while frame is not None and not frame.f_code.co_filename.startswith(rl):
            frame = frame.f_back
        return frame

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(rl):
            return
        caller = rl_caller(frame.f_back)
        callee, origin = Path(frame.f_code.co_filename).stem, caller and Path(caller.f_code.co_filename).stem
        if caller is None or origin == callee or "trainer" not in (origin, callee) or callee == "data_parallel":
            return
        if (caller.f_code, caller.f_lineno, frame.f_code) not in seen:
            seen.add((caller.f_code, caller.f_lineno, frame.f_code))
            if not path or path[-1] != callee:
                path.append(callee)

    sys.setprofile(profile)
    try:
        trainer.step(step)
    finally:
        sys.setprofile(None)
    return path


def test_the_step_enters_each_stage_module_once_in_data_flow_order(tmp_path):
    """rollout -> score -> advantages -> loss -> update -> metrics, with every decision the step takes on (recompute
    anchors, a correction, the KL reference, policy lag, several mini-batches): no module is entered twice and
    nothing calls back into the trainer (scoring is a value the trainer holds, data-parallel or not)."""
    cfg = _short(tmp_path, "flow", "warm_start.steps=5", "algorithm.old_logprobs=recompute",
                 "correction.method=token_tis", "inject.mode=logit_noise", "inject.sigma=0.05",
                 "algorithm.mini_batches=2", "rollout.policy_lag=1", "algorithm.kl_coef=0.05", "threads=1")
    trainer = Trainer(cfg, Console(quiet=True))
    trainer._prepare(False, ())
    trainer.step(0)  # step 1 samples from the lagged policy
    path = _step_path(trainer, 1)
    trainer.close()
    assert path == ["inject", "collect", "rollout_engines", "scoring", "advantages", "schedules", "objective", "optim",
                    "step_metrics"], path


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_cli_injection_errors_are_one_line(tmp_path, capsys, one_torch_thread):
    config = _tiny(tmp_path)
    err = _error(["run", str(config), "--set", "inject.value=0.5"], capsys)
    assert "inject.value" in err and "inject.mode" in err
    err = _error(["run", str(config), "--set", "inject.mode=logit_noise"], capsys)
    assert "needs inject.sigma" in err
    assert not (tmp_path / "runs").exists()  # refused before any work


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_an_empty_config_file_is_refused(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="is empty"):
        load_config(path)
    err = _error(["run", str(path)], capsys)
    assert str(path) in err and "{}" in err
    (tmp_path / "braces.yaml").write_text("{}\n")  # the way to ask for every default
    assert load_config(tmp_path / "braces.yaml").name == "run"


def _tiny(tmp_path: Path) -> Path:
    spec = yaml.safe_load(EXPERIMENT.read_text())
    spec.update(steps=2, threads=1, output_dir=str(tmp_path / "runs" / "tiny"))
    spec["warm_start"].update(steps=5, cache_dir=str(tmp_path / "cache"))
    spec["rollout"].update(prompts_per_step=2, samples_per_prompt=2)
    spec["task"]["eval_prompts"] = 4
    spec["logging"].update(live=False, eval_every=1, checkpoint_every=1)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_resume_of_a_run_that_does_not_exist_is_refused(tmp_path, capsys):
    config = _tiny(tmp_path)
    never = tmp_path / "runs" / "never"
    err = _error(["run", str(config), "--resume", f"--set=output_dir={never}"], capsys)
    assert f"cannot resume {never}: there is no run there" in err
    assert shlex.join(["vexact", "run", str(config), f"--set=output_dir={never}"]) in err  # the command to start it
    assert not never.exists()  # refused before anything was written
    never.mkdir(parents=True)  # a directory, but no run in it
    assert "holds no config.yaml" in _error(["run", str(never), "--resume"], capsys)


def test_run_directory_resume_collision_and_rename(tmp_path, capsys, one_torch_thread):
    config = _tiny(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    assert main(["run", str(config)]) == 0
    capsys.readouterr()

    # a second start into the same directory: the error spells out both ways on
    err = _error(["run", str(config), "--set=seed=1"], capsys)
    assert f"to continue it: vexact run {run_dir} --resume" in err
    rename = shlex.join(["vexact", "run", str(config), "--set=seed=1", f"--set=output_dir={run_dir}-2"])
    assert f"to start another beside it: {rename}" in err, err
    assert main(shlex.split(rename)[1:]) == 0  # the suggested command works as printed
    assert len(read_metrics(Path(f"{run_dir}-2") / "metrics.jsonl")) == 2
    capsys.readouterr()

    # the run directory alone resumes from its own config.yaml: no --set repeated; more steps with --allow-change
    assert main(["run", str(run_dir), "--resume", "--set=steps=3", "--allow-change=steps"]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    capsys.readouterr()
    err = _error(["run", str(run_dir), "--resume", "--set=seed=5"], capsys)  # still the run's own config
    assert "different config" in err and "seed" in err
    err = _error(["run", str(run_dir)], capsys)  # a directory without --resume: say both commands
    assert f"vexact run {run_dir} --resume" in err and f"vexact run {run_dir / 'config.yaml'} --set name=" in err
