"""One Llama/Qwen-style decoder serving both the rollout path and the training path.

``Transformer.forward`` is the only model logic there is. Training calls it on whole
sequences (no cache, every sequence starting at position 0); rollout calls it on the prompts
(prefill) and then on one token per sequence per step (decode), with a ``KVCache``. Every
op goes through the kernel backend (``vexact_kernels``), so with ``backend="exact"`` the two
paths produce bit-identical logits for the same token at the same position.

Parameter names follow Hugging Face's Llama/Qwen layout (``embed_tokens``,
``layers.N.self_attn.q_proj`` ...) so that checkpoints map over one to one.

With ``num_experts`` > 0 the MLP of (some) layers is a mixture of experts, Qwen3-MoE / Mixtral style (router
``mlp.gate``, experts ``mlp.experts.E.{gate,up,down}_proj``, optional Qwen2-MoE shared expert): each token goes to
its ``num_experts_per_tok`` best experts. Routing is exact too (``vexact_kernels.moe_exact``): router logits through
the exact linear, a top-k whose ties go to the lowest expert index, weights and combination from exactly rounded
elementwise ops in expert-index order, each expert's rows through the exact linear -- so a token's output never
depends on which other tokens share its experts. How a forward routes is a value passed in (``Routing``): the
rollout's injected routing mismatch, router replay, and where the chosen experts are recorded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

import vexact_kernels
from vexact_kernels import checks, contract, kv_rows, moe_exact

from .devices import missing_gpu
from .seeds import check_seed

# A kernel op module (``vexact_kernels.get_ops(...)``) or any object with the same functions: the contract
# ``vexact_kernels.KernelOps`` (a Protocol; ``tests/kernels/test_kernel_contract.py`` checks every backend against it).
KernelOps = vexact_kernels.KernelOps

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short dtype names -> torch's names. The one table of dtype spellings: config keys (``dtype``,
``rollout.dtype``, ``inject.precision``, ...) and every CLI flag accept both, so ``bf16`` works wherever
``bfloat16`` does; configs store the long name."""

# what the model computes in: the floating dtypes the exact kernels take
_MODEL_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vexact_kernels.cpu_exact.FLOAT_DTYPES}
DTYPES = {**_MODEL_DTYPES, **{short: _MODEL_DTYPES[long] for short, long in DTYPE_ALIASES.items()
                              if long in _MODEL_DTYPES}}
"""Every accepted name of a model dtype (long and short) -> the torch dtype."""
DTYPE_NAMES: tuple[str, ...] = tuple(_MODEL_DTYPES)
"""The model dtypes' names as configs store them (torch's names): ``float32``, ``bfloat16``."""


def canonical_dtype_name(name: str) -> str:
    """torch's name for a dtype spelling (``bf16`` -> ``bfloat16``); other strings are returned unchanged."""
    return DTYPE_ALIASES.get(name, name)


def dtype_names_text(names: tuple[str, ...] = DTYPE_NAMES) -> str:
    """``float32 (fp32), bfloat16 (bf16)``: the accepted spellings of ``names``, for messages and --help."""
    short = {long: s for s, long in DTYPE_ALIASES.items()}
    return ", ".join(f"{n} ({short[n]})" if n in short else n for n in names)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16 or any of their names (``DTYPE_ALIASES``); anything else is a ValueError."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected {dtype_names_text()}")
        return DTYPES[dtype]
    if dtype not in _MODEL_DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; expected {' or '.join(map(str, _MODEL_DTYPES.values()))}")
    return dtype


def short_dtype_name(dtype: torch.dtype | str) -> str:
    """``fp32`` or ``bf16`` for a supported dtype or any of its names (for tables and labels)."""
    return "fp32" if resolve_dtype(dtype) == torch.float32 else "bf16"


class ModelConfigError(ValueError):
    """An invalid ``ModelConfig``; ``field`` names the field to change, ``problem`` says what is wrong with it."""

    def __init__(self, field_name: str, problem: str):
        self.field, self.problem = field_name, problem
        super().__init__(f"ModelConfig.{problem}")


