"""The stack's service registry: a 3-member etcd cluster the gateways find their workers in.

    find_etcd()                                   # the binary, or InvalidInput saying how
    members = plan_members(state_dir, network)    # names, URLs, folders
    start_member(member, members, ...); wait_ready(members)
    leader(members) -> "reg-1"                    # from each member's maintenance status

With network namespaces, each member runs in a namespace of its own on one segment
(`netns.create_registry_network`), so a member can be partitioned from its peers and its
clients like a node; without, the members listen on loopback ports. Each member keeps its data
folder, so a killed member started again rejoins with what it had (`restart_member`).

etcd comes from, in order: $LLMCHAOS_ETCD, the etcd that scripts/build-k8s.sh builds for the
Kubernetes tests (~/.cache/llmchaos/k8s/<version>/bin/etcd, v3.6.4), or `etcd` on the PATH
(Debian's etcd-server, 3.4).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from llmchaos.errors import InvalidInput, StackError
from llmchaos.processes import Owner, pid_alive
from llmchaos.stack import etcd
from llmchaos.stack.netns import RegistryNetwork
from llmchaos.stack.procs import free_port, http_get_status, spawn, wait_until
from llmchaos.stack.topology import RegistryInfo, RegistryMember, Topology, read_owner

__all__ = [
    "MEMBERS",
    "find_etcd",
    "leader",
    "member_argv",
    "plan_members",
    "restart_member",
    "start_member",
    "wait_ready",
]

MEMBERS = 3
"""A cluster that survives the loss of one member (its leader included)."""
CLIENT_PORT, PEER_PORT = 2379, 2380
_STATUS_TIMEOUT_S = 0.5
_START_CHECK_S = 0.3
"""A restarted member still running this long after its start did not fail on its flags
or its data folder."""


def find_etcd() -> str:
    """The etcd binary to run; InvalidInput saying how to get one when there is none."""
    configured = os.environ.get("LLMCHAOS_ETCD")
    if configured:
        if not os.access(configured, os.X_OK):
            raise InvalidInput(f"LLMCHAOS_ETCD: {configured} is not an executable file")
        return configured
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmchaos" / "k8s"
    built = sorted(cache.glob("*/bin/etcd"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in built:
        if os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("etcd")
    if found:
        return found
    raise InvalidInput(
        "discovery etcd: no etcd binary: run `make k8s-bin` (builds etcd 3.6.4 into "
        f"{cache}/<version>/bin), `apt-get install etcd-server`, or set LLMCHAOS_ETCD"
    )


def plan_members(state_dir: Path, network: RegistryNetwork | None) -> tuple[RegistryMember, ...]:
    """The members' names, URLs and folders, before any starts."""
    members = []
    for i in range(MEMBERS):
        if network is not None:
            namespace, address = network.members[i]
            client, peer = f"http://{address}:{CLIENT_PORT}", f"http://{address}:{PEER_PORT}"
        else:
            namespace = None
            client = f"http://127.0.0.1:{free_port()}"
            peer = f"http://127.0.0.1:{free_port()}"
        members.append(
            RegistryMember(
                name=f"reg-{i}",
                client_url=client,
                peer_url=peer,
                netns=namespace,
                data_dir=str(state_dir / "registry" / f"reg-{i}"),
                log_path=str(state_dir / "logs" / f"registry-reg-{i}.log"),
            )
        )
    return tuple(members)


def member_argv(
    member: RegistryMember, members: tuple[RegistryMember, ...], binary: str, token: str
) -> list[str]:
    """The member's command line: the same for its first start and a restart (etcd ignores
    the initial-cluster flags once its data folder exists)."""
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    argv = [
        binary,
        "--name", member.name,
        "--data-dir", member.data_dir,
        "--listen-client-urls", member.client_url,
        "--advertise-client-urls", member.client_url,
        "--listen-peer-urls", member.peer_url,
        "--initial-advertise-peer-urls", member.peer_url,
        "--initial-cluster", cluster,
        "--initial-cluster-state", "new",
        "--initial-cluster-token", token,
        "--log-level", "warn",
        # Timing as etcd's tuning guide has it for members a few ms apart rather than on one
        # LAN (election >= 10 x RTT): a lost leader leaves the cluster leaderless 2-4 s, longer
        # than one discovery poll (3 members x 0.5 s). With the 1 s default the election often
        # ended inside one poll, and registry_leader_loss's known-bad gateway never saw it.
        "--heartbeat-interval", "200",
        "--election-timeout", "2000",
    ]  # fmt: skip
    if member.netns:
        argv = ["ip", "netns", "exec", member.netns, *argv]
    return argv


def start_member(
    member: RegistryMember,
    members: tuple[RegistryMember, ...],
    *,
    binary: str,
    token: str,
    stack_id: str,
    owner: Owner,
) -> int:
    """Start one member (`ip netns exec` execs etcd: the pid is etcd's); returns its pid."""
    Path(member.data_dir).mkdir(parents=True, exist_ok=True)
    process = spawn(
        member_argv(member, members, binary, token),
        stack_id=stack_id,
        owner=owner,
        log_path=Path(member.log_path),
    )
    return process.pid


def wait_ready(members: tuple[RegistryMember, ...], timeout_s: float) -> None:
    """Until every member answers /health (true once the cluster has a leader)."""
    for member in members:
        wait_until(
            f"registry member {member.name}",
            lambda m=member: http_get_status(f"{m.client_url}/health", 0.5) == 200,
            timeout_s,
            log_path=Path(member.log_path),
        )


def leader(members: tuple[RegistryMember, ...]) -> str:
    """The name of the member that leads now, by the members' own maintenance status.

    Raises StackError when no member answers or they know no leader (an election)."""
    ids: dict[str, str] = {}
    leaders = set()
    problems = []
    for member in members:
        try:
            status = etcd.call(member.client_url, "/v3/maintenance/status", {}, _STATUS_TIMEOUT_S)
        except StackError as exc:
            problems.append(str(exc))
            continue
        ids[str(status.get("header", {}).get("member_id"))] = member.name
        if status.get("leader") not in (None, "0"):
            leaders.add(str(status["leader"]))
    for leader_id in leaders:
        if leader_id in ids:
            return ids[leader_id]
    raise StackError(
        "registry: no leader known to the members that answered"
        + (f" ({'; '.join(problems)})" if problems else "")
    )


def restart_member(topology: Topology, name: str) -> Topology:
    """Start member `name` again from its data folder if it is not running; save and return
    the updated topology. It is not waited for: a member does not serve its clients until
    it has rejoined a quorum, which may need the other members back too (wait_ready, or
    `leader`, once all are started). Raises StackError when it exits at once."""
    info = _registry(topology)
    member = info.member(name)
    if member.pid and pid_alive(member.pid):
        return topology
    owner = read_owner(Path(topology.state_dir)) or Owner.this_process("user")
    pid = start_member(
        member,
        info.members,
        binary=info.binary,
        token=info.cluster_token,
        stack_id=topology.stack_id,
        owner=owner,
    )
    time.sleep(_START_CHECK_S)
    if not pid_alive(pid):
        raise StackError(f"registry member {name} exited at once; see {member.log_path}")
    members = tuple(replace(m, pid=pid) if m.name == name else m for m in info.members)
    updated = replace(topology, registry=replace(info, members=members))
    updated.save()
    return updated


def _registry(topology: Topology) -> RegistryInfo:
    if topology.registry is None:
        raise InvalidInput(
            "the stack has no registry: start it with discovery etcd (the experiment's "
            "`discovery: etcd`)"
        )
    return topology.registry
