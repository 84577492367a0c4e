"""How right each response form of the surge task is under a config's warm-started policy.

The surge needs the worked trace to pay: this measures it. On the config's first ``N`` held-out problems it samples
the policy (the config's warm start, loaded from its cache or trained) three ways at the config's temperature:
free (the policy's own choice; the share that starts a trace), forced direct (the response starts with ``=``),
and forced trace (the response starts with the trace's first token), and prints the reward of each and the mean
length. Run: ``python -m tools.studies.surge_modes CONFIG.yaml [N]``.
"""

from __future__ import annotations

import sys

import torch
from rich.console import Console

from vexact.engine.generation import generate
from vexact.engine.model import Transformer
from vexact.rl.config import ConfigError, load_config
from vexact.rl.tasks import EOS_ID, encode_prompt, held_out_problems, make_task
from vexact.rl.warmstart import warm_start


def form_rewards(config_path: str, n: int = 128, seed: int = 1) -> dict[str, dict[str, float]]:
    """{form: {"reward": mean reward, "length": mean response length}} for free / direct / trace, plus
    ``free["trace_share"]``: the share of free responses that do not start with ``=``."""
    cfg = load_config(config_path)
    task = make_task(cfg.task.name, cfg.task.min_len, cfg.task.max_len)
    tok = task.tokenizer
    model = Transformer(cfg.model.to_model_config(tok.vocab_size), backend=cfg.backend, dtype=torch.float32,
                        init_seed=cfg.policy_seed)
    warm_start(model, cfg, task, log=Console(stderr=True).print)
    problems = held_out_problems(task, n)
    equals = tok.encode("=")
    out: dict[str, dict[str, float]] = {}
    for form, first in (("free", lambda p: []), ("direct", lambda p: equals),
                        ("trace", lambda p: tok.encode(p.worked[0]))):
        prefixes = [first(p) for p in problems]
        gen = generate(model, [encode_prompt(tok, p) + f for p, f in zip(problems, prefixes)],
                       max_new_tokens=cfg.rollout.max_new_tokens - max(map(len, prefixes)),
                       temperature=cfg.rollout.temperature, seed=seed, eos_token_id=EOS_ID)
        responses = [f + r for f, r in zip(prefixes, gen.tokens)]
        out[form] = {"reward": sum(task.reward(p, r) for p, r in zip(problems, responses)) / n,
                     "length": sum(map(len, responses)) / n}
        if form == "free":
            out[form]["trace_share"] = sum(1 for r in responses if r[:1] != equals) / n
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m tools.studies.surge_modes CONFIG.yaml [N]", file=sys.stderr)
        return 2
    try:
        rows = form_rewards(args[0], int(args[1]) if len(args) == 2 else 128)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| form | reward | mean length |\n|:---|---:|---:|")
    for form, r in rows.items():
        print(f"| {form} | {r['reward']:.3f} | {r['length']:.2f} |")
    print(f"\nfree responses that start a trace: {rows['free']['trace_share']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
