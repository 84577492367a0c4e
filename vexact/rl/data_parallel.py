"""Data parallelism whose results do not depend on the number of ranks.

``vexact run CONFIG --nproc N`` (or ``torchrun --nproc-per-node N -m vexact run CONFIG``) runs N ranks. Each rank
generates and scores its share of the step's sequences; the shares are gathered, so every rank holds the whole
batch, and everything computed from it (advantages, corrections, metrics, the loss value) is the same code on
the same numbers as in one process. Per-sequence results do not depend on which rank computed them, because the
kernels are batch-invariant and sampling is keyed by the global sequence index.

What does depend on the split is a gradient: a sum over tokens, whose rounding depends on how it is grouped.
So the grouping is fixed by the config, not by N:

* each PPO mini-batch is cut into ``distributed.leaves`` = L leaves of equal size (in sequence order);
* each leaf's gradient comes from its own backward (its own padded shape), in fp32;
* the leaves are summed by one fixed binary tree over leaf index: ``tree_sum`` splits a list in halves
  (at ``len // 2``) and adds the two halves' sums.

With N a power of two dividing L, rank r owns the leaves ``[r L/N, (r+1) L/N)``, which is one subtree of that tree:
the rank sums it locally, then the ranks' subtotals are combined by the top of the same tree. That last part is a
deterministic reduce-scatter (``all_to_all``: rank j receives every rank's j-th chunk, and sums them with
``tree_sum`` in rank order) and an ``all_gather`` of the chunks. Element by element, the additions are exactly
those of the one-process tree, so the gradient, and with it the whole run, is bitwise the same for N = 1, 2, 4, ...

``distributed.reduce: allreduce`` replaces the reduce-scatter by a plain ``all_reduce``, whose summation order
is the collective's (a ring, by chunk): the run then depends on N. It exists to measure the difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..cli_base import RANK_ERRORS_ENV
from .lifetime import die_with_parent

STORE_ENV = "VEXACT_DIST_STORE"
"""A file the ranks rendezvous through (set by ``vexact run --nproc``); without it, torchrun's env:// store."""
LAUNCHER_ENV = "VEXACT_LAUNCHER_PID"
"""The pid of the ``vexact run --nproc`` process that started the ranks: they die with it (``die_with_parent``: the
elastic agent starts them from the launcher's main thread, which lives as long as the launcher)."""

ReduceMode = Literal["tree", "allreduce"]


def tree_sum(parts: list[Tensor]) -> Tensor:
    """The sum of ``parts`` along the fixed binary tree over their index: (first half) + (second half)."""
    if not parts:
        raise ValueError("tree_sum of no tensors")
    if len(parts) == 1:
        return parts[0]
    mid = len(parts) // 2
    return tree_sum(parts[:mid]) + tree_sum(parts[mid:])


