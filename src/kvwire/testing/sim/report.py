"""What one simulation run found (``simulate``'s answer, ``kvwire sim``'s report and its JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    requests: int
    seed: int
    mode: str
    violations: list[str]
    faults: dict[str, int]
    outcomes: dict[str, int]
    wall_seconds: float
    simulated_seconds: float
    # CPU time of this process during the run: on a shared machine the wall time includes other jobs'.
    cpu_seconds: float = 0.0
    # With ``meter_cores``: the part of ``cpu_seconds`` inside the cores' ``handle`` (None: not metered).
    core_cpu_seconds: float | None = None
    # ...by (core class, input class): (CPU seconds, inputs handled); empty when not metered.
    core_cpu_by: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)
    layerwise: bool = False  # push, layer by layer (``LayerwisePushProducerCore``)

    @property
    def requests_per_second(self) -> float:
        """Simulated requests per second of wall time (issue 21's goal: >= 5,000 in one process)."""
        return self.requests / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def requests_per_cpu_second(self) -> float:
        return self.requests / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "seed": self.seed,
            "mode": self.mode,
            "layerwise": self.layerwise,
            "violations": self.violations,
            "faults": self.faults,
            "outcomes": self.outcomes,
            "wall_seconds": round(self.wall_seconds, 3),
            "simulated_seconds": round(self.simulated_seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "requests_per_second": round(self.requests_per_second, 1),
            "requests_per_cpu_second": round(self.requests_per_cpu_second, 1),
            **self._cores_json(),
        }

    @property
    def core_us_per_request(self) -> float | None:
        """The cores' CPU per simulated request (None: not metered)."""
        return None if self.core_cpu_seconds is None else self.core_cpu_seconds / self.requests * 1e6

    def _cores_json(self) -> dict[str, object]:
        if self.core_cpu_seconds is None or self.core_us_per_request is None:
            return {}
        return {
            "core_cpu_seconds": round(self.core_cpu_seconds, 3),
            "core_us_per_request": round(self.core_us_per_request, 1),
            "core_inputs": self.core_inputs(),
        }

    def core_inputs(self) -> list[dict[str, object]]:
        """Where the cores' CPU went, costliest first: per (core, input) kind, microseconds per simulated
        request, inputs per request and microseconds per input (the profile that issue 21's cuts start
        from)."""
        rows = sorted(self.core_cpu_by.items(), key=lambda kv: kv[1][0], reverse=True)
        n = self.requests
        return [
            {"core": core, "input": inp, "us_per_request": round(cpu / n * 1e6, 1),
             "per_request": round(count / n, 2), "us_each": round(cpu / count * 1e6, 1)}
            for (core, inp), (cpu, count) in rows
        ]  # fmt: skip
