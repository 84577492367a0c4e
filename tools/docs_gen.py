"""The documentation's reference pages, generated from the code so they cannot drift.

The reference pages are written from the objects that define them, never by hand:

* the CLI reference, by walking ``vexact.cli.build_parser()`` (every subcommand and flag; ``vexact bench``'s
  benchmarks from their own ``add_arguments`` where the ``benchmarks`` package is importable);
* the config reference, by walking the ``RunConfig`` dataclasses of ``vexact.rl.config_schema`` (types, defaults,
  bounds; a field's description is the comment beside it in the source, for a key an extension's settings brought
  the comment in the settings class, with the entries it comes from) and the other spellings of keys and values
  (``vexact.rl.config_spellings``), and the tables of registered choices (every registry of
  ``vexact.rl.registries``, with the keys each entry's settings bring);
* the metric reference, from the registry ``vexact.metric_keys``;
* the kernel op contracts, one mkdocstrings block per op of ``vexact_kernels.OP_NAMES``.

The generated text is committed, so the pages read whole on a code host too: in a page, a region
``<!-- vexact-docs: NAME -->`` ... ``<!-- end vexact-docs: NAME -->`` (``NAME`` one of ``PAGES``) holds the text
the generator gives now. ``python -m tools.docs_gen --update`` rewrites every region under ``docs/``;
``python -m tools.docs_gen --check`` exits 1 naming each stale region (``tests/docs/test_docs.py`` runs it, so a change
of a flag, key or metric that leaves its page behind fails the tests). ``mkdocs build`` calls
:func:`on_page_markdown` (this file is listed under ``hooks:`` in ``mkdocs.yml``), which refreshes the regions the
same way (a bare start marker, without its end, is filled too). ``python -m tools.docs_gen DIR`` writes the pages
as plain markdown files, to read or diff them. ``tests/docs/test_docs.py`` also checks that every flag, key and metric
appears.

Imports are absolute: mkdocs loads this file by path, outside the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import logging
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from vexact.registry import RegisteredName, mounts
from vexact.sweeps.markdown_table import markdown_table

__all__ = ["PAGES", "choices_markdown", "cli_flags", "cli_markdown", "config_keys", "config_markdown", "expand",
           "metrics_markdown", "on_config", "on_page_markdown", "stale_pages", "update_pages"]

MARKER = re.compile(r"^<!-- vexact-docs: (\w+) -->$", re.MULTILINE)
END = "<!-- end vexact-docs: {} -->"
REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _load_own_extensions() -> None:
    """Import the modules vexact itself lists in the ``vexact.plugins`` entry-point group (its built-in extensions
    above ``vexact.rl``: ``rollout.engine: vllm``), so the reference shows the product as installed, and no other
    distribution's plugins, whatever this environment holds."""
    from importlib.metadata import entry_points

    from vexact.rl.plugins import ENTRY_POINT_GROUP

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if getattr(entry.dist, "name", None) == "vexact":
            entry.load()


_load_own_extensions()


def _cell(text: object) -> str:
    """Text for one table cell on one line (``markdown_table``, the one table writer, escapes ``|``)."""
    return " ".join(str(text).split())


def _code(text: object) -> str:
    return f"`{text}`"


# --- CLI ---------------------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(command path, parser, one-line help) for every subcommand below ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                path = f"{prefix} {name}"
                yield path, sub, helps.get(name, "")
                yield from _subcommands(sub, path)


