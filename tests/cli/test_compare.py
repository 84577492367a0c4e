"""``vexact compare``: dumped log-probs compared bitwise, with known answers.

What must hold: on a hand-built dump the metrics are the numbers worked out by hand below; JSON Lines (two files
in any order, or one file), safetensors and torch files of the same data give the same report; each gate exits 0
or 1 at its threshold; every kind of bad input is exit 2 with one line naming the file, line and id; float32
values written with >= 9 significant digits compare exactly, with 6 they do not; the HF recipe of the README
produces dumps that compare as expected; ``full_vocab_metrics`` gives hand-computed values on 2- and 3-token
vocabularies.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import save_file

from vexact.cli import main
from vexact.real.dump_files import REFUSED_FILE_HINT
from vexact.rl.metrics import full_vocab_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

# --------------------------------------------------------------------------- the hand-built dump
# Three sequences. r = logp_train - logp_roll per token:
#   id "a": roll [-0.5, -1.0, -2.0]  train [-0.5, -1.5, -2.0]   r = [0, -0.5, 0]
#   id "b": roll [-0.25]             train [-0.25]              r = [0]
#   id 7:   roll [-3.0, -0.125]      train [-3.0, -0.0625]      r = [0, 0.0625]
# N = 6 tokens, 4 bitwise equal. Every value is a dyadic rational, exact in float32 and float64.
ROLL = {"a": [-0.5, -1.0, -2.0], "b": [-0.25], 7: [-3.0, -0.125]}
TRAIN = {"a": [-0.5, -1.5, -2.0], "b": [-0.25], 7: [-3.0, -0.0625]}
TOKENS = {"a": [5, 6, 7], "b": [9], 7: [11, 12]}
ORDER = [7, "a", "b"]  # the training file's order (the rollout file is written a, b, 7)

KL = (0.5 - 0.0625) / 6  # k1 = mean(logp_roll - logp_train) = -(Σ r) / N = -(-0.5 + 0.0625) / 6
K3 = ((math.expm1(-0.5) + 0.5) + (math.expm1(0.0625) - 0.0625)) / 6  # mean(e^r - r - 1); zeros add 0
ABS_MEAN = (0.5 + 0.0625) / 6
ABS_MAX = 0.5


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _two_files(tmp_path: Path) -> tuple[Path, Path]:
    rollout = _jsonl(tmp_path / "rollout.jsonl", [{"id": i, "logprobs": ROLL[i], "tokens": TOKENS[i]}
                                                  for i in ("a", "b", 7)])
    train = _jsonl(tmp_path / "train.jsonl", [{"id": i, "tokens": TOKENS[i], "logprobs": TRAIN[i]} for i in ORDER])
    return rollout, train


def _padded(values: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[3, 3] rows in ORDER, padded with a value that must never be read (NaN)."""
    out = torch.full((3, 3), float("nan"), dtype=dtype)
    for b, i in enumerate(ORDER):
        out[b, : len(values[i])] = torch.tensor(values[i], dtype=dtype)
    return out


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])


