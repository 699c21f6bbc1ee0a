"""The topology of a running stack: what `stack up` started, where, and with which pids.

Written as `topology.json` in the stack's state folder; probes, actions and the load read it
to find the gateway URL, the tokens file, the nodes' namespaces and the workers' addresses.
Worker pids change when a node agent restarts a worker, so they live in the agent's own state
file (`AgentState`), not here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.files import write_json_atomic, write_text_atomic
from llmchaos.processes import Owner
from llmchaos.stack.settings import ServingMode, settings_from_dict, write_settings

__all__ = [
    "CURRENT_FILE",
    "OWNER_FILE",
    "SECRETS_FILE",
    "AgentState",
    "GatewayInfo",
    "NodeInfo",
    "RegistryInfo",
    "RegistryMember",
    "StackSecrets",
    "Topology",
    "WorkerInfo",
    "WorkerState",
    "find_state_dir",
    "read_agent_state",
    "read_owner",
    "read_replicas",
    "read_secrets",
    "write_owner",
    "write_replicas",
    "write_secrets",
]

CURRENT_FILE = "current"
"""File in the state root naming the stack that `status`/`down` act on by default."""
OWNER_FILE = "owner.json"
"""File in a stack's state folder saying whom the stack belongs to; written before anything
of the stack starts, so even a start killed half-way can be judged by `llmchaos cleanup`."""


SECRETS_FILE = "secrets.json"
"""The stack's own secrets (the Redis password), mode 600 like the tokens file: the only
files of a state folder that hold secrets. Nothing else (topology, settings, logs) does."""


@dataclass(frozen=True)
class StackSecrets:
    """What the stack's processes need and nobody may read in its other files."""

    redis_password: str


def write_secrets(state_dir: Path, stack_secrets: StackSecrets) -> None:
    data = {"redis_password": stack_secrets.redis_password}
    write_text_atomic(Path(state_dir) / SECRETS_FILE, json.dumps(data), private=True)


