"""A ``threads`` setting holds for the call only: the caller's torch thread count is back afterwards.

What must hold: ``run_check``, ``run_compare``, ``run_locate``, ``run_dump`` and ``run_measure`` (and
``run_vllm_dump``: tests/integrations/test_vllm.py) run at ``settings.threads`` (the reports that record the count
say so) and leave ``torch.get_num_threads()`` at the caller's count, also when they raise after setting it; a
count torch would refuse is one ValueError naming ``threads``. (Before, a notebook that called
``run_measure(MeasureSettings(threads=1, ...))`` ran everything after it at 1 thread.)
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, num_threads

from vexact.real.check import CheckSettings, run_check
from vexact.real.compare import CompareSettings, run_compare
from vexact.real.locate import LocateSettings, run_dump, run_locate
from vexact.real.measure import MeasureSettings, run_measure
from vexact.real.tiny import make_tiny_checkpoint
from vexact_kernels.host_guard import torch_threads

CALLER, CALL = 3, 2  # the caller's count and the call's: different, and neither the machine's default
SHAPE = {k: v for k, v in TINY.items() if k != "max_seq_len"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3, tokenizer=False)


def _check(**kw):
    settings = CheckSettings(**{**SHAPE, "num_prompts": 2, "max_prompt_len": 3, "max_new_tokens": 2,
                                "batch_sizes": (None,), "micro_batch_sizes": (None,), "threads": CALL, **kw})
    return run_check(settings, backends=("exact",))


def _compare(tmp_path, **kw):
    rows = [json.dumps({"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -1.0]})]
    (tmp_path / "roll.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    settings = CompareSettings(**{"rollout": tmp_path / "roll.jsonl", "train": tmp_path / "train.jsonl",
                                  "threads": CALL, **kw})
    return run_compare(settings).summary


def _locate(**kw):
    return run_locate(LocateSettings(**{"random_model": dict(SHAPE), "random_prompts": 2, "max_new_tokens": 2,
                                        "threads": CALL, **kw})).summary


def _dump(tmp_path, **kw):
    return run_dump(LocateSettings(**{"random_model": dict(SHAPE), "random_prompts": 2, "max_new_tokens": 2,
                                      "threads": CALL, "dump": tmp_path / "dump", **kw}))


def _measure(checkpoint, **kw):
    return run_measure(MeasureSettings(**{"model": checkpoint, "random_prompts": 2, "max_new_tokens": 2,
                                          "threads": CALL, **kw})).summary


def test_check_runs_at_its_count_and_gives_the_callers_back():
    with num_threads(CALLER):
        _check()
        assert torch.get_num_threads() == CALLER
        with pytest.raises(ValueError, match="nope"):  # raised inside, after the count was set
            _check(dtype="nope")
        assert torch.get_num_threads() == CALLER


def test_compare_runs_at_its_count_and_gives_the_callers_back(tmp_path):
    with num_threads(CALLER):
        assert _compare(tmp_path)["bitwise_equal"] == 2
        assert torch.get_num_threads() == CALLER
        with pytest.raises(ValueError, match="missing.jsonl"):
            _compare(tmp_path, train=tmp_path / "missing.jsonl")
        assert torch.get_num_threads() == CALLER


def test_locate_and_its_dump_run_at_their_count_and_give_the_callers_back(tmp_path):
    with num_threads(CALLER):
        assert _locate()["threads"] == CALL  # the report records the run's count, not the caller's
        assert torch.get_num_threads() == CALLER
        with pytest.raises(ValueError, match="--positions 1000- selects no position"):
            _locate(positions="1000-")
        assert torch.get_num_threads() == CALLER
        _dump(tmp_path)
        assert torch.get_num_threads() == CALLER
        with pytest.raises(ValueError, match="--positions 1000- selects no position"):
            _dump(tmp_path, positions="1000-", dump=tmp_path / "dump2")
        assert torch.get_num_threads() == CALLER


def test_measure_runs_at_its_count_and_gives_the_callers_back(checkpoint, tmp_path):
    with num_threads(CALLER):
        assert _measure(checkpoint)["threads"] == CALL
        assert torch.get_num_threads() == CALLER
        with pytest.raises(ValueError, match="missing"):  # the checkpoint is read after the count was set
            _measure(tmp_path / "missing")
        assert torch.get_num_threads() == CALLER


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_count_torch_would_refuse_is_one_value_error(bad):
    with num_threads(CALLER):
        with pytest.raises(ValueError, match=f"threads must be a positive integer, got {bad!r}"):
            with torch_threads(bad):
                pass
        assert torch.get_num_threads() == CALLER


def test_the_count_a_block_changed_itself_is_put_back_too():
    with num_threads(CALLER):
        with pytest.raises(RuntimeError, match="boom"), torch_threads(None):
            torch.set_num_threads(CALL)
            raise RuntimeError("boom")
        assert torch.get_num_threads() == CALLER