def _run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main(["compare", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _report(capsys, *argv: object, out: Path) -> dict:
    code, _, err = _run(capsys, *argv, "--json", out)
    assert code == 0, err
    return json.loads(out.read_text())


def test_known_answers_two_files_matched_by_id_in_any_order(tmp_path, capsys):
    rollout, train = _two_files(tmp_path)
    report = _report(capsys, rollout, train, out=tmp_path / "r.json")
    m = report["metrics"]
    assert report["tokens"] == 6 and report["bitwise_equal"] == 4 and report["sequences"] == 3
    assert report["sequences_with_tokens_checked"] == 3 and report["mode"] == "two files, matched by id"
    assert m["mismatch/bitwise_equal_frac"] == 4 / 6
    assert m["rollout_corr/kl"] == pytest.approx(KL, rel=1e-12, abs=0)
    assert m["rollout_corr/k3_kl"] == pytest.approx(K3, rel=1e-12, abs=0)
    assert m["mismatch/abs_dlogp_mean"] == pytest.approx(ABS_MEAN, rel=1e-12, abs=0)
    assert m["mismatch/abs_dlogp_max"] == ABS_MAX
    # training-path probabilities e^-3 = 0.0498, e^-1.5 = 0.223, e^-2 = 0.135, e^-0.5 = 0.607, e^-0.25 = 0.779,
    # e^-0.0625 = 0.939 -> buckets 0.01-0.1: 1, 0.1-0.5: 2 (|r| 0.5 and 0), 0.5-0.9: 2, 0.9-1: 1 (|r| 0.0625)
    assert [(b["bucket"], b["tokens"], b["abs_dlogp_mean"]) for b in report["by_probability"]] == [
        ("0-0.01", 0, None), ("0.01-0.1", 1, 0.0), ("0.1-0.5", 2, 0.25), ("0.5-0.9", 2, 0.0), ("0.9-1", 1, 0.0625)]
    # positions: 0 holds three zeros; 1 holds |r| 0.0625 (id 7) and 0.5 (id "a"); 2 holds id "a"'s zero
    assert [(p["positions"], p["tokens"], p["abs_dlogp_mean"], p["abs_dlogp_max"]) for p in report["by_position"]] \
        == [("0", 3, 0.0, 0.0), ("1", 2, 0.28125, 0.5), ("2", 1, 0.0, 0.0)]
    for key in ("rollout_corr/chi2_token", "rollout_corr/log_ppl_abs_diff", "training/rollout_probs_diff_max",
                "mismatch/abs_dlogp_p99", "mismatch/tokens_bucket/0.9-1"):
        assert key in m


def test_the_input_formats_agree(tmp_path, capsys):
    """Two JSON Lines files, one JSON Lines file, safetensors, torch (with attention_mask) and two tensor files:
    the same numbers, bit for bit (the values are exact in float32)."""
    rollout, train = _two_files(tmp_path)
    reference = _report(capsys, rollout, train, out=tmp_path / "ref.json")
    one = _jsonl(tmp_path / "one.jsonl", [{"id": i, "rollout_log_probs": ROLL[i], "old_log_probs": TRAIN[i]}
                                          for i in ORDER])
    save_file({"rollout_log_probs": _padded(ROLL), "old_log_probs": _padded(TRAIN), "response_mask": MASK},
              tmp_path / "batch.safetensors")
    prompt_mask = torch.tensor([[0, 1], [1, 1], [0, 0]])  # left-padded prompts: verl's attention_mask
    torch.save({"rollout_log_probs": _padded(ROLL, torch.float64), "old_log_probs": _padded(TRAIN, torch.float64),
                "attention_mask": torch.cat([prompt_mask, MASK], 1)}, tmp_path / "batch.pt")
    token_ids = _padded(TOKENS).nan_to_num().long()  # padding 0: never read
    save_file({"logp": _padded(ROLL), "response_mask": MASK, "responses": token_ids}, tmp_path / "roll.safetensors")
    torch.save({"logp": _padded(TRAIN), "response_mask": MASK.bool(), "responses": token_ids}, tmp_path / "train.pt")
    runs = {
        "one jsonl": [one],
        "safetensors": [tmp_path / "batch.safetensors"],
        "torch + attention_mask": [tmp_path / "batch.pt"],
        "two tensor files": [tmp_path / "roll.safetensors", tmp_path / "train.pt", "--rollout-key", "logp",
                             "--train-key", "logp"],
    }
    for name, argv in runs.items():
        report = _report(capsys, *argv, out=tmp_path / f"{name}.json")
        for key in ("tokens", "bitwise_equal", "metrics", "by_probability", "by_position"):
            assert report[key] == reference[key], (name, key)
        assert report["sequences_with_tokens_checked"] == (3 if name == "two tensor files" else 0)


@pytest.mark.parametrize("flags,code", [
    ([], 0),
    (["--fail-on-mismatch"], 1),  # 2 of 6 tokens differ
    (["--max-k3", "0.02"], 0),  # k3 = 0.01809... <= 0.02
    (["--max-k3", "0.018"], 1),
    (["--max-abs-dlogp", "0.5"], 0),  # the max is exactly 0.5: not above the limit
    (["--max-abs-dlogp", "0.4999"], 1),
    (["--max-k3", "1", "--max-abs-dlogp", "1", "--fail-on-mismatch"], 1),
])
def test_gates(tmp_path, capsys, flags, code):
    rollout, train = _two_files(tmp_path)
    got, out, err = _run(capsys, rollout, train, *flags)
    assert got == code
    if "--fail-on-mismatch" in flags:
        assert "gate failed: --fail-on-mismatch: 2 of 6 tokens are not bitwise equal" in err
    if flags[:2] == ["--max-k3", "0.018"]:
        assert err == f"gate failed: --max-k3: rollout_corr/k3_kl = {K3:.6g} > 0.018\n"
    if flags == ["--max-abs-dlogp", "0.4999"]:
        assert err == "gate failed: --max-abs-dlogp: mismatch/abs_dlogp_max = 0.5 > 0.4999\n"
    if flags == ["--max-abs-dlogp", "0.5"]:
        assert "gate passed: --max-abs-dlogp: mismatch/abs_dlogp_max = 0.5 <= 0.5" in out and err == ""


def test_identical_dumps_pass_every_gate(tmp_path, capsys):
    rollout, _ = _two_files(tmp_path)
    code, out, err = _run(capsys, rollout, rollout, "--fail-on-mismatch", "--max-k3", "0", "--max-abs-dlogp", "0")
    assert code == 0 and err == "" and out.count("gate passed") == 3


def test_json_and_png_outputs(tmp_path, capsys):
    rollout, train = _two_files(tmp_path)
    code, out, _ = _run(capsys, rollout, train, "--json", tmp_path / "o.json", "--png", tmp_path / "o.png",
                        "--max-k3", "0.018")
    assert code == 1
    report = json.loads((tmp_path / "o.json").read_text())
    assert report["gates"] == [{"gate": "--max-k3", "limit": 0.018, "value": report["metrics"]["rollout_corr/k3_kl"],
                                "passed": False, "message": f"rollout_corr/k3_kl = {K3:.6g} > 0.018"}]
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "k3 KL" in out and "|Δlogp| by response position" in out


def test_json_naming_an_input_is_refused_before_anything_is_written(tmp_path, capsys):
    rollout, train = _two_files(tmp_path)
    kept = rollout.read_text(), train.read_text()
    for flags, what, named in (((rollout, train, "--json", rollout), "ROLLOUT", rollout),
                               ((rollout, train, "--floor", train, "--json", tmp_path / "." / "train.jsonl"), "TRAIN",
                                tmp_path / "." / "train.jsonl")):
        code, out, err = _run(capsys, *flags)
        assert (code, out) == (2, "")
        assert err == f"error: --json {named} is the {what} file: the output would overwrite it; name another file\n"
    assert (rollout.read_text(), train.read_text()) == kept  # the dumps are intact
    # --correction is a name here, not a file: a report of that name is fine
    code, _, err = _run(capsys, rollout, train, "--map", "--correction", "bypass", "--json", tmp_path / "bypass")
    assert code == 0, err


def test_the_first_mismatch_is_named_by_id_and_position(tmp_path, capsys):
    """Beside the aggregates, compare names the first mismatched token -- id, position (and tensor column), token,
    both values with their bits, Δ -- as vexact.testing reports it (one ``Mismatch`` class), on screen and in the
    JSON; pairs are read in TRAIN's order, so in the hand-built dump that is id 7's second token."""
    rollout, train = _two_files(tmp_path)
    code, out, _ = _run(capsys, rollout, train, "--json", tmp_path / "r.json")
    assert code == 0
    assert ("first mismatch: id 7, position 1, token 12: rollout -0.125 (0xbfc0000000000000) vs training -0.0625 "
            "(0xbfb0000000000000), Δ = 0.0625") in out
    assert json.loads((tmp_path / "r.json").read_text())["first_mismatch"] == {
        "id": 7, "sequence": 0, "position": 1, "column": None, "token": 12, "rollout": -0.125, "train": -0.0625,
        "rollout_bits": "0xbfc0000000000000", "train_bits": "0xbfb0000000000000", "delta": 0.0625}

    # one mismatched token in a tensor dump with left-padded responses: its row, position and column
    roll = torch.full((3, 5), -1.0)
    train_side = roll.clone()
    train_side[2, 3] = torch.nextafter(torch.tensor(-1.0), torch.tensor(0.0))  # one float32 ulp
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    save_file({"rollout_log_probs": roll, "old_log_probs": train_side, "response_mask": mask},
              tmp_path / "one.safetensors")
    code, out, _ = _run(capsys, tmp_path / "one.safetensors", "--json", tmp_path / "one.json")
    report = json.loads((tmp_path / "one.json").read_text())
    assert code == 0 and report["tokens"] - report["bitwise_equal"] == 1
    assert "first mismatch: id 2, position 1 (column 3): rollout -1.0 (0xbff0000000000000) vs training " \
           "-0.9999999403953552 (0xbfefffffe0000000), Δ = 5.96046e-08" in out
    first = report["first_mismatch"]
    assert (first["id"], first["position"], first["column"], first["token"]) == (2, 1, 3, None)

    # every token equal (0.0 and -0.0 are equal values, as compare counts them): no first mismatch
    _jsonl(tmp_path / "z_roll.jsonl", [{"id": "z", "logprobs": [0.0, -1.0]}])
    _jsonl(tmp_path / "z_train.jsonl", [{"id": "z", "logprobs": [-0.0, -1.0]}])
    code, out, _ = _run(capsys, tmp_path / "z_roll.jsonl", tmp_path / "z_train.jsonl", "--json", tmp_path / "z.json")
    report = json.loads((tmp_path / "z.json").read_text())
    assert code == 0 and report["bitwise_equal"] == 2 and report["first_mismatch"] is None
    assert "first mismatch" not in out


def test_map_before_the_dumps_does_not_take_a_dump_for_the_map(tmp_path, capsys):
    """``--map`` takes an optional FILE, and argparse gives it the next word: ``--map R T`` used to read R as the
    map. A dump given to --map is one error naming the order that works; --map last, --map FILE after the dumps and
    --map=FILE anywhere keep working."""
    from vexact.map import verdict
    rollout, train = _two_files(tmp_path)
    save_file({"rollout_log_probs": _padded(ROLL), "old_log_probs": _padded(TRAIN), "response_mask": MASK},
              tmp_path / "batch.safetensors")
    for argv, dump in (([ "--map", rollout, train], rollout), (["--map", tmp_path / "batch.safetensors"],
                                                               tmp_path / "batch.safetensors"),
                       ([rollout, "--map", train], train)):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "", err
        assert err.startswith(f"error: --map took {dump} as its map file, but it is a log-prob dump, not a "
                              "scaling.json: for the map shipped with vexact put --map after the dumps (vexact "
                              "compare ROLLOUT [TRAIN] --map)") and err.count("\n") == 1, err
    code, _, err = _run(capsys, "--map", verdict.DEFAULT_MAP)
    assert code == 2 and err.startswith(f"error: no ROLLOUT dump given (--map took {verdict.DEFAULT_MAP} as its map")
    code, _, err = _run(capsys)
    assert code == 2 and err == "error: no ROLLOUT dump given\n"

    expected = _report(capsys, rollout, train, "--map", out=tmp_path / "last.json")["map"]
    for argv in ([rollout, train, "--map", verdict.DEFAULT_MAP], [f"--map={verdict.DEFAULT_MAP}", rollout, train]):
        assert _report(capsys, *argv, out=tmp_path / "m.json")["map"] == expected


def test_map_prints_one_verdict_line_and_the_details_under_verbose(tmp_path, capsys):
    """``--map`` prints one short line (the point, the correction, the verdict's first clause, the extrapolation said
    once); ``--verbose`` prints the whole placement; the JSON's map is the same either way; --verbose without --map
    is refused."""
    rollout, train = tmp_path / "roll.jsonl", tmp_path / "train.jsonl"
    _jsonl(rollout, [{"id": i, "logprobs": [-1.0] * 1000} for i in range(4)])  # T = 1000: beyond every curve
    _jsonl(train, [{"id": i, "logprobs": [-0.99] * 1000} for i in range(4)])
    code, short, err = _run(capsys, rollout, train, "--map", "--json", tmp_path / "short.json")
    assert code == 0, err
    map_lines = [x for x in short[short.index("map: "):].strip().splitlines() if not x.startswith("wrote ")]
    assert len(map_lines) == 1 and len(map_lines[0]) < 300, map_lines
    line = map_lines[0]
    assert line.startswith("map: k3 = 5.02e-05 at T = 1000.0 tokens, correction bypass (assumed: --correction "
                           "names yours): ") and line.endswith("(--verbose: the details)")
    assert line.count("outside the curve's measured horizons") == 1 and "assumptions" not in line
    code, verbose, err = _run(capsys, rollout, train, "--map", "--verbose", "--json", tmp_path / "verbose.json")
    assert code == 0, err
    assert "  assumptions: " in verbose and "  verdict: " in verbose and "map: k3" not in verbose
    assert json.loads((tmp_path / "short.json").read_text())["map"] == json.loads(
        (tmp_path / "verbose.json").read_text())["map"]
    code, out, err = _run(capsys, rollout, train, "--verbose")
    assert code == 2 and out == "" and err == "error: --verbose prints the --map placement in full: give --map too\n"


def test_tensor_file_flags_are_refused_where_they_would_change_nothing(tmp_path, capsys):
    """--mask-key reads a tensor file's mask and --full-vocab-top-k the full-vocabulary log-probs: given with JSON
    Lines only, or without the full keys, each was ignored; now one error line. With a tensor file, both count."""
    rollout, train = _two_files(tmp_path)
    code, out, err = _run(capsys, rollout, train, "--mask-key", "response_mask")
    assert code == 2 and out == "" and err == (
        "error: --mask-key says which positions of a tensor file hold tokens, and no dump here is one (.safetensors, "
        ".pt, .pth, .bin): JSON Lines list only the tokens\n")
    code, out, err = _run(capsys, rollout, train, "--full-vocab-top-k", "5")  # given, even as the default
    assert code == 2 and out == "" and err == (
        "error: --full-vocab-top-k sets k of the full-vocabulary comparison, which reads --rollout-full-key and "
        "--train-full-key: give them too\n")
    path = tmp_path / "batch.pt"
    full = torch.log_softmax(torch.arange(36.0).reshape(3, 3, 4).sin(), -1)
    torch.save({"rollout_log_probs": _padded(ROLL), "old_log_probs": _padded(TRAIN), "m": MASK, "f": full}, path)
    out_json = tmp_path / "r.json"
    code, _, err = _run(capsys, path, "--mask-key", "m", "--rollout-full-key", "f", "--train-full-key", "f",
                        "--full-vocab-top-k", "2", "--json", out_json)
    assert code == 0, err
    metrics = json.loads(out_json.read_text())["metrics"]
    assert metrics["mismatch/full_vocab_top2_overlap_mean"] == 1.0
    assert "mismatch/full_vocab_top5_overlap_mean" not in metrics


# --------------------------------------------------------------------------- bad input: one line, exit 2
GOOD_ROLL = ['{"id": "a", "logprobs": [-0.5, -1.0], "tokens": [5, 6]}', '{"id": "b", "logprobs": [-0.25]}']
GOOD_TRAIN = ['{"id": "b", "logprobs": [-0.25]}', '{"id": "a", "logprobs": [-0.5, -1.5], "tokens": [5, 6]}']


@pytest.mark.parametrize("side,lines,message", [
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, -1.5], "tokens": [5, 7]}'],
     "{T}:2: id 'a': tokens differ from {R}:1 at position 1 (7 here, 6 there)"),
    ("train", [GOOD_TRAIN[1]], "{R}:2: id 'b': no sequence with this id in {T}"),
    ("train", [*GOOD_TRAIN, '{"id": "c", "logprobs": []}'], "{T}:3: id 'c': no sequence with this id in {R}"),
    ("roll", [*GOOD_ROLL, '{"id": "a", "logprobs": [-1.0, -1.0]}'], "{R}:3: id 'a': duplicate id (first on line 1)"),
    ("train", [GOOD_TRAIN[0], GOOD_TRAIN[0], GOOD_TRAIN[1]], "{T}:2: id 'b': duplicate id (first on line 1)"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, "x"]}'], "{T}:2: id 'a': 'logprobs'[1] is not a "
     'number: "x"'),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [true, -1]}'], "{T}:2: id 'a': 'logprobs'[0] is not a number: "
     "true"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, null]}'], "{T}:2: id 'a': 'logprobs'[1] is not a "
     "number: null"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, NaN]}'], "{T}:2: id 'a': 'logprobs'[1] is nan: not a "
     "finite log-prob (1 of 2 values are NaN or infinite)"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-Infinity, 1e999]}'], "{T}:2: id 'a': 'logprobs'[0] is -inf: "
     "not a finite log-prob (2 of 2 values are NaN or infinite)"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5]}'],
     "{T}:2: id 'a': 1 log-probs here but 2 in {R}:1 (lengths differ)"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, -1.5], "tokens": [5]}'],
     "{T}:2: id 'a': lengths differ within the sequence: 'logprobs' has 2, 'tokens' has 1"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, -1.5]'],
     "{T}:2: not valid JSON (Expecting ',' delimiter at column 37)"),
    ("train", [GOOD_TRAIN[0], '[-0.5, -1.5]'], '{T}:2: expected a JSON object {"id": ..., ...}, got a list'),
    ("train", [GOOD_TRAIN[0], '{"logprobs": [-0.5, -1.5]}'], '{T}:2: no "id" key'),
    ("train", [GOOD_TRAIN[0], '{"id": 1.5, "logprobs": []}'], '{T}:2: "id" must be a string or an integer, got a '
     "number"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprob": [-0.5, -1.5]}'],
     "{T}:2: id 'a': no 'logprobs' key (the line has 'id', 'logprob')"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": "-0.5 -1.5"}'],
     "{T}:2: id 'a': 'logprobs' must be a list of numbers, got a string"),
    ("train", [GOOD_TRAIN[0], '{"id": "a", "logprobs": [-0.5, -1.5], "tokens": [5, -6]}'],
     "{T}:2: id 'a': 'tokens'[1] is not a token id (a non-negative 64-bit integer): -6"),
    ("train", [], "{T}: empty (no sequences)"),
    ("roll", ["", "   "], "{R}: empty (no sequences)"),
])
def test_bad_jsonl_input_is_one_line_naming_file_line_and_id(tmp_path, capsys, side, lines, message):
    rollout, train = tmp_path / "rollout.jsonl", tmp_path / "train.jsonl"
    rollout.write_text("\n".join(lines if side == "roll" else GOOD_ROLL) + "\n")
    train.write_text("\n".join(lines if side == "train" else GOOD_TRAIN) + ("\n" if lines or side != "train" else ""))
    code, out, err = _run(capsys, rollout, train)
    assert code == 2 and out == ""
    assert err == "error: " + message.replace("{R}", str(rollout)).replace("{T}", str(train)) + "\n"


