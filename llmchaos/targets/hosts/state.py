"""The state folder of one opened hosts target, and the cleanup of what dead owners left.

    reports/hosts/<id>/hosts.json      owner, status, the processes llmchaos started (pid,
                                       process group, start time), written before each start
    reports/hosts/<id>/tokens.json     the generated front-door token (mode 600), for the load
    reports/hosts/<id>/<part>/         {state} of each process: its log, pid files, prefix

What a killed run leaves is found three ways, so none depends on the others: the process
groups in hosts.json (nginx and redis-server overwrite their environment with their title),
the LLMCHAOS_HOSTS marker in the environment of the others, and the iptables rules by their
tag, which names the owner (firewall.py).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmchaos.files import read_json_object, write_json_atomic, write_text_atomic
from llmchaos.processes import Owner, find_marked
from llmchaos.stack import cgroups
from llmchaos.targets.hosts import firewall
from llmchaos.targets.hosts.procs import (
    HOSTS_ENV,
    OWNER_ENV,
    group_members,
    kill_all,
    wait_gone,
)

__all__ = ["STATE_FILE", "TargetState", "cleanup_dead", "new_target_id", "remove_target"]

STATE_FILE = "hosts.json"
_GRACE_S = 5.0


def new_target_id() -> str:
    """<date>-<time>-<4 hex>: sortable, and unique on one machine."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@dataclass
class TargetState:
    """hosts.json of one target."""

    state_dir: Path
    data: dict[str, Any]

    @classmethod
    def create(cls, root: Path, owner: Owner, hosts_file: Path, variant: str) -> TargetState:
        target_id = new_target_id()
        state = cls(
            Path(root).resolve() / target_id,
            {
                "id": target_id,
                "owner": owner.to_dict(),
                "status": "running",
                "hosts_file": str(Path(hosts_file).resolve()),
                "variant": variant,
                "processes": {},
            },
        )
        state.state_dir.mkdir(parents=True)
        state.save()
        return state

    @classmethod
    def load(cls, state_dir: Path) -> TargetState | None:
        data = read_json_object(Path(state_dir) / STATE_FILE)
        return cls(Path(state_dir), data) if data and "id" in data else None

    @property
    def target_id(self) -> str:
        return str(self.data["id"])

    @property
    def owner(self) -> Owner | None:
        return Owner.from_dict(self.data.get("owner") or {})

    @property
    def tokens_file(self) -> Path:
        return self.state_dir / "tokens.json"

    def part_dir(self, name: str) -> Path:
        path = self.state_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def save(self) -> None:
        write_json_atomic(self.state_dir / STATE_FILE, self.data)

    def record_process(self, name: str, role: str, pid: int, ticks: int | None) -> None:
        """Note a process llmchaos started (its own process group: pgid = pid)."""
        self.data["processes"][name] = {
            "pid": pid,
            "pgid": pid,
            "start_ticks": ticks,
            "role": role,
            "started_at": time.time(),
        }
        self.save()

    def write_token(self, token: str) -> Path:
        tokens = {"tokens": [{"token": token, "tenant": "default", "revoked": False}]}
        return write_text_atomic(self.tokens_file, json.dumps(tokens), private=True)

    def mark(self, status: str) -> None:
        self.data["status"] = status
        self.save()


def _state_pids(state: TargetState) -> list[int]:
    pids: list[int] = []
    for record in state.data.get("processes", {}).values():
        pids += group_members(int(record["pgid"]), record.get("start_ticks"))
    return pids


def remove_target(state: TargetState) -> list[str]:
    """Stop every process of the target that llmchaos started and remove its partition rules;
    one line per thing removed."""
    lines = []
    marked = [p for p, v in find_marked(HOSTS_ENV).items() if v == state.target_id]
    pids = sorted(set(_state_pids(state)) | set(marked))
    if pids:
        kill_all(pids, 15)
        left = wait_gone(pids, _GRACE_S)
        kill_all(left)
        wait_gone(left, 2.0)
        lines.append(
            f"hosts target {state.target_id}: stopped processes {' '.join(map(str, pids))}"
        )
    lines += remove_rules(state.target_id)
    for group in cgroups.list_ours(f"hosts-{state.target_id}-"):
        cgroups.remove(group)  # the user's processes back where they were, unthrottled
        lines.append(f"hosts target {state.target_id}: removed cgroup {group.describe()}")
    state.mark("stopped")
    return lines


