"""Output files are checked before any work (``cli_base.check_outputs``): one that is a file the command reads is
refused (``--json prompts.txt`` would replace the prompts with the report; compare's cases are in
test_compare.py), and so is one that cannot be written (a folder), before the work rather than after it."""

from __future__ import annotations

import pytest

from vexact.cli import main


@pytest.mark.parametrize("command", [["measure", "--model", "no-checkpoint-read"], ["locate"]])
@pytest.mark.parametrize("output", ["--json", "--png"])
def test_an_output_naming_the_prompts_file_is_refused_and_the_file_kept(tmp_path, capsys, command, output):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n")
    assert main([*command, "--prompts", str(prompts), output, str(tmp_path / "." / "prompts.txt")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {output} {tmp_path / '.' / 'prompts.txt'} is the --prompts file: the output would "
                   "overwrite it; name another file\n")
    assert prompts.read_text() == "1 2 3\n"


def test_a_folder_as_the_output_is_refused_before_the_work(tmp_path, capsys):
    rollout = tmp_path / "r.jsonl"
    rollout.write_text('{"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}\n')
    assert main(["compare", str(rollout), str(rollout), "--json", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: --json: cannot write {tmp_path}: Is a directory\n"  # nothing compared


def test_an_output_beside_the_inputs_is_written(tmp_path):
    from vexact.cli_base import check_outputs

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1\n")
    check_outputs({"--json": tmp_path / "report.json", "--png": None}, {"--prompts": prompts, "--model": tmp_path})
    assert not (tmp_path / "report.json").exists()  # the probe leaves nothing behind


@pytest.mark.parametrize("command", ["measure", "locate"])
def test_an_output_naming_a_file_of_the_checkpoint_is_refused(tmp_path, capsys, command):
    """``--json CKPT/config.json`` wrote the report over the checkpoint's config (the next run: "config.json has no
    integer vocab_size"): the files of ``--model DIR`` are inputs too."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    prompts = ["--random-prompts", "1"] if command == "measure" else []  # (measure asks for a prompt source)
    assert main([command, "--model", str(checkpoint), *prompts, "--json", str(checkpoint / "config.json")]) == 2
    assert capsys.readouterr().err == (f"error: --json {checkpoint / 'config.json'} is a file of --model {checkpoint}: "
                                       "the output would overwrite it; name another file\n")
    assert (checkpoint / "config.json").read_text() == "{}"


@pytest.mark.parametrize("command", ["measure", "locate", "compare"])
def test_two_outputs_naming_one_file_are_refused(tmp_path, capsys, command):
    """``--json X --png X`` wrote the PNG over the JSON report (exit 0, 'wrote X, X')."""
    out = tmp_path / "out.json"
    if command == "compare":
        rollout = tmp_path / "r.jsonl"
        rollout.write_text('{"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}\n')
        head = [str(rollout), str(rollout)]
    else:
        head = ["--model", str(tmp_path / "none"), *(["--random-prompts", "1"] if command == "measure" else [])]
    assert main([command, *head, "--json", str(out), "--png", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --png {out} is also --json's file: each output needs its own file\n"
    assert not out.exists()


def test_the_probe_leaves_no_folder_behind_and_the_report_makes_its_own(tmp_path, capsys):
    """``compare r.jsonl missing.jsonl --json nodir/x/y.json`` exited 2 and left nodir/x behind: the probe made the
    folders and removed only its file. Now it removes the folders it made; a command that succeeds makes them when
    it writes."""
    rollout = tmp_path / "r.jsonl"
    rollout.write_text('{"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}\n')
    assert main(["compare", str(rollout), str(tmp_path / "missing.jsonl"), "--json",
                 str(tmp_path / "nodir" / "x" / "y.json")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    assert main(["compare", str(rollout), str(rollout), "--json", str(tmp_path / "kept" / "new" / "y.json")]) == 0
    assert (tmp_path / "kept" / "new" / "y.json").is_file()


@pytest.mark.parametrize("where", ["file", "folder"])
@pytest.mark.parametrize("target_folder", [True, False], ids=["target_folder_exists", "no_target_folder"])
def test_a_broken_symlink_as_the_output_is_one_error_naming_the_flag_and_the_link(tmp_path, where, target_folder):
    """``--out link.json`` where link.json (or a folder above it) is a symlink to nothing: the probe wrote through it
    (made its target, then unlinked the user's link: the check passed and left a stray file) or failed with "No such
    file or directory" for a path that is there."""
    from vexact.cli_base import check_writable

    target = tmp_path / "targets" / "t" if target_folder else tmp_path / "gone" / "t"
    (tmp_path / "targets").mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    out = link if where == "file" else link / "out.json"
    with pytest.raises(ValueError) as e:
        check_writable(out, "--out")
    assert str(e.value) == (f"--out: cannot write {out}: {link} is a broken symlink (its target {target} does not "
                            "exist); remove it or name another file")
    assert link.is_symlink() and list((tmp_path / "targets").iterdir()) == []  # the link kept, nothing made


def test_the_cli_prints_a_broken_symlink_output_as_one_error_line(tmp_path, capsys):
    rollout = tmp_path / "r.jsonl"
    rollout.write_text('{"id": 0, "tokens": [1, 2], "logprobs": [-0.5, -0.25]}\n')
    link = tmp_path / "report.json"
    link.symlink_to(tmp_path / "nowhere.json")
    assert main(["compare", str(rollout), str(rollout), "--json", str(link)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: --json: cannot write {link}: {link} is a broken symlink (its target "
                                 f"{tmp_path / 'nowhere.json'} does not exist); remove it or name another file\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "report.json"]  # nothing compared or written
