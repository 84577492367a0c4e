"""``vexact sweep --executor ray``: a real local Ray cluster, bound to 127.0.0.1 only, gives the local results.

The test starts Ray itself (no dashboard, no usage stats), reads every listening TCP socket of the Ray processes
from /proc to check that none is reachable from outside this host, then runs a 2-point sweep on it and compares
every point's metrics and final checkpoint with the same sweep run by the local executor. A second Ray run of the
finished sweep must skip both points, and a sweep interrupted after its first point must resume on Ray.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sweep import _metrics, _sweep_file, interrupt_sweep

from vexact.records.runlog import latest_checkpoint
from vexact.sweeps import ray_executor
from vexact.sweeps.sweep import load_sweep_spec, run_sweep

# Ray itself is imported by ray_executor (which sets its loopback mode first), never at this module's top.
pytestmark = pytest.mark.needs_package("ray", "pip install 'vexact[ray]' (.ci/run does)")
LISTEN = "0A"


def _is_loopback(address: str) -> bool:
    host = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(host, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback seen through IPv6
    return (mapped or host).is_loopback


def _listening_sockets() -> dict[int, list[str]]:
    """{inode: [local address, ...]} of every listening TCP socket in this network namespace."""
    out: dict[int, list[str]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            host_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(host_hex)
            if family == socket.AF_INET:
                host = socket.inet_ntop(family, raw[::-1])
            else:  # four little-endian 32-bit words
                host = socket.inet_ntop(family, b"".join(struct.pack(">I", w) for w in struct.unpack("<4I", raw)))
            out.setdefault(int(fields[9]), []).append(f"{host}:{int(port_hex, 16)}")
    return out


def _ray_process_sockets() -> dict[str, list[str]]:
    """{process: [listening address, ...]} for the Ray processes (names containing 'ray' or 'gcs_server') and
    this driver process, found through /proc/<pid>/fd socket inodes."""
    sockets = _listening_sockets()
    found: dict[str, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if "ray" not in cmdline and "gcs_server" not in cmdline and int(pid) != os.getpid():
            continue
        for link in links:
            if link.startswith("socket:["):
                for address in sockets.get(int(link[8:-1]), []):
                    found.setdefault(f"{pid} {cmdline[:80]}", []).append(address)
    return found


def _checkpoint(point) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(point.run_dir) / "checkpoint.safetensors"))


def test_ray_sweep_is_loopback_only_and_equals_local(tmp_path):
    """Local points at 2 threads, Ray's at the default (1 CPU, 1 thread): the same bits (the exact backward is
    thread-count invariant, so the executors need not agree on ``threads``)."""
    local_path = _sweep_file(tmp_path, "loc", grid={"seed": [0, 1], "threads": [2]})
    ray_path = _sweep_file(tmp_path, "ray", grid={"seed": [0, 1]})
    run_sweep(load_sweep_spec(local_path), jobs=1)

    assert ray_executor.start(None, num_cpus=2)
    try:
        listening = _ray_process_sockets()
        assert listening, "found no listening socket of a Ray process: the check would pass vacuously"
        exposed = {proc: [a for a in addrs if not _is_loopback(a)] for proc, addrs in listening.items()}
        assert not any(exposed.values()), f"Ray listens beyond loopback: {exposed}"
        assert not any(addr.endswith(":8265") for addrs in listening.values() for addr in addrs)  # no dashboard

        statuses = run_sweep(load_sweep_spec(ray_path), executor="ray")
        assert set(statuses.values()) == {"completed"}
        # a second run finds both points finished and submits nothing
        assert run_sweep(load_sweep_spec(ray_path), executor="ray") == statuses
    finally:
        ray_executor.stop()

    local, remote = load_sweep_spec(local_path), load_sweep_spec(ray_path)
    assert list(_metrics(local).values()) == list(_metrics(remote).values())
    for a, b in zip(local.points, remote.points):
        ca, cb = _checkpoint(a), _checkpoint(b)
        assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    index = json.loads((remote.output_dir / "sweep.json").read_text())
    assert [p["status"] for p in index["points"]] == ["completed", "completed"]


def test_ray_executor_resumes_an_interrupted_sweep(tmp_path, monkeypatch):
    """Interrupted locally in its second point, the sweep is finished on Ray: the first point is skipped, the
    second resumed from its checkpoint, and the results are bitwise those of an uninterrupted local sweep."""
    from rich.console import Console


    reference = load_sweep_spec(_sweep_file(tmp_path, "ref", grid={"seed": [0, 1]}))
    run_sweep(reference, console=Console(quiet=True))
    path = _sweep_file(tmp_path, "cut", grid={"seed": [0, 1]})
    interrupt_sweep(monkeypatch, load_sweep_spec(path), at_step_call=5)  # in the middle of the second point
    spec = load_sweep_spec(path)
    finished_mtime = (spec.points[0].run_dir / "metrics.jsonl").stat().st_mtime_ns
    try:
        statuses = run_sweep(spec, console=Console(quiet=True), executor="ray")
    finally:
        ray_executor.stop()
    assert list(statuses.values()) == ["completed", "completed"]
    assert (spec.points[0].run_dir / "metrics.jsonl").stat().st_mtime_ns == finished_mtime  # skipped
    assert _metrics(spec) == _metrics(reference)


def test_a_ray_sweep_stopped_by_ctrl_c_records_its_running_points_as_interrupted(tmp_path, monkeypatch):
    """Ctrl-C during a Ray sweep cancelled its tasks and left their points "pending" in sweep.json; the point that
    ran is now recorded as interrupted (as --jobs records it), and the one Ray had not started yet stays pending."""
    import time

    from rich.console import Console
    from test_sweep_faults import _sweep_file as fast_sweep_file

    spec = load_sweep_spec(fast_sweep_file(tmp_path, "stop", grid={"seed": [0, 1]}, steps=500))

    def stop_once_running(names):  # Ctrl-C once a point's run has begun: 1 CPU, so the other waits
        deadline = time.monotonic() + 300
        # Ray need not start the points in submission order (a CI run saw the second one run first and finish)
        while not any(point.run_dir.exists() for point in spec.points):
            assert time.monotonic() < deadline, "no point started"
            time.sleep(0.1)
        raise KeyboardInterrupt

    real_run_points = ray_executor.run_points
    monkeypatch.setattr(ray_executor, "run_points", lambda *args, **kwargs: real_run_points(
        *args, **{**kwargs, "on_running": stop_once_running}))
    assert ray_executor.start(None, num_cpus=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(spec, console=Console(quiet=True), executor="ray")
    finally:
        ray_executor.stop()
    index = json.loads((spec.output_dir / "sweep.json").read_text())
    started = [point.run_dir.exists() for point in spec.points]
    assert sorted(started) == [False, True]
    assert [p["status"] for p in index["points"]] == ["interrupted" if ran else "pending" for ran in started]


def test_loopback_check_recognises_addresses():
    assert _is_loopback("127.0.0.1:6379") and _is_loopback("::ffff:127.0.0.1:6379") and _is_loopback("::1:80")
    assert not _is_loopback("0.0.0.0:6379") and not _is_loopback(":::6379") and not _is_loopback("192.0.2.2:1")


def test_address_needs_the_ray_executor(tmp_path):
    with pytest.raises(ValueError, match="needs --executor ray"):
        run_sweep(load_sweep_spec(_sweep_file(tmp_path, "a", grid={"seed": [0]})), address="auto")
    # and --jobs is the local executor's: on Ray it was ignored
    with pytest.raises(ValueError) as refused:
        run_sweep(load_sweep_spec(_sweep_file(tmp_path, "b", grid={"seed": [0]})), jobs=2, executor="ray")
    assert str(refused.value) == ("--jobs 2 is the number of local worker processes: with --executor ray, Ray decides "
                                  "how many points run at once (each asks for its threads' CPUs)")


def test_an_address_where_nothing_answers_is_one_error_within_seconds(tmp_path):
    """A closed port or a host that does not resolve: ray.init retried it for about 13 minutes, printing warnings."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:  # a port of this host that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError) as refused:
        ray_executor.check_reachable(f"127.0.0.1:{port}")
    assert str(refused.value) == (f"--address 127.0.0.1:{port}: nothing answers there (Connection refused); start the "
                                  f"cluster's head with `ray start --head --port {port}` on 127.0.0.1, or give the "
                                  "address it printed")
    ray_executor.check_reachable("auto")  # left to Ray, as are local and ray:// addresses
    ray_executor.check_reachable("ray://127.0.0.1:1")

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vexact", "sweep", str(_sweep_file(tmp_path, "a", grid={"seed": [0]})),
                           "--no-report", "--executor", "ray", "--address", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {refused.value}"
    assert time.monotonic() - started < 60


