"""Network faults of the embedded stack: partitions (both ways or one) and degraded links.

A node is a network namespace joined to the host by a veth pair (llmchaos.stack.netns). A
partition is iptables DROP in the node's namespace (INPUT: what comes in, OUTPUT: what goes
out); packet loss is the same with the statistic match; latency, jitter and a bandwidth cap
are qdiscs (llmchaos.stack.tc) on the node's end of the pair (what the node sends) or the
host's end (what it receives). A kernel without netem gets its latency and jitter from a
delayer process in the node's namespace that iptables NFQUEUE rules hand the packets to
(llmchaos.stack.nfqueue). The checks read the kernel's counters: the DROP rules' packet
counts rising, the qdiscs present and passing packets, the NFQUEUE rules' counts rising and
the delayer's own measure of how long it held them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import Verification
from llmchaos.processes import stop_pids
from llmchaos.stack import netns, nfqueue, tc
from llmchaos.stack.procs import find_stack_processes, spawn
from llmchaos.stack.topology import read_owner

if TYPE_CHECKING:
    from llmchaos.stack.topology import NodeInfo, Topology

__all__ = ["NetworkFaults"]

_COUNTERS_RISE_S = 5.0
"""How long a check waits for packets to hit a rule or a qdisc: the gateways check every
worker each second, so a node sees traffic well within it even without load."""
_CHAINS = {"ingress": ("INPUT",), "egress": ("OUTPUT",), "both": ("INPUT", "OUTPUT")}


def _veth_ns(node: NodeInfo) -> str:
    """The node's end of its veth pair (the host's end with its last letter h -> n)."""
    assert node.veth_host is not None
    return node.veth_host[:-1] + "n"


class NetworkFaults:
    """Partitions and degraded links (see the module docstring)."""

    if TYPE_CHECKING:

        @property
        def topology(self) -> Topology: ...

    def _node_netns(self, node: str) -> NodeInfo:
        info = self.topology.node(node)
        if not info.netns or not info.veth_host:
            raise InvalidInput(
                f"node {node!r} is not a network namespace: network faults need root "
                "(netns auto or on)"
            )
        return info

    def partition_node(self, node: str, direction: str = "both") -> None:
        netns.partition_namespace(self._node_netns(node).netns or "", direction)

    def heal_partition(self, node: str) -> None:
        namespace = self.topology.node(node).netns
        if namespace and namespace in netns.list_namespaces():
            netns.heal_partition(namespace)

    def _links(self, info: NodeInfo, direction: str) -> list[tuple[str | None, str]]:
        """(namespace or None for the host, device) whose qdisc shapes `direction`."""
        links = []
        if direction in ("egress", "both"):
            links.append((info.netns, _veth_ns(info)))
        if direction in ("ingress", "both"):
            links.append((None, info.veth_host or ""))
        return links

    def degrade_network(
        self,
        node: str,
        delay_ms: float,
        jitter_ms: float,
        loss_percent: float,
        rate_kbit: float,
        direction: str,
    ) -> dict[str, Any]:
        info = self._node_netns(node)
        details: dict[str, Any] = {"node": node, "direction": direction, "qdiscs": {}}
        # without netem the delay is a delayer process the node's packets are queued to
        queued = bool(delay_ms) and tc.netem_support() is not None
        if queued:
            details["delayer_pid"] = self._start_delayer(node, delay_ms, jitter_ms)
            netns.queue_packets(info.netns or "", direction)
        for namespace, device in self._links(info, direction):
            qdisc_delay_ms = 0.0 if queued else delay_ms
            if qdisc_delay_ms or rate_kbit:
                kinds = tc.shape(
                    namespace,
                    device,
                    delay_ms=qdisc_delay_ms,
                    jitter_ms=0.0 if queued else jitter_ms,
                    rate_kbit=rate_kbit,
                )
                details["qdiscs"][device] = kinds
        if loss_percent:
            netns.drop_share(info.netns or "", loss_percent / 100, direction)
        details.update(
            delay_ms=delay_ms, jitter_ms=jitter_ms, loss_percent=loss_percent, rate_kbit=rate_kbit
        )
        return details

    def _delay_stats_path(self, node: str) -> Path:
        return Path(self.topology.state_dir) / f"delay-{node}.json"

    def _start_delayer(self, node: str, delay_ms: float, jitter_ms: float) -> int:
        """A delayer (llmchaos.stack.nfqueue) inside the node's namespace, marked as the
        stack's (its teardown and `llmchaos cleanup` stop it), bound to its queue; its pid."""
        self._stop_delayer(node)
        info = self._node_netns(node)
        state_dir = Path(self.topology.state_dir)
        owner = read_owner(state_dir)
        if owner is None:
            raise StackError(f"stack {self.topology.stack_id}: no owner file in {state_dir}")
        stats = self._delay_stats_path(node)
        stats.unlink(missing_ok=True)
        log = state_dir / "logs" / f"delay-{node}.log"
        argv = ["ip", "netns", "exec", info.netns or ""]
        argv += nfqueue.command(0, delay_ms, jitter_ms, stats)
        process = spawn(argv, stack_id=self.topology.stack_id, owner=owner, log_path=log)
        try:
            nfqueue.wait_bound(process, stats, log)
        except StackError as exc:
            raise StackError(f"{node}: {exc}") from None
        return process.pid

    def _stop_delayer(self, node: str) -> None:
        """Stop the node's delayer (it lets every held packet go first). Idempotent."""
        stats = nfqueue.read_stats(self._delay_stats_path(node))
        if stats is not None and stats.pid in find_stack_processes(self.topology.stack_id):
            stop_pids([stats.pid])

    def restore_network(self, node: str) -> None:
        info = self.topology.node(node)
        if not info.netns or info.netns not in netns.list_namespaces():
            return
        netns.undrop_share(info.netns)
        netns.unqueue_packets(info.netns)  # the rules first: no packet waits for a dead queue
        self._stop_delayer(node)
        for namespace, device in self._links(info, "both"):
            tc.unshape(namespace, device)

    # -- checks --------------------------------------------------------------------------
    def _rules_rising(self, namespace: str, kind: str, chains: tuple[str, ...]) -> Verification:
        """Our `kind` rules on every one of `chains` present, and packets dropped by them since
        (on one chain is enough: a node that starts no connection sends nothing to drop on
        the way out of a two-way partition)."""
        before = netns.rule_packets(namespace, kind)
        missing = [c for c in chains if c not in before]
        if missing:
            return Verification(
                False, f"no {kind} rule on {', '.join(missing)} in namespace {namespace}"
            )
        start = time.monotonic()
        while True:
            time.sleep(0.25)
            now = netns.rule_packets(namespace, kind)
            rose = {c: now.get(c, 0) - before[c] for c in chains}
            waited_s = time.monotonic() - start
            if any(rose.values()) or waited_s >= _COUNTERS_RISE_S:
                counts = ", ".join(f"{c} +{n}" for c, n in rose.items())
                verdict = "NFQUEUE" if kind == "delay" else "DROP"
                return Verification(
                    any(rose.values()),
                    f"{kind} {verdict} rules in {namespace}: packets {counts} in {waited_s:.1f} s",
                )

    def verify_partition_node(self, details: dict[str, Any]) -> Verification:
        """The DROP rules in the node's namespace, on the chains of the direction, dropping."""
        info = self._node_netns(str(details["node"]))
        return self._rules_rising(
            info.netns or "", "partition", _CHAINS[str(details.get("direction", "both"))]
        )

    def verify_degrade_network(self, details: dict[str, Any]) -> Verification:
        """Each qdisc present on its device and passing packets; the loss rules dropping."""
        info = self._node_netns(str(details["node"]))
        lines, in_effect = [], True
        for namespace, device in self._links(info, str(details["direction"])):
            wanted = list(details["qdiscs"].get(device, []))
            if not wanted:
                continue
            before = tc.qdisc_stats(namespace, device)
            time.sleep(1.0)
            now = tc.qdisc_stats(namespace, device)
            passed = now.packets - before.packets
            in_effect = in_effect and now.kinds == wanted and passed > 0
            lines.append(
                f"{device}: qdiscs {'/'.join(now.kinds) or 'none'} (wanted {'/'.join(wanted)}), "
                f"{passed} packets through them in 1 s, {now.dropped} dropped so far"
            )
        if details.get("loss_percent"):
            loss = self._rules_rising(info.netns or "", "loss", _CHAINS[str(details["direction"])])
            in_effect = in_effect and bool(loss.in_effect)
            lines.append(loss.evidence)
        if details.get("delayer_pid"):
            delayed = self._verify_delayer(info.netns or "", details)
            in_effect = in_effect and bool(delayed.in_effect)
            lines.append(delayed.evidence)
        if not lines:  # qdiscs on other devices than this node's: nothing here was shaped
            devices = ", ".join(d for _, d in self._links(info, str(details["direction"])))
            return Verification(False, f"no qdisc or loss rule of this fault on {devices}")
        return Verification(in_effect, "; ".join(lines))

    def _verify_delayer(self, namespace: str, details: dict[str, Any]) -> Verification:
        """The NFQUEUE rules passing packets to the node's delayer, which holds them as asked."""
        queued = self._rules_rising(namespace, "delay", _CHAINS[str(details["direction"])])
        held, evidence = nfqueue.check_hold(
            self._delay_stats_path(str(details["node"])),
            int(details["delayer_pid"]),
            float(details["delay_ms"]),
            float(details["jitter_ms"]),
        )
        return Verification(bool(queued.in_effect) and held, f"{queued.evidence}; {evidence}")
