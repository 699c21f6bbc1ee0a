"""Each fault check of the embedded target against a fault made to do nothing: a kill aimed
at a pid that had already exited, a partition rule or a qdisc on another node, a throttle the
process never hits, a memory limit it never reaches, a GPU fault never sent, token keys never
touched. Every check must say "not in effect" with its evidence; the real fault beside it
(where cheap) shows the same check can pass."""

from __future__ import annotations

import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from llmchaos.processes import pid_alive
from llmchaos.stack import tc
from llmchaos.stack.netns import rule_packets
from llmchaos.stack.topology import Topology, read_secrets
from llmchaos.targets.cache import key_ttls
from llmchaos.targets.embedded import EmbeddedTarget
from llmchaos.targets.embedded.target import _TOKEN_PATTERN
from tests.stack.stack_client import chat, valid_token


@pytest.fixture(scope="module")
def stack(module_stack_factory) -> Topology:  # type: ignore[no-untyped-def]
    return module_stack_factory()


@pytest.fixture
def target(stack: Topology) -> Iterator[EmbeddedTarget]:
    target = EmbeddedTarget(stack)
    yield target
    for node in target.info().nodes:  # whatever a test left in, out again
        target.heal_partition(node)
        target.restore_network(node)
    for worker in ("gpu-0", "gpu-1"):
        target.clear_gpu_fault(worker)
        target.resume_gpu_process(worker)
        target.unthrottle_cpu(worker)
        target.unlimit_memory(worker)


def _exited_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _not_in_effect(target: EmbeddedTarget, fault: str, details: dict[str, Any]) -> str:
    verification = target.verify(fault, details)
    assert verification.in_effect is False, verification
    return verification.evidence


def test_a_kill_aimed_at_an_exited_pid_is_not_in_effect(target: EmbeddedTarget) -> None:
    killed = {"worker": "gpu-0", "pid": _exited_pid(), "killed_at": time.time()}
    evidence = _not_in_effect(target, "kill_gpu_process", {"killed": [killed]})
    assert "never hit" in evidence, evidence
    # the real kill: the same check sees the pid gone and the agent's new one
    real = target.kill_gpu_process("gpu-0")
    verification = target.verify("kill_gpu_process", {"killed": [real]})
    assert verification.in_effect is True, verification
    assert "new pid" in verification.evidence


def test_a_hang_or_a_crash_that_hit_nothing_is_not_in_effect(target: EmbeddedTarget) -> None:
    evidence = _not_in_effect(target, "hang_gpu_process", {"worker": "gpu-1", "pid": _exited_pid()})
    assert "state gone" in evidence, evidence
    primary = target.topology.gateways[0]
    evidence = _not_in_effect(
        target, "crash_gateway", {"gateway": primary.name, "pid": primary.pid}
    )
    assert "still alive" in evidence, evidence


def test_network_faults_on_another_node_are_not_in_effect(target: EmbeddedTarget) -> None:
    if not target.info().partitions_supported:
        pytest.skip("nodes are not network namespaces here (needs root)")
    node_a, node_b = target.info().nodes[:2]
    target.partition_node(node_b, "both")
    evidence = _not_in_effect(target, "partition_node", {"node": node_a, "direction": "both"})
    assert "no partition rule" in evidence, evidence
    assert target.verify("partition_node", {"node": node_b, "direction": "both"}).in_effect
    target.heal_partition(node_b)
    shaped = target.degrade_network(node_b, 0, 0, 0, 800, "egress")
    evidence = _not_in_effect(target, "degrade_network", {**shaped, "node": node_a})
    assert "no qdisc or loss rule" in evidence, evidence
    assert target.verify("degrade_network", shaped).in_effect, shaped


def test_resource_faults_the_process_never_feels_are_not_in_effect(
    target: EmbeddedTarget,
) -> None:
    # a whole CPU for an idle single-threaded worker: never throttled
    idle = target.throttle_cpu("gpu-1", 100)
    evidence = _not_in_effect(target, "throttle_cpu", idle)
    assert "nr_throttled +0" in evidence, evidence
    target.unthrottle_cpu("gpu-1")
    # a limit the worker never reaches: it does not grow (the details claim it does)
    limited = target.oom_kill_worker("gpu-1", limit_mib=2048, grow_mib_s=0.0)
    evidence = _not_in_effect(target, "oom_kill_worker", {**limited, "grow_mib_s": 1024.0})
    assert "oom_kill 0" in evidence and "alive" in evidence, evidence


def test_gpu_faults_never_sent_are_not_in_effect(target: EmbeddedTarget) -> None:
    evidence = _not_in_effect(target, "gpu_errors", {"worker": "gpu-1", "xid": 79})
    assert "straight to it: 200" in evidence, evidence
    evidence = _not_in_effect(target, "slow_gpu", {"worker": "gpu-1", "slowdown": 4.0})
    assert "decode step" in evidence, evidence
    assert target.verify("slow_gpu", target.slow_gpu("gpu-1", 4.0)).in_effect


def test_token_keys_never_touched_are_not_in_effect(
    target: EmbeddedTarget, stack: Topology
) -> None:
    for index in range(3):  # a few tokens cached by the gateways
        assert chat(stack.gateway_url, valid_token(stack, index)).status == 200
    url = stack.redis_url
    password = read_secrets(stack.state_dir).redis_password
    before = key_ttls(url, password, url, pattern=_TOKEN_PATTERN)
    assert before, "the gateways cached no token"
    target._token_snapshot = (0.0, before)  # expire_token_cache's snapshot, keys left alone
    evidence = _not_in_effect(target, "expire_token_cache", {"keys": len(before)})
    assert f"{len(before)} untouched" in evidence, evidence
    target.expire_token_cache(0)
    assert target.verify("expire_token_cache", {}).in_effect


def _get_ms(url: str) -> float:
    """Milliseconds for a fresh connection's GET (connect, request, answer)."""
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=5) as answer:
        answer.read()
    return 1000 * (time.monotonic() - started)


def test_a_delay_without_netem_holds_the_nodes_packets(target: EmbeddedTarget) -> None:
    """The delayer (NFQUEUE) where the kernel has no netem: a real client's round trips to the
    node grow by the delay, the check sees it, and the undo takes it away."""
    if not target.info().partitions_supported:
        pytest.skip("nodes are not network namespaces here (needs root)")
    if tc.netem_support() is None:
        pytest.skip("this kernel has netem: delays are netem's, tested in the catalogue")
    node_a, node_b = target.info().nodes[:2]
    url = target.topology.node(node_b).workers[0].url + "/healthz"
    before_ms = statistics.median(_get_ms(url) for _ in range(5))
    delayed = target.degrade_network(node_b, 100, 20, 0, 0, "egress")
    try:
        # what leaves the node waits 80-120 ms: the SYN-ACK and the answer, so 2 of them
        during_ms = statistics.median(_get_ms(url) for _ in range(5))
        assert during_ms >= before_ms + 150, (before_ms, during_ms)
        verified = target.verify("degrade_network", delayed)
        assert verified.in_effect is True and "NFQUEUE" in verified.evidence, verified
        evidence = _not_in_effect(target, "degrade_network", {**delayed, "node": node_a})
        assert "no delay rule" in evidence or "does not run" in evidence, evidence
    finally:
        target.restore_network(node_b)
    assert not pid_alive(delayed["delayer_pid"])
    assert rule_packets(target.topology.node(node_b).netns or "", "delay") == {}
    after_ms = statistics.median(_get_ms(url) for _ in range(5))
    assert after_ms < before_ms + 50, (before_ms, after_ms)
