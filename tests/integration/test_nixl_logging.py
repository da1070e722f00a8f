"""NIXL's Python layer logs to stdout through its own handler; kvwire hands those lines to the
application's logging instead (issue 13, logs), so stdout carries nothing of NIXL's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl

_CHILD = """
import logging
logging.basicConfig(level=logging.INFO, format="APPLOG %(name)s %(message)s")
from kvwire.transport.nixl import NixlAgent
NixlAgent("logcheck").close()
"""


def test_nixl_python_log_lines_go_to_the_applications_logging_not_stdout() -> None:
    pytest.importorskip("nixl._api", reason="the NIXL backend is not installed")
    env = {**os.environ, "NIXL_LOG_LEVEL": "INFO", "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib*")}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # Through the application's handler and format, under the "nixl" logger hierarchy.
    assert "APPLOG nixl" in done.stderr and "Initialized NIXL agent: logcheck" in done.stderr
