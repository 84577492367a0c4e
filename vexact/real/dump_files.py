"""The dumps ``vexact compare`` reads, each sequence a ``Record``: JSON Lines, padded tensor files (``.safetensors``;
``.pt`` / ``.pth`` / ``.bin`` through the weights-only unpickler) and slime's debug dumps.

``read_dump(path, ...)`` picks the format from the file name (and a torch file's structure) and yields one
``Record`` per sequence: its log-probs as float64 (exactly the values written; rounded to float32 first with
``--float32``), its token ids and, for tensor rows, the masked columns. Every value is checked as it is read -- a
number, finite, at most ``MAX_LOGPROB`` -- and bad input is one ValueError naming the file, the line, row or sample,
and the key. The formats, their default keys and what exact comparison of written floats means:
``vexact.real.compare``'s docstring.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..records.runlog import UnsafeFileError, load_tensor_file

ONE_FILE_KEYS = ("rollout_log_probs", "old_log_probs")  # verl's batch keys: rollout engine, actor recompute
TWO_FILE_KEY = "logprobs"
JSONL_TOKENS_KEY, TENSOR_TOKENS_KEY = "tokens", "responses"
MASK_KEY, ATTENTION_MASK_KEY, NO_MASK = "response_mask", "attention_mask", "none"
MASK_KEY_HINT = f"give --mask-key KEY, or --mask-key {NO_MASK} if every position does"  # where no mask is found
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SLIME_DUMP_KEYS = ("rollout_id", "samples")  # the top level of both of slime's debug dumps (torch.save of a dict)
SLIME_KEYS = ("rollout_log_probs", "log_probs")  # a --save-debug-train-data sample: SGLang's, the Megatron actor's
SLIME_MASK_KEY, SLIME_RESPONSE_LENGTH_KEY = "loss_masks", "response_lengths"  # both over the response only
REFUSED_FILE_HINT = ("vexact never loads such a file unsafely: where you trust it, load it and save only the tensors "
                     "and lists to compare (for slime's debug dumps: docs/live_and_recipes.md, section slime)")
"""What a torch file the weights-only unpickler refuses is told to do (after ``load_tensor_file``'s message)."""
LOG_SUM_EXP_TOLERANCE = 0.1
"""A full-vocabulary row must satisfy |log Σ_v exp(row_v)| ≤ this (log-probs sum to probability 1); logits fail."""
MAX_LOGPROB = 1e-3
"""The largest per-token log-prob accepted: a probability is at most 1, but rounding can leave a near-certain token's
log-prob a little above 0 (a float32 log_softmax at logits of magnitude 50 is off by a few 4e-6 ulps). Above this
(a probability above 1.001) the value is not a log-prob -- a logit, a probability, a sign error -- and is refused."""


@dataclass(frozen=True)
class ReadOptions:
    """What a reader takes of ``vexact compare``'s settings (``CompareSettings``, whose fields these are)."""

    tokens_key: str | None = None  # None: the format's default (JSONL_TOKENS_KEY, TENSOR_TOKENS_KEY)
    mask_key: str | None = None  # None: the format's default mask (see ``vexact.real.compare``'s docstring)
    float32: bool = False  # round every parsed value to float32 first (``_rounded_to_float32``)


@dataclass(slots=True)  # one per held sequence: no per-instance __dict__
class Record:
    """One sequence as read from one file: its log-prob arrays (float64) under each requested key, and what
    else the file had for it."""

    path: Path
    line: int | None  # JSON Lines: the line number
    row: int | None  # tensor files: the row
    id: Hashable
    values: dict[str, np.ndarray]
    tokens: np.ndarray | None = None
    columns: np.ndarray | None = None  # tensor files: the masked columns of the row
    full: dict[str, Tensor] | None = None  # tensor files: full-vocabulary log-probs [n, V] per key
    unit: str = "row"  # what ``row`` counts: a padded tensor's rows, or a slime dump's samples

    @property
    def where(self) -> str:
        """How error messages name the sequence: ``FILE:LINE: id X``, ``FILE: row B`` or ``FILE: sample I``."""
        return f"{self.path}:{self.line}: id {self.id!r}" if self.row is None else f"{self.path}: {self.place}"

    @property
    def place(self) -> str:
        """Where in its file: ``line N``, ``row B`` or ``sample I``."""
        return f"line {self.line}" if self.row is None else f"{self.unit} {self.row}"



# --------------------------------------------------------------------------- values
_NUMBER_TYPES = frozenset((float, int))
_JSON_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
                    int: "an integer", float: "a number"}


