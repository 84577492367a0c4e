"""Child processes that never outlive the vexact process that started them (sweep workers, ``--nproc`` ranks)."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, however that dies (``kill -9`` included).

    Call it first thing in the child. ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned this process exits,
    so the parent must spawn from a thread that lives as long as it does (each caller says why its does). The parent
    may have died before this call: then this process was re-parented (its ppid is no longer ``parent_pid``), and
    it exits at once. No prctl off Linux: there only that check remains."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl in this libc: the check below still helps
            pass
    if os.getppid() != parent_pid:
        os._exit(1)
