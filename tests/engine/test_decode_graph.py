"""``generate(cuda_graphs=True)``'s decode step replayed from a recording (``vexact.engine.decode_graph``).

On the CPU the recording is ``RerunRecorder`` (the step run again at each replay): what is checked here is the
buffers' plumbing -- inputs copied into the static buffers, the first step run for real and then recorded, every
later step a replay, the output copied out before the next replay overwrites it -- bit for bit against the eager
loop, and the fallback when a step cannot be recorded. That a CUDA graph's replay gives its eager step's bits is
checked on a GPU (``benchmarks.gpu_real``, parts ``graphed`` and ``rollout``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, tiny_model

from vexact import generate
from vexact.engine import generation
from vexact.engine.decode_graph import DecodeStep, RerunRecorder

EOS = 3


@torch.no_grad()  # as generate runs it
def _batch(model, prompts, recorder, temperature=1.0, eos=EOS):
    return generation._generate_batch(model, prompts, 0, 24, temperature, 11, eos, None, model.ops, None, 1,
                                      recorder)


class _CountingRecorder(RerunRecorder):
    def __init__(self) -> None:
        self.warm_ups = self.records = self.replays = 0

    def warm_up(self, step):
        self.warm_ups += 1
        return super().warm_up(step)

    def record(self, step):
        self.records += 1
        replay, out = super().record(step)

        def counted() -> None:
            self.replays += 1
            replay()
        return counted, out


@pytest.mark.parametrize("backend", ["exact", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_recorded_decode_step_replayed_gives_the_eager_loops_bits(backend, dtype, temperature):
    model = tiny_model(backend, dtype)
    prompts = random_prompts(6, 9, seed=2)
    eager = _batch(model, prompts, None, temperature, eos=None)
    recorder = _CountingRecorder()
    replayed = _batch(model, prompts, recorder, temperature, eos=None)
    assert replayed.tokens == eager.tokens
    assert all(torch.equal(a, b) for a, b in zip(replayed.logprobs, eager.logprobs))
    # 23 decode steps: the first run for real and recorded once, the other 22 replays
    assert (recorder.warm_ups, recorder.records, recorder.replays) == (1, 1, 22)


def test_recorded_steps_stop_at_eos_as_the_eager_loop_does():
    model = tiny_model("exact", torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    prompts = random_prompts(8, 9, seed=4)
    eager, replayed = _batch(model, prompts, None), _batch(model, prompts, RerunRecorder())
    assert replayed.tokens == eager.tokens and replayed.finished == eager.finished and any(eager.finished)
    assert all(torch.equal(a, b) for a, b in zip(replayed.logprobs, eager.logprobs))


def test_the_output_handed_back_is_a_copy_the_next_replay_does_not_overwrite():
    calls = []

    def run(token, positions):
        calls.append(int(token[0]))
        return token.float() * 10

    step = DecodeStep(run, batch=2, device=torch.device("cpu"), recorder=RerunRecorder())
    first = step(torch.tensor([1, 2]), torch.tensor([0, 0]))
    second = step(torch.tensor([3, 4]), torch.tensor([1, 1]))
    third = step(torch.tensor([5, 6]), torch.tensor([2, 2]))
    assert first.tolist() == [10.0, 20.0] and second.tolist() == [30.0, 40.0] and third.tolist() == [50.0, 60.0]
    assert calls == [1, 1, 3, 5]  # warm-up, recording (the same inputs), then one run per replay


class _Refusing(RerunRecorder):
    def record(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_step_that_cannot_be_recorded_is_said_once_and_runs_eagerly_with_the_same_bits():
    model = tiny_model("exact", torch.bfloat16)
    prompts = random_prompts(5, 7, seed=3)
    eager = _batch(model, prompts, None)
    with pytest.warns(RuntimeWarning, match="could not be recorded in a CUDA graph.*decoding eagerly") as said:
        fallback = _batch(model, prompts, _Refusing())
    assert len(said) == 1
    assert fallback.tokens == eager.tokens
    assert all(torch.equal(a, b) for a, b in zip(fallback.logprobs, eager.logprobs))


def test_cuda_graphs_is_refused_where_it_cannot_run():
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="needs a model on a CUDA device, not cpu"):
        generate(tiny_model("exact"), prompts, max_new_tokens=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="MoE model's decode step records its routing on the host"):
        generate(tiny_model("exact", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), prompts,
                 max_new_tokens=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False, got 'yes'"):
        generate(tiny_model("exact"), prompts, max_new_tokens=2, cuda_graphs="yes")