def _first_item(value) -> None:
    """The mutation ``_first_item(value)(row, key)``: the first item of ``row[key]`` set to ``value``, where it is a
    list with one (an earlier mutation may have left another type, or none)."""
    def mutate(row: dict, key: str) -> None:
        if isinstance(row.get(key), list) and row[key]:
            row[key][0] = value
    return mutate


MUTATIONS = {  # name: what it does to one key of one decoded line (a dict) of a good dump
    "drop the key": lambda row, key: row.pop(key, None),
    "a dict": lambda row, key: row.update({key: {}}),
    "a string": lambda row, key: row.update({key: "x"}),
    "a number": lambda row, key: row.update({key: 3.5}),
    "null": lambda row, key: row.update({key: None}),
    "one shorter": lambda row, key: row.update({key: row[key][:-1]}) if isinstance(row.get(key), list) else None,
    "a list in a list": lambda row, key: row.update({key: [row.get(key)]}),
    "an empty list": lambda row, key: row.update({key: []}),
    **{f"first item {value!r}": _first_item(value)
       for value in ("a", True, -5, 2**70, math.nan, math.inf, -math.inf, 1e300, -1e308, 0.5)},
}


@pytest.mark.parametrize("seed", range(8))
def test_mutated_dumps_are_a_report_or_one_error_line(tmp_path, capsys, seed):
    """A seeded fuzz over what the table above names one at a time: good two-file dumps with up to two lines
    mutated (``MUTATIONS``) or a bad line added, under each output flag. Each run is a report (exit 0 or 1) or
    exit 2 with exactly one ``error:`` line and nothing on stdout -- never an exception out of ``main``."""
    rng = random.Random(seed)
    for trial in range(25):
        sides = {side: [{"id": i, "logprobs": list(values[i]), "tokens": list(TOKENS[i])} for i in ("a", "b", 7)]
                 for side, values in (("roll", ROLL), ("train", TRAIN))}
        for _ in range(rng.randint(0, 2)):
            mutation = rng.choice(sorted(MUTATIONS))
            row = rng.choice(sides[rng.choice(["roll", "train"])])
            MUTATIONS[mutation](row, rng.choice(["logprobs", "tokens", "id"]))
        lines = {side: [json.dumps(row) for row in rows] for side, rows in sides.items()}
        if rng.random() < 0.3:
            lines[rng.choice(["roll", "train"])].append(rng.choice(["", "{not json", "[1, 2]", lines["train"][0]]))
        rollout, train = tmp_path / "rollout.jsonl", tmp_path / "train.jsonl"
        rollout.write_text("\n".join(lines["roll"]) + "\n")
        train.write_text("\n".join(lines["train"]) + "\n")
        flags = rng.choice([[], ["--float32"], ["--fail-on-mismatch"], ["--json", tmp_path / "r.json"], ["--map"]])
        code, out, err = _run(capsys, rollout, train, *flags)
        assert code in (0, 1, 2), (trial, lines, flags, err)
        if code == 2:
            assert out == "" and err.startswith("error: ") and len(err.splitlines()) == 1, (trial, lines, err)


