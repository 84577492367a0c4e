"""One mismatch-metric prefix family: vexact's own mismatch metrics live under ``mismatch/``, verl's prefixes
(``rollout_corr/``, ``training/``) hold verl's names only. The keys that moved (``metric_keys.RENAMED_METRICS``)
read under their new names from old files, and the logged stream carries the old name too for a deprecation
period."""

from __future__ import annotations

import json

import pytest
import torch

from vexact import metric_keys
from vexact.metric_keys import K3_KL, LAG_K3_KL, LOG_PPL_ABS_DIFF_SUM, RENAMED_METRICS, TIM_K3_KL
from vexact.records.runlog import MetricsWriter, read_metrics
from vexact.rl.config import config_from_dict

VERL_ONLY = ("rollout_corr", "training")  # the verl prefixes of the mismatch metrics


def test_verl_prefixes_hold_verl_keys_only_and_mismatch_holds_vexacts():
    assert [k.name for k in metric_keys.KEYS if k.group in VERL_ONLY and not k.verl] == []
    assert [k.name for k in metric_keys.KEYS if k.group == "mismatch" and k.verl] == []
    assert {LAG_K3_KL, TIM_K3_KL, LOG_PPL_ABS_DIFF_SUM} == set(RENAMED_METRICS.values())
    for old, new in RENAMED_METRICS.items():
        assert metric_keys.find(new).name == new and not metric_keys.find(new).verl
        assert metric_keys.find(old) is None  # the old name is no registered key: nothing writes it as a metric
        assert old.split("/", 1) == ["rollout_corr", new.split("/", 1)[1]] and new.startswith("mismatch/")


def _raw_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_old_metrics_file_reads_under_the_new_names(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = [{"step": 0, "rollout_corr/lag_k3_kl": 0.25, "rollout_corr/tim_k3_kl": 0.0, K3_KL: 0.25,
            "rollout_corr/log_ppl_abs_diff_sum": "nan"},
           {"step": 1, "rollout_corr/lag_k3_kl": 1e-300, "rollout_corr/tim_k3_kl": 3.0, K3_KL: 3.5,
            "rollout_corr/log_ppl_abs_diff_sum": 0.1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    rows = read_metrics(path)
    assert [sorted(r) for r in rows] == [sorted(["step", LAG_K3_KL, TIM_K3_KL, K3_KL, LOG_PPL_ABS_DIFF_SUM])] * 2
    assert rows[1] == {"step": 1, LAG_K3_KL: 1e-300, TIM_K3_KL: 3.0, K3_KL: 3.5, LOG_PPL_ABS_DIFF_SUM: 0.1}
    assert rows[0][LAG_K3_KL] == 0.25 and rows[0][TIM_K3_KL] == 0.0 and rows[0][LOG_PPL_ABS_DIFF_SUM] != 0.0  # nan


def test_the_writer_writes_both_names_and_readers_see_the_new_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    seen: list[tuple[int, dict]] = []
    replayed: list[list[dict]] = []

    class View:
        def write(self, step: int, values: dict[str, float]) -> None:
            seen.append((step, values))

        def close(self) -> None:
            pass

    def views(rows: list[dict]) -> list[View]:
        replayed.append(rows)
        return [View()]

    row = {"step": 0, LAG_K3_KL: 0.125, TIM_K3_KL: 0.5, K3_KL: 0.625, LOG_PPL_ABS_DIFF_SUM: 2.0}
    writer = MetricsWriter(path, live_views=views)
    writer.write(row)
    writer.write({**row, "step": 1})
    writer.close()
    assert row == {"step": 0, LAG_K3_KL: 0.125, TIM_K3_KL: 0.5, K3_KL: 0.625, LOG_PPL_ABS_DIFF_SUM: 2.0}  # untouched
    raw = _raw_rows(path)[0]
    assert {old: raw[old] for old in RENAMED_METRICS} == {old: row[new] for old, new in RENAMED_METRICS.items()}
    assert {new: raw[new] for new in RENAMED_METRICS.values()} == {new: row[new] for new in RENAMED_METRICS.values()}
    assert seen[0] == (0, {k: float(v) for k, v in raw.items() if k != "step"})  # the live views: both names
    assert read_metrics(path) == [row, {**row, "step": 1}]  # readers: the new names only
    # A resume keeps the lines as written and replays them into the views as written: both names.
    MetricsWriter(path, keep_steps_below=1, live_views=views).close()
    assert _raw_rows(path) == [raw] and replayed[-1] == [{k: float(v) if k != "step" else v for k, v in raw.items()}]


def test_a_row_without_renamed_keys_is_written_as_given(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 0, K3_KL: 0.5})
    writer.close()
    assert _raw_rows(path) == [{"step": 0, K3_KL: 0.5}]


def test_live_monitor_rows_carry_the_new_names_and_its_log_both(tmp_path):
    from vexact.live import LiveMonitor

    roll = torch.tensor([[-0.5, -1.0, -2.0]])
    behaviour = torch.tensor([[-0.5, -1.25, -2.0]])
    current = torch.tensor([[-0.75, -1.25, -1.5]])
    with LiveMonitor(tmp_path / "live") as monitor:
        rows = [monitor.step(s, roll, current, behaviour_logprobs=behaviour) for s in range(2)]
    for row in rows:
        assert LAG_K3_KL in row and TIM_K3_KL in row and LOG_PPL_ABS_DIFF_SUM in row
        assert not set(RENAMED_METRICS) & set(row)
    path = tmp_path / "live" / "metrics.jsonl"
    raw = _raw_rows(path)
    assert [r["rollout_corr/lag_k3_kl"] for r in raw] == [r[LAG_K3_KL] for r in raw] == [r[LAG_K3_KL] for r in rows]
    assert [r["rollout_corr/tim_k3_kl"] for r in raw] == [r[TIM_K3_KL] for r in rows]
    # resuming at step 1 rewrites the kept rows: as they were written, both names
    with LiveMonitor(tmp_path / "live", resume=True) as monitor:
        monitor.step(1, roll, current, behaviour_logprobs=behaviour)
    assert _raw_rows(path) == raw
    assert [r[LAG_K3_KL] for r in read_metrics(path)] == [r[LAG_K3_KL] for r in rows]


@pytest.mark.parametrize("old, new", list(RENAMED_METRICS.items()))
def test_collapse_metric_given_an_old_name_warns_and_stores_the_new(old, new):
    with pytest.warns(FutureWarning, match=f"'{new}'"):
        cfg = config_from_dict({"collapse": {"metric": old}})
    assert cfg.collapse.metric == new and cfg == config_from_dict({"collapse": {"metric": new}})


def test_the_reference_page_lists_each_deprecated_name_with_its_key_now():
    from tools.docs_gen import metrics_markdown

    page = metrics_markdown()
    assert [old for old, new in RENAMED_METRICS.items() if f"| `{old}` | `{new}` |" not in page] == []
