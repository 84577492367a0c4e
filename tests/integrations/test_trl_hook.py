"""vexact.integrations.trl: a real TRL ``GRPOTrainer`` (tiny random Qwen2, tokenizer built here, CPU, no hub) with
the live monitor mixed in.

The rollout side comes from ``hf_generate_rollout``, a ``rollout_func`` -- the hook TRL gives custom engines
(SGLang, a server) -- that samples with transformers' ``generate`` (KV cache, one token at a time) and returns each
sampled token's log-prob from the raw scores / temperature; the training side is TRL's full-sequence forward. So the
two differ the way a real engine and trainer do, and the tests check that the hook hands the monitor exactly those
tensors, that a run resumed from a checkpoint keeps its rows, and that the docs' example runs as written."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vexact.live import Gates, LiveMonitor
from vexact.real.measure import mismatch_report
from vexact.records.runlog import read_metrics

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "live_and_recipes.md"

pytestmark = [pytest.mark.needs_package("trl", "pip install 'vexact[trl]'"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # transformers 5's renames, inside TRL

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10"]


class RecordingMonitor(LiveMonitor):
    """A LiveMonitor that keeps what each step was given (to recompute the row independently)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def step(self, step, rollout_logprobs, train_logprobs, mask=None, extra=None):
        self.calls.append((rollout_logprobs.clone(), train_logprobs.clone(), mask.clone()))
        return super().step(step, rollout_logprobs, train_logprobs, mask, extra)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1))


class RecordingRollout:
    """``hf_generate_rollout``, keeping what it returned (the rollout side the monitor must be handed)."""

    def __init__(self):
        self.returned = []

    def __call__(self, prompts, trainer):
        from vexact.integrations.trl import hf_generate_rollout

        out = hf_generate_rollout(prompts, trainer)
        self.returned.append(out["logprobs"])
        return out


