"""``vexact compare`` on slime's debug dumps (THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515).

``--save-debug-train-data PATH`` makes slime's Megatron actor write ``torch.save(payload, PATH)`` where payload is
``_build_dump_payload``'s (``slime/observability/train_data_utils.py``): ``{"format_version": 2, "rollout_id",
"rank", "samples": [one dict per sample], "dp_shards": [...]}``. A sample holds the rollout batch's per-sample
fields: ``tokens`` (prompt + response, int64), ``total_lengths`` / ``response_lengths`` (ints), ``loss_masks``
(int32 over the response), ``rollout_log_probs`` (SGLang's) and ``log_probs`` (the actor's), float32 over the
response, plus ``advantages``, ``rewards``, ``sample_index``, ``rollout_position``, ``data_parallel_rank``.
``_train_dump`` below builds exactly that. What must hold: ``vexact compare FILE`` reads it with no flags (slime's
keys and mask by default) and gives the report of the same masked values written as verl-style JSON Lines, bit for
bit; the mask is applied; the first mismatch is named by sample, position and token; equal sides give k3 = 0; a
wrong key, a bad field and a file the weights-only unpickler refuses are each one error line.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy
import pytest
import torch
from test_compare import _report, _run  # the compare CLI run and its --json report, as test_compare.py runs them

from vexact.cli import main
from vexact.map.verdict import DEFAULT_TAIL_MAP, find_curve, fmt_t, load_map
from vexact.real.dump_files import REFUSED_FILE_HINT, SLIME_KEYS, SLIME_MASK_KEY

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = [3, 1, 4]  # prompt lengths
ROLL = [[-0.5, -1.0, -2.0, -0.25], [-0.125, -3.0], [-0.75, -0.0625, -1.5]]  # ragged responses (dyadic: exact)
MASKS = [[1, 1, 0, 1], [1, 1], [1, 1, 1]]  # sample 0's position 2 is not trained on (e.g. a tool's output)
MASKED_TRAIN = -4.0  # the actor's value at that masked position: differs, and must not be read
MISMATCH = (2, 1, -0.03125)  # sample 2, response position 1: the actor's log-prob there


def _train_dump(path: Path, *, mismatch: bool = True, **extra_field) -> Path:
    """A ``--save-debug-train-data`` file as slime writes it (``_build_dump_payload``, format_version 2)."""
    samples = []
    for i, (prompt, roll, mask) in enumerate(zip(PROMPTS, ROLL, MASKS, strict=True)):
        train = list(roll)
        if i == 0:
            train[2] = MASKED_TRAIN
        if mismatch and i == MISMATCH[0]:
            train[MISMATCH[1]] = MISMATCH[2]
        n = len(roll)
        samples.append({
            "data_parallel_rank": i % 2, "sample_index": i, "rollout_position": i,
            "tokens": torch.arange(prompt + n, dtype=torch.long) + 100 * i,
            "total_lengths": prompt + n, "response_lengths": n, "rewards": 1.0, "truncated": 0,
            "loss_masks": torch.tensor(mask, dtype=torch.int),
            "rollout_log_probs": torch.tensor(roll, dtype=torch.float32),
            "log_probs": torch.tensor(train, dtype=torch.float32),
            "advantages": torch.zeros(n), **extra_field})
    torch.save({"format_version": 2, "rollout_id": 0, "rank": 0, "samples": samples,
                "dp_shards": [{"rank": 0, "data_parallel_rank": 0, "sample_indices": [0, 2],
                               "micro_batch_indices": [[0, 1]]}]}, path)
    return path


def _jsonl_twin(path: Path, dump: Path) -> Path:
    """The same masked response tokens as verl-style one-file JSON Lines (float32 values written exactly)."""
    lines = []
    for i, sample in enumerate(torch.load(dump, weights_only=True)["samples"]):
        keep = sample["loss_masks"].bool()
        n = sample["response_lengths"]
        lines.append(json.dumps({"id": i, "rollout_log_probs": sample["rollout_log_probs"][keep].tolist(),
                                 "old_log_probs": sample["log_probs"][keep].tolist(),
                                 "tokens": sample["tokens"][-n:][keep].tolist()}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_slime_train_dump_compares_with_no_flags_like_its_jsonl_twin(tmp_path, capsys):
    dump = _train_dump(tmp_path / "train_0.pt")
    report = _report(capsys, dump, out=tmp_path / "r.json")
    assert (report["rollout_key"], report["train_key"]) == SLIME_KEYS == ("rollout_log_probs", "log_probs")
    # 3 + 2 + 3 = 8 trained tokens (sample 0's masked position is not read); one differs
    assert report["sequences"] == 3 and report["tokens"] == 8 and report["bitwise_equal"] == 7
    twin = _report(capsys, _jsonl_twin(tmp_path / "twin.jsonl", dump), out=tmp_path / "t.json")
    for key in ("metrics", "by_probability", "by_position", "tokens", "bitwise_equal"):
        assert report[key] == twin[key], key
    # the one differing token: |logp_train - logp_roll| = |-0.03125 - -0.0625|
    assert report["metrics"]["mismatch/abs_dlogp_max"] == 0.03125


def test_the_first_mismatch_names_the_sample_position_and_token(tmp_path, capsys):
    dump = _train_dump(tmp_path / "train_0.pt")
    first = _report(capsys, dump, out=tmp_path / "r.json")["first_mismatch"]
    sample, position, train = MISMATCH
    token = 100 * sample + PROMPTS[sample] + position  # tokens are prompt + response: the response is the tail
    assert (first["id"], first["position"], first["column"], first["token"]) == (sample, position, position, token)
    assert (first["rollout"], first["train"]) == (ROLL[sample][position], train)
    code, out, _ = _run(capsys, dump)
    assert code == 0 and f"first mismatch: id {sample}, position {position}, token {token}:" in out


def test_the_loss_mask_is_applied_and_none_reads_every_position(tmp_path, capsys):
    """Without the mask, sample 0's untrained position 2 (-2.0 vs -4.0) is the first mismatch; with it, never read.
    The column names the response position where masked positions came before the mismatch."""
    dump = _train_dump(tmp_path / "train_0.pt", mismatch=False)
    masked = _report(capsys, dump, out=tmp_path / "m.json")
    assert masked["tokens"] == 8 and masked["bitwise_equal"] == 8 and masked["first_mismatch"] is None
    every = _report(capsys, dump, "--mask-key", "none", out=tmp_path / "n.json")
    assert every["tokens"] == 9 and every["bitwise_equal"] == 8
    first = every["first_mismatch"]
    assert (first["id"], first["position"], first["train"]) == (0, 2, MASKED_TRAIN)
    # a mismatch after a masked position: position counts compared tokens, column the response position
    samples = torch.load(dump, weights_only=True)
    samples["samples"][0]["log_probs"][3] = -0.5
    torch.save(samples, dump)
    first = _report(capsys, dump, out=tmp_path / "c.json")["first_mismatch"]
    assert (first["id"], first["position"], first["column"], first["token"]) == (0, 2, 3, PROMPTS[0] + 3)


def test_bitwise_equal_sides_give_k3_zero_and_pass_the_gates(tmp_path, capsys):
    dump = _train_dump(tmp_path / "train_0.pt", mismatch=False)
    code, out, err = _run(capsys, dump, "--fail-on-mismatch", "--max-k3", "0", "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and err == "" and "first mismatch" not in out
    assert report["metrics"]["rollout_corr/k3_kl"] == 0.0 and report["bitwise_equal"] == report["tokens"] == 8
    assert _run(capsys, _train_dump(tmp_path / "diff.pt"), "--fail-on-mismatch")[0] == 1


def test_keys_can_be_overridden(tmp_path, capsys):
    """--rollout-key / --train-key name other per-sample fields (here: the sides swapped, and the reference model's
    log-probs, equal to the rollout's: k3 = 0)."""
    dump = _train_dump(tmp_path / "train_0.pt")
    swapped = _report(capsys, dump, "--rollout-key", "log_probs", "--train-key", "rollout_log_probs",
                      out=tmp_path / "s.json")
    assert (swapped["first_mismatch"]["rollout"], swapped["first_mismatch"]["train"]) == (MISMATCH[2],
                                                                                         ROLL[2][1])
    data = torch.load(dump, weights_only=True)
    for sample in data["samples"]:
        sample["ref_log_probs"] = sample["rollout_log_probs"].clone()
    torch.save(data, dump)
    ref = _report(capsys, dump, "--train-key", "ref_log_probs", out=tmp_path / "r.json")
    assert ref["train_key"] == "ref_log_probs" and ref["metrics"]["rollout_corr/k3_kl"] == 0.0
    assert ref["tokens"] == ref["bitwise_equal"] == 8


@pytest.mark.parametrize("argv, message", [
    (["--train-key", "old_log_probs"],
     "sample 0: no 'old_log_probs' key (the sample has 'advantages', 'data_parallel_rank', 'log_probs', "),
    (["--mask-key", "loss_mask"], "sample 0: no 'loss_mask' key to say which positions hold tokens; give "
                                  "--mask-key KEY, or --mask-key none if every position does"),
    (["--tokens-key", "responses"], "sample 0: no 'responses' key (--tokens-key)"),
])
def test_a_wrong_key_is_one_error_naming_file_sample_and_key(tmp_path, capsys, argv, message):
    dump = _train_dump(tmp_path / "train_0.pt")
    code, out, err = _run(capsys, dump, *argv)
    assert code == 2 and out == "" and err.startswith(f"error: {dump}: {message}"), err
    assert err.count("\n") == 1


def test_bad_fields_are_one_error_naming_file_sample_and_key(tmp_path, capsys):
    dump = tmp_path / "train_0.pt"

    def error(edit) -> str:
        _train_dump(dump)
        data = torch.load(dump, weights_only=True)
        edit(data["samples"])
        torch.save(data, dump)
        code, out, err = _run(capsys, dump)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        return err.removeprefix(f"error: {dump}: ").rstrip("\n")

    def split_by_cp(samples):  # log-probs still split by context parallelism: fewer than the response's tokens
        samples[1]["rollout_log_probs"] = samples[1]["rollout_log_probs"][:1]
        samples[1]["log_probs"] = samples[1]["log_probs"][:1]
        samples[1]["loss_masks"] = samples[1]["loss_masks"][:1]

    assert error(split_by_cp) == "sample 1: 'rollout_log_probs' has 1 values but 'response_lengths' is 2"
    assert error(lambda s: s[2].update(loss_masks=torch.ones(2, dtype=torch.int))) == (
        f"sample 2: mask {SLIME_MASK_KEY!r} has 2 values but 'rollout_log_probs' has 3")
    assert error(lambda s: s[2].update(loss_masks=torch.tensor([1, 2, 1]))) == (
        "sample 2: mask 'loss_masks' holds values other than 0 and 1")
    assert error(lambda s: s[1].update(log_probs=torch.tensor([-0.1, 0.5]))).startswith(
        "sample 1: 'log_probs' at column 1 is 0.5: a log-prob is at most 0")
    assert error(lambda s: s[0].update(log_probs=torch.zeros(2, 2))) == (
        "sample 0: 'log_probs' must be a 1-D dense floating-point tensor, got torch.float32 of shape [2, 2]")
    assert error(lambda s: s[1].update(tokens=torch.tensor([5]))) == (
        "sample 1: 'tokens' must hold at least the response's 2 token ids, none negative; got 1 values, min 5")
    assert error(lambda s: s.__setitem__(1, [1, 2])) == "sample 1 is a list, not a dict of the sample's fields"
    assert error(lambda s: s.clear()) == "empty (no sequences: 'samples' is an empty list)"


def test_a_rollout_dump_alone_says_which_dump_holds_both_sides(tmp_path, capsys):
    """--save-debug-rollout-data writes {"rollout_id", "samples": [Sample.to_dict()]}: the rollout side only
    (``slime/observability/rollout_data_utils.py``); its fields are lists."""
    sample = {"index": 0, "tokens": [1, 2, 3], "response_length": 2, "loss_mask": [1, 1], "status": "completed",
              "rollout_log_probs": [-0.5, -0.25], "reward": 1.0, "metadata": {}, "spec_info": {}}
    path = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": [sample]}, path)
    code, _, err = _run(capsys, path)
    assert code == 2 and err.endswith("(slime's --save-debug-train-data dump holds both sides; a "
                                      "--save-debug-rollout-data dump holds only the rollout's)\n"), err
    # its fields are lists, read as such: here with a training side added, under its own mask key
    sample["train_log_probs"] = [-0.5, -0.25]
    torch.save({"rollout_id": 0, "samples": [sample]}, path)
    report = _report(capsys, path, "--train-key", "train_log_probs", "--mask-key", "loss_mask",
                     out=tmp_path / "r.json")
    assert report["tokens"] == 2 and report["bitwise_equal"] == 2


def test_a_dump_the_weights_only_unpickler_refuses_says_what_to_do(tmp_path, capsys):
    """A numpy scalar (a reward computed with numpy) makes the file need the unsafe unpickler: never used."""
    dump = _train_dump(tmp_path / "train_0.pt", rewards=numpy.float64(1.0))
    code, out, err = _run(capsys, dump)
    assert code == 2 and out == ""
    assert err.startswith(f"error: refusing to unpickle {dump}: not a plain tensor file (it names numpy"), err
    assert err.endswith(f"); {REFUSED_FILE_HINT}\n") and "docs/live_and_recipes.md, section slime" in err, err
    assert err.count("\n") == 1


def _docs_section() -> str:
    page = Path(__file__).resolve().parents[2] / "docs" / "live_and_recipes.md"
    return page.read_text().split("### slime", 1)[1].split("\n### ", 1)[0]


def _docs_blocks() -> list[str]:
    return re.findall(r"```(?:bash|python)\n(.*?)```", _docs_section(), flags=re.S)


def test_the_docs_slime_recipe_runs_as_written(tmp_path, capsys, monkeypatch):
    """docs/live_and_recipes.md#slime: its compare command on a dump at the path its slime flag names, its
    conversion recipe on a dump the weights-only unpickler refuses, and its map placement on a dump it reads, with
    every correction its flag list names a curve of the shipped map."""
    flags, command, convert = _docs_blocks()[:3]
    path = re.search(r"--save-debug-train-data (\S+)", flags).group(1).format(rollout_id=0)
    monkeypatch.chdir(tmp_path)
    Path(path).parent.mkdir(parents=True)
    _train_dump(Path(path), rewards=numpy.float64(1.0))
    argv = shlex.split(command.split("#", 1)[0])
    assert argv[:2] == ["vexact", "compare"] and argv[2] == path
    assert main(argv[1:]) == 2 and "refusing to unpickle" in capsys.readouterr().err
    exec(compile(convert, "docs/live_and_recipes.md", "exec"), {"__name__": "__docs__"})
    plain = re.findall(r'"([^"]+\.pt)"', convert)[-1]  # the file the recipe writes
    assert main([*argv[1:2], plain, *argv[3:]]) == 0  # k3 = 6e-5 over 8 tokens: under the --max-k3 1e-3 gate
    out = capsys.readouterr().out
    assert "gate passed: --max-k3" in out and "first mismatch: id 2, position 1" in out

    (placement,) = [block for block in _docs_blocks() if "--map" in block]
    argv = shlex.split(placement.split("#", 1)[0])
    assert argv[:3] == ["vexact", "compare", path]
    _train_dump(Path(path))  # a dump compare reads (the one above needed converting)
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    # the page says: a real vocabulary picks the tail map, whose curves (all at lag 0) it names; the command's
    # token_tis is one of them, so its verdict comes from that curve; another correction gets the sentence that the
    # map has no curve for it, and a lag it has no curve at is an error
    said = _docs_section().split("A real vocabulary picks the tail map, whose curves are ", 1)[1].split(" all at", 1)[0]
    tail = load_map(DEFAULT_TAIL_MAP)
    tail_curves = [c["correction"] for c in tail["curves"]]
    assert re.findall(r"`(\w+)`", said) == tail_curves and {c["policy_lag"] for c in tail["curves"]} == {0}
    map_line = out[out.index("\nmap: "):]
    t0, t1 = find_curve(tail, "token_tis")["horizon_range"]  # the tail map's curve answers, not the main map's
    assert f"correction token_tis: no verdict at this horizon: T = 2.7 lies below the token_tis curve's measured " \
           f"horizons (T = {fmt_t(t0)} .. {fmt_t(t1)})" in map_line
    other = [*argv[1:argv.index("--correction") + 1], "icepop", *argv[argv.index("--correction") + 2:]]
    assert main(other) == 0
    other_line = capsys.readouterr().out
    assert "has no curve for your correction" in other_line and "the tail map shipped with vexact" in other_line
    assert f"(its curves there: {', '.join(tail_curves)})" in other_line
    lagged = [*argv[1:argv.index("--policy-lag") + 1], "1", *argv[argv.index("--policy-lag") + 2:]]
    assert main(lagged) == 2 and "has no curve at policy lag 1" in capsys.readouterr().err
    on_the_map = _docs_section().split("**On the collapse map.**", 1)[1].split("**The live hook.**", 1)[0]
    names = set(re.findall(r"--correction (\w+)", on_the_map))
    assert names == {"recompute", "bypass", "token_tis", "seq_tis", "icepop"}
    assert [name for name in sorted(names) if find_curve(load_map(), name) is None] == []  # main map, lag 0