def _benchmark_parsers(bench: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``vexact bench WHICH``'s own options, read from ``benchmarks.WHICH.add_arguments`` (repository checkouts
    only: ``benchmarks`` is not part of the installed package)."""
    which = next((a for a in bench._actions if a.dest == "which"), None)
    for name in (which.choices if which is not None and which.choices else ()):
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ImportError:
            continue
        add = getattr(module, "add_arguments", None)
        if add is None:
            continue
        parser = argparse.ArgumentParser(prog=f"vexact bench {name}", add_help=False)
        add(parser)
        yield f"vexact bench {name}", parser


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    params = {"default": action.default, "prog": "vexact", "dest": action.dest,
              "choices": ", ".join(map(str, action.choices or ()))}
    try:
        return text % params
    except (KeyError, TypeError, ValueError):
        return text


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
                           argparse._VersionAction)) or action.default in (None, argparse.SUPPRESS, [], ()):
        return ""
    default = action.default
    if isinstance(default, Path) and default.is_absolute() and default.is_relative_to(REPO):
        default = default.relative_to(REPO)  # a repository file: the same text in every checkout
    return _code(default)


def _flag_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(_code(o) for o in action.option_strings) or _code(action.metavar or action.dest)
        choices = ", ".join(map(str, action.choices)) if action.choices else ""
        rows.append([names, _default(action), _cell(choices), _cell(_help(action))])
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().split())[len("usage: "):]


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    from vexact.cli import build_parser

    root = build_parser()
    yield "vexact", root, root.description or ""
    for path, sub, text in _subcommands(root, "vexact"):
        yield path, sub, text
        if path == "vexact bench":
            for bench_path, bench in _benchmark_parsers(sub):
                yield bench_path, bench, bench.description or f"options of {bench_path}"


def cli_markdown() -> str:
    """The CLI reference: every command's usage and a table of its flags (default, choices, help)."""
    out = ["Generated from `vexact.cli.build_parser()` by `python -m tools.docs_gen --update` (a test fails when "
           "this page is stale); `vexact COMMAND --help` prints the same. Exit codes: see "
           "[Failure behaviour](failure.md).", ""]
    for path, parser, text in _parsers():
        out += [f"## `{path}`", ""]
        if text:
            out += [_cell(text), ""]
        out += ["```text", _usage(parser), "```", ""]
        rows = _flag_rows(parser)
        if rows:
            out += [markdown_table(["flag", "default", "choices", "help"], rows), ""]
    return "\n".join(out)


def cli_flags() -> dict[str, set[str]]:
    """{command path: its option strings and positional names}, for the completeness test."""
    flags: dict[str, set[str]] = {}
    for path, parser, _ in _parsers():
        names = set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            names |= set(action.option_strings) or {action.metavar or action.dest}
        flags[path] = names
    return flags


# --- config keys -------------------------------------------------------------------------------------------

_FIELD = re.compile(r"^(\s+)(\w+)\s*:")


