"""Files that processes running side by side share: the warm-start cache (trained once per key, whoever asks), the
one atomic-write helper, the one metrics.jsonl reader, damaged points in a report, and the library switches
(safetensors' safe_open, huggingface_hub's cache lookup, public Ray API only, one Markdown table writer).

The warm-start race runs real ``vexact run`` processes with the write window forced wide: each safetensors save of
the warm start sleeps 1 s after writing (a slow disk), as in the report that found the race. Models are tiny and
warm starts a few steps: the machine is shared.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from conftest import require_optional
from rich.console import Console
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors
from test_trainer import EXPERIMENT, _short, _without_timing

from vexact.cli import main
from vexact.real.hf_checkpoint import read_checkpoint_config
from vexact.records import atomic, metrics_log
from vexact.records.metrics_log import NON_FINITE, MetricsDamaged, decode_non_finite, read_metrics
from vexact.records.runlog import MetricsWriter, latest_checkpoint, save_checkpoint
from vexact.reports import sweep_table
from vexact.reports.sweep_report import write_report
from vexact.reports.sweep_table import group_markdown, group_table
from vexact.rl import collapse
from vexact.rl.config import ConfigError, config_from_dict, load_config, save_config
from vexact.rl.trainer import Trainer
from vexact.sweeps import ray_executor
from vexact.sweeps.markdown_table import markdown_table
from vexact.sweeps.sweep import load_sweep_spec, run_sweep
from vexact.sweeps.sweep_data import read_point, read_sweep_results

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = ["steps=2", "warm_start.steps=6", "warm_start.batch_size=8", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "task.eval_prompts=4", "logging.eval_every=1",
            "logging.checkpoint_every=1", "logging.live=false", "threads=1"]

SLOW_SAVE_CHILD = """
import sys, time
from vexact.rl import warmstart
real_save = warmstart.save_file
def slow_save(*args, **kwargs):  # a slow disk: the file sits written but unpublished for a second
    real_save(*args, **kwargs)
    time.sleep(1.0)
warmstart.save_file = slow_save
from vexact.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run_args(out: Path, cache: Path) -> list[str]:
    sets = [*TINY_RUN, f"output_dir={out}", f"warm_start.cache_dir={cache}"]
    return ["run", str(EXPERIMENT), *[arg for s in sets for arg in ("--set", s)]]


def _checkpoint(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run_dir) / "checkpoint.safetensors"))


def _same_bits(a: Path, b: Path) -> None:
    assert _without_timing(read_metrics(a / "metrics.jsonl")) == _without_timing(read_metrics(b / "metrics.jsonl"))
    ca, cb = _checkpoint(a), _checkpoint(b)
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)


# --------------------------------------------------------------------------- 1. one warm start per key
@pytest.mark.slow
def test_racing_runs_train_the_warm_start_once_and_match_a_serial_run(tmp_path):
    """Three ``vexact run``s of one warm-start key start together with a slow writer: all succeed, exactly one
    trains (its log says so), the others say they wait and then load, and every run is bitwise the serial one."""
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_SAVE_CHILD, *_run_args(tmp_path / f"r{i}", cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env())
             for i in range(3)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n----\n".join(logs)
    trained = [log for log in logs if "warm start: trained here and cached" in log]
    loaded = [log for log in logs if "warm start: loaded" in log]
    assert len(trained) == 1 and len(loaded) == 2, "\n----\n".join(logs)
    assert any("warm start: waiting for" in log for log in loaded)  # they started together: someone waited
    assert [p.name for p in cache.iterdir() if p.suffix == ".safetensors"] and not list(cache.glob("*.tmp"))

    serial_cache = tmp_path / "serial-cache"
    assert main(_run_args(tmp_path / "serial", serial_cache)) == 0
    for i in range(3):
        _same_bits(tmp_path / f"r{i}", tmp_path / "serial")
    (cached,) = cache.glob("*.safetensors")
    (serial,) = serial_cache.glob("*.safetensors")
    assert cached.name == serial.name and cached.read_bytes() == serial.read_bytes()


