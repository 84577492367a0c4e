"""logging.backends: TensorBoard and W&B copies of metrics.jsonl, read back and compared key by key and step by step.

The extras are optional: a test that needs one is skipped without it (``.ci/run`` installs both). W&B runs in
offline mode only: no network, no account.
"""

from __future__ import annotations

import json
import math
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import interrupt_trainer_at, num_threads, require_optional, warm_start_cache
from rich.console import Console

from vexact.metric_keys import with_deprecated_names
from vexact.records import metrics_log
from vexact.records.runlog import MetricsWriter, read_metrics
from vexact.registry import PluginCodeError
from vexact.rl import log_backends
from vexact.rl.config import ConfigError, config_from_dict, load_config
from vexact.rl.trainer import Trainer

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
HAVE_WANDB = log_backends.missing_package("wandb") is None
TENSORBOARD_PIP = "pip install 'vexact[tensorboard]'"


def _cfg(root: Path, name: str, backends: list[str], *overrides: str):
    # threads=1: tiny models gain nothing from two, and a busy 2-core machine makes OpenMP's barriers crawl
    base = ["threads=1", f"output_dir={root / name}", f"warm_start.cache_dir={warm_start_cache(root)}",
            "warm_start.steps=30", "steps=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "task.eval_prompts=16", "logging.eval_every=3", "logging.checkpoint_every=2", "logging.live=false",
            f"logging.backends=[{', '.join(backends)}]"]
    return load_config(EXPERIMENT, base + list(overrides))


def _run(cfg, resume: bool = False) -> dict:
    return Trainer(cfg, Console(quiet=True)).run(resume=resume)


def _offline_wandb(mp: pytest.MonkeyPatch, home: Path) -> None:
    """W&B offline and hermetic: nothing leaves the machine or lands in ~/.config or ~/.cache."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(var, str(home))


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    _offline_wandb(monkeypatch, tmp_path / "wandb-home")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny run twice: metrics.jsonl only, and with every backend installed here."""
    require_optional("tensorboard", TENSORBOARD_PIP)
    root = tmp_path_factory.mktemp("runs")
    backends = ["jsonl", "tensorboard"] + (["wandb"] if HAVE_WANDB else [])
    with pytest.MonkeyPatch.context() as mp, num_threads(torch.get_num_threads()):  # restored afterwards
        _offline_wandb(mp, root / "wandb-home")
        assert _run(_cfg(root, "plain", ["jsonl"]))["status"] == "completed"
        assert _run(_cfg(root, "all", backends))["status"] == "completed"
    return root


# --- reading the backends back ----------------------------------------------------------------------------------