def read_secrets(state_dir: Path) -> StackSecrets:
    """The stack's secrets; raises InvalidInput when the file is missing or broken."""
    path = Path(state_dir) / SECRETS_FILE
    try:
        return StackSecrets(str(json.loads(path.read_text())["redis_password"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise InvalidInput(f"{path}: missing or unreadable (is it a stack state folder?)") from None


def write_owner(state_dir: Path, owner: Owner) -> None:
    write_json_atomic(Path(state_dir) / OWNER_FILE, owner.to_dict())


def read_owner(state_dir: Path) -> Owner | None:
    """The stack's owner, None when the folder has no readable owner file."""
    try:
        data = json.loads((Path(state_dir) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Owner.from_dict(data) if isinstance(data, dict) else None


@dataclass(frozen=True)
class WorkerInfo:
    """An engine worker as placed by `stack up`."""

    name: str
    mode: ServingMode
    node: str
    url: str
    """Base URL, reachable from the host (the node's namespace address when netns is on)."""
    settings_path: str
    log_path: str


@dataclass(frozen=True)
class NodeInfo:
    """A node: a network namespace (or the host's loopback) with its agent and workers."""

    name: str
    address: str
    """Address the node's workers bind to."""
    netns: str | None
    """Namespace name, None when nodes share the host's loopback."""
    veth_host: str | None
    agent_pid: int
    agent_state_path: str
    workers: tuple[WorkerInfo, ...]


@dataclass(frozen=True)
class GatewayInfo:
    """An API gateway process behind HAProxy."""

    name: str
    role: str
    """primary (an active gateway: HAProxy spreads requests over all of them) or backup
    (HAProxy sends to it only when every primary is down)."""
    url: str
    pid: int
    settings_path: str
    log_path: str


@dataclass(frozen=True)
class RegistryMember:
    """One etcd member of the stack's registry (llmchaos.stack.registry)."""

    name: str
    client_url: str
    peer_url: str
    netns: str | None
    data_dir: str
    log_path: str
    pid: int = 0
    """Its etcd process now (changes when it is started again)."""


@dataclass(frozen=True)
class RegistryInfo:
    """The registry the gateways find their workers in, and who keeps it filled."""

    members: tuple[RegistryMember, ...]
    prefix: str
    """Key prefix of the stack's workers."""
    cluster_token: str
    binary: str
    """The etcd the members run (what a restart runs again)."""
    registrar_pid: int = 0

    def member(self, name: str) -> RegistryMember:
        """The member called `name`; raises InvalidInput listing the known ones."""
        for member in self.members:
            if member.name == name:
                return member
        known = ", ".join(m.name for m in self.members)
        raise InvalidInput(f"member: unknown registry member {name!r}; members: {known}")


@dataclass(frozen=True)
class Topology:
    """Everything one `stack up` started."""

    stack_id: str
    state_dir: str
    created_at: float
    variant: str
    status: str
    """running or stopped."""
    gateway_url: str
    """HAProxy's front URL: what clients and the load use."""
    model: str
    tokens_file: str
    token_db: str
    redis_url: str
    redis_pid: int
    haproxy_pid: int
    haproxy_config: str
    haproxy_stats_port: int
    """HAProxy's admin socket (TCP on 127.0.0.1): `show stat`, `disable server` ..."""
    nodes: tuple[NodeInfo, ...]
    gateways: tuple[GatewayInfo, ...]
    replicas_path: str | None = None
    """The replicas file the node agents follow (None: every worker always runs)."""
    autoscaler_pid: int | None = None
    """The embedded autoscaler (None: none runs; the replica count stays as written)."""
    registry: RegistryInfo | None = None
    """The service registry (None: the gateways' workers are in their settings)."""

    @property
    def path(self) -> Path:
        return Path(self.state_dir) / "topology.json"

    def save(self) -> Path:
        return write_settings(self, self.path)

    def with_status(self, status: str) -> Topology:
        return replace(self, status=status)

    def node(self, name: str) -> NodeInfo:
        """The node called `name`; raises InvalidInput listing the known ones."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise InvalidInput(f"unknown node {name!r}; nodes: {', '.join(n.name for n in self.nodes)}")

    def worker(self, name: str) -> WorkerInfo:
        """The worker called `name`; raises InvalidInput listing the known ones."""
        workers = [w for n in self.nodes for w in n.workers]
        for worker in workers:
            if worker.name == name:
                return worker
        raise InvalidInput(
            f"unknown worker {name!r}; workers: {', '.join(w.name for w in workers)}"
        )

    @classmethod
    def load(cls, state_dir: Path) -> Topology:
        """Read `state_dir/topology.json`; raises InvalidInput when it is missing or broken."""
        path = Path(state_dir) / "topology.json"
        try:
            data = json.loads(path.read_text())
        except OSError:
            raise InvalidInput(
                f"{path}: no topology (is {state_dir} a stack state folder?)"
            ) from None
        except ValueError as exc:
            raise InvalidInput(f"{path}: not JSON: {exc}") from None
        return settings_from_dict(cls, data, str(path))


@dataclass(frozen=True)
class WorkerState:
    """A worker as its node agent last saw it."""

    pid: int
    started_at: float
    restarts: int = 0
    running: bool = True
    last_exit_code: int | None = None
    last_exit_at: float | None = None
    ready_at: float | None = None
    """When the worker (this pid) first answered ready; None while its model loads."""


@dataclass(frozen=True)
class AgentState:
    """State file of a node agent, rewritten on every change."""

    node: str
    agent_pid: int
    updated_at: float
    workers: dict[str, WorkerState]


def read_agent_state(path: Path) -> AgentState | None:
    """The agent's last state, or None when it has not written one yet."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    workers = {name: WorkerState(**w) for name, w in data.get("workers", {}).items()}
    return AgentState(data["node"], data["agent_pid"], data["updated_at"], workers)


REPLICAS_FILE = "replicas.json"
"""A stack's replica counts per worker pool ({"gpu": N}), written by the autoscaler (and
before anything starts), followed by the node agents: a Deployment's `spec.replicas`."""


def write_replicas(state_dir: Path, replicas: dict[str, int]) -> Path:
    path = Path(state_dir) / REPLICAS_FILE
    write_json_atomic(path, replicas)
    return path


def read_replicas(path: Path) -> dict[str, int]:
    """Replica counts from a replicas file; raises OSError when it cannot be read, ValueError
    when it is not such a file."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
        raise ValueError(f"{path}: expected {{pool: replicas}}, got {data!r}")
    return {str(k): int(v) for k, v in data.items()}


def find_state_dir(state_root: Path, state_dir: Path | None = None) -> Path:
    """The state folder to act on: `state_dir` if given, else the root's current stack.

    Raises InvalidInput when there is none.
    """
    if state_dir is not None:
        if not (Path(state_dir) / "topology.json").exists():
            raise InvalidInput(f"--state {state_dir}: no topology.json there")
        return Path(state_dir)
    current = Path(state_root) / CURRENT_FILE
    try:
        stack_id = current.read_text().strip()
    except OSError:
        raise InvalidInput(
            f"no stack found under {state_root} (start one with `llmchaos stack up`)"
        ) from None
    return Path(state_root) / stack_id