HOLD_LOCK_CHILD = """
import sys, time
from filelock import FileLock
FileLock(sys.argv[1]).acquire()
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_lock_holder_does_not_block_the_warm_start(tmp_path, capsys):
    """The lock is the OS's (flock): when its holder is killed mid-training, the next process trains."""
    from vexact.rl.warmstart import warm_start_lock_path

    cache = tmp_path / "cache"
    cache.mkdir()
    cfg = load_config(EXPERIMENT, [*TINY_RUN, f"output_dir={tmp_path / 'run'}", f"warm_start.cache_dir={cache}"])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK_CHILD, str(warm_start_lock_path(cfg))],
                              stdout=subprocess.PIPE, text=True, env=_child_env())
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait()
    assert main(_run_args(tmp_path / "run", cache)) == 0
    assert "warm start: trained here and cached" in capsys.readouterr().out


def _warm_started(cfg) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A fresh policy of ``cfg`` after ``warm_start``, and what it logged."""
    from vexact.engine.model import Transformer
    from vexact.rl.tasks import task_of
    from vexact.rl.warmstart import warm_start

    task = task_of(cfg)
    model = Transformer(cfg.model.to_model_config(task.tokenizer.vocab_size), backend=cfg.backend,
                        dtype=torch.float32, device=torch.device("cpu"), init_seed=cfg.policy_seed)
    lines: list[str] = []
    warm_start(model, cfg, task, log=lines.append)
    return {k: v.clone() for k, v in model.state_dict().items()}, lines


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
@pytest.mark.parametrize("damage", ("truncated", "another_model"))
def test_a_damaged_warm_start_entry_is_retrained_to_a_cold_runs_bits(tmp_path, damage):
    """A cache entry cut short (safetensors' SafetensorError, neither OSError nor ValueError) crashed every run with a
    traceback. Now one log line names it as damaged, and it is retrained under the lock and republished: the weights
    (and the entry's bytes) are a cold cache's."""
    from vexact.rl.warmstart import warm_start_cache_path

    cold = load_config(EXPERIMENT, [*TINY_RUN, f"output_dir={tmp_path / 'a'}",
                                     f"warm_start.cache_dir={tmp_path / 'c'}"])
    expected, _ = _warm_started(cold)
    good = warm_start_cache_path(cold).read_bytes()
    cfg = load_config(EXPERIMENT, [*TINY_RUN, f"output_dir={tmp_path / 'b'}", f"warm_start.cache_dir={tmp_path / 'd'}"])
    entry = warm_start_cache_path(cfg)
    entry.parent.mkdir()
    if damage == "truncated":
        entry.write_bytes(good[:len(good) // 2])
    else:  # a whole safetensors file, of other tensors
        atomic.write_bytes_atomic(entry, bytes(save_tensors({"w": torch.zeros(3)})))
    got, lines = _warm_started(cfg)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert [line for line in lines if "is damaged (" in line] == [lines[0]] and str(entry) in lines[0], lines
    assert lines[-1] == f"warm start: trained here and cached {entry}", lines
    assert entry.read_bytes() == good and not list(entry.parent.glob("*.tmp"))


@pytest.mark.slow
def test_a_parallel_sweep_trains_its_warm_start_once_and_says_which_point(tmp_path):
    """``vexact sweep --jobs 3`` (as ``vexact demo --jobs 3``): three points of one warm-start key; the sweep's log
    names the point that trained it and the points that loaded it."""
    spec_path = tmp_path / "s.yaml"
    settings = dict(s.split("=", 1) for s in TINY_RUN)
    spec_path.write_text(yaml.safe_dump({
        "name": "s", "base": str(EXPERIMENT), "output_dir": str(tmp_path / "s"),
        "set": {**{k: yaml.safe_load(v) for k, v in settings.items()}, "warm_start.cache_dir": str(tmp_path / "c"),
                "inject.mode": "logit_scale"},
        "grid": {"inject.value": [0.0, -0.25, -0.5]}}))
    console = Console(record=True, width=400)
    statuses = run_sweep(load_sweep_spec(spec_path), jobs=3, console=console)
    assert set(statuses.values()) == {"completed"}
    text = console.export_text()
    trained = [line for line in text.splitlines() if "warm start: trained here" in line]
    loaded = [line for line in text.splitlines() if "warm start: loaded" in line]
    assert len(trained) == 1 and len(loaded) == 2, text
    assert {line.split()[0] for line in trained + loaded} == set(statuses)  # each line names its point


# --------------------------------------------------------------------------- 2. one atomic-write helper
def test_two_writers_at_once_both_publish_whole_files(tmp_path, monkeypatch):
    """Two writers of one file whose renames are slow (both temp files exist at once): both succeed and the file
    is one of the two documents, whole. (One fixed temp name: the second rename finds its file renamed away.)"""
    real_replace = os.replace

    def slow_replace(src, dst):
        time.sleep(0.3)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    path = tmp_path / "summary.json"
    documents = [{"writer": i, "payload": [i] * 1000} for i in range(2)]
    errors: list[BaseException] = []

    def write(doc: dict) -> None:
        try:
            atomic.write_json_atomic(path, doc)
        except BaseException as err:  # noqa: BLE001 -- recorded for the assertion
            errors.append(err)

    threads = [threading.Thread(target=write, args=(d,)) for d in documents]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text()) in documents
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left behind


def test_atomic_write_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path / "state.json"
    atomic.write_json_atomic(path, {"a": 1})
    assert synced[-1] == str(tmp_path)  # the directory, after the rename
    assert any(Path(s).parent == tmp_path and s != str(tmp_path) for s in synced[:-1])  # the temp file, before


CRASH_CHILD = """
import os, sys
from vexact.records import atomic
atomic._before_rename = lambda tmp, path: os._exit(9)  # killed between write and rename
atomic.write_json_atomic(sys.argv[1], {"version": "new", "padding": "x" * 100000})
"""


@pytest.mark.slow
def test_a_crash_between_write_and_rename_leaves_the_old_file(tmp_path):
    path = tmp_path / "sweep.json"
    atomic.write_json_atomic(path, {"version": "old"})
    crashed = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(path)], env=_child_env())
    assert crashed.returncode == 9
    assert json.loads(path.read_text()) == {"version": "old"}
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".sweep.json.")  # the unpublished temp file
    atomic.write_json_atomic(path, {"version": "next"})  # the next writer is not in its way
    assert json.loads(path.read_text()) == {"version": "next"}


def test_every_must_not_tear_file_goes_through_the_helper():
    """No module writes summary.json, sweep.json, manifests, caches or reports with a bare write_text / fixed temp
    name any more: the only ``os.replace`` calls left publish directories (checkpoints, the SmolLM2 conversion)."""
    offenders = []
    for path in [*(ROOT / "vexact").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if '+ ".tmp"' in line or "'.tmp'" in line or 'name + ".tmp"' in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
    for rel in ("vexact/sweeps/sweep.py", "vexact/reports/sweep_report.py", "vexact/reports/run_report.py",
                "vexact/rl/warmstart.py", "vexact/map/scaling_report.py", "vexact/map/build.py",
                "vexact/real/check_report.py"):
        assert ".write_text(" not in (ROOT / rel).read_text(), rel


def test_every_plot_is_published_whole():
    """scaling.png, meter.png and the --png plots of measure, compare and locate were saved in place: a reader saw half
    an image, and a failed save left half an image where the old one was. Every ``savefig`` in vexact now writes
    the temp file of ``atomic.publish``."""
    bare = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in (ROOT / "vexact").rglob("*.py")
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if ".savefig(" in line and "publish(" not in line]
    assert bare == []


def test_config_yaml_and_measure_summaries_are_published_through_the_helper(tmp_path, monkeypatch):
    from vexact.real.measure import write_report_json

    published = []
    monkeypatch.setattr(atomic, "_before_rename", lambda tmp, path: published.append(path.name))
    save_config(load_config(EXPERIMENT), tmp_path / "config.yaml")
    write_report_json({"k3": math.inf}, tmp_path / "summary.json")
    assert published == ["config.yaml", "summary.json"]
    assert load_config(tmp_path / "config.yaml") == load_config(EXPERIMENT)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"k3": "inf"}


# --------------------------------------------------------------------------- 3. one metrics.jsonl reader
GOOD = [{"step": 0, "reward/mean": 0.5, "actor/grad_norm": "nan"}, {"step": 1, "reward/mean": 0.25,
                                                                     "actor/grad_norm": "inf"}]


def _write_log(path: Path, lines: list[str], torn: str | None = None) -> None:
    path.write_text("".join(line + "\n" for line in lines) + (torn or ""))


def test_a_torn_last_line_is_left_out_by_every_reader(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = run / "metrics.jsonl"
    _write_log(log, [json.dumps(r) for r in GOOD], torn='{"step": 2, "reward/mean": 0.1}')  # parses, but torn
    rows = read_metrics(log)
    assert [r["step"] for r in rows] == [0, 1]
    assert read_point(run, "run").metrics == rows and not read_point(run, "run").damage  # report
    MetricsWriter(log, keep_steps_below=2).close()  # resume keeps both complete lines
    assert read_metrics(log) == rows and log.read_text().endswith("}\n")


def test_damage_before_the_last_line_is_the_same_error_everywhere(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = run / "metrics.jsonl"
    _write_log(log, [json.dumps(GOOD[0]), "garbage{", json.dumps(GOOD[1])])
    with pytest.raises(MetricsDamaged, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(log)
    with pytest.raises(MetricsDamaged, match=r"metrics.jsonl:2: not a JSON line"):
        MetricsWriter(log, keep_steps_below=3)  # resume
    point = read_point(run, "run")  # the report does not skip the line silently: it names the damage
    assert point.metrics == [] and point.damage == ["metrics.jsonl:2: not a JSON line (Expecting value); the "
                                                    "metrics log is damaged"]
    log.write_bytes(json.dumps(GOOD[0]).encode() + b'\n{"step": 1, "bad": "\xff"}\n' + json.dumps(GOOD[1]).encode()
                    + b"\n")
    with pytest.raises(MetricsDamaged, match="metrics.jsonl:2: not a JSON line .not UTF-8 text"):
        read_metrics(log)


def test_one_table_of_non_finite_spellings():
    """Every reader maps the same spellings to the same floats: the metrics reader, collapse detection, the live
    views (TensorBoard/W&B rows) and the report."""
    for spelling, value in NON_FINITE.items():
        for text in (spelling, spelling.upper(), spelling.capitalize()):
            decoded = decode_non_finite({"x": text})["x"]
            from_collapse = collapse.as_float(text)
            from_views = metrics_log.scalars({"step": 0, "x": text})["x"]
            for got in (decoded, from_collapse, from_views):
                assert (math.isnan(got) and math.isnan(value)) or got == value, (text, got)
    for text in ("fast", "1.5", "nanometre", ""):
        assert collapse.as_float(text) is None and "x" not in metrics_log.scalars({"x": text})
        assert decode_non_finite(text) == text


# --------------------------------------------------------------------------- damaged points in a report
def _hand_sweep(root: Path) -> Path:
    entries = []
    for seed in (0, 1):
        name = f"seed={seed}"
        entries.append({"name": name, "dir": f"points/{name}", "overrides": {"seed": seed}, "status": "completed"})
        point = root / "points" / name
        point.mkdir(parents=True)
        rows = [{"step": s, "reward/mean": 0.5, "eval/reward_mean": 0.5, "rollout_corr/k3_kl": 0.0} for s in range(4)]
        (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (point / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": 4,
                                                        "collapse": {"collapsed": False, "peak_reward": 0.5}}))
    (root / "sweep.json").write_text(json.dumps({"name": "hand", "grid": {"seed": [0, 1]}, "points": entries}))
    return root


def test_report_names_damaged_points_and_exits_non_zero_unless_told_to_skip(tmp_path, capsys):
    sweep = _hand_sweep(tmp_path / "sweep")
    damaged = sweep / "points" / "seed=1"
    (damaged / "summary.json").write_text('{"status": "compl')  # unparsable
    (damaged / "metrics.jsonl").write_text("\x00\x01garbage\nmore garbage\n")
    assert main(["report", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "1 damaged or unreadable point: seed=1 (summary.json: not a readable run summary" in err
    assert "metrics.jsonl:1: not a JSON line" in err and "--skip-damaged" in err
    assert not (sweep / "report").exists()  # refused before anything was written

    assert main(["report", str(sweep), "--skip-damaged"]) == 0
    out = capsys.readouterr().out
    assert "skipped damaged point seed=1: summary.json: not a readable run summary" in out
    table = (sweep / "report" / "table.md").read_text()
    assert "Left out (damaged or unreadable, --skip-damaged): seed=1" in table
    assert [r["seeds"] for r in json.loads((sweep / "report" / "table.json").read_text())] == [1]


def test_single_run_report_refuses_a_damaged_log_unless_told_to_skip(tmp_path, capsys):
    sweep = _hand_sweep(tmp_path / "sweep")
    run = sweep / "points" / "seed=0"
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"step": 4, "reward/mean": 0.5}) + "\n")
    assert main(["report", str(run)]) == 2
    assert "metrics.jsonl:5: not a JSON line" in capsys.readouterr().err
    assert main(["report", str(run), "--skip-damaged"]) == 0
    report = json.loads((run / "report" / "report.json").read_text())
    assert any("left out, damaged (--skip-damaged): metrics.jsonl:5" in n for n in report["notes"])


def test_single_run_report_speaks_of_the_run_not_of_points(tmp_path, capsys):
    run = _hand_sweep(tmp_path / "sweep") / "points" / "seed=0"
    (run / "summary.json").write_text('{"status": "compl')  # unparsable
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run}: the run's files are damaged or unreadable: summary.json: not a readable "
                          "run summary (") and err.count("\n") == 1, err
    assert err.endswith(". Repair them, or pass --skip-damaged to report from what is readable\n")
    assert "point" not in err.replace(str(run), "")


def test_report_refuses_a_file_where_its_folder_goes(tmp_path, capsys):
    """mkdir's own error was a bare "File exists: DIR/report"; now it says what to do, for a sweep and a run."""
    sweep = _hand_sweep(tmp_path / "sweep")
    for target in (sweep, sweep / "points" / "seed=0"):
        (target / "report").write_text("the user's notes\n")
        assert main(["report", str(target)]) == 2
        assert capsys.readouterr().err == (f"error: {target / 'report'} is a file; the report is written into a "
                                           "folder of that name: move the file away and run vexact report again\n")
        assert (target / "report").read_text() == "the user's notes\n"


def test_an_undamaged_sweep_reports_as_before(tmp_path):
    result = write_report(_hand_sweep(tmp_path / "sweep"), Console(quiet=True))
    assert result["skipped"] == [] and [r["seeds"] for r in result["rows"]] == [2]


# --------------------------------------------------------------------------- 4. library switches
def test_safetensors_headers_are_checked_by_safe_open(tmp_path, monkeypatch):
    """The header checks are the library's: a file safe_open refuses is refused, named, even where a hand parser
    would have found nothing wrong (here: safe_open is made to refuse a good file)."""
    import safetensors

    from vexact.real import hf_checkpoint, tiny

    ckpt = tiny.make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=1, tokenizer=False)
    infos = hf_checkpoint._safetensors_header(ckpt / "model.safetensors")
    assert infos["model.embed_tokens.weight"].dtype == "F32" and infos["model.embed_tokens.weight"].shape == (128, 64)

    def refusing_open(*args, **kwargs):
        raise safetensors.SafetensorError("Error while deserializing header: a check of the library's")

    monkeypatch.setattr(safetensors, "safe_open", refusing_open)
    with pytest.raises(ValueError) as info:
        hf_checkpoint._safetensors_header(ckpt / "model.safetensors")
    assert str(info.value) == (f"{ckpt / 'model.safetensors'}: corrupt or truncated safetensors file (a check of "
                               "the library's)")


def _hub_cache(root: Path, revisions: dict[str, float]) -> Path:
    """A Hugging Face cache holding org/tiny at the given snapshot hashes (with those mtimes)."""
    repo = root / "hub" / "models--org--tiny"
    for sha, mtime in revisions.items():
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        os.utime(snap, (mtime, mtime))
    (repo / "refs").mkdir()
    return repo


def test_hub_cache_lookup_follows_refs_main_not_the_newest_snapshot(tmp_path, monkeypatch):


    repo = _hub_cache(tmp_path, {"aaa111": 1_000_000, "bbb222": 2_000_000})
    (repo / "refs" / "main").write_text("aaa111")  # main is the older snapshot
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at its import
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"--model {repo / 'snapshots' / 'aaa111'}$"):
        read_checkpoint_config(Path("org/tiny"))


