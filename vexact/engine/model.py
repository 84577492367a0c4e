"""One Llama/Qwen-style decoder serving both the rollout path and the training path.

``Transformer.forward`` is the only model logic there is. Training calls it on whole
sequences (no cache, every sequence starting at position 0); rollout calls it on the prompts
(prefill) and then on one token per sequence per step (decode), with a ``KVCache``. Every
op goes through the kernel backend (``vexact_kernels``), so with ``backend="exact"`` the two
paths produce bit-identical logits for the same token at the same position.

Parameter names follow Hugging Face's Llama/Qwen layout (``embed_tokens``,
``layers.N.self_attn.q_proj`` ...) so that checkpoints map over one to one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

import vexact_kernels

# A kernel op module (``vexact_kernels.get_ops(...)``) or any object with the same functions: the contract
# ``vexact_kernels.KernelOps`` (a Protocol; ``tests/test_kernel_contract.py`` checks every backend against it).
KernelOps = vexact_kernels.KernelOps

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short dtype names -> torch's names. The one table of dtype spellings: config keys (``dtype``,
``rollout.dtype``, ``inject.precision``, ...) and every CLI flag accept both, so ``bf16`` works wherever
``bfloat16`` does; configs store the long name."""

_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what the model computes in
DTYPES = {**_MODEL_DTYPES, **{short: _MODEL_DTYPES[long] for short, long in DTYPE_ALIASES.items()
                              if long in _MODEL_DTYPES}}
"""Every accepted name of a model dtype (long and short) -> the torch dtype."""


def canonical_dtype_name(name: str) -> str:
    """torch's name for a dtype spelling (``bf16`` -> ``bfloat16``); other strings are returned unchanged."""
    return DTYPE_ALIASES.get(name, name)


def dtype_names_text(names: tuple[str, ...] = tuple(_MODEL_DTYPES)) -> str:
    """``float32 (fp32), bfloat16 (bf16)``: the accepted spellings of ``names``, for messages and --help."""
    short = {long: s for s, long in DTYPE_ALIASES.items()}
    return ", ".join(f"{n} ({short[n]})" if n in short else n for n in names)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16 or any of their names (``DTYPE_ALIASES``); anything else is a ValueError."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected {dtype_names_text()}")
        return DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported dtype {dtype}; expected torch.float32 or torch.bfloat16")
    return dtype


def short_dtype_name(dtype: torch.dtype | str) -> str:
    """``fp32`` or ``bf16`` for a supported dtype or any of its names (for tables and labels)."""
    return "fp32" if resolve_dtype(dtype) == torch.float32 else "bf16"


class ModelConfigError(ValueError):
    """An invalid ``ModelConfig``; ``field`` names the field to change, ``problem`` says what is wrong with it."""

    def __init__(self, field_name: str, problem: str):
        self.field, self.problem = field_name, problem
        super().__init__(f"ModelConfig.{problem}")


