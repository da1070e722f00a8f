"""``kvwire.testing`` is a test kit usable without pytest: importing it, and every module in it, loads no
pytest (an engine's own test runner, or a bench, may use it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire.testing.conformance import raises

PROBE = """
import importlib, pkgutil, sys
import kvwire.testing
names = sorted(m.name for m in pkgutil.walk_packages(kvwire.testing.__path__, "kvwire.testing."))
for name in names:
    importlib.import_module(name)
print(len(names), "pytest" in sys.modules, "_pytest" in sys.modules)
"""


def test_importing_every_testing_module_loads_no_pytest() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    count, has_pytest, has_private = out.stdout.split()
    assert int(count) >= 30  # the probe saw the kit (conformance, the harnesses, the simulator, ...)
    assert (has_pytest, has_private) == ("False", "False")


def test_the_probe_would_see_pytest() -> None:
    code = "import sys, kvwire.testing, pytest; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_raises_passes_the_expected_error_and_fails_otherwise() -> None:
    with raises(KeyError):
        {}["x"]
    with raises(LookupError):  # a subclass counts
        [][1]
    with pytest.raises(AssertionError, match="expected KeyError"), raises(KeyError):
        pass
    with pytest.raises(ValueError), raises(KeyError):  # another error goes through
        raise ValueError("not a KeyError")
