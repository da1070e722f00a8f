"""Deterministic simulation of kvwire's cores in virtual time (see ``docs/cores.md``)."""

from kvwire.testing.sim.net import Faults
from kvwire.testing.sim.report import Report
from kvwire.testing.sim.run import Plant, simulate

__all__ = ["Faults", "Plant", "Report", "simulate"]