_POSITIVE = {"min": 1}  # field metadata: numeric bounds, also read by the run config's schema (vexact.rl.config)


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
        if self.head_dim <= 0 or self.head_dim % 2:  # RoPE rotates pairs of dimensions
            if derived_head_dim:
                raise ModelConfigError("hidden_size", f"hidden_size / num_heads = {self.head_dim} is the head dim "
                                                      "and must be even (RoPE)")
            raise ModelConfigError("head_dim", f"head_dim must be a positive even integer, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ModelConfigError(name, f"{name} must be positive, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            keys = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if not isinstance(self.rope_scaling, dict) or set(self.rope_scaling) != keys:
                raise ModelConfigError("rope_scaling", f"rope_scaling must be None or a dict with exactly the keys "
                                                       f"{sorted(keys)}, got {self.rope_scaling!r}")
            if self.rope_scaling["rope_type"] != "llama3":
                raise ModelConfigError("rope_scaling", f"rope_scaling: only rope_type 'llama3' is supported, "
                                                       f"got {self.rope_scaling['rope_type']!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(unknown)}")
        return cls(**values)


def parameter_count(config: ModelConfig) -> int:
    """Parameters ``Transformer(config)`` has, by arithmetic (nothing is built)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = 2 * h + 2 * q * h + 2 * kv * h + 3 * config.intermediate_size * h
    layer += (q + 2 * kv) if config.qkv_bias else 0
    layer += 2 * config.head_dim if config.qk_norm else 0
    return config.vocab_size * h * (1 if config.tie_embeddings else 2) + h + config.num_layers * layer


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
               what: str = "the float32 parameters", where: str = "ModelConfig", vocab: str | None = None) -> None:
    """Refuse (``ModelTooLarge``, naming the size fields and both numbers) a model whose parameters would not fit
    in the memory available now, before anything is allocated: otherwise the allocator fails deep inside torch,
    or the machine swaps. ``where`` prefixes the field names (``model`` for a run config's section); ``vocab``
    names the vocabulary where it is no field of that section (a run's comes from its task)."""
    need = memory_estimate(config, bytes_per_parameter)
    available = available_memory()
    if available is None or need <= available:
        return
    sizes = ", ".join([f"{vocab or where + '.vocab_size'}={config.vocab_size:,}"] + [
        f"{where}.{name}={getattr(config, name):,}"
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")])
    raise ModelTooLarge(f"{sizes} make {parameter_count(config):,} parameters; {what} need about "
                        f"{_bytes_text(need)}, but this machine has {_bytes_text(available)} of memory available: "
                        "choose smaller sizes")


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
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


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
        check_fits(config)  # before allocating: an absurd size is one error, not an allocator's
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        angles = torch.arange(c.max_seq_len, dtype=torch.float64)[:, None] * rope_inv_freq(c)[None, :]
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
        """Deterministic GPT-style init: N(0, std) matrices, ones for norms, zero biases."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight",
                                                                                         "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        vexact_kernels.get_ops(name, self.device)  # validates the name
        self._backend = name

    @property
    def ops(self):
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
                ops: KernelOps | None = None) -> Tensor:
        """Hidden states after the final norm, [B, T, D], for ``tokens`` [B, T].

        Row b holds tokens at absolute positions q_start[b] .. q_start[b] + T - 1 (default
        0). Without ``cache`` the tokens are the whole sequence (training path); with a
        cache their keys/values are written into it at those positions and attention
        reads positions 0 .. own position from it (rollout path: prefill, then decode).
        Rows are independent: padding tokens in a row affect only that row's padded slots.
        ``ops``: the kernel op module to run (default ``self.ops``).
        """
        ops, c = self.ops if ops is None else ops, self.config
        batch, length = tokens.shape
        if q_start is None:
            q_start = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        positions = q_start[:, None] + torch.arange(length, device=tokens.device)[None, :]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        batch_index = torch.arange(batch, device=tokens.device)[:, None]
        scale = 1.0 / math.sqrt(c.head_dim)

        x = ops.embedding(tokens, self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = ops.rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q = ops.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(batch, length, c.num_heads, c.head_dim)
            k = ops.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(batch, length, c.num_kv_heads, c.head_dim)
            v = ops.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(batch, length, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = ops.rms_norm(q, attn.q_norm.weight, c.rms_norm_eps)
                k = ops.rms_norm(k, attn.k_norm.weight, c.rms_norm_eps)
            q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
            if cache is None:
                keys, values = k, v
            else:
                cache.keys[i][batch_index, positions] = k
                cache.values[i][batch_index, positions] = v
                keys, values = cache.keys[i], cache.values[i]
            o = ops.attention(q, keys, values, q_start, scale).reshape(batch, length, c.num_heads * c.head_dim)
            x = x + ops.linear(o, attn.o_proj.weight)
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            mlp = layer.mlp
            gated = ops.silu_mul(ops.linear(h, mlp.gate_proj.weight), ops.linear(h, mlp.up_proj.weight))
            x = x + ops.linear(gated, mlp.down_proj.weight)
        return ops.rms_norm(x, self.norm.weight, c.rms_norm_eps)

    def logits(self, hidden: Tensor, ops: KernelOps | None = None) -> Tensor:
        """LM head: hidden [..., D] -> logits [..., V] (model dtype), on ``ops`` (default ``self.ops``)."""
        head = self.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight
        return (self.ops if ops is None else ops).linear(hidden, head)
