"""Service discovery through a real etcd cluster: the registrar keeps the ready workers, the
gateways follow it, and they keep (or, known-bad, drop) their workers when it is gone."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmchaos.errors import StackError
from llmchaos.processes import pid_alive
from llmchaos.stack import etcd, netns
from llmchaos.stack.procs import find_stack_processes
from llmchaos.stack.registry import find_etcd, leader, restart_member
from llmchaos.stack.settings import UpstreamWorker
from llmchaos.stack.stack import stop_stack
from llmchaos.stack.topology import Topology
from llmchaos.targets.embedded import EmbeddedTarget
from tests.stack.stack_client import chat, valid_token

from .gateway_fixtures import metric_value

try:
    find_etcd()
    _NO_ETCD = None
except Exception as exc:  # the reason is the skip message
    _NO_ETCD = str(exc)

pytestmark = pytest.mark.skipif(
    _NO_ETCD is not None and not os.environ.get("CI"), reason=str(_NO_ETCD)
)


def test_prefix_range_ends_after_the_last_key_under_the_prefix() -> None:
    body = etcd.prefix_range("/llmchaos/x/workers/")
    assert etcd.unb64(body["key"]) == "/llmchaos/x/workers/"
    assert etcd.unb64(body["range_end"]) == "/llmchaos/x/workers0"  # '/' + 1 = '0'


def test_endpoints_of_skips_what_is_not_a_worker() -> None:
    worker = UpstreamWorker("gpu-0", "http://10.0.0.2:8000", "gpu", node="node-a")
    answer = {
        "kvs": [
            {"key": etcd.b64("k1"), "value": etcd.b64(etcd.worker_value(worker))},
            {"key": etcd.b64("k2"), "value": etcd.b64("not json")},
            {"key": etcd.b64("k3"), "value": etcd.b64('{"url": "x"}')},
        ]
    }
    assert etcd.endpoints_of(answer) == (worker,)


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Topology]) -> Topology:
    return module_stack_factory(discovery="etcd")


def _gateway_metric(topology: Topology, name: str) -> float:
    url = topology.gateways[0].url + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return metric_value(response.read().decode(), name)


def _statuses(topology: Topology, seconds: float) -> list[int | None]:
    token, statuses = valid_token(topology), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        statuses.append(chat(topology.gateway_url, token, timeout_s=5).status)
        time.sleep(0.05)
    return statuses


def _registered(topology: Topology) -> list[str]:
    assert topology.registry is not None
    body = etcd.prefix_range(topology.registry.prefix)
    for member in topology.registry.members:
        try:
            answer = etcd.call(member.client_url, "/v3/kv/range", body, 1.0)
        except StackError:
            continue
        return [w.name for w in etcd.endpoints_of(answer)]
    raise AssertionError("no registry member answered")


def _wait(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


@pytest.fixture
def registry_restored(stack: Topology) -> Iterator[EmbeddedTarget]:
    """The stack's target; every member healed and running again afterwards."""
    target = EmbeddedTarget(stack)
    try:
        yield target
    finally:
        for member in target.info().registry_members:
            target.heal_registry_member(member)
        for member in target.info().registry_members:
            target.restart_registry_member(member)
        target.wait_registry_ready()


def _has_leader(target: EmbeddedTarget) -> bool:
    try:
        target.registry_leader()
    except StackError:
        return False
    return True


def test_gateways_find_the_workers_the_registrar_keeps(stack: Topology) -> None:
    assert stack.registry is not None and len(stack.registry.members) == 3
    assert sorted(_registered(stack)) == ["cpu-0", "gpu-0", "gpu-1"]
    settings = json.loads(Path(stack.gateways[0].settings_path).read_text())
    assert settings["workers"] == []  # nothing static: only what the registry says
    assert _gateway_metric(stack, "llmchaos_gateway_discovered_workers") == 3.0
    assert set(_statuses(stack, 1.0)) == {200}


def test_a_killed_worker_leaves_the_registry_and_comes_back(
    stack: Topology, registry_restored: EmbeddedTarget
) -> None:
    registry_restored.kill_gpu_process("gpu-1")
    _wait("gpu-1 deregistered", lambda: "gpu-1" not in _registered(stack), 5)
    # the agent restarts it; once loaded (1.5 s) the registrar registers it again
    _wait("gpu-1 registered again", lambda: "gpu-1" in _registered(stack), 15)
    _wait(
        "the gateways' pool back at 3",
        lambda: _gateway_metric(stack, "llmchaos_gateway_discovered_workers") == 3.0,
        5,
    )


def test_killing_every_member_leaves_the_gateways_serving(
    stack: Topology, registry_restored: EmbeddedTarget
) -> None:
    for member in registry_restored.info().registry_members:
        registry_restored.kill_registry_member(member)
    assert set(_statuses(stack, 3.0)) == {200}
    assert _gateway_metric(stack, "llmchaos_gateway_discovery_age_seconds") >= 2.5
    assert _gateway_metric(stack, "llmchaos_gateway_discovered_workers") == 3.0
    log = Path(stack.gateways[0].log_path).read_text()
    assert "registry unreachable" in log and "serving the 3 workers last found" in log


