"""vexact.reports.run_report: `vexact report RUN_DIR` on a tiny real run and on hand-built run directories."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from conftest import num_threads, warm_start_cache
from rich.console import Console
from test_sweep_faults import _cli_error

from vexact.cli import main
from vexact.records.runlog import read_metrics
from vexact.reports.run_report import (
    CHI2_NOTE,
    _summary_columns,
    read_run,
    run_figure,
    run_summary,
    write_any_report,
    write_run_report,
)
from vexact.reports.sweep_table import reward_summary
from vexact.rl.collapse import detect_collapse
from vexact.rl.config import load_config
from vexact.rl.config_schema import CollapseSection
from vexact.rl.trainer import Trainer
from vexact.sweeps.sweep_data import read_point

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "zero_mismatch.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PANEL_TITLES = ["reward", "realised mismatch: k3 KL, rollout vs training log-probs", "policy entropy",
                "mean response length (tokens)", "learning rate", "grad norm"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps under injected mismatch; k3_kl_max makes it 'collapse' at step 0 and a mismatch-triggered LR
    schedule fires at step 1, so the run has markers to draw."""
    root = tmp_path_factory.mktemp("run")
    cfg = load_config(EXPERIMENT, [
        f"output_dir={root / 'tiny'}", f"warm_start.cache_dir={warm_start_cache(root)}", "warm_start.steps=30",
        "steps=6",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "task.eval_prompts=16",
        "logging.eval_every=3", "logging.checkpoint_every=2", "logging.live=false",
        "inject.mode=logit_scale", "inject.epsilon=-0.3", "collapse.k3_kl_max=1e-3",
        "lr_schedule.kind=mismatch_triggered", "lr_schedule.mismatch_threshold=1e-3",
        "lr_schedule.mismatch_window=2", "lr_schedule.decay_period=2", "optimizer.warmup_steps=0"])
    with num_threads(1):  # tiny model: a second thread only adds OpenMP waits on a busy machine
        summary = Trainer(cfg, console=Console(quiet=True)).run()
    assert summary["status"] == "completed"
    return root / "tiny"


def test_report_of_a_tiny_real_run(tiny_run: Path) -> None:
    console = Console(file=io.StringIO(), width=80, record=True)
    result = write_any_report(tiny_run, console)
    assert result["kind"] == "run"
    out = tiny_run / "report"
    assert {p.name for p in result["files"]} == {"run_curves.png", "report.json"}
    assert (out / "run_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "run_curves.png").stat().st_size > 20_000

    saved = json.loads((out / "report.json").read_text())
    summary = json.loads((tiny_run / "summary.json").read_text())
    rows = read_metrics(tiny_run / "metrics.jsonl")
    assert saved["status"] == "completed" and saved["steps_completed"] == 6 == saved["steps_planned"]
    assert saved["collapse_source"] == "summary.json"
    assert saved["collapse"]["collapsed"] is True and saved["collapse"]["collapse_step"] == 0
    assert saved["collapse"]["collapse_reason"] == "k3_kl"
    assert saved["collapse"] == {k: summary["collapse"][k] for k in saved["collapse"]}  # the trainer's verdict
    assert saved["lr_schedule"] == {"kind": "mismatch_triggered", "trigger_step": 1}
    k3 = [r["rollout_corr/k3_kl"] for r in rows]
    assert saved["series"]["rollout_corr/k3_kl"]["mean"] == pytest.approx(sum(k3) / len(k3))
    assert saved["series"]["actor/lr"]["first"] > saved["series"]["actor/lr"]["last"]  # the decay shows
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    assert saved["reward"]["points"] == len(evals) == 3  # steps 0, 3 and the last
    same = reward_summary(read_point(tiny_run, "tiny"))  # one reader, one definition: as in a sweep table
    assert saved["reward"]["peak"] == same["peak"] and saved["reward"]["final"] == same["final"]
    assert saved["reward"]["final"] == pytest.approx(sum(evals) / 3)

    text = console.export_text()
    assert text.count("report written to") == 1
    values = _summary_columns(saved)[1].cells
    assert "yes, at step 0 (k3_kl)" in values and "mismatch_triggered, decay triggered at step 1" in values
    # a k3_kl collapse is no reward fall: no failure kind (it was read as one from the eval rows)
    assert saved["failure"] is None and "— (a k3_kl collapse, not a reward drop)" in values
    for word in (w for cell in values for w in cell.split()):
        assert word in text, word  # at 80 columns a value wraps at spaces, never inside a number
    assert f"{saved['series']['rollout_corr/chi2_token']['mean']:.3g}" in text and "E[ρ²] − 1" in text
    assert max(len(line) for line in text.splitlines() if "report written to" not in line) <= 80


def test_run_figure_has_every_panel_and_marker(tiny_run: Path) -> None:
    import matplotlib.pyplot as plt

    run = read_run(tiny_run)
    fig = run_figure(run, run_summary(run))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == PANEL_TITLES
    rows = read_metrics(tiny_run / "metrics.jsonl")
    for ax in axes:  # collapse (step 0) and LR trigger (step 1) on every panel
        vertical = {line.get_xdata()[0] for line in ax.get_lines() if len(set(line.get_xdata())) == 1
                    and len(line.get_xdata()) == 2}
        assert {0, 1} <= vertical, ax.get_title()
    k3_ax = axes[1]
    assert k3_ax.get_yscale() == "log"
    k3_line = next(line for line in k3_ax.get_lines() if line.get_label() == "k3 KL")
    assert list(k3_line.get_ydata()) == [r["rollout_corr/k3_kl"] for r in rows]
    lr_line = next(line for line in axes[4].get_lines() if line.get_label() == "learning rate")
    assert list(lr_line.get_ydata()) == [r["actor/lr"] for r in rows]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "collapse (step 0)" in labels and "LR decay triggered (step 1)" in labels
    plt.close(fig)


def test_cli_report_on_a_run_dir(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tiny_run)]) == 0
    out = capsys.readouterr().out
    assert out.count("report written to") == 1 and "not a sweep directory" not in out


