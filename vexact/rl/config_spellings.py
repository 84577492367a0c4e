"""Other spellings of config keys and values: what a raw mapping (a config file, ``--set``, a sweep grid) may say
that the schema (``config_schema``) names otherwise, read as the current spelling so the config stores one.

* Deprecated spellings, each read with a FutureWarning (``warn_deprecated``) unless the reader is quiet about it
  (``DEPRECATED_SPELLINGS``: a record vexact wrote itself): a renamed key (``RENAMED_KEYS``; ``move_renamed_keys``
  moves it to its new key) and an old value (``DEPRECATED_VALUES``; ``modernize_values`` replaces it).
* verl's names of keys (``KEY_ALIASES``; ``move_aliases``) and other spellings of values (``VALUE_ALIASES``:
  ``bf16``, verl's ``token-mean``; validation accepts them): no deprecation, either spelling works.

``config.config_from_dict`` moves the keys before the schema sees the data. The lowest of the config's modules: it
imports neither of the others.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..engine.model import DTYPE_ALIASES
from ..metric_keys import ABS_DLOGP_MEAN, K3_KL, RENAMED_METRICS
from .validate import ConfigError, show_value

VALUE_ALIASES: dict[str, str] = {
    **DTYPE_ALIASES,  # bf16 -> bfloat16, fp32 -> float32, fp16 -> float16 (the engine's one table)
    "token-mean": "token_mean",  # verl's loss_agg_mode spellings of vexact's algorithm.loss_agg
    "seq-mean-token-mean": "seq_mean",
}
"""Other spellings of ``Literal`` values: a string here is accepted by any Literal field that allows the value it
maps to, and is stored (and saved to config.yaml) as that value, so a config written either way resumes as one."""


# --- renamed keys ------------------------------------------------------------------------------------------

DROP = object()
"""What a renamed key's ``null`` becomes when its values are translated: nothing (the key was not given)."""


@dataclass(frozen=True)
class Renamed:
    """A deprecated config key: the key that replaced it, why (said in the FutureWarning), and, when the old key
    spelled its values otherwise too, ``values``: {old value: new value}; its ``null`` then means "not given"."""

    new: str
    why: str
    values: dict[Any, Any] | None = None

    def translate(self, old: str, value: Any) -> Any:
        """``value`` of key ``old`` as the new key's value (``DROP`` for a translated key's null)."""
        if self.values is None:
            return value
        if value is None:
            return DROP
        for was, now in self.values.items():
            if type(value) is type(was) and value == was:  # True is not 1: a typed match
                return now
        raise ConfigError(f"expected {' or '.join(show_value(v) for v in self.values)} (or null), got "
                          f"{show_value(value)}", old)


_LENGTH_SURGE = "the length-triggered LR decay and the collapse detector share one length-surge rule"
RENAMED_KEYS: dict[str, Renamed] = {
    "lr_schedule.length_window": Renamed("collapse.length_surge_window", _LENGTH_SURGE),
    "lr_schedule.length_ratio": Renamed("collapse.length_surge_ratio", _LENGTH_SURGE),
    # verl's algorithm.rollout_correction.bypass_mode: where the old log-probs come from, said once
    "correction.bypass_mode": Renamed("algorithm.old_logprobs", "verl's bypass_mode: true is old_logprobs rollout "
                                      "(verl's bypass mode), false is recompute (verl's decoupled mode)",
                                      values={True: "rollout", False: "recompute"}),
}
"""Deprecated key -> how it is read now (``Renamed``). The old spelling still works, with a FutureWarning; the
config stores the new key. The one registry of renamed keys: files, ``--set``, sweep grids and the config
reference read it."""


def warn_deprecated(key: str, message: str, quiet: Collection[str], stacklevel: int) -> None:
    """The FutureWarning for a deprecated spelling of ``key`` (its old name or an old value), unless the reader
    passed ``key`` in ``quiet`` (a record vexact wrote itself, or a sweep file's ``inject.value``)."""
    if key not in quiet:
        warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


def current_spelling(key: str, quiet: Collection[str] = ()) -> str:
    """The current spelling of a dotted key (warning when ``key`` is a deprecated one not in ``quiet``)."""
    renamed = RENAMED_KEYS.get(key)
    if renamed is None:
        return key
    warn_deprecated(key, f"config key '{key}' is deprecated; use '{renamed.new}' ({renamed.why})", quiet, 4)
    return renamed.new