def test_bad_one_file_and_empty_sequences(tmp_path, capsys):
    one = _jsonl(tmp_path / "one.jsonl", [{"id": 0, "rollout_log_probs": [-1.0, -2.0], "old_log_probs": [-1.0]}])
    assert _run(capsys, one)[2] == (f"error: {one}:1: id 0: lengths differ within the sequence: 'rollout_log_probs' "
                                    "has 2, 'old_log_probs' has 1\n")
    one = _jsonl(tmp_path / "one.jsonl", [{"id": 0, "rollout_log_probs": [], "old_log_probs": []}])
    assert _run(capsys, one)[2] == f"error: {one}: no tokens to compare: every sequence is empty\n"
    assert _run(capsys, one, "--rollout-key", "x", "--train-key", "x")[2] == (
        "error: --rollout-key and --train-key are both 'x': one file needs two keys\n")
    assert _run(capsys, tmp_path / "missing.jsonl")[2] == f"error: {tmp_path / 'missing.jsonl'}: file not found\n"


@pytest.mark.parametrize("map_flags", [(), ("--map",)], ids=["report", "--map"])
def test_a_log_prob_of_minus_1e308_is_one_error_naming_the_token_before_any_report(tmp_path, capsys, map_flags):
    """-1e308 (a mask's fill value, say) made k3 = e^r - r - 1 overflow: the report printed k3 = inf (stored in the
    JSON as the string "inf"), and --map failed after the report with "k3 must be finite", no cause named."""
    one = _jsonl(tmp_path / "one.jsonl", [
        {"id": "s", "rollout_log_probs": [-0.5, -1e308], "old_log_probs": [-0.5, -1.0]},
        {"id": "t", "rollout_log_probs": [-0.2], "old_log_probs": [-0.3]}])
    code, out, err = _run(capsys, one, *map_flags, "--json", tmp_path / "r.json")
    assert code == 2 and out == "" and not (tmp_path / "r.json").exists()
    assert err.startswith("error: rollout_corr/k3_kl overflowed float64 (rollout_corr/k3_kl = inf): "
                          f"{one}:1: id 's', position 1 has the training log-prob -1 and the rollout log-prob "
                          "-1e+308;") and len(err.splitlines()) == 1, err


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the hostile pickle below
def test_bad_tensor_input(tmp_path, capsys):
    path = tmp_path / "b.pt"

    def error(data: object, *flags: str) -> str:
        torch.save(data, path)
        code, _, err = _run(capsys, path, *flags)
        assert code == 2 and err.count("\n") == 1
        return err.removeprefix("error: ").rstrip("\n")

    good = {"rollout_log_probs": _padded(ROLL), "old_log_probs": _padded(TRAIN), "response_mask": MASK}
    assert error({**good, "response_mask": MASK[:, :2]}) == (
        f"{path}: mask 'response_mask' has shape [3, 2] but 'rollout_log_probs' has [3, 3]")
    assert error({**good, "old_log_probs": _padded(TRAIN)[:, :2]}) == (
        f"{path}: 'old_log_probs' has shape [3, 2] but 'rollout_log_probs' has [3, 3]")
    assert error({k: v for k, v in good.items() if k != "response_mask"}) == (
        f"{path}: no 'response_mask' or 'attention_mask' tensor to say which positions hold tokens; give --mask-key "
        "KEY, or --mask-key none if every position does")
    assert error(good, "--mask-key", "none") == (f"{path}: row 0: 'rollout_log_probs' at column 2 is nan: not a finite "
                                                 "log-prob (1 of the row's 3 masked values are NaN or infinite)")
    assert error({**good, "response_mask": MASK * 2}) == f"{path}: mask 'response_mask' holds values other than 0 and 1"
    assert error({**good, "old_log_probs": _padded(TRAIN).long()}) == (
        f"{path}: 'old_log_probs' must be a floating-point tensor (log-probs [B, T]), got torch.int64")
    assert error({**good, "responses": _padded(TOKENS)}) == (
        f"{path}: 'responses' must be an integer tensor (token ids [B, T]), got torch.float32")
    assert error({**good, "old_log_probs": _padded(TRAIN)[:0], "rollout_log_probs": _padded(ROLL)[:0],
                  "response_mask": MASK[:0]}) == f"{path}: empty (no sequences: 'rollout_log_probs' has shape [0, 3])"
    assert error([1, 2]) == f"{path}: expected a dict of tensors (name -> tensor), got list"
    assert error({**good, "x": torch.zeros(1)}, "--train-key", "y") == (
        f"{path}: no tensor 'y' (log-probs [B, T])")
    assert error(good, "--rollout-full-key", "f") == "give both --rollout-full-key and --train-full-key (or neither)"
    full = torch.log_softmax(torch.zeros(3, 3, 4), -1)
    assert error({**good, "f": full, "g": full + 5}, "--rollout-full-key", "f", "--train-full-key", "g") == (
        f"{path}: row 0: 'g' at masked position 0 is not a row of log-probs (log Σ exp = 5, expected 0): store "
        "log_softmax(logits / T), not logits")

    path.write_bytes(pickle.dumps({"rollout_log_probs": _Evil()}, protocol=2))  # a pickle that would run code
    code, _, err = _run(capsys, path)
    assert code == 2 and err == (f"error: refusing to unpickle {path}: not a plain tensor file (it names "
                                 f"print); {REFUSED_FILE_HINT}\n")  # torch's name for builtins.print
    # protocol 4 frames its opcodes: the weights-only unpickler stops at the frame, before any global, exactly as
    # it does on damaged bytes -- so the message cannot claim more than that
    path.write_bytes(pickle.dumps({"rollout_log_probs": _Evil()}, protocol=4))
    code, _, err = _run(capsys, path)
    assert code == 2 and err == (f"error: {path}: cannot be read as a plain tensor file (damaged, or not saved by "
                                 "torch.save of tensors)\n")