def _field_comments(cls: type) -> dict[str, str]:
    """{field name: the comment beside it (or the comment lines just above it)} from the class's source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    indent = None
    for line in source.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        match = _FIELD.match(line)
        if match and (indent is None or match.group(1) == indent) and not stripped.startswith(("def ", "@")):
            indent = match.group(1)
            code, _, comment = line.partition("  # ")
            text = comment.strip() if "=" in code or ":" in code else ""
            out[match.group(2)] = text or " ".join(above)
        above = []
    return out

_DESCRIPTIONS = {
    "name": "run name; the run directory is runs/<name> unless output_dir is set",
    "seed": "seed of everything random (keyed by seed and step)",
    "steps": "RL steps",
    "output_dir": "run directory (null = runs/<name>)",
    "threads": "torch threads (null = torch's default); a run gives the same bits at any thread count",
    "model.preset": "named shape (vexact.engine.presets.MODEL_PRESETS); explicit model keys win over it",
    "model.hidden_size": "hidden size", "model.num_layers": "decoder layers", "model.num_heads": "attention heads",
    "model.num_kv_heads": "key/value heads (grouped-query attention)",
    "model.intermediate_size": "MLP intermediate size", "model.max_seq_len": "longest prompt + response",
    "model.head_dim": "null = hidden_size / num_heads", "model.rope_theta": "RoPE base",
    "model.rms_norm_eps": "RMSNorm epsilon", "model.tie_embeddings": "LM head shares the embedding",
    "task.min_len": "shortest problem (the difficulty knob)", "task.max_len": "longest problem",
    "task.partial_credit": "reward a partly right answer",
    "warm_start.lr": "learning rate of the supervised warm start", "warm_start.batch_size": "examples per step",
    "rollout.prompts_per_step": "problems sampled per RL step",
    "rollout.samples_per_prompt": "responses per problem (the GRPO group)",
    "rollout.temperature": "sampling temperature (0 = greedy)", "rollout.max_new_tokens": "longest response",
    "rollout.batch_size": "generation batch (null = all at once)",
    "rollout.backend": "rollout kernel backend (null = the training backend)",
    "rollout.dtype": "rollout dtype (null = the training dtype)",
    "algorithm.old_logprobs": "PPO anchor: the rollout's log-probs (bypass) or recomputed by the training path",
    "algorithm.advantage": "group advantage estimator (reinforce = batch-mean baseline)",
    "algorithm.std_normalize": "divide group advantages by their standard deviation",
    "algorithm.clip_low": "lower clip range of the ratio (1 - clip_low)",
    "algorithm.clip_high": "upper clip range (1 + clip_high, clip-higher)",
    "algorithm.loss_agg": "token mean over the batch, or mean over sequences of token means",
    "algorithm.kl_coef": "k3 penalty against the step-0 policy, in the loss",
    "algorithm.entropy_coef": "entropy bonus", "algorithm.mini_batches": "PPO mini-batches per step",
    "algorithm.ppo_epochs": "passes over the step's batch",
    "algorithm.micro_batch_size": "sequences per forward/backward within a leaf (null = the whole leaf); with "
                                  "algorithm.grad_unit set it only batches the passes without grad",
    "optimizer.lr": "AdamW learning rate", "optimizer.betas": "AdamW betas", "optimizer.eps": "AdamW epsilon",
    "optimizer.weight_decay": "AdamW weight decay", "optimizer.warmup_steps": "linear warm-up steps",
    "optimizer.master_dtype": "dtype of the master weights AdamW updates (a bf16 dtype computes in a bf16 copy)",
    "logging.checkpoint_every": "checkpoint every N steps (and at the end; the newest two are kept)",
    "logging.live": "rich progress bar with ETA, reward, length, k3 KL, bitwise-equal fraction",
    "logging.eval_every": "clean evaluation every N steps",
    "logging.backends": "jsonl (required) plus live views (the log backends below)",
    "inject.mode": "how the rollout path is perturbed (none = exact)",
    "inject.value": "the old spelling of the mode's knob: set it by the mode's own key (`inject.sigma`, "
                    "`inject.epsilon`, `inject.top_p`, `inject.top_k`, `inject.flip_rate`: the injection modes "
                    "table), which the config stores; `inject.value` still reads, with a `FutureWarning` (in a "
                    "sweep file without one: it names the points' folders); 0 is a bitwise no-op",
    "inject.scope": "which vocabulary entries or positions are perturbed",
    "inject.calibration_prompts": "prompts of the calibration batch (with target)",
    "inject.target.metric": "the metric the calibration aims at",
    "inject.target.value": "its value on the calibration batch (required)",
    "correction.method": "vexact's shorthand for a correction",
    "correction.rollout_is": "verl: importance-sampling level", "correction.rollout_is_batch_normalize":
    "verl: divide the weights by their mean",
    "lr_schedule.kind": "schedule on top of optimizer.lr and its warm-up",
    "distributed.leaves": "each mini-batch gradient is the fixed-tree sum of this many leaves",
    "distributed.reduce": "tree (bitwise equal for every rank count) or allreduce",
}
"""Descriptions of the config fields that have no comment beside them in the source (the comment wins).
Left for later: move these into ``vexact/rl/config_schema.py`` as field comments."""


def _slug(title: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " | ".join(_code(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, RegisteredName):  # the registry's names when the docs are built
        return " | ".join(_code(a) for a in tp.registry.names())
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(parts) + (" | null" if type(None) in args else "")
    if origin in (list, tuple):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


_BOUND_WORDS = {"min": "≥", "gt": ">", "max": "≤", "lt": "<"}


def _bounds(meta: Any) -> str:
    return ", ".join(f"{_BOUND_WORDS[k]} {v}" for k, v in meta.items() if k in _BOUND_WORDS)


def _default_of(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return ""
    else:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        value = list(value)
    return _code(value)


def _sections() -> Iterator[tuple[str, type]]:
    """(dotted prefix, dataclass) of ``RunConfig`` and every section below it (optional ones too)."""
    from vexact.rl.config_schema import RunConfig

    todo: list[tuple[str, type]] = [("", RunConfig)]
    while todo:
        prefix, cls = todo.pop(0)
        yield prefix, cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
            if inner:
                todo.append((f"{prefix}{f.name}.", inner[0]))


def _comment_source(cls: type) -> type:
    """The class whose source documents ``cls``'s fields: ``ModelSection`` is built from ``ModelConfig``."""
    if cls.__name__ == "ModelSection":
        from vexact.engine.model import ModelConfig

        return ModelConfig
    return cls


