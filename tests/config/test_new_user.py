"""Tried as a new user would: no silent misconfiguration, run directories that fit habits, and the shipped
configs under ``--nproc`` 1, 2 and 4 as they are.

Each misconfiguration used to run (exit 0) with no word said: a value without a mode injected nothing, a mode
without a value injected zero, an empty file ran every default, and ``--resume`` of a run that never existed
started a fresh one. Each is now one ``error:`` line (exit 2) naming what is missing.
"""

from __future__ import annotations

import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from vexact.cli import main
from vexact.records.runlog import latest_checkpoint, read_metrics
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.data_parallel import check_leaves
from vexact.sweeps.sweep import load_sweep_spec

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "zero_mismatch.yaml"


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# --------------------------------------------------------------------------- inject: a value needs a mode and back
@pytest.mark.parametrize("overrides,key,words", [
    (["inject.value=0.5"], "inject.value", ["would inject nothing", "no inject.mode", "logit_noise"]),
    (["inject.mode=logit_noise"], "inject.mode", ["needs inject.value", "sigma", "inject.target"]),
    (["inject.mode=logit_scale"], "inject.mode", ["needs inject.value", "epsilon"]),
    (["inject.mode=top_k"], "inject.mode", ["needs inject.value"]),
    (["inject.mode=precision", "inject.value=0.3"], "inject.value", ["not used by mode 'precision'",
                                                                      "inject.precision"]),
])
def test_an_injection_that_would_do_nothing_is_refused(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, overrides)
    assert err.value.key == key and all(w in str(err.value) for w in words), str(err.value)
    assert f"(from --set {overrides[-1] if key == 'inject.value' else overrides[0]})" in str(err.value)


def test_what_injection_configs_may_still_say():
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.value=0"]).inject.value == 0.0  # a baseline
    assert config_from_dict({}, ["inject.mode=logit_noise", "inject.target.value=0.01"]).inject.target.value == 0.01
    assert config_from_dict({}, ["inject.mode=precision"]).inject.mode == "precision"  # no knob needed
    assert config_from_dict({"inject": {"mode": "none", "value": 0.0}}).inject.mode == "none"  # as saved
    saved = config_from_dict({}, ["inject.mode=top_p", "inject.value=0.9"]).to_dict()
    assert config_from_dict(saved).inject.value == 0.9  # a saved config.yaml loads as it was


def test_cli_injection_errors_are_one_line(tmp_path, capsys, one_torch_thread):
    config = _tiny(tmp_path)
    err = _error(["run", str(config), "--set", "inject.value=0.5"], capsys)
    assert "inject.value" in err and "inject.mode" in err
    err = _error(["run", str(config), "--set", "inject.mode=logit_noise"], capsys)
    assert "needs inject.value" in err
    assert not (tmp_path / "runs").exists()  # refused before any work


# --------------------------------------------------------------------------- empty config file
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


# --------------------------------------------------------------------------- run directories
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


# --------------------------------------------------------------------------- shipped configs under --nproc
def _shipped_configs() -> list[tuple[str, object]]:
    """Every run config and every sweep point the repository ships (experiments/ and the demo)."""
    configs = []
    for path in sorted((ROOT / "experiments").glob("*.yaml")) + [ROOT / "vexact" / "sweeps" / "demo_sweep.yaml"]:
        raw = yaml.safe_load(path.read_text())
        if {"grid", "variants"} & set(raw) and "horizons" not in raw:
            configs += [(f"{path.name}:{p.name}", p.config) for p in load_sweep_spec(path).points]
        elif "base" not in raw:
            configs.append((path.name, load_config(path)))
    return configs


@pytest.mark.slow
def test_shipped_configs_run_under_nproc_1_2_and_4_as_they_are():
    configs = _shipped_configs()
    assert len(configs) > 20 and any(name == "zero_mismatch.yaml" for name, _ in configs)
    refused = []
    for name, cfg in configs:  # loading checked that each mini-batch cuts into distributed.leaves leaves
        for nproc in (1, 2, 4):
            try:
                check_leaves(cfg.distributed.leaves, nproc)
            except ValueError:
                refused.append(f"{name} --nproc {nproc}")
    assert refused == []
    with pytest.raises(ValueError, match="distributed.leaves"):  # what the old default (1) said to --nproc 2
        check_leaves(1, 2)


# --------------------------------------------------------------------------- faults that used to slip
def _compare(capsys, *args: str) -> tuple[int, str]:
    code = main(["compare", *map(str, args)])
    return code, capsys.readouterr().err