def _jsonl_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as the live views get it, {key: {step: value}}: numbers only, "nan"/"inf" strings back to
    floats, and a renamed key's value under its old name too (the deprecation period's copy, ``RENAMED_METRICS``)."""
    out: dict[str, dict[int, float]] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in metrics_log.scalars(with_deprecated_names(row)).items():
            out.setdefault(key, {})[row["step"]] = value
    return out


def _tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """What TensorBoard shows: its own EventAccumulator, every event kept (size guidance 0 = no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"{tag}: a step shown twice"
        out[tag] = {e.step: e.value for e in events}
    return out


def _raw_tensorboard_events(log_dir: Path) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in the event files as written, no purging: duplicates would show here."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            found += [(v.tag, event.step) for v in event.summary.value]
    return found


def _same_float32(a: float, b: float) -> bool:
    # TensorBoard stores a scalar as float32 (Summary.Value.simple_value), so the JSONL's float64 is compared after
    # the same cast -- exactly, not within a tolerance; NaN matches NaN (a diverged value is a recorded outcome).
    with np.errstate(over="ignore"):  # beyond float32's range is inf, in TensorBoard too
        a32, b32 = np.float32(a), np.float32(b)
    return bool(a32 == b32 or (np.isnan(a32) and np.isnan(b32)))


def _assert_tensorboard_matches_jsonl(run_dir: Path) -> None:
    expected = _jsonl_scalars(run_dir)
    shown = _tensorboard_scalars(run_dir / log_backends.TENSORBOARD_DIR)
    assert set(shown) == set(expected)
    for key, by_step in expected.items():
        assert set(shown[key]) == set(by_step), key
        for step, value in by_step.items():
            assert _same_float32(shown[key][step], value), (key, step, shown[key][step], value)
    raw = _raw_tensorboard_events(run_dir / log_backends.TENSORBOARD_DIR)
    assert len(raw) == len(set(raw)) == sum(len(v) for v in expected.values())


def _wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """The history of the newest offline run. ``run.finish()`` returns before W&B's service process has written
    the whole .wandb file, so it is read until it ends with the run's exit record (at most 30 s)."""
    newest = (run_dir / "wandb" / "latest-run").resolve()  # names sort by the second: two sessions may share one
    path = next(newest.glob("run-*.wandb"))
    deadline = time.monotonic() + 30
    while True:
        kinds, history = _read_wandb_log(path.read_bytes())
        if "exit" in kinds or time.monotonic() > deadline:
            assert "exit" in kinds, f"{path}: no exit record after 30 s"
            return history
        time.sleep(0.05)


def _read_wandb_log(data: bytes) -> tuple[set[str], dict[str, dict[int, float]]]:
    """Record kinds and history of a .wandb file: W&B's LevelDB-style log, a 7-byte header, then 32 KiB blocks of
    chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last; then the payload)."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, chunks, kinds, out = 7, 32768, b"", set(), {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a chunk still being written
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            kinds.add(record.WhichOneof("record_type"))
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                        out.setdefault(key, {})[step] = float(json.loads(item.value_json))
    return kinds, out


def _assert_wandb_matches_jsonl(run_dir: Path) -> None:
    expected = _jsonl_scalars(run_dir)
    logged = _wandb_history(run_dir)
    assert set(logged) == set(expected)
    for key, by_step in expected.items():
        assert logged[key].keys() == by_step.keys(), key
        for step, value in by_step.items():  # W&B keeps float64: exact
            assert logged[key][step] == value or (math.isnan(value) and math.isnan(logged[key][step])), (key, step)


# --- runs ------------------------------------------------------------------------------------------------------


def _masked(path: Path) -> str:
    """metrics.jsonl's bytes with the timing values blanked (wall-clock, different on every run)."""
    return re.sub(r'("timing/[^"]+": )[-+0-9.eE]+', r"\1T", path.read_text())


def test_backends_do_not_change_metrics_jsonl(runs):
    plain, full = _masked(runs / "plain" / "metrics.jsonl"), _masked(runs / "all" / "metrics.jsonl")
    assert plain.count("\n") == 4 and '"timing/step": T' in plain
    assert full == plain
    assert not (runs / "plain" / log_backends.TENSORBOARD_DIR).exists()
    assert not (runs / "plain" / log_backends.WANDB_DIR).exists()


def test_tensorboard_holds_every_jsonl_scalar(runs):
    _assert_tensorboard_matches_jsonl(runs / "all")
    shown = _tensorboard_scalars(runs / "all" / log_backends.TENSORBOARD_DIR)
    assert {"rollout_corr/k3_kl", "actor/ppo_kl", "timing/step", "eval/reward_mean"} <= set(shown)
    assert "step" not in shown


@pytest.mark.needs_package("wandb", "pip install 'vexact[wandb]'")
def test_wandb_offline_run_holds_every_jsonl_scalar(runs):
    offline = list((runs / "all" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    _assert_wandb_matches_jsonl(runs / "all")


def test_resume_rebuilds_the_views_without_duplicates(runs, monkeypatch):
    """Interrupted after step 2 (checkpoint after step 1), resumed: the views hold steps 0..3 once each."""
    backends = ["jsonl", "tensorboard"] + (["wandb"] if HAVE_WANDB else [])
    cfg = _cfg(runs, "cut", backends)
    real_step = interrupt_trainer_at(monkeypatch, 3)
    assert _run(cfg)["status"] == "interrupted"
    run_dir = runs / "cut"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    _assert_tensorboard_matches_jsonl(run_dir)
    monkeypatch.setattr(Trainer, "step", real_step)
    assert _run(cfg, resume=True)["status"] == "completed"  # steps 2, 3 recomputed
    assert _masked(run_dir / "metrics.jsonl") == _masked(runs / "plain" / "metrics.jsonl")
    assert len(list((run_dir / log_backends.TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1
    _assert_tensorboard_matches_jsonl(run_dir)
    if HAVE_WANDB:  # one W&B run per session; the newest holds every step
        assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
        _assert_wandb_matches_jsonl(run_dir)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_resume_whose_new_view_fails_to_open_keeps_the_runs_config(checkpoint, runs, monkeypatch):
    """A resume allowed to change logging.backends, whose new backend refuses to open (W&B refusing a project):
    the run's config.yaml, config_changes.jsonl and metrics.jsonl stay as they were, so a plain --resume afterwards
    still resumes the run as it was started (the changes were kept, and the log cut, before the logs opened) -- from
    its checkpoint, or from scratch where it has none (killed before its first)."""
    import shutil

    from vexact.records.runlog import checkpoint_dirs

    class Refuses(log_backends.LogBackendKind):
        name = "refuses"

        def open(self, run_dir, cfg):
            raise ConfigError("no", "logging.backends")

    name = f"refused-{checkpoint}"
    run_dir = runs / name
    real_step = interrupt_trainer_at(monkeypatch, 3)
    assert _run(_cfg(runs, name, ["jsonl"]))["status"] == "interrupted"
    monkeypatch.setattr(Trainer, "step", real_step)
    if not checkpoint:
        for kept in checkpoint_dirs(run_dir):
            shutil.rmtree(kept)
    saved, logged = (run_dir / "config.yaml").read_text(), (run_dir / "metrics.jsonl").read_text()
    log_backends.register_log_backend(Refuses())
    try:
        changed = _cfg(runs, name, ["jsonl", "refuses"])
        with pytest.raises(ConfigError, match="^config error at 'logging.backends': no$"):
            Trainer(changed, Console(quiet=True)).run(resume=True, allow_changes=("logging.backends",))
    finally:
        log_backends.LOG_BACKENDS.remove("refuses")
    assert (run_dir / "config.yaml").read_text() == saved
    assert (run_dir / "metrics.jsonl").read_text() == logged
    assert not (run_dir / "config_changes.jsonl").exists()
    assert _run(_cfg(runs, name, ["jsonl"]), resume=True)["status"] == "completed"


# --- the writer on hand-made rows ------------------------------------------------------------------------------


def test_non_finite_and_non_numeric_values(tmp_path):
    """NaN/Inf are kept (a diverged run is an outcome); strings, lists and None are not scalars and are skipped."""
    require_optional("tensorboard", TENSORBOARD_PIP)
    cfg = config_from_dict({"logging": {"backends": ["jsonl", "tensorboard"]}})
    writer = MetricsWriter(tmp_path / "metrics.jsonl", live_views=log_backends.live_views(tmp_path, cfg))
    writer.write({"step": 0, "a/loss": math.nan, "a/up": math.inf, "a/down": -math.inf, "a/n": 3, "a/flag": True,
                  "a/name": "x", "a/list": [1, 2], "a/none": None})
    writer.write({"step": 1, "a/loss": 0.1, "a/up": 1e40, "a/down": -2.5, "a/n": 4, "a/flag": False})
    writer.close()
    _assert_tensorboard_matches_jsonl(tmp_path)
    shown = _tensorboard_scalars(tmp_path / log_backends.TENSORBOARD_DIR)
    assert set(shown) == {"a/loss", "a/up", "a/down", "a/n", "a/flag"}
    assert math.isnan(shown["a/loss"][0]) and shown["a/up"][0] == math.inf and shown["a/down"][0] == -math.inf
    assert shown["a/up"][1] == math.inf  # 1e40 overflows float32: TensorBoard's own limit, not a crash
    assert metrics_log.scalars({"step": 7, "x": "nan", "y": "-inf", "z": "inf", "w": "fast"}).keys() == {"x", "y", "z"}


def test_jsonl_alone_opens_no_live_view(tmp_path, monkeypatch):
    """With only ``jsonl`` there is nothing to open: ``live_views`` is None, and the writer does not read
    metrics.jsonl back (a damaged old line is no concern of a writer that replays nothing)."""
    cfg = config_from_dict({})
    assert log_backends.live_views(tmp_path, cfg) is None
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    MetricsWriter(tmp_path / "metrics.jsonl", live_views=log_backends.live_views(tmp_path, cfg)).close()
    with pytest.raises(metrics_log.MetricsDamaged):  # a view to rebuild reads the log back first
        MetricsWriter(tmp_path / "metrics.jsonl", live_views=lambda rows: [])


def _event_files(log_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in log_dir.glob("events.out.tfevents.*")}


@pytest.mark.needs_package("wandb", "pip install 'vexact[wandb]'")
@pytest.mark.parametrize("logging,key,expected", [
    ({"wandb_project": "a/b"}, "logging.wandb_project", "W&B refuses the project name: Invalid project name 'a/b'"),
    ({"wandb_mode": "online"}, "logging.wandb_mode",
     "W&B could not start an online run: No API key configured"),
])
def test_wandb_refusal_is_a_config_error_and_keeps_the_old_views(logging, key, expected, tmp_path, monkeypatch):
    """W&B refusing its settings (a project name it does not allow; online without an API key -- refused before
    any network) is one ConfigError naming the key, not W&B's traceback; and the TensorBoard view opened before it
    (a resume's) keeps its old event files: they go only once every backend has opened."""
    require_optional("tensorboard", TENSORBOARD_PIP)
    monkeypatch.delenv("WANDB_MODE")  # the config's mode, not the hermetic fixture's
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc key
    history = [{"step": 0, "a/loss": 0.5}]
    tensorboard_only = config_from_dict({"logging": {"backends": ["jsonl", "tensorboard"]}})
    for backend in log_backends.open_backends(tmp_path, tensorboard_only, history):
        backend.close()
    log_dir = tmp_path / log_backends.TENSORBOARD_DIR
    before = _event_files(log_dir)
    assert len(before) == 1
    cfg = config_from_dict({"logging": {"backends": ["jsonl", "tensorboard", "wandb"], **logging}})
    with pytest.raises(ConfigError) as info:
        log_backends.open_backends(tmp_path, cfg, history)
    assert str(info.value).startswith(f"config error at '{key}': {expected}")
    assert "\n" not in str(info.value)
    assert _event_files(log_dir) == before
    assert _tensorboard_scalars(log_dir) == {"a/loss": {0: 0.5}}


def test_a_failed_open_leaves_no_tensorboard_view_behind(tmp_path):
    """A fresh run whose later backend fails to open: the TensorBoard writer opened first removes its file and the
    folder it made (the run directory holds nothing a retry of the same command would trip on)."""
    require_optional("tensorboard", TENSORBOARD_PIP)

    class Refuses(log_backends.LogBackendKind):
        name = "refuses"

        def open(self, run_dir, cfg):
            raise ConfigError("no", "logging.backends")

    log_backends.register_log_backend(Refuses())
    try:
        cfg = config_from_dict({"logging": {"backends": ["jsonl", "tensorboard", "refuses"]}})
        with pytest.raises(ConfigError, match="^config error at 'logging.backends': no$"):
            log_backends.open_backends(tmp_path, cfg, [])
    finally:
        log_backends.LOG_BACKENDS.remove("refuses")
    assert not (tmp_path / log_backends.TENSORBOARD_DIR).exists()


# --- config ----------------------------------------------------------------------------------------------------


def test_default_is_jsonl_only():
    cfg = config_from_dict({})
    assert cfg.logging.backends == ["jsonl"] and cfg.logging.wandb_mode == "offline"
    assert cfg.logging.wandb_project == "vexact"


@pytest.mark.parametrize("logging,key,expected", [
    ({"backends": ["jsonl", "tb"]}, "logging.backends[1]",
     "expected a registered log backend (one of 'jsonl', 'tensorboard', 'wandb'; vexact.register_log_backend adds "
     "one), got 'tb'"),
    ({"backends": "tensorboard"}, "logging.backends", "expected a list of"),
    ({"backends": []}, "logging.backends", "must include 'jsonl'"),
    ({"backends": ["tensorboard"]}, "logging.backends", "must include 'jsonl' (metrics.jsonl is what resume and"),
    ({"backends": ["jsonl", "jsonl"]}, "logging.backends[1]", "'jsonl' is listed twice"),
    ({"wandb_mode": "cloud"}, "logging.wandb_mode", "expected one of 'offline', 'online', got 'cloud'"),
])
def test_config_errors(logging, key, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"logging": logging})
    assert str(info.value).startswith(f"config error at '{key}': ")
    assert expected in str(info.value)


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_missing_package_names_the_extra(backend, tmp_path, monkeypatch):
    """Refused when the run opens its log, before the first step and before metrics.jsonl exists (so the same
    command works once the extra is installed); the config itself loads anywhere."""
    monkeypatch.setattr(type(log_backends.LOG_BACKENDS[backend]), "package", "vexact_no_such_package")
    cfg = _cfg(tmp_path, "missing", ["jsonl", backend], "warm_start.steps=0")
    with pytest.raises(ConfigError) as info:
        _run(cfg)
    assert str(info.value) == (f"config error at 'logging.backends': backend '{backend}' needs the "
                               f"'vexact_no_such_package' package, which is not installed: "
                               f"pip install 'vexact[{backend}]'")
    assert not (tmp_path / "missing" / "metrics.jsonl").exists()
    assert not (tmp_path / "missing" / log_backends.TENSORBOARD_DIR).exists()


class _Writer:
    """A plugin backend's writer: records its writes and close; ``fails`` names the call that raises."""

    def __init__(self, fails: str | None = None):
        self.fails, self.steps, self.closed = fails, [], False

    def write(self, step, values):
        if self.fails == "write":
            raise RuntimeError("boom in write")
        self.steps.append(step)

    def close(self):
        self.closed = True
        if self.fails == "close":
            raise RuntimeError("boom in close")


@pytest.fixture
def plugin_backends():
    """Registers ``log_x`` (opened by the test's ``opens``) and ``log_ok`` (a writer that works); yields their
    writers as they open."""
    opened: dict[str, object] = {}

    def kind(name, opens):
        class Kind(log_backends.LogBackendKind):
            def open(self, run_dir, cfg):
                opened[name] = opens()
                return opened[name]
        Kind.name = name
        log_backends.register_log_backend(Kind())

    def register(opens):
        kind("log_x", opens)
        kind("log_ok", _Writer)
        return opened

    yield register
    for name in ("log_x", "log_ok"):
        if name in log_backends.LOG_BACKENDS:
            log_backends.LOG_BACKENDS.remove(name)


def _raise():
    raise RuntimeError("boom in open")


@pytest.mark.parametrize("opens, says", [
    (_raise, "log backend 'log_x' (open) raised RuntimeError: boom in open"),
    (object, "log backend 'log_x' (open) returned an object: expected a writer with write(step, values) and close(), "
             "or None"),
    (lambda: _Writer("write"), "log backend 'log_x' (write) raised RuntimeError: boom in write"),
])
def test_a_backends_failure_is_one_error_naming_it_and_closes_the_other_views(opens, says, plugin_backends,
                                                                               tmp_path):
    opened = plugin_backends(opens)
    cfg = _cfg(tmp_path, "run", ["jsonl", "log_ok", "log_x"], "warm_start.steps=0", "steps=1")
    with pytest.raises(PluginCodeError) as e:
        _run(cfg)
    assert str(e.value) == says
    assert opened["log_ok"].closed


def test_a_backend_failing_to_close_leaves_the_runs_end_written_then_names_it(plugin_backends, tmp_path):
    """A live view is a copy: its close failing does not cost a completed run its summary.json, nor leave the views
    after it open; its error comes after the run's end, naming the backend."""
    opened = plugin_backends(lambda: _Writer("close"))
    cfg = _cfg(tmp_path, "run", ["jsonl", "log_x", "log_ok"], "warm_start.steps=0", "steps=2")
    with pytest.raises(PluginCodeError) as e:
        _run(cfg)
    assert str(e.value) == "log backend 'log_x' (close) raised RuntimeError: boom in close"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert opened["log_ok"].closed and opened["log_ok"].steps == [0, 1] == opened["log_x"].steps


@pytest.mark.parametrize("install, line", [("", "pip install no_such_pkg_zz"),
                                           ("pip install 'zz-tools[log]'", "pip install 'zz-tools[log]'")])
def test_a_plugin_backends_missing_package_names_its_own_install_line(install, line):
    """Not ``pip install 'vexact[NAME]'``, an extra vexact does not have: the backend's ``install``, else
    ``pip install PACKAGE``."""

    class Missing(log_backends.LogBackendKind):
        name = "log_missing"
        package = "no_such_pkg_zz"

        def open(self, run_dir, cfg):
            return None

    Missing.install = install
    log_backends.register_log_backend(Missing())
    try:
        problem = log_backends.missing_package("log_missing")
    finally:
        log_backends.LOG_BACKENDS.remove("log_missing")
    assert problem == f"backend 'log_missing' needs the 'no_such_pkg_zz' package, which is not installed: {line}"