@pytest.mark.slow
def test_hub_cache_lookup_honours_hf_home(tmp_path):
    repo = _hub_cache(tmp_path / "home", {"ccc333": 1_000_000})
    (repo / "refs" / "main").write_text("ccc333")
    code = ("from pathlib import Path\nfrom vexact.real.hf_checkpoint import _hub_id_hint\n"
            "print(_hub_id_hint(Path('org/tiny')))")
    env = {k: v for k, v in _child_env().items() if k not in ("HF_HUB_CACHE", "HF_HOME")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HOME": str(tmp_path / "home"),
                                                            "HF_HUB_OFFLINE": "1"},
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith(f"--model {repo / 'snapshots' / 'ccc333'}")


def test_ray_executor_uses_only_public_ray_api():
    tree = ast.parse((ROOT / "vexact" / "lab" / "ray_executor.py").read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            private += [n for n in names if "_private" in n]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(node.attr)
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
            private.append(node.arg)
    assert private == []


@pytest.mark.slow
def test_ray_imported_in_cluster_mode_is_refused_for_a_private_instance(tmp_path):
    require_optional("ray", "pip install 'vexact[ray]'")
    code = ("import ray\nfrom vexact.sweeps import ray_executor\ntry:\n    ray_executor.start(None)\n"
            "except ValueError as e:\n    print('refused:', e)\nprint('initialized', ray.is_initialized())")
    env = {k: v for k, v in _child_env().items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "refused: a private Ray instance must listen on 127.0.0.1 only" in out and "initialized False" in out
    assert ray_executor.LOCAL_HOST == "127.0.0.1"


def test_one_markdown_table_writer():
    """The benchmark tables (what the README shows) come from the one writer, which escapes cells and checks rows."""
    from benchmarks import tables

    assert tables._markdown(["op", "x"], [["a|b", "1"]]) == markdown_table(["op", "x"], [["a|b", "1"]],
                                                                           [None, "right"])
    assert markdown_table(["op", "x"], [["a|b", "1"]], [None, "right"]) == "| op | x |\n|---|---:|\n| a\\|b | 1 |"
    with pytest.raises(ValueError, match="a row has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])


def test_the_sweep_table_comes_from_the_one_writer(tmp_path, monkeypatch):
    calls = []
    real = sweep_table.markdown_table
    monkeypatch.setattr(sweep_table, "markdown_table", lambda *a: calls.append(a) or real(*a))
    text = group_markdown(group_table(read_sweep_results(_hand_sweep(tmp_path / "sweep"))), notes=[])
    assert len(calls) == 1 and text.splitlines()[1].startswith("|:---|---:|")


def test_one_function_named_markdown_table():
    """The package defines ``markdown_table`` once (the sweep report's group table is ``group_markdown``, a caller of
    it): one name, one writer."""
    defined = [f"{path.relative_to(ROOT)}:{node.lineno}"
               for path in [*(ROOT / "vexact").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"),
                            *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").rglob("*.py")]
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "markdown_table"]
    assert defined == ["vexact/sweeps/markdown_table.py:18"], defined


def test_no_second_markdown_table_writer():
    """No other module joins table cells itself (docs_gen.py, the docs helper's reference-page generator, aside)."""
    for path in [*(ROOT / "vexact").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                 *(ROOT / "tools").rglob("*.py")]:
        if path.name in ("markdown_table.py", "docs_gen.py"):
            continue
        assert '"| " + " | ".join' not in path.read_text(), path  # how a table row is built


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_checkpoint_files_get_the_umask_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        model = torch.nn.Linear(2, 2)
        directory = save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), {"next_step": 1})
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in directory.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask) and "checkpoint.safetensors" in modes


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_warm_start_cache_and_run_checkpoints_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        Trainer(_short(tmp_path, "run", "steps=1", "warm_start.steps=2", f"warm_start.cache_dir={tmp_path / 'cache'}"),
                Console(quiet=True)).run()  # a cache of its own: the entry is written here, under this umask
    finally:
        os.umask(old)
    (cached,) = (tmp_path / "cache").glob("*.safetensors")
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("*/checkpoint.safetensors")
    assert cached.stat().st_mode & 0o777 == checkpoint.stat().st_mode & 0o777 == 0o644


def test_a_run_named_like_the_warm_start_cache_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"name": ".warmstart_cache"})
    assert e.value.key == "name" and "the warm-start cache" in e.value.problem
    with pytest.raises(ConfigError) as e:
        config_from_dict({"output_dir": str(tmp_path / "c"), "warm_start": {"cache_dir": str(tmp_path / "c")}})
    assert e.value.key == "output_dir"
    assert config_from_dict({"name": "warmstart_cache"}).name == "warmstart_cache"
