"""``vexact sweep SWEEP.yaml``: a base config plus a grid, one run directory per point.

A sweep file::

    name: noise_sweep
    base: zero_mismatch.yaml          # a run config, relative to this file
    set: {inject.mode: logit_noise}   # overrides applied to every point (optional)
    grid:                             # the cartesian product of these is run
      inject.value: [0, 1.0, 2.0]
      seed: [0, 1, 2]
    output_dir: runs/sweeps/noise_sweep   # optional; default runs/sweeps/<name>

Optional ``variants`` name bundles of overrides that belong together (a remedy = a correction method plus an
LR schedule, say); every variant is crossed with the grid, and the point records ``variant: <name>``, which
the report groups by like a grid key::

    variants:
      none: {}
      tis_lr_decay: {correction.method: token_tis, lr_schedule.kind: length_triggered}

Every point's config is built and validated before anything runs. Points run in grid order,
sequentially or in ``--jobs N`` worker processes. The sweep is resumable: a point whose
``summary.json`` says completed/stopped is skipped, an unfinished one resumes from its last
checkpoint; ``sweep.json`` is rewritten atomically after every point, so Ctrl-C loses nothing
finished. A point that fails records its error and the sweep goes on.
"""

from __future__ import annotations

import itertools
import json
import re
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from ..rl.config import ConfigError, RunConfig, config_from_dict
from ..rl.runlog import write_json_atomic

FINISHED = ("completed", "stopped")  # stopped = the run ended itself (NaN, exactness) -- an outcome
SWEEP_KEYS = {"name", "base", "set", "grid", "variants", "output_dir"}
VARIANT_KEY = "variant"


@dataclass
class SweepPoint:
    name: str
    overrides: dict[str, Any]
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class SweepSpec:
    name: str
    grid: dict[str, list]
    output_dir: Path
    points: list[SweepPoint]
    variants: dict[str, dict] | None = None


