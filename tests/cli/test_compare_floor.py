"""``vexact compare --floor DUMP``: the trainer's own noise floor, and whether the user's k3 stands above it.

What must hold: the floor's k3 is the hand value k3(train vs train2); a k3 far above a small floor is
"distinguishable", one of the floor's own size "indistinguishable", by the bootstrap rule (a constructed case each);
a floor dump of other tokens, lengths, ids or shapes is one error (exit 2); and on vexact's exact backend two batch
arrangements of the same scoring give bitwise equal log-probs, so the floor is exactly 0.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import random_prompts, tiny_model
from safetensors.torch import save_file

from vexact.cli import main
from vexact.engine.scoring import token_logprobs
from vexact.real.floor import FLOOR_QUANTILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dump(path, rows: dict, tokens: dict | None = None):
    lines = [{"id": i, "logprobs": v, **({"tokens": tokens[i]} if tokens else {})} for i, v in rows.items()]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    return path


def _compare(tmp_path, capsys, roll: dict, train: dict, floor: dict, tokens: dict | None = None,
             floor_tokens: dict | None = None) -> tuple[int, str, str, dict | None]:
    args = [str(_dump(tmp_path / "r.jsonl", roll, tokens)), str(_dump(tmp_path / "t.jsonl", train, tokens)),
            "--floor", str(_dump(tmp_path / "f.jsonl", floor, floor_tokens or tokens)),
            "--json", str(tmp_path / "out.json")]
    code = main(["compare", *args])
    out = capsys.readouterr()
    report = json.loads((tmp_path / "out.json").read_text()) if code == 0 else None
    return code, out.out, out.err, report


def _k3(a: list[float], b: list[float]) -> float:
    return sum(math.expm1(x - y) - (x - y) for x, y in zip(a, b)) / len(a)  # e^r - r - 1, without its cancellation


def _sequences(n: int, shift: float, floor_shift: float) -> tuple[dict, dict, dict]:
    """n sequences of 4 tokens: the rollout off the trainer by ``shift`` at every token, the second training scoring
    off it by ``floor_shift`` (alternating sign) -- every value a dyadic rational, exact in float64."""
    train = {i: [-1.0, -2.0, -0.5, -3.0] for i in range(n)}
    roll = {i: [v - shift for v in train[i]] for i in range(n)}
    floor = {i: [v + (floor_shift if (i + j) % 2 else -floor_shift) for j, v in enumerate(train[i])]
             for i in range(n)}
    return roll, train, floor


def test_a_k3_far_above_the_floor_is_distinguishable(tmp_path, capsys):
    roll, train, floor = _sequences(8, shift=0.25, floor_shift=2**-10)
    code, out, err, report = _compare(tmp_path, capsys, roll, train, floor)
    assert code == 0, err
    f = report["floor"]
    flat = lambda d: [v for i in sorted(d) for v in d[i]]  # noqa: E731
    assert f["k3_floor"] == pytest.approx(_k3(flat(train), flat(floor)), rel=1e-12, abs=0)
    assert f["k3"] == report["metrics"]["rollout_corr/k3_kl"]
    assert f["ratio"] == pytest.approx(f["k3"] / f["k3_floor"], rel=1e-12) and f["ratio"] > 1000
    assert f["distinguishable"] is True and f["d_quantile"] > 0
    assert "distinguishable from the floor" in out and "indistinguishable" not in out
    assert f"the {FLOOR_QUANTILE:g}-quantile of k3 − k3_floor" in out


def test_a_k3_the_size_of_the_floor_is_indistinguishable(tmp_path, capsys):
    """The rollout is off the trainer by as much as the trainer's second arrangement: no engine mismatch to see."""
    roll, train, floor = _sequences(8, shift=0.0, floor_shift=2**-8)
    roll = {i: [v + (2**-8 if (i + j) % 2 else -2**-8) for j, v in enumerate(train[i])] for i in train}
    roll[0] = [v + 2**-7 for v in train[0]]  # one sequence a bit further: k3 above the floor, but by chance
    code, out, err, report = _compare(tmp_path, capsys, roll, train, floor)
    assert code == 0, err
    f = report["floor"]
    assert f["k3"] > f["k3_floor"] > 0 and f["distinguishable"] is False and f["d_quantile"] <= 0
    assert "indistinguishable from the floor" in out


