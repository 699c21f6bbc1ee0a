"""The user's own serving processes on this machine as a target kind, described in a hosts
file (topology.py: front door, inference servers, gateways, Redis, max_qps, variants).

    LLMCHAOS_TARGET=hosts LLMCHAOS_HOSTS_FILE=experiments/targets/litellm.yaml \\
      chaos run experiments/gpu_kill.json

Settings are `hosts_<field>` configuration keys or `LLMCHAOS_HOSTS_<FIELD>`. Opening the
target checks the file against the machine first (preflight.py), then starts what the file
says llmchaos starts (servers, then gateways, each waited for), and keeps the servers alive
(supervisor.py); closing it stops them and removes this run's iptables rules. A killed run's
leftovers are found by `llmchaos cleanup` (state.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import FaultLedger
from llmchaos.processes import Owner
from llmchaos.targets import (
    DEFAULT_VARIANT,
    CleanupRequest,
    Target,
    TargetInfo,
    TargetKind,
    TargetSettings,
)
from llmchaos.targets.hosts.preflight import preflight_problems
from llmchaos.targets.hosts.state import TargetState, cleanup_dead, remove_target
from llmchaos.targets.hosts.supervisor import Supervisor
from llmchaos.targets.hosts.target import HostsTarget, planned_info
from llmchaos.targets.hosts.topology import HostsTopology, load_topology

__all__ = ["KIND", "HostsKind", "HostsSettings", "HostsTarget", "load_topology"]

log = logging.getLogger("chaostoolkit")

DEFAULT_STATE_ROOT = "reports/hosts"


@dataclass(frozen=True)
class HostsSettings(TargetSettings):
    """The hosts target (configuration keys `hosts_<field>`, LLMCHAOS_HOSTS_<FIELD>)."""

    file: str = ""
    """The hosts file (YAML or JSON) describing the processes: required."""
    state_root: str = DEFAULT_STATE_ROOT
    """Folder of the opened targets' state folders (process records, logs, token file)."""

    def __post_init__(self) -> None:
        if not self.file:
            raise InvalidInput(
                "hosts_file (LLMCHAOS_HOSTS_FILE): required with target hosts: the file that "
                "describes your serving processes, e.g. experiments/targets/litellm.yaml"
            )


@functools.lru_cache(maxsize=32)
def _cached(path: str, mtime_ns: int, variant: str) -> HostsTopology:
    return load_topology(Path(path), variant)


def topology_of(settings: TargetSettings, variant: str | None = None) -> HostsTopology:
    """The hosts file of `settings` with its variant (or `variant`) applied, read again only
    when it changed."""
    assert isinstance(settings, HostsSettings), settings
    path = Path(settings.file)
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        mtime_ns = 0  # load_topology says why it cannot be read
    return _cached(str(path), mtime_ns, variant or settings.variant)


class HostsKind(TargetKind):
    """See the module docstring."""

    name = "hosts"
    settings_type = HostsSettings
    prefix = "hosts_"

    def variants(self, settings: TargetSettings) -> tuple[str, ...]:
        return topology_of(settings, DEFAULT_VARIANT).variants

    def max_qps(self, settings: TargetSettings) -> float | None:
        return topology_of(settings).max_qps

    def max_qps_source(self, settings: TargetSettings) -> str:
        return f"max_qps in {topology_of(settings).path}: what this machine's gateways take"

    def plan(self, settings: TargetSettings) -> TargetInfo:
        topology = topology_of(settings)
        _preflight(topology)
        return planned_info(topology)

    def open(self, settings: TargetSettings, owner: Owner) -> Target:
        assert isinstance(settings, HostsSettings), settings
        topology = topology_of(settings)
        _preflight(topology)
        state = TargetState.create(
            Path(settings.state_root), owner, topology.path, topology.variant
        )
        token = _token(topology)
        tokens_file = state.write_token(token) if token else None
        supervisor = Supervisor(topology, state, owner, token)
        try:
            ours = [p for p in topology.parts if p.started_by_us]
            for role in ("redis", "server", "gateway"):
                parts = [p for p in ours if p.role == role]
                for part in parts:
                    supervisor.start(part)
                supervisor.wait_ready(parts)
                if parts:
                    log.info(
                        "llmchaos: hosts %ss ready: %s", role, ", ".join(p.name for p in parts)
                    )
            supervisor.wait_ready([p for p in topology.parts if not p.started_by_us])
            _warm_up(topology, token)
            supervisor.watch()
        except BaseException:
            supervisor.stop()
            remove_target(state)
            raise
        return HostsTarget(topology, state, owner, supervisor, tokens_file)

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        state = _state(record)
        owner = state.owner or Owner.this_process("run")
        topology = load_topology(Path(state.data["hosts_file"]), str(state.data["variant"]))
        return HostsTarget(topology, state, owner, None, None)

    def finish_dead_run(
        self, settings: TargetSettings, record: dict[str, Any], ledger: FaultLedger
    ) -> list[str]:
        """Partitions are healed through the rules' tags; a gateway the user runs is
        restarted with its restart command; what llmchaos started goes with the run."""
        target = self.reattach(settings, record)
        assert isinstance(target, HostsTarget)
        ours = {p.name for p in target.topology.parts if p.started_by_us}
        for fault in ledger.open_faults():
            undo = fault.undo
            if (
                undo is not None
                and undo.op == "restore_gateway"
                and undo.args.get("gateway") in ours
            ):
                ledger.mark_undone(fault.id, by="cleanup (stopped with the run's processes)")
        try:
            return ledger.undo_all(lambda undo: target.undo(undo.op, undo.args), by="cleanup")
        finally:
            target.close()

    def remove_run_target(self, settings: TargetSettings, record: dict[str, Any]) -> list[str]:
        if not record.get("hosts_state_dir"):
            return []
        return remove_target(_state(record))

    def cleanup(self, request: CleanupRequest) -> list[str]:
        return cleanup_dead(
            Path(DEFAULT_STATE_ROOT),
            request.names,
            everything=request.everything,
            dry_run=request.dry_run,
        )


def _preflight(topology: HostsTopology) -> None:
    problems = preflight_problems(topology, os.environ)
    if problems:
        raise InvalidInput("\n".join(problems))


def _state(record: dict[str, Any]) -> TargetState:
    state = TargetState.load(Path(record["hosts_state_dir"]))
    if state is None:
        raise InvalidInput(f"hosts target: no state in {record['hosts_state_dir']}")
    return state


def _token(topology: HostsTopology) -> str | None:
    """The front door's token: generated for processes llmchaos starts (LiteLLM wants sk-),
    or the user's, from the environment."""
    if topology.token == "generate":
        return "sk-llmchaos-" + secrets.token_hex(24)
    if topology.token == "env":
        return os.environ.get(topology.token_env or "")
    return None


def _warm_up(topology: HostsTopology, token: str | None) -> None:
    """`warmup_requests` short completions through each gateway that asks for them (a cold
    LiteLLM answers its first requests in 1-3 s)."""
    body = json.dumps(
        {"model": topology.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for gateway in topology.gateways:
        for _ in range(gateway.warmup_requests):
            request = urllib.request.Request(
                gateway.url + "/v1/chat/completions", data=body, headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
            except urllib.error.HTTPError as exc:
                raise StackError(
                    f"{topology.path}: warm-up request through {gateway.name} got HTTP "
                    f"{exc.code}: {exc.read()[:200]!r}"
                ) from None
            except OSError as exc:
                raise StackError(
                    f"{topology.path}: warm-up request through {gateway.name}: {exc}"
                ) from None


KIND = HostsKind()