def _hand_built_run(root: Path, with_summary: bool = True) -> Path:
    """40 steps: the evaluation reward drops at step 25 (the smoothed series crosses half its peak at 30, the
    collapse step), the response length surges at 17 (trailing mean of 10), the LR decay fires at 20, and
    chi2_token dips slightly negative (the estimator's noise at near-zero mismatch)."""
    root.mkdir(parents=True)
    rows = []
    for step in range(40):
        row = {"step": step, "reward/mean": 0.3, "rollout_corr/k3_kl": 1e-4 * (1 + step / 40),
               "rollout_corr/chi2_token": -0.003 if step == 5 else 1e-4, "actor/entropy": 0.5 - step / 100,
               "response_length/mean": 10.0 if step < 15 else 30.0, "actor/lr": 1e-4 if step <= 20 else 5e-5,
               "actor/grad_norm": 1.0, "lr_schedule/triggered": float(step >= 20)}
        if step % 5 == 0 or step == 39:
            row["eval/reward_mean"] = 0.6 if step < 25 else 0.05
        rows.append(row)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "config.yaml").write_text("name: hand\nsteps: 40\n")
    if with_summary:
        collapse = detect_collapse(rows, CollapseSection(patience=5))
        (root / "summary.json").write_text(json.dumps({
            "name": "hand", "status": "completed", "reason": None, "steps_completed": 40, "steps_planned": 40,
            "collapse": collapse, "lr_schedule": {"kind": "length_triggered", "trigger_step": 20}}))
    return root


