"""``vexact check`` end to end through the console entry point; what ``--help`` imports."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_run_faults import _write_config
from test_sweep_faults import _cli_error

from vexact.cli import COMMANDS, build_parser, main
from vexact.engine import model as model_module
from vexact.real.check import WIDE_NEW_TOKENS, WIDE_PROMPTS, CheckSettings, check_units, run_check, wide_settings
from vexact.real.check_report import check_verdict
from vexact_kernels.host_guard import CANONICAL_PATH, ENV_MODES, MODE_ENV, SAME_BITS

ROOT = Path(__file__).resolve().parents[2]

# What a command imports to do its work, never to print a help: the trainer, the report, the sweep, the kernels,
# torch (and rich, which prints results)
HEAVY = ("torch", "vexact.rl.trainer", "vexact.reports.sweep_report", "vexact.sweeps.sweep", "vexact_kernels",
         "vexact.real.check", "rich")


def test_check_reports_zero_exact_mismatch_and_native_mismatch(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--num-prompts", "16", "--max-new-tokens", "24", "--hidden-size", "64",
                 "--intermediate-size", "160", "--dtype", "all", "--json", str(out), "--verbose"])
    assert code == 0
    rows = json.loads(out.read_text())
    # the checked model, then its wide one (--wide-hidden, default 512: one layer), each backend and dtype
    assert [(r["hidden_size"], r["num_layers"], r["backend"], r["dtype"]) for r in rows] == [
        (hidden, layers, b, d) for hidden, layers in ((64, 2), (512, 1)) for d in ("float32", "bfloat16")
        for b in ("exact", "native")]
    for r in rows:  # the keys of measure's and compare's --json reports
        assert r["tokens"] > 0
        if r["backend"] == "exact":
            assert r["bitwise_equal"] == r["tokens"] and r["metrics"]["mismatch/abs_dlogp_max"] == 0.0
            assert r["metrics"]["rollout_corr/k3_kl"] == 0.0
    assert sum(r["tokens"] - r["bitwise_equal"] for r in rows if r["backend"] == "native") > 0
    exact_paths = next(r["kernel_paths"] for r in rows if r["backend"] == "exact")
    # every exact op says which path it took; probed ops name their probes, by-construction ops need none
    assert exact_paths["ops"]["embedding"]["path"] == "by construction"
    for op in ("linear", "attention", "rms_norm", "silu_mul", "token_logprobs", "sampling"):
        assert exact_paths["ops"][op]["path"] in ("fast", "fixed-order", "mixed"), op
        assert exact_paths["ops"][op]["shape_classes"], op
    if exact_paths["mode"] == "auto":  # (VEXACT_CPU_EXACT_PATH=fixed-order: nothing is probed)
        assert all(p["passed"] is not None and p["threads_checked"] for p in exact_paths["probes"])
    out = capsys.readouterr().out
    assert "vexact check" in out and "path per op" in out and "gemm_rows" in out
    assert "hidden 64 x 2 layers" in out and "hidden 512 x 1 layer" in out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ENV_MODES)
def test_check_passes_in_every_guard_mode(mode, tmp_path):
    """``VEXACT_CPU_EXACT_PATH`` as a user sets it, in a fresh process: ``vexact check --dtype all`` passes in each
    mode a user may choose, on the path that mode names -- ``auto`` probing and free to take a ``same_bits``
    arrangement, ``canonical`` probing but taking none (what a host whose ``same_bits`` probes fail gets),
    ``fixed-order`` probing nothing."""
    out = tmp_path / "check.json"
    # fixed-order probes nothing, so the wide model (there to reach same_bits arrangements) has nothing to show it,
    # and is the slowest part there (30 s of 40 on an AVX2-only CPU)
    wide = ["--wide-hidden", "0"] if mode == "fixed-order" else []
    done = subprocess.run([sys.executable, "-m", "vexact", "check", "--dtype", "all", "--num-prompts", "8",
                           "--max-prompt-len", "12", "--max-new-tokens", "8", "--hidden-size", "64",
                           "--intermediate-size", "160", *wide, "--json", str(out)],
                          env={**os.environ, MODE_ENV: mode}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("PASS: ")
    exact = [r for r in json.loads(out.read_text()) if r["backend"] == "exact"]
    assert {r["dtype"] for r in exact} == {"float32", "bfloat16"}
    assert all(r["tokens"] > 0 and r["bitwise_equal"] == r["tokens"] for r in exact)
    for row in exact:
        paths = row["kernel_paths"]
        assert paths["mode"] == mode
        probes = paths["probes"]
        arrangements = [p for p in probes if p["property"] == SAME_BITS]
        properties = [p for p in probes if p["property"] != SAME_BITS]
        assert properties and all((p["passed"] is None) == (mode == "fixed-order") for p in properties)
        if mode == "auto":
            assert all(p["passed"] is not None for p in arrangements)
        else:  # declined without asking (canonical), never asked (fixed-order)
            assert all(p["path"] == CANONICAL_PATH and p["passed"] is None for p in arrangements)
    if mode != "fixed-order":  # the shapes reach a same_bits arrangement: canonical's declining is tested
        assert any(p["property"] == SAME_BITS for p in exact[-1]["kernel_paths"]["probes"])


def test_check_adds_a_wide_model_only_where_the_checked_one_is_narrower():
    """``wide_settings``: one dense layer of the wide size with the check's own vocabulary, dtype and arrangements, at
    most ``WIDE_PROMPTS`` x ``WIDE_NEW_TOKENS``; none at 0 or for a model as wide; a size its heads cannot split is
    one error naming the flag."""
    narrow = CheckSettings(hidden_size=64, num_layers=2, num_experts=4, dtype="bfloat16", num_prompts=24)
    wide = wide_settings(narrow, 256)
    assert (wide.hidden_size, wide.num_layers, wide.num_heads, wide.num_kv_heads, wide.intermediate_size) == (
        256, 1, 4, 2, 512)
    assert (wide.num_experts, wide.dtype, wide.vocab_size, wide.batch_sizes) == (
        0, "bfloat16", narrow.vocab_size, narrow.batch_sizes)
    assert (wide.num_prompts, wide.max_new_tokens) == (WIDE_PROMPTS, min(narrow.max_new_tokens, WIDE_NEW_TOKENS))
    assert wide_settings(narrow, 0) is None and wide_settings(CheckSettings(hidden_size=256), 256) is None
    with pytest.raises(ValueError, match="--wide-hidden 200: expected a multiple of 128"):
        wide_settings(narrow, 200)


def test_check_verdict_names_the_model_of_a_failing_row():
    row = {"backend": "exact", "dtype": "bfloat16", "tokens": 10, "bitwise_equal": 7, "sampling_batch_invariant": True,
           "hidden_size": 512, "num_layers": 1}
    assert "exact/bfloat16 at hidden 512 x 1 layer (3 of 10 tokens differ)" in check_verdict([row])


def test_check_scores_at_other_thread_counts(tmp_path):
    """Rollout at 1 thread, every rollout rescored at 2 and at 3: still 0 mismatched exact tokens."""
    out = tmp_path / "check.json"
    assert main(["check", "--num-prompts", "6", "--max-new-tokens", "8", "--hidden-size", "64", "--intermediate-size",
                 "160", "--backend", "exact", "--threads", "1", "--scoring-threads", "2,3", "--wide-hidden", "0",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["threads"] == 1 and row["scoring_threads"] == [2, 3]
    assert row["tokens"] == row["bitwise_equal"] == 6 * 8 * 3 * 3 * 2


def test_check_bad_dtype_is_one_clear_error(capsys):
    assert main(["check", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "unsupported dtype 'fp8'" in err and "Traceback" not in err


@pytest.mark.parametrize("backend, message", [
    ("exact,foo", "unknown backend 'foo'"),  # refused after the exact backend's whole check, before
    (",", "no backend given"),  # checked nothing, and passed: "PASS (vacuous)"
])
def test_check_bad_backend_is_one_error_before_any_work(capsys, backend, message):
    assert main(["check", "--backend", backend]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --backend: {message}; expected a comma-separated list of exact, native, triton\n"
    assert captured.out == ""


@pytest.mark.parametrize("argv, message", [
    (["--backend", "exact,native,exact"], "--backend: 'exact' is named twice; name each backend once"),  # ran twice,
    # counted twice in the verdict
    (["--seed", str(2**64)], f"--seed: seed must be an int in [-2**63, 2**64), got {2**64}"),  # 'Overflow when
    # unpacking long long', naming no flag
    (["--seed", str(-2**63 - 1)], "--seed: seed must be an int in [-2**63, 2**64)"),
])
def test_check_flags_refused_before_any_work(capsys, argv, message):
    assert main(["check", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {message}") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""


def _imported(*args: str) -> set[str]:
    """The modules ``python -X importtime -m vexact ARGS`` imports (its import-time lines name each one)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "vexact", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: vexact" in done.stdout
    return {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--help",), ("run", "--help")], ids=["vexact", "run"])
def test_help_imports_only_what_it_prints(args):
    modules = _imported(*args)
    assert {"vexact.cli", "argparse"} <= modules  # the lines were read: a module list, not an empty set
    heavy = sorted(m for m in modules if m.partition(".")[0] in HEAVY or m in HEAVY)
    assert heavy == [], f"vexact {' '.join(args)} imported {heavy}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_lazy_subcommand_parses_and_helps_as_the_full_one(name):
    """``main``'s parser adds a subcommand's arguments on first use; its help and parse are the full parser's."""
    def command(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]

    lazy, full = build_parser(lazy=True), build_parser()
    assert command(lazy).format_help() == command(full).format_help()
    words = {"check": [], "run": ["x.yaml"], "sweep": ["s.yaml"], "report": ["d"], "demo": [],
             "measure": ["--model", "m", "--random-prompts", "2"], "compare": ["a.pt", "b.pt"],
             "locate": ["--random"], "meter": ["m.yaml"], "bench": ["kernels"]}[name]
    lazy_args = vars(build_parser(lazy=True).parse_args([name, *words]))
    full_args = vars(full.parse_args([name, *words]))
    assert lazy_args.keys() == full_args.keys()
    assert {k: v for k, v in lazy_args.items() if k != "func"} == {k: v for k, v in full_args.items() if k != "func"}


def test_measure_and_locate_define_their_shared_prompt_flags_once():
    """--prompts, --max-prompt-len, --token-ids and --threads: the same type and help in both (one helper adds
    them), and --prompts and --token-ids in the vLLM dump too. --max-prompt-len parses to None in all three (a flag
    given where it is moot must be seen), and so does measure's --seed: the default each help names is the one filled
    in later."""
    sub = build_parser()._subparsers._group_actions[0].choices

    def flags(command: str) -> dict[str, argparse.Action]:
        return {a.option_strings[0]: a for a in sub[command]._actions if a.option_strings}

    from vexact.integrations import vllm

    measure, locate = flags("measure"), flags("locate")
    dump = {a.option_strings[0]: a for a in vllm.build_parser()._actions if a.option_strings}  # the vLLM dump
    same = ("type", "help", "metavar", "nargs", "const", "choices")
    for flag in ("--prompts", "--max-prompt-len", "--token-ids", "--threads"):
        assert [getattr(measure[flag], k) for k in same] == [getattr(locate[flag], k) for k in same], flag
        assert isinstance(measure[flag], type(locate[flag])), flag
    for flag in ("--prompts", "--token-ids"):  # its --max-prompt-len names its own default; its --threads its side
        assert [getattr(measure[flag], k) for k in same] == [getattr(dump[flag], k) for k in same], flag
        assert isinstance(measure[flag], type(dump[flag])), flag
    assert dump["--max-prompt-len"].default is None
    assert f"(default: {vllm.DUMP_DEFAULTS['max_prompt_len']})" in dump["--max-prompt-len"].help
    from vexact.real.locate import RUN_DEFAULTS

    assert locate["--max-prompt-len"].default is None  # RUN_DEFAULTS fills it in; the help says which
    assert f"(default: {RUN_DEFAULTS['max_prompt_len']})" in locate["--max-prompt-len"].help
    # measure's: test_measure_flags_take_their_defaults_from_measure_settings


def test_measure_flags_take_their_defaults_from_measure_settings(monkeypatch):
    """One source for ``vexact measure``'s defaults, ``MeasureSettings``: each is moved here to a value no flag types,
    and a parser built then parses to it (--max-new-tokens, --rollout, --train, --temperature) or, for a flag that
    parses to None unless given (--seed, --max-prompt-len, --device: the settings fill it in), names it in its help.
    A default typed in the CLI again fails here."""
    from vexact.real.measure import MeasureSettings

    moved = {"max_new_tokens": 5, "rollout": "hf:fp32", "train": "triton:bf16", "temperature": 0.25, "seed": 1234,
             "max_prompt_len": 3, "device": "cuda:7"}
    for key, value in moved.items():
        assert getattr(MeasureSettings, key) != value, key  # a move, so that the parser can show where it reads
        monkeypatch.setattr(MeasureSettings, key, value)
    measure = build_parser()._subparsers._group_actions[0].choices["measure"]
    parsed = vars(measure.parse_args(["--model", "m", "--random-prompts", "2"]))
    helps = {a.dest: a.help for a in measure._actions}
    for key in ("max_new_tokens", "rollout", "train", "temperature"):
        assert parsed[key] == moved[key], key
    for key in ("rollout", "train"):
        assert f"(default {moved[key]})" in helps[key], key
    for key in ("seed", "max_prompt_len", "device"):
        assert parsed[key] is None, key
        assert f"(default: {moved[key]})" in helps[key], key


def test_measure_and_meter_each_say_what_they_do_and_point_to_the_other():
    """Two names that sound alike, two unrelated jobs (both names are contracts): each one's help names the other."""
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    assert "log-prob mismatch" in COMMANDS["measure"][0] and "not meter" in COMMANDS["measure"][0]
    assert "gradient bias" in COMMANDS["meter"][0] and "not measure" in COMMANDS["meter"][0]
    assert "see vexact meter" in sub["measure"].description and "see vexact measure" in sub["meter"].description


def test_version_has_one_source():
    from setuptools.config.pyprojecttoml import read_configuration

    import vexact
    from vexact.cli import package_version

    root = Path(__file__).resolve().parents[2]
    project = read_configuration(root / "pyproject.toml")["project"]
    assert project["version"] == vexact.__version__ == package_version()
    assert 'dynamic = ["version"]' in (root / "pyproject.toml").read_text()  # no second literal version


def test_check_and_check_paths_share_their_arrangements():
    import inspect

    from vexact.cli import build_parser
    from vexact.real.check import DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES, CheckSettings
    from vexact.testing import check_paths

    kw = {n: p.default for n, p in inspect.signature(check_paths).parameters.items()}
    assert kw["batch_sizes"] == DEFAULT_BATCH_SIZES == CheckSettings().batch_sizes
    assert kw["micro_batch_sizes"] == DEFAULT_MICRO_BATCH_SIZES == CheckSettings().micro_batch_sizes
    args = build_parser().parse_args(["check"])
    assert (args.batch_sizes, args.micro_batch_sizes) == (DEFAULT_BATCH_SIZES, DEFAULT_MICRO_BATCH_SIZES)


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_check_accepts_short_dtype_and_ends_with_a_verdict(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check", "--dtype", "bf16", "--backend", "exact", "--num-prompts", "3", "--max-new-tokens", "4",
                 "--hidden-size", "32", "--intermediate-size", "64", "--batch-sizes", "all,1",
                 "--micro-batch-sizes", "all", "--wide-hidden", "0", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["dtype"] == "bfloat16" and row["bitwise_equal"] == row["tokens"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASS: ") and "exact/bfloat16" in last and f"({row['tokens']} of" in last


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_check_verdict_fails_naming_the_exact_path():
    ok = {"backend": "exact", "dtype": "float32", "tokens": 10, "bitwise_equal": 10, "sampling_batch_invariant": True}
    native = {**ok, "backend": "native", "bitwise_equal": 3}
    assert check_verdict([ok, native]).startswith("PASS: ")  # native makes no promise
    bad = {**ok, "dtype": "bfloat16", "bitwise_equal": 7}
    verdict = check_verdict([ok, bad, native])
    assert verdict.startswith("FAIL: ") and "exact/bfloat16 (3 of 10 tokens differ)" in verdict
    assert "native" not in verdict and "\n" not in verdict
    assert "sampling not batch-invariant" in check_verdict([{**ok, "sampling_batch_invariant": False}])


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"vexact": parser, **{f"vexact {name}": p for name, p in sub.choices.items()}}


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_every_subcommand_and_every_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest: bool(c.help) for c in sub._choices_actions} == dict.fromkeys(sub.choices, True)
    missing = [f"{name} {action.option_strings or action.dest}" for name, p in _subcommands().items()
               for action in p._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not (action.help or "").strip()]
    assert missing == []


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_every_flag_with_a_default_shows_it():
    unshown = []
    for name, p in _subcommands().items():
        formatter = p._get_formatter()
        for action in p._actions:
            default = action.default
            if (not action.option_strings or default is None or isinstance(default, bool) or default == []
                    or default is argparse.SUPPRESS):
                continue
            if "default" not in formatter._get_help_string(action).lower():
                unshown.append(f"{name} {action.option_strings}")
    assert unshown == []
    check_help = _subcommands()["vexact check"].format_help()
    assert "(default: 24)" in check_help and "(default all,1,3" in check_help  # the shared check_paths default


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_defaults_read_as_typed_and_help_says_each_thing_once(monkeypatch):
    """The help nits a newcomer found: a default shown as ``(None, 1, 3)`` in the CLI reference, "finished work is
    kept; finished output is kept", an unwrapped epilogue in ``compare --help``, and ``--only``'s help saying every
    KEY must match where a KEY given twice merges its values."""
    from tools.docs_gen import _default

    commands = _subcommands()
    check = commands["vexact check"]
    sizes = {a.dest: a for a in check._actions if a.dest in ("batch_sizes", "micro_batch_sizes")}
    assert [_default(a) for a in sizes.values()] == ["`all,1,3`", "`all,1,5`"]  # the CLI reference's cells
    assert check.parse_args([]).batch_sizes == (None, 1, 3)  # still parsed by the flag's type
    for name, p in commands.items():
        assert "finished output is kept" not in p.format_help() and p.epilog.count("is kept") == 1, name
    monkeypatch.setenv("COLUMNS", "100")
    text = commands["vexact compare"].format_help()
    epilog = text[text.index("exit codes:"):]
    assert len(epilog.splitlines()) > 1 and max(map(len, epilog.splitlines())) <= 100
    assert "  vexact compare dump.jsonl                    one file holding both sides" in text  # laid out by hand
    only = next(a for a in commands["vexact sweep"]._actions if a.dest == "only")
    assert "every KEY must match" not in only.help and "a KEY given twice keeps the values of both" in only.help


@pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vexact {importlib.metadata.version('vexact')}"


def test_check_generates_at_one_thread_by_default_and_its_probes_still_cover_the_machines_threads():
    from vexact.cli import build_parser
    from vexact_kernels.host_guard import MACHINE_THREADS

    assert build_parser().parse_args(["check"]).threads == 1
    settings = CheckSettings(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, num_prompts=2, max_prompt_len=4, max_new_tokens=3, threads=1)
    seen = []

    class Recorder:
        def running(self, text: str) -> None:
            seen.append(text)

        def advance(self, said: str | None = None, always: bool = False) -> None:
            seen.append("done")

    before = torch.get_num_threads()
    try:
        (row,) = run_check(settings, ("exact",), progress=Recorder())
    finally:
        torch.set_num_threads(before)
    assert seen.count("done") == check_units(settings) == 3 + 9
    assert seen[0] == "exact/fp32: generating all at once"
    assert row["threads"] == 1
    # Every probe that passed (so its faster path is in use) was checked at the machine's thread count too. The
    # report lists every class this process probed, also those earlier tests probed at another count and the check
    # never used, so "checked at 1 thread" holds only for the classes probed first here.
    # A class that calls the library with 1 thread by construction (bf16 weight gradients: "one-thread") is probed at
    # 1 thread only: no other count ever runs it.
    passed = [p for p in row["kernel_paths"]["probes"] if p["passed"] and not p["shape_class"].endswith("one-thread")]
    assert all(MACHINE_THREADS in p["threads_checked"] for p in passed)  # (fixed-order mode probes nothing)


@pytest.mark.parametrize("flag", ["--num-experts-per-tok", "--moe-intermediate-size"])
def test_check_expert_flags_without_experts_are_one_error_before_the_check(flag, capsys, monkeypatch):
    def no_check(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr("vexact.real.check.run_check", no_check)
    line = _cli_error(capsys, monkeypatch, "check", flag, "2")
    assert f"{flag} sets the mixture of experts, but the model has none: give --num-experts" in line


def test_check_json_to_an_unwritable_path_fails_before_the_check(tmp_path, capsys, monkeypatch):
    def no_check(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr("vexact.real.check.run_check", no_check)
    (tmp_path / "a_file").write_text("")
    line = _cli_error(capsys, monkeypatch, "check", "--json", str(tmp_path / "a_file" / "check.json"))
    assert f"--json: cannot write {tmp_path / 'a_file' / 'check.json'}" in line


def test_the_memory_error_of_an_expert_count_names_num_experts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(model_module, "available_memory", lambda: 16 << 30)  # a laptop's 16 GiB, on any machine
    line = _cli_error(capsys, monkeypatch, "run", str(_write_config(tmp_path, "moe")), "--set",
                      "model.num_experts=100000")
    assert "model.num_experts=100,000" in line and "model.hidden_size=64" in line
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("args", [["--prompts", "P", "--max-prompt-len", "4"], ["--random-prompts", "2", "--token-ids"],
                                  ["--prompts", "P", "--temperature", "0", "--seed", "0"]])
def test_measure_the_vllm_dump_and_locate_name_the_prompt_source_alike(tmp_path, capsys, args):
    """Where the prompts come from (``vexact.cli_base.prompt_source``) reads the same in the three commands that take
    ``--prompts``/``--random-prompts``: a moot prompt flag gets one message, byte for byte (locate's --seed message
    also names the checkpoint, which brings the weights)."""
    from vexact.integrations import vllm

    (tmp_path / "ids.txt").write_text("5 6 7\n")
    args = [str(tmp_path / "ids.txt") if a == "P" else a for a in args]
    model = ["--model", str(tmp_path)]
    errors = []
    for command, argv in ((main, ["measure", *model, *args]), (vllm.main, [*model, "--out", str(tmp_path), *args]),
                          (main, ["locate", *model, *args])):
        assert command(argv) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0].startswith("error: --") and errors[0].count("\n") == 1
    locate = errors[2].replace(f"--model {tmp_path} brings the weights, ", "")
    assert errors[0] == errors[1] == locate


@pytest.mark.slow
@pytest.mark.parametrize("rank_env,handled", [({}, True), ({"TORCHELASTIC_RUN_ID": "r"}, False),
                                              ({"LOCAL_RANK": "0"}, False)], ids=["own", "torchrun", "local-rank"])
def test_the_cli_takes_sigterm_as_ctrl_c_for_its_process_life_except_in_a_launched_rank(tmp_path, rank_env, handled):
    """``vexact`` as the program (argv from the command line) takes SIGTERM as Ctrl-C for the process's life; a rank
    that torchrun (or ``vexact run --nproc``) started keeps SIGTERM's default: its agent sends SIGTERM to the
    surviving ranks when one fails, and a failure must not be recorded as "interrupted"."""
    import os

    script = ("import signal, sys\nfrom vexact.cli import main\n"
              f"sys.argv = ['vexact', 'report', {str(tmp_path / 'none')!r}]\n"
              "code = main()\n"
              "print(code, signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, **rank_env})
    assert done.stdout.split() == ["2", str(handled)], done.stdout + done.stderr[-2000:]


def test_main_called_with_its_arguments_leaves_the_callers_sigterm_alone(tmp_path, capsys):
    """A caller that passes argv (a test, a script) keeps its own SIGTERM handling: only the program installs one."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert main(["report", str(tmp_path / "none")]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_help_never_breaks_a_flag_or_word_at_its_hyphen(capsys, monkeypatch):
    """argparse wraps --help with textwrap's default, which breaks at hyphens: "--allow-" / "change", "re-" /
    "running" (the exit codes' epilog of vexact sweep read "re- running" once it grew by a few words)."""
    import re

    for columns in ("60", "100"):
        monkeypatch.setenv("COLUMNS", columns)
        for name in COMMANDS:
            with pytest.raises(SystemExit):
                main([name, "--help"])
            broken = [line for line in capsys.readouterr().out.splitlines() if re.search(r"\w-$", line)]
            assert broken == [], (name, columns, broken)


@pytest.mark.parametrize("env, argv", [({"VEXACT_CPU_EXACT_PATH": "bogus"}, ["check", "--help"]),
                                       ({"VEXACT_CPU_EXACT_PATH": "bogus"}, ["check", "--preset", "tiny"]),
                                       ({"VEXACT_CPU_ONEDNN": "x"}, ["measure", "--help"])])
def test_a_bad_kernel_setting_is_one_error_line_and_exit_2(env, argv):
    """The kernels read their VEXACT_* settings when the command's module is imported, which parsing does: that was
    outside main's error handling (a traceback, and exit 1, a mismatch's code, even for --help)."""
    done = subprocess.run([sys.executable, "-m", "vexact", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    name, value = next(iter(env.items()))
    assert done.stderr.startswith(f"error: {name}={value!r}: expected one of "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