def _trainer(tmp_path, monitor, cls=None, **config):
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.x
    from datasets import Dataset
    from trl import GRPOConfig

    from vexact.integrations.trl import LiveGRPOTrainer

    tokenizer = _tokenizer()
    settings = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                    use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    args = GRPOConfig(**{**settings, **config})
    rollout = RecordingRollout()
    trainer = (cls or LiveGRPOTrainer)(model=_model(), reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                                                                            completions],
                                       args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                       processing_class=tokenizer, rollout_func=rollout, live_monitor=monitor)
    return trainer, rollout


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_grpo_trainer_writes_one_row_per_step(tmp_path, one_torch_thread):
    monitor = RecordingMonitor(tmp_path / "vexact", gates=Gates(max_k3=1.0))
    trainer, rollout = _trainer(tmp_path, monitor)
    trainer.train()
    monitor.close()

    rows = read_metrics(tmp_path / "vexact" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and [r["trl/global_step"] for r in rows] == [0, 1]
    for row, (roll, train, mask), returned in zip(rows, monitor.calls, rollout.returned):
        assert row["outcome"] == "ok" and row["live/sequences"] == 4
        assert row["gates"][0]["gate"] == "--max-k3" and row["live/gates_failed"] == 0
        # the rollout side is exactly what the engine (rollout_func) returned, under TRL's completion mask
        lengths = mask.sum(1).tolist()
        for b, logps in enumerate(returned):
            assert torch.equal(roll[b, : lengths[b]], torch.tensor(logps, dtype=roll.dtype))
        # and the row is mismatch_report on those tensors (compare's metrics), key by key, exactly
        keep = mask.bool()
        report = mismatch_report(train[keep].double(), roll[keep].double(), lengths, max(lengths))
        assert row["mismatch/tokens"] == sum(lengths) > 0
        assert all(_same(row[k], v) for k, v in report["metrics"].items())
        assert row["rollout_corr/k3_kl"] >= 0.0 and 0.0 <= row["mismatch/bitwise_equal_frac"] <= 1.0


def test_uses_trls_old_logprobs_when_trl_computes_them_and_the_dump_recipe(tmp_path, one_torch_thread):
    """With generation ahead of optimisation (steps_per_generation 2 > gradient accumulation 1) TRL computes
    ``old_per_token_logps`` itself; the hook must pass that tensor, not a second forward of its own. The same trainer
    follows the TRL dump recipe of docs/live_and_recipes.md, and ``vexact compare`` on the dump gives the live row."""
    from trl import GRPOTrainer

    from vexact.integrations.trl import LiveMismatchMixin, dump_batch
    from vexact.real.compare import CompareSettings, run_compare

    seen = []
    dumps = tmp_path / "dumps" / "run1"  # not made here: dump_batch makes the folders

    class Capturing(LiveMismatchMixin, GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            seen.append(output)
            if self.model.training and self.accelerator.is_main_process:  # the recipe, as documented
                dump_batch(self, output, dumps / f"step{self.state.global_step}.safetensors")
            return output

    monitor = RecordingMonitor(tmp_path / "vexact")
    trainer, _ = _trainer(tmp_path, monitor, cls=Capturing, steps_per_generation=2, temperature=0.7)
    trainer.train()
    monitor.close()
    assert len(seen) == 1 and "old_per_token_logps" in seen[0]
    assert torch.equal(monitor.calls[0][1], seen[0]["old_per_token_logps"])
    rows = read_metrics(tmp_path / "vexact" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0]
    summary = run_compare(CompareSettings(rollout=dumps / "step0.safetensors")).summary
    assert all(_same(rows[0][k], v) for k, v in summary["metrics"].items())
    assert summary["tokens"] == rows[0]["mismatch/tokens"] > 0


def test_a_sampled_monitor_scores_only_its_sample(tmp_path, one_torch_thread):
    """``LiveMonitor(sample_fraction=0.5)``: the mixin's extra no-grad forward covers the sampled rows only, and each
    row is the full comparison's metrics over those rows."""
    from vexact.integrations.trl import LiveGRPOTrainer

    no_grad_rows, outputs = [], []

    class Spying(LiveGRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
            if not torch.is_grad_enabled():
                no_grad_rows.append(int(input_ids.shape[0]))
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            outputs.append(output)
            return output

    monitor = LiveMonitor(tmp_path / "vexact", sample_fraction=0.5, seed=3)
    trainer, _ = _trainer(tmp_path, monitor, cls=Spying)
    trainer.train()
    monitor.close()
    rows = read_metrics(tmp_path / "vexact" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and no_grad_rows == [2, 2]  # 2 of each step's 4 completions
    from vexact.integrations.trl import batch_sides

    for step, (row, output) in enumerate(zip(rows, outputs)):
        assert row["live/sampled_sequences"] == 2 and row["live/sample_fraction"] == 0.5
        picked = monitor.sample(step, 4)
        roll, _, mask = batch_sides(trainer, {**output, "old_per_token_logps": output["sampling_per_token_logps"]})
        keep = mask[picked].bool()
        assert row["mismatch/tokens"] == int(keep.sum()) > 0 and row["live/sequences"] == 2


def test_refuses_a_trainer_without_rollout_logprobs(tmp_path):
    """TRL's transformers-generate path keeps no generation log-probs: nothing to compare, so one clear error."""
    from datasets import Dataset
    from trl import GRPOConfig

    from vexact.integrations.trl import LiveGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="needs the generation engine's log-probs"):
        LiveGRPOTrainer(model=_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=_tokenizer(),
                        live_monitor=LiveMonitor(tmp_path / "vexact"))


def test_refuses_a_trainer_that_is_no_grpo_trainer_or_puts_it_first(tmp_path):
    """Mixed into another trainer, the hook was an AttributeError ('use_vllm') after the whole trainer was built;
    after GRPOTrainer in the bases, TRL's "unexpected keyword argument 'live_monitor'". Each is one ValueError now,
    before anything is built."""
    from transformers import Trainer, TrainingArguments
    from trl import GRPOTrainer

    from vexact.integrations.trl import LiveMismatchMixin

    class Monitored(LiveMismatchMixin, Trainer):
        pass

    with pytest.raises(ValueError, match=r"^LiveMismatchMixin hooks TRL's GRPOTrainer, and Monitored is not one: mix "
                                         r"it into GRPOTrainer or a subclass of it$"):
        Monitored(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True,
                                                         report_to="none"),
                  live_monitor=LiveMonitor(tmp_path / "vexact"))

    class Mine(GRPOTrainer):
        pass

    with pytest.raises(ValueError, match=r"^Backwards: LiveMismatchMixin must come before GRPOTrainer \(or your "
                                         r"subclass of it\) in the bases, e.g. class "
                                         r"Backwards\(LiveMismatchMixin, GRPOTrainer\)$"):
        class Backwards(Mine, LiveMismatchMixin):
            pass

    class Forwards(LiveMismatchMixin, Mine):  # your own GRPOTrainer subclass, the mixin first
        pass

    assert not (tmp_path / "vexact").exists() and not (tmp_path / "t").exists()


def test_a_grpo_config_names_the_correction_trl_applies(tmp_path):
    """TRL 1.16 applies its importance-sampling correction only with vLLM: the docs' example (use_vllm=False, a
    rollout_func) trains with none, so its GRPOConfig is the recompute curve (it was read as seq_mis, TRL's default
    mode); with use_vllm=True the mode names it."""
    from trl import GRPOConfig

    from vexact.map.verdict import resolve_correction

    settings = dict(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none")
    assert resolve_correction(GRPOConfig(**settings)) == "recompute"
    assert resolve_correction(GRPOConfig(**settings, vllm_importance_sampling_mode="token_truncate")) == "recompute"
    assert resolve_correction(GRPOConfig(**settings, use_vllm=True)) == "seq_mis"
    assert resolve_correction(GRPOConfig(**settings, use_vllm=True,
                                         vllm_importance_sampling_mode="token_truncate")) == "token_tis"


def test_dump_batch_and_batch_sides_refuse_what_is_no_generation_output(tmp_path):
    """The trainer's ``inputs`` (a list of prompt dicts) in place of the output was AttributeError: 'list' object has
    no attribute 'get'; an output missing a key was a bare KeyError. Each is one ValueError naming it; nothing is
    written."""
    from vexact.integrations.trl import batch_sides, dump_batch

    logps = torch.zeros(2, 3)
    path = tmp_path / "dumps" / "step0.safetensors"
    with pytest.raises(ValueError, match=r"^expected the dict GRPOTrainer._generate_and_score_completions returns, "
                                         r"got list$"):
        dump_batch(None, [{"prompt": "w1"}], path)
    with pytest.raises(ValueError, match=r"^this GRPOTrainer batch has no 'completion_mask': pass the dict "
                                         r"_generate_and_score_completions returns$"):
        batch_sides(None, {"sampling_per_token_logps": logps, "old_per_token_logps": logps})
    with pytest.raises(ValueError, match=r"^this GRPOTrainer batch has no 'prompt_ids', 'prompt_mask': pass"):
        batch_sides(None, {"sampling_per_token_logps": logps, "completion_mask": torch.ones(2, 3),
                           "completion_ids": torch.ones(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"^this GRPOTrainer batch has no 'completion_ids': pass"):
        dump_batch(None, {"sampling_per_token_logps": logps, "old_per_token_logps": logps,
                          "completion_mask": torch.ones(2, 3)}, path)
    assert not path.parent.exists()


def test_a_resumed_run_keeps_its_rows_and_continues_at_global_step(tmp_path, one_torch_thread):
    """Train 4 steps with a checkpoint at step 3 (a run that died after step 3's row), then resume from that
    checkpoint with ``LiveMonitor(..., resume=True)``: the rows of steps 0-2 stay as written, step 3 is written again
    by the resumed trainer, step 4 follows, and every row's ``step`` is its ``trl/global_step``. (The counter the
    mixin kept before restarted at 0 in the resumed trainer, so its first row dropped every earlier one.)"""
    out = tmp_path / "vexact"
    checkpoints = dict(save_strategy="steps", save_steps=3)
    first = LiveMonitor(out)
    trainer, _ = _trainer(tmp_path, first, max_steps=4, **checkpoints)
    trainer.train()
    first.close()
    before = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in before] == [0, 1, 2, 3]
    assert (tmp_path / "trl" / "checkpoint-3").is_dir()
    shutil.rmtree(tmp_path / "trl" / "checkpoint-4")  # the final save: the run died after step 3's row, before it

    second = LiveMonitor(out, resume=True)
    resumed, _ = _trainer(tmp_path, second, max_steps=5, **checkpoints)
    resumed.train(resume_from_checkpoint=True)
    second.close()
    after = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in after] == [0, 1, 2, 3, 4]
    assert [r["trl/global_step"] for r in after] == [0, 1, 2, 3, 4]
    assert after[:3] == before[:3]  # the history before the checkpoint, kept as written
    assert all(r["outcome"] == "ok" and r["mismatch/tokens"] > 0 for r in after)


@pytest.mark.parametrize("accumulation, per_generation, iterations, global_steps, expected", [
    (1, 1, 1, [0, 1, 2], [0, 1, 2]),  # TRL's defaults: one generation batch per optimiser step
    (1, 2, 1, [0, 2, 4], [0, 2, 4]),  # generation ahead of optimisation: a batch every other step
    (4, 4, 2, [0, 2], [0, 2]),  # num_iterations 2: a batch every 2 optimiser steps
    (2, 1, 1, [0, 0, 1, 1, 5, 5], [0, 1, 2, 3, 10, 11]),  # two batches per optimiser step (resumed at 5)
    (3, 2, 1, [0, 0, 1, 2, 2], [0, 1, 2, 4, 5]),  # 2, 1, 2 batches per step: at most G = 2
])
def test_the_row_step_is_a_function_of_the_trainers_state(accumulation, per_generation, iterations, global_steps,
                                                          expected):
    """``global_step x G + j``: G = most generation batches one optimiser step makes (1 under TRL's defaults), j the
    batch's index within its step -- so steps increase, and a resumed trainer's rows continue its own."""
    from vexact.integrations.trl import LiveMismatchMixin

    fake = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=accumulation,
                                                steps_per_generation=per_generation),
                           num_iterations=iterations, state=SimpleNamespace(global_step=0), _live_last=None)
    steps = []
    for global_step in global_steps:
        fake.state.global_step = global_step
        steps.append(LiveMismatchMixin._live_step(fake))
    assert steps == expected


def _docs_block(marker: str) -> str:
    """The docs page's python block that holds ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS_PAGE.read_text(), flags=re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"{DOCS_PAGE}: {len(found)} python blocks hold {marker!r}"
    return found[0]


def test_the_docs_trl_example_runs_as_written(tmp_path, monkeypatch, one_torch_thread):
    """docs/live_and_recipes.md's TRL example is complete: run as written (in a fresh folder) it trains 2 GRPO steps
    on the CPU with ``hf_generate_rollout`` and writes one passing row per step."""
    code = _docs_block("rollout_func=hf_generate_rollout")
    assert "use_vllm" not in code and "..." not in code  # runnable as written: no placeholders, no vLLM
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    exec(compile(code, str(DOCS_PAGE), "exec"), {"__name__": "__docs__"})
    rows = read_metrics(tmp_path / "out" / "vexact" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and [r["trl/global_step"] for r in rows] == [0, 1]
    assert all(r["outcome"] == "ok" and r["live/gates_failed"] == 0 and r["gates"] for r in rows)
