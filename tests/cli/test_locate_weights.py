"""``vexact locate``'s weights digest: two recordings of one config but other weights are refused, not blamed on
the first layer (tiny random models, no downloads).

What must hold: the digest is bitwise repeatable (any thread count, a rebuilt model) and names a transformers model
and the vexact model of its weights alike; one element changed by one ulp changes it (a change below bfloat16's
resolution changes only the float32 digest, as documented); a bf16 recording and an fp32 one of the same weights
compare by the bfloat16 digest and pass; dumps of other weights are one error naming both digests and both files,
compared anyway with ``--allow-different-weights``; ``--dump --tokens-from`` of other weights than that dump's is
refused before anything is recorded (recorded with ``--allow-different-weights``); a dump without a digest (written
before one was recorded) is compared and the report says the weights were not checked; ``assert_sites_equal``
refuses the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY

from vexact import ModelConfig, Transformer
from vexact.cli import main
from vexact.real.locate import LocateSettings, run_dump, run_locate
from vexact.real.pretrained import from_pretrained
from vexact.real.sites import DUMP_FILE, read_dump, weights_digest
from vexact.real.tiny import make_tiny_hf_model
from vexact.testing import assert_sites_equal, record_sites
from vexact_kernels.host_guard import torch_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

SHAPE = {k: v for k, v in TINY.items() if k != "max_seq_len"}
PROMPTS = [[5, 17, 3, 90, 41], [60, 1, 44]]


def _digest(model: torch.nn.Module, threads: int = 1) -> dict:
    with torch_threads(threads):
        return weights_digest(model.named_parameters())


def test_the_digest_is_repeatable_and_names_transformers_and_vexact_weights_alike():
    model = Transformer(ModelConfig(**TINY), init_seed=0)
    digest = _digest(model)
    assert digest["held"] == "float32" and set(digest["sha256"]) == {"float32", "bfloat16"}
    assert digest["tensors"] == len(list(model.parameters()))
    for threads in (2, 3):
        assert _digest(model, threads) == digest
    assert _digest(Transformer(ModelConfig(**TINY), init_seed=0)) == digest  # rebuilt: the same bits
    hf = make_tiny_hf_model("llama", seed=0).float()
    assert _digest(from_pretrained(hf, backend="exact")) == _digest(hf)  # model. prefix, tied or not
    bf16 = _digest(from_pretrained(hf, backend="exact", dtype="bf16"))
    assert bf16["held"] == "bfloat16" and bf16["sha256"] == {"bfloat16": _digest(hf)["sha256"]["bfloat16"]}


def test_one_element_changes_the_digest():
    model = Transformer(ModelConfig(**TINY), init_seed=0)
    digest = _digest(model)
    weight = model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        original = weight[3, 5].clone()
        weight[3, 5] = original.nextafter(torch.tensor(1.0))  # one float32 ulp: below bfloat16's resolution
        ulp = _digest(model)
        weight[3, 5] = original * 2  # another bfloat16 value too
        moved = _digest(model)
        weight[3, 5] = original
    assert ulp["sha256"]["float32"] != digest["sha256"]["float32"]
    assert ulp["sha256"]["bfloat16"] == digest["sha256"]["bfloat16"]  # a bf16 side holds the same weights
    assert moved["sha256"]["bfloat16"] != digest["sha256"]["bfloat16"]
    assert _digest(model) == digest


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A trainer's dump; an engine's of the same weights in bf16; one of other weights (seed 1: one config)."""
    root = tmp_path_factory.mktemp("weights")
    common = dict(random_model=dict(SHAPE), hash=True)
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "trainer", prompt_tokens=PROMPTS, max_new_tokens=1,
                            **common))
    run_dump(LocateSettings(a="exact:bf16:rollout", dump=root / "engine", tokens_from=root / "trainer", **common))
    run_dump(LocateSettings(a="exact:fp32:rollout", dump=root / "stepped", tokens_from=root / "trainer", seed=1,
                            allow_different_weights=True, **common))  # other weights, knowingly
    (root / "old").mkdir()  # the trainer's dump as vexact wrote it before it recorded a digest
    manifest = json.loads((root / "trainer" / DUMP_FILE).read_text())
    del manifest["weights"]
    (root / "old" / DUMP_FILE).write_text(json.dumps(manifest))
    return root


def test_a_bf16_engine_and_an_fp32_trainer_of_the_same_weights_compare(dumps):
    s = run_locate(LocateSettings(a=str(dumps / "engine"), b=str(dumps / "trainer"))).summary
    w = s["weights"]
    assert w["same"] is True and w["dtype"] == "bfloat16" and w["a"] == w["b"]
    assert s["diverged"]  # bf16 vs fp32: the sites differ, and it is not the weights


