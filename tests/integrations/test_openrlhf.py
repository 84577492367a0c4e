"""OpenRLHF: the dump and live hooks on ``Experience`` objects built as OpenRLHF 0.11.2 (and 0.8.9 on) builds them.

The fakes follow the source, step by step: ``samples_generator._process_response_into_experience`` (one sample:
prompt + response ids, ``action_mask[1:]``, ``rollout_log_probs`` with 0.0 over the prompt, shifted by one as the
mask), ``utils/agent.py`` (multi-turn: several action ranges, 0.0 for feedback tokens),
``Experience.concat_experiences`` (right padding: the pad token for ``sequences``, 0 for the rest) and
``Actor.forward`` (``log_probs[:, :-1][:, -A:] * action_mask``). Both sides read one bigram table of log-probs, so
they agree bit for bit unless a test moves one. test_openrlhf_parity.py runs OpenRLHF's own sample and padding code
and reads the rest of its source.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vexact.cli import main
from vexact.integrations.openrlhf import (
    COMPARE_FLAGS,
    DUMP_KEYS,
    dump_experiences,
    experience_sides,
    observe_experiences,
)
from vexact.live import LiveMonitor
from vexact.metric_keys import LIVE_SAMPLED_SEQUENCES

VOCAB, PAD = 16, 0
TABLE = torch.log_softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
"""A bigram 'model': TABLE[a, b] = log p(b | previous token a), float32, read by both sides."""


@dataclass
class Experience:
    """The fields of OpenRLHF's ``Experience`` (openrlhf/trainer/ppo_utils/experience.py) the hooks read."""

    sequences: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    action_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None


def _sample(prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> Experience:
    """One sample as OpenRLHF's generator makes it: ``turns`` = (action tokens, feedback tokens) per turn."""
    tokens, ranges, rollout = list(prompt), [], [0.0] * len(prompt)
    for action, feedback in turns:
        start = len(tokens)
        for token in action:
            rollout.append(float(TABLE[tokens[-1], token]))  # vLLM's log-prob of the sampled token
            tokens.append(token)
        ranges.append((start, len(tokens)))
        tokens += feedback
        rollout += [0.0] * len(feedback)  # agent.py: dummy log-probs for the environment's tokens
    action_mask = torch.zeros(len(tokens), dtype=torch.long)
    for start, end in ranges:
        action_mask[start:end] = 1
    return Experience(sequences=torch.tensor(tokens).unsqueeze(0),
                      attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                      action_mask=action_mask[1:].unsqueeze(0),
                      rollout_log_probs=torch.tensor(rollout[1:]).unsqueeze(0))


def _right_pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
    """openrlhf.utils.utils.zero_pad_sequences(side="right"), concatenated on rows."""
    width = max(t.shape[-1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=value) for t in tensors])


def _micro_batch(samples: list[Experience]) -> Experience:
    """Experience.concat_experiences, then the actor's forward (RemoteExperienceMaker.make_experience)."""
    out = Experience(**{name: _right_pad([getattr(s, name) for s in samples], PAD if name == "sequences" else 0)
                        for name in ("sequences", "attention_mask", "action_mask", "rollout_log_probs")})
    rolled = torch.roll(out.sequences, shifts=-1, dims=1)
    log_probs = TABLE[out.sequences, rolled][:, :-1]  # column t: log p(token t + 1 | token t)
    out.action_log_probs = log_probs[:, -out.action_mask.shape[1]:] * out.action_mask.float()
    return out


def _experiences() -> list[Experience]:
    """Two micro-batches of different widths; prompts of different lengths; one two-turn agent sample."""
    first = _micro_batch([_sample([3, 4, 5], [([6, 7, 8, 9], [])]),
                          _sample([2], [([5, 5], [11, 12]), ([13, 1, 2], [])])])
    second = _micro_batch([_sample([7, 8], [([9], [])]), _sample([1, 2, 3, 4], [([10, 11], [])])])
    return [first, second]


def _compare(tmp_path: Path, path: Path) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["compare", str(path), *COMPARE_FLAGS, "--json", str(out)])
    return code, json.loads(out.read_text())


def test_sides_follow_openrlhfs_layout():
    """Rows in order, right-padded to the widest micro-batch; the token ids are those each column scores."""
    experiences = _experiences()
    rollout, train, mask, tokens = experience_sides(experiences)
    assert rollout.shape == train.shape == mask.shape == tokens.shape == (4, 7)  # agent row: 8 tokens, 7 columns
    assert mask.dtype == torch.bool and tokens.dtype == torch.long
    assert mask.sum(1).tolist() == [4, 5, 1, 2]  # action tokens only: not prompt, feedback or padding
    assert tokens[1][mask[1]].tolist() == [5, 5, 13, 1, 2]
    assert not mask[2:, 5:].any()  # the narrower micro-batch's padding
    assert torch.equal(rollout[mask], train[mask])