def _json_type(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, bool, type(None), int, float)) else _json_type(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _floats(value: Any, what: str, float32: bool) -> np.ndarray:
    """A JSON list of numbers as float64: exactly the parsed Python floats, or with ``float32`` those rounded to the
    nearest float32 (``_rounded_to_float32``); refuses anything else."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of numbers, got {_json_type(value)}")
    if not _NUMBER_TYPES.issuperset(map(type, value)):  # type(), not isinstance: true/false are not numbers
        i = next(i for i, v in enumerate(value) if type(v) not in _NUMBER_TYPES)
        raise ValueError(f"{what}[{i}] is not a number: {_short(value[i])}")
    try:
        array = np.array(value, dtype=np.float64)
    except OverflowError:
        i = next(i for i, v in enumerate(value) if type(v) is int and abs(v) > 1.7e308)
        raise ValueError(f"{what}[{i}] is an integer too large for a float") from None
    _require_logprobs(array, what)
    return _rounded_to_float32(array, what) if float32 else array


def _rounded_to_float32(array: np.ndarray, what: str) -> np.ndarray:
    """``--float32``: each value rounded to the nearest float32 (held as float64, exactly), so a float32 dump written
    in any format that round-trips float32 -- repr of the float64 value, ``%.9g``, numpy's shortest float32 repr --
    compares equal exactly when the float32 values are equal."""
    with np.errstate(over="ignore"):
        rounded = array.astype(np.float32)
    if not np.isfinite(rounded).all():
        i = int(np.flatnonzero(~np.isfinite(rounded))[0])
        raise ValueError(f"{what}[{i}] is {array[i]}: beyond float32's range (--float32)")
    return rounded.astype(np.float64)


def _require_logprobs(array: np.ndarray, what: str, columns: np.ndarray | None = None) -> None:
    """Refuse values that are no log-prob: NaN, ±inf, or above ``MAX_LOGPROB``. The message names the value's index
    (``columns``: the tensor column it came from) after ``what`` (file, line or row, id, key)."""
    def place(i: int) -> str:
        return f"{what}[{i}]" if columns is None else f"{what} at column {int(columns[i])}"

    of = f"{array.size} values" if columns is None else f"the row's {array.size} masked values"
    if not np.isfinite(array).all():
        bad = np.flatnonzero(~np.isfinite(array))
        raise ValueError(f"{place(int(bad[0]))} is {array[bad[0]]}: not a finite log-prob "
                         f"({bad.size} of {of} are NaN or infinite)")
    if array.size and array.max() > MAX_LOGPROB:
        bad = np.flatnonzero(array > MAX_LOGPROB)
        value = float(array[bad[0]])
        raise ValueError(f"{place(int(bad[0]))} is {value:.9g}: a log-prob is at most 0 (accepted up to "
                         f"+{MAX_LOGPROB:g} for rounding), this is a probability of {math.exp(min(value, 700)):.4g} "
                         f"-- logits or probabilities instead of log-probs? ({bad.size} of {of} are above)")


def _token_ids(value: Any, what: str) -> np.ndarray:
    """A JSON list of non-negative integers as int64."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of token ids, got {_json_type(value)}")
    array = None
    if not set(map(type, value)) - {int}:
        try:
            array = np.array(value, dtype=np.int64)
        except OverflowError:
            pass
    if array is None or (array.size and array.min() < 0):
        i = next(i for i, v in enumerate(value) if type(v) is not int or not 0 <= v < 2**63)
        raise ValueError(f"{what}[{i}] is not a token id (a non-negative 64-bit integer): {_short(value[i])}")
    return array


