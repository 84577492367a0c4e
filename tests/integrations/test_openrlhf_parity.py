"""Parity with OpenRLHF 0.11.2's own source: the layout ``vexact.integrations.openrlhf`` states is OpenRLHF's.

OpenRLHF imports deepspeed, ray, vllm and flash-attn when its package loads, so this test does not import the package
(``pip install --no-deps openrlhf==0.11.2``, which .ci/run does). Two kinds of check:

* run: the real ``Experience`` class, ``Experience.concat_experiences`` and
  ``SamplesGenerator._process_response_into_experience``, loaded from the installed files with stand-ins for the
  modules they import but never call (ray, vllm, tqdm, transformers, deepspeed, logging), build micro-batches from
  vLLM-like responses (one a two-turn agent sample, one cut at ``max_len``); ``experience_sides`` must read them as
  the module says (A = T - 1, right padding, column j scoring token T - A + j, the mask 1 on sampled tokens only).
  OpenRLHF's ``PolicyLoss`` runs beside vexact's ``rollout_correction`` for docs/reference/verl_trl.md's table;
* read: what needs Ray, a GPU or a model (``train_step``, ``make_experience_batch``, ``Actor.forward``,
  ``PolicyLoss``, the argument parser) is parsed with ``ast`` and its statements compared with what the module says.

``test_each_check_fails_on_a_changed_source`` runs every check on a copy of OpenRLHF's source with one plausible
change (a renamed field, left padding, a renamed flag, ...): no check passes whatever the source says. The
statements only OpenRLHF 0.11.1 and earlier make (``ENABLE_FLAG``, its correction types) were checked at 0.11.1, the
release this test read before (git history); the docs say which release each holds for.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import shutil
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import require_optional
from test_openrlhf import TABLE

from vexact.integrations import openrlhf as integration
from vexact.integrations.openrlhf import DUMP_KEYS, ENABLE_FLAG, LEVEL_FLAG, LEVEL_OFF, LEVEL_ON, experience_sides

OPENRLHF_VERSION = "0.11.2"
OPENRLHF_PIP = f"pip install --no-deps openrlhf=={OPENRLHF_VERSION} (.ci/run does)"
pytestmark = pytest.mark.needs_package("openrlhf", OPENRLHF_PIP)  # without it: one skip for the file (conftest.py)
ROLLOUT, TRAIN, MASK = DUMP_KEYS[:3]  # the Experience fields the module reads, besides sequences
PAD = 15  # not 0: right padding with the pad token is told apart from padding with 0
MAX_LEN = 9  # SamplesGenerator's truncate_length (generate_kwargs["max_len"]); one sample below is longer


@pytest.fixture(scope="module")
def root() -> Path:
    """The installed ``openrlhf`` folder, found without running its ``__init__``."""
    require_optional("openrlhf", OPENRLHF_PIP)
    version = importlib.metadata.version("openrlhf")
    if version != OPENRLHF_VERSION:
        pytest.fail(f"the parity test is written against OpenRLHF {OPENRLHF_VERSION}, found {version}")
    return Path(next(iter(importlib.util.find_spec("openrlhf").submodule_search_locations)))


# --- reading the source ---------------------------------------------------------------------------------------------

def _tree(root: Path, path: str | Path) -> ast.Module:
    with warnings.catch_warnings():  # OpenRLHF's own invalid escapes ("\\%" in a prompt string) are not our concern
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        return ast.parse((root / path).read_text())


def _node(tree: ast.AST, dotted: str) -> ast.AST:
    """The class or function ``A.b`` of ``tree``; an AssertionError naming it when it is not there."""
    node = tree
    for name in dotted.split("."):
        found = [n for n in ast.iter_child_nodes(node)
                 if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        assert found, f"OpenRLHF has no {dotted}"
        node = found[0]
    return node


def _code(source: str) -> str:
    """``source`` as ``ast.unparse`` writes it: quotes, spaces and line breaks no longer matter."""
    return ast.unparse(ast.parse(source))


def _statements(node: ast.AST) -> list[str]:
    """Every simple statement (no if/for/with/def, no docstring) under ``node``, unparsed, in source order."""
    compound = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def docstring(n: ast.stmt) -> bool:
        return isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)

    return [ast.unparse(n) for n in ast.walk(node)
            if isinstance(n, ast.stmt) and not isinstance(n, compound) and not docstring(n)]


def _has(node: ast.AST, *sources: str) -> None:
    statements = _statements(node)
    missing = [s for s in sources if _code(s) not in statements]
    assert not missing, f"{getattr(node, 'name', 'the file')} no longer says {missing}"


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name`` or ``x.name`` under ``node``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def _keyword(call: ast.Call, name: str) -> str | None:
    return next((ast.unparse(k.value) for k in call.keywords if k.arg == name), None)


def _flag_attribute(prefix: str, flag: str = LEVEL_FLAG) -> str:
    """A flag as the code reads it: ``--algo.advantage.is_correction_level`` -> ``<prefix>.algo.advantage...``."""
    return f"{prefix}.{flag.removeprefix('--')}"


def _declared(cli: ast.Module, flag: str) -> list[ast.Call]:
    """The parser's ``add_argument(flag, ...)`` calls."""
    return [c for c in _calls(cli, "add_argument") if c.args and ast.unparse(c.args[0]) == repr(flag)]