def config_keys() -> list[str]:
    """Every dotted config key (leaves and sections), for the completeness test."""
    keys = []
    for prefix, cls in _sections():
        keys += [prefix + f.name for f in dataclasses.fields(cls)]
    return keys


def config_markdown() -> str:
    """The config reference: one table per section (key, type, default, bounds, description)."""
    from vexact.rl import config_spellings

    out = []
    for prefix, cls in _sections():
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        out += [f"## {title}", ""]
        doc = inspect.getdoc(cls) or ""
        if doc:
            out += [" ".join(doc.split("\n\n")[0].split()), ""]
        hints = typing.get_type_hints(cls)
        comments = _field_comments(_comment_source(cls))
        mounted = mounts(cls)
        rows = []
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if f.name in mounted:  # a key an extension's settings brought: documented beside its declaration
                text = _field_comments(mounted[f.name].declared_in).get(f.name) or _DESCRIPTIONS.get(key, "")
                text = f"{text} (from {', '.join(mounted[f.name].owner_names)})".lstrip()
            else:
                text = comments.get(f.name) or _DESCRIPTIONS.get(key, "")
            inner = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(a)]
            if inner:
                text = f"{text}; see [`{key}`](#{_slug(key)})".lstrip("; ")
            rows.append([f"`{key}`", _type_name(hints[f.name]), _default_of(f), _bounds(f.metadata), _cell(text)])
        out += [markdown_table(["key", "type", "default", "bounds", "description"], rows), ""]
    aliases = getattr(config_spellings, "KEY_ALIASES", {})
    if aliases:
        out += ["## Other spellings", "",
                "verl's name of a key, in vexact's section; the config stores vexact's. Giving both is an error.", "",
                markdown_table(["verl spelling", "vexact key"], [[_code(a), _code(k)] for a, k in aliases.items()]),
                ""]
    renamed = getattr(config_spellings, "RENAMED_KEYS", {})
    if renamed:
        out += ["Deprecated keys (still read, with a `FutureWarning`; the config stores the new key):", "",
                markdown_table(["old key", "new key", "why"], [[_code(a), _code(r.new), _cell(r.why)]
                                                               for a, r in renamed.items()]), ""]
    deprecated = getattr(config_spellings, "DEPRECATED_VALUES", {})
    if deprecated:
        out += ["Deprecated values (still read, with a `FutureWarning`; the config stores the new one):", "",
                markdown_table(["key", "old value", "new value"], [[_code(k), _code(a), _code(v)]
                                                                   for k, m in deprecated.items()
                                                                   for a, v in m.items()]), ""]
    values = getattr(config_spellings, "VALUE_ALIASES", {})
    if values:
        out += ["Other spellings of values (stored under the second):", "",
                ", ".join(f"`{a}` → `{v}`" for a, v in values.items()), ""]
    return "\n".join(out)


def _first_line(obj: object) -> str:
    return " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())


def _settings_keys(registry: Any, entry: object) -> str:
    """The config keys an entry's settings bring (``vexact.registry``), as code spans; "" for none."""
    settings = getattr(entry, "settings", None)
    if settings is None:
        return ""
    section = registry.settings_section(settings)
    return ", ".join(_code(f"{section}.{f.name}") for f in dataclasses.fields(settings))


def _what(obj: object) -> str:
    """A registered entry's description: its docstring's first line after "``name``: "."""
    text = _first_line(obj if inspect.isfunction(obj) or isinstance(obj, type) else type(obj))
    return _cell(text.partition(": ")[2] or text)