def test_hand_built_run_markers_and_negative_chi2(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    run_dir = _hand_built_run(tmp_path / "hand")
    console = Console(file=io.StringIO(), width=100, record=True)
    s = write_run_report(run_dir, console)["summary"]
    c = s["collapse"]
    assert c["collapsed"] and c["collapse_step"] == 30 and c["length_surge_step"] == 17
    assert c["length_surge_lead"] == 13 and s["lr_schedule"]["trigger_step"] == 20
    assert s["series"]["rollout_corr/chi2_token"]["min"] == -0.003
    fig = run_figure(read_run(run_dir), s)
    for ax in fig.axes:
        vertical = {line.get_xdata()[0] for line in ax.get_lines() if len(line.get_xdata()) == 2
                    and len(set(line.get_xdata())) == 1}
        assert {30, 17, 20} <= vertical, ax.get_title()
    plt.close(fig)
    text = console.export_text()
    assert "(min -0.003)" in text and "† " + CHI2_NOTE.split(" (")[0] in text  # the footnote explains it
    assert "17 (13 steps before the collapse)" in text
    assert math.isclose(s["reward"]["peak"], 0.6) and s["reward"]["final"] <= s["reward"]["peak"]


def test_run_without_summary_is_judged_from_its_metrics(tmp_path: Path) -> None:
    """A killed run has no summary.json: the verdict comes from detect_collapse with config.yaml's settings."""
    run_dir = _hand_built_run(tmp_path / "killed", with_summary=False)
    (run_dir / "config.yaml").write_text("name: killed\nsteps: 40\ncollapse:\n  patience: 5\n")
    s = write_run_report(run_dir, Console(file=io.StringIO()))["summary"]
    assert s["status"] == "no summary.json" and s["collapse_source"].startswith("recomputed")
    assert s["collapse"]["collapsed"] and s["collapse"]["collapse_step"] == 30
    assert s["lr_schedule"]["trigger_step"] == 20  # from the logged lr_schedule/triggered
    (run_dir / "config.yaml").write_text("name: killed\nsteps: 40\n")  # default patience 20: not confirmed yet
    s = write_run_report(run_dir, Console(file=io.StringIO()))["summary"]
    assert not s["collapse"]["collapsed"] and s["collapse"]["collapse_unconfirmed_step"] == 30


def test_unreadable_config_is_noted_not_fatal(tmp_path: Path) -> None:
    run_dir = _hand_built_run(tmp_path / "bad")
    (run_dir / "config.yaml").write_text("steps: [not, a, number]\n")
    s = write_run_report(run_dir, Console(file=io.StringIO()))["summary"]
    assert any(n.startswith("config.yaml not used") for n in s["notes"]) and s["collapse"]["collapsed"]


def test_report_on_a_finished_run_whose_log_is_empty_says_it_has_no_steps(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": 4,
                                                      "steps_planned": 4}))
    line = _cli_error(capsys, monkeypatch, "report", str(run_dir))
    assert "metrics.jsonl holds no steps, but summary.json says 4 were completed" in line


def test_report_on_a_finished_run_whose_last_line_is_torn_names_the_damage(tmp_path, capsys, monkeypatch):
    """A completed run's log is final (its summary comes after the log is closed), so a torn last line there is
    damage, not a step being written: the report left the step out without a word. Now it names the file and line;
    --skip-damaged reports the rest. A log with more rows than the summary (an extension under way) is no damage."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    rows = [json.dumps({"step": i, "actor/reward_mean": 0.5}) + "\n" for i in range(4)]
    (run_dir / "metrics.jsonl").write_text("".join(rows)[:-5])  # the last line cut short, by hand
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps_completed": 4,
                                                      "steps_planned": 4}))
    line = _cli_error(capsys, monkeypatch, "report", str(run_dir))
    assert ("metrics.jsonl:4: a torn last line (no newline), 3 steps logged, but summary.json says the run finished "
            "after 4") in line
    assert main(["report", str(run_dir), "--skip-damaged"]) == 0
    (run_dir / "metrics.jsonl").write_text("".join(rows) + rows[0].replace('"step": 0', '"step": 4')[:-5])
    assert read_point(run_dir, name="").damage == []


def _rewrite_metric(run_dir: Path, key: str, value: object, steps: range | None = None) -> None:
    """Set ``key`` to ``value`` (as runlog writes it: "nan", "inf") in the rows of ``steps`` (all when None)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    for row in rows:
        if steps is None or row["step"] in steps:
            row[key] = value
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _panel_texts(run_dir: Path, title: str) -> list[str]:
    import matplotlib.pyplot as plt

    run = read_run(run_dir)
    fig = run_figure(run, run_summary(run))
    texts = [t.get_text() for ax in fig.axes if ax.get_title() == title for t in ax.texts]
    plt.close(fig)
    return texts


def test_the_k3_panel_says_exact_only_for_a_k3_logged_finite_and_zero(tmp_path: Path) -> None:
    title = PANEL_TITLES[1]
    run_dir = _hand_built_run(tmp_path / "inf")
    _rewrite_metric(run_dir, "rollout_corr/k3_kl", "inf")
    assert _panel_texts(run_dir, title) == ["k3 KL non-finite at 40 of 40 steps"]  # it said "= 0 ... (exact)"
    _rewrite_metric(run_dir, "rollout_corr/k3_kl", 0.0)
    _rewrite_metric(run_dir, "rollout_corr/k3_kl", "nan", range(3))
    assert _panel_texts(run_dir, title) == ["k3 KL non-finite at 3 of 40 steps"]
    _rewrite_metric(run_dir, "rollout_corr/k3_kl", 0.0)
    assert _panel_texts(run_dir, title) == ["k3 KL = 0 at every step (exact)"]


