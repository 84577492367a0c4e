"""``vexact.testing`` and its pytest plugin: bitwise log-prob assertions for a user's own rollout engine and trainer.

Three ways: hand-built tensors whose report is written out here (count, first mismatch, values and bit patterns,
max |Δ|, k3 computed by hand); ``check_paths`` on vexact's exact backend (passes), on the native backend and on a
transformers model's generate + teacher-forced forward (both fail, and the report says where); and the
``vexact_exact`` fixture through the installed ``pytest11`` entry point, in a separate pytest process.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_prompts, run_pytest, tiny_model

from vexact import generate, token_logprobs
from vexact.testing import assert_logprobs_equal, check_paths, compare_logprobs, float_bits

NEXT_BELOW_MINUS_2 = float(torch.tensor(-2.0).nextafter(torch.tensor(-3.0)))  # -2 - 2**-22 in float32: 0xc0000001


def _raises(fn, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- assert_logprobs_equal, by hand
def test_report_of_one_mismatch_written_out():
    rollout = [torch.tensor([-0.25, -2.0]), torch.tensor([-1.0, -3.0, -0.125])]
    train = [torch.tensor([-0.25, -2.0]), torch.tensor([-0.5, -3.0, -0.125])]
    # r = -0.5 - (-1.0) = 0.5 on one token of five: k3 = (e^0.5 - 0.5 - 1) / 5 = 0.148721.../5 = 0.0297443
    expected = (
        "log-probs are not bitwise equal: 1 of 5 tokens mismatched (float32)\n"
        "first mismatch: sequence 1, position 0, token 7: rollout -1.0 (0xbf800000) vs training -0.5 (0xbf000000), "
        "Δ = 0.5\n"
        "max |Δ| = 0.5, k3 = 0.0297443 (float64 over the 5 tokens, r = training - rollout)\n"
        "mismatched tokens by sequence: 1: 1"
    )
    assert _raises(assert_logprobs_equal, rollout, train, tokens=[[1, 2], [7, 8, 9]]) == expected
    result = compare_logprobs(rollout, train)
    assert (result.tokens, result.mismatched, result.max_abs_diff) == (5, 1, 0.5)
    assert result.k3 == pytest.approx((math.exp(0.5) - 1.5) / 5, rel=1e-12)


def test_padded_tensor_with_mask_one_ulp_apart():
    # Row 0 is left-padded (its tokens sit in columns 1 and 2), row 1 right-padded (column 0).
    rollout = torch.tensor([[0.0, -1.0, -2.0], [-3.0, 0.0, 0.0]])
    train = rollout.clone()
    train[0, 2] = NEXT_BELOW_MINUS_2
    train[1, 1:] = 99.0  # padding may hold anything: the mask leaves it out
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    tokens = torch.tensor([[0, 5, 6], [7, 0, 0]])
    # r = -2**-22 on one token of three: k3 ≈ r²/2 / 3 = 2**-45 / 3 = 9.4739e-15
    expected = (
        "log-probs are not bitwise equal: 1 of 3 tokens mismatched (float32)\n"
        "first mismatch: sequence 0, position 1 (column 2), token 6: rollout -2.0 (0xc0000000) vs "
        "training -2.0000002 (0xc0000001), Δ = -2.38419e-07\n"
        "max |Δ| = 2.38419e-07, k3 = 9.4739e-15 (float64 over the 3 tokens, r = training - rollout)\n"
        "mismatched tokens by sequence: 0: 1"
    )
    assert _raises(assert_logprobs_equal, rollout, train, tokens=tokens, mask=mask) == expected
    assert compare_logprobs(rollout, train, mask=mask).max_abs_diff == 2.0**-22
    train[0, 2] = -2.0
    assert assert_logprobs_equal(rollout, train, tokens=tokens, mask=mask.bool()) is None
    assert assert_logprobs_equal(rollout, train, mask=[[False, True, True], [True, False, False]]) is None
    # a padded side against a list of sequences
    assert assert_logprobs_equal([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])], train, mask=mask) is None


def test_bit_patterns_not_values_sign_of_zero_and_nan():
    """-0.0 == 0.0 as values but not as bits; NaNs with equal bits are equal, with different payloads are not."""
    nan = torch.tensor([float("nan")])
    other_nan = (nan.view(torch.int32) | 1).view(torch.float32)  # 0x7fc00001
    rollout = torch.cat([torch.tensor([0.0]), nan, torch.tensor([-1.0]), nan])
    train = torch.cat([torch.tensor([-0.0]), nan, torch.tensor([-1.0]), other_nan])
    expected = (
        "log-probs are not bitwise equal: 2 of 4 tokens mismatched (float32)\n"
        "first mismatch: sequence 0, position 0: rollout 0.0 (0x00000000) vs training -0.0 (0x80000000), Δ = -0\n"
        "max |Δ| = 0, k3 = 0 (float64 over the 2 tokens where both are finite, r = training - rollout)\n"
        "NaN: 2 rollout, 2 training; ±inf: 0 rollout, 0 training\n"
        "mismatched tokens by sequence: 0: 2"
    )
    assert _raises(assert_logprobs_equal, rollout, train) == expected  # a 1-D tensor is one sequence
    assert compare_logprobs(rollout, train).first.position == 0
    assert assert_logprobs_equal([rollout], [rollout.clone()]) is None  # same NaN bits: equal


def test_bfloat16_float16_and_float64_bits():
    assert float_bits(torch.tensor(1.0)) == "0x3f800000"
    assert float_bits(torch.tensor(1.0, dtype=torch.float64)) == "0x3ff0000000000000"
    assert float_bits(torch.tensor(1.0, dtype=torch.float16)) == "0x3c00"
    assert float_bits(torch.tensor(-1.0, dtype=torch.bfloat16)) == "0xbf80"
    rollout = torch.tensor([-1.0, -0.5], dtype=torch.bfloat16)
    train = torch.tensor([-1.0078125, -0.5], dtype=torch.bfloat16)  # the next bfloat16 below -1: 0xbf81
    message = _raises(assert_logprobs_equal, [rollout], [train])
    assert message.startswith("log-probs are not bitwise equal: 1 of 2 tokens mismatched (bfloat16)\n"
                              "first mismatch: sequence 0, position 0: rollout -1.0 (0xbf80) vs training -1.0078125 "
                              "(0xbf81), Δ = -0.0078125\n")
    f64 = _raises(assert_logprobs_equal, [torch.tensor([1.0], dtype=torch.float64)], [[1.5]])  # Python floats: f64
    assert "rollout 1.0 (0x3ff0000000000000) vs training 1.5 (0x3ff8000000000000)" in f64


def test_numpy_arrays_and_lists_of_floats():
    a = np.array([-0.25, -1.5], dtype=np.float32)
    assert assert_logprobs_equal([a], [torch.tensor([-0.25, -1.5])]) is None
    assert assert_logprobs_equal([[-0.25, -1.5]], [a.astype(np.float64)]) is None
    padded = np.array([[-0.25, -1.5], [-2.0, 0.0]], dtype=np.float32)
    assert assert_logprobs_equal(padded, [a, np.array([-2.0], dtype=np.float32)],
                                 mask=np.array([[True, True], [True, False]])) is None
    assert "1 of 3 tokens" in _raises(assert_logprobs_equal, padded, [a, np.array([-2.5], dtype=np.float32)],
                                      mask=np.array([[1, 1], [1, 0]]))


@pytest.mark.parametrize("rollout,train,kwargs,message", [
    ([torch.zeros(2), torch.zeros(3)], [torch.zeros(2), torch.zeros(2)], {},
     "sequence 1: rollout has 3 log-probs but training has 2"),
    ([torch.zeros(2)], [torch.zeros(2), torch.zeros(1)], {}, "rollout has 1 sequences but training has 2"),
    ([torch.zeros(2)], [torch.zeros(2, dtype=torch.float64)], {},
     "sequence 0: training log-probs are float64, rollout sequence 0 is float32: values of two dtypes are never "
     "bitwise equal"),
    ([torch.zeros(2, dtype=torch.long)], [torch.zeros(2)], {},
     "sequence 0: rollout log-probs are torch.int64; expected float16, bfloat16, float32 or float64"),
    ([torch.zeros(1), torch.zeros(2, 2)], [torch.zeros(1), torch.zeros(4)], {},
     "rollout sequence 1 must be 1-D, got shape (2, 2)"),
    (torch.zeros(2, 3), torch.zeros(2, 3), {"mask": torch.ones(2, 2)}, "mask has shape (2, 2) but rollout has shape"),
    (torch.zeros(2, 3), torch.zeros(2, 3), {"mask": torch.full((2, 3), 2)},
     "mask must be bool or 0/1 integers, got torch.int64 values other than 0 and 1"),
    # a float mask of 0s and 1s was said to hold "other values"
    (torch.zeros(2, 3), torch.zeros(2, 3), {"mask": torch.ones(2, 3)},
     "mask must be bool or 0/1 integers, got dtype torch.float32 (for a 0/1 float mask pass mask.bool())"),
    ([torch.zeros(2)], [torch.zeros(2)], {"mask": torch.ones(1, 2)},
     "mask applies to a padded [B, T] tensor, but no argument is one"),
    ([torch.zeros(2)], [torch.zeros(2)], {"tokens": [[1, 2, 3]]}, "sequence 0: tokens has 3 ids but the log-probs"),
    (torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), {}, "must be a list of 1-D sequences or a padded [B, T] tensor"),
    # "equal", with nothing compared: a CI gate that asserts nothing (vexact compare refuses it too)
    ([torch.zeros(0), torch.zeros(0)], [torch.zeros(0), torch.zeros(0)], {},
     "no tokens to compare: every sequence is empty"),
    (torch.zeros(2, 3), torch.zeros(2, 3), {"mask": torch.zeros(2, 3, dtype=torch.bool)},
     "no tokens to compare: every sequence is empty"),
], ids=["lengths", "sequence-count", "two-dtypes", "int-dtype", "not-1d", "mask-shape", "mask-values",
        "mask-float", "mask-without-padded", "tokens-length", "3d", "empty", "masked-out"])
def test_inputs_that_cannot_be_compared_are_value_errors(rollout, train, kwargs, message):
    with pytest.raises(ValueError) as info:
        assert_logprobs_equal(rollout, train, **kwargs)
    assert message in str(info.value)


def test_object_arrays_and_bad_names_are_value_errors():
    """A ragged numpy batch (dtype object) was torch's TypeError "can't convert np.ndarray of type numpy.object_",
    naming no argument; ``names`` of another length was an IndexError from inside the report."""
    ragged = np.array([np.zeros(2), np.zeros(3)], dtype=object)
    with pytest.raises(ValueError) as info:
        compare_logprobs(ragged, ragged)
    assert str(info.value) == ("rollout is a numpy array of dtype object, not numbers (a ragged batch: pass a list of "
                               "1-D arrays)")
    with pytest.raises(ValueError) as info:
        compare_logprobs([torch.zeros(2)], [torch.zeros(1)], names=("engine",))
    assert str(info.value) == "names must be two strings (the rollout side's, the training side's), got ('engine',)"
    found = compare_logprobs([torch.tensor([-1.0])], [torch.tensor([-0.5])], names=["engine", "trainer"])
    assert found.names == ("engine", "trainer") and "engine -1.0 (0xbf800000) vs trainer -0.5" in found.message()


def test_long_reports_list_the_first_sequences_only():
    rollout = [torch.tensor([-1.0]) for _ in range(10)]
    message = _raises(assert_logprobs_equal, rollout, [r - 1 for r in rollout])
    assert message.endswith("mismatched tokens by sequence: 0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, "
                            "... (2 more sequences)")


# --------------------------------------------------------------------------- check_paths on hand-built callables
PROMPTS = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]


def _fake_generate(prompts, batch_size):
    """Deterministic per prompt content: tokens p[0] + 100 and p[-1] + 100, log-prob -(t - 100) / 8 for token t."""
    tokens = [[p[0] + 100, p[-1] + 100] for p in prompts]
    return tokens, _fake_score(prompts, tokens, None)


def _fake_score(prompts, responses, micro_batch_size):
    return [torch.tensor([-(t - 100) / 8 for t in r]) for r in responses]


def test_check_paths_passes_and_reports_the_arrangements():
    report = check_paths(_fake_generate, _fake_score, PROMPTS, permute=True)
    assert report["generation"] == ["batch_size=None", "batch_size=1", "batch_size=3", "batch_size=3, shuffled"]
    assert report["scoring"] == ["micro_batch_size=None", "micro_batch_size=1", "micro_batch_size=5"]
    assert (report["prompts"], report["response_tokens"]) == (5, 10)
    assert report["checks"] == 3 + 4 * 3  # 3 generation comparisons with the reference, 4 x 3 scorings
    assert report["tokens_compared"] == 15 * 10


def test_check_paths_names_the_broken_scoring_arrangement():
    def score(prompts, responses, micro_batch_size):
        out = _fake_score(prompts, responses, micro_batch_size)
        if micro_batch_size == 1:
            out[2] = torch.tensor([out[2][0].item(), NEXT_BELOW_MINUS_2])  # -6/8 = -0.75 became -2.0000002
        return out

    # r = -2.0000002 + 0.75 = -1.25000024 on one token of ten: k3 = (e^r - r - 1) / 10 = (0.2865047 + 0.2500002) / 10
    message = _raises(check_paths, _fake_generate, score, PROMPTS, batch_sizes=(None, 2))
    assert message == (
        "check_paths: 2 of 7 checks failed (5 prompts; reference: generate batch_size=None)\n"
        "[1] score micro_batch_size=1 of generate batch_size=None: log-probs are not bitwise equal: "
        "1 of 10 tokens mismatched (float32)\n"
        "    first mismatch: sequence 2, position 1, token 106: rollout -0.75 (0xbf400000) vs training -2.0000002 "
        "(0xc0000001), Δ = -1.25\n"
        "    max |Δ| = 1.25, k3 = 0.0536505 (float64 over the 10 tokens, r = training - rollout)\n"
        "    mismatched tokens by sequence: 2: 1\n"
        "[2] score micro_batch_size=1 of generate batch_size=2: log-probs are not bitwise equal: "
        "1 of 10 tokens mismatched (float32)\n"
        "    first mismatch: sequence 2, position 1, token 106: rollout -0.75 (0xbf400000) vs training -2.0000002 "
        "(0xc0000001), Δ = -1.25\n"
        "    max |Δ| = 1.25, k3 = 0.0536505 (float64 over the 10 tokens, r = training - rollout)\n"
        "    mismatched tokens by sequence: 2: 1"
    )


def test_check_paths_names_the_generation_arrangement_whose_tokens_differ():
    def gen(prompts, batch_size):
        tokens, logprobs = _fake_generate(prompts, batch_size)
        if batch_size == 1:
            tokens[3] = tokens[3][:1]  # prompt 3 stops early when generated alone
            logprobs[3] = logprobs[3][:1]
        return tokens, logprobs

    message = _raises(check_paths, gen, _fake_score, PROMPTS, micro_batch_sizes=(None,))
    assert message == (  # its rollout scores as it was generated: only the tokens differ
        "check_paths: 1 of 5 checks failed (5 prompts; reference: generate batch_size=None)\n"
        "[1] generate batch_size=1 vs generate batch_size=None (reference): tokens differ in 1 of 5 sequences; "
        "first: sequence 3, position 1: token (ended) vs 107 in the reference (lengths 1 vs 2)")


def test_check_paths_bad_callables_are_value_errors_naming_the_arrangement():
    def short(prompts, batch_size):
        tokens, logprobs = _fake_generate(prompts, batch_size)
        return (tokens[:-1], logprobs[:-1]) if batch_size == 3 else (tokens, logprobs)

    with pytest.raises(ValueError, match=r"generate_fn \(arrangement batch_size=3\) returned 4 token lists and 4 "
                                         r"log-prob sequences for 5 prompts"):
        check_paths(short, _fake_score, PROMPTS)

    def score_short(prompts, responses, micro_batch_size):
        return [lp[:1] for lp in _fake_score(prompts, responses, micro_batch_size)]

    with pytest.raises(ValueError, match=r"score_fn \(arrangement micro_batch_size=None, generate batch_size=None\): "
                                         r"sequence 0: rollout has 2 log-probs but training has 1"):
        check_paths(_fake_generate, score_short, PROMPTS)
    with pytest.raises(ValueError, match="prompts"):
        check_paths(_fake_generate, _fake_score, [])
    with pytest.raises(ValueError, match="micro_batch_sizes entries must be positive ints or None"):
        check_paths(_fake_generate, _fake_score, PROMPTS, micro_batch_sizes=(0,))


# --------------------------------------------------------------------------- check_paths on real models
def _vexact_fns(model, temperature: float = 1.0, max_new_tokens: int = 8):
    def generate_fn(prompts, batch_size):
        out = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=0,
                       batch_size=batch_size)
        return out.tokens, out.logprobs

    def score_fn(prompts, responses, micro_batch_size):
        with torch.no_grad():
            return token_logprobs(model, prompts, responses, temperature=temperature,
                                  micro_batch_size=micro_batch_size)

    return generate_fn, score_fn


def test_check_paths_passes_on_the_exact_backend(one_torch_thread):
    prompts = random_prompts(12, 20, seed=1)
    report = check_paths(*_vexact_fns(tiny_model("exact")), prompts)
    assert report["response_tokens"] == 12 * 8
    assert report["checks"] == 2 + 3 * 3 and report["tokens_compared"] == 11 * 12 * 8


def test_check_paths_exact_greedy_in_shuffled_order(one_torch_thread):
    prompts = random_prompts(6, 12, seed=2)
    report = check_paths(*_vexact_fns(tiny_model("exact"), temperature=0.0, max_new_tokens=5), prompts,
                         batch_sizes=(None, 1, 4), micro_batch_sizes=(None, 4), permute=True)
    assert report["generation"][-1] == "batch_size=4, shuffled" and report["checks"] == 3 + 4 * 2


def test_check_paths_exact_at_two_threads(one_torch_thread):
    """Kept small: on a busy 2-core host two OpenMP threads make tiny matmuls very slow."""
    report = check_paths(*_vexact_fns(tiny_model("exact"), max_new_tokens=3), random_prompts(3, 8, seed=3),
                         batch_sizes=(None,), micro_batch_sizes=(None, 2), threads=(2,))
    assert report["generation"] == ["batch_size=None", "batch_size=None, threads=2"]
    assert report["scoring"] == ["micro_batch_size=None", "micro_batch_size=2", "micro_batch_size=None, threads=2",
                                 "micro_batch_size=2, threads=2"]
    assert torch.get_num_threads() == 1  # restored


def test_check_paths_shuffled_order_catches_a_sampler_keyed_on_the_index(one_torch_thread):
    """vexact's own sampler keys on a prompt's index in the call, so at temperature 1 a shuffled order samples
    other tokens: the check must say so (and hint at why)."""
    message = _raises(check_paths, *_vexact_fns(tiny_model("exact")), random_prompts(6, 12, seed=2), permute=True)
    assert message.startswith("check_paths: 1 of 15 checks failed")
    assert "[1] generate batch_size=3, shuffled vs generate batch_size=None (reference): tokens differ in" in message
    assert "does your sampler depend on a prompt's place in the call?" in message


FIRST_MISMATCH = re.compile(r"first mismatch: sequence (\d+), position (\d+), token (\d+): rollout \S+ "
                            r"\((0x[0-9a-f]{8})\) vs training \S+ \((0x[0-9a-f]{8})\), Δ = \S+")


def test_check_paths_fails_on_the_native_backend_and_says_where(one_torch_thread):
    model = tiny_model("native")
    prompts = random_prompts(12, 20, seed=1)
    message = _raises(check_paths, *_vexact_fns(model), prompts)
    print(message)
    assert message.startswith("check_paths: ")
    block = message.split("score micro_batch_size=None of generate batch_size=None: ")[1].split("\n[")[0]
    assert block.startswith("log-probs are not bitwise equal: ")
    seq, pos, token, roll_bits, train_bits = FIRST_MISMATCH.search(block).groups()
    # the reported place is the first token whose bits differ, recomputed here independently
    out = generate(model, prompts, max_new_tokens=8, seed=0)
    with torch.no_grad():
        scored = token_logprobs(model, prompts, out.tokens)
    first = next((i, j) for i, (a, b) in enumerate(zip(out.logprobs, scored))
                 for j in range(len(a)) if a[j].view(torch.int32) != b[j].view(torch.int32))
    assert (int(seq), int(pos)) == first and int(token) == out.tokens[first[0]][first[1]]
    assert (roll_bits, train_bits) == (float_bits(out.logprobs[first[0]][first[1]]),
                                       float_bits(scored[first[0]][first[1]]))


def test_check_paths_fails_on_transformers_generate_vs_forward(one_torch_thread):
    from vexact.real.measure import HFPath, MeasureSettings
    from vexact.real.tiny import make_tiny_hf_model

    hf = HFPath(make_tiny_hf_model("llama", vocab_size=128))
    unused = Path(".")  # MeasureSettings wants a checkpoint path; HFPath never reads it

    def generate_fn(prompts, batch_size):  # greedy: tokens need no RNG, so only the log-probs can differ
        return hf.generate(prompts, MeasureSettings(unused, max_new_tokens=8, temperature=0.0, batch_size=batch_size),
                           None)

    def score_fn(prompts, responses, micro_batch_size):
        return hf.score(prompts, responses, MeasureSettings(unused, temperature=0.0, micro_batch_size=micro_batch_size))

    message = _raises(check_paths, generate_fn, score_fn, random_prompts(8, 20, vocab=128, seed=1))
    print(message)
    block = message.split("score micro_batch_size=None of generate batch_size=None: ")[1].split("\n[")[0]
    assert re.match(r"log-probs are not bitwise equal: \d+ of 64 tokens mismatched \(float32\)", block)
    assert FIRST_MISMATCH.search(block) and "max |Δ| = " in block and ", k3 = " in block


# --------------------------------------------------------------------------- importability and the pytest plugin
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_vexact_testing_imports_without_pytest():
    no_pytest = "import sys; sys.modules['pytest'] = None; "  # any 'import pytest' now raises ImportError
    assert _python(no_pytest + "import vexact.testing").returncode == 0
    blocked = _python(no_pytest + "import vexact.pytest_plugin")  # proves the block works: the plugin needs pytest
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr


@pytest.mark.slow
def test_plugin_is_registered_and_imports_nothing_heavy_itself():
    found = {e.name: e.value for e in entry_points(group="pytest11")}
    assert found.get("vexact") == "vexact.pytest_plugin", "run `pip install -e .` to register the pytest11 entry point"
    done = _python("import sys, vexact.pytest_plugin; print('vexact.testing' in sys.modules)")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.slow
def test_fixture_through_the_plugin(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import torch

        PROMPTS = [[1, 2], [3], [4, 5, 6]]

        def generate_fn(prompts, batch_size):
            return [[p[0]] for p in prompts], [torch.tensor([-p[0] / 4]) for p in prompts]

        def score_fn(prompts, responses, micro_batch_size):
            return [torch.tensor([-p[0] / 4]) for p in prompts]

        def test_passes(vexact_exact):
            assert vexact_exact.assert_logprobs_equal([torch.tensor([-1.0])], [torch.tensor([-1.0])]) is None
            assert vexact_exact.check_paths(generate_fn, score_fn, PROMPTS)["checks"] == 11
            assert vexact_exact.compare_logprobs([torch.tensor([-1.0])], [torch.tensor([-0.5])]).mismatched == 1

        def test_fails(vexact_exact):
            vexact_exact.assert_logprobs_equal([torch.tensor([-1.0])], [torch.tensor([-0.5])])
    """))
    # warnings as errors, as many CIs run: the fixture asked for record_property, which warns under xunit2
    run = run_pytest("--junitxml=junit.xml", "-W", "error::pytest.PytestWarning", "test_user.py", cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "1 failed, 1 passed" in out, out
    assert "first mismatch: sequence 0, position 0: rollout -1.0 (0xbf800000) vs training -0.5 (0xbf000000)" in out
    assert "vexact_exact.assert_logprobs_equal(" in out and "vexact/testing.py" not in out  # ends at the test's line
    assert 'name="vexact_check_paths"' in (tmp_path / "junit.xml").read_text()  # the report, recorded


def test_check_paths_with_no_response_token_is_refused():
    """An engine that generated nothing (max_new_tokens 0) passed every check with tokens_compared 0."""
    def nothing(prompts, batch_size):
        return [[] for _ in prompts], [torch.zeros(0) for _ in prompts]

    with pytest.raises(ValueError, match=r"^generate_fn \(arrangement batch_size=None\) returned no response token "
                                         r"for any prompt: no tokens to compare$"):
        check_paths(nothing, lambda prompts, responses, micro: [torch.zeros(0) for _ in prompts], [[1, 2], [3]])


def test_check_paths_restores_the_thread_count_after_a_failure(one_torch_thread):
    def score(prompts, responses, micro_batch_size):
        if torch.get_num_threads() == 2:
            raise RuntimeError("scoring broke at 2 threads")
        return _fake_score(prompts, responses, micro_batch_size)

    with pytest.raises(RuntimeError, match="scoring broke at 2 threads"):
        check_paths(_fake_generate, score, PROMPTS, threads=(2,))
    assert torch.get_num_threads() == 1