def remove_rules(
    target_id: str | None = None, dead_only: bool = False, dry_run: bool = False
) -> list[str]:
    """Remove partition rules of `target_id` (None: of any target whose owner is gone, when
    `dead_only`), in the host's table and every network namespace; `dry_run`: only say
    which."""
    lines = []
    for netns in (None, *firewall.namespaces()):
        for rule in firewall.tagged_rules(netns):
            if target_id is not None and rule.target_id != target_id:
                continue
            if dead_only and rule.owner is not None and rule.owner.alive():
                continue
            if not dry_run:
                firewall.delete_rule(rule)
            where = f" in netns {netns}" if netns else ""
            done = "would remove" if dry_run else "removed"
            lines.append(f"hosts target {rule.target_id}: {done} rule {rule.comment}{where}")
    return lines


def cleanup_dead(
    root: Path, names: tuple[str, ...] = (), everything: bool = False, dry_run: bool = False
) -> list[str]:
    """Remove what hosts targets of dead owners left (or those named, or every one): their
    processes, partition rules and throttle cgroups (empty ones of targets known nowhere
    too). One line per thing removed or left alone."""
    lines = []
    known_ids = set()
    for state_file in sorted(Path(root).glob(f"*/{STATE_FILE}")):
        state = TargetState.load(state_file.parent)
        if state is None or state.data.get("status") != "running":
            continue
        known_ids.add(state.target_id)
        owner = state.owner
        live = owner is not None and owner.alive()
        if live and not everything and state.target_id not in names:
            lines.append(
                f"left alone hosts target {state.target_id}: belongs to {owner.describe()}"
            )
            continue
        if dry_run:
            lines.append(f"would stop hosts target {state.target_id} ({state.state_dir})")
            continue
        lines += remove_target(state)
    owners = find_marked(OWNER_ENV)
    for pid, target_id in find_marked(HOSTS_ENV).items():
        owner = Owner.from_marker(owners.get(pid, ""))
        if target_id not in known_ids and (everything or owner is None or not owner.alive()):
            if not dry_run:
                kill_all([pid])
            done = "would kill" if dry_run else "killed"
            lines.append(f"hosts target {target_id}: {done} stray process {pid}")
    lines += remove_rules(dead_only=not everything, dry_run=dry_run)
    lines += _remove_stray_cgroups(known_ids, dry_run)
    return lines


_CGROUP_NAME = re.compile(rf"{cgroups.CGROUP_PREFIX}hosts-(\d{{8}}-\d{{6}}-[0-9a-f]{{4}})-")
"""A hosts target's cgroup: llmc-hosts-<target id (new_target_id)>-<part>."""
STRAY_CGROUP_GRACE_S = 30.0
"""A hosts cgroup of a target known nowhere is left alone this long after its creation: a run
under another state root creates it a moment before it moves the process in."""


def _remove_stray_cgroups(known_ids: set[str], dry_run: bool = False) -> list[str]:
    """Empty throttle cgroups of targets whose state folder is gone (a run killed, its folder
    deleted): empty, they throttle nothing, and no state folder leads cleanup to them. One
    that holds a process may be a live run's under another state root: left alone.
    `dry_run`: only say which."""
    lines = []
    for group in cgroups.list_ours("hosts-"):
        named = _CGROUP_NAME.match(group.path.name)
        target_id = named.group(1) if named else "?"
        if target_id in known_ids or group.pids():
            continue
        try:
            age_s = time.time() - group.path.stat().st_mtime
        except OSError:
            continue  # gone meanwhile
        if age_s >= STRAY_CGROUP_GRACE_S:
            if not dry_run:
                cgroups.remove(group)
            done = "would remove" if dry_run else "removed"
            lines.append(f"hosts target {target_id}: {done} empty cgroup {group.describe()}")
    return lines
