"""Deterministic simulation of kvwire's cores in virtual time (see ``docs/cores.md``)."""

from kvwire.testing.sim.net import Faults
from kvwire.testing.sim.run import Plant, Report, simulate

__all__ = ["Faults", "Plant", "Report", "simulate"]
