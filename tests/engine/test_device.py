"""The ``device`` setting: the default keeps the CPU's runs and bits, ``auto`` is the CPU here, a CUDA
device where there is none is one error (exit 2), and parallel workers share GPUs by index mod device count."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import warm_start_cache
from rich.console import Console
from safetensors.torch import load_file

from vexact.cli import DEVICE_COMMANDS, build_parser, main
from vexact.engine import devices
from vexact.engine.devices import (
    DeviceError,
    check_device_name,
    rank_device,
    resolve_device,
    same_device_kind,
    worker_device,
)
from vexact.engine.model import ModelConfig, Transformer
from vexact.records.runlog import latest_checkpoint, read_metrics
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.trainer import Trainer
from vexact.rl.warmstart import warm_start_key
from vexact.sweeps.ray_executor import task_config, task_resources
from vexact.sweeps.sweep import SweepPoint, point_config

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs (only the counting: nothing is allocated on them)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(devices, "cuda_device_count", lambda: n)
    return set_count


def _short(tmp_path: Path, name: str, *overrides: str):
    base = [f"output_dir={tmp_path / name}", f"warm_start.cache_dir={warm_start_cache(tmp_path)}",
            "warm_start.steps=10",
            "steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "task.eval_prompts=4",
            "logging.eval_every=1", "logging.checkpoint_every=2", "logging.live=false"]
    return load_config(EXPERIMENT, base + list(overrides))


def _without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


def test_default_is_cpu_and_cpu_or_auto_give_the_same_bits(tmp_path):
    """A run that names no device, one with ``device: cpu`` and (here, without CUDA) ``device: auto``: the same
    metrics and the same final weights, bit for bit."""
    assert config_from_dict({}).device == "cpu"
    runs = {"none": _short(tmp_path, "none"), "cpu": _short(tmp_path, "cpu", "device=cpu")}
    if NO_CUDA:
        runs["auto"] = _short(tmp_path, "auto", "device=auto")
    for cfg in runs.values():
        assert Trainer(cfg, Console(quiet=True)).run()["status"] == "completed"
    metrics = {k: _without_timing(read_metrics(tmp_path / k / "metrics.jsonl")) for k in runs}
    weights = {k: load_file(str(latest_checkpoint(tmp_path / k) / "checkpoint.safetensors")) for k in runs}
    for name in runs:
        assert metrics[name] == metrics["none"], name
        assert weights[name].keys() == weights["none"].keys()
        assert all(torch.equal(weights[name][k], weights["none"][k]) for k in weights["none"]), name


def test_cpu_init_keeps_its_bits():
    """Building on the device must not change how the CPU draws its weights: the init of every earlier run (a CPU
    generator, one ``randn`` per matrix in parameter order), written out here."""
    config = ModelConfig(vocab_size=31, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=48, max_seq_len=16, qk_norm=True)
    model = Transformer(config, init_seed=7)
    gen = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        scale = 0.02 / math.sqrt(2 * config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) \
            else 0.02
        assert torch.equal(p, torch.randn(p.shape, generator=gen) * scale), name


def test_warm_start_key_of_a_cpu_run_is_unchanged(gpus):
    """The CPU's cache entries stay valid: the device enters the key only off the CPU (checked against main's
    keys when this was written); a GPU run trains its own entry, shared by its GPUs."""
    gpus(0)
    key = warm_start_key(config_from_dict({}))
    assert warm_start_key(config_from_dict({"device": "cpu"})) == key == warm_start_key(
        config_from_dict({"device": "auto"}))
    cuda = warm_start_key(config_from_dict({"device": "cuda"}))
    assert cuda != key and cuda == warm_start_key(config_from_dict({"device": "cuda:1"}))


def test_auto_is_the_cpu_without_cuda_and_cuda_with_it(gpus):
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    gpus(2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")


def test_cuda_without_cuda_is_one_error_naming_the_key(gpus):
    gpus(0)
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda")
    assert "'device'" in str(err.value) and "CUDA" in str(err.value)
    gpus(2)
    with pytest.raises(DeviceError, match="GPU 2.*2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "", 3, None,
                                 "cuda:01", "cuda:007", "cuda:99999999999999999999"])  # torch.device's traceback
def test_bad_device_names_are_config_errors(bad):
    with pytest.raises(DeviceError):
        check_device_name(bad)
    with pytest.raises(ConfigError) as err:
        config_from_dict({"device": bad})
    assert err.value.key == "device"


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv", [["run", str(EXPERIMENT), "--device", "cuda"],
                                  ["run", str(EXPERIMENT), "--set", "device=cuda"],
                                  ["check", "--device", "cuda"],
                                  ["sweep", str(EXPERIMENT.parent / "collapse_sweep.yaml"), "--device", "cuda"],
                                  ["demo", "--device", "cuda"],
                                  ["locate", "--device", "cuda"],
                                  ["meter", str(EXPERIMENT.parent / "horizon_scaling_meter.yaml"), "--device", "cuda"]])
def test_cli_cuda_without_cuda_exits_2_with_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err and "device" in err
    assert not (tmp_path / "runs").exists()  # refused before any work


def test_every_device_command_takes_the_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in DEVICE_COMMANDS:
        flags = {f for action in sub.choices[name]._actions for f in action.option_strings}
        assert "--device" in flags, name
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["check", "--device", "gpu"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("count,expected", [(0, ["cpu"] * 5), (1, ["cuda:0"] * 5),
                                            (2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]),
                                            (4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0"])])
def test_worker_gpu_is_its_index_mod_the_device_count(count, expected):
    setting = "cuda" if count else "cpu"
    assert [worker_device(setting, slot, count) for slot in range(5)] == expected
    assert [worker_device("auto", slot, count) for slot in range(5)] == (expected if count else ["auto"] * 5)
    assert worker_device("cuda:3", 0, count) == "cuda:3"  # an explicit GPU is kept
    assert worker_device("cpu", 1, count) == "cpu"


def test_sweep_point_config_carries_the_worker_gpu(tmp_path, gpus):
    point = SweepPoint("p", {}, config_from_dict({"device": "cuda", "output_dir": str(tmp_path / "p")}))
    assert [point_config(point, slot, 3)["device"] for slot in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]
    cpu = SweepPoint("q", {}, config_from_dict({"output_dir": str(tmp_path / "q")}))
    assert point_config(cpu, 1, 3) == cpu.config.to_dict()  # the CPU's points run as before


def test_ranks_take_their_own_gpu(monkeypatch, gpus):
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cuda") == torch.device("cuda:1")
    assert rank_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert rank_device("cuda") == torch.device("cuda")


def test_data_parallel_uses_nccl_for_a_cuda_device(monkeypatch):
    from vexact.rl import data_parallel

    chosen = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(data_parallel.STORE_ENV, raising=False)
    monkeypatch.delenv(data_parallel.LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(data_parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(data_parallel.dist, "init_process_group", lambda backend, **kw: chosen.append(backend))
    monkeypatch.setattr(data_parallel.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(data_parallel.dist, "get_world_size", lambda: 2)
    data_parallel.DataParallel.from_environment("tree", torch.device("cuda:1"))
    data_parallel.DataParallel.from_environment("tree", torch.device("cpu"))
    assert chosen == ["nccl", "gloo"]


def test_ray_asks_for_a_gpu_when_the_device_is_cuda(gpus):
    gpus(0)
    assert task_resources(None, "cpu") == {"num_cpus": 1, "num_gpus": 0}
    assert task_resources(4, "cuda") == {"num_cpus": 4, "num_gpus": 1}
    assert task_resources(2, "cuda:3") == {"num_cpus": 2, "num_gpus": 1}
    assert task_resources(1, "auto") == {"num_cpus": 1, "num_gpus": 0}  # auto without CUDA: the CPU
    gpus(1)
    assert task_resources(1, "auto") == {"num_cpus": 1, "num_gpus": 1}
    # Ray shows a task its one GPU as cuda:0: a point's cuda:3 becomes cuda
    assert task_config({"device": "cuda:3", "seed": 1}) == {"device": "cuda", "seed": 1}
    assert task_config({"device": "cpu"}) == {"device": "cpu"}


def test_resume_across_gpus_of_one_kind(gpus):
    gpus(2)
    assert same_device_kind("cuda:0", "cuda:1") and same_device_kind("cuda", "auto")
    assert not same_device_kind("cpu", "cuda:0")
    gpus(0)
    assert same_device_kind("cpu", "auto")


def test_transformer_refuses_a_gpu_number_past_the_last_as_resolve_device_does(gpus):
    """One check (``devices.missing_gpu``) behind both: ``Transformer(device="cuda:2")`` on a two-GPU machine is the
    same sentence ``--device cuda:2`` gives, not torch's invalid-device-ordinal error from the first allocation."""
    gpus(2)
    with pytest.raises(DeviceError) as resolved:
        resolve_device("cuda:2")
    with pytest.raises(ValueError) as built:
        Transformer(ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                                intermediate_size=16, max_seq_len=8), device="cuda:2")
    assert str(built.value) == f"device {resolved.value.problem}"
    assert "GPU 2" in str(built.value) and "2 CUDA device(s)" in str(built.value)
