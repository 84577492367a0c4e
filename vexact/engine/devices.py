"""Where vexact computes: the ``device`` setting (run config key, ``--device`` on the commands) and its rules.

One place for the spellings (``cpu``, ``cuda``, ``cuda:N``, ``auto``), for what ``auto`` means (CUDA when
``torch.cuda.is_available()``, else the CPU), for the one error a CUDA device gives where there is none, and for how
parallel workers share the GPUs of one machine (sweep worker slots, ``--nproc`` ranks: index mod device count).
The default is ``cpu``: a run that names no device computes where it always did, with the same bits.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is resolved: --help (which spells the names) needs none
    import torch

DEFAULT_DEVICE = "cpu"
DEVICE_NAMES = ("cpu", "cuda", "cuda:N", "auto")
"""The accepted spellings (``cuda:N``: GPU number N), for messages and ``--help``."""

DEVICE_HELP = "where the models compute: cpu, cuda, cuda:N or auto (CUDA when available, else cpu)"

_PATTERN = re.compile(r"^(cpu|auto|cuda(:(0|[1-9]\d{0,8}))?)$")  # a GPU number torch parses: no leading 0


class DeviceError(ValueError):
    """A device name that is malformed or names hardware this machine lacks; ``key`` names the setting."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"config error at '{key}': {problem}" if key != "--device" else f"--device: {problem}")


def check_device_name(name: object, key: str = "device") -> str:
    """``name`` if it is one of the accepted spellings (``DEVICE_NAMES``), else ``DeviceError`` naming ``key``.
    Only the spelling is checked: a config naming ``cuda`` stays readable where there is no GPU (a report of a GPU
    run on a laptop); ``resolve_device`` checks the hardware when the work starts."""
    if not isinstance(name, str) or not _PATTERN.match(name):
        raise DeviceError(key, f"expected one of {', '.join(DEVICE_NAMES)}, got {name!r}")
    return name


def cuda_device_count() -> int:
    """GPUs torch can use here (0 without CUDA). Its own function so tests can pretend to have several."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, key: str = "device") -> torch.device:
    """The torch device ``name`` means on this machine: ``auto`` is CUDA when available, else the CPU. A CUDA
    device where there is none (or a GPU number past the last) is one ``DeviceError`` naming ``key`` and CUDA."""
    import torch

    check_device_name(name, key)
    if name == "auto":
        return torch.device("cuda" if cuda_device_count() else "cpu")
    device = torch.device(name)
    if (problem := missing_gpu(device)) is not None:
        raise DeviceError(key, problem if cuda_device_count() else f"{problem}; use cpu or auto")
    return device


def missing_gpu(device: torch.device) -> str | None:
    """Why ``device`` cannot compute on this machine -- a CUDA device where torch sees none, or a GPU number past
    the last -- or None. The one check behind ``resolve_device`` and ``Transformer(device=...)``."""
    import torch

    if device.type != "cuda":
        return None
    count = cuda_device_count()
    if not count:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"{str(device)!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}, {build})")
    if device.index is not None and device.index >= count:
        return (f"{str(device)!r} names GPU {device.index}, but this machine has {count} CUDA device(s): "
                f"cuda:0 .. cuda:{count - 1}")
    return None


def device_kind(name: str) -> str:
    """``cpu`` or ``cuda``: the kind of device setting ``name`` (``auto``: what it resolves to here)."""
    import torch

    return ("cuda" if cuda_device_count() else "cpu") if name == "auto" else torch.device(name).type


def same_device_kind(a: str, b: str) -> bool:
    """Whether two device settings compute the same bits: the same kind (``cuda:0`` and ``cuda:1`` are one GPU
    model's two copies). ``auto`` counts as what it resolves to here."""
    return device_kind(a) == device_kind(b)


def worker_device(name: str, slot: int, device_count: int | None = None) -> str:
    """The device of parallel worker ``slot`` (a sweep's ``--jobs`` slot, a ``--nproc`` rank's local rank) when the
    setting is ``name``: on a machine with several GPUs, ``cuda`` (or ``auto`` resolving to it) becomes
    ``cuda:{slot mod device_count}``, so each worker gets its own GPU while there are enough; ``cpu`` and an
    explicit ``cuda:N`` are kept. ``device_count``: default ``cuda_device_count()``."""
    check_device_name(name)
    count = cuda_device_count() if device_count is None else device_count
    if name == "cpu" or name.startswith("cuda:") or (name == "auto" and not count):
        return name
    if count <= 1:
        return "cuda:0" if count == 1 else name
    return f"cuda:{slot % count}"


def rank_device(name: str, key: str = "device") -> torch.device:
    """This process's device for setting ``name``: under a launcher (``vexact run --nproc``, torchrun: LOCAL_RANK
    set) each rank on a machine with several GPUs takes its own (``worker_device``), else ``resolve_device``."""
    local = os.environ.get("LOCAL_RANK")
    return resolve_device(worker_device(name, int(local)) if local is not None else name, key)