def test_series_count_nan_and_keep_metrics_with_no_finite_value(tmp_path: Path) -> None:
    """report.json's series: steps and non_finite from the raw rows (NaN counted), a metric whose every value is
    NaN/Inf kept with null first/last/mean/min/max; the table says how many steps were not finite."""
    run_dir = _hand_built_run(tmp_path / "nan")
    _rewrite_metric(run_dir, "actor/grad_norm", "nan", range(30, 40))
    _rewrite_metric(run_dir, "actor/grad_norm", "inf", range(38, 40))
    _rewrite_metric(run_dir, "rollout_corr/k3_kl", "nan")
    console = Console(file=io.StringIO(), width=200, record=True)
    series = write_run_report(run_dir, console)["summary"]["series"]
    assert series["actor/grad_norm"] == {"steps": 40, "non_finite": 10, "first": 1.0, "last": 1.0, "mean": 1.0,
                                         "min": 1.0, "max": 1.0}
    assert series["rollout_corr/k3_kl"] == {"steps": 40, "non_finite": 40, "first": None, "last": None,
                                            "mean": None, "min": None, "max": None}
    saved = json.loads((run_dir / "report" / "report.json").read_text())
    assert saved["series"]["rollout_corr/k3_kl"]["non_finite"] == 40
    assert "1 → 1 (min 1, max 1; non-finite at 10 of 40 steps)" in console.export_text()


def test_skipped_damaged_summary_says_so_not_pending(tmp_path: Path) -> None:
    """--skip-damaged on a finished run whose summary.json is empty: its status is unknown, not "pending", and it
    is not said to be running or killed."""
    run_dir = _hand_built_run(tmp_path / "empty")
    (run_dir / "summary.json").write_text("")
    s = write_run_report(run_dir, Console(file=io.StringIO()), skip_damaged=True)["summary"]
    assert s["status"] == "summary.json damaged"
    assert s["collapse_source"] == "recomputed from metrics.jsonl (summary.json damaged)"
    assert any(n.startswith("left out, damaged (--skip-damaged): summary.json") for n in s["notes"])


@pytest.mark.parametrize(("edit", "field"), [
    (lambda s: s.update(collapse="yes"), "field 'collapse' is 'yes', expected a mapping or null"),
    (lambda s: s.update(lr_schedule=[1]), "field 'lr_schedule' is [1], expected a mapping or null"),
    (lambda s: s["collapse"].update(criteria="x"), "field 'collapse.criteria' is 'x', expected a mapping or null"),
    (lambda s: s["collapse"]["criteria"].update(smoothing="inf"),
     "field 'collapse.criteria.smoothing' is inf, expected a whole number >= 1 or null"),
    (lambda s: s["lr_schedule"].update(trigger_step="abc"),
     "field 'lr_schedule.trigger_step' is 'abc', expected a step number or null"),
    (lambda s: s["collapse"].update(collapse_step="five"),
     "field 'collapse.collapse_step' is 'five', expected a number or null"),
])
def test_a_hand_edited_summary_field_is_one_error_naming_file_and_field(tmp_path, capsys, monkeypatch, edit,
                                                                         field) -> None:
    run_dir = _hand_built_run(tmp_path / "edited")
    summary = json.loads((run_dir / "summary.json").read_text())
    edit(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    line = _cli_error(capsys, monkeypatch, "report", str(run_dir))
    assert f"summary.json: not a readable run summary ({field})" in line
    assert main(["report", "--skip-damaged", str(run_dir)]) == 0  # what is readable: the metrics
    assert json.loads((run_dir / "report" / "report.json").read_text())["status"] == "summary.json damaged"


def test_names_and_reasons_are_printed_as_text_not_markup(tmp_path: Path) -> None:
    """A run named exp[v2] was shown as "run exp"; a reason with "[/user]" ended the report with a MarkupError."""
    run_dir = _hand_built_run(tmp_path / "marked")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(name="exp[v2]", status="stopped", reason="stopped by [/user] request [batch, seq, hidden]")
    (run_dir / "summary.json").write_text(json.dumps(summary))
    console = Console(file=io.StringIO(), width=200, record=True)
    write_run_report(run_dir, console)
    text = console.export_text()
    assert "run exp[v2]" in text and "stopped: stopped by [/user] request [batch, seq, hidden]" in text
