"""`llmchaos cleanup`: remove what crashed or killed runs left behind.

Found by marks, not by memory: processes by their `LLMCHAOS_STACK` environment marker,
namespaces and veth ends by name prefix, state folders by their topology. Running it with
nothing left behind is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.stack import netns
from llmchaos.stack.procs import find_stack_processes, stop_pids
from llmchaos.stack.topology import CURRENT_FILE, Topology

__all__ = ["CleanupReport", "cleanup", "leftovers"]


@dataclass
class CleanupReport:
    """What cleanup found (and removed, unless it was a dry run)."""

    processes: list[int] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    stacks_marked_stopped: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.processes or self.namespaces or self.links)

    def lines(self) -> list[str]:
        return [
            f"processes: {' '.join(map(str, self.processes)) or '-'}",
            f"namespaces: {' '.join(self.namespaces) or '-'}",
            f"veth links: {' '.join(self.links) or '-'}",
            f"stacks marked stopped: {' '.join(self.stacks_marked_stopped) or '-'}",
        ]


def leftovers(stack_id: str | None = None) -> CleanupReport:
    """Processes, namespaces and links of `stack_id` (all stacks when None) that exist now."""
    short = stack_id[-4:] if stack_id else None
    return CleanupReport(
        processes=find_stack_processes(stack_id),
        namespaces=[
            n for n in netns.list_namespaces() if short is None or n.startswith(f"llmc-{short}-")
        ],
        links=[link for link in netns.list_links() if short is None or link[2:6] == short],
    )


def cleanup(state_root: Path, stack_id: str | None = None, dry_run: bool = False) -> CleanupReport:
    """Stop leftover processes, delete leftover namespaces and links, mark state folders stopped.

    `stack_id` limits it to one stack; raises InvalidInput when that stack is unknown and has
    nothing left.
    """
    report = leftovers(stack_id)
    if stack_id and report.empty and not (Path(state_root) / stack_id).exists():
        raise InvalidInput(f"--stack {stack_id}: no such stack under {state_root} and nothing left")
    if dry_run:
        return report
    stop_pids(report.processes, grace_s=2.0)
    for name in report.namespaces:
        # Processes inside were marked and stopped above; deleting the namespace drops its rules.
        netns.delete_namespace(name)
    for link in report.links:
        netns.delete_link(link)
    root = Path(state_root)
    for topo_path in sorted(root.glob("*/topology.json")):
        if stack_id and topo_path.parent.name != stack_id:
            continue
        try:
            topology = Topology.load(topo_path.parent)
        except InvalidInput:
            continue
        if topology.status != "stopped":
            topology.with_status("stopped").save()
            report.stacks_marked_stopped.append(topology.stack_id)
    current = root / CURRENT_FILE
    if current.exists() and (stack_id is None or current.read_text().strip() == stack_id):
        current.unlink()
    return report