class _Evil:
    def __reduce__(self):  # would run code under an unsafe unpickler
        return (print, ("pwned",))


def test_tensors_saved_with_requires_grad_compare_and_sparse_ones_are_one_error(tmp_path, capsys):
    # a trainer's log-probs torch.save'd without .detach() keep requires_grad (a traceback from numpy() before)
    path = tmp_path / "b.pt"
    torch.save({"rollout_log_probs": _padded(ROLL).requires_grad_(), "old_log_probs": _padded(TRAIN).requires_grad_(),
                "response_mask": MASK}, path)
    m = _report(capsys, path, out=tmp_path / "r.json")["metrics"]
    assert (m["rollout_corr/kl"], m["mismatch/abs_dlogp_max"]) == (KL, ABS_MAX)
    assert m["rollout_corr/k3_kl"] == pytest.approx(K3, rel=1e-12, abs=0)
    torch.save({"rollout_log_probs": _padded(ROLL).nan_to_num().to_sparse(), "old_log_probs": _padded(TRAIN),
                "response_mask": MASK}, path)
    code, out, err = _run(capsys, path)
    assert (code, out) == (2, "")
    assert err == (f"error: {path}: 'rollout_log_probs' is a torch.sparse_coo tensor; store it dense "
                   "(tensor.to_dense())\n")


