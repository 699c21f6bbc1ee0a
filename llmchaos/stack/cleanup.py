"""`llmchaos cleanup`: remove what crashed or killed stacks left behind, and nothing else.

Found by marks, not by memory: processes by their `LLMCHAOS_STACK` environment marker (and
redis-server by its working directory), namespaces, veth ends and the resource faults'
cgroups by the stack's short id in their names, state folders by their owner and topology
files. Each stack is then judged by
its owner (`owner.json`, or the processes' `LLMCHAOS_STACK_OWNER` marker):

- a chaos run's stack goes when that run's process is gone, and stays while it lives (two
  runs at once never touch each other);
- a `llmchaos stack up` stack is the user's: it stays until `stack down`, unless its start
  was killed half-way (no topology, starter gone);
- a stopped stack's leftovers, and namespaces or links nobody owns, go;
- `--stack ID` (or `everything`) removes whatever it names, owner or not.

Running it with nothing left behind is a no-op.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.processes import Owner
from llmchaos.stack import cgroups, netns
from llmchaos.stack.procs import (
    STACK_ID_PATTERN,
    find_stack_processes,
    scan_stack_processes,
    stop_pids,
)
from llmchaos.stack.topology import CURRENT_FILE, OWNER_FILE, Topology, read_owner

__all__ = [
    "CleanupReport",
    "StackLeftovers",
    "cleanup",
    "find_stacks",
    "leftovers",
    "remove_leftovers",
]


_STACK_CGROUP = re.compile(r"[0-9a-f]{4}-")
"""A stack's cgroup after the prefix: its short id (the stack id's last 4 hex), a dash."""
_STARTING_GRACE_S = 30.0
"""A namespace younger than this, with no process and no state folder, may belong to a stack
that is starting right now (under another state root): left alone."""


@dataclass
class StackLeftovers:
    """One stack as the machine shows it now."""

    stack_id: str
    """The stack id, or `?<short id>` for namespaces and links of a stack known nowhere else."""
    state_dir: Path | None = None
    owner: Owner | None = None
    status: str = "unknown"
    """running, stopped (its topology says), starting (an owner file but no topology yet) or
    unknown (no state folder found)."""
    processes: list[int] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    """Folders of the stack's cgroups (CPU throttling, memory limits)."""

    @property
    def empty(self) -> bool:
        return not (self.processes or self.namespaces or self.links or self.cgroups)

    def keep_because(self) -> str | None:
        """Why cleanup must leave this stack alone; None when it is garbage."""
        owner = self.owner
        if owner is None and self.status == "unknown" and self.processes == []:
            young = [n for n in self.namespaces if netns.namespace_age_s(n) < _STARTING_GRACE_S]
            if young:
                # a stack under another state root creates its namespaces a moment before
                # its first marked process: not an orphan yet
                return f"namespaces {' '.join(young)} were created moments ago (a stack starting)"
        if self.status == "stopped":
            return None  # what a stopped stack left is garbage
        if owner is None:
            if self.processes and (self.state_dir is None or self.state_dir.exists()):
                return (
                    "its processes carry no owner (started by another llmchaos version?); "
                    f"`llmchaos cleanup --stack {self.stack_id}` removes them"
                )
            return None  # namespaces nobody owns, or processes whose state folder is gone
        if owner.kind == "run":
            return f"belongs to a live {owner.describe()}" if owner.alive() else None
        if self.status == "starting":
            return f"still starting ({owner.describe()})" if owner.alive() else None
        where = f" --state {self.state_dir}" if self.state_dir else ""
        return (
            f"started by {owner.describe()}; stop it with `llmchaos stack down{where}` or "
            f"`llmchaos cleanup --stack {self.stack_id}`"
        )

    def summary(self) -> str:
        parts = [
            f"processes {' '.join(map(str, self.processes)) or '-'}",
            f"namespaces {' '.join(self.namespaces) or '-'}",
            f"veth links {' '.join(self.links) or '-'}",
            *([f"cgroups {' '.join(self.cgroups)}"] if self.cgroups else []),
        ]
        return f"stack {self.stack_id} ({self.status}): " + "; ".join(parts)


@dataclass
class CleanupReport:
    """What cleanup found: removed (or would remove, in a dry run) and left alone."""

    removed: list[StackLeftovers] = field(default_factory=list)
    left_alone: list[tuple[StackLeftovers, str]] = field(default_factory=list)
    stacks_marked_stopped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return all(s.empty for s in self.removed)

    @property
    def processes(self) -> list[int]:
        return [pid for s in self.removed for pid in s.processes]

    def lines(self, dry_run: bool = False) -> list[str]:
        verb = "would remove" if dry_run else "removed"
        lines = [f"{verb} {s.summary()}" for s in self.removed if not s.empty]
        lines += [f"left alone {s.summary()}: {why}" for s, why in self.left_alone]
        if self.stacks_marked_stopped:
            lines.append(f"stacks marked stopped: {' '.join(self.stacks_marked_stopped)}")
        return lines


