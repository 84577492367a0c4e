"""The decode step replayed from a CUDA graph: the same kernels, without Python or launch overhead per step.

On a GPU an eager decode step is launch-bound (hundreds of small kernels a step; at ``qwen3_1_7b``, batch 64, an
H200 was busy a fifth of the step's wall time). ``DecodeStep`` records ``decode_one_token`` once and replays it each
step on static token and position buffers: the KV cache is preallocated for the whole generation, so every replay
reads and writes the same memory, and the kernels read the positions from the buffer (nothing about a step is
decided on the host). Same kernels, same inputs: the same bits as the eager step.

How a step is recorded is a value passed in (a ``Recorder``): ``CudaGraphRecorder`` on a GPU; ``RerunRecorder``,
which runs the step again at each replay, lets the CPU check the buffers' plumbing bit for bit without a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

Step = Callable[[], Tensor]


class Recorder(Protocol):
    """How ``DecodeStep`` warms a step up and records it."""

    def warm_up(self, step: Step) -> Tensor:
        """Run ``step`` once for real (its output is this decode step's), before anything is recorded."""

    def record(self, step: Step) -> tuple[Callable[[], None], Tensor]:
        """(replay, output): ``replay()`` runs the recorded step again, refilling ``output``."""


class CudaGraphRecorder:
    """torch's capture recipe: warm up on a side stream (compilation, autotuning and the allocator's first blocks
    stay out of the graph), then capture in a ``torch.cuda.CUDAGraph``. Capturing runs no kernel."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def warm_up(self, step: Step) -> Tensor:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def record(self, step: Step) -> tuple[Callable[[], None], Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph.replay, out


class RerunRecorder:
    """A stand-in that runs the step again at each replay (and once when recording, on the inputs the warm-up had:
    the same cache writes, the same values): ``DecodeStep``'s buffers checked on any device."""

    def warm_up(self, step: Step) -> Tensor:
        return step()

    def record(self, step: Step) -> tuple[Callable[[], None], Tensor]:
        out = step()
        return lambda: out.copy_(step()), out


class DecodeStep:
    """``decode(token, positions) -> logits`` replaying one recorded step.

    ``run(token, positions)`` is the eager step (``decode_one_token`` with the model, cache and ops bound). The
    first call copies its inputs into the static buffers, runs the step once for real on them (the recorder's
    warm-up) and records it; each later call copies its inputs in and replays. The logits returned are a copy: the
    next replay overwrites the recorded output. A step that cannot be recorded (an op that reads a tensor back to
    the host, say) is said once as a warning and runs eagerly from then on: slower, the same bits.
    """

    def __init__(self, run: Callable[[Tensor, Tensor], Tensor], batch: int, device: torch.device,
                 recorder: Recorder) -> None:
        self.run = run
        self.recorder = recorder
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.replay: Callable[[], None] | None = None
        self.output: Tensor | None = None
        self.eager = False

    def _on_buffers(self) -> Tensor:
        return self.run(self.token, self.positions)

    def __call__(self, token: Tensor, positions: Tensor) -> Tensor:
        if self.eager:
            return self.run(token, positions)
        self.token.copy_(token)
        self.positions.copy_(positions)
        if self.replay is None:
            logits = self.recorder.warm_up(self._on_buffers)
            try:
                self.replay, self.output = self.recorder.record(self._on_buffers)
            except Exception as error:  # noqa: BLE001 -- recording is a speed-up: without it the step runs eagerly
                self.eager = True
                warnings.warn(f"vexact: the decode step could not be recorded in a CUDA graph ({type(error).__name__}: "
                              f"{error}); decoding eagerly", RuntimeWarning, stacklevel=2)
            return logits
        self.replay()
        return self.output.clone()