def test_dumps_of_other_weights_are_refused_naming_both_digests_and_files(dumps, capsys):
    trainer, stepped = read_dump(dumps / "trainer", "--a"), read_dump(dumps / "stepped", "--b")
    assert trainer.config == stepped.config and trainer.tokens == stepped.tokens  # what check_comparable sees
    a, b = trainer.weights["sha256"]["float32"], stepped.weights["sha256"]["float32"]
    assert a != b
    argv = ["locate", "--a", str(dumps / "trainer"), "--b", str(dumps / "stepped")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert (f"{dumps / 'trainer' / DUMP_FILE} and {dumps / 'stepped' / DUMP_FILE} ran different weights (sha256 of "
            f"their float32 weights: {a} vs {b})") in err, err
    assert "--allow-different-weights" in err
    # knowingly: compared, and the report says the weights differ
    assert main([*argv, "--allow-different-weights", "--fail-on-divergence"]) == 1
    out = capsys.readouterr().out
    assert f"weights DIFFER (sha256 of the float32 weights {a[:16]} vs {b[:16]})" in out
    s = run_locate(LocateSettings(a=str(dumps / "trainer"), b=str(dumps / "stepped"),
                                  allow_different_weights=True)).summary
    assert s["weights"] == {"same": False, "dtype": "float32", "a": a, "b": b, "note": ""}


def test_a_dump_without_a_digest_is_compared_and_the_report_says_so(dumps, capsys):
    assert read_dump(dumps / "old", "--a").weights is None
    s = run_locate(LocateSettings(a=str(dumps / "old"), b=str(dumps / "stepped"))).summary
    assert s["weights"]["same"] is None and str(dumps / "old" / DUMP_FILE) in s["weights"]["note"]
    assert main(["locate", "--a", str(dumps / "old"), "--b", str(dumps / "trainer")]) == 0
    out = capsys.readouterr().out
    assert f"weights not checked: {dumps / 'old' / DUMP_FILE} records no weights digest" in out
    assert "no divergence" in out


def test_a_dump_of_other_weights_than_its_tokens_from_is_refused_before_it_records(dumps, monkeypatch, capsys):
    """--dump with --tokens-from checks the model's weights against that dump's before it records anything (the
    refusal came only at the later comparison, after the recording and the write); --allow-different-weights records
    them knowingly. Either way the weights are digested once (a full read of every weight)."""
    import vexact.real.locate as locate

    calls = {"capture": 0, "weights_digest": 0}

    def counted(name):
        original = getattr(locate, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(locate, name, counted(name))
    out = dumps / "stepped-again"
    sizes = [arg for k, v in SHAPE.items() for arg in (locate.size_flag(k), str(v))]
    argv = ["locate", *sizes, "--seed", "1", "--a", "exact:fp32:rollout", "--hash", "--tokens-from",
            str(dumps / "trainer"), "--dump", str(out)]
    a = read_dump(dumps / "trainer", "--a").weights["sha256"]["float32"]
    b = read_dump(dumps / "stepped", "--b").weights["sha256"]["float32"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert (f"{dumps / 'trainer' / DUMP_FILE} and path exact:fp32:rollout ran different weights (sha256 of their "
            f"float32 weights: {a} vs {b})") in err, err  # sites.different_weights_error, as a comparison says it
    assert calls == {"capture": 0, "weights_digest": 1} and not out.exists()  # no site recorded, nothing written
    assert main([*argv, "--allow-different-weights"]) == 0
    capsys.readouterr()
    assert calls == {"capture": 1, "weights_digest": 2}  # the digest checked is the one the dump records
    assert read_dump(out, "--b").weights == read_dump(dumps / "stepped", "--b").weights
    assert main(["locate", "--a", str(dumps / "trainer"), "--b", str(out)]) == 2  # compared: refused as before
    assert "ran different weights" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--dump", "D/new"], "--allow-different-weights: --dump records one path and compares nothing"),
    ([], "--allow-different-weights: both paths run one model here; it lets two dumps of other weights compare"),
])
def test_the_flag_is_refused_where_it_would_change_nothing(dumps, args, message, capsys):
    args = [a.replace("D/", f"{dumps}/") for a in args]
    assert main(["locate", *args, "--allow-different-weights"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_assert_sites_equal_refuses_other_weights():
    engine = record_sites(Transformer(ModelConfig(**TINY), init_seed=0), PROMPTS, kind="rollout")
    trainer = record_sites(Transformer(ModelConfig(**TINY), init_seed=1), PROMPTS)
    with pytest.raises(ValueError, match="path vexact exact:float32:rollout and path vexact exact:float32:train ran "
                                         "different weights"):
        assert_sites_equal(engine, trainer)
    with pytest.raises(AssertionError, match="weights DIFFER"):
        assert_sites_equal(engine, trainer, allow_different_weights=True)


def test_a_run_that_compares_its_own_paths_digests_nothing(monkeypatch):
    """Both paths of one run load one checkpoint (or seed): the same weights by construction. Digesting them read
    every weight (minutes at 30B) to tell nothing; the report says so instead, and a dump still digests."""
    import vexact.real.locate as locate

    def refused(named, held=None):
        raise AssertionError("weights_digest ran in a run that compares its own paths")

    monkeypatch.setattr(locate, "weights_digest", refused)
    summary = run_locate(LocateSettings(a="exact:fp32:rollout", b="native:fp32:train", prompt_tokens=PROMPTS,
                                        max_new_tokens=2)).summary
    assert summary["weights"]["same"] is True and summary["weights"]["dtype"] is None
    assert "in this run (the same weights by construction: not digested)" in summary["weights"]["note"]
    with pytest.raises(AssertionError, match="weights_digest ran"):
        run_dump(LocateSettings(a="exact:fp32:rollout", prompt_tokens=PROMPTS, max_new_tokens=2, dump=Path("unused")))