def test_two_tensor_files_must_select_the_same_positions(tmp_path, capsys):
    save_file({"logprobs": _padded(ROLL).nan_to_num(), "response_mask": MASK}, tmp_path / "r.safetensors")
    other = MASK.clone()
    other[0] = torch.tensor([1, 0, 1])
    save_file({"logprobs": _padded(TRAIN).nan_to_num(), "response_mask": other}, tmp_path / "t.safetensors")
    code, _, err = _run(capsys, tmp_path / "r.safetensors", tmp_path / "t.safetensors")
    assert code == 2
    assert err == (f"error: {tmp_path / 't.safetensors'}: row 0: the mask selects other positions than in "
                   f"{tmp_path / 'r.safetensors'} row 0\n")
    # token ids that differ, and a file with fewer rows
    tokens = _padded(TOKENS).nan_to_num().long()
    save_file({"logprobs": _padded(TRAIN).nan_to_num(), "response_mask": MASK, "responses": tokens + 1},
              tmp_path / "t.safetensors")
    save_file({"logprobs": _padded(ROLL).nan_to_num(), "response_mask": MASK, "responses": tokens},
              tmp_path / "r.safetensors")
    assert _run(capsys, tmp_path / "r.safetensors", tmp_path / "t.safetensors")[2] == (
        f"error: {tmp_path / 't.safetensors'}: row 0: tokens differ from {tmp_path / 'r.safetensors'} row 0 at "
        "position 0 (12 here, 11 there)\n")
    save_file({"logprobs": _padded(TRAIN).nan_to_num()[:2], "response_mask": MASK[:2]}, tmp_path / "t.safetensors")
    assert _run(capsys, tmp_path / "r.safetensors", tmp_path / "t.safetensors")[2] == (
        f"error: {tmp_path / 'r.safetensors'}: row 2: no sequence with this id in {tmp_path / 't.safetensors'}\n")


# --------------------------------------------------------------------------- float32 through JSON
def test_float32_through_json(tmp_path, capsys):
    """repr of the float64 value parses back exactly; %.9g on both sides compares exactly; repr against %.9g needs
    --float32; %.6g loses bits even then; a 1-ulp float32 difference is found, and measured exactly."""
    gen = torch.Generator().manual_seed(0)
    values = torch.log(torch.rand(200, generator=gen, dtype=torch.float64)).float()  # float32 log-probs

    def dump(name: str, xs: torch.Tensor, digits: int | None) -> Path:
        numbers = xs.tolist()
        text = json.dumps(numbers) if digits is None else "[" + ", ".join(f"{v:.{digits}g}" for v in numbers) + "]"
        path = tmp_path / name
        path.write_text('{"id": 0, "logprobs": ' + text + "}\n")
        return path

    exact, nine, nine_again, six = dump("r", values, None), dump("9", values, 9), dump("9b", values, 9), dump(
        "6", values, 6)
    assert [float(v) for v in json.loads(exact.read_text())["logprobs"]] == values.double().tolist()  # exact
    gate = "--fail-on-mismatch"
    assert _run(capsys, nine, nine_again, gate)[0] == 0  # the same float32 values, written alike: equal
    assert _report(capsys, exact, nine, out=tmp_path / "a.json")["bitwise_equal"] < 200  # parsed ≠ x
    assert _run(capsys, exact, nine, gate, "--float32")[0] == 0  # rounded to float32: x again
    assert _report(capsys, exact, six, "--float32", out=tmp_path / "b.json")["bitwise_equal"] < 200  # bits lost
    bumped = torch.nextafter(values, torch.zeros_like(values))  # each one float32 ulp towards 0
    ulp = (bumped.double() - values.double()).abs()
    for flags, rollout, train in (([], nine, dump("u9", bumped, 9)), (["--float32"], exact, dump("u9f", bumped, 9)),
                                  ([], exact, dump("ur", bumped, None))):
        report = _report(capsys, rollout, train, *flags, out=tmp_path / "u.json")
        assert report["bitwise_equal"] == 0
        if flags or rollout == exact:  # exact values on both sides: |Δlogp| is exactly the ulp
            assert report["metrics"]["mismatch/abs_dlogp_max"] == float(ulp.max())


# --------------------------------------------------------------------------- the README's HF recipe
def _hf_rollout_dump(model, prompts: list[list[int]], path: Path, max_new_tokens: int, temperature: float) -> None:
    """The README recipe, rollout side: transformers' generate with output_logits, log_softmax of the sampled
    token. One prompt per call (no padding: position ids stay those of the training forward)."""
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            new = out.sequences[0, ids.shape[1]:]
            logits = torch.stack(out.logits, dim=1)[0].float() / temperature  # [T, V], raw logits / temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None])[:, 0]
            f.write(json.dumps({"id": i, "tokens": new.tolist(), "logprobs": logp.tolist()}) + "\n")


