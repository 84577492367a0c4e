"""The generated reference pages and the metric-key registry cannot drift from the code.

* every CLI flag (read back from each command's ``--help``), every config key (read back from a default config's
  ``to_dict`` and from the schema) and every registered metric key is on its generated page;
* a tiny run (plain; corrected + injected + KL + triggered LR; verl's IS/RS in decoupled mode; IcePop with batch
  normalisation), ``vexact measure``, ``vexact compare`` and ``vexact.live.LiveMonitor`` write only registered keys,
  and every key the registry says a run (or only the live monitor) writes is written by one of them;
* the strict docs build (the real ``mkdocs.yml`` validation settings) fails on a broken link and a broken anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import warm_start_cache
from rich.console import Console
from safetensors.torch import save_file

from tools import docs_gen
from vexact import metric_keys
from vexact.cli import build_parser, main
from vexact.records.runlog import read_metrics
from vexact.rl.config import config_from_dict, load_config
from vexact.rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "zero_mismatch.yaml"
DOCS_PIP = "pip install -e '.[docs]'"


# --------------------------------------------------------------------------- the generated pages


def _help_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags a parser's usage line shows: an independent read of what the generator walks."""
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage()))


def _missing_flags(page: str) -> list[str]:
    missing = []
    for path, parser, _ in docs_gen._parsers():
        section = page.split(f"## `{path}`\n", 1)
        if len(section) < 2:
            missing.append(path)
            continue
        body = section[1].split("\n## ", 1)[0]
        missing += [f"{path} {flag}" for flag in sorted(_help_flags(parser) - {"-h", "--help"})
                    if f"`{flag}`" not in body]
    return missing


@pytest.mark.slow
def test_cli_reference_lists_every_command_and_flag():
    page = docs_gen.cli_markdown()
    assert _missing_flags(page) == []
    commands = {p for p in docs_gen.cli_flags() if p.count(" ") == 1}
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert commands == {f"vexact {name}" for name in subparsers.choices}
    assert "`--nproc`" in page and "`--fail-on-mismatch`" in page and "## `vexact bench kernels`" in page


@pytest.mark.slow
def test_cli_check_fails_on_a_page_missing_a_flag():
    page = docs_gen.cli_markdown()
    doctored = page.replace("`--nproc`", "`--nprocs`")
    assert _missing_flags(doctored) == ["vexact run --nproc"]