def _finite_positive(value: object) -> bool:
    """A real number (not a bool) that is finite and > 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int too large for a float
        return False


_POSITIVE = {"min": 1}  # field metadata: numeric bounds, also read by the run config's schema (vexact.rl.config_schema)


@dataclass
class ModelConfig:
    """Shape of a Llama/Qwen-style decoder. ``head_dim`` defaults to hidden_size // num_heads.

    The run config's ``model`` section is built from these fields (all but ``vocab_size``, which the task
    sets), so a field added here is a config key there too."""

    vocab_size: int = field(metadata=_POSITIVE)
    hidden_size: int = field(metadata=_POSITIVE)
    num_layers: int = field(metadata=_POSITIVE)
    num_heads: int = field(metadata=_POSITIVE)
    num_kv_heads: int = field(metadata=_POSITIVE)
    intermediate_size: int = field(metadata=_POSITIVE)
    max_seq_len: int = field(default=256, metadata=_POSITIVE)
    head_dim: int | None = field(default=None, metadata=_POSITIVE)
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    rms_norm_eps: float = field(default=1e-6, metadata={"gt": 0})
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    # Llama-3-style RoPE frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE.
    rope_scaling: dict | None = None
    # Mixture of experts (names as in HF's Qwen3-MoE / Qwen2-MoE configs); num_experts 0 = the dense model.
    num_experts: int = field(default=0, metadata={"min": 0})
    num_experts_per_tok: int = field(default=2, metadata=_POSITIVE)  # top-k: experts per token
    moe_intermediate_size: int | None = field(default=None, metadata=_POSITIVE)  # an expert's; None = intermediate_size
    norm_topk_prob: bool = True  # divide the top-k routing weights by their sum
    decoder_sparse_step: int = field(default=1, metadata=_POSITIVE)  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = field(default=(), metadata={"min": 0})  # ... and i is not listed here
    shared_expert_intermediate_size: int = field(default=0, metadata={"min": 0})  # Qwen2-MoE shared expert; 0 = none

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(name, f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError("num_heads", f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                                                f"({self.num_kv_heads})")
        derived_head_dim = self.head_dim is None
        if derived_head_dim:
            if self.hidden_size % self.num_heads:
                raise ModelConfigError("hidden_size", f"hidden_size ({self.hidden_size}) must be divisible by "
                                                      f"num_heads ({self.num_heads}) unless head_dim is given")
            self.head_dim = self.hidden_size // self.num_heads
        head_dim = self.head_dim
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0 or head_dim % 2:  # RoPE pairs
            if derived_head_dim:
                raise ModelConfigError("hidden_size", f"hidden_size / num_heads = {self.head_dim} is the head dim "
                                                      "and must be even (RoPE)")
            raise ModelConfigError("head_dim", f"head_dim must be a positive even integer, got {self.head_dim!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not _finite_positive(getattr(self, name)):
                raise ModelConfigError(name, f"{name} must be a finite positive number, got {getattr(self, name)!r}")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):  # a string such as "false" would read as True
                raise ModelConfigError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        self._check_moe()

    def _check_rope_scaling(self) -> None:
        """Llama-3 scaling with values ``rope_inv_freq`` can use: finite positive numbers, and high_freq_factor !=
        low_freq_factor (it divides by their difference) -- as ``from_pretrained`` requires of a checkpoint's."""
        keys = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        if not isinstance(self.rope_scaling, dict) or set(self.rope_scaling) != keys:
            raise ModelConfigError("rope_scaling", f"rope_scaling must be None or a dict with exactly the keys "
                                                   f"{sorted(keys)}, got {self.rope_scaling!r}")
        if self.rope_scaling["rope_type"] != "llama3":
            raise ModelConfigError("rope_scaling", f"rope_scaling: only rope_type 'llama3' is supported, "
                                                   f"got {self.rope_scaling['rope_type']!r}")
        for key in sorted(keys - {"rope_type"}):
            if not _finite_positive(self.rope_scaling[key]):
                raise ModelConfigError("rope_scaling", f"rope_scaling: {key} must be a finite positive number, "
                                                       f"got {self.rope_scaling[key]!r}")
        low = self.rope_scaling["low_freq_factor"]
        if low == self.rope_scaling["high_freq_factor"]:
            raise ModelConfigError("rope_scaling", f"rope_scaling: llama3 scaling needs high_freq_factor != "
                                                   f"low_freq_factor, got both {low!r}")

    def _check_moe(self) -> None:
        for name in ("num_experts", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelConfigError(name, f"{name} must be a non-negative integer (0 = none), got {value!r}")
        for name in ("num_experts_per_tok", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(name, f"{name} must be a positive integer, got {value!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ModelConfigError("num_experts_per_tok", f"num_experts_per_tok (top-k: experts per token) must be "
                                                          f"between 1 and num_experts ({self.num_experts}), got "
                                                          f"{self.num_experts_per_tok}")
        size = self.moe_intermediate_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ModelConfigError("moe_intermediate_size", f"moe_intermediate_size must be a positive integer or "
                                                            f"None (= intermediate_size), got {size!r}")
        if not isinstance(self.mlp_only_layers, (list, tuple)):
            raise ModelConfigError("mlp_only_layers", f"mlp_only_layers must be a list of layer indices, got "
                                                      f"{self.mlp_only_layers!r}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers]
        if bad:
            raise ModelConfigError("mlp_only_layers", f"mlp_only_layers must hold layer indices in [0, "
                                                      f"{self.num_layers}), got {bad[0]!r}")
        if self.num_experts and not self.moe_layers:  # experts asked for, a dense model built: never silently
            step = self.decoder_sparse_step
            name, fix = (("decoder_sparse_step", f"lower decoder_sparse_step to at most {self.num_layers}")
                         if step > self.num_layers else ("mlp_only_layers", "leave a layer out of mlp_only_layers"))
            raise ModelConfigError(name, f"num_experts is {self.num_experts}, but no layer is a mixture of experts: "
                                         f"layer i is one when (i + 1) is a multiple of decoder_sparse_step ({step}) "
                                         f"and i is not in mlp_only_layers ({list(self.mlp_only_layers)}), of "
                                         f"{self.num_layers} layers; {fix}, or set num_experts: 0 for a dense "
                                         "model")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is a mixture of experts (HF's rule: ``num_experts`` > 0, (i + 1) a
        multiple of ``decoder_sparse_step``, i not in ``mlp_only_layers``); () for the dense model."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if (i + 1) % self.decoder_sparse_step == 0 and i not in self.mlp_only_layers)

    @property
    def expert_intermediate_size(self) -> int:
        """An expert's intermediate size: ``moe_intermediate_size``, else ``intermediate_size``."""
        return self.intermediate_size if self.moe_intermediate_size is None else self.moe_intermediate_size

    def to_dict(self) -> dict:
        values = asdict(self)
        values["mlp_only_layers"] = list(values["mlp_only_layers"])  # YAML/JSON-friendly
        return values

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
            raise ValueError(f"ModelConfig.from_dict needs a dict of its field names, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(unknown)}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in values]
        if missing:
            raise ValueError(f"ModelConfig keys missing: {', '.join(missing)}")
        return cls(**values)


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size")
"""The ``ModelConfig`` fields of the mixture of experts: unused by a dense model (``num_experts`` 0), whose cache keys
leave them out (``vexact.rl.warmstart``), so a dense model's keys are those from before MoE existed."""


MOE_SIZES = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
"""The MoE fields that size its parameters: named by the memory guard's error when the model has experts."""


def parameter_count(config: ModelConfig) -> int:
    """Parameters ``Transformer(config)`` has, by arithmetic (nothing is built)."""
    h, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    layer = 2 * h + 2 * q * h + 2 * kv * h
    layer += (q + 2 * kv) if config.qkv_bias else 0
    layer += 2 * config.head_dim if config.qk_norm else 0
    moe = len(config.moe_layers)
    moe_mlp = (config.num_experts * (1 + 3 * config.expert_intermediate_size) * h
               + (3 * config.shared_expert_intermediate_size + 1) * h * bool(config.shared_expert_intermediate_size))
    return (config.vocab_size * h * (1 if config.tie_embeddings else 2) + h + config.num_layers * layer
            + (config.num_layers - moe) * 3 * inter * h + moe * moe_mlp)


INIT_BYTES_PER_PARAMETER = 4  # ``Transformer`` creates its parameters in float32 on the CPU (then casts and moves)
_ROPE_BYTES_PER_ENTRY = 3 * 8 + 2 * 4  # the float64 angles, cos and sin while computed, the float32 tables kept


class ModelTooLarge(ValueError):
    """A model whose estimated memory exceeds what this machine has available: refused before any allocation."""


def available_memory() -> int | None:
    """Bytes of memory this process can still get: /proc/meminfo's MemAvailable, lowered to the cgroup's free limit
    (v2 memory.max, v1 memory.limit_in_bytes) when one is set; None where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    v1 = Path("/sys/fs/cgroup/memory")
    for limit, usage in ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                         (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes")):
        try:
            found.append(int(limit.read_text()) - int(usage.read_text()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            continue
    return min(found) if found else None


def memory_estimate(config: ModelConfig, bytes_per_parameter: int = INIT_BYTES_PER_PARAMETER) -> int:
    """Bytes ``config``'s parameters (at ``bytes_per_parameter`` each) and RoPE tables take, by arithmetic."""
    return parameter_count(config) * bytes_per_parameter + config.max_seq_len * (config.head_dim // 2) * \
        _ROPE_BYTES_PER_ENTRY


def _bytes_text(n: int) -> str:
    """1.5 MiB, 954 GiB, 36 TiB: three significant digits in the largest binary unit below the number."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    power = max(0, min(len(units) - 1, (max(n, 1).bit_length() - 1) // 10))
    value = n / 2 ** (10 * power)
    return f"{value:,.0f} {units[power]}" if value >= 100 else f"{value:.3g} {units[power]}"


def check_fits(config: ModelConfig, bytes_per_parameter: int = INIT_BYTES_PER_PARAMETER,
               what: str = "the float32 parameters", where: str = "ModelConfig", vocab: str | None = None,
               available: int | None = None, machine: str = "this machine has") -> None:
    """Refuse (``ModelTooLarge``, naming the size fields and both numbers) a model whose parameters would not fit
    in the memory available now, before anything is allocated: otherwise the allocator fails deep inside torch,
    or the machine swaps. ``where`` prefixes the field names (``model`` for a run config's section); ``vocab``
    names the vocabulary where it is no field of that section (a run's comes from its task)."""
    need = memory_estimate(config, bytes_per_parameter)
    available = available_memory() if available is None else available
    if available is None or need <= available:
        return
    sizes = ", ".join([f"{vocab or where + '.vocab_size'}={config.vocab_size:,}"] + [
        f"{where}.{name}={getattr(config, name):,}"
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
        + (MOE_SIZES if config.num_experts else ()) if getattr(config, name)])
    raise ModelTooLarge(f"{sizes} make {parameter_count(config):,} parameters; {what} need about "
                        f"{_bytes_text(need)}, but {machine} {_bytes_text(available)} of memory available: "
                        "choose smaller sizes")


def check_fits_on(config: ModelConfig, device: torch.device) -> None:
    """``check_fits`` for a model about to be built on ``device``: the host's memory on the CPU, the GPU's free
    memory on CUDA; a meta-device model (shapes only) takes none."""
    if device.type == "cpu":
        check_fits(config)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        check_fits(config, available=free, machine=f"GPU {device} has")


def rope_inv_freq(c: ModelConfig) -> Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float64, with Llama-3 scaling when configured.

    Llama 3 (as in transformers' ``_compute_llama3_parameters``) keeps wavelengths shorter than
    original_max_position_embeddings / high_freq_factor, divides those longer than
    original_max_position_embeddings / low_freq_factor by ``factor`` and interpolates between.
    """
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    if c.rope_scaling is None:
        return inv_freq
    s = c.rope_scaling
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class KVCache:
    """Per-layer key/value buffers [B, L, Hkv, hd]; position p of sequence b lives at [b, p]."""

    def __init__(self, config: ModelConfig, batch: int, length: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, length, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: positions past a sequence's end must hold finite values.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


def _check_q_start(q_start: object, cache: KVCache | None, batch: int, length: int, max_seq_len: int,
                   positions: bool) -> None:
    """``Transformer.forward``'s ``q_start``: an integer tensor [B]; with a cache and ``positions``, the positions it
    starts at fit the cache and ``max_seq_len`` (checked on the CPU only: on a GPU the check would wait for the
    device at every decode step, and a captured decode graph may not wait at all); without a cache the tokens are
    the whole sequence, so it starts at 0 (else each query would see keys past its own position: no error, a
    non-causal output)."""
    where = "Transformer.forward: q_start"
    if not isinstance(q_start, Tensor) or q_start.dtype not in (torch.int64, torch.int32) \
            or tuple(q_start.shape) != (batch,):
        got = f"{q_start.dtype} {list(q_start.shape)}" if isinstance(q_start, Tensor) else type(q_start).__name__
        raise ValueError(f"{where} must be an integer tensor [{batch}] (one start position per row), got {got}")
    if cache is None:
        if q_start.device.type == "cpu" and bool(q_start.any()):
            raise ValueError(f"{where} without a cache must be all 0 (the tokens are the whole sequence, from "
                             f"position 0); pass a cache (new_cache) to continue sequences from later positions")
        return
    rows = cache.keys[0].shape[0] if cache.keys else batch
    if rows < batch:
        raise ValueError(f"Transformer.forward: the cache holds {rows} rows, the tokens {batch} (tokens "
                         f"{[batch, length]})")
    if positions and q_start.device.type == "cpu" and batch:
        first, last = int(q_start.min()), int(q_start.max()) + length
        room = min(cache.length, max_seq_len)
        if first < 0 or last > room:
            raise ValueError(f"{where} puts {length} tokens at positions up to {last - 1} (from {first}), outside "
                             f"the cache's {cache.length} positions and max_seq_len {max_seq_len}: positions must "
                             f"lie in [0, {room})")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size = c.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, c.hidden_size, bias=False)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` [E, D], experts ``experts.E`` (SwiGLU MLPs of ``expert_intermediate_size``) and, with
    ``shared_expert_intermediate_size``, Qwen2-MoE's shared expert and its sigmoid gate."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(c, c.expert_intermediate_size) for _ in range(c.num_experts))
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoeBlock(c) if moe else MLP(c)


RouteHook = Callable[[Tensor, int, Tensor, Tensor, int], Tensor]
"""(ranked experts [B, T, E] (best first), k, sequence ids [B], positions [B, T], MoE layer number) -> the k experts
to use [B, T, k]: how the rollout's routing is changed on purpose (the injector's ``routing_flip``). The result must
be an int64 or int32 tensor [B, T, k] on the model's device whose ids lie in [0, E) and differ at each position;
anything else is one ValueError naming ``routing_hook`` (the ids checked on the CPU only: ``check_expert_ids``)."""


@dataclass(frozen=True)
class Routing:
    """How the MoE layers of one forward choose their experts, and where the choices go: a value passed in
    (``Transformer.forward(..., routing=...)``); None routes by the router's own top-k and records nothing.

    ``replay``: [B, T, n_moe_layers, k] int64 expert ids to use at every position instead of the router's top-k
    (router replay, "R3": the trainer reuses the rollout's routing; the weights are still the router's
    probabilities of those experts, so gradients reach the router). ``hook``: changes the top-k (``RouteHook``),
    with ``sequence_ids`` [B] keying its random draws. ``record``: a list each MoE layer appends the experts it
    used to, [B, T, k] in ascending order (the rollout records its routing this way)."""

    replay: Tensor | None = None
    hook: RouteHook | None = None
    sequence_ids: Tensor | None = None
    record: list[Tensor] | None = None


def check_expert_shape(chosen: object, what: str, want: tuple[int, ...], layout: str,
                       dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """One ValueError naming ``what`` unless ``chosen`` is a tensor of expert ids of shape ``want`` (``layout`` says
    what its dimensions are) and an integer dtype (one of ``dtypes`` where given). Metadata only: reads no value."""
    if not isinstance(chosen, Tensor):
        got = "None" if chosen is None else f"a {type(chosen).__name__}"
        raise ValueError(f"{what} is {got}, expected a tensor of expert ids of shape {want} ({layout})")
    if tuple(chosen.shape) != want:
        raise ValueError(f"{what} has shape {tuple(chosen.shape)}, expected {want} ({layout})")
    integer = not (chosen.dtype.is_floating_point or chosen.dtype.is_complex or chosen.dtype == torch.bool)
    if not integer or (dtypes is not None and chosen.dtype not in dtypes):
        kinds = f" ({' or '.join(checks.name_of(d) for d in dtypes)})" if dtypes else ""
        raise ValueError(f"{what} is {chosen.dtype}; expected integer expert ids{kinds}")


def check_expert_ids(chosen: Tensor, what: str, num_experts: int, k: int, on_device: bool = False) -> None:
    """One ValueError naming ``what`` unless the expert ids of ``chosen`` [..., k] lie in [0, ``num_experts``) and a
    position's k differ (a repeated expert would be counted twice). The ids of a tensor off the CPU are read only
    with ``on_device`` (a check once per call): inside the forward the read would wait for the device at every MoE
    layer of every decode step."""
    if (chosen.device.type != "cpu" and not on_device) or not chosen.numel():
        return
    first, last = (int(bound) for bound in torch.aminmax(chosen))
    if first < 0 or last >= num_experts:
        raise ValueError(f"{what} names experts outside [0, {num_experts}) (ids in [{first}, {last}])")
    ordered = chosen.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"{what} names one expert twice at a position (each position's {k} experts must differ)")


class Transformer(nn.Module):
    """Llama/Qwen-style decoder whose every op runs on a kernel backend.

    ``nn.Linear`` / ``RMSNorm`` modules only hold parameters (HF names); the math is in
    ``forward`` and always goes through a kernel op module. Which one is a value passed in:
    ``forward(..., ops=...)`` / ``logits(..., ops=...)`` (the rollout path passes its
    ``RolloutPlan.ops``); without it, ``model.ops`` -- the ops of ``model.backend``, the
    backend the model was built with. Parameters and state_dict do not depend on either.
    """

    def __init__(self, config: ModelConfig, backend: str = "exact", dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", init_seed: int | None = 0):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):  # torch's message names neither the argument nor the spellings
            raise ValueError(f"device must be a torch.device or a name such as cpu, cuda, cuda:1, got {device!r}"
                             ) from None
        check_seed(init_seed, "init_seed", none_means="no initialisation")
        if device.type not in ("cpu", "cuda", "meta"):  # torch's own error comes from deep inside, or is an assert
            raise ValueError(f"device {str(device)!r} is not supported: the models compute on cpu or cuda (cuda:N)")
        if (problem := missing_gpu(device)) is not None:
            raise ValueError(f"device {problem}")
        check_fits_on(config, device)  # before allocating: an absurd size is one error, not an allocator's
        self.config = config
        c = config
        # RoPE on the CPU whatever the device: every device indexes the same table.
        angles = torch.arange(c.max_seq_len, dtype=torch.float64)[:, None] * rope_inv_freq(c)[None, :]
        # Off the CPU the parameters are created where they live (a real-size model is never built on the host
        # and copied); on the CPU exactly as always (the same bits).
        with contextlib.nullcontext() if device.type == "cpu" else device:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            moe_layers = set(c.moe_layers)
            self.layers = nn.ModuleList(DecoderLayer(c, i in moe_layers) for i in range(c.num_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            if not c.tie_embeddings:
                self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # Computed once: every path indexes the same table, so RoPE cannot differ between them.
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        if init_seed is not None:
            self.init_weights(init_seed)
        self.to(device=device, dtype=resolve_dtype(dtype))
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        self.backend = backend

    # ------------------------------------------------------------------ setup
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic GPT-style init: N(0, std) matrices, ones for norms, zero biases. Drawn on the parameters'
        device from a generator there (on the CPU the bits of all earlier runs; a GPU draws its own stream, the same
        for the same seed); a model on the meta device (shapes only) has nothing to draw."""
        if self.device.type == "meta":
            return
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight",
                                                                                         "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * scale)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        vexact_kernels.get_ops(name, self.device)  # validates the name
        self._backend = name

    @property
    def ops(self) -> ModuleType:
        """The default kernel ops: those of ``backend`` on the model's device."""
        return vexact_kernels.get_ops(self._backend, self.device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(self.config, batch, length, self.dtype, self.device)

    # ------------------------------------------------------------------ the forward
    def forward(self, tokens: Tensor, q_start: Tensor | None = None, cache: KVCache | None = None,
                ops: KernelOps | None = None, routing: Routing | None = None, q_start_checked: bool = False
                ) -> Tensor:
        """Hidden states after the final norm, [B, T, D], for ``tokens`` [B, T].

        Row b holds tokens at absolute positions q_start[b] .. q_start[b] + T - 1 (default
        0). Without ``cache`` the tokens are the whole sequence (training path); with a
        cache their keys/values are written into it at those positions and attention
        reads positions 0 .. own position from it (rollout path: prefill, then decode).
        Rows are independent: padding tokens in a row affect only that row's padded slots.
        ``ops``: the kernel op module to run (default ``self.ops``). ``routing``: how MoE layers route
        (``Routing``; default: the router's top-k, nothing recorded). ``q_start_checked``: the caller checked
        ``q_start``'s positions against the cache and ``max_seq_len`` already (a rollout's decode steps: ``generate``
        checks them where it starts), so a step reads no value back from its tensors.
        """
        ops, c = self.ops if ops is None else ops, self.config
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise ValueError(f"Transformer.forward: tokens must be a [B, T] tensor of token ids, got "
                             f"{list(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}")
        batch, length = tokens.shape
        if q_start is None:
            if length > c.max_seq_len:  # (a rollout's positions, from q_start, are checked where it starts: generate)
                raise ValueError(f"Transformer.forward: {length} tokens from position 0 exceed max_seq_len "
                                 f"({c.max_seq_len}) (tokens {list(tokens.shape)})")
            q_start = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        else:
            _check_q_start(q_start, cache, batch, length, c.max_seq_len, positions=not q_start_checked)
        positions = q_start[:, None] + torch.arange(length, device=tokens.device)[None, :]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        batch_index = torch.arange(batch, device=tokens.device)[:, None]
        scale = 1.0 / math.sqrt(c.head_dim)

        x = ops.embedding(tokens, self.embed_tokens.weight)
        moe_number = 0  # the MoE layers' count so far: the index into a routing replay
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = ops.rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q, k, v = _projections(h, (attn.q_proj, attn.k_proj, attn.v_proj), ops)
            q = q.view(batch, length, c.num_heads, c.head_dim)
            k = k.view(batch, length, c.num_kv_heads, c.head_dim)
            v = v.view(batch, length, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = ops.rms_norm(q, attn.q_norm.weight, c.rms_norm_eps)
                k = ops.rms_norm(k, attn.k_norm.weight, c.rms_norm_eps)
            q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
            if cache is None:
                keys, values = k, v
            else:
                # through kv_rows, whose record of the writes lets the exact CPU attention keep its rows of the cache
                kv_rows.write(cache.keys[i], batch_index, positions, k)
                kv_rows.write(cache.values[i], batch_index, positions, v)
                keys, values = cache.keys[i], cache.values[i]
            o = ops.attention(q, keys, values, q_start, scale).reshape(batch, length, c.num_heads * c.head_dim)
            x = x + ops.linear(o, attn.o_proj.weight)
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            if isinstance(layer.mlp, SparseMoeBlock):
                x = x + self._moe(h, layer.mlp, ops, routing, moe_number, positions)
                moe_number += 1
            else:
                x = x + _mlp(h, layer.mlp, ops)
        return ops.rms_norm(x, self.norm.weight, c.rms_norm_eps)

    def _moe(self, h: Tensor, block: SparseMoeBlock, ops: KernelOps, routing: Routing | None, number: int,
             positions: Tensor) -> Tensor:
        """The MoE MLP of normed hidden states ``h`` [B, T, D] (MoE layer ``number``), in the model dtype.

        Each token's output depends only on its own row of ``h`` (and the replayed or hooked routing of its own
        position): router logits by the exact linear, its top-k by ``moe_exact.rank_experts`` (ties: lowest
        expert index), weights by ``moe_exact.routing_weights``; every expert runs the exact linear on the rows
        routed to it (each row's result independent of the others), and ``moe_exact.combine`` adds the k outputs
        in expert-index order."""
        c = self.config
        batch, length, width = h.shape
        k = c.num_experts_per_tok
        log_probs = ops.log_softmax(ops.linear(h, block.gate.weight))  # fp32 [B, T, E]
        if routing is not None and routing.replay is not None:
            check_expert_shape(routing.replay, "Routing.replay", (batch, length, len(c.moe_layers), k),
                               "[B, T, n_moe_layers, k]: every MoE layer's experts at every position",
                               checks.INDEX_DTYPES)  # what moe_exact.routing_weights takes
            chosen = routing.replay[:, :, number].to(h.device)
            check_expert_ids(routing.replay[:, :, number], f"Routing.replay of MoE layer {number}", c.num_experts, k)
        else:
            ranked = moe_exact.rank_experts(log_probs)
            chosen = ranked[..., :k]
            if routing is not None and routing.hook is not None:
                chosen = routing.hook(ranked, k, routing.sequence_ids, positions, number)
                what = f"routing_hook's result for MoE layer {number}"
                check_expert_shape(chosen, what, (batch, length, k), "[B, T, k]: the k experts of every position",
                                   checks.INDEX_DTYPES)
                if chosen.device != h.device:
                    raise ValueError(f"{what} is on {chosen.device}, expected the model's device {h.device}")
                check_expert_ids(chosen, what, c.num_experts, k)
        experts = chosen.sort(dim=-1).values  # expert-index order: the order the weights are summed and combined in
        if routing is not None and routing.record is not None:
            routing.record.append(experts)
        weights = moe_exact.routing_weights(log_probs, experts, c.norm_topk_prob)
        rows = h.reshape(-1, width)
        flat = experts.reshape(-1)  # (token, slot) pairs, token-major
        outputs, slots = [], []
        for e, expert in enumerate(block.experts):
            slot = (flat == e).nonzero().squeeze(-1)
            if slot.numel():
                outputs.append(_mlp(rows[slot // k], expert, ops))
                slots.append(slot)
        # every (token, slot) pair is in exactly one expert's list: put the outputs back in (token, slot) order
        order = torch.cat(slots).argsort()
        out = moe_exact.combine(weights.reshape(-1, k), torch.cat(outputs)[order].view(-1, k, width))  # fp32
        if c.shared_expert_intermediate_size:
            gate = moe_exact.sigmoid(ops.linear(rows, block.shared_expert_gate.weight))  # fp32 [N, 1]
            out = out + gate * _mlp(rows, block.shared_expert, ops).float()
        return out.to(h.dtype).view(batch, length, width)  # one rounding to the model dtype

    @property
    def head_weight(self) -> Tensor:
        """The LM head's weight [V, D]: the embedding's where they are tied."""
        return self.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight

    def logits(self, hidden: Tensor, ops: KernelOps | None = None) -> Tensor:
        """LM head: hidden [..., D] -> logits [..., V] (model dtype), on ``ops`` (default ``self.ops``)."""
        return (self.ops if ops is None else ops).linear(hidden, self.head_weight)


def _projections(h: Tensor, layers: tuple[nn.Linear, ...], ops: KernelOps) -> tuple[Tensor, ...]:
    """Each layer of ``layers`` applied to ``h`` (its bias too, where it has one): in one call of the backend's fused
    ``linears`` where none has a bias (the same bits as a call per layer; ``vexact_kernels.contract.linears``)."""
    if any(layer.bias is not None for layer in layers):
        return tuple(ops.linear(h, layer.weight, layer.bias) for layer in layers)
    return contract.linears(ops, h, [layer.weight for layer in layers])


def _mlp(h: Tensor, mlp: MLP, ops: KernelOps) -> Tensor:
    """SwiGLU MLP: down(silu(gate(h)) * up(h)), in the dtype of ``h``."""
    gate, up = _projections(h, (mlp.gate_proj, mlp.up_proj), ops)
    return ops.linear(ops.silu_mul(gate, up), mlp.down_proj.weight)
