"""Sweep points as Ray tasks: ``vexact sweep SWEEP --executor ray [--address ADDR]``.

One Ray task per unfinished point, each asking Ray for ``threads`` CPUs (the point's ``threads`` config key, 1 when
unset) and running the same point runner as the local executor (the sweep hands it in: this module imports nothing
of the sweep), so a point's results are the same bits wherever it runs. Ray only schedules; what to run, what to
skip and what to resume is decided here, exactly as for local workers: finished points are skipped, a point whose
run directory exists resumes from its last checkpoint, and ``sweep.json`` is rewritten as each point finishes.

Without ``--address`` a private single-node Ray instance is started on this machine, bound to 127.0.0.1, with no
dashboard and no usage statistics, and shut down at the end. With ``--address`` (``auto``, or ``HOST:PORT`` of
an existing cluster's head) the tasks go to that cluster; every node must see the sweep's output directory and
the warm-start cache at the same path (a shared filesystem), since each task works in the driver's working
directory.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..cli_base import stopped_by
from ..engine.devices import device_kind

LOCAL_HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 10.0
"""How long ``--address HOST:PORT`` may take to accept a connection before the sweep gives up on it."""


# Ray picks its node address in two ways. On a cluster it asks the OS for the host's routable address and binds
# its servers to all interfaces; on a single machine (Ray's Windows/macOS mode, chosen by this variable being 0)
# it uses the loopback address and binds its servers to it. A private instance wants the second, and the
# variable must be set before Ray is imported, since Ray reads it once at import.
_SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DASHBOARD_ENABLED": "0"}


def _ray(private: bool) -> Any:
    """Import Ray; for a private instance, in its single-machine (loopback) mode.

    Ray reads the mode once, at import, and offers no public way to ask which mode it is in, so it is checked on
    what decides it: the variable must say single-machine (``"0"``, which this sets unless the user did), and if Ray
    was imported before this call, the variable must already have said so then (as when an earlier call here
    imported it). Otherwise one ValueError: the instance would listen beyond loopback."""
    imported_before = "ray" in sys.modules
    said_before = {key: os.environ.get(key) for key in _SINGLE_MACHINE}
    for key, value in {**_QUIET, **(_SINGLE_MACHINE if private else {})}.items():
        os.environ.setdefault(key, value)
    if private:
        cluster = [key for key, value in _SINGLE_MACHINE.items()
                   if os.environ[key] != value or (imported_before and said_before[key] != value)]
        if cluster:
            raise ValueError(
                "a private Ray instance must listen on 127.0.0.1 only, but Ray is or was imported in cluster mode: "
                f"set {cluster[0]}=0 before Ray is imported, or pass --address of a cluster")
    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'vexact[ray]'") from None
    return ray


def start(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to Ray at ``address``, or start a private instance that listens on 127.0.0.1 only.

    Returns True if this call started Ray (the caller shuts it down). Raises ValueError if a private instance
    would not be loopback-only (Ray imported earlier in cluster mode, or the variable overridden)."""
    ray = _ray(private=not address)
    if ray.is_initialized():
        return False
    if address:
        check_reachable(address)
        _init_keeping_sigterm(ray, address=address, log_to_driver=False, configure_logging=False)
        return False
    _init_keeping_sigterm(ray, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                          configure_logging=False)
    if ray.util.get_node_ip_address() != LOCAL_HOST:
        ray.shutdown()
        raise ValueError(f"the private Ray instance took node address {ray.util.get_node_ip_address()}, "
                         f"not {LOCAL_HOST}: refusing to run it")
    return True