# --------------------------------------------------------------------------- JSON Lines
def _jsonl_records(path: Path, keys: tuple[str, ...], s: ReadOptions) -> Iterator[Record]:
    """The sequences of a JSON Lines file, one per non-blank line, read line by line (never the whole text)."""
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.rstrip(b"\r\n"))  # errors then point into this line, not past it
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{number}: not valid JSON (not UTF-8 text){_format_hint(path)}") from None
            except (ValueError, RecursionError) as err:  # e.g. an integer literal of more than 4300 digits
                raise ValueError(f"{path}:{number}: not valid JSON ({str(err)[:80]})") from None
            yield _jsonl_record(path, number, row, keys, s)
            count += 1
    if count == 0:
        raise ValueError(f"{path}: empty (no sequences)")


def _jsonl_record(path: Path, number: int, row: Any, keys: tuple[str, ...], s: ReadOptions) -> Record:
    tokens_key = s.tokens_key or JSONL_TOKENS_KEY
    if not isinstance(row, dict):
        raise ValueError(f'{path}:{number}: expected a JSON object {{"id": ..., ...}}, got {_json_type(row)}')
    if "id" not in row:
        raise ValueError(f'{path}:{number}: no "id" key')
    ident = row["id"]
    if type(ident) not in (str, int):
        raise ValueError(f'{path}:{number}: "id" must be a string or an integer, got {_json_type(ident)}')
    record = Record(path, number, None, ident, {})
    where = record.where  # built once per line: the messages below only use it on failure
    for key in keys:
        if key not in row:
            present = ", ".join(sorted(map(repr, row)))[:120]
            raise ValueError(f"{where}: no {key!r} key (the line has {present})")
        record.values[key] = _floats(row[key], f"{where}: {key!r}", s.float32)
    if tokens_key in row:
        record.tokens = _token_ids(row[tokens_key], f"{where}: {tokens_key!r}")
    elif s.tokens_key is not None:
        raise ValueError(f"{where}: no {tokens_key!r} key (--tokens-key)")
    _check_lengths(record, keys, tokens_key)
    return record


def _check_lengths(record: Record, keys: tuple[str, ...], tokens_key: str) -> None:
    """Within one sequence, every log-prob list (and the tokens) has one length."""
    lengths = {key: len(record.values[key]) for key in keys}
    if record.tokens is not None:
        lengths[tokens_key] = len(record.tokens)
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{key!r} has {n}" for key, n in lengths.items())
        raise ValueError(f"{record.where}: lengths differ within the sequence: {listed}")


def _format_hint(path: Path) -> str:
    """For a binary file read as JSON Lines because of its name (an .npz, a .pt renamed): how the format is chosen."""
    if path.suffix in (".jsonl", ".json"):
        return ""
    return (f"; the format follows the file name: {', '.join(('.safetensors', *TORCH_SUFFIXES))} are tensor files, "
            "any other name is read as JSON Lines")


# --------------------------------------------------------------------------- tensor files
def is_tensor_file(path: Path) -> bool:
    return path.suffix == ".safetensors" or path.suffix in TORCH_SUFFIXES


def load_torch(path: Path) -> Any:
    """A torch file through the weights-only unpickler; a refused one says what to do instead of unsafe loading."""
    try:
        return load_tensor_file(path)
    except UnsafeFileError as err:
        raise UnsafeFileError(f"{err}; {REFUSED_FILE_HINT}") from None


def slime_samples(data: Any) -> list | None:
    """The per-sample list of a loaded slime debug dump, or None if ``data`` is not one."""
    if isinstance(data, dict) and all(key in data for key in SLIME_DUMP_KEYS) and isinstance(data["samples"], list):
        return data["samples"]
    return None