def move_renamed_keys(data: dict, quiet: Collection[str] = ()) -> None:
    """Move deprecated keys of a raw mapping to their new place, in place; both set differently is an error.
    ``quiet``: deprecated keys read without their FutureWarning (``config_from_dict``)."""
    for old, renamed in RENAMED_KEYS.items():
        old_section, old_name = old.split(".")
        section = data.get(old_section)
        if not isinstance(section, dict) or old_name not in section:
            continue
        value = renamed.translate(old, section.pop(old_name))
        if value is DROP:  # a translated key's null: not given (what configs saved before the rename hold)
            continue
        current_spelling(old, quiet)
        new_section, new_name = renamed.new.split(".")
        target = data.get(new_section)
        if target is None:
            target = data[new_section] = {}
        if not isinstance(target, dict):
            continue  # the section's own type error is reported when it is built
        if new_name in target and target[new_name] != value:
            raise ConfigError(f"deprecated key set to {show_value(value)} while '{renamed.new}' is "
                              f"{show_value(target[new_name])}; keep only '{renamed.new}'", old)
        target[new_name] = value


DEPRECATED_VALUES: dict[str, dict[str, str]] = {
    "inject.target.metric": {"k3_kl": K3_KL, "abs_dlogp_mean": ABS_DLOGP_MEAN},
    "collapse.metric": dict(RENAMED_METRICS),  # any key: one renamed since (metric_keys.RENAMED_METRICS)
}
"""Config key -> {old spelling of a value: the value}. Keys that name a metric take its full key (as
``lr_schedule.mismatch_metric`` and ``collapse.metric`` do); the short names still work, with a FutureWarning, and
the config stores the full key. So do renamed metric keys, where a key can name one."""


def modernize_values(data: dict, quiet: Collection[str] = ()) -> None:
    """Replace deprecated spellings of values in the raw mapping, in place, warning once per replaced value (not for
    the keys in ``quiet``)."""
    for key, spellings in DEPRECATED_VALUES.items():
        *path, name = key.split(".")
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        old = node.get(name)
        if isinstance(old, str) and old in spellings:
            node[name] = spellings[old]
            warn_deprecated(key, f"{key}: {old!r} is deprecated; use the full metric key {spellings[old]!r}",
                            quiet, 3)


DEPRECATED_SPELLINGS: tuple[str, ...] = (*RENAMED_KEYS, *DEPRECATED_VALUES, "inject.value")
"""Every config key with a deprecated spelling (an old name, old values, the knob's old name): what a record vexact
wrote itself is read with, quietly (``load_config(saved=True)``)."""


# --- verl's spellings -------------------------------------------------------------------------------------

KEY_ALIASES = {
    "rollout.n": "rollout.samples_per_prompt",  # verl: actor_rollout_ref.rollout.n
    "rollout.response_length": "rollout.max_new_tokens",  # verl: data.max_response_length
    "algorithm.adv_estimator": "algorithm.advantage",  # verl: algorithm.adv_estimator
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.std_normalize",  # verl: algorithm.norm_adv_by_std_in_grpo
    "algorithm.clip_ratio_low": "algorithm.clip_low",  # verl: actor_rollout_ref.actor.clip_ratio_low
    "algorithm.clip_ratio_high": "algorithm.clip_high",  # verl: actor_rollout_ref.actor.clip_ratio_high
    "algorithm.loss_agg_mode": "algorithm.loss_agg",  # verl: actor.loss_agg_mode (token-mean, seq-mean-token-mean)
    "algorithm.kl_loss_coef": "algorithm.kl_coef",  # verl: actor.kl_loss_coef (with kl_loss_type low_var_kl = k3)
    "algorithm.entropy_coeff": "algorithm.entropy_coef",  # verl: actor.entropy_coeff
    "algorithm.ppo_micro_batch_size_per_gpu": "algorithm.micro_batch_size",  # verl: actor.ppo_micro_batch_size_per_gpu
    "optimizer.lr_warmup_steps": "optimizer.warmup_steps",  # verl: actor.optim.lr_warmup_steps
}
"""verl's name of a key, placed in vexact's section -> vexact's key. Either spelling works (config files, ``--set``,
sweep grids) and the config is stored under vexact's; giving both is an error. Only keys whose meaning is the
same are here; the README's "verl and TRL names" table maps the rest of the vocabulary."""


def move_aliases(data: dict) -> dict[str, str]:
    """Move verl-spelled keys of a raw mapping to vexact's spelling, in place; both given is an error.

    Returns {vexact key: the spelling the file used}, so an error about the value can name what was written."""
    moved = {}
    for alias, key in KEY_ALIASES.items():
        alias_section, alias_name = alias.split(".")
        section = data.get(alias_section)
        if not isinstance(section, dict) or alias_name not in section:
            continue
        new_section, new_name = key.split(".")
        target = section if new_section == alias_section else data.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the section's own type error is reported when it is built
        if new_name in target:
            raise ConfigError(f"'{alias}' is verl's spelling of '{key}', which is given too; keep only one", alias)
        target[new_name] = section.pop(alias_name)
        moved[key] = alias
    return moved
