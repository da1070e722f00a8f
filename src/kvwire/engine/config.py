"""Model presets and engine configuration for the reference engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvwire.core.config import LoadFailurePolicy
from kvwire.engine.tokenizer import VOCAB_SIZE
from kvwire.errors import ConfigError
from kvwire.kv.spec import KVSpec, Layout


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

    ``window`` limits attention to the last ``window`` positions (sliding-window attention). The cache
    still holds every position (and every position is transferred); only the attention reads fewer, so a
    model with a production-sized KV geometry stays cheap to run on a CPU.
    """

    name: str
    num_layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kv_dtype: str = "float16"
    block_size: int = 16
    layout: Layout = Layout.HND
    window: int | None = None
    max_model_len: int = 8192
    rope_theta: float = 10000.0
    eps: float = 1e-5
    vocab_size: int = VOCAB_SIZE
    # Cache size a server gets unless told otherwise (tiny: 64 MiB; kv-heavy: 2 MiB a block, 1 GiB).
    default_num_blocks: int = 4096

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even (RoPE rotates pairs)")
        if self.kv_dtype not in ("float16", "float32"):
            raise ConfigError(f"the reference model computes with float16 or float32 KV, not {self.kv_dtype}")
        if self.window is not None and self.window <= 0:
            raise ConfigError("window must be positive")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def kv_spec(self) -> KVSpec:
        return KVSpec(
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            block_size=self.block_size,
            layout=self.layout,
        )


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", num_layers=4, hidden=64, q_heads=8, kv_heads=4, head_dim=16, intermediate=128
    ),
    # Llama-3-8B's KV geometry: 32 layers x 8 KV heads x 128 head dim x 2 bytes x (K, V) = 128 KiB/token.
    "kv-heavy": ModelConfig(
        name="kv-heavy",
        num_layers=32,
        hidden=64,
        q_heads=8,
        kv_heads=8,
        head_dim=128,
        intermediate=128,
        window=64,
        default_num_blocks=512,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: its role, its parallel layout, its cache size and its scheduling limits."""

    model: ModelConfig
    role: Role = Role.COLOCATED
    tp_size: int = 1
    pp_size: int = 1
    num_blocks: int = 4096
    seed: int = 0
    max_num_seqs: int = 64
    # Prompt tokens prefilled in one engine step (at least one request is always admitted).
    max_prefill_tokens: int = 8192
    # Requests waiting for blocks or a slot; beyond it new requests are refused (503).
    max_waiting: int = 1024
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL
    # Keep whole prompt blocks after a request and reuse them (engine.prefix_cache). Off by default: the
    # cached blocks stay allocated, which leak checks of a quiet engine would otherwise have to allow for.
    prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ConfigError("tp_size and pp_size must be at least 1")
        if self.pp_size > self.model.num_layers:
            raise ConfigError(f"pp_size={self.pp_size} exceeds the model's {self.model.num_layers} layers")
        if self.pp_size > 1 and self.role is Role.DECODE:
            raise ConfigError("pipeline parallelism is supported on the prefill side only")
        if self.model.q_heads % self.tp_size:
            raise ConfigError(f"q_heads={self.model.q_heads} is not divisible by tp_size={self.tp_size}")
        self.model.kv_spec().heads_per_rank(self.tp_size)  # raises LayoutError when unmappable
        for name in ("num_blocks", "max_num_seqs", "max_prefill_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
