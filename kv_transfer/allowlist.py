"""Allow-list of decode destinations: CIDRs (checked before any contact) or agent names."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from kv_transfer.errors import DestinationNotAllowed, InvalidTransferRequest


@dataclass(frozen=True)
class AllowList:
    """A destination is allowed when its host resolves into one of ``cidrs`` or, after the
    handshake, its agent name is in ``agent_names``. Both empty allows nothing."""

    cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    agent_names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, cidrs: Iterable[str] = (), agent_names: Iterable[str] = ()) -> AllowList:
        nets = []
        for text in cidrs:
            try:
                nets.append(ipaddress.ip_network(text, strict=False))
            except ValueError as exc:
                raise InvalidTransferRequest(f"bad CIDR {text!r} in KV allow-list") from exc
        return cls(tuple(nets), frozenset(agent_names))

    @classmethod
    def loopback(cls) -> AllowList:
        return cls.parse(["127.0.0.0/8", "::1/128"])

    def host_allowed(self, host: str) -> bool:
        """True if every address ``host`` resolves to lies in an allowed CIDR."""
        if not self.cidrs:
            return False
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return False
        addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
        return bool(addrs) and all(any(a in net for net in self.cidrs) for a in addrs)

    def check_host(self, host: str) -> bool:
        """Pre-contact check. True: allowed by CIDR. False: only an agent-name match can
        still allow it (the handshake will tell). Raises when nothing can allow it."""
        if self.host_allowed(host):
            return True
        if self.agent_names:
            return False
        raise DestinationNotAllowed(
            f"decode host {host!r} is outside the KV allow-list {[str(n) for n in self.cidrs]}"
        )

    def check_agent(self, host_ok: bool, agent_name: str) -> None:
        if not host_ok and agent_name not in self.agent_names:
            raise DestinationNotAllowed(f"decode agent {agent_name!r} is not on the allow-list")