def choices_markdown() -> str:
    """The registered choices of the config keys that name a registry entry, one table each, read from the
    registries (``vexact.rl.registries``), with the config keys each entry's own settings bring."""
    from vexact.rl.registries import (
        ADVANTAGE_ESTIMATORS,
        BYPASS_LOSSES,
        CORRECTION_METHODS,
        INJECT_MODES,
        LOG_BACKENDS,
        LOSS_AGGREGATIONS,
        LR_SCHEDULES,
        ROLLOUT_ENGINES,
        TASKS,
    )

    modes = [[_code(name), (_code(f"inject.{m.knob_key}") + ": " if m.knob else "")
              + _cell(m.knob or ("set by " + ", ".join(_code(k) for k in m.source_keys) if m.source_keys else "")),
              "✓" if m.calibratable else "", _what(m), _settings_keys(INJECT_MODES, m)]
             for name, m in INJECT_MODES.items()]
    tasks = [[_code(name), _code(cls.tag), _cell(_first_line(cls)), _code(f"{cls.__module__}.{cls.__name__}"),
              _settings_keys(TASKS, cls)] for name, cls in TASKS.items()]
    methods = [[_code(name), _cell(m.verl), _cell(m.effect), _code(list(m.band)) if m.band else "",
                _settings_keys(CORRECTION_METHODS, m)] for name, m in CORRECTION_METHODS.items()]
    kinds = [[_code(name), "✓" if k.triggered else "", _what(k), _settings_keys(LR_SCHEDULES, k)]
             for name, k in LR_SCHEDULES.items()]

    def plain(registry: Any) -> list[list[str]]:
        return [[_code(name), _what(e), _settings_keys(registry, e)] for name, e in registry.items()]

    backends = [[_code(name), _code(b.package) if b.package else "", _what(b), _settings_keys(LOG_BACKENDS, b)]
                for name, b in LOG_BACKENDS.items()]
    engines = [[_code(name), _code(e.package) if e.package else "", _what(e), _settings_keys(ROLLOUT_ENGINES, e)]
               for name, e in ROLLOUT_ENGINES.items()]
    return "\n".join([
        "## Injection modes (`inject.mode`)", "",
        "From the registry `INJECT_MODES`; `vexact.register_inject_mode` adds one ([how](../howto/add_mode.md)).", "",
        markdown_table(["mode", "its knob (key: what it is)", "calibratable", "what the rollout does", "its settings"],
                       modes), "",
        "## Tasks (`task.name`)", "",
        "From the registry `TASKS`; `vexact.register_task` adds one ([how](../howto/add_task.md)).",
        "", markdown_table(["task", "tag", "description", "class", "its settings"], tasks), "",
        "## Correction methods (`correction.method`)", "",
        "From the registry `CORRECTION_METHODS`: vexact's shorthand and the verl keys it stands for (C = "
        "`correction.threshold`, [a, b] = `correction.band`); `vexact.register_correction_method` adds one.", "",
        markdown_table(["method", "verl equivalent", "effect", "default band", "its settings"], methods), "",
        "## Bypass losses (`correction.loss_type`)", "",
        "From the registry `BYPASS_LOSSES` (`vexact.rl.objective.register_bypass_loss` adds one).", "",
        markdown_table(["loss type", "loss", "its settings"], plain(BYPASS_LOSSES)), "",
        "## LR schedules (`lr_schedule.kind`)", "",
        "From the registry `LR_SCHEDULES`; `vexact.register_lr_schedule` adds one.", "",
        markdown_table(["kind", "triggered", "learning rate", "its settings"], kinds), "",
        "## Advantage estimators (`algorithm.advantage`)", "",
        "From the registry `ADVANTAGE_ESTIMATORS`; `vexact.register_advantage_estimator` adds one.", "",
        markdown_table(["estimator", "advantage", "its settings"], plain(ADVANTAGE_ESTIMATORS)), "",
        "## Loss aggregations (`algorithm.loss_agg`)", "",
        "From the registry `LOSS_AGGREGATIONS` (`vexact.rl.objective.register_loss_aggregation` adds one).", "",
        markdown_table(["aggregation", "loss", "its settings"], plain(LOSS_AGGREGATIONS)), "",
        "## Log backends (`logging.backends`)", "",
        "From the registry `LOG_BACKENDS`; `vexact.register_log_backend` adds one.", "",
        markdown_table(["backend", "package", "what it writes", "its settings"], backends), "",
        "## Rollout engines (`rollout.engine`)", "",
        "From the registry `ROLLOUT_ENGINES`; `vexact.register_rollout_engine` adds one.", "",
        markdown_table(["engine", "package", "who samples", "its settings"], engines), ""])


