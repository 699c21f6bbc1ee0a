"""Partitions of the hosts target: iptables DROP rules on a server's port, both directions,
in the host's filter table (or inside the server's network namespace), each tagged with a
comment naming the target and its owner:

    -A INPUT  -p tcp --dport 18701 -m comment --comment TAG -j DROP
    -A OUTPUT -p tcp --sport 18701 -m comment --comment TAG -j DROP
    TAG = llmchaos-hosts/<target id>/<node>/run:<owner pid>:<owner start ticks>

On loopback a client's packets to the port pass INPUT and the server's answers pass OUTPUT,
so both directions are cut and clients time out (no RST), as in a real partition. The tag
lets `llmchaos cleanup` find the rules of a run that was killed, from the rules alone.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass

from llmchaos.errors import StackError
from llmchaos.processes import Owner

__all__ = [
    "TAG",
    "Rule",
    "add_port_drop",
    "add_port_queue",
    "delete_rule",
    "dropped_packets",
    "namespaces",
    "tag",
    "tagged_rules",
]

TAG = "llmchaos-hosts"
_CHAINS = (("INPUT", "--dport"), ("OUTPUT", "--sport"))


@dataclass(frozen=True)
class Rule:
    """One tagged rule as `iptables -S` prints it."""

    netns: str | None
    chain: str
    spec: tuple[str, ...]
    """Everything after `-A CHAIN`."""
    comment: str

    @property
    def target_id(self) -> str:
        return self.comment.split("/")[1]

    @property
    def node(self) -> str:
        return self.comment.split("/")[2]

    @property
    def owner(self) -> Owner | None:
        return Owner.from_marker(self.comment.split("/", 3)[3])


def tag(target_id: str, node: str, owner: Owner) -> str:
    """The comment of a partition rule (at most 256 characters, no spaces)."""
    return f"{TAG}/{target_id}/{node}/{owner.to_marker()}"


def _iptables(
    netns: str | None, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    if shutil.which("iptables") is None:
        raise StackError("iptables not found: apt-get install iptables (partitions need it)")
    argv = ["iptables", "-w", "5", *args]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise StackError(f"{shlex.join(argv)} failed: {result.stderr.strip() or result.stdout}")
    return result


def add_port_drop(
    port: int,
    comment: str,
    netns: str | None = None,
    direction: str = "both",
    share: float | None = None,
) -> None:
    """DROP TCP to `port` (direction "ingress"), from it ("egress") or both, all of it or a
    random `share` (0..1: packet loss). Idempotent."""
    action = ["-j", "DROP"]
    if share is not None:
        action = ["-m", "statistic", "--mode", "random", "--probability", f"{share:.6f}", *action]
    _add_port_rule(port, comment, netns, direction, action)


def add_port_queue(
    port: int, comment: str, queue: int, netns: str | None = None, direction: str = "both"
) -> None:
    """Hand TCP to and/or from `port` to NFQUEUE `queue` (a delayer holds it: nfqueue.py);
    it passes untouched while nothing listens (--queue-bypass). Idempotent."""
    action = ["-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
    _add_port_rule(port, comment, netns, direction, action)


def _add_port_rule(
    port: int, comment: str, netns: str | None, direction: str, action: list[str]
) -> None:
    """Insert `action` for TCP of `port` on the chains of `direction`, first in the chain
    (so later ones go before: drops before a queue). Idempotent."""
    chains = {"ingress": _CHAINS[:1], "egress": _CHAINS[1:]}.get(direction, _CHAINS)
    for chain, port_flag in chains:
        spec = ["-p", "tcp", port_flag, str(port), "-m", "comment", "--comment", comment]
        spec += action
        if _iptables(netns, "-C", chain, *spec, check=False).returncode != 0:
            _iptables(netns, "-I", chain, "1", *spec)


def tagged_rules(netns: str | None = None, prefix: str = TAG + "/") -> list[Rule]:
    """Our rules (comment starting with `prefix`) in the host's filter table or `netns`."""
    if shutil.which("iptables") is None:
        return []
    rules = []
    for chain, _ in _CHAINS:
        out = _iptables(netns, "-S", chain, check=False).stdout
        for line in out.splitlines():
            words = shlex.split(line)
            if words[:2] != ["-A", chain] or "--comment" not in words:
                continue
            comment = words[words.index("--comment") + 1]
            if comment.startswith(prefix) and comment.count("/") >= 3:
                rules.append(Rule(netns, chain, tuple(words[2:]), comment))
    return rules


def delete_rule(rule: Rule) -> None:
    """Remove `rule`; a rule already gone is fine."""
    result = _iptables(rule.netns, "-D", rule.chain, *rule.spec, check=False)
    if (
        result.returncode != 0
        and _iptables(rule.netns, "-C", rule.chain, *rule.spec, check=False).returncode == 0
    ):
        raise StackError(f"cannot delete iptables rule {rule.comment}: {result.stderr.strip()}")


def dropped_packets(comment: str, netns: str | None = None) -> int:
    """Packets the rules tagged `comment` matched so far (dropped, or queued to a delayer:
    iptables -v -S counters)."""
    total = 0
    for chain, _ in _CHAINS:
        for line in _iptables(netns, "-v", "-S", chain, check=False).stdout.splitlines():
            words = shlex.split(line)
            if (
                "--comment" in words
                and words[words.index("--comment") + 1] == comment
                and "-c" in words
            ):
                total += int(words[words.index("-c") + 1])
    return total


def namespaces() -> list[str]:
    """Network namespaces that exist (`ip netns list`)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]