def _load_tensors(path: Path, wanted: set[str], loaded: Any = None) -> dict[str, Tensor]:
    """The ``wanted`` tensors that ``path`` has (safetensors: only those are read; torch files: weights-only;
    ``loaded``: the torch file's contents, read already)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as f:
                return {key: f.get_tensor(key) for key in f.keys() if key in wanted}
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
            raise ValueError(f"{path}: not a readable safetensors file ({first})") from None
    data = load_torch(path) if loaded is None else loaded
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of tensors (name -> tensor), got {type(data).__name__}")
    return {key: value for key, value in data.items() if key in wanted}


def _tensor(data: dict[str, Tensor], path: Path, key: str, dims: int, what: str, floating: bool | None) -> Tensor:
    """``data[key]``: a tensor of ``dims`` dimensions; floating point (True), integer (False) or any (None)."""
    if key not in data:
        raise ValueError(f"{path}: no tensor {key!r} ({what})")
    value = data[key]
    if not isinstance(value, Tensor):
        raise ValueError(f"{path}: {key!r} is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided:  # sparse rows have no per-position values to index; torch's error is a trace
        raise ValueError(f"{path}: {key!r} is a {value.layout} tensor; store it dense (tensor.to_dense())")
    value = value.detach()  # a trainer's log-probs saved without .detach() still carry requires_grad; numpy() refuses
    if value.dim() != dims:
        raise ValueError(f"{path}: {key!r} must have {dims} dimensions ({what}), got shape {list(value.shape)}")
    if floating is not None and value.is_floating_point() != floating:
        kind = "a floating-point" if floating else "an integer"
        raise ValueError(f"{path}: {key!r} must be {kind} tensor ({what}), got {value.dtype}")
    return value


def _tensor_records(path: Path, keys: tuple[str, ...], s: ReadOptions, full_keys: tuple[str, ...],
                    loaded: Any = None) -> Iterator[Record]:
    """One record per row of padded [B, T] tensors, holding the masked positions only."""
    tokens_key, mask_key = s.tokens_key or TENSOR_TOKENS_KEY, s.mask_key
    wanted = {*keys, tokens_key, *full_keys, MASK_KEY, ATTENTION_MASK_KEY, *([mask_key] if mask_key else [])}
    data = _load_tensors(path, wanted, loaded)
    logprobs = {key: _tensor(data, path, key, 2, "log-probs [B, T]", floating=True) for key in keys}
    shape = next(iter(logprobs.values())).shape
    for key, value in logprobs.items():
        if value.shape != shape:
            raise ValueError(f"{path}: {key!r} has shape {list(value.shape)} but {keys[0]!r} has {list(shape)}")
    if shape[0] == 0:
        raise ValueError(f"{path}: empty (no sequences: {keys[0]!r} has shape {list(shape)})")
    mask = _mask(data, path, mask_key, shape, keys[0])
    tokens = None
    if tokens_key in data:
        tokens = _tensor(data, path, tokens_key, 2, "token ids [B, T]", floating=False)
        if tokens.shape != shape:
            raise ValueError(f"{path}: {tokens_key!r} has shape {list(tokens.shape)} but {keys[0]!r} has "
                             f"{list(shape)}")
    elif s.tokens_key is not None:
        raise ValueError(f"{path}: no tensor {tokens_key!r} (--tokens-key)")
    full = {key: _tensor(data, path, key, 3, "full-vocabulary log-probs [B, T, V]", floating=True)
            for key in full_keys}
    for key, value in full.items():
        if value.shape[:2] != shape:
            raise ValueError(f"{path}: {key!r} has shape {list(value.shape)}; expected [{shape[0]}, {shape[1]}, V] "
                             f"like {keys[0]!r}")
    for b in range(shape[0]):
        columns = mask[b].nonzero().flatten()
        record = Record(path, None, b, b, {}, columns=columns.numpy())
        for key, value in logprobs.items():
            array = value[b, columns].double().numpy()
            _require_logprobs(array, f"{record.where}: {key!r}", columns.numpy())
            record.values[key] = _rounded_to_float32(array, f"{record.where}: {key!r}") if s.float32 else array
        if tokens is not None:
            record.tokens = tokens[b, columns].long().numpy()
            if (record.tokens < 0).any():
                raise ValueError(f"{record.where}: {tokens_key!r} holds a negative token id")
        if full:
            record.full = {key: _full_rows(value[b, columns], f"{record.where}: {key!r}")
                           for key, value in full.items()}
        yield record


def _sample_records(path: Path, samples: list, keys: tuple[str, ...], s: ReadOptions) -> Iterator[Record]:
    """One record per sample of a slime debug dump (ragged 1-D tensors or lists), holding its masked positions."""
    tokens_key, mask_key = s.tokens_key or JSONL_TOKENS_KEY, s.mask_key or SLIME_MASK_KEY
    if not samples:
        raise ValueError(f"{path}: empty (no sequences: 'samples' is an empty list)")
    for i, sample in enumerate(samples):
        record = Record(path, None, i, i, {}, unit="sample")
        where = record.where
        if not isinstance(sample, dict):
            raise ValueError(f"{where} is a {type(sample).__name__}, not a dict of the sample's fields")
        for key in keys:
            if key not in sample:
                hint = (" (slime's --save-debug-train-data dump holds both sides; a --save-debug-rollout-data dump "
                        "holds only the rollout's)" if key == SLIME_KEYS[1] else "")
                raise ValueError(f"{where}: no {key!r} key (the sample has "
                                 f"{', '.join(sorted(map(repr, sample)))[:160]}){hint}")
        values = {key: _sample_array(sample[key], f"{where}: {key!r}", floating=True) for key in keys}
        n = len(values[keys[0]])
        for key, value in values.items():
            if len(value) != n:
                raise ValueError(f"{where}: {key!r} has {len(value)} values but {keys[0]!r} has {n}")
        stated = sample.get(SLIME_RESPONSE_LENGTH_KEY)
        if stated is not None and stated != n:  # e.g. log-probs still split by context parallelism
            raise ValueError(f"{where}: {keys[0]!r} has {n} values but {SLIME_RESPONSE_LENGTH_KEY!r} is {stated!r}")
        if mask_key == NO_MASK:
            columns = np.arange(n)
        elif mask_key not in sample:
            raise ValueError(f"{where}: no {mask_key!r} key to say which positions hold tokens; {MASK_KEY_HINT}")
        else:
            mask = _sample_array(sample[mask_key], f"{where}: mask {mask_key!r}", floating=False)
            if len(mask) != n:
                raise ValueError(f"{where}: mask {mask_key!r} has {len(mask)} values but {keys[0]!r} has {n}")
            _require_binary(mask, f"{where}: mask {mask_key!r}")
            columns = np.flatnonzero(mask)
        record.columns = columns
        for key, value in values.items():
            _require_logprobs(value[columns], f"{where}: {key!r}", columns)
            record.values[key] = _rounded_to_float32(value[columns], f"{where}: {key!r}") if s.float32 \
                else value[columns]
        if tokens_key in sample:
            tokens = _sample_array(sample[tokens_key], f"{where}: {tokens_key!r}", floating=False)
            if len(tokens) < n or (tokens < 0).any():
                raise ValueError(f"{where}: {tokens_key!r} must hold at least the response's {n} token ids, none "
                                 f"negative; got {len(tokens)} values, min {tokens.min() if len(tokens) else None}")
            record.tokens = tokens[len(tokens) - n :][columns]  # slime's tokens are prompt + response: its tail
        elif s.tokens_key is not None:
            raise ValueError(f"{where}: no {tokens_key!r} key (--tokens-key)")
        yield record


def _sample_array(value: Any, what: str, floating: bool) -> np.ndarray:
    """One field of a sample: a 1-D tensor (floating-point log-probs, or integer ids / mask), or a list of numbers,
    as float64 or int64."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point() != floating or value.layout != torch.strided:
            kind = "floating-point" if floating else "integer or bool"
            raise ValueError(f"{what} must be a 1-D dense {kind} tensor, got {value.dtype} of shape "
                             f"{list(value.shape)}")
        return value.detach().double().numpy() if floating else value.detach().long().numpy()
    if isinstance(value, list):
        return _floats(value, what, float32=False) if floating else _token_ids(value, what)
    raise ValueError(f"{what} must be a 1-D tensor or a list, got {type(value).__name__}")


