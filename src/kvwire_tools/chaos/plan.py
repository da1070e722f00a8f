"""What a chaos run does, decided up front from its seed: its settings and when it kills whom."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from pathlib import Path

from kvwire.config import DEFAULT_BACKEND, Backend
from kvwire.errors import ConfigError

# Kills land once this fraction of the requests has been sent: late enough that traffic is flowing,
# early enough that requests after the last restart show the router recovered.
_FIRST_KILL_AT = 0.1
_LAST_KILL_AT = 0.75
# Requests of the tiny preset take tens of milliseconds: a kill this much after the chosen request was
# sent finds it (and its neighbours) anywhere between prefill and the last token.
_MAX_JITTER_S = 0.05


class Victim(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ChaosConfig:
    requests: int = 1000
    kills: int = 4
    seed: int = 0
    concurrency: int = 8
    max_tokens: int = 8
    min_prompt_tokens: int = 8
    max_prompt_tokens: int = 64
    # Requests cycle over this many prompts, whose reference answers are computed in-process first.
    distinct_prompts: int = 64
    preset: str = "tiny"
    backend: Backend = DEFAULT_BACKEND
    request_timeout_s: float = 30.0
    # P's lease: how long P keeps blocks for a D that never registers (a D killed before it did).
    kv_lease_s: float = 10.0
    min_down_s: float = 0.2
    max_down_s: float = 2.0
    # While a peer is down one worker keeps sending (to see 502/503 come back fast) at this pace; the
    # others wait for the restart, so the run is not spent on requests that can only fail.
    probe_interval_s: float = 1.0
    quiet_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    deadline_s: float | None = None  # the whole run; default: see ``deadline``
    json_path: Path | None = None
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "max_tokens", "min_prompt_tokens", "distinct_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kills < 0:
            raise ConfigError("--kills must not be negative")
        if self.min_prompt_tokens > self.max_prompt_tokens:
            raise ConfigError("--min-prompt-tokens exceeds --max-prompt-tokens")
        if not 0 <= self.min_down_s <= self.max_down_s:
            raise ConfigError("need 0 <= --min-down-s <= --max-down-s")
        positive = (
            "request_timeout_s",
            "kv_lease_s",
            "probe_interval_s",
            "quiet_timeout_s",
            "startup_timeout_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')} must be positive")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError("--deadline must be positive")

    @property
    def deadline(self) -> float:
        """Seconds the run may take once the servers are up: requests, restarts, the quiet wait (start-up
        has its own bound, ``startup_timeout_s``)."""
        if self.deadline_s is not None:
            return self.deadline_s
        per_kill = self.max_down_s + self.startup_timeout_s / 4
        return 120.0 + self.requests * 0.5 + self.kills * per_kill + self.quiet_timeout_s


@dataclass(frozen=True)
class PlannedKill:
    after_started: int  # kill once this many requests have been sent
    jitter_s: float  # then wait this long, so the kill lands at a random phase of the requests in flight
    victim: Victim
    down_s: float  # how long the peer stays dead before it is started again


def plan_kills(cfg: ChaosConfig) -> list[PlannedKill]:
    """Kill moments spread at random over the run; victims alternate, so any two kills hit P and D."""
    rng = random.Random(cfg.seed)
    lo, hi = int(cfg.requests * _FIRST_KILL_AT), max(int(cfg.requests * _LAST_KILL_AT), 1)
    moments = sorted(rng.randint(lo, hi) for _ in range(cfg.kills))
    first = rng.choice(list(Victim))
    victims = [first if i % 2 == 0 else _other(first) for i in range(cfg.kills)]
    return [
        PlannedKill(at, rng.uniform(0.0, _MAX_JITTER_S), victim, rng.uniform(cfg.min_down_s, cfg.max_down_s))
        for at, victim in zip(moments, victims, strict=True)
    ]


def _other(v: Victim) -> Victim:
    return Victim.DECODE if v is Victim.PREFILL else Victim.PREFILL