@pytest.mark.parametrize("change, message", [
    (lambda f, t: (f.update({0: f[0][:3]}), t.update({0: t[0][:3]})), "has 3 log-probs here but"),
    (lambda f, t: f.pop(1), "no sequence with this id in the --floor dump"),
    (lambda f, t: (f.update({99: [-1.0]}), t.update({99: [1]})), "not among the compared ones"),
    (lambda f, t: t.update({2: [7, 7, 7, 8]}), "--floor dump's tokens differ from"),
])
def test_a_floor_of_other_tokens_is_one_error(tmp_path, capsys, change, message):
    roll, train, floor = _sequences(3, shift=0.25, floor_shift=2**-10)
    tokens = {i: [1, 2, 3, 4] for i in train}
    floor_tokens = {i: list(v) for i, v in tokens.items()}
    change(floor, floor_tokens)
    code, out, err, _ = _compare(tmp_path, capsys, roll, train, floor, tokens, floor_tokens)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_floor_tensor_file_of_another_shape_is_one_error(tmp_path, capsys):
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.0]])
    save_file({"rollout_log_probs": lp, "old_log_probs": lp.clone(), "response_mask": torch.ones(2, 3)},
              str(tmp_path / "both.safetensors"))
    save_file({"old_log_probs": lp[:, :2].contiguous(), "response_mask": torch.ones(2, 2)},
              str(tmp_path / "floor.safetensors"))
    code = main(["compare", str(tmp_path / "both.safetensors"), "--floor", str(tmp_path / "floor.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and "has 2 log-probs here but" in err and len(err.strip().splitlines()) == 1


def test_on_the_exact_backend_the_floor_is_exactly_zero(tmp_path, capsys):
    """Two batch arrangements of exact scoring -- all sequences in one batch, and one at a time in reverse order --
    give bitwise equal log-probs, so k3(train vs train2) is 0.0 exactly and any k3 > 0 is above the floor."""
    model = tiny_model("exact")
    prompts = random_prompts(4, 6, seed=1)
    responses = random_prompts(4, 5, seed=2)
    whole = token_logprobs(model, prompts, responses)
    order = list(reversed(range(4)))
    single = dict(zip(order, token_logprobs(model, [prompts[i] for i in order], [responses[i] for i in order],
                                            micro_batch_size=1)))
    assert all(torch.equal(whole[i], single[i]) for i in range(4))
    train = {i: whole[i].tolist() for i in range(4)}
    floor = {i: single[i].tolist() for i in range(4)}
    roll = {i: [v - 2**-12 for v in train[i]] for i in range(4)}  # a rollout engine off by a little
    code, out, err, report = _compare(tmp_path, capsys, roll, train, floor)
    assert code == 0, err
    f = report["floor"]
    assert f["k3_floor"] == 0.0 and f["bitwise_equal_frac"] == 1.0 and f["ratio"] is None
    assert f["distinguishable"] is True and f["k3"] > 0
    assert "bitwise equal: the trainer is batch-invariant" in out


def test_a_floor_off_by_an_ulp_is_zero_but_not_called_bitwise_equal(tmp_path, capsys):
    """Near-certain tokens the second scoring rounds one ulp apart: k3_floor is 0 (the terms are below float64's
    reach), and the verdict said "bitwise equal: the trainer is batch-invariant" of a floor that is not."""
    train = {i: [-1.458e-9, -2.5e-10, -3.75e-9] for i in range(4)}
    roll = {i: [v - 0.25 for v in train[i]] for i in train}
    floor = {i: [math.nextafter(v, 0.0) for v in train[i]] for i in train}
    code, out, err, report = _compare(tmp_path, capsys, roll, train, floor)
    assert code == 0, err
    f = report["floor"]
    assert f["k3_floor"] == 0 and f["bitwise_equal_frac"] == 0 and f["distinguishable"] is True
    assert "1 of the tokens differ, by too little to move k3 off 0" in f["verdict"]
    assert "batch-invariant" not in f["verdict"] and "batch-invariant" not in out
