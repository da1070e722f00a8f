"""UCX's connect settings follow the handshake deadline, and never override an operator's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire.transport.ucx_env import apply_ucx_defaults, syn_count, ucx_defaults


@pytest.mark.parametrize(
    ("timeout_s", "want"), [(0.5, 1), (5.0, 1), (7.0, 2), (14.9, 2), (15.0, 3), (60.0, 4), (1e6, 6)]
)
def test_syn_count_gives_up_within_the_deadline(timeout_s: float, want: int) -> None:
    n = syn_count(timeout_s)
    assert n == want
    # The kernel waits 1 s, then doubles, per SYN: n retries give up after 2**(n+1) - 1 s.
    assert 2 ** (n + 1) - 1 <= max(timeout_s, 3.0)


def test_defaults_fill_only_what_the_user_left_unset() -> None:
    env = {"UCX_TCP_SYN_CNT": "5", "UCX_MODULES": "^ib*"}
    applied = apply_ucx_defaults(5.0, env)
    assert applied == {"UCX_TCP_CONN_NB": "y"}
    assert env == {"UCX_TCP_SYN_CNT": "5", "UCX_MODULES": "^ib*", "UCX_TCP_CONN_NB": "y"}
    assert apply_ucx_defaults(5.0, env) == {}  # idempotent
    assert ucx_defaults(7.0) == {"UCX_TCP_CONN_NB": "y", "UCX_TCP_SYN_CNT": "2"}


@pytest.mark.nixl
def test_the_first_nixl_agent_sets_them_before_ucx_reads_them() -> None:
    """In a fresh process (UCX reads its variables once): the agent's connect timeout picks the SYN count,
    and a user's own UCX_TCP_CONN_NB stays."""
    pytest.importorskip("nixl._api", reason="the NIXL backend is not installed")
    code = (
        "import os\n"
        "from kvwire.transport.nixl import NixlAgent\n"
        "a = NixlAgent('ucx-env-probe', connect_timeout_s=7.0)\n"
        "print(os.environ.get('UCX_TCP_CONN_NB'), os.environ.get('UCX_TCP_SYN_CNT'))\n"
        "a.close()\n"
    )
    for user, want in ((None, "y 2"), ("n", "n 2")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
        env.update(UCX_MODULES="^ib*", PYTHONPATH=os.pathsep.join(sys.path))
        if user is not None:
            env["UCX_TCP_CONN_NB"] = user
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == want
