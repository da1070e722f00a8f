"""UCX's connect settings follow the handshake deadline, and never override an operator's own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvwire.transport.ucx_env import (
    _ipv4_of,
    apply_ucx_defaults,
    interface_of,
    limit_net_devices,
    syn_count,
    ucx_defaults,
)


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


def _addresses() -> dict[str, str]:
    """Every interface of this host that has an IPv4 address, by name (``lo`` at least)."""
    out = {}
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr is not None:
            out[name] = addr
    return out


def test_interface_of_finds_the_interface_holding_an_address() -> None:
    found = _addresses()
    assert found.get("lo") == "127.0.0.1"
    for name, addr in found.items():
        loopback = addr.startswith("127.")
        assert interface_of(addr) == (None if loopback else name), (name, addr)
    for other in ("0.0.0.0", "::1", "fe80::1", "localhost", "192.0.2.77", "not an address"):
        assert interface_of(other) is None  # 192.0.2.0/24 is TEST-NET-1: no host holds it


def test_net_devices_limited_only_where_the_user_and_rdma_leave_it_open() -> None:
    mine = next((a for a in _addresses().values() if not a.startswith("127.")), None)
    env: dict[str, str] = {}
    # Loopback, 0.0.0.0 and unknown addresses change nothing.
    for host in ("127.0.0.1", "0.0.0.0", "192.0.2.77"):
        assert limit_net_devices(host, env, rdma=False) is None
    assert env == {}
    if mine is not None:
        assert limit_net_devices(mine, {"UCX_NET_DEVICES": "all"}, rdma=False) is None  # the user's wins
        assert limit_net_devices(mine, env, rdma=True) is None  # RDMA devices would be turned off
        assert env == {}
        device = limit_net_devices(mine, env, rdma=False)
        assert device is not None and env == {"UCX_NET_DEVICES": device}
        assert limit_net_devices(mine, env, rdma=False) is None  # set now: kept


def test_interface_of_inside_a_namespace() -> None:
    """In a namespace pair (where this host can make one): the veth's address maps to the veth."""
    from kvwire.testing.netns import NetnsPair, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    code = "import sys\nfrom kvwire.transport.ucx_env import interface_of\nprint(interface_of(sys.argv[1]))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with NetnsPair() as net:
        for side in (net.a, net.b):
            argv = net.command(side, [sys.executable, "-c", code, side.addr])
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.strip() == side.ifname
