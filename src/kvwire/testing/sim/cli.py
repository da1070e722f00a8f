"""``kvwire sim``: run the deterministic simulation; exit 1 when an invariant was violated."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvwire.protocol.messages import TransferMode

TOP_INPUTS = 8  # --meter-cores prints the costliest (core, input) kinds; the JSON has them all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10_000, help="simulated requests")
    parser.add_argument("--seed", type=int, default=0, help="the seed; a failing seed replays exactly")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default="push")
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="push mode, layer by layer: P writes each layer as its prefill step computes it",
    )
    parser.add_argument(
        "--faults", choices=["chaos", "none"], default="chaos", help="the fault mix (Faults.chaos or none)"
    )
    parser.add_argument(
        "--plant", default=None, help="run with a planted bug (see kvwire.testing.sim.plants)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--meter-cores",
        action="store_true",
        help="also time the cores' handle, in all and by (core, input) kind (the run gets a little slower)",
    )


def run(args: argparse.Namespace) -> int:
    from kvwire.testing.sim import Faults, simulate
    from kvwire.testing.sim.plants import PLANTS

    plant, faults, mode = (
        None,
        Faults.chaos() if args.faults == "chaos" else Faults(),
        TransferMode(args.mode),
    )
    if args.plant is not None:
        if args.plant not in PLANTS:
            print(f"kvwire sim: unknown plant {args.plant!r}; one of {sorted(PLANTS)}", file=sys.stderr)
            return 2
        planted = PLANTS[args.plant]
        plant, faults, mode = planted.plant, planted.faults, planted.mode  # a plant runs in its own mode
    layerwise = args.layerwise or bool(args.plant and PLANTS[args.plant].layerwise)
    if layerwise and mode is not TransferMode.PUSH:
        print("kvwire sim: --layerwise is a push mode: drop --mode pull", file=sys.stderr)
        return 2
    report = simulate(
        args.requests, args.seed, faults=faults, mode=mode, plant=plant, meter_cores=args.meter_cores,
        layerwise=layerwise,
    )  # fmt: skip
    label = mode.value + (" layer-wise" if layerwise else "")
    print(
        f"{args.requests} requests, seed {args.seed}, {label}: {len(report.violations)} violations; "
        f"{report.simulated_seconds:.1f} s simulated in {report.wall_seconds:.1f} s "
        f"({report.requests_per_second:.0f} requests/s; {report.cpu_seconds:.1f} s CPU, "
        f"{report.requests_per_cpu_second:.0f} requests per CPU second)"
    )
    if report.core_cpu_seconds is not None and report.core_us_per_request is not None:
        share = report.core_cpu_seconds / report.cpu_seconds if report.cpu_seconds > 0 else 0.0
        print(
            f"cores: {report.core_cpu_seconds:.2f} s CPU inside handle, "
            f"{report.core_us_per_request:.0f} us per request ({share:.0%} of the run; the rest is the "
            "simulator's network, memory and checks)"
        )
        for row in report.core_inputs()[:TOP_INPUTS]:
            print(
                f"  {row['core']} {row['input']}: {row['us_per_request']} us per request "
                f"({row['per_request']} per request, {row['us_each']} us each)"
            )
    print("faults:", ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())) or "none")
    print("outcomes:", ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items())))
    for v in report.violations[:20]:
        print("VIOLATION", v)
    if report.violations:
        print(
            f"replay: kvwire sim --requests {args.requests} --seed {args.seed} --mode {mode.value}"
            + (" --layerwise" if layerwise and not args.plant else "")
            + (f" --plant {args.plant}" if args.plant else f" --faults {args.faults}")
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_json(), indent=2))
    return 1 if report.violations else 0