def test_compare_refuses_a_positive_log_prob_naming_file_line_and_id(tmp_path, capsys):
    """+0.7 is a probability of 2: not a log-prob. Up to +1e-3 (rounding of a near-certain token) is accepted."""
    one = tmp_path / "one.jsonl"
    one.write_text('{"id": "a", "rollout_log_probs": [-0.5, -0.1], "old_log_probs": [-0.5, -0.1]}\n'
                   '{"id": "b", "rollout_log_probs": [-0.2, 0.7], "old_log_probs": [-0.2, 0.7]}\n')
    code, err = _compare(capsys, one)
    assert code == 2 and err.startswith(f"error: {one}:2: id 'b': 'rollout_log_probs'[1] is 0.7: a log-prob is at "
                                        "most 0 (accepted up to +0.001"), err
    assert "probability of 2.014" in err and err.count("\n") == 1

    roll, train = tmp_path / "roll.jsonl", tmp_path / "train.jsonl"
    roll.write_text('{"id": 1, "logprobs": [-0.3, 0.0005]}\n')  # within the rounding tolerance
    train.write_text('{"id": 1, "logprobs": [-0.3, 0.002]}\n')
    code, err = _compare(capsys, roll, train)
    assert code == 2 and f"{train}:1: id 1: 'logprobs'[1] is 0.002" in err, err
    train.write_text('{"id": 1, "logprobs": [-0.3, 0.0005]}\n')
    assert _compare(capsys, roll, train)[0] == 0

    tensors = tmp_path / "batch.pt"
    logp = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 3.5, -0.6]])
    torch.save({"rollout_log_probs": logp, "old_log_probs": logp, "response_mask": torch.ones(2, 3)}, tensors)
    code, err = _compare(capsys, tensors)
    assert code == 2 and f"{tensors}: row 1: 'rollout_log_probs' at column 1 is 3.5: a log-prob" in err, err


@pytest.mark.slow
def test_a_hostile_torch_file_gets_the_error_line_and_nothing_before_it(tmp_path):
    """torch's weights-only unpickler warns about the pickle protocol before refusing; that warning is noise."""
    path = tmp_path / "hostile.pt"
    path.write_bytes(pickle.dumps(_Hostile(), protocol=4))
    done = subprocess.run([sys.executable, "-m", "vexact", "compare", str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 2
    assert done.stderr == f"error: refusing to unpickle {path}: not a plain tensor file\n", done.stderr


class _Hostile:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# Limits of the test below, for a loaded 2-core host, not an idle one. At load 12-20 the whole test took 60-140 s,
# but a `--nproc 2` run that took ~55 s 44 times took 268 s once (a stall before its ranks' trainers started), and
# one resumed step took 218 s: stalls of that size break limits of 300 s (to get going) and 30 s (for the ranks to
# die: a SIGKILLed rank inside fsync dies only when that write completes). This test failed once in a fresh-clone CI
# run at load ~5, at a limit its output did not name (the launcher's output went to /dev/null); now every failure
# shows it. The limits still end a hang.
GET_GOING_S, RANKS_DIE_S, RERUN_S = 900, 120, 900


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_sigkilled_launcher_and_a_rerun_resumes(tmp_path):
    """kill -9 of `vexact run --nproc 2`: both ranks die with it (they used to write every remaining step and
    summary.json), and the run directory takes a re-run at once (no rank holds its lock)."""
    config = _tiny(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    output = tmp_path / "launcher.out"  # what the launcher and its ranks printed: shown by a failing assertion
    with open(output, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "vexact", "run", str(config), "--nproc=2",
                                     "--set=steps=500", "--set=logging.eval_every=100", "--set=distributed.leaves=4"],
                                    stdout=out, stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        started = time.monotonic()
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir / "metrics.jsonl")) < 2:
            assert launcher.poll() is None, f"the launcher exited {launcher.returncode}:\n{_tail(output)}"
            assert time.monotonic() - started < GET_GOING_S, f"no 2 steps in {GET_GOING_S} s:\n{_tail(output)}"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks), (ranks, _tail(output))
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in ranks) and time.monotonic() - killed < RANKS_DIE_S:
            time.sleep(0.1)
        alive = [(pid, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) for pid in ranks
                 if _alive(pid)]
        assert alive == [], f"a rank outlived its launcher by {RANKS_DIE_S} s (pid, state): {alive}"
    finally:
        for pid in [launcher.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    lines = len(read_metrics(run_dir / "metrics.jsonl"))
    time.sleep(1.0)
    assert len(read_metrics(run_dir / "metrics.jsonl")) == lines and not (run_dir / "summary.json").exists()

    done = latest_checkpoint(run_dir)
    assert done is not None
    steps = int(done.name.rsplit("-", 1)[1]) + 2  # one step beyond the last checkpoint
    rerun = subprocess.run([sys.executable, "-m", "vexact", "run", str(run_dir), "--resume", "--nproc=2",
                            f"--set=steps={steps}", "--allow-change=steps"], capture_output=True, text=True,
                           timeout=RERUN_S)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(steps))
