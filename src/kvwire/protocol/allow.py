"""Which peer addresses an engine may dial (``allowed_peers``): the trust anchor where no secret is set.

Every handshake dials an address that a message named: D dials the P of a request's ``kv_transfer_params``,
P dials the D of a ``push_reg``. With a shared secret, a peer is loaded only after its reply proved the secret
(``kvwire.handshake.client``); without one, anyone who can send a request or a notification could make an
engine connect (and load a NIXL agent) wherever it likes. ``allowed_peers`` bounds that: a comma-separated
list of CIDRs (``10.0.0.0/8``, ``fd00::/8``), addresses (``10.1.2.3``) and host names (``p0.cluster``,
compared as written: no lookup is made, so a name must be listed as the peers are named). Empty: any.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvwire.errors import ConfigError

_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    networks: tuple[_Net, ...] = ()
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> PeerAllowList:
        """``ConfigError`` naming an entry that is neither a network, an address nor a host name."""
        nets: list[_Net] = []
        names: set[str] = set()
        for raw in spec.split(","):
            entry = raw.strip()
            if not entry:
                continue
            try:
                nets.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if "/" in entry or not all(part.isalnum() or part == "-" for part in entry.replace(".", "")):
                raise ConfigError(f"allowed_peers: {entry!r} is not a CIDR, an address or a host name")
            names.add(entry.lower().rstrip("."))
        return cls(tuple(nets), frozenset(names))

    @property
    def open(self) -> bool:
        """No list: every address is allowed."""
        return not self.networks and not self.names

    def allows(self, host: str) -> bool:
        if self.open:
            return True
        bare = host.strip("[]")
        try:
            addr = ipaddress.ip_address(bare.split("%", 1)[0])
        except ValueError:
            return bare.lower().rstrip(".") in self.names
        return any(addr in net for net in self.networks)