def test_a_point_no_ray_node_can_hold_is_one_error_before_any_runs(tmp_path):
    """threads above every node's CPUs, or a GPU on a cluster without one: Ray kept the task waiting for ever."""
    import subprocess
    import sys

    node = {"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}}
    ray_executor.check_placeable("p", {"num_cpus": 2, "num_gpus": 0}, [node])
    with pytest.raises(ValueError) as refused:
        ray_executor.check_placeable("p", {"num_cpus": 2, "num_gpus": 1},
                                     [node, {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 1.0}}])
    assert str(refused.value) == ("point p asks Ray for 2 CPUs and 1 GPU (its threads and device), but no node of the "
                                  "Ray cluster has them (the most one has: 2 CPUs, 0 GPUs); lower its threads, or add "
                                  "a node that has them")

    path = _sweep_file(tmp_path, "big", grid={"seed": [0], "threads": [4096]})
    done = subprocess.run([sys.executable, "-m", "vexact", "sweep", str(path), "--no-report", "--executor", "ray"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: point seed=0,threads=4096 asks Ray for 4096 CPUs (its threads and device), but no node of the Ray "
        "cluster has them (the most one has: "), done.stderr
    assert not (tmp_path / "big" / "points").exists()  # nothing ran


def test_sigterm_stops_a_ray_sweep_as_ctrl_c_does(tmp_path):
    """``ray.init`` installed its own SIGTERM handler over vexact's: a job scheduler's stop aborted the sweep (exit
    134, Ray's fatal-signal dump) and left its running points "pending". Now it exits 143 and records them
    interrupted, as Ctrl-C records them (130)."""
    import signal
    import subprocess
    import sys
    import time

    from test_sweep_faults import _sweep_file as fast_sweep_file

    spec = load_sweep_spec(fast_sweep_file(tmp_path, "term", grid={"seed": [0, 1]}, steps=500))
    sweep = subprocess.Popen([sys.executable, "-m", "vexact", "sweep", str(tmp_path / "term.yaml"), "--no-report",
                              "--executor", "ray"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any((p.run_dir / "metrics.jsonl").is_file() and (p.run_dir / "metrics.jsonl").stat().st_size
                      for p in spec.points):
            assert sweep.poll() is None and time.monotonic() < deadline, "no point wrote a metrics line"
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 143, err
    statuses = [p["status"] for p in json.loads((spec.output_dir / "sweep.json").read_text())["points"]]
    assert "interrupted" in statuses and set(statuses) <= {"interrupted", "pending"}, statuses
    started = [p.run_dir.exists() for p in spec.points]
    assert [status == "interrupted" for status in statuses] == started, (statuses, started)