def _hf_train_dump(model, prompts: list[list[int]], rollout: Path, path: Path, temperature: float,
                   full_out: Path | None = None) -> None:
    """The README recipe, training side: a teacher-forced forward over prompt + response tokens."""
    rows, full_rows = [], []
    with open(rollout) as src, open(path, "w") as f:
        for line in src:
            seq = json.loads(line)
            prompt, tokens = prompts[seq["id"]], seq["tokens"]
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # predicts each token
            full = torch.log_softmax(logits, dim=-1)
            logp = full.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            f.write(json.dumps({"id": seq["id"], "tokens": tokens, "logprobs": logp.tolist()}) + "\n")
            rows.append(logp)
            full_rows.append(full)
    if full_out is not None:
        torch.save({"logprobs": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
                    "full": torch.nn.utils.rnn.pad_sequence(full_rows, batch_first=True),
                    "response_mask": torch.nn.utils.rnn.pad_sequence([torch.ones(len(r)) for r in rows],
                                                                     batch_first=True).long()}, full_out)


def test_hf_recipe_dumps_compare_as_expected(tmp_path, capsys):
    """fp32 generate vs the same model's fp32 forward agree to fp32 rounding (|Δlogp| <= 1e-4, the tolerance of
    test_measure); a bf16 trainer does not (|Δlogp| > 1e-3): the gate passes for one and fails for the other."""
    import copy

    from vexact.real.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("llama", seed=0)
    prompts = [[5, 6, 7, 8], [40, 41], [100, 3, 99, 4, 98, 5]]
    torch.manual_seed(0)
    _hf_rollout_dump(model, prompts, tmp_path / "rollout.jsonl", max_new_tokens=8, temperature=0.7)
    _hf_train_dump(model, prompts, tmp_path / "rollout.jsonl", tmp_path / "train.jsonl", 0.7,
                   full_out=tmp_path / "train_full.pt")
    _hf_train_dump(copy.deepcopy(model).to(torch.bfloat16), prompts, tmp_path / "rollout.jsonl",
                   tmp_path / "bf16.jsonl", 0.7, full_out=tmp_path / "bf16_full.pt")
    lengths = [len(json.loads(line)["tokens"]) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]

    gate = ["--max-abs-dlogp", "1e-4"]
    report = _report(capsys, tmp_path / "rollout.jsonl", tmp_path / "train.jsonl", *gate, out=tmp_path / "a.json")
    assert report["tokens"] == sum(lengths) and report["sequences_with_tokens_checked"] == 3
    assert report["metrics"]["mismatch/abs_dlogp_max"] <= 1e-4
    code, _, err = _run(capsys, tmp_path / "rollout.jsonl", tmp_path / "bf16.jsonl", *gate)
    assert code == 1 and "gate failed: --max-abs-dlogp" in err
    bf16 = _report(capsys, tmp_path / "rollout.jsonl", tmp_path / "bf16.jsonl", out=tmp_path / "b.json")
    assert bf16["metrics"]["mismatch/abs_dlogp_max"] > 1e-3 and bf16["bitwise_equal"] == 0

    # full vocabulary: the fp32 forward against itself is exactly zero; against the bf16 forward it is not
    full = ["--rollout-key", "logprobs", "--train-key", "logprobs", "--rollout-full-key", "full", "--train-full-key",
            "full"]
    same = _report(capsys, tmp_path / "train_full.pt", tmp_path / "train_full.pt", *full, out=tmp_path / "c.json")
    m = same["metrics"]
    assert m["mismatch/full_vocab_positions"] == sum(lengths)
    assert (m["mismatch/full_vocab_kl_max"], m["mismatch/full_vocab_tv_max"], m["mismatch/full_vocab_argmax_flip_frac"],
            m["mismatch/full_vocab_top5_overlap_mean"]) == (0.0, 0.0, 0.0, 1.0)
    diff = _report(capsys, tmp_path / "bf16_full.pt", tmp_path / "train_full.pt", *full, out=tmp_path / "d.json")
    assert 0 < diff["metrics"]["mismatch/full_vocab_kl_mean"] < 0.1
    assert 0 < diff["metrics"]["mismatch/full_vocab_tv_max"] < 0.5


# --------------------------------------------------------------------------- full_vocab_metrics by hand
def _rows(*probs: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in row] for row in probs], dtype=torch.float64)


def test_full_vocab_metrics_on_a_two_token_vocabulary():
    # position 1: μ = (1/2, 1/2), π = (3/4, 1/4): KL = ½ln(½/¾) + ½ln(½/¼) = ½ln(4/3); TV = ½(¼ + ¼) = ¼;
    #             argmax μ = 0 (tie: lowest index) = argmax π: no flip; top-1 sets {0} and {0}: overlap 1
    # position 2: μ = (1/4, 3/4), π = (3/4, 1/4): KL = ¼ln(⅓) + ¾ln(3) = ½ln3; TV = ½; flip; overlap 0
    roll, train = _rows((0.5, 0.5), (0.25, 0.75)), _rows((0.75, 0.25), (0.75, 0.25))
    m = full_vocab_metrics(train, roll, top_k=1)
    assert m["mismatch/full_vocab_positions"] == 2
    assert m["mismatch/full_vocab_kl_mean"] == pytest.approx((0.5 * math.log(4 / 3) + 0.5 * math.log(3)) / 2,
                                                            rel=1e-12, abs=0)  # = ½ ln 2
    assert m["mismatch/full_vocab_kl_max"] == pytest.approx(0.5 * math.log(3), rel=1e-12, abs=0)
    assert m["mismatch/full_vocab_tv_mean"] == pytest.approx(0.375, rel=1e-12, abs=0)
    assert m["mismatch/full_vocab_tv_max"] == pytest.approx(0.5, rel=1e-12, abs=0)
    assert m["mismatch/full_vocab_argmax_flip_frac"] == 0.5
    assert m["mismatch/full_vocab_top1_overlap_mean"] == 0.5
    # top-2 of a 2-token vocabulary is the whole vocabulary: overlap 1
    assert full_vocab_metrics(train, roll, top_k=2)["mismatch/full_vocab_top2_overlap_mean"] == 1.0