def test_a_partitioned_registry_times_out_and_the_gateways_keep_serving(
    stack: Topology, registry_restored: EmbeddedTarget, needs_netns: None
) -> None:
    assert stack.registry is not None
    for member in registry_restored.info().registry_members:
        registry_restored.partition_registry_member(member)
        assert netns.is_partitioned(stack.registry.member(member).netns or "")
    started = time.monotonic()
    with pytest.raises(StackError, match="timed out"):
        etcd.call(stack.registry.members[0].client_url, "/v3/kv/range", {"key": "eA=="}, 1.0)
    assert time.monotonic() - started >= 0.9  # a timeout, not a refusal
    assert set(_statuses(stack, 2.0)) == {200}


def test_the_others_elect_a_new_leader_and_the_killed_one_rejoins(
    stack: Topology, registry_restored: EmbeddedTarget
) -> None:
    before = registry_restored.registry_leader()
    pid = registry_restored.kill_registry_member(before)["pid"]
    _wait("a new leader", lambda: _has_leader(registry_restored), 10)
    assert registry_restored.registry_leader() != before
    assert set(_statuses(stack, 1.0)) == {200}
    topology = restart_member(registry_restored.topology, before)
    assert topology.registry is not None
    restarted = topology.registry.member(before)
    assert restarted.pid != pid and pid_alive(restarted.pid)
    _wait(
        f"{before} healthy again",
        lambda: (
            etcd.call(restarted.client_url, "/v3/kv/range", etcd.prefix_range("/"), 1.0) is not None
        ),
        15,
    )


def test_the_known_bad_gateway_drops_its_workers_with_the_registry(
    stack_factory: Callable[..., Topology],
) -> None:
    topology = stack_factory(discovery="etcd", variant="no-endpoint-cache")
    target = EmbeddedTarget(topology)
    assert set(_statuses(topology, 0.5)) == {200}
    for member in target.info().registry_members:
        target.kill_registry_member(member)
    time.sleep(2.0)
    statuses = _statuses(topology, 1.0)
    assert set(statuses) == {503}
    body = chat(topology.gateway_url, valid_token(topology)).body
    assert json.loads(body)["error"]["code"] == "no_healthy_upstream"
    for member in target.info().registry_members:
        target.restart_registry_member(member)
    _wait(
        "serving again", lambda: chat(topology.gateway_url, valid_token(topology)).status == 200, 20
    )


def test_stopping_the_stack_leaves_no_member_namespace_or_link(
    stack_factory: Callable[..., Topology],
) -> None:
    topology = stack_factory(discovery="etcd")
    assert topology.registry is not None
    pids = [m.pid for m in topology.registry.members] + [topology.registry.registrar_pid]
    short_id = topology.stack_id[-4:]
    stop_stack(topology)
    assert not [pid for pid in pids if pid_alive(pid)]
    assert find_stack_processes(topology.stack_id) == []
    assert netns.list_namespaces(short_id) == []
    assert netns.list_links(short_id) == []


def test_the_topology_names_each_members_etcd_process(stack: Topology) -> None:
    """The pid a fault kills is etcd's own (`ip netns exec` execs it), also after restarts."""
    stack = Topology.load(Path(stack.state_dir))
    assert stack.registry is not None
    for member in stack.registry.members:
        cmdline = Path(f"/proc/{member.pid}/cmdline").read_bytes().split(b"\0")
        assert Path(cmdline[0].decode()).name == "etcd" and member.name.encode() in cmdline
    assert leader(stack.registry.members) in {m.name for m in stack.registry.members}


def test_registry_faults_that_hit_nothing_are_not_in_effect(
    stack: Topology, registry_restored: EmbeddedTarget, needs_netns: None
) -> None:
    """Each registry fault's check, on a fault made to do nothing and on the real one."""
    first, second = registry_restored.info().registry_members[:2]
    exited = subprocess.Popen(["true"])
    exited.wait()
    aimed_wrong = registry_restored.verify(
        "kill_registry_member", {"member": first, "pid": exited.pid}
    )
    assert aimed_wrong.in_effect is False and "not seen alive" in aimed_wrong.evidence
    killed = registry_restored.kill_registry_member(first)  # the real kill
    assert registry_restored.verify("kill_registry_member", killed).in_effect
    registry = registry_restored.topology.registry  # read again: earlier tests restarted members
    member = registry.member(second) if registry else None
    assert member is not None and member.pid
    never_killed = registry_restored.verify(
        "kill_registry_member", {**killed, "member": second, "pid": member.pid}
    )
    assert never_killed.in_effect is False and "still alive" in never_killed.evidence
    registry_restored.partition_registry_member(second)
    not_there = registry_restored.verify("partition_registry_member", {"member": first})
    assert not_there.in_effect is False, not_there
    assert registry_restored.verify("partition_registry_member", {"member": second}).in_effect