def _format_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def point_name(overrides: dict[str, Any]) -> str:
    """'inject.value=0.5,seed=1' -- also the point's folder name (unsafe characters replaced)."""
    text = ",".join(f"{k}={_format_value(v)}" for k, v in overrides.items())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def load_sweep_spec(path: str | Path, output_dir: str | Path | None = None) -> SweepSpec:
    """Read and validate a sweep file; every point's config is validated here, before any work."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep file {path} must be a mapping with keys {', '.join(sorted(SWEEP_KEYS))}")
    unknown = sorted(set(spec) - SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"unknown key (known keys: {', '.join(sorted(SWEEP_KEYS))})", unknown[0])
    name = spec.get("name") or path.stem
    base = spec.get("base")
    if base is None:
        base_dict: dict = {}
    elif isinstance(base, dict):
        base_dict = base
    else:
        base_path = (path.parent / str(base)).resolve()
        if not base_path.is_file():
            raise ConfigError(f"base config {base_path} does not exist", "base")
        base_dict = yaml.safe_load(base_path.read_text()) or {}
    common = spec.get("set") or {}
    grid = spec.get("grid")
    if not isinstance(common, dict):
        raise ConfigError("expected a mapping of dotted keys to values", "set")
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError("expected a mapping of dotted config keys to non-empty lists of values", "grid")
    variants = spec.get("variants")
    if variants is not None:
        if not isinstance(variants, dict) or not variants or not all(
                isinstance(v, dict) or v is None for v in variants.values()):
            raise ConfigError("expected a mapping of variant names to mappings of dotted keys to values", "variants")
        if VARIANT_KEY in grid:
            raise ConfigError(f"{VARIANT_KEY!r} is set by 'variants'; remove it from the grid", "grid")
        grid = {VARIANT_KEY: list(variants), **grid}
    out = Path(output_dir or spec.get("output_dir") or Path("runs") / "sweeps" / name)

    points = []
    for combo in itertools.product(*grid.values()):
        overrides = dict(zip(grid.keys(), combo))
        pname = point_name(overrides)
        config_overrides = dict(overrides)
        if variants is not None:
            config_overrides = {**(variants[config_overrides.pop(VARIANT_KEY)] or {}), **config_overrides}
        settings = {**common, **config_overrides, "output_dir": str(out / "points" / pname),
                    "name": f"{name}/{pname}"}
        settings.setdefault("logging.live", False)
        items = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for k, v in settings.items()]
        try:
            cfg = config_from_dict(base_dict, items)
        except ConfigError as err:
            raise ConfigError(f"sweep point {pname}: {err}") from None
        points.append(SweepPoint(pname, overrides, cfg))
    return SweepSpec(name, {k: list(v) for k, v in grid.items()}, out, points, variants)


def point_status(point: SweepPoint) -> str:
    summary = point.run_dir / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text()).get("status", "pending")
    return "pending" if not point.run_dir.exists() else "interrupted"


def _write_index(spec: SweepSpec, statuses: dict[str, str], errors: dict[str, str | None]) -> None:
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec.output_dir / "sweep.json", {
        "name": spec.name,
        "grid": spec.grid,
        "variants": spec.variants,
        "points": [{"name": p.name, "dir": f"points/{p.name}", "overrides": p.overrides,
                    "status": statuses[p.name], "error": errors.get(p.name)} for p in spec.points],
    })


def _run_point(config: dict, resume: bool, threads: int | None) -> dict:
    """Run one point (in this process or a worker). Returns its summary, or the error."""
    from ..rl.trainer import Trainer  # imported here: workers are spawned fresh

    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = config_from_dict(config)
        summary = Trainer(cfg, Console(quiet=True)).run(resume=resume)
        return {"status": summary["status"], "error": None}
    except KeyboardInterrupt:
        return {"status": "interrupted", "error": None}
    except Exception as err:  # a failing point is recorded; the sweep goes on
        return {"status": "failed", "error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}


def run_sweep(spec: SweepSpec, jobs: int = 1, console: Console | None = None) -> dict[str, str]:
    """Run every unfinished point; returns {point name: status}."""
    console = console or Console()
    statuses = {p.name: point_status(p) for p in spec.points}
    errors: dict[str, str | None] = {}
    _write_index(spec, statuses, errors)
    todo = [p for p in spec.points if statuses[p.name] not in FINISHED]
    done_before = len(spec.points) - len(todo)
    if done_before:
        console.print(f"sweep {spec.name}: {done_before} of {len(spec.points)} points already finished, skipped")
    threads = max(1, torch.get_num_threads() // jobs) if jobs > 1 else None

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(), TextColumn("{task.fields[current]}"), console=console,
                        disable=not console.is_terminal)

    def finish(point: SweepPoint, result: dict) -> None:
        statuses[point.name] = result["status"]
        errors[point.name] = result["error"]
        if result["error"]:
            (point.run_dir).mkdir(parents=True, exist_ok=True)
            (point.run_dir / "error.txt").write_text(result["error"])
        _write_index(spec, statuses, errors)
        line = f"{point.name}: {result['status']}"
        console.print(line if result["status"] != "failed" else f"[red]{line}[/] (see {point.run_dir / 'error.txt'})")
        progress.update(bar, advance=1)

    with progress:
        bar = progress.add_task(f"sweep {spec.name}", total=len(spec.points), completed=done_before, current="")
        if jobs <= 1:
            for point in todo:
                progress.update(bar, current=point.name)
                result = _run_point(point.config.to_dict(), point.run_dir.exists(), None)
                finish(point, result)
                if result["status"] == "interrupted":
                    raise KeyboardInterrupt
        else:
            _run_parallel(todo, jobs, threads, finish, progress, bar)
    return statuses


def _run_parallel(todo: list[SweepPoint], jobs: int, threads: int | None, finish, progress, bar) -> None:
    pending = list(todo)
    running: dict[Future, SweepPoint] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    point = pending.pop(0)
                    running[pool.submit(_run_point, point.config.to_dict(), point.run_dir.exists(), threads)] = point
                progress.update(bar, current=", ".join(p.name for p in running.values()))
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    finish(running.pop(future), future.result())
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            raise