def test_full_vocab_metrics_on_a_three_token_vocabulary_with_zero_probabilities():
    # μ = (1, 0, 0) (log-probs 0, -inf, -inf), π = (1/2, 1/4, 1/4): KL(μ‖π) = 1·ln(1/½) = ln 2 (the zero entries add
    # 0); TV = ½(½ + ¼ + ¼) = ½; argmax both 0; top-2: μ {0, 1} (tie at -inf: lowest index), π {0, 1} (tie at ¼)
    roll, train = _rows((1.0, 0.0, 0.0)), _rows((0.5, 0.25, 0.25))
    m = full_vocab_metrics(train, roll, top_k=2)
    assert m["mismatch/full_vocab_kl_mean"] == pytest.approx(math.log(2), rel=1e-12, abs=0)
    assert m["mismatch/full_vocab_tv_mean"] == pytest.approx(0.5, rel=1e-12, abs=0)
    assert (m["mismatch/full_vocab_argmax_flip_frac"], m["mismatch/full_vocab_top2_overlap_mean"]) == (0.0, 1.0)
    # the other way round μ puts mass where π has none: KL(μ‖π) = +inf
    assert full_vocab_metrics(roll, train, top_k=2)["mismatch/full_vocab_kl_max"] == math.inf
    # identical rows: exactly zero
    same = full_vocab_metrics(train, train, top_k=3)
    assert (same["mismatch/full_vocab_kl_max"], same["mismatch/full_vocab_tv_max"],
            same["mismatch/full_vocab_argmax_flip_frac"], same["mismatch/full_vocab_top3_overlap_mean"]) == (0, 0, 0, 1)


def test_full_vocab_metrics_refuses_bad_shapes_and_k():
    rows = _rows((0.5, 0.5))
    with pytest.raises(ValueError, match="two \\[N, V\\] tensors of one shape"):
        full_vocab_metrics(rows, _rows((0.5, 0.25, 0.25)))
    with pytest.raises(ValueError, match="top_k must be an integer in \\[1, 2\\]"):
        full_vocab_metrics(rows, rows, top_k=3)
    with pytest.raises(ValueError, match="no positions"):
        full_vocab_metrics(rows[:0], rows[:0], top_k=1)
    # not tensors of log-probs: one error naming the side (a list was an AttributeError from .detach())
    with pytest.raises(ValueError, match="logp_roll_full must be a floating-point \\[N, V\\] torch tensor of "
                                         "log-probs, got list"):
        full_vocab_metrics(rows, rows.tolist())
    with pytest.raises(ValueError, match="logp_train_full must be .* got torch.int64"):
        full_vocab_metrics(rows.long(), rows)


# --------------------------------------------------------------------------- the benchmark
def test_compare_benchmark_smoke(tmp_path):
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import compare as bench

    formats = ["two-files", "safetensors"]  # each format is a subprocess that imports torch: keep it short
    record = bench.run(sequences=30, max_len=5, formats=formats, directory=tmp_path)
    assert record["benchmark"] == "compare" and [r["format"] for r in record["results"]] == formats
    for row in record["results"]:
        assert row["correct"] and row["exit_code"] == 0 and row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0


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
    assert done.stderr == (f"error: {path}: cannot be read as a plain tensor file (damaged, or not saved by "
                           "torch.save of tensors)\n"), done.stderr


class _Hostile:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_a_binary_file_of_another_format_says_how_the_format_is_chosen(tmp_path, capsys):
    """An .npz dump (a format compare does not read) was answered "not valid JSON (not UTF-8 text)" alone, as if
    the user had meant JSON Lines; a binary .jsonl keeps the short message."""
    npz = tmp_path / "dump.npz"
    numpy.savez(npz, rollout_log_probs=numpy.zeros((2, 3)))
    code, out, err = _run(capsys, npz)
    assert code == 2 and out == ""
    assert err == (f"error: {npz}:1: not valid JSON (not UTF-8 text); the format follows the file name: .safetensors, "
                   ".pt, .pth, .bin are tensor files, any other name is read as JSON Lines\n")
    jsonl = tmp_path / "dump.jsonl"
    jsonl.write_bytes(npz.read_bytes())
    assert _run(capsys, jsonl)[2] == f"error: {jsonl}:1: not valid JSON (not UTF-8 text)\n"


def test_a_long_response_with_a_steady_offset_is_a_report(tmp_path, capsys):
    """1,500 tokens each 0.5 more likely to the trainer: the sequence's log-ratio, 750, overflowed math.exp in the
    sequence-level IS metrics (a traceback, exit 1), where every metric is finite: a report."""
    roll = _jsonl(tmp_path / "r.jsonl", [{"id": 0, "logprobs": [-1.0] * 1500}])
    train = _jsonl(tmp_path / "t.jsonl", [{"id": 0, "logprobs": [-0.5] * 1500}])
    report = _report(capsys, roll, train, out=tmp_path / "out.json")
    assert report["metrics"]["rollout_corr/k3_kl"] == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-12)


def test_a_broken_correction_method_is_refused_before_compare_or_a_live_monitor_reads_anything(tmp_path, capsys,
                                                                                               monkeypatch):
    """The report resolves every registered correction method's default plan (``mismatch/ratio_affected_frac/*``):
    compare met a plugin method whose ``to_verl`` fails only after reading both files, and a ``LiveMonitor`` at its
    first step. Both now refuse it first, with ``vexact measure``'s and ``vexact run``'s check."""
    from vexact.live import LiveMonitor
    from vexact.real import compare
    from vexact.registry import PluginCodeError
    from vexact.rl.corrections import CorrectionMethod, register_correction_method
    from vexact.rl.registries import CORRECTION_METHODS

    def no_read(*args, **kwargs):
        raise AssertionError("compare read the files before refusing the method")

    monkeypatch.setattr(compare, "_read_two_files", no_read)
    rollout, train = _two_files(tmp_path)
    register_correction_method(CorrectionMethod("outside_broken", "x", "x", lambda cfg: None))
    try:
        code, _, err = _run(capsys, rollout, train)
        with pytest.raises(PluginCodeError, match="correction method 'outside_broken'"):
            LiveMonitor(tmp_path / "live")
    finally:
        CORRECTION_METHODS.remove("outside_broken")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: correction method 'outside_broken' (to_verl) returned None"), err
    assert not (tmp_path / "live").exists()