def _init_keeping_sigterm(ray: Any, **kwargs: Any) -> None:
    """``ray.init(**kwargs)``, leaving this process's SIGTERM handler as it was: ``ray.init`` installs its own,
    which aborted the sweep (exit 134, its points left "pending") where vexact's (``stop_on_sigterm``) stops it as
    Ctrl-C does (exit 143, its running points "interrupted")."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**kwargs)
    finally:
        # None: a handler set from outside Python, which cannot be put back; unchanged: nothing to do (and off the
        # main thread, where Ray installs none, signal.signal would raise)
        if handler is not None and signal.getsignal(signal.SIGTERM) is not handler:
            signal.signal(signal.SIGTERM, handler)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ValueError unless something accepts a connection at ``address`` (``HOST:PORT``) within ``timeout``.

    ``ray.init`` retries an address where no Ray answers (a closed port, a host that does not resolve) 20 times at
    about 40 s each, printing a warning each time: the sweep seemed to hang for minutes. ``auto``, ``local`` and
    ``ray://`` client addresses are left to Ray, which fails on them within seconds."""
    host, colon, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not colon or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ValueError(f"--address {address}: nothing answers there ({reason}); start the cluster's head with "
                         f"`ray start --head --port {port}` on {host}, or give the address it printed") from None


PointRunner = Callable[[dict, bool, "int | None"], dict]
"""``run_point(config, resume, threads) -> summary``: the sweep's runner of one point, the local workers' too."""


def _run_in(cwd: str, path: list[str], run_point: PointRunner, config: dict, resume: bool,
            threads: int | None) -> dict:
    """A task's body: the driver's working directory (relative run and cache paths) and its import path (so the
    point's ``plugins`` import here as they did there, as a local worker process inherits both), then the local
    runner (a module-level function: Ray pickles it by reference, and the task imports its module)."""
    os.chdir(cwd)
    sys.path.extend(entry for entry in path if entry not in sys.path)
    return run_point(config, resume, threads)


def task_resources(threads: int | None, device: str) -> dict[str, int]:
    """What one point's Ray task asks for: ``num_cpus`` its torch threads (default 1) and, when its device is CUDA,
    ``num_gpus`` 1 (Ray then gives the task a GPU of its own and shows it that one alone)."""
    return {"num_cpus": threads or 1, "num_gpus": int(device_kind(device) == "cuda")}


def check_placeable(name: str, resources: dict[str, int], nodes: list[dict]) -> None:
    """Raise ValueError unless one of ``nodes`` (``ray.nodes()``) is alive and has ``resources`` (``task_resources``):
    Ray keeps a task no node can hold waiting for one, so the sweep waited for ever, silently (the driver does not
    show Ray's log). ``run_points`` refuses such a point on the Ray it starts itself, and on a cluster (``--address``),
    whose autoscaler may add the node, says so once and lets Ray wait."""
    held = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    needs = {"CPU": resources["num_cpus"], "GPU": resources["num_gpus"]}
    if any(all(node.get(key, 0) >= need for key, need in needs.items()) for node in held):
        return
    most = {key: max((int(node.get(key, 0)) for node in held), default=0) for key in needs}
    gpu = " and 1 GPU" if needs["GPU"] else ""
    raise ValueError(f"point {name} asks Ray for {needs['CPU']} CPUs{gpu} (its threads and device), but no node of "
                     f"the Ray cluster has them (the most one has: {most['CPU']} CPUs, {most['GPU']} GPUs); lower its "
                     "threads, or add a node that has them")


def task_config(config: dict) -> dict:
    """A point's config as its Ray task runs it: a CUDA device becomes ``cuda``, the one GPU Ray lets it see
    (``cuda:3`` would name a GPU hidden from it)."""
    return {**config, "device": "cuda"} if device_kind(config["device"]) == "cuda" else config