def test_dump_of_equal_sides_compares_equal(tmp_path):
    """The recipe's file, read with the docs' flags: every token equal, k3 exactly 0; masked positions, where the
    two sides differ (the trainer's side holds junk there), are not read."""
    experiences = _experiences()
    for e in experiences:
        e.action_log_probs = torch.where(e.action_mask.bool(), e.action_log_probs, torch.tensor(-3.0))
    path = dump_experiences(experiences, tmp_path / "dumps" / "step1.safetensors")
    code, report = _compare(tmp_path, path)
    assert code == 0 and report["first_mismatch"] is None
    assert report["metrics"]["rollout_corr/k3_kl"] == 0.0 and report["metrics"]["mismatch/tokens"] == 12


def test_a_known_mismatch_is_found_where_it_is(tmp_path):
    """One ulp moved in the agent sample's second turn: compare names its row, column and token."""
    experiences = _experiences()
    e = experiences[0]
    column = int(e.action_mask[1].nonzero()[3])  # the 4th action token of row 1 (second turn)
    value = e.action_log_probs[1, column].clone()
    e.action_log_probs[1, column] = torch.nextafter(value, torch.tensor(0.0))
    code, report = _compare(tmp_path, dump_experiences(experiences, tmp_path / "d.safetensors"))
    first = report["first_mismatch"]
    assert code == 0 and report["metrics"]["rollout_corr/k3_kl"] > 0.0
    assert (first["id"], first["position"], first["column"]) == (1, 3, column)
    assert first["token"] == int(e.sequences[1, column + 1]) == 1  # column j scores token j + 1 (A = T - 1)
    assert first["rollout"] == float(value)


def test_live_row_is_compares_report(tmp_path):
    experiences = _experiences()
    experiences[1].action_log_probs = experiences[1].action_log_probs * 1.001
    code, report = _compare(tmp_path, dump_experiences(experiences, tmp_path / "d.safetensors"))
    with LiveMonitor(tmp_path / "live") as monitor:
        row = observe_experiences(monitor, experiences, 7)
    assert row["step"] == 7 and report["metrics"]["rollout_corr/k3_kl"] > 0.0
    same = [key for key, value in report["metrics"].items()
            if row[key] == value or (value != value and row[key] != row[key])]
    assert same == list(report["metrics"])  # every metric, exactly (NaN where both are NaN)
    with LiveMonitor(tmp_path / "sampled", sample_fraction=0.5, every=2, seed=0) as monitor:  # a sampling monitor
        skipped, sampled = (observe_experiences(monitor, experiences, step) for step in (1, 2))
    assert skipped is None and sampled[LIVE_SAMPLED_SEQUENCES] == 2


def test_refusals():
    experiences = _experiences()
    experiences[1].rollout_log_probs = None  # OpenRLHF without the correction flag
    with pytest.raises(ValueError, match=r"^experiences\[1\]\.rollout_log_probs is None: .*"
                                         r"--algo\.advantage\.is_correction_level token \(OpenRLHF 0\.11\.2 on\); "
                                         r"--algo\.advantage\.is_correction_enable \(OpenRLHF 0\.10\.2 to 0\.11\.1\); "
                                         r"--enable_vllm_is_correction \(OpenRLHF up to 0\.10\.1\)$"):
        experience_sides(experiences)  # each release's switch (the parity test reads 0.11.2's; the rest: the docs)
    with pytest.raises(ValueError, match=r"action_log_probs is None: call after make_experience_batch"):
        experience_sides(Experience(sequences=torch.zeros(1, 3), rollout_log_probs=torch.zeros(1, 2),
                                    action_mask=torch.ones(1, 2)))
    e = _experiences()[0]
    with pytest.raises(ValueError, match=r"action_mask has shape \[2, 6\] but rollout_log_probs has \[2, 7\]"):
        experience_sides(Experience(e.sequences, None, e.action_mask[:, 1:], e.action_log_probs, e.rollout_log_probs))
    with pytest.raises(ValueError, match=r"experiences\[0\]\.action_mask holds values other than 0 and 1"):
        experience_sides(Experience(e.sequences, None, e.action_mask * 2, e.action_log_probs, e.rollout_log_probs))
    with pytest.raises(ValueError, match=r"sequences has shape \[2, 7\]; .* more columns"):
        experience_sides(Experience(e.sequences[:, 1:], None, e.action_mask, e.action_log_probs, e.rollout_log_probs))
    with pytest.raises(ValueError, match=r"has no 'rollout_log_probs': expected OpenRLHF's Experience, got dict"):
        experience_sides({"sequences": e.sequences})
    with pytest.raises(ValueError, match=r"^no experiences"):
        experience_sides([])
    with pytest.raises(ValueError, match=r"monitor must be a vexact.live.LiveMonitor"):
        observe_experiences(None, e, 0)


def test_the_docs_recipe_uses_these_names():
    """docs/live_and_recipes.md's OpenRLHF section calls the helpers and gives compare exactly COMPARE_FLAGS."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "live_and_recipes.md").read_text()
    section = page.split("### OpenRLHF", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    commands = re.findall(r"^vexact compare (\S+) (.*?)(?:\s+#.*)?$", section, re.MULTILINE)
    assert commands and all(flags.split()[:len(COMPARE_FLAGS)] == list(COMPARE_FLAGS) for _, flags in commands)
    assert "dump_experiences(" in section and "observe_experiences(" in section
    assert DUMP_KEYS[:3] == ("rollout_log_probs", "action_log_probs", "action_mask")  # OpenRLHF's field names