# --- metric keys -------------------------------------------------------------------------------------------


def metrics_markdown() -> str:
    """The metric reference: one table per key prefix, from ``vexact.metric_keys``."""
    from vexact import metric_keys

    out = ["Generated from the registry `vexact/metric_keys.py`. **writers**: `run` = a line of `metrics.jsonl`; "
           "`measure` / `compare` = the `metrics` object of their `--json` report; `live` = a row of "
           "`vexact.live.LiveMonitor`'s `metrics.jsonl`. **verl** ✓: verl's key and "
           "definition. `<lo>-<hi>` is a token-probability bucket (0-0.01, 0.01-0.1, 0.1-0.5, 0.5-0.9, 0.9-1), "
           "`<option>` a `correction.rollout_rs` option, `<k>` the top-k size.", ""]
    by_group: dict[str, list] = {}
    for key in metric_keys.KEYS:
        by_group.setdefault(key.group, []).append(key)
    for group in [*metric_keys.GROUPS, *(g for g in by_group if g not in metric_keys.GROUPS)]:
        keys = by_group.get(group)
        if not keys:
            continue
        out += [f"## `{group}/*`: {metric_keys.GROUPS.get(group, group)}", "",
                markdown_table(["key", "definition", "unit", "writers", "verl", "computed in"],
                               [[_code(k.name), _cell(k.definition), k.unit, ", ".join(k.writers),
                                 "✓" if k.verl else "", _code(f"vexact/{k.source}")] for k in keys]), ""]
    out += ["## Renamed keys (deprecated names)", "",
            "From `RENAMED_METRICS`. vexact's own metrics live under `mismatch/`; `rollout_corr/*` and `training/*` "
            "hold verl's names only. For a deprecation period `vexact run` and `LiveMonitor` write each renamed key "
            "under its old name too (metrics.jsonl and its TensorBoard / W&B views), so a dashboard on the old name "
            "keeps working: move it to the new name, the old one will go (the `measure` / `compare` reports carry "
            "the new names only). Every reader of metrics.jsonl (reports, "
            "resume, `read_metrics`) reads an old file's keys under the new names; `collapse.metric` given an old "
            "name takes the new one, with a FutureWarning.", "",
            markdown_table(["deprecated key", "key now"],
                           [[_code(old), _code(new)] for old, new in metric_keys.RENAMED_METRICS.items()]), ""]
    return "\n".join(out)


# --- kernel contracts ----------------------------------------------------------------------------------------


def kernel_ops_markdown() -> str:
    """One mkdocstrings block per op of ``vexact_kernels.OP_NAMES``: the exact CPU kernel's docstring, which states
    the op's invariance contract. (mkdocstrings reads ``kernels/`` by path, where the package's folder is.)"""
    import vexact_kernels

    out = ["The ops, from `vexact_kernels.OP_NAMES`, then the fused ops a backend may offer beside them "
           "(`vexact_kernels.FUSED_OP_NAMES`: the same bits as the calls they stand for), with the docstring of the "
           "exact CPU kernel (`kernels/cpu_exact.py`) that states each one's contract.", ""]
    for op in (*vexact_kernels.OP_NAMES, *vexact_kernels.FUSED_OP_NAMES):
        out += [f"### `{op}`", ""]
        fn = getattr(vexact_kernels.cpu_exact, op, None)
        module = getattr(fn, "__module__", "") or ""
        if inspect.isfunction(fn) and module.startswith("vexact_kernels."):  # where mkdocstrings finds its source
            path = "kernels." + module.removeprefix("vexact_kernels.") + "." + fn.__name__
            out += [f"::: {path}", "    options:", "      show_root_heading: false", ""]
        else:
            out += [inspect.getdoc(fn) or "(no docstring)", ""] if fn is not None else ["(no exact CPU kernel)", ""]
    return "\n".join(out)