def _dotted(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        out.append(prefix + key)
        if isinstance(value, dict) and key not in ("rope_scaling",):
            out += _dotted(value, f"{prefix}{key}.")
    return out


def test_config_reference_lists_every_key():
    page = docs_gen.config_markdown()
    from_schema = docs_gen.config_keys()
    from_a_config = _dotted(config_from_dict({}).to_dict())  # independent of the generator's walk
    assert set(from_a_config) <= set(from_schema)
    assert {"inject.target.metric", "inject.target.value", "distributed.leaves"} <= set(from_schema)
    assert [k for k in from_schema if f"| `{k}` |" not in page] == []
    assert [k for k in docs_gen._DESCRIPTIONS if k not in from_schema] == []  # no description of a removed key


def test_metric_reference_lists_every_registered_key():
    page = docs_gen.metrics_markdown()
    assert [k.name for k in metric_keys.KEYS if f"| `{k.name}` |" not in page] == []


def test_the_registry_is_well_formed():
    names = [k.name for k in metric_keys.KEYS]
    assert len(names) == len(set(names))
    for key in metric_keys.KEYS:
        assert key.definition and key.unit and key.writers, key.name
        assert set(key.writers) <= set(metric_keys.WRITERS), key.name
        assert key.group in metric_keys.GROUPS, key.name
        assert (ROOT / "vexact" / key.source).is_file(), key.source
    assert metric_keys.find("mismatch/tokens_bucket/0.1-0.5").name == "mismatch/tokens_bucket/<lo>-<hi>"
    assert metric_keys.find("rollout_corr/rollout_rs_seq_mean_k3_seq_max").name == \
        "rollout_corr/rollout_rs_<option>_seq_max"
    assert metric_keys.unregistered(["step", "rollout_corr/k3_kl", "rollout_corr/k3", "mismatch/typo"]) == \
        ["mismatch/typo", "rollout_corr/k3"]
    assert metric_keys.find("rollout_corr/rollout_rs_token_k9_mean") is None  # not an option


def test_generated_markers_expand_and_unknown_ones_are_refused():
    text = docs_gen.expand("# x\n\n<!-- vexact-docs: metrics -->\n\ntext after\n")  # a bare marker is filled
    body = docs_gen.metrics_markdown().strip()
    region = f"<!-- vexact-docs: metrics -->\n\n{body}\n\n<!-- end vexact-docs: metrics -->"
    assert text == f"# x\n\n{region}\n\ntext after\n"
    assert docs_gen.expand(text) == text  # a current region stays as it is
    stale = text.replace("`rollout_corr/k3_kl`", "`rollout_corr/old_name`")
    assert docs_gen.expand(stale) == text  # a stale one is rewritten, and only it
    with pytest.raises(ValueError, match="unknown generated page 'nope'"):
        docs_gen.expand("<!-- vexact-docs: nope -->")


@pytest.mark.slow
def test_the_committed_reference_pages_hold_what_the_generators_give_now():
    """The generated pages are committed (readable on a code host, not only on the built site) and current: a flag,
    key or metric changed without ``python -m tools.docs_gen --update`` fails here. A fresh process, so that no
    mode or task registered by another test shows up in the tables."""
    pages = {p.relative_to(ROOT).as_posix() for p in docs_gen.pages_with_regions()}
    assert {"docs/reference/cli.md", "docs/reference/config.md", "docs/reference/metrics.md"} <= pages
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert "## `vexact run`" in cli and "`--nproc`" in cli and "<!-- end vexact-docs: cli -->" in cli
    assert str(ROOT) not in cli  # a default path inside the repository is written relative to it
    done = subprocess.run([sys.executable, "-m", "tools.docs_gen", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_check_finds_a_stale_page_and_update_rewrites_it(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "reference").mkdir(parents=True)
    page = docs / "reference" / "metrics.md"
    page.write_text("# Metric keys\n\nby hand\n\n<!-- vexact-docs: metrics -->\n\nold table\n\n"
                    "<!-- end vexact-docs: metrics -->\n\nby hand too\n")
    (docs / "other.md").write_text("# no region\n")
    assert docs_gen.main(["--check", str(docs)]) == 1
    assert f"{page}: a generated region differs" in capsys.readouterr().err
    assert docs_gen.main(["--update", str(docs)]) == 0
    text = page.read_text()
    assert "old table" not in text and "`rollout_corr/k3_kl`" in text
    assert text.startswith("# Metric keys\n\nby hand\n\n") and text.endswith("\n\nby hand too\n")
    assert docs_gen.main(["--check", str(docs)]) == 0
    assert docs_gen.main(["--check", str(tmp_path / "none")]) == 2


# --------------------------------------------------------------------------- keys written by run / measure / compare

RUN_VARIANTS = {
    "plain": [],
    "corrected": ["correction.method=token_tis", "inject.mode=logit_noise", "inject.sigma=0.1",
                  "algorithm.kl_coef=0.01", "lr_schedule.kind=mismatch_triggered",
                  "lr_schedule.mismatch_threshold=1e-9", "lr_schedule.mismatch_window=1",
                  "rollout.policy_lag=1"],  # the lag drift and the TIM apart (mismatch/lag_k3_kl, tim_k3_kl)
    "verl": ["correction.rollout_is=sequence", "correction.rollout_rs=token_k1",
             "correction.rollout_rs_threshold=0.5_2.0", "algorithm.old_logprobs=recompute",
             "inject.mode=logit_scale", "inject.epsilon=-0.3"],
    "icepop": ["correction.method=icepop", "correction.batch_normalize=true", "inject.mode=logit_noise",
               "inject.sigma=0.5"],
    "tail": ["task.distractors=6"],  # the tail/* keys (vexact.rl.vocab_tail)
    "moe": ["model.num_experts=4", "inject.mode=routing_flip", "inject.flip_rate=0.2"],  # the routing/* keys
    "sampled": ["monitor.sample_fraction=0.5", "algorithm.mini_batches=2", "distributed.leaves=2"],  # monitor/*
}


def _run_keys(tmp_path: Path) -> set[str]:
    base = [f"warm_start.cache_dir={warm_start_cache(tmp_path)}", "warm_start.steps=2", "steps=2",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "task.eval_prompts=2",
            "logging.eval_every=1", "logging.checkpoint_every=2", "logging.live=false", "rollout.max_new_tokens=9"]
    keys: set[str] = set()
    for name, overrides in RUN_VARIANTS.items():
        cfg = load_config(EXPERIMENT, [*base, f"output_dir={tmp_path / name}", *overrides])
        summary = Trainer(cfg, Console(quiet=True)).run()
        assert summary["status"] == "completed", (name, summary)
        for row in read_metrics(tmp_path / name / "metrics.jsonl"):
            keys |= set(row)
    return keys


def _quiet_main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def _measure_keys(tmp_path: Path) -> set[str]:
    from vexact.real.tiny import make_tiny_checkpoint

    model = tmp_path / "tiny"
    make_tiny_checkpoint(model, arch="llama")
    out = tmp_path / "m.json"
    assert _quiet_main(["measure", "--model", str(model), "--random-prompts", "4", "--max-prompt-len", "8",
                        "--max-new-tokens", "4", "--rollout", "native:bf16", "--train", "exact:fp32",
                        "--json", str(out)]) == 0
    return set(json.loads(out.read_text())["metrics"])


def _compare_keys(tmp_path: Path) -> set[str]:
    # Full log-prob rows [B, T, V] in tensor files, so compare adds its full-vocabulary keys too.
    gen = torch.Generator().manual_seed(0)
    full = {side: torch.log_softmax(torch.randn(2, 3, 7, generator=gen), dim=-1) for side in ("roll", "train")}
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    paths = {}
    for side, rows in full.items():
        paths[side] = tmp_path / f"{side}.safetensors"
        save_file({"logprobs": rows.gather(-1, tokens[..., None])[..., 0].contiguous(), "full": rows.contiguous(),
                   "tokens": tokens}, str(paths[side]))
    out = tmp_path / "c.json"
    assert _quiet_main(["compare", str(paths["roll"]), str(paths["train"]), "--rollout-full-key", "full",
                        "--train-full-key", "full", "--mask-key", "none", "--json", str(out)]) == 0
    return set(json.loads(out.read_text())["metrics"])


def _live_keys(tmp_path: Path) -> set[str]:
    from vexact.live import RESERVED_KEYS, Gates, LiveMonitor

    monitor = LiveMonitor(tmp_path / "live", gates=Gates(max_k3=1e-3))
    roll = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, 0.0, 0.0]])
    train = torch.tensor([[-0.5, -1.5, -2.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    monitor.step(0, roll, train, mask)
    monitor.step(1, roll.clone().fill_(float("nan")), train, mask)  # the non-finite row has its own keys
    monitor.step(2, roll, train, mask, behaviour_logprobs=roll)  # policy lag: the drift and the TIM apart
    monitor.step_sampled(3, roll, lambda rows: train[rows], mask)  # a sampled step: live/sampled_* (all rows here)
    monitor.close()
    keys = set().union(*(set(row) for row in read_metrics(tmp_path / "live" / "metrics.jsonl")))
    return keys - set(RESERVED_KEYS) | {"step"}  # outcome, gates, by_position, map: structured fields


def test_run_measure_compare_and_live_write_only_registered_keys(tmp_path):
    run, measured, compared = _run_keys(tmp_path), _measure_keys(tmp_path), _compare_keys(tmp_path)
    live = _live_keys(tmp_path)
    assert metric_keys.unregistered(run | measured | compared | live) == []
    # ... and the registry says who writes what: each writer's keys are entries naming that writer.
    for writer, keys in (("run", run), ("measure", measured), ("compare", compared), ("live", live)):
        assert [k for k in keys - {"step"} if writer not in metric_keys.find(k).writers] == [], writer
    assert any(k.startswith("mismatch/full_vocab_top") for k in compared)
    # The other direction: every entry naming a writer is written by it here (a hook's extra keys: its own tests).
    for writer, keys in (("run", run), ("measure", measured), ("compare", compared), ("live", live)):
        written = {metric_keys.find(k).name for k in keys - {"step"}}
        assert [k.name for k in metric_keys.KEYS if writer in k.writers and k.name not in written
                and not k.source.startswith("integrations/")] == [], writer


# --------------------------------------------------------------------------- the strict build catches broken links


def _strict_build(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """Build a one-page site with the real mkdocs.yml's validation settings and hooks (nav, theme and plugins
    dropped, so it takes seconds)."""
    real = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    config = {"site_name": "t", "docs_dir": str(docs), "site_dir": str(tmp_path / "site"), "strict": True,
              "validation": real["validation"], "hooks": [str(ROOT / hook) for hook in real["hooks"]],
              "markdown_extensions": ["toc"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
@pytest.mark.needs_package("mkdocs", DOCS_PIP)
@pytest.mark.parametrize("link,problem", [
    ("other.md#a-section", None),
    ("missing.md", "not found among documentation files"),
    ("other.md#no-such-section", "does not contain an anchor '#no-such-section'"),
])
def test_the_strict_build_fails_on_a_broken_link(tmp_path, link, problem):
    result = _strict_build(tmp_path, f"# Home\n\nSee [there]({link}).\n\n<!-- vexact-docs: metrics -->\n")
    if problem is None:
        assert result.returncode == 0, result.stderr
        assert "rollout_corr/k3_kl" in (tmp_path / "site" / "index.html").read_text()  # the hook ran
    else:
        assert result.returncode != 0 and problem in result.stderr, result.stderr


# --------------------------------------------------------------------------- the README


def test_readme_is_short_keeps_the_quickstart_and_links_only_existing_pages():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]" && vexact demo\npython -m pytest -q\n' in readme
    links = re.findall(r"\]\(((?:docs/)[^)#]+)", readme)
    assert links and [link for link in links if not (ROOT / link).is_file()] == []
    for section in ("quickstart", "check", "demo"):  # the docs include these README sections (pymdownx.snippets)
        assert f"<!-- --8<-- [start:{section}] -->" in readme and f"<!-- --8<-- [end:{section}] -->" in readme


def test_the_quickstart_says_how_to_get_torchs_cpu_build_on_a_plain_index():
    """On PyPI's plain index ``pip install torch==2.13.0`` pulls the CUDA build; the Quickstart names PyTorch's CPU
    wheel index (as torch's own install docs do), and its two command lines stay as CI runs them."""
    quickstart = _readme_section("quickstart")
    assert "```bash\npip install torch==2.13.0 && pip install -e \".[dev]\" && vexact demo\npython -m pytest -q\n```" \
        in quickstart
    assert "`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`" in quickstart
    assert "so no CUDA build gets pulled in" not in quickstart


def test_the_readme_test_command_says_what_it_skips_and_how_to_run_everything():
    section = (ROOT / "README.md").read_text().split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    assert "`python -m pytest -q`" in section and "skips" in section and "-rs" in section
    assert "`CI=true bash .ci/run`" in section
    ci = (ROOT / ".ci" / "run").read_text()
    installed = re.search(r'pip install --quiet -e "(\.\[[^\]]+\])"', ci).group(1)
    assert f"`{installed}`" in section  # the extras CI installs, as .ci/run spells them now
    # what .ci/run installs beside the extras: the pinned --no-deps releases (verl, OpenRLHF) and the smollm2 packages
    pinned = re.findall(r"pip install --quiet --no-deps (\w+)==([\d.]+)", ci)
    assert len(pinned) >= 2 and [p for p in pinned if f"{p[0]} {p[1]}".lower() not in section.lower()] == []
    assert "smollm2" in section


def _readme_section(name: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split(f"<!-- --8<-- [start:{name}] -->", 1)[1].split(f"<!-- --8<-- [end:{name}] -->", 1)[0]


def test_the_demo_time_is_one_figure_from_one_named_measurement():
    """The Quickstart points at the demo section's time instead of giving one of its own (they said two things)."""
    about_demo = _readme_section("quickstart").split("`vexact demo`: ", 1)[1].split("runs/demo/", 1)[0]
    assert "(#vexact-demo)" in about_demo and not re.search(r"\d ?(min|s)\b|idle", about_demo), about_demo
    demo = _readme_section("demo")
    assert len(re.findall(r"\d+ min \d+ s wall", demo)) == 1 and "`/usr/bin/time -v vexact demo`" in demo


# ------------------------------------------------------------ no documented command overwrites a shipped file
FENCE = re.compile(r"^\s*```(?P<lang>[a-z]*)\n(?P<body>.*?)^\s*```", re.S | re.M)
# where a command names the file it writes: build-map's OUT, a shell redirect, an output flag
WRITES = re.compile(r"(?:build-map|>|--output-dir|--out|--json|--png|-o)\s+(?P<path>[\w./-]+)")
SHIPPED = ("vexact/", "kernels/", "experiments/", "benchmarks/", "tools/")


INLINE = re.compile(r"`[^`\n]+(?:\n[^`\n]+)*`")  # a code span in prose, which may wrap onto the next lines


def written_shipped_paths(text: str) -> list[str]:
    """The shipped paths (package, kernels, experiments, tools) that a page's shell blocks, or the commands its prose
    quotes in code spans, write to."""
    blocks = "\n".join(m.group("body").replace("\\\n", " ") for m in FENCE.finditer(text)
                       if m.group("lang") in ("", "bash", "sh", "shell", "console"))
    spans = "\n".join(m.group(0).replace("\n", " ") for m in INLINE.finditer(FENCE.sub("", text)))
    return [m.group("path") for m in WRITES.finditer(blocks + "\n" + spans) if m.group("path").startswith(SHIPPED)]


def test_no_documented_command_overwrites_a_shipped_file():
    """A command a reader copies from the docs writes to a scratch path (runs/, /tmp), never over a file the
    package ships (a rebuilt map once overwrote vexact/lab/default_map.json with a one-curve map)."""
    assert written_shipped_paths("```bash\npython -m vexact.map build-map vexact/map/default_map.json \\\n"
                                 "    runs/x\ngit show A:f > vexact/lab/x.json\n```\n") == [
        "vexact/map/default_map.json", "vexact/lab/x.json"]
    assert written_shipped_paths("```bash\npython -m vexact.map build-map runs/map.json "
                                 "vexact/map/default_map.json\n```\n") == []
    assert written_shipped_paths("Then `python -m vexact.map build-map\nvexact/map/default_map.json runs/x` added "
                                 "curves; `build-map runs/map.json vexact/map/default_map.json` does not.\n") == [
        "vexact/map/default_map.json"]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}: {path}" for page in pages for path in written_shipped_paths(page.read_text())]
    assert found == []


def test_the_verl_and_trl_tables_name_real_keys():
    """The hand-written vocabulary tables: every vexact config key and metric key they name exists."""
    page = (ROOT / "docs" / "reference" / "verl_trl.md").read_text()
    rows = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `")]
    names = {name for row in rows for name in re.findall(r"`([^`]+)`", row)}
    config, metrics = set(docs_gen.config_keys()), [n for n in names if "/" in n and "*" not in n]
    dotted = [n for n in names if re.fullmatch(r"[a-z_]+\.[a-z_]+", n)]
    assert len(dotted) > 10 and [n for n in dotted if n not in config] == []
    assert len(metrics) > 10 and [n for n in metrics if metric_keys.find(n) is None] == []


def test_every_results_page_says_which_cpu_and_what_carries_to_another_machine():
    """Numbers on a results page were measured on one CPU: each page names it (or says it was not recorded) and
    includes the one shared note on what carries to another machine (not typed per page)."""
    snippet = ROOT / "docs" / "_snippets" / "per_machine.md"
    text = snippet.read_text()
    assert "per machine" in text and "collapse" in text and "bits" in text
    include = '--8<-- "docs/_snippets/per_machine.md"'
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert len(pages) >= 10
    missing = [p.name for p in pages if include not in p.read_text()
               or not re.search(r"^\s*(CPU|GPU): \S", p.read_text(), re.MULTILINE)]
    assert missing == []
    assert [p.name for p in pages if text.splitlines()[0] in p.read_text()] == []  # included, never copied
    assert "_snippets/" in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["exclude_docs"]  # not a page itself
