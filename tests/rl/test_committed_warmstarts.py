"""The warm starts kept in the repository (docs/results/data/warmstarts/) save the long sweeps an hour each: a sweep
copies one into runs/.warmstart_cache/ and vexact loads it by its key. A file whose key no experiment's point has any
more (a changed config, a bumped ``CACHE_VERSION``) would sit unused while the sweep silently retrains, so each file
must be the cache entry of a point of some sweep in experiments/, and load into that point's model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vexact.engine.model import Transformer
from vexact.rl.tasks import task_of
from vexact.rl.warmstart import warm_start_cache_path, warm_start_key
from vexact.sweeps.sweep import SweepPoint, load_sweep_spec

ROOT = Path(__file__).resolve().parents[2]
KEPT = sorted((ROOT / "docs" / "results" / "data" / "warmstarts").glob("*.safetensors"))


@pytest.fixture(scope="module")
def points_by_key(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SweepPoint]:
    """Every sweep's points in experiments/, by warm-start key (loaded once for all the kept files)."""
    out = tmp_path_factory.mktemp("sweeps")
    points: dict[str, SweepPoint] = {}
    for sweep in sorted((ROOT / "experiments").glob("*sweep*.yaml")):
        for point in load_sweep_spec(sweep, output_dir=out / sweep.stem).points:
            points.setdefault(warm_start_key(point.config), point)
    return points


def test_the_repository_keeps_warm_starts():
    assert KEPT, "docs/results/data/warmstarts/ holds no warm start"


@pytest.mark.parametrize("kept", KEPT, ids=[path.name for path in KEPT])
def test_each_kept_warm_start_is_the_cache_entry_of_an_experiment_and_loads_into_its_model(kept, points_by_key):
    key = kept.stem.removeprefix("warmstart-")
    assert key in points_by_key, f"{kept.name}: no point of any sweep in experiments/ has warm-start key {key}"
    config = points_by_key[key].config
    assert warm_start_cache_path(config).name == kept.name  # the name the sweep looks for in its cache
    model_config = config.model.to_model_config(task_of(config).tokenizer.vocab_size)
    model = Transformer(model_config, backend=config.backend, dtype=torch.float32, init_seed=config.policy_seed)
    weights = load_file(str(kept))
    expected = model.state_dict()
    assert {name: tuple(t.shape) for name, t in weights.items()} == {
        name: tuple(t.shape) for name, t in expected.items()}
    model.load_state_dict(weights)  # strict: every parameter, nothing extra