def _mask(data: dict[str, Tensor], path: Path, mask_key: str | None, shape: torch.Size, like: str) -> Tensor:
    """The [B, T] bool mask of positions holding tokens (see the module docstring for the defaults)."""
    if mask_key == NO_MASK:
        return torch.ones(shape, dtype=torch.bool)
    key = mask_key or (MASK_KEY if MASK_KEY in data else ATTENTION_MASK_KEY if ATTENTION_MASK_KEY in data else None)
    if key is None:
        raise ValueError(f"{path}: no {MASK_KEY!r} or {ATTENTION_MASK_KEY!r} tensor to say which positions hold "
                         f"tokens; {MASK_KEY_HINT}")
    mask = _tensor(data, path, key, 2, "mask [B, T]", floating=None)
    if key == ATTENTION_MASK_KEY and mask.shape[0] == shape[0] and mask.shape[1] > shape[1]:
        mask = mask[:, mask.shape[1] - shape[1] :]  # prompt + response: the response is the last T columns
    if mask.shape != shape:
        raise ValueError(f"{path}: mask {key!r} has shape {list(mask.shape)} but {like!r} has {list(shape)}")
    _require_binary(mask, f"{path}: mask {key!r}")
    return mask.bool()


def _require_binary(mask: Tensor | np.ndarray, what: str) -> None:
    """A mask (a tensor file's [B, T] or a slime sample's 1-D) holds only 0 and 1."""
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{what} holds values other than 0 and 1")


