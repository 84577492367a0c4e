"""README tables that a command prints are generated blocks that ``benchmarks/readme_tables.py`` regenerates and
checks (the demo itself takes minutes, so here its output directory is a stand-in; the README's numbers are checked
with ``python -m benchmarks.readme_tables --check`` after ``vexact demo``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import readme_tables

TABLE = """### demo

| inject.value | seeds | final reward |
|:---|---:|---:|
| 0 | 2 | 0.5 |

peak / final reward (smoothed): eval/reward_mean as a trailing mean of 3 evaluation points
"""


def _demo_dir(tmp_path: Path, table: str = TABLE) -> Path:
    (tmp_path / "demo" / "report").mkdir(parents=True, exist_ok=True)
    (tmp_path / "demo" / "report" / "table.md").write_text(table)
    return tmp_path / "demo"


def test_the_readme_demo_table_is_a_generated_block_with_the_smoothed_label():
    text = readme_tables.README.read_text()
    found = readme_tables.blocks(text)  # raises on a block no generator knows
    demo = [m for m in found if m.group("command") == "vexact demo"]
    assert len(demo) == 1
    body = demo[0].group("body")
    assert body.startswith("| inject.value |") and "final reward" in body and "(smoothed)" in body


def test_check_finds_a_stale_block_and_write_regenerates_only_the_block(tmp_path, capsys):
    readme = tmp_path / "README.md"
    before, after = "# title\n\ntext before\n", "\ntext after\n"
    readme.write_text(f"{before}<!-- generated: vexact demo -->\n| old | table |\n<!-- end generated -->{after}")
    demo = _demo_dir(tmp_path)
    args = ["--readme", str(readme), "--demo-dir", str(demo)]
    assert readme_tables.main(["--check", *args]) == 1
    assert "the block of `vexact demo` differs" in capsys.readouterr().err
    assert readme_tables.main(args) == 0
    expected = TABLE.split("\n", 2)[2]  # without the title line
    assert readme.read_text() == f"{before}<!-- generated: vexact demo -->\n{expected}<!-- end generated -->{after}"
    assert readme_tables.main(["--check", *args]) == 0
    _demo_dir(tmp_path, TABLE.replace("0.5", "0.6"))  # the command printed other numbers: stale again
    assert readme_tables.main(["--check", *args]) == 1


def test_a_block_without_a_generator_or_output_is_one_error(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- generated: vexact unknown -->\n|x|\n<!-- end generated -->\n")
    assert readme_tables.main(["--check", "--readme", str(readme)]) == 2
    assert "has no generator" in capsys.readouterr().err
    readme.write_text("<!-- generated: vexact demo -->\n|x|\n<!-- end generated -->\n")
    assert readme_tables.main(["--check", "--readme", str(readme), "--demo-dir", str(tmp_path / "none")]) == 2
    assert "run `vexact demo`" in capsys.readouterr().err


DEMO_TABLE = """### demo

| inject.value | seeds | realised k3 KL | realised \\|Δlogp\\| | collapse rate | final reward (smoothed) |
|:---|---:|---:|---:|---:|---:|
| 0 | 2 | 0 | 0 | 0/2 | 0.500 |
| -0.5 | 2 | 4.7e-01 | 9.1e-01 | 2/2 | 0.023 |
"""
AMD = {"model": "AMD EPYC", "machine": "x86_64", "flags": ["avx2", "avx512f", "avx512_bf16"]}
INTEL = {"model": "Intel(R) Xeon(R) Platinum", "machine": "x86_64", "flags": ["avx512f", "amx_bf16"]}


def _demo_on(tmp_path: Path, host: dict, table: str) -> Path:
    demo = _demo_dir(tmp_path, table)
    (demo / "points" / "p0").mkdir(parents=True, exist_ok=True)
    (demo / "points" / "p0" / "summary.json").write_text(json.dumps({"host_cpu": host}))
    return demo


def test_a_block_names_its_host_and_another_host_checks_what_carries(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- generated: vexact demo -->\n|x|\n<!-- end generated -->\n")
    args = ["--readme", str(readme), "--demo-dir", str(_demo_on(tmp_path, AMD, DEMO_TABLE))]
    assert readme_tables.main(args) == 0
    assert readme.read_text().startswith("<!-- generated: vexact demo; host: AMD EPYC (avx2, avx512f, avx512_bf16) -->")
    assert readme_tables.main(["--check", *args]) == 0
    # another host: other rewards, other k3 and another outcome under injection -- what carries is unchanged
    other = DEMO_TABLE.replace("0.500", "0.410").replace("4.7e-01", "3.9e-01").replace("2/2 | 0.023", "1/2 | 0.2")
    _demo_on(tmp_path, INTEL, other)
    capsys.readouterr()
    assert readme_tables.main(["--check", *args]) == 0
    assert "compared what carries across hosts" in capsys.readouterr().out
    # ... but mismatch without injection, or another set of rows, is a difference on any host
    _demo_on(tmp_path, INTEL, other.replace("| 0 | 2 | 0 | 0 | 0/2 |", "| 0 | 2 | 1.0e-09 | 0 | 0/2 |"))
    assert readme_tables.main(["--check", *args]) == 1
    _demo_on(tmp_path, INTEL, other.replace("| -0.5 | 2 |", "| -0.4 | 2 |"))
    assert readme_tables.main(["--check", *args]) == 1
    # on the table's own host every cell counts
    _demo_on(tmp_path, AMD, other)
    assert readme_tables.main(["--check", *args]) == 1
