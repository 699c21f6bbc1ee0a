"""Nodes as Linux network namespaces, and partitions as iptables rules inside them.

Each node gets a namespace `llmc-<short id>-<node>` joined to the host by a veth pair
`lc<short id>-<i>h` (host side) / `lc<short id>-<i>n` (namespace side) on a /30 of
10.203.K.0/24, K chosen so it collides with no address or route on the host. Traffic to a node
never leaves the machine. A partition is a DROP rule (both directions, or one: a partial
partition, loopback spared) in the node's own namespace, so clients see timeouts rather than
refusals, and deleting the namespace deletes the rules with it. Random packet loss is the
same rule with the `statistic` match (a share of the packets). Each rule's packet counter
(`rule_packets`) is the evidence that it drops what it should.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from llmchaos.errors import InvalidInput, StackError

__all__ = [
    "NETNS_PREFIX",
    "NodeNetwork",
    "RegistryNetwork",
    "check_netns_support",
    "create_node_network",
    "create_registry_network",
    "delete_link",
    "delete_namespace",
    "delete_node_network",
    "drop_share",
    "heal_partition",
    "is_partitioned",
    "list_links",
    "list_namespaces",
    "namespace_age_s",
    "partition_namespace",
    "pick_subnet",
    "rule_packets",
    "short_id_of",
    "undrop_share",
]

NETNS_PREFIX = "llmc-"
"""Every namespace the stack creates starts with this; `llmchaos cleanup` removes them all."""
_LINK_PATTERN = re.compile(r"lc[0-9a-f]{4}-\d+[hn]")
_PARTITION_COMMENT = "llmchaos-partition"
_LOSS_COMMENT = "llmchaos-loss"
_DELAY_COMMENT = "llmchaos-delay"
_SUBNET_BASE = ipaddress.ip_network("10.203.0.0/16")


@dataclass(frozen=True)
class NodeNetwork:
    """The network of one node namespace."""

    netns: str
    """Namespace name."""
    veth_host: str
    """Host end of the veth pair."""
    veth_ns: str
    """Namespace end of the veth pair."""
    host_address: str
    """Host-side address (the gateways' source address towards this node)."""
    address: str
    """The node's address: workers on this node bind to it."""


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise StackError(
            f"{' '.join(argv)} failed: {result.stderr.strip() or result.stdout.strip()}"
        )
    return result


def check_netns_support() -> str | None:
    """None when network namespaces can be used here, else the reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use --netns off)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found (apt-get install iproute2 iptables, or use --netns off)"
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The host's IPv4 addresses and routes, as networks."""
    used: list[ipaddress.IPv4Network] = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for token in _run(argv, check=False).stdout.split():
            try:
                net = ipaddress.ip_network(token, strict=False)
            except ValueError:
                continue
            if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                used.append(net)
    return used


_claims: dict[ipaddress.IPv4Network, socket.socket] = {}
"""Subnets this process picked and has not put an address of on the host yet."""


def _claim(subnet: ipaddress.IPv4Network) -> bool:
    """Claim `subnet` until its first host address exists: an abstract Unix socket named after
    it (no file; the kernel frees the name when the process ends). Two stacks starting at once
    both saw the same free /24 before either had an address in it, and the second one's
    namespaces then failed or took the first one's addresses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0llmchaos-subnet-{subnet.network_address}")
    except OSError:  # another process holds it
        sock.close()
        return False
    _claims[subnet] = sock
    return True


def _release(subnet: ipaddress.IPv4Network) -> None:
    sock = _claims.pop(subnet, None)
    if sock is not None:
        sock.close()


def pick_subnet() -> ipaddress.IPv4Network:
    """A 10.203.K.0/24 that no host address or route overlaps and no other starting stack has
    claimed; it stays claimed until the first network is created in it."""
    used = _used_networks()
    for candidate in _SUBNET_BASE.subnets(new_prefix=24):
        if candidate.network_address.packed[2] == 0:
            continue
        if any(candidate.overlaps(net) for net in used) or not _claim(candidate):
            continue
        # read again: a stack that created its first address and let its claim go between
        # our read and our claim is using it
        if any(candidate.overlaps(net) for net in _used_networks()):
            _release(candidate)
            continue
        return candidate
    raise StackError("no free 10.203.K.0/24 subnet for node namespaces (stale stacks? run cleanup)")


def create_node_network(
    short_id: str, index: int, node: str, subnet: ipaddress.IPv4Network
) -> NodeNetwork:
    """Create the namespace and veth pair of node number `index`.

    Raises StackError (after removing what it created) when a step fails.
    """
    if not re.fullmatch(r"[0-9a-f]{4}", short_id):
        raise InvalidInput(f"short stack id must be 4 hex digits, got {short_id!r}")
    base = int(subnet.network_address) + 4 * index
    host_ip, ns_ip = ipaddress.ip_address(base + 1), ipaddress.ip_address(base + 2)
    net = NodeNetwork(
        netns=f"{NETNS_PREFIX}{short_id}-{node}",
        veth_host=f"lc{short_id}-{index}h",
        veth_ns=f"lc{short_id}-{index}n",
        host_address=str(host_ip),
        address=str(ns_ip),
    )
    steps = [
        ["ip", "netns", "add", net.netns],
        ["ip", "link", "add", net.veth_host, "type", "veth", "peer", "name", net.veth_ns],
        ["ip", "link", "set", net.veth_ns, "netns", net.netns],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", net.veth_host],
        ["ip", "link", "set", net.veth_host, "up"],
        ["ip", "-n", net.netns, "addr", "add", f"{ns_ip}/30", "dev", net.veth_ns],
        ["ip", "-n", net.netns, "link", "set", net.veth_ns, "up"],
        ["ip", "-n", net.netns, "link", "set", "lo", "up"],
    ]
    try:
        for argv in steps:
            _run(argv)
    except StackError:
        delete_node_network(net)
        raise
    finally:
        _release(subnet)  # its addresses now show (or it failed): the claim has done its job
    return net


REGISTRY_LINK_INDEX = 50
"""Link numbers of the registry's network (the host's link, then one per member), above
any node's (at most 21 nodes)."""
_REGISTRY_OFFSET = 192
"""The registry's segment: 10.203.K.192/26 of the stack's /24 (nodes use the /30s below)."""


