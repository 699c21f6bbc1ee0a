"""Network namespaces as "hosts" for distributed load: real TCP between them, on this machine.

    with namespace_hosts(3) as hosts:
        hosts.address            # the root namespace's address every host reaches (veth 0)
        hosts.namespaces         # ["llmc-1a2b-h0", ...]
        hosts.exec_argv(1, [...])  # argv that runs a command inside host 1

Each host is a namespace with a veth pair to the root namespace on a /30 of a free
10.203.K.0/24 (llmchaos.stack.netns); its default route goes to its own veth peer, so it reaches
every address of the root namespace (the kernel delivers locally whatever interface the packet
came in on) and nothing else: no forwarding, no NAT, traffic never leaves the machine. The
namespaces are deleted on exit whatever happened. Needs root (the `needs_netns` fixture).
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llmchaos.stack.netns import (
    NodeNetwork,
    create_node_network,
    delete_node_network,
    pick_subnet,
)

__all__ = ["NamespaceHosts", "namespace_hosts"]


@dataclass(frozen=True)
class NamespaceHosts:
    nets: tuple[NodeNetwork, ...]

    @property
    def address(self) -> str:
        """An address of the root namespace that every host reaches (bind servers here)."""
        return self.nets[0].host_address

    @property
    def namespaces(self) -> list[str]:
        return [net.netns for net in self.nets]

    def exec_argv(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run inside host `index` (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.nets[index].netns, *argv]


@contextmanager
def namespace_hosts(count: int) -> Iterator[NamespaceHosts]:
    """`count` namespace hosts (at least one: the root namespace's address is on veth 0)."""
    short_id = secrets.token_hex(2)
    subnet = pick_subnet()
    nets: list[NodeNetwork] = []
    try:
        for index in range(max(1, count)):
            net = create_node_network(short_id, index, f"h{index}", subnet)
            nets.append(net)
            subprocess.run(
                ["ip", "-n", net.netns, "route", "add", "default", "via", net.host_address],
                check=True,
                capture_output=True,
                timeout=30,
            )
        yield NamespaceHosts(tuple(nets))
    finally:
        for net in nets:
            delete_node_network(net)