def check_leaves(leaves: int, world_size: int, nproc: bool = True) -> None:
    """Raise ValueError unless ``world_size`` ranks can share ``leaves`` leaves along the tree. ``nproc``: the count
    is ``vexact run --nproc``'s; False: the ranks' environment's (WORLD_SIZE, as torchrun sets it), whose errors
    name no flag the user did not give."""
    ranks = f"--nproc {world_size}" if nproc else f"{world_size} ranks (WORLD_SIZE)"
    if world_size & (world_size - 1):
        raise ValueError(f"{ranks}: the number of ranks must be a power of two (1, 2, 4, ...), so that "
                         "each rank's leaves are one subtree of the gradient tree")
    if leaves % world_size:
        raise ValueError(f"config error at 'distributed.leaves': {leaves} leaves cannot be shared by {world_size} "
                         f"ranks; set it to a multiple of {'--nproc' if nproc else 'the number of ranks'} (e.g. "
                         f"--set distributed.leaves={world_size})")


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the ranks of a run; ``DataParallel()`` is the single-process run."""

    rank: int = 0
    world_size: int = 1
    reduce: ReduceMode = "tree"

    @staticmethod
    def environment_rank() -> int:
        """This process's rank as its launcher (torchrun, ``vexact run --nproc``) set it in ``RANK``; 0 when alone."""
        return int(os.environ.get("RANK", "0"))

    @classmethod
    def from_environment(cls, reduce: ReduceMode = "tree", device: torch.device | str = "cpu") -> DataParallel:
        """Join the ranks that torchrun / ``vexact run --nproc`` started (WORLD_SIZE, RANK), or be alone.

        gloo for CPU tensors, nccl for CUDA ones."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if LAUNCHER_ENV in os.environ:  # started by vexact run --nproc: never outlive it (kill -9 included)
            die_with_parent(int(os.environ[LAUNCHER_ENV]))
        if world == 1:
            return cls(reduce=reduce)
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            store_path = os.environ.get(STORE_ENV)
            if store_path:  # a file: no TCP store listening on every interface
                rank = cls.environment_rank()
                dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                                        world_size=world)
            else:
                dist.init_process_group(backend)
        return cls(dist.get_rank(), dist.get_world_size(), reduce)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory and prints."""
        return self.rank == 0

    def block(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (the first ``n % world_size`` ranks take one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def gather(self, items: list) -> list:
        """Every rank's ``items`` concatenated in rank order; every rank gets the same list."""
        if self.world_size == 1:
            return list(items)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum_gradients(self, local_leaves: list[Tensor]) -> Tensor:
        """The sum over all leaves of the run's flat fp32 gradient, given this rank's leaves (in order)."""
        subtotal = tree_sum(local_leaves)
        if self.world_size == 1:
            return subtotal
        if self.reduce == "allreduce":
            dist.all_reduce(subtotal)
            return subtotal
        return self._tree_across_ranks(subtotal)

    def _tree_across_ranks(self, subtotal: Tensor) -> Tensor:
        """Top of the tree: reduce-scatter by ``tree_sum`` over ranks in rank order, then all_gather."""
        w, n = self.world_size, subtotal.numel()
        chunk = -(-n // w)
        padded = torch.zeros(chunk * w, dtype=subtotal.dtype, device=subtotal.device)
        padded[:n] = subtotal
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded)  # row j of `received`: rank j's copy of this rank's chunk
        mine = tree_sum(list(received.view(w, chunk).unbind(0)))
        chunks = [torch.empty_like(mine) for _ in range(w)]
        dist.all_gather(chunks, mine)
        return torch.cat(chunks)[:n]

    def close(self, wait: bool = True) -> None:
        """Leave the process group, once every rank is done unless ``wait`` is False (after an interrupt, when
        the other ranks may never get there). A rank that leaves early aborts gloo's peers."""
        if self.world_size > 1 and dist.is_initialized():
            if wait:
                dist.barrier()
            dist.destroy_process_group()


def launch(nproc: int, python_args: list[str], threads: int | None = None, errors_dir: str | None = None) -> None:
    """Run ``python <python_args>`` (``vexact run --nproc``: ``-m vexact run ...``) as ``nproc`` ranks on this
    machine, through torch.distributed's elastic launcher (what torchrun runs), and wait for them.

    Single-machine only, so everything stays on loopback: the ranks rendezvous through files in a private
    temporary directory (no TCP store, which would listen on every interface) and gloo binds to ``lo``.

    ``threads``: torch threads per rank; default: this process's count, the one a single-process run here uses.
    With the exact backend it changes no bit (forward, backward and update are thread-count invariant); with
    ``native`` it does. ``errors_dir``: where the ranks leave their error lines (``cli_base.RANK_ERRORS_ENV``).
    Raises ``ChildFailedError`` if a rank exits non-zero."""
    import logging
    import sys
    import tempfile
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own warnings (one line per rank it signals) and errors (one per failed rank) repeat what the ranks
    # and ``vexact run --nproc`` print themselves.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    # torch reads this switch only from the launching process's environment: without it, the c10d rendezvous
    # starts a TCP store for the ranks, listening on every interface. Nothing else in vexact rendezvouses.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with tempfile.TemporaryDirectory(prefix="vexact-ranks-") as tmp:
        rank_env = {STORE_ENV: os.path.join(tmp, "process_group"), LAUNCHER_ENV: str(os.getpid()),
                    "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                    "OMP_NUM_THREADS": str(threads or torch.get_num_threads())}
        if errors_dir is not None:
            rank_env[RANK_ERRORS_ENV] = errors_dir
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint=os.path.join(tmp, "rendezvous"),
                              rdzv_configs={"store_type": "file"}, max_restarts=0, monitor_interval=0.1,
                              local_addr="127.0.0.1")
        # each rank is `env K=V ... python ARGS`: the ranks' variables are passed, this process's stay as they are
        elastic_launch(config, "env")(*(f"{k}={v}" for k, v in rank_env.items()), sys.executable, *python_args)