@dataclass(frozen=True)
class RegistryNetwork:
    """One L2 segment for the registry's members, each in a namespace of its own: a bridge in
    a namespace of its own (no bridge and no forwarding on the host), the host on it by one
    veth, each member by another. A member is partitioned like a node (DROP in its own
    namespace), which cuts it off from its peers and its clients alike."""

    bridge_netns: str
    host_address: str
    """The host's address on the segment (the gateways' and the registrar's source)."""
    members: tuple[tuple[str, str], ...]
    """(namespace, address) of each member, in order."""


def create_registry_network(
    short_id: str, members: int, subnet: ipaddress.IPv4Network
) -> RegistryNetwork:
    """Create the registry's namespaces, bridge and links. Raises StackError (after removing
    what it created) when a step fails."""
    if not re.fullmatch(r"[0-9a-f]{4}", short_id):
        raise InvalidInput(f"short stack id must be 4 hex digits, got {short_id!r}")
    base = int(subnet.network_address) + _REGISTRY_OFFSET
    host_ip = ipaddress.ip_address(base + 1)
    bridge_ns = f"{NETNS_PREFIX}{short_id}-regnet"
    net = RegistryNetwork(
        bridge_netns=bridge_ns,
        host_address=str(host_ip),
        members=tuple(
            (f"{NETNS_PREFIX}{short_id}-reg-{i}", str(ipaddress.ip_address(base + 2 + i)))
            for i in range(members)
        ),
    )
    host_link = f"lc{short_id}-{REGISTRY_LINK_INDEX}h"
    steps = [
        ["ip", "netns", "add", bridge_ns],
        ["ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", bridge_ns, "link", "set", "br0", "up"],
        # the host's link: its far end on the bridge
        [
            "ip",
            "link",
            "add",
            host_link,
            "type",
            "veth",
            "peer",
            "name",
            f"lc{short_id}-{REGISTRY_LINK_INDEX}n",
        ],
        ["ip", "link", "set", f"lc{short_id}-{REGISTRY_LINK_INDEX}n", "netns", bridge_ns],
        [
            "ip",
            "-n",
            bridge_ns,
            "link",
            "set",
            f"lc{short_id}-{REGISTRY_LINK_INDEX}n",
            "master",
            "br0",
            "up",
        ],
        ["ip", "addr", "add", f"{host_ip}/26", "dev", host_link],
        ["ip", "link", "set", host_link, "up"],
    ]
    for i, (namespace, address) in enumerate(net.members):
        near, far = (
            f"lc{short_id}-{REGISTRY_LINK_INDEX + 1 + i}n",
            f"lc{short_id}-{REGISTRY_LINK_INDEX + 1 + i}h",
        )
        steps += [
            ["ip", "netns", "add", namespace],
            ["ip", "link", "add", near, "type", "veth", "peer", "name", far],
            ["ip", "link", "set", near, "netns", namespace],
            ["ip", "link", "set", far, "netns", bridge_ns],
            ["ip", "-n", bridge_ns, "link", "set", far, "master", "br0", "up"],
            ["ip", "-n", namespace, "addr", "add", f"{address}/26", "dev", near],
            ["ip", "-n", namespace, "link", "set", near, "up"],
            ["ip", "-n", namespace, "link", "set", "lo", "up"],
        ]
    try:
        for argv in steps:
            _run(argv)
    except StackError:
        delete_registry_network(net, short_id)
        raise
    finally:
        _release(subnet)
    return net


