"""``kvwire demo``'s settings (its flags, ``kvwire_tools.demo.cli``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvwire.config import DEFAULT_BACKEND, Backend
from kvwire.errors import ConfigError
from kvwire.protocol.messages import TransferMode


@dataclass(frozen=True)
class DemoConfig:
    prefill: int = 1
    decode: int = 1
    p_tp: int = 1
    d_tp: int = 1
    p_pp: int = 1
    mode: TransferMode = TransferMode.PUSH
    backend: Backend = DEFAULT_BACKEND
    preset: str = "tiny"
    requests: int = 32
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 2048
    max_tokens: int = 16
    concurrency: int = 1
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 300.0
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "p_tp", "d_tp", "p_pp", "requests", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ConfigError("need 1 <= min prompt tokens <= --max-prompt-tokens")
