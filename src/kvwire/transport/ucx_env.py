"""UCX settings kvwire chooses so that one unreachable peer cannot hold an agent for minutes.

UCX reads its ``UCX_*`` variables once, when a process creates its first UCX context (the first NIXL agent),
so these are set in ``os.environ`` just before that, and only where the user has not set them: an operator's
own value always wins.

* ``UCX_TCP_CONN_NB=y``: UCX's tcp transport connects with a non-blocking ``connect()``. Its default (``n``)
  blocks ``add_remote_agent`` inside the kernel's SYN retries (~130 s against a blackholed port), holding
  the UCX worker's lock, so every other call on the agent (progress, every other peer's transfers) waits
  with it. Measured across network namespaces: the load of a blackholed peer took 2.0 s (abandoned at the
  handshake deadline, the agent then held ~130 s) with ``n``, 0.02 s with ``y``; the transfer tests pass
  with either (tests/faults/test_blocked_ucx_port.py, test_netns_transport.py).
* ``UCX_TCP_SYN_CNT``: how many SYNs the kernel retransmits before a connect fails (the socket's
  ``TCP_SYNCNT``). With ``n`` retries a connect gives up after about ``2**(n+1) - 1`` s (1 s initial
  timeout, doubling); kvwire picks the largest ``n`` that fits in ``handshake_timeout_s`` (at least 1), so
  an endpoint to a dead address fails within one handshake deadline instead of the kernel's 127 s.
* ``UCX_NET_DEVICES`` (``limit_net_devices``, called by engines with their advertised side-channel address):
  the interface that holds that address, and only on hosts without RDMA devices. UCX's default (``all``)
  advertises every interface and may carry a peer's notifications over any pair of them that routing
  allows: a P on a second network D is also on but cannot reach (firewalled) lost every request to D
  (measured in namespaces: 160 of 160 failed, ``peer_dead``; tests/faults/test_blackholed_request.py).
  The side channel's address is the one peers are known to reach. Not on RDMA hosts: the list applies to
  InfiniBand/RoCE devices too, and naming one netdev would turn RDMA off.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import MutableMapping

DEFAULT_CONNECT_TIMEOUT_S = 5.0  # ConnectorConfig.handshake_timeout_s's default
_MAX_SYN_CNT = 6  # the kernel's own default (tcp_syn_retries): kvwire never asks for more
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address
NET_DEVICES = "UCX_NET_DEVICES"


def syn_count(timeout_s: float) -> int:
    """The most SYN retransmissions whose total wait (``2**(n+1) - 1`` s) fits in ``timeout_s``; >= 1."""
    n = 1
    while n < _MAX_SYN_CNT and 2 ** (n + 2) - 1 <= timeout_s:
        n += 1
    return n


def ucx_defaults(connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> dict[str, str]:
    """The UCX variables kvwire sets when they are unset, for a connect deadline of ``connect_timeout_s``."""
    return {"UCX_TCP_CONN_NB": "y", "UCX_TCP_SYN_CNT": str(syn_count(connect_timeout_s))}


def apply_ucx_defaults(
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set each of ``ucx_defaults`` the user left unset; what was set, by name (empty when all were set).
    Only the first agent of a process makes UCX read them: later calls change what later processes
    inherit, nothing in this one."""
    env = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    for name, value in ucx_defaults(connect_timeout_s).items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied


def has_infiniband() -> bool:
    """Whether this host has an RDMA device (InfiniBand, RoCE, EFA: all under /sys/class/infiniband)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            req = struct.pack("256s", ifname.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, req)[20:24])
        except OSError:  # no IPv4 address on it
            return None


def interface_of(host: str) -> str | None:
    """The network interface whose (primary) IPv4 address is ``host``; None for anything else (a name,
    IPv6, loopback, the unspecified address, an address no interface here holds)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version != 4 or ip.is_loopback or ip.is_unspecified:
        return None
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == host:
                return name
    return None


def limit_net_devices(
    advertise_host: str, environ: MutableMapping[str, str] | None = None, *, rdma: bool | None = None
) -> str | None:
    """Set ``UCX_NET_DEVICES`` to the interface of ``advertise_host`` (the address peers dial for the side
    channel), unless the user set it, the host has RDMA devices (``rdma``: detected when None), or no
    interface here holds that address. Returns the device set, or None. Like ``apply_ucx_defaults``: only
    before the process's first NIXL agent does it change what UCX uses."""
    env = os.environ if environ is None else environ
    if NET_DEVICES in env or (has_infiniband() if rdma is None else rdma):
        return None
    device = interface_of(advertise_host)
    if device is not None:
        env[NET_DEVICES] = device
    return device