def delete_registry_network(net: RegistryNetwork, short_id: str) -> None:
    """Remove the registry's namespaces (their links go with them) and the host's link, and
    any member link left on the host by an interrupted creation."""
    for namespace, _ in net.members:
        delete_namespace(namespace)
    delete_namespace(net.bridge_netns)
    for index in range(REGISTRY_LINK_INDEX, REGISTRY_LINK_INDEX + 1 + len(net.members)):
        for end in "hn":
            delete_link(f"lc{short_id}-{index}{end}")


def delete_node_network(net: NodeNetwork) -> None:
    """Remove the node's namespace (its rules and veth end go with it) and the host veth end."""
    delete_namespace(net.netns)
    delete_link(net.veth_host)


def delete_namespace(name: str) -> None:
    """Delete namespace `name` if it exists; its iptables rules and veth ends go with it."""
    if name:
        _run(["ip", "netns", "del", name], check=False)


def delete_link(name: str) -> None:
    """Delete host link `name` if it exists (deleting one veth end deletes the pair)."""
    if name:
        _run(["ip", "link", "del", name], check=False)


def _iptables(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", "netns", "exec", netns, "iptables", "-w", *args], check=check)


_CHAINS = {"ingress": ("INPUT", "-i"), "egress": ("OUTPUT", "-o")}
"""Traffic into the node (INPUT, by incoming interface) and out of it (OUTPUT)."""


def _directions(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return ("ingress", "egress")
    if direction not in _CHAINS:
        raise InvalidInput(f"direction: expected both, ingress or egress, got {direction!r}")
    return (direction,)


def _rule(direction: str, comment: str, share: float | None = None) -> tuple[str, list[str]]:
    """(chain, rule spec): DROP on every interface but loopback, of a random `share` of the
    packets when given."""
    chain, interface = _CHAINS[direction]
    spec = ["!", interface, "lo"]
    if share is not None:
        spec += ["-m", "statistic", "--mode", "random", "--probability", f"{share:.6f}"]
    return chain, [*spec, "-m", "comment", "--comment", comment, "-j", "DROP"]


def _add(netns: str, chain: str, spec: list[str]) -> None:
    if _iptables(netns, "-C", chain, *spec, check=False).returncode != 0:
        _iptables(netns, "-I", chain, "1", *spec)


def _delete_commented(netns: str, comment: str) -> None:
    """Every rule of the filter table carrying `comment`, whatever its match."""
    for line in _iptables(netns, "-S", check=False).stdout.splitlines():
        if f"--comment {comment} " in line + " " and line.startswith("-A "):
            _iptables(netns, "-D", *shlex.split(line)[1:], check=False)


def partition_namespace(netns: str, direction: str = "both") -> None:
    """Drop every packet into and/or out of `netns` except on its loopback. Idempotent."""
    for side in _directions(direction):
        _add(netns, *_rule(side, _PARTITION_COMMENT))


def heal_partition(netns: str) -> None:
    """Remove the partition rules from `netns`, whatever their direction. Idempotent."""
    _delete_commented(netns, _PARTITION_COMMENT)


def is_partitioned(netns: str) -> bool:
    """True when `netns` holds a partition rule."""
    return _PARTITION_COMMENT in _iptables(netns, "-S", check=False).stdout


def drop_share(netns: str, share: float, direction: str) -> None:
    """Drop a random `share` (0..1) of the packets into and/or out of `netns` (iptables'
    statistic match): packet loss. Replaces an earlier loss rule."""
    undrop_share(netns)
    for side in _directions(direction):
        _add(netns, *_rule(side, _LOSS_COMMENT, share))


def undrop_share(netns: str) -> None:
    """Remove the loss rules of `netns`. Idempotent."""
    _delete_commented(netns, _LOSS_COMMENT)


def queue_packets(netns: str, direction: str, queue: int = 0) -> None:
    """Hand the packets into and/or out of `netns` (loopback aside) to NFQUEUE `queue`, where
    a delayer holds them (llmchaos.stack.nfqueue); they pass untouched while none listens
    (--queue-bypass). Appended, so drop rules before it still drop. Idempotent."""
    for side in _directions(direction):
        chain, interface = _CHAINS[side]
        spec = ["!", interface, "lo", "-m", "comment", "--comment", _DELAY_COMMENT]
        spec += ["-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
        if _iptables(netns, "-C", chain, *spec, check=False).returncode != 0:
            _iptables(netns, "-A", chain, *spec)


def unqueue_packets(netns: str) -> None:
    """Remove the NFQUEUE rules of `netns`. Idempotent."""
    _delete_commented(netns, _DELAY_COMMENT)


def rule_packets(netns: str, kind: str) -> dict[str, int]:
    """Packets matched so far by our `kind` rules ("partition" or "loss": dropped; "delay":
    queued) in `netns`, by chain; {} when there are none (or no such namespace)."""
    comment = {"partition": _PARTITION_COMMENT, "loss": _LOSS_COMMENT, "delay": _DELAY_COMMENT}[
        kind
    ]
    counts: dict[str, int] = {}
    for chain in ("INPUT", "OUTPUT"):
        listed = _iptables(netns, "-L", chain, "-v", "-x", "-n", check=False).stdout
        for line in listed.splitlines():
            if f"/* {comment} */" in line:
                counts[chain] = counts.get(chain, 0) + int(line.split()[0])
    return counts


def list_namespaces(short_id: str | None = None) -> list[str]:
    """Namespaces of ours that exist now: of the stack with `short_id`, or of any stack."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    prefix = NETNS_PREFIX + (f"{short_id}-" if short_id else "")
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def namespace_age_s(name: str) -> float:
    """Seconds since namespace `name` was created (its mount point's age); inf when unknown."""
    try:
        return time.time() - (Path("/run/netns") / name).stat().st_mtime
    except OSError:
        return math.inf


def short_id_of(name: str) -> str:
    """The short stack id in one of our namespace or link names."""
    return name.removeprefix(NETNS_PREFIX)[:4] if name.startswith(NETNS_PREFIX) else name[2:6]


def list_links(short_id: str | None = None) -> list[str]:
    """Host network links of ours that exist now: of the stack with `short_id`, or of any."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    links = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if _LINK_PATTERN.fullmatch(name) and short_id in (None, short_id_of(name)):
                links.append(name)
    return links