def _correction_flag(suffix: str) -> str:
    """A sibling of LEVEL_FLAG: ``_correction_flag("mode")`` is ``--algo.advantage.is_correction_mode``."""
    return f"{LEVEL_FLAG.removesuffix('level')}{suffix}"


def _default(cli: ast.Module, flag: str) -> object:
    """The parser's default for ``flag`` (declared once)."""
    declared = _declared(cli, flag)
    assert len(declared) == 1, f"{flag} is declared {len(declared)} times"
    return ast.literal_eval(_keyword(declared[0], "default"))


# --- running the source ---------------------------------------------------------------------------------------------

def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _exec(root: Path, files: dict[str, str], stand_ins: dict[str, types.ModuleType]) -> types.SimpleNamespace:
    """``files`` (module name: path under ``root``) executed in order, with ``stand_ins`` for what they import;
    sys.modules is left as it was (other tests may import the real transformers, tqdm or ray)."""
    saved = {name: sys.modules.get(name) for name in [*stand_ins, *files]}
    loaded = {}
    try:
        sys.modules.update(stand_ins)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # OpenRLHF's own, at import (torch.jit.script_method)
            for name, path in files.items():
                spec = importlib.util.spec_from_file_location(name, root / path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
                loaded[name.rsplit(".", 1)[1]] = module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return types.SimpleNamespace(**loaded)


def _load(root: Path) -> types.SimpleNamespace:
    """experience.py, samples_generator.py and utils/utils.py (zero_pad_sequences)."""
    stand_ins = {name: _module(name) for name in ("openrlhf", "openrlhf.utils", "openrlhf.trainer",
                                                  "openrlhf.trainer.ppo_utils", "openrlhf.trainer.ray", "ray")}
    stand_ins.update({
        "transformers": _module("transformers", AutoTokenizer=None),
        "tqdm": _module("tqdm", tqdm=lambda iterable=None, **kwargs: iterable),
        "vllm": _module("vllm", SamplingParams=dict),
        "openrlhf.trainer.ray.vllm_engine": _module("openrlhf.trainer.ray.vllm_engine", batch_vllm_engine_call=None),
        "openrlhf.utils.logging_utils": _module("openrlhf.utils.logging_utils", init_logger=logging.getLogger),
    })
    return _exec(root, {"openrlhf.utils.utils": "utils/utils.py",
                        "openrlhf.trainer.ppo_utils.experience": "trainer/ppo_utils/experience.py",
                        "openrlhf.trainer.ppo_utils.samples_generator": "trainer/ppo_utils/samples_generator.py"},
                 stand_ins)


def _response(prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> dict:
    """A finished rollout as utils/agent.py returns it (check_agent_rollout_fields reads that code): the tokens, the
    action ranges, vLLM's log-prob of each sampled token and 0.0 over the prompt and the environment's feedback."""
    tokens, ranges, log_probs = list(prompt), [], [0.0] * len(prompt)
    for action, feedback in turns:
        ranges.append((len(tokens), len(tokens) + len(action)))
        for token in action:
            log_probs.append(float(TABLE[tokens[-1], token]))
            tokens.append(token)
        tokens += feedback
        log_probs += [0.0] * len(feedback)
    return {"prompt": "", "label": "", "observation_tokens": tokens, "action_ranges": ranges,
            "rollout_log_probs": log_probs, "reward": 1.0, "scores": 1.0, "extra_logs": {}, "truncated": False}


RESPONSES = [[_response([3, 4, 5], [([6, 7, 8, 9], [])]), _response([2], [([5, 5], [11, 12]), ([13, 1, 2], [])])],
             [_response([7, 8], [([9], [])]), _response([1, 2], [([10, 11, 12, 13, 14, 6, 7, 8, 9], [])])]]
"""Two micro-batches: a two-turn agent sample in the first, a sample longer than MAX_LEN in the second."""


def _actor_log_probs(sequences: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Actor.forward on the bigram TABLE (check_actor_forward reads its statements)."""
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    log_probs = TABLE[sequences, rolled][:, :-1]
    return log_probs[:, -action_mask.shape[1]:] * action_mask.float()


def _micro_batches(root: Path) -> tuple[list, list[list]]:
    """OpenRLHF's micro-batches of RESPONSES (with the actor's log-probs) and each sample's Experience."""
    openrlhf = _load(root)
    process = openrlhf.samples_generator.SamplesGenerator._process_response_into_experience  # reads no self
    samples = [[process(None, response, max_len=MAX_LEN) for response in batch] for batch in RESPONSES]
    for sample in (s for batch in samples for s in batch):  # what Actor.forward's last-A-columns read relies on
        T, A = sample.sequences.shape[1], getattr(sample, MASK).shape[1]
        assert A == T - 1, f"A sample's {MASK} has {A} columns for {T} tokens: A = T - 1 no longer holds"
    batches = [openrlhf.experience.Experience.concat_experiences(batch, PAD) for batch in samples]
    for batch in batches:
        batch.action_log_probs = _actor_log_probs(batch.sequences, getattr(batch, MASK))
    return batches, samples


# --- the checks -----------------------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Path], None]] = {}


def check(function: Callable[[Path], None]) -> Callable[[Path], None]:
    CHECKS[function.__name__] = function
    return function


@check
def check_experience_fields(root: Path) -> None:
    """Experience has the fields the module reads: sequences [B, T], the other three [B, A] (its comments say)."""
    tree = _tree(root, "trainer/ppo_utils/experience.py")
    lines = (root / "trainer/ppo_utils/experience.py").read_text().splitlines()
    fields = {n.target.id: lines[n.lineno - 1] for n in _node(tree, "Experience").body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    shapes = {"sequences": "(B, T)", ROLLOUT: "(B, A)", TRAIN: "(B, A)", MASK: "(B, A)"}
    missing = sorted(set(shapes) - set(fields))
    assert not missing, f"Experience has no {missing}"
    assert all(shape in fields[name] for name, shape in shapes.items()), {n: fields[n] for n in shapes}


@check
def check_train_step_hook(root: Path) -> None:
    """The recipe's hook point: train_step's first list of experiences, a method the async trainer inherits."""
    _has(_node(_tree(root, "trainer/ppo_trainer.py"), "BasePPOTrainer.train_step"),
         "experiences = self.experience_maker.make_experience_batch(rollout_samples)")
    training_actor = _node(_tree(root, "trainer/ppo_trainer_async.py"), "TrainingActor")
    assert [ast.unparse(b) for b in training_actor.bases] == ["BasePPOTrainer"]
    assert "train_step" not in {n.name for n in training_actor.body if isinstance(n, ast.FunctionDef)}
    assert any(ast.unparse(c.func) == "self.train_step" for c in _calls(training_actor, "train_step"))


@check
def check_make_experience_batch_returns_micro_batches(root: Path) -> None:
    """make_experience_batch returns a list of Experience, one per micro-batch (concat_experiences of its samples)."""
    tree = _tree(root, "trainer/ppo_utils/experience_maker.py")
    for name in ("make_experience_batch", "make_experience", "compute_advantages_and_returns"):
        function = _node(tree, f"RemoteExperienceMaker.{name}")
        assert ast.unparse(function.returns) == "List[Experience]", (name, ast.unparse(function.returns))
    assert _statements(_node(tree, "RemoteExperienceMaker.make_experience_batch")) == [_code(s) for s in (
        "samples_list = self.split_rollout_samples(rollout_samples)",
        "experiences = self.make_experience(samples_list)",
        "experiences = self.compute_advantages_and_returns(experiences)", "return experiences")]
    split = _node(tree, "RemoteExperienceMaker.split_rollout_samples")
    assert _statements(split).count(_code("samples_list.append(concat_samples)")) == 2  # both ways of splitting
    assert len([c for c in _calls(split, "concat_experiences") if ast.unparse(c.func) ==
                "Experience.concat_experiences"]) == 2
    make = _node(tree, "RemoteExperienceMaker.make_experience")
    _has(make, f"samples.{TRAIN} = {TRAIN}", "return samples_list")


@check
def check_samples_and_micro_batches(root: Path) -> None:
    """Run: A = T - 1 per sample, float32 rollout log-probs, right padding (the pad token in sequences, 0 elsewhere);
    experience_sides then gives, at row n and column j, the token sequences[n, T - A + j] with vLLM's log-prob of it,
    the mask 1 exactly on the sampled tokens."""
    batches, samples = _micro_batches(root)
    for sample, response in zip((s for batch in samples for s in batch), (r for b in RESPONSES for r in b)):
        T = min(len(response["observation_tokens"]), MAX_LEN)
        assert sample.sequences.shape == (1, T) and getattr(sample, MASK).shape == (1, T - 1)
        assert getattr(sample, ROLLOUT).shape == (1, T - 1) and getattr(sample, ROLLOUT).dtype == torch.float32
    rollout, train, mask, tokens = experience_sides(batches)
    expected_mask = torch.zeros(mask.shape, dtype=torch.bool)
    scored, before = (torch.zeros(tokens.shape, dtype=torch.long) for _ in range(2))
    for n, response in enumerate(r for batch in RESPONSES for r in batch):
        seq = torch.tensor(response["observation_tokens"][:MAX_LEN])
        scored[n, :len(seq) - 1], before[n, :len(seq) - 1] = seq[1:], seq[:-1]  # column j scores token j + 1
        for start, end in response["action_ranges"]:
            expected_mask[n, start - 1:min(end, MAX_LEN) - 1] = True
    assert torch.equal(mask, expected_mask) and torch.equal(tokens[mask], scored[mask])
    assert torch.equal(rollout[mask], TABLE[before, scored][mask])  # vLLM's log-prob of that very token
    assert torch.equal(train[mask], rollout[mask]) and not rollout[~mask].any()
    for batch in batches:  # concat_experiences pads on the right: the pad token in sequences, 0 in the rest
        lengths = [int(n) for n in batch.attention_mask.sum(1)]
        for row, length in enumerate(lengths):
            assert (batch.sequences[row, length:] == PAD).all() and not batch.attention_mask[row, length:].any()
            assert not getattr(batch, MASK)[row, length - 1:].any()
            assert not getattr(batch, ROLLOUT)[row, length - 1:].any()


@check
def check_agent_rollout_fields(root: Path) -> None:
    """utils/agent.py (what _response imitates): action ranges cover the sampled tokens only; 0.0 is the rollout
    log-prob over the prompt and over the environment's feedback, in both the multi-turn and the single-turn path."""
    tree = _tree(root, "utils/agent.py")
    _has(tree, "action_start = len(current_obs_tokens)", "action_end = action_start + len(action_tokens)",
         "action_ranges.append((action_start, action_end))", "rollout_log_probs = [0.0] * len(current_obs_tokens)",
         "rollout_log_probs.append(logprob[action_tokens[i]].logprob)",
         "rollout_log_probs.extend([0.0] * len(feedback_tokens))",
         "current_obs_tokens = current_obs_tokens + action_tokens + feedback_tokens",
         "observation_token_ids = prompt_token_ids + action_token_ids",
         "action_ranges = [(len(prompt_token_ids), len(observation_token_ids))]",
         "rollout_log_probs = [0.0] * len(prompt_token_ids)")


@check
def check_enable_flag(root: Path) -> None:
    """LEVEL_FLAG (default LEVEL_OFF, LEVEL_ON a choice) is the one switch that asks vLLM for log-probs (logprobs=1,
    an engine with logprobs_mode='processed_logprobs': after temperature) at any level but off; otherwise
    rollout_log_probs stays None. The older switches are gone (the parser rejects them), and LEVEL_ON with the other
    correction flags at their defaults is a setting PolicyLoss accepts."""
    cli = _tree(root, "cli/train_ppo_ray.py")
    declared = _declared(cli, LEVEL_FLAG)
    assert len(declared) == 1 and _default(cli, LEVEL_FLAG) == LEVEL_OFF, f"{LEVEL_FLAG} is not declared, default off"
    assert {LEVEL_OFF, LEVEL_ON} <= set(ast.literal_eval(_keyword(declared[0], "choices")))
    assert not _declared(cli, ENABLE_FLAG) and not _declared(cli, integration.OLD_ENABLE_FLAG)
    engines = _calls(cli, "create_vllm_engines")
    assert len(engines) == 1 and _code(f"'processed_logprobs' if {_flag_attribute('args')} != {LEVEL_OFF!r} else None"
                                       ) in [ast.unparse(a) for a in engines[0].args]
    sampling = [c for path in sorted(root.rglob("*.py")) for c in _calls(_tree(root, path), "SamplingParams")]
    on = _code(f"1 if {_flag_attribute('self.args')} != {LEVEL_OFF!r} else None")
    asked = [_keyword(c, "logprobs") for c in sampling]
    assert asked and all(a == on for a in asked), asked
    process = _node(_tree(root, "trainer/ppo_utils/samples_generator.py"),
                    "SamplesGenerator._process_response_into_experience")
    _has(process, f"{ROLLOUT} = None")
    defaults = {name: _default(cli, _correction_flag(name)) for name in ("mode", "gating", "threshold")}
    try:
        _policy_loss(root, level=LEVEL_ON, **defaults)
    except ValueError as error:
        raise AssertionError(f"PolicyLoss refuses {LEVEL_FLAG} {LEVEL_ON} with the defaults {defaults}") from error


@check
def check_actor_forward(root: Path) -> None:
    """Actor.forward (what _actor_log_probs does): float32 logits divided by the temperature (--rollout.temperature),
    the log-prob of the next token, the last A columns times the mask; PolicyModelActor runs it without grad."""
    _has(_node(_tree(root, "models/actor.py"), "Actor.forward"),
         "output['logits'] = output['logits'].to(torch.float32)", "output['logits'].div_(self.temperature)",
         "rolled_sequences = torch.roll(sequences, shifts=-1, dims=1)",
         "log_probs = log_probs_from_logits(output['logits'], rolled_sequences)", "log_probs = log_probs[:, :-1]",
         "action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()")
    actors = _tree(root, "trainer/ray/ppo_actor.py")
    forward = _node(actors, "PolicyModelActor.forward")
    no_grad = [w for w in ast.walk(forward) if isinstance(w, ast.With)
               and [ast.unparse(i.context_expr) for i in w.items] == ["torch.no_grad()"]]
    assert no_grad and any(s.startswith(f"{TRAIN} = self.actor(") for s in _statements(no_grad[0]))
    built = [n.value for n in ast.walk(_node(actors, "PolicyModelActor")) if isinstance(n, ast.Assign)
             and ast.unparse(n).startswith("actor = Actor(")]  # self.actor (the EMA copy never runs forward here)
    assert len(built) == 1 and _keyword(built[0], "temperature") == "strategy.args.rollout.temperature"


@check
def check_correction_ratio(root: Path) -> None:
    """PolicyLoss weighs the loss by exp(old_log_probs - rollout_log_probs), clamped or masked, and the actor passes it
    Experience's action_log_probs as old_log_probs: the ratio compare reports as mismatch/ratio_*."""
    loss = _node(_tree(root, "models/loss.py"), "PolicyLoss.forward")
    _has(loss, f"is_log_ratio = (old_log_probs - {ROLLOUT}).detach()", "token_is = is_log_ratio.exp()")
    step = _node(_tree(root, "trainer/ray/ppo_actor.py"), "ActorPPOTrainer.training_step")
    _has(step, f"old_action_log_probs = experience.{TRAIN}")
    call = [c for c in _calls(step, "actor_loss_fn")]
    assert len(call) == 1 and ast.unparse(call[0].args[1]) == "old_action_log_probs"
    assert _keyword(call[0], ROLLOUT) == f"experience.{ROLLOUT}" and _keyword(call[0], "action_mask") == (
        f"experience.{MASK}")


def _policy_loss(root: Path, level: str, mode: str = "mask", gating: str = "ratio",
                 threshold: tuple[float, float] | list[float] = (0.5, 5.0)) -> Callable:
    """OpenRLHF's PolicyLoss for ``--algo.advantage.is_correction_level level``, ``_mode``, ``_gating`` and
    ``_threshold`` (two values: the parser makes one value b [0.0, b]), loaded from its files."""
    stand_ins = {name: _module(name) for name in ("openrlhf", "openrlhf.models", "deepspeed")}
    openrlhf = _exec(root, {"openrlhf.models.utils": "models/utils.py", "openrlhf.models.loss": "models/loss.py"},
                     stand_ins)
    openrlhf.loss.aggregate_loss = lambda loss, mask, **kwargs: loss  # the loss per token: the reduction only
    return openrlhf.loss.PolicyLoss(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                                    is_correction_threshold=list(threshold))


def _openrlhf_weights(root: Path, train: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor,
                      **settings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the weight PolicyLoss puts on each token's loss, vllm_kl, is_filter_ratio) for ``settings`` (see
    _policy_loss): log_probs = old_log_probs and advantages -1 make each token's clipped PPO loss exactly 1."""
    loss, _, _, vllm_kl, filtered = _policy_loss(root, **settings)(train, train, -torch.ones_like(train),
                                                                   action_mask=mask, rollout_log_probs=roll)
    return loss, vllm_kl, filtered


@check
def check_correction_types(root: Path) -> None:
    """docs/reference/verl_trl.md's OpenRLHF table, on OpenRLHF's own PolicyLoss and vexact's rollout_correction:
    level token (mask, ratio: the defaults) is vexact's icepop; clip with one threshold b is token_tis, with a b it
    also clamps below; level seq rejects geo_rs's sequences but weighs kept tokens by the raw ratio; binary_kl and tv
    gate on the sampled token's probabilities, with one upper bound; vllm_kl is rollout_corr/kl; is_filter_ratio is
    vexact's zeroed, truncated or rejected fraction."""
    from vexact.rl.config_schema import CorrectionSection
    from vexact.rl.corrections import rollout_correction
    from vexact.rl.metrics import mismatch_metrics

    gen = torch.Generator().manual_seed(0)
    lengths = [6, 8, 3, 8, 5]
    mask = (torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]).long()
    train = -torch.rand(len(lengths), 8, generator=gen, dtype=torch.float64) * 3
    shift = torch.tensor([0.0, 0.5, -0.6, 0.02, 0.0], dtype=torch.float64)[:, None]  # rows 1, 2 leave the band
    roll = train + shift + torch.randn(train.shape, generator=gen, dtype=torch.float64) * torch.tensor(
        [1.5, 0.01, 0.01, 0.01, 0.01], dtype=torch.float64)[:, None]  # row 0: ratios in and out of [0.5, 5]
    keep = mask.bool()
    ratio = torch.exp(train - roll)[keep]

    def ours(**settings) -> object:
        return rollout_correction(train[keep], roll[keep], lengths, CorrectionSection(**settings))

    def fraction(correction: object, key: str) -> torch.Tensor:  # OpenRLHF counts in float32 (filtered.float())
        return torch.tensor(correction.metrics[f"correction/{key}"], dtype=torch.float32)

    cli = _tree(root, "cli/train_ppo_ray.py")
    assert _default(cli, _correction_flag("threshold")) == [0.5, 5.0], "the default band [a, b]"
    assert _default(cli, _correction_flag("mode")) == "mask" and _default(cli, _correction_flag("gating")) == "ratio"
    _has(cli, "threshold.insert(0, 0.0)")  # one value b is the band [0, b]
    theirs, _, filtered = _openrlhf_weights(root, train, roll, mask, level="token")
    icepop = ours(method="icepop", band=(0.5, 5.0))
    assert ((ratio < 0.5) | (ratio > 5.0)).any() and torch.equal(theirs[keep], icepop.weights), "icepop"
    assert icepop.keep.all()  # zeroed, not rejected: in the loss's denominator, as OpenRLHF's action_mask keeps them
    assert torch.equal(filtered, fraction(icepop, "zeroed_token_frac")), "is_filter_ratio: zeroed tokens"
    theirs, _, filtered = _openrlhf_weights(root, train, roll, mask, level="token", mode="clip", threshold=(0.0, 1.5))
    tis = ours(method="token_tis", threshold=1.5)
    assert (ratio > 1.5).any() and torch.equal(theirs[keep], tis.weights), "clip, one threshold: min(ρ, b)"
    assert torch.equal(filtered, fraction(tis, "truncated_token_frac")), "is_filter_ratio: truncated tokens"
    theirs, _, _ = _openrlhf_weights(root, train, roll, mask, level="token", mode="clip", threshold=(0.5, 1.5))
    low = ratio < 0.5
    assert low.any() and torch.equal(theirs[keep][~low], tis.weights[~low]), "clip: the same where no ratio < a"
    assert (theirs[keep][low] == 0.5).all(), "clip, a b: clamp(ρ, a, b)"
    theirs, vllm_kl, filtered = _openrlhf_weights(root, train, roll, mask, level="seq", threshold=(0.8, 1.25))
    geo = ours(method="geo_rs", band=(0.8, 1.25))
    kept = theirs[keep] != 0
    assert torch.equal(kept, geo.keep) and not kept.all() and kept.any(), "level seq rejects geo_rs's sequences"
    assert torch.equal(theirs[keep][kept], ratio[kept]) and (geo.weights[geo.keep] == 1).all(), "kept: ρ_t vs 1"
    assert torch.equal(filtered, fraction(geo, "rejected_seq_frac")), "is_filter_ratio: rejected sequences"
    kl = mismatch_metrics([t[m] for t, m in zip(train, keep)], [r[m] for r, m in zip(roll, keep)])["rollout_corr/kl"]
    assert abs(float(vllm_kl) - kl) <= 1e-12 * abs(kl), (float(vllm_kl), kl)  # the same mean, summed in another order
    # the trust regions: KL(Bern(μ_t) || Bern(π_t)) or |μ_t - π_t| of the sampled token's probabilities (clamped to
    # [1e-6, 1 - 1e-6]), per token or as a sequence's mean, kept at most δ; kept tokens weighed by ρ_t
    p, q = roll.exp().clamp(1e-6, 1 - 1e-6), train.exp().clamp(1e-6, 1 - 1e-6)
    divergences = {"binary_kl": p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log(), "tv": (p - q).abs()}
    for gating, level in (("binary_kl", "seq"), ("tv", "token"), ("binary_kl", "token")):
        stat = divergences[gating]
        if level == "seq":
            stat = ((stat * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(stat)
        values = stat[keep].unique()  # sorted
        delta = float(values[len(values) // 2 - 1:len(values) // 2 + 1].mean())  # between two units: some kept
        theirs, _, _ = _openrlhf_weights(root, train, roll, mask, level=level, gating=gating, threshold=(0.0, delta))
        inside = stat[keep] <= delta
        assert inside.any() and not inside.all() and torch.equal(theirs[keep] != 0, inside), (gating, level)
        assert torch.equal(theirs[keep][inside], ratio[inside]), (gating, level, "kept: ρ_t")
        try:
            _policy_loss(root, level=level, gating=gating, threshold=(0.5, 5.0))
        except ValueError:
            continue
        raise AssertionError(f"gating {gating} took a lower bound: it takes one threshold δ")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_openrlhf_says_what_the_module_states(root, name):
    CHECKS[name](root)


# (check, file, what OpenRLHF 0.11.2 says, a plausible change in a later release)
MUTATIONS = [
    ("check_experience_fields", "trainer/ppo_utils/experience.py", "rollout_log_probs: torch.Tensor",
     "vllm_log_probs: torch.Tensor"),
    ("check_experience_fields", "trainer/ppo_utils/experience.py", "# (B, A) mask over action", "# (B, T) mask"),
    ("check_train_step_hook", "trainer/ppo_trainer.py", "experiences = self.experience_maker.make_experience_batch(",
     "experiences = self.experience_maker.make_experiences("),
    ("check_train_step_hook", "trainer/ppo_trainer_async.py", "class TrainingActor(BasePPOTrainer):",
     "class TrainingActor:"),
    ("check_make_experience_batch_returns_micro_batches", "trainer/ppo_utils/experience_maker.py",
     "experiences = self.compute_advantages_and_returns(experiences)\n        return experiences",
     "experiences = self.compute_advantages_and_returns(experiences)\n        return experiences[0]"),
    ("check_make_experience_batch_returns_micro_batches", "trainer/ppo_utils/experience_maker.py",
     "samples.action_log_probs = action_log_probs", "samples.old_action_log_probs = action_log_probs"),
    ("check_samples_and_micro_batches", "trainer/ppo_utils/samples_generator.py",
     'action_mask = action_mask[1:truncate_length].to("cpu")', 'action_mask = action_mask[:truncate_length].to("cpu")'),
    ("check_samples_and_micro_batches", "trainer/ppo_utils/samples_generator.py",
     'torch.tensor(response["rollout_log_probs"][1:truncate_length])',
     'torch.tensor(response["rollout_log_probs"][1:truncate_length], dtype=torch.float64)'),
    ("check_samples_and_micro_batches", "trainer/ppo_utils/experience.py",
     'zero_pad_sequences(items, side="right", value=pad_value)',
     'zero_pad_sequences(items, side="left", value=pad_value)'),
    ("check_samples_and_micro_batches", "trainer/ppo_utils/experience.py",
     'pad_value = pad_token_id if field == "sequences" else 0', "pad_value = 0"),
    ("check_agent_rollout_fields", "utils/agent.py", "rollout_log_probs.extend([0.0] * len(feedback_tokens))",
     "rollout_log_probs.extend([float('nan')] * len(feedback_tokens))"),
    ("check_agent_rollout_fields", "utils/agent.py", "rollout_log_probs = [0.0] * len(prompt_token_ids)",
     "rollout_log_probs = []"),
    ("check_enable_flag", "cli/train_ppo_ray.py", '"--algo.advantage.is_correction_level",',
     '"--algo.advantage.is_correction_granularity",'),  # a renamed switch, as 0.11.2 renamed 0.11.1's
    ("check_enable_flag", "cli/train_ppo_ray.py", 'default="off",\n        choices=["off", "token", "seq"]',
     'default="token",\n        choices=["off", "token", "seq"]'),
    ("check_enable_flag", "trainer/ppo_utils/samples_generator.py",
     'logprobs=1 if self.args.algo.advantage.is_correction_level != "off" else None', "logprobs=1"),
    ("check_enable_flag", "cli/train_ppo_ray.py", '"processed_logprobs" if', '"raw_logprobs" if'),
    ("check_enable_flag", "models/loss.py", 'if is_correction_level not in {"off", "token", "seq"}:',
     'if is_correction_level not in {"off", "seq"}:'),
    ("check_actor_forward", "models/actor.py", "log_probs[:, -action_mask.shape[1] :]",
     "log_probs[:, : action_mask.shape[1]]"),
    ("check_actor_forward", "models/actor.py", 'output["logits"].div_(self.temperature)', "pass"),
    ("check_actor_forward", "trainer/ray/ppo_actor.py", "        with torch.no_grad():\n            action_log_probs",
     "        if True:\n            action_log_probs"),
    ("check_correction_types", "models/loss.py", "coef = stat.clamp(min=low, max=high)",
     "coef = stat.clamp(max=high)"),
    ("check_correction_types", "models/loss.py", "coef = torch.where(keep, token_is, 0.0)", "coef = keep.float()"),
    ("check_correction_types", "models/loss.py", "coef = torch.where(keep, token_is, 0.0)",
     "coef = torch.where(keep, token_is, low)"),
    ("check_correction_types", "models/loss.py",
     "masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None)",
     "masked_mean(old_log_probs - rollout_log_probs, action_mask, dim=None)"),
    ("check_correction_types", "models/loss.py", "is_filter_ratio = filtered.float().mean()",
     "is_filter_ratio = masked_mean(filtered.float().expand_as(action_mask), action_mask, dim=None)"),
    ("check_correction_types", "models/loss.py", "stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()",
     "stat = p * (p / q).log()"),
    ("check_correction_types", "models/loss.py", "stat = (p - q).abs()", "stat = (p.log() - q.log()).abs()"),
    ("check_correction_types", "models/loss.py", "and is_correction_threshold[0] > 0:",
     "and is_correction_threshold[0] > 1:"),
    ("check_correction_types", "cli/train_ppo_ray.py", "default=[0.5, 5.0]", "default=[0.8, 1.25]"),
    ("check_correction_types", "cli/train_ppo_ray.py", 'default="mask",', 'default="clip",'),
    ("check_correction_types", "cli/train_ppo_ray.py", "threshold.insert(0, 0.0)", "threshold.insert(0, 0.5)"),
    ("check_correction_ratio", "models/loss.py", "is_log_ratio = (old_log_probs - rollout_log_probs).detach()",
     "is_log_ratio = (log_probs - rollout_log_probs).detach()"),
    ("check_correction_ratio", "trainer/ray/ppo_actor.py", "rollout_log_probs=experience.rollout_log_probs",
     "rollout_log_probs=experience.base_action_log_probs"),
]


@pytest.mark.parametrize("name,path,said,changed", MUTATIONS)
def test_each_check_fails_on_a_changed_source(root, tmp_path, name, path, said, changed):
    copy = tmp_path / "openrlhf"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / path).read_text()
    assert text.count(said) == 1, f"{path} says {said!r} {text.count(said)} times"
    (copy / path).write_text(text.replace(said, changed))
    with pytest.raises(AssertionError):
        CHECKS[name](copy)


def test_every_check_has_a_changed_source():
    assert {m[0] for m in MUTATIONS} == set(CHECKS)