def leftovers(stack_id: str) -> StackLeftovers:
    """The processes, namespaces and links of `stack_id` that exist now."""
    short_id = stack_id[-4:]
    return StackLeftovers(
        stack_id,
        processes=find_stack_processes(stack_id),
        namespaces=netns.list_namespaces(short_id),
        links=netns.list_links(short_id),
        cgroups=[str(g.path) for g in cgroups.list_ours(short_id + "-")],
    )


def remove_leftovers(found: StackLeftovers) -> None:
    """Stop the processes, then delete the namespaces (their rules go with them), links and
    cgroups."""
    stop_pids(found.processes, grace_s=2.0)
    for name in found.namespaces:
        netns.delete_namespace(name)
    for link in found.links:
        netns.delete_link(link)
    for group in cgroups.list_ours():
        if str(group.path) in found.cgroups:
            cgroups.remove(group)


def find_stacks(state_root: Path) -> dict[str, StackLeftovers]:
    """Every stack with anything on this machine or a state folder under `state_root`."""
    stacks: dict[str, StackLeftovers] = {}

    def stack(stack_id: str) -> StackLeftovers:
        return stacks.setdefault(stack_id, StackLeftovers(stack_id))

    for folder in sorted(Path(state_root).glob("*")):
        if folder.is_dir() and STACK_ID_PATTERN.fullmatch(folder.name):
            stack(folder.name).state_dir = folder
    for process in scan_stack_processes():
        found = stack(process.stack_id)
        found.processes.append(process.pid)
        found.owner = found.owner or process.owner
        found.state_dir = found.state_dir or process.state_dir
    by_short = {stack_id[-4:]: stack_id for stack_id in stacks}
    for name in netns.list_namespaces():
        short = netns.short_id_of(name)
        stack(by_short.get(short, f"?{short}")).namespaces.append(name)
    for link in netns.list_links():
        short = netns.short_id_of(link)
        stack(by_short.get(short, f"?{short}")).links.append(link)
    for path in sorted({str(g.path) for g in cgroups.list_ours()}):
        name = Path(path).name.removeprefix(cgroups.CGROUP_PREFIX)
        if not _STACK_CGROUP.match(name):
            continue  # another target's (the hosts target's are its own to clean up)
        stack(by_short.get(name[:4], f"?{name[:4]}")).cgroups.append(path)
    for found in stacks.values():
        if found.state_dir is None:
            continue
        found.owner = read_owner(found.state_dir) or found.owner
        try:
            found.status = Topology.load(found.state_dir).status
        except InvalidInput:
            found.status = "starting" if (found.state_dir / OWNER_FILE).exists() else "unknown"
    return stacks


def cleanup(
    state_root: Path,
    stack_ids: Iterable[str] = (),
    *,
    everything: bool = False,
    dry_run: bool = False,
) -> CleanupReport:
    """Remove the leftovers of dead stacks (see the module docstring), or of `stack_ids`
    whatever their owner, or of every stack with `everything`.

    Raises InvalidInput for a stack id that is known nowhere (no state folder, nothing left).
    """
    named = set(stack_ids)
    stacks = find_stacks(state_root)
    unknown = sorted(named - set(stacks))
    if unknown:
        raise InvalidInput(
            f"--stack {unknown[0]}: no such stack under {state_root} and nothing of it left"
        )
    report = CleanupReport()
    for found in stacks.values():
        if named and found.stack_id not in named:
            continue
        why = None if everything or named else found.keep_because()
        if why is not None:
            if not found.empty:
                report.left_alone.append((found, why))
            continue
        report.removed.append(found)
        if not dry_run:
            _remove(found, report)
    current = Path(state_root) / CURRENT_FILE
    removed_ids = {s.stack_id for s in report.removed}
    if not dry_run and current.exists() and current.read_text().strip() in removed_ids:
        current.unlink()
    return report


def _remove(found: StackLeftovers, report: CleanupReport) -> None:
    remove_leftovers(found)
    if found.state_dir is None:
        return
    try:
        topology = Topology.load(found.state_dir)
    except InvalidInput:
        return
    if topology.status != "stopped":
        topology.with_status("stopped").save()
        report.stacks_marked_stopped.append(topology.stack_id)