PAGES = {"cli": cli_markdown, "config": config_markdown, "choices": choices_markdown, "metrics": metrics_markdown,
         "kernel_ops": kernel_ops_markdown}
"""Marker name -> generator. ``<!-- vexact-docs: NAME -->`` on a line of its own in a page is replaced."""


def expand(markdown: str) -> str:
    """``markdown`` with every generated region holding the generator's text now: the start marker, the text and
    the end marker. A start marker without its end (before the next start marker) is filled as a new region; an
    unknown name is an error."""
    out: list[str] = []
    rest = markdown
    while (match := MARKER.search(rest)) is not None:
        name = match.group(1)
        if name not in PAGES:
            raise ValueError(f"unknown generated page {name!r}; expected one of {', '.join(PAGES)}")
        out.append(rest[:match.start()])
        after = rest[match.end():]
        end = after.find("\n" + END.format(name))
        following = MARKER.search(after)
        if end < 0 or (following is not None and following.start() < end):  # a bare marker: nothing to replace
            tail = after
        else:
            tail = after[end + 1 + len(END.format(name)):]
        out.append(f"{match.group(0)}\n\n{PAGES[name]().strip()}\n\n{END.format(name)}")  # blank lines: Markdown blocks
        rest = tail
    out.append(rest)
    return "".join(out)


def pages_with_regions(docs: Path = DOCS) -> list[Path]:
    """The markdown files under ``docs`` that hold a generated region, sorted."""
    return sorted(p for p in docs.rglob("*.md") if MARKER.search(p.read_text(encoding="utf-8")))


def stale_pages(docs: Path = DOCS) -> list[Path]:
    """The pages under ``docs`` whose generated regions differ from what the generators give now."""
    return [p for p in pages_with_regions(docs) if expand(text := p.read_text(encoding="utf-8")) != text]


def update_pages(docs: Path = DOCS) -> list[Path]:
    """Rewrite the generated regions of every page under ``docs``; the pages that changed."""
    changed = stale_pages(docs)
    for page in changed:
        page.write_text(expand(page.read_text(encoding="utf-8")), encoding="utf-8")
    return changed


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: refresh the generated regions of every page."""
    return expand(markdown)


class _DocstringBrackets(logging.Filter):
    """Docstrings are written for ``help()``, not as Markdown: ``x[i][j]`` reads to Markdown as a reference link,
    and mkdocstrings' cross-reference check would fail the strict build on it. Such a warning about a docstring
    (its location is a ``.py`` file) is logged as info; one about a page's own link still fails the build."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno == logging.WARNING and "Could not find cross-reference target" in message \
                and re.search(r"\.py:\d+:", message):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_config(config: Any, **_: Any) -> Any:
    """mkdocs hook: demote docstring cross-reference warnings (see ``_DocstringBrackets``)."""
    logger = logging.getLogger("mkdocs.plugins.mkdocs_autorefs._internal.plugin")
    if not any(isinstance(f, _DocstringBrackets) for f in logger.filters):
        logger.addFilter(_DocstringBrackets())
    return config


USAGE = (f"usage: python -m tools.docs_gen OUT_DIR  (writes {', '.join(f'{n}.md' for n in PAGES)})\n"
         "       python -m tools.docs_gen --update [DOCS_DIR]  (refresh the generated regions of the pages; "
         "default: the repository's docs/)\n"
         "       python -m tools.docs_gen --check [DOCS_DIR]   (exit 1 if a region is stale)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["--update"], ["--check"]) and len(args) <= 2:
        docs = Path(args[1]) if len(args) == 2 else DOCS
        if not docs.is_dir():
            print(f"error: {docs} is not a directory", file=sys.stderr)
            return 2
        if args[0] == "--update":
            for page in update_pages(docs):
                print(f"updated {page}")
            return 0
        stale = stale_pages(docs)
        for page in stale:
            print(f"{page}: a generated region differs from the code; run python -m tools.docs_gen --update",
                  file=sys.stderr)
        return 1 if stale else 0
    if len(args) != 1 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (out / f"{name}.md").write_text(make() + "\n")
        print(out / f"{name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