def run_points(todo: list, finish: Callable[[Any, dict], None], check_lock: Callable[[Any], dict | None],
               address: str | None, run_point: PointRunner,
               on_running: Callable[[list], None] = lambda names: None) -> None:
    """Submit every point in ``todo`` as a Ray task running ``run_point`` and ``finish(point, result)`` each as it
    completes. Stopped (Ctrl-C, or SIGTERM as ``stop_on_sigterm`` handles it), it cancels the tasks, records their
    points (``_record_cancelled``) and raises the stop again: ``Terminated`` for a SIGTERM."""
    ray = _ray(private=not address)
    started = start(address)
    refs: dict[Any, Any] = {}
    try:
        with _noting_sigterm() as sigterms:
            try:
                nodes = ray.nodes()
                for point in todo:  # before any is submitted: one error, not a sweep stopped half-way
                    try:
                        check_placeable(point.name, task_resources(point.config.threads, point.config.device), nodes)
                    except ValueError as err:
                        if started:  # the sweep's own Ray on this machine: no node will join it
                            raise
                        # a cluster's autoscaler may add the node the point asks for: said once, then Ray waits
                        print(f"warning: {err}; it waits for such a node (an autoscaling cluster starts one)",
                              file=sys.stderr)
                for point in todo:
                    locked = check_lock(point)
                    if locked:
                        finish(point, locked)
                        continue
                    resources = task_resources(point.config.threads, point.config.device)
                    task = ray.remote(**resources, max_retries=0)(_run_in)
                    refs[task.remote(os.getcwd(), list(sys.path), run_point, task_config(point.config.to_dict()),
                                     point.run_dir.exists(), resources["num_cpus"])] = point
                while refs:
                    on_running([p.name for p in refs.values()])
                    done, _ = ray.wait(list(refs), num_returns=1)
                    point = refs.pop(done[0])
                    try:
                        result = ray.get(done[0])
                    except ray.exceptions.RayError as err:  # the task's process died: recorded, a re-run resumes it
                        result = {"status": "failed", "error": f"Ray task failed: {type(err).__name__}: {err}"}
                    finish(point, result)
            except KeyboardInterrupt as stop:
                for ref in list(refs):
                    ray.cancel(ref, force=True)
                _record_cancelled(ray, refs, finish)
                if sigterms:  # Ray's wait turns the handler's Terminated into a plain KeyboardInterrupt (Ctrl-C's)
                    raise stopped_by(signal.SIGTERM) from None
                raise stop
    finally:
        if started:
            ray.shutdown()


@contextmanager
def _noting_sigterm() -> Iterator[list[int]]:
    """A list that gets an entry when SIGTERM arrives, its handler (``stop_on_sigterm``'s) still run: ``ray.wait``
    and ``ray.get`` catch the KeyboardInterrupt a handler raises and raise a new, plain one, so the stop no longer
    says it was SIGTERM (the sweep exited 130, not 143). Nothing is noted where SIGTERM keeps Python's default
    handling or off the main thread (where no handler can be set)."""
    received: list[int] = []
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield received
        return

    def noting(signum: int, frame: Any) -> None:
        received.append(signum)
        handler(signum, frame)

    signal.signal(signal.SIGTERM, noting)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, handler)

CANCEL_WAIT_S = 10.0
"""How long a stopped sweep waits for Ray to settle the tasks it cancelled (a cancelled task is settled at once)."""


def _record_cancelled(ray: Any, refs: dict[Any, Any], finish: Callable[[Any, dict], None]) -> None:
    """The points whose tasks a stopped sweep cancelled, recorded as the local executor's ``_record_stopped`` does:
    a point that finished meanwhile with its result, one that ran as interrupted (a re-run resumes it), one whose
    task never started (no run directory) left pending. They stayed "pending" in sweep.json."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=CANCEL_WAIT_S) if refs else ([], [])
    for ref, point in refs.items():
        result = None
        if ref in ready:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError:  # cancelled: its process was killed
                pass
        if result is None and point.run_dir.exists():
            result = {"status": "interrupted", "error": None}
        if result is not None:
            finish(point, result)


def stop() -> None:
    """Shut down this process's Ray connection (and a private instance it started); a no-op without Ray."""
    import sys

    if "ray" in sys.modules:
        sys.modules["ray"].shutdown()