def _full_rows(rows: Tensor, what: str) -> Tensor:
    """Full-vocabulary log-prob rows [n, V]: no NaN or +inf (-inf is probability 0), and normalised."""
    bad = torch.isnan(rows) | torch.isposinf(rows)
    if bad.any():
        raise ValueError(f"{what} at masked position {int(bad.any(-1).nonzero()[0, 0])} holds NaN or +inf")
    if rows.shape[0]:
        lse = torch.logsumexp(rows.double(), dim=-1)
        off = (lse.abs() > LOG_SUM_EXP_TOLERANCE).nonzero()
        if off.numel():
            t = int(off[0, 0])
            raise ValueError(f"{what} at masked position {t} is not a row of log-probs (log Σ exp = "
                             f"{float(lse[t]):.3g}, expected 0): store log_softmax(logits / T), not logits")
    return rows



# --------------------------------------------------------------------------- one dump, any format
def read_dump(path: Path, keys: tuple[str, ...], s: ReadOptions, full_keys: tuple[str, ...],
             loaded: Any = None) -> Iterator[Record]:
    """The sequences of one dump (``loaded``: a torch file's contents, read already)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found" if not path.exists() else f"{path}: not a file")
    if path.suffix in TORCH_SUFFIXES:
        loaded = load_torch(path) if loaded is None else loaded
        samples = slime_samples(loaded)
        if samples is not None:
            if full_keys:
                raise ValueError(f"{path}: full-vocabulary log-probs (--rollout-full-key / --train-full-key) need "
                                 "padded tensor files; this slime dump holds the sampled tokens' log-probs only")
            return _sample_records(path, samples, keys, s)
    if is_tensor_file(path):
        return _tensor_records(path, keys, s, full_keys, loaded)
    if full_keys:
        raise ValueError(f"{path}: full-vocabulary log-probs (--rollout-full-key / --train-full-key) need tensor "
                         "files (.safetensors, .pt); JSON Lines hold the sampled tokens' log-probs only")
    return _jsonl_records(path, keys, s)
