"""vexact.integrations.trl: a real TRL ``GRPOTrainer`` (tiny random Qwen2, tokenizer built here, CPU, no hub) with
the live monitor mixed in.

The rollout side comes from a ``rollout_func`` -- the hook TRL gives custom engines (SGLang, a server) -- that
samples with transformers' ``generate`` (KV cache, one token at a time) and returns each sampled token's log-prob
from the processed scores; the training side is TRL's full-sequence forward. So the two differ the way a real
engine and trainer do, and the test checks that the hook hands the monitor exactly those tensors."""

from __future__ import annotations

import math

import pytest
import torch

from vexact.live import Gates, LiveMonitor
from vexact.real.measure import mismatch_report
from vexact.rl.runlog import read_metrics

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


class KVCacheRollout:
    """TRL's ``rollout_func``: sample with ``generate`` and return each sampled token's log_softmax(raw logits / T)
    -- what an engine reports after temperature (the HF recipe of docs/tutorials/own_engine.md; top-k/top-p off)."""

    def __init__(self, tokenizer, temperature: float = 1.0):
        self.tokenizer, self.temperature, self.returned = tokenizer, temperature, []

    def __call__(self, prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            ids = self.tokenizer(prompt)["input_ids"]
            attention = torch.ones(1, len(ids), dtype=torch.long)
            with torch.no_grad():
                gen = trainer.model.generate(torch.tensor([ids]), attention_mask=attention, do_sample=True,
                                             max_new_tokens=6, output_logits=True, return_dict_in_generate=True,
                                             temperature=self.temperature, top_k=0, top_p=1.0, pad_token_id=0,
                                             eos_token_id=1)
            completion = gen.sequences[0, len(ids):]
            logits = torch.stack(gen.logits)[:, 0].float() / self.temperature
            logps = torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0].tolist()
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion.tolist())
            out["logprobs"].append(logps)
        self.returned.append(out["logprobs"])
        return out


def _trainer(tmp_path, monitor, cls=None, **config):
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.x
    from datasets import Dataset
    from trl import GRPOConfig

    from vexact.integrations.trl import LiveGRPOTrainer

    tokenizer = _tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **config)
    rollout = KVCacheRollout(tokenizer, config.get("temperature", 1.0))
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
    from safetensors.torch import save_file
    from trl import GRPOTrainer

    from vexact.integrations.trl import LiveMismatchMixin, batch_sides
    from vexact.real.compare import CompareSettings, run_compare

    seen = []
    dumps = tmp_path / "dumps"
    dumps.mkdir()

    class Capturing(LiveMismatchMixin, GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            seen.append(output)
            if self.model.training and self.accelerator.is_main_process:  # the recipe, as documented
                rollout, train, mask = batch_sides(self, output)
                save_file({"rollout_log_probs": rollout.detach().cpu().contiguous(),
                           "old_log_probs": train.detach().cpu().contiguous(),
                           "response_mask": mask.cpu().contiguous(),
                           "responses": output["completion_ids"].cpu().contiguous()},
                          str(dumps / f"step{self.state.global_step}.safetensors"))
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
