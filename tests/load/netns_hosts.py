"""Network namespaces as "hosts" for distributed load: real TCP between them, on this machine.

    with namespace_hosts(3) as hosts:
        hosts.address            # the root namespace's address every host reaches (veth 0)
        hosts.namespaces         # ["llmc-1a2b-h0", ...]
        hosts.exec_argv(1, [...])  # argv that runs a command inside host 1

Each host is a namespace `lcload-<id>-h<i>` with a veth pair `ld<id>-<i>h`/`ld<id>-<i>n` to
the root namespace on a /30 of a free 10.203.K.0/24 (llmchaos.stack.netns.pick_subnet); its
default route goes to its own veth peer, so it reaches every address of the root namespace (the
kernel delivers locally whatever interface the packet came in on) and nothing else: no
forwarding, no NAT, traffic never leaves the machine. The names are not the stack's (`llmc-`,
`lc<id>-`): `llmchaos cleanup`, which other runs on this machine may call at any time, removes
those as orphans after 30 s. The namespaces are deleted on exit whatever happened. Needs root
(the `needs_netns` fixture).
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llmchaos.stack.netns import NodeNetwork, delete_link, delete_namespace, pick_subnet

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
            base = int(subnet.network_address) + 4 * index
            net = NodeNetwork(
                netns=f"lcload-{short_id}-h{index}",
                veth_host=f"ld{short_id}-{index}h",
                veth_ns=f"ld{short_id}-{index}n",
                host_address=str(ipaddress.ip_address(base + 1)),
                address=str(ipaddress.ip_address(base + 2)),
            )
            nets.append(net)
            for argv in _steps(net):
                subprocess.run(argv, check=True, capture_output=True, timeout=30)
        yield NamespaceHosts(tuple(nets))
    finally:
        for net in nets:
            delete_namespace(net.netns)  # its veth end and routes go with it
            delete_link(net.veth_host)


def _steps(net: NodeNetwork) -> list[list[str]]:
    ns = ["ip", "-n", net.netns]
    return [
        ["ip", "netns", "add", net.netns],
        ["ip", "link", "add", net.veth_host, "type", "veth", "peer", "name", net.veth_ns],
        ["ip", "link", "set", net.veth_ns, "netns", net.netns],
        ["ip", "addr", "add", f"{net.host_address}/30", "dev", net.veth_host],
        ["ip", "link", "set", net.veth_host, "up"],
        [*ns, "addr", "add", f"{net.address}/30", "dev", net.veth_ns],
        [*ns, "link", "set", net.veth_ns, "up"],
        [*ns, "link", "set", "lo", "up"],
        [*ns, "route", "add", "default", "via", net.host_address],
    ]
