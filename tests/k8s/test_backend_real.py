"""KubernetesTarget against a real API server (tests/k8s/controlplane.py): deploy/ on fake
GPU nodes, the backend acting as deploy/10-rbac.yaml's service account, kwok playing the
kubelets. What the server, its controllers and its scheduler decide is theirs: label
selectors, RBAC, NetworkPolicy validation, evictions against a PodDisruptionBudget, the
Deployment controller recreating pods, pod lifecycles. The API server's audit log (every
request of a service account) shows what the backend sent."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import redis
from kubernetes import client as k8s
from kubernetes import watch

from llmchaos.errors import ComponentNotReady, InvalidInput, StackError
from llmchaos.stack.settings import GPU_PROFILE, WorkerSettings, write_settings
from llmchaos.targets.kubernetes import (
    KubernetesSettings,
    KubernetesTarget,
    parse_selector,
    selector_matches,
)

from .controlplane import NAMESPACE as NS
from .controlplane import POD_READY_DELAY_S, DeployedStack, fake_node

pytestmark = pytest.mark.slow

Make = Callable[..., KubernetesTarget]
GPU = "app.kubernetes.io/component=engine-gpu"
GATEWAY = "app.kubernetes.io/component=gateway"
LABEL = "llmchaos.io/partitioned"
WATCH_LAG_S = 0.5
"""How late this test's watch may see a pod change on a busy 2-core machine."""


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def verbs(deployed: DeployedStack, user: str | None = None) -> list[tuple[str, str, int]]:
    """(verb, resource[/subresource], response code) of the backend's requests so far."""
    events = deployed.audit_events(user)
    return [
        (
            e["verb"],
            e["objectRef"]["resource"]
            + ("/" + e["objectRef"]["subresource"] if e["objectRef"].get("subresource") else ""),
            e["responseStatus"]["code"],
        )
        for e in events
    ]


def node_of(deployed: DeployedStack, pod: str) -> str:
    return str(deployed.core.read_namespaced_pod(pod, NS).spec.node_name)


@pytest.fixture
def gpu_worker(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An embedded engine worker (the stack's GPU worker process) on a free port: the process
    behind a fake GPU pod. (its URL, its process)"""
    port = _free_port()
    profile = replace(GPU_PROFILE, load_s=0.2)
    settings = WorkerSettings(name="gpu-0", port=port, profile=profile)
    path = write_settings(settings, tmp_path / "worker.json")
    process = subprocess.Popen(
        [sys.executable, "-m", "llmchaos.stack.worker", "--settings", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        DeployedStack.wait(lambda: _answers(url + "/gpu/processes"), 30, "the worker serving")
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def service_account(deployed: DeployedStack, name: str, rules: list[dict[str, Any]]) -> Path:
    """A kubeconfig for a new service account of the namespace with only `rules`."""
    rbac = k8s.RbacAuthorizationV1Api(deployed.api)
    deployed.core.create_namespaced_service_account(NS, {"metadata": {"name": name}})
    if rules:
        rbac.create_namespaced_role(NS, {"metadata": {"name": name}, "rules": rules})
        rbac.create_namespaced_role_binding(
            NS,
            {
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NS}],
            },
        )
    return deployed.plane.service_account_kubeconfig(
        NS, name, deployed.folder / f"{name}.kubeconfig"
    )


def another_teams_gpu_pod(deployed: DeployedStack, name: str) -> None:
    """A pod of namespace other-team on node-gpu-0 with the GPU pods' labels: chaos in
    llmchaos must never see or touch it."""
    deployed.create_namespace("other-team")
    deployed.core.create_namespaced_pod(
        "other-team",
        {
            "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "engine-gpu"}},
            "spec": {"nodeName": "node-gpu-0", "containers": [{"name": "c", "image": "x"}]},
        },
    )


# -- names and selectors ---------------------------------------------------------------------
SELECTORS = [
    GPU,
    "app.kubernetes.io/component in (engine-gpu, engine-cpu)",
    "app.kubernetes.io/component notin (gateway,redis), app.kubernetes.io/part-of=llmchaos",
    "app.kubernetes.io/component!=redis",
    "pod-template-hash",
    "!pod-template-hash",
    "app.kubernetes.io/component=gateway,!llmchaos.io/partitioned",
]


def test_label_selectors_mean_what_the_server_means(deployed: DeployedStack) -> None:
    """The backend re-applies selectors client-side: its parser must agree with the server."""
    deployed.core.create_namespaced_pod(
        NS,
        {
            "metadata": {"name": "bare", "labels": {"app.kubernetes.io/component": "gateway"}},
            "spec": {"nodeName": "node-cpu-0", "containers": [{"name": "c", "image": "x"}]},
        },
    )
    pods = deployed.pods()
    for selector in SELECTORS:
        by_server = deployed.pod_names(selector)
        ours = [
            p.metadata.name
            for p in pods
            if selector_matches(parse_selector(selector), p.metadata.labels or {})
        ]
        assert by_server == ours, selector
        assert by_server, selector  # each selector selects something here


def test_info_lists_the_namespaces_pods_not_another_teams(
    deployed: DeployedStack, real_backend: Make
) -> None:
    another_teams_gpu_pod(deployed, "their-gpu-job")
    info = real_backend().info()
    assert sorted(w.name for w in info.workers if w.mode == "gpu") == deployed.pod_names(GPU)
    assert [w.name for w in info.workers if w.mode == "cpu"] == deployed.pod_names(
        "app.kubernetes.io/component=engine-cpu"
    )
    assert list(info.gateways) == deployed.pod_names(GATEWAY)
    assert set(info.nodes) == {"node-gpu-0", "node-gpu-1", "node-cpu-0"}
    gpu_nodes = {w.node for w in info.workers if w.mode == "gpu"}
    assert gpu_nodes == {"node-gpu-0", "node-gpu-1"}  # the scheduler placed one GPU pod per GPU
    assert {v for v, _, _ in verbs(deployed)} == {"list"}


# -- kill ------------------------------------------------------------------------------------
def test_kill_gpu_process_through_real_exec(
    deployed: DeployedStack, real_backend: Make, gpu_worker: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, worker = gpu_worker
    pod = deployed.pod_names(GPU)[0]
    deployed.map_exec(pod, {"LLMCHAOS_FAKE_GPU_URL": url})
    deployed.wait_exec(pod)
    result = real_backend().kill_gpu_process(pod)
    assert result == {
        "worker": pod,
        "pod": pod,
        "node": node_of(deployed, pod),
        "uid": deployed.core.read_namespaced_pod(pod, NS).metadata.uid,  # the check's anchor
        "pid": worker.pid,
        "pids": [worker.pid],
    }
    assert worker.wait(10) == -signal.SIGKILL  # really killed, by kill -9 run through exec
    assert pod in deployed.pod_names(GPU)  # killed inside, not deleted
    sent = verbs(deployed)
    # a WebSocket exec is a GET: audited as get (and authorized as get and create, below)
    assert [(v, r) for v, r, _ in sent if r == "pods/exec"] == [("get", "pods/exec")] * 2
    assert not [v for v, _, _ in sent if v == "delete"]


@pytest.mark.parametrize(
    "case",
    ["no-exec-mapping", "nvidia-smi-fails", "no-gpu-process", "kill-fails", "exec-forbidden"],
)
def test_kill_falls_back_to_deleting_the_pod_and_the_deployment_replaces_it(
    deployed: DeployedStack,
    real_backend: Make,
    gpu_processes: Callable[[list[int]], str],
    case: str,
) -> None:
    pod = deployed.pod_names(GPU)[1]
    backend = real_backend()
    reason = {
        "no-exec-mapping": r"nvidia-smi failed: .*",
        "nvidia-smi-fails": r"nvidia-smi failed: .*exit status 9.*LLMCHAOS_FAKE_GPU_URL is not set",
        "no-gpu-process": "nvidia-smi lists no compute process",
        "kill-fails": r"kill -9 \[\d+\] failed: .*exit status 1",
        "exec-forbidden": r"nvidia-smi failed: .*HTTP 403",
    }[case]
    if case == "nvidia-smi-fails":
        deployed.map_exec(pod, {})  # no GPU behind the pod: the stand-in exits 9
    elif case == "no-gpu-process":
        deployed.map_exec(pod, {"LLMCHAOS_FAKE_GPU_URL": gpu_processes([])})
    elif case == "kill-fails":
        gone = subprocess.Popen(["true"])
        gone.wait()
        deployed.map_exec(pod, {"LLMCHAOS_FAKE_GPU_URL": gpu_processes([gone.pid])})
    elif case == "exec-forbidden":
        config = service_account(
            deployed,
            "chaos-no-exec",
            [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}],
        )
        backend = real_backend(kubeconfig=str(config))
    if case not in ("no-exec-mapping", "exec-forbidden"):
        deployed.wait_exec(pod)
    result = backend.kill_gpu_process(pod)
    assert result["deleted_pod"] == pod and "pid" not in result
    assert re.search(reason, result["reason"]), result["reason"]
    deployed.wait(lambda: pod not in deployed.pod_names(GPU), 10, f"{pod} deleted")
    deployed.wait_available(30)  # the ReplicaSet made another GPU pod, kwok made it Ready
    assert len(deployed.pod_names(GPU)) == 2


def test_kill_unknown_or_cpu_worker_is_invalid_input(deployed: DeployedStack, real_backend: Make):
    backend = real_backend()
    cpu = deployed.pod_names("app.kubernetes.io/component=engine-cpu")[0]
    with pytest.raises(InvalidInput, match=rf"worker: '{cpu}' is not a GPU inference pod"):
        backend.kill_gpu_process(cpu)
    with pytest.raises(InvalidInput, match="GPU pods: " + ", ".join(deployed.pod_names(GPU))):
        backend.kill_gpu_process("nope")
    assert {v for v, _, _ in verbs(deployed)} == {"list"}


# -- partition -------------------------------------------------------------------------------
def test_partition_creates_a_policy_the_server_accepts_and_heal_removes_it(
    deployed: DeployedStack, real_backend: Make
) -> None:
    net = k8s.NetworkingV1Api(deployed.api)
    backend = real_backend()
    on_node = [p.metadata.name for p in deployed.pods() if p.spec.node_name == "node-gpu-0"]
    backend.partition_node("node-gpu-0")
    (policy,) = net.list_namespaced_network_policy(NS).items
    assert policy.metadata.name == "llmchaos-partition-node-gpu-0"
    assert policy.spec.pod_selector.match_labels == {LABEL: "node-gpu-0"}
    assert sorted(policy.spec.policy_types) == ["Egress", "Ingress"]
    assert not policy.spec.ingress and not policy.spec.egress  # no rule: deny all
    # the server's own selection: exactly the namespace's pods on the node
    assert deployed.pod_names(f"{LABEL}=node-gpu-0") == sorted(on_node)
    backend.partition_node("node-gpu-0")  # idempotent: the server's 409 means "already there"
    backend.heal_partition("node-gpu-0")
    assert net.list_namespaced_network_policy(NS).items == []
    assert deployed.pod_names(LABEL) == []
    backend.heal_partition("node-gpu-0")  # twice: nothing left, no error
    backend.heal_partition("node-gone")
    with pytest.raises(InvalidInput, match=r"node: 'node-x' runs no pod of namespace llmchaos"):
        backend.partition_node("node-x")
    codes = {(v, r): c for v, r, c in verbs(deployed) if r == "networkpolicies"}
    assert codes == {("create", "networkpolicies"): 409, ("delete", "networkpolicies"): 404}


def test_partition_of_a_node_with_a_long_name_passes_validation(
    deployed: DeployedStack, real_backend: Make
) -> None:
    """Label values and object names stop at 63 characters; node names do not."""
    node = "gpu-node-" + "x" * 60 + ".example.internal"
    deployed.core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node},
            "status": {"allocatable": {"cpu": "4", "memory": "8Gi", "pods": "10"}},
        }
    )
    deployed.core.create_namespaced_pod(
        NS,
        {
            "metadata": {
                "name": "gpu-extra",
                "labels": {"app.kubernetes.io/component": "engine-gpu"},
            },
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        },
    )
    backend = real_backend()
    backend.partition_node(node)
    (policy,) = k8s.NetworkingV1Api(deployed.api).list_namespaced_network_policy(NS).items
    assert (
        len(policy.metadata.name) <= 63 and policy.metadata.annotations["llmchaos.io/node"] == node
    )
    assert deployed.pod_names(LABEL) == ["gpu-extra"]
    backend.heal_partition(node)
    assert deployed.pod_names(LABEL) == []


LABEL_KEYS = [
    "llmchaos.io/partitioned",
    "partitioned",
    "Part_itioned.x",
    "bad key",
    "llmchaos.io/",
    "a/b/c",
    "x" * 64,
    "example.com/" + "y" * 63,
    "Example.com/partitioned",
    "-partitioned",
]


def test_partition_labels_the_backend_accepts_are_those_the_server_accepts(
    deployed: DeployedStack,
) -> None:
    """The API server's validation of the partition NetworkPolicy (server-side dry run) is the
    reference for which partition_label values KubernetesSettings lets through."""
    net = k8s.NetworkingV1Api(deployed.api)
    for key in LABEL_KEYS:
        policy = {
            "metadata": {"name": "probe"},
            "spec": {"podSelector": {"matchLabels": {key: "node"}}, "policyTypes": ["Ingress"]},
        }
        try:
            net.create_namespaced_network_policy(NS, policy, dry_run="All")
            server_ok = True
        except k8s.ApiException as exc:
            assert exc.status == 422, exc
            server_ok = False
        try:
            KubernetesSettings(allowed_namespaces=(NS,), partition_label=key)
            ours_ok = True
        except InvalidInput as exc:
            assert "partition_label: expected a label key" in str(exc)
            ours_ok = False
        assert ours_ok == server_ok, key
    assert net.list_namespaced_network_policy(NS).items == []  # dry run: nothing stored


# -- gateways --------------------------------------------------------------------------------
def test_crash_gateway_and_restore_waits_for_the_replacement_to_be_ready(
    deployed: DeployedStack, real_backend: Make
) -> None:
    backend = real_backend()
    before = deployed.pod_names(GATEWAY)
    result = backend.crash_gateway(before[0])
    assert result["deleted_pod"] == before[0]
    started = time.monotonic()
    backend.restore_gateway(before[0])
    waited = time.monotonic() - started
    after = deployed.pod_names(GATEWAY)
    assert before[0] not in after and before[1] in after and len(after) == 2
    status = deployed.apps.read_namespaced_deployment("gateway", NS).status
    assert status.available_replicas == 2
    # the Deployment controller made a pod, the scheduler bound it, kwok made it Ready
    assert waited >= POD_READY_DELAY_S * 0.75, waited
    backend.restore_gateway(before[0])  # idempotent: ready already


def test_restore_gateway_deadline_when_the_replacement_cannot_be_scheduled(
    deployed: DeployedStack, real_backend: Make
) -> None:
    for node in ("node-gpu-0", "node-gpu-1", "node-cpu-0"):
        deployed.core.patch_node(node, {"spec": {"unschedulable": True}})
    backend = real_backend(ready_timeout_s=3)
    gateway = deployed.pod_names(GATEWAY)[0]
    backend.crash_gateway(gateway)
    with pytest.raises(ComponentNotReady, match=r"gateway deployment llmchaos/gateway: 1/2"):
        backend.restore_gateway(gateway)
    (pending,) = [p for p in deployed.pods(GATEWAY) if not p.spec.node_name]
    scheduled = [c for c in pending.status.conditions or [] if c.type == "PodScheduled"]
    assert scheduled and scheduled[0].reason == "Unschedulable"


def test_gateway_names_and_missing_deployment_are_invalid_input(
    deployed: DeployedStack, real_backend: Make
) -> None:
    with pytest.raises(
        InvalidInput, match="gateway pods: " + ", ".join(deployed.pod_names(GATEWAY))
    ):
        real_backend().crash_gateway(deployed.pod_names(GPU)[0])
    with pytest.raises(InvalidInput, match="gateway_deployment: no deployment 'gw'"):
        real_backend(gateway_deployment="gw").restore_gateway("x")


# -- token cache -----------------------------------------------------------------------------
def test_expire_token_cache_through_redis_cli_exec(
    deployed: DeployedStack, real_backend: Make, redis_url: str
) -> None:
    """redis-cli exec'd in the Redis pod (kwok runs the real redis-cli here, against a real
    redis-server): keys expired in batches that keep each exec URL under 8 KiB."""
    client = redis.Redis.from_url(redis_url)
    client.mset({**{f"token:t{i:04d}": "tenant" for i in range(1203)}, "other:key": "x"})
    port = str(client.connection_pool.connection_kwargs["port"])
    pod = deployed.pod_names("app.kubernetes.io/component=redis")[0]
    deployed.map_exec(pod, {})
    deployed.wait_exec(pod)
    backend = real_backend(redis_cli=("redis-cli", "-p", port))
    assert backend.expire_token_cache(2.5) == 1203
    assert 0 < client.pttl("token:t0007") <= 2500 and client.ttl("other:key") == -1
    assert backend.expire_token_cache(0) == 1203
    assert client.keys("*") == [b"other:key"]
    uris = [
        e["requestURI"]
        for e in deployed.audit_events()
        if e["objectRef"].get("subresource") == "exec"
    ]
    deletes = [u for u in uris if "command=DEL" in u]
    assert len(deletes) > 1 and max(len(u) for u in uris) < 8192
    keys = sum(len(parse_qs(urlparse(u).query)["command"]) - 4 for u in deletes)
    assert keys == 1203  # redis-cli -p PORT DEL key...
    client.close()


def test_expire_token_cache_needs_a_ready_redis_pod(deployed: DeployedStack, real_backend: Make):
    deployed.apps.patch_namespaced_deployment_scale("redis", NS, {"spec": {"replicas": 0}})
    deployed.wait(
        lambda: not deployed.pod_names("app.kubernetes.io/component=redis"), 20, "redis gone"
    )
    with pytest.raises(StackError, match=r"no ready Redis pod .* set redis_url"):
        real_backend().expire_token_cache(0)


# -- readings --------------------------------------------------------------------------------
def test_readings(deployed: DeployedStack, real_backend: Make) -> None:
    backend = real_backend()
    assert (backend.healthy_workers(), backend.healthy_workers("gpu")) == (3, 2)
    # Fake pods have no IP: the API server's pod proxy refuses them (nothing is sent off this
    # machine), and a pod whose /metrics cannot be read counts 0.
    assert backend.queue_depth() == 0.0
    proxied = [(v, r, c) for v, r, c in verbs(deployed) if r == "pods/proxy"]
    assert len(proxied) == 3 and all(v == "get" and c >= 400 for v, _, c in proxied), proxied
    # A third GPU pod finds no free GPU: the scheduler leaves it Pending, it is not healthy.
    deployed.apps.patch_namespaced_deployment_scale("vllm-gpu", NS, {"spec": {"replicas": 3}})
    deployed.wait(lambda: len(deployed.pod_names(GPU)) == 3, 10, "a third GPU pod")
    time.sleep(POD_READY_DELAY_S + 0.5)
    assert backend.healthy_workers("gpu") == 2
    with pytest.raises(InvalidInput, match="mode"):
        backend.healthy_workers("tpu")


def test_replicas_read_the_gpu_deployment_and_its_hpa(
    deployed: DeployedStack, real_backend: Make
) -> None:
    """What the autoscaling experiment reads on a cluster: the GPU Deployment's spec.replicas
    and Ready pods, the HPA's bounds and status. No HPA controller runs here (it needs a
    metrics API this control plane does not have), so the test scales the Deployment through
    the API as the HPA would, and the readings and the scale-out watch must follow."""
    from types import SimpleNamespace

    from llmchaos import measure

    backend = real_backend()
    first = backend.replicas()
    assert (first.desired, first.ready, first.min_replicas, first.max_replicas) == (2, 2, 2, 8)
    assert first.autoscaled and "no status yet" in first.detail
    # a scale-out watched as the experiment watches it: asked at once, one of three ready
    # only when a third GPU node joins (the scheduler leaves the pod Pending until then)
    run = SimpleNamespace(target=backend, findings={}, notes=[], last_fault_ts=lambda: time.time())
    scaler = threading.Timer(
        1.0,
        lambda: deployed.apps.patch_namespaced_deployment_scale(
            "vllm-gpu", NS, {"spec": {"replicas": 3}}
        ),
    )
    joiner = threading.Timer(4.0, lambda: deployed.core.create_node(fake_node("node-gpu-2", 1)))
    scaler.start()
    joiner.start()
    try:
        found = measure.watch_scale_out(run, timeout_s=30)  # type: ignore[arg-type]
    finally:
        scaler.cancel()
        joiner.cancel()
    assert found["replicas_before"] == 2 and found["replicas_after_scale_out"] == 3
    assert 0.5 <= found["scale_out_decided_after_s"] <= 3.0
    # ready once the node is there and kwok made the pod Ready (2 s)
    assert 4.0 + POD_READY_DELAY_S - 0.5 <= found["scale_out_ready_after_s"] <= 15.0
    assert backend.replicas().ready == 3
    # without an HPA the pool is not autoscaled
    k8s.AutoscalingV2Api(deployed.api).delete_namespaced_horizontal_pod_autoscaler("vllm-gpu", NS)
    alone = backend.replicas()
    assert (
        not alone.autoscaled and alone.desired == 3 and alone.detail == "no HorizontalPodAutoscaler"
    )


def test_pod_recovery_times_agree_with_a_watch_of_the_pods(
    deployed: DeployedStack, real_backend: Make
) -> None:
    """Krkn's pod recovery fields from the API's timestamps (whole seconds) against a
    reference: this test's own watch of the pods, timed with its clock as events arrive."""
    seen: dict[str, dict[str, float]] = {}
    stop = threading.Event()

    def watch_pods() -> None:
        w = watch.Watch()
        for event in w.stream(
            deployed.core.list_namespaced_pod, NS, label_selector=GPU, timeout_seconds=60
        ):
            pod = event["object"]
            times = seen.setdefault(pod.metadata.name, {"added": time.time()})
            if pod.spec.node_name and "scheduled" not in times:
                times["scheduled"] = time.time()
            ready = [c for c in pod.status.conditions or [] if c.type == "Ready"]
            if ready and ready[0].status == "True" and "ready" not in times:
                times["ready"] = time.time()
            if stop.is_set():
                w.stop()

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    time.sleep(1.0)  # the watch is open (it lists the current pods first)
    backend = real_backend()
    victim = deployed.pod_names(GPU)[0]
    killed_at = time.time()
    backend.kill_gpu_process(victim)  # no exec mapping: the pod is deleted
    deployed.wait(lambda: victim not in deployed.pod_names(GPU), 10, "victim gone")
    deployed.wait_available(30)
    stop.set()
    times = backend.pod_recovery_times(GPU, killed_at)
    (entry,) = times["recovered"]
    assert times["unrecovered"] == []
    reference = seen[entry["pod_name"]]
    assert entry["node"] == node_of(deployed, entry["pod_name"])
    rescheduling = reference["scheduled"] - killed_at
    readiness = reference["ready"] - reference["scheduled"]
    # API timestamps are truncated to whole seconds (up to 1 s early) and the watch sees an
    # event after it happened (up to WATCH_LAG_S on a busy machine): the API's figure may be
    # below the reference by both, and above it by at most a truncation.
    early = rescheduling - entry["pod_rescheduling_time"]
    assert -0.05 <= early <= 1.0 + WATCH_LAG_S, (entry, reference)
    assert abs(entry["pod_readiness_time"] - readiness) <= 1.0 + WATCH_LAG_S, (entry, reference)
    assert POD_READY_DELAY_S - 1.0 <= entry["pod_readiness_time"] <= POD_READY_DELAY_S + 2.0
    assert (
        entry["total_recovery_time"] == entry["pod_rescheduling_time"] + entry["pod_readiness_time"]
    )


# -- nodes -----------------------------------------------------------------------------------
def test_drain_evicts_for_real_and_a_disruption_budget_blocks_with_429(
    deployed: DeployedStack, real_backend: Make
) -> None:
    k8s.PolicyV1Api(deployed.api).create_namespaced_pod_disruption_budget(
        NS,
        {
            "metadata": {"name": "vllm-gpu"},
            "spec": {
                "minAvailable": 2,
                "selector": {"matchLabels": {"app.kubernetes.io/component": "engine-gpu"}},
            },
        },
    )
    deployed.wait(
        lambda: (
            k8s.PolicyV1Api(deployed.api)
            .read_namespaced_pod_disruption_budget("vllm-gpu", NS)
            .status.expected_pods
            == 2
        ),
        20,
        "the disruption controller counting the budget's pods",
    )
    another_teams_gpu_pod(deployed, "their-job")
    on_node = sorted(p.metadata.name for p in deployed.pods() if p.spec.node_name == "node-gpu-0")
    gpu_pod = [p for p in on_node if p.startswith("vllm-gpu-")]
    backend = real_backend()
    drained = backend.drain_node("node-gpu-0")
    assert drained["was_unschedulable"] is False
    assert drained["blocked"] == gpu_pod  # the budget answered 429
    assert drained["evicted"] == [p for p in on_node if p not in gpu_pod]
    assert drained["deleted"] == [] and drained["notes"] == []  # a real Eviction API
    assert deployed.core.read_node("node-gpu-0").spec.unschedulable is True
    assert deployed.pod_names(namespace="other-team") == ["their-job"]  # other namespaces stay
    deployed.wait_available(30)  # evicted pods were recreated, elsewhere: the node is cordoned
    assert {p.metadata.name for p in deployed.pods() if p.spec.node_name == "node-gpu-0"} == set(
        gpu_pod
    )
    codes = [(r, c) for v, r, c in verbs(deployed) if r == "pods/eviction"]
    assert sorted(codes) == sorted(
        [("pods/eviction", 201)] * len(drained["evicted"]) + [("pods/eviction", 429)]
    )
    backend.undo("uncordon_node", {"node": "node-gpu-0"})
    backend.uncordon_node("node-gpu-0")  # idempotent
    assert not deployed.core.read_node("node-gpu-0").spec.unschedulable


def test_cordon_of_a_cordoned_node_says_so(deployed: DeployedStack, real_backend: Make):
    backend = real_backend()
    assert backend.cordon_node("node-gpu-1") == {"node": "node-gpu-1", "was_unschedulable": False}
    assert backend.cordon_node("node-gpu-1") == {"node": "node-gpu-1", "was_unschedulable": True}
    with pytest.raises(InvalidInput, match="node: 'node-z' runs no pod"):
        backend.cordon_node("node-z")


# -- RBAC ------------------------------------------------------------------------------------
def test_a_forbidden_verb_is_a_clear_403(deployed: DeployedStack, real_backend: Make) -> None:
    config = service_account(
        deployed, "chaos-read-only", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    )
    backend = real_backend(kubeconfig=str(config))
    gateway = deployed.pod_names(GATEWAY)[0]
    with pytest.raises(StackError) as caught:
        backend.crash_gateway(gateway)
    message = str(caught.value)
    assert f"delete pod llmchaos/{gateway} (grace period 0) failed: HTTP 403 (forbidden" in message
    assert "deploy/10-rbac.yaml" in message
    assert (
        f'pods "{gateway}" is forbidden: User "system:serviceaccount:llmchaos:chaos-read-only" '
        'cannot delete resource "pods"' in message
    )
    with pytest.raises(
        StackError, match=r"exec redis-cli --scan in pod llmchaos/redis-\S+ failed: HTTP 403"
    ):
        backend.expire_token_cache(0)
    nobody = service_account(deployed, "chaos-nobody", [])
    with pytest.raises(
        StackError, match=r"list pods in namespace llmchaos .* HTTP 403 \(forbidden"
    ):
        real_backend(kubeconfig=str(nobody)).info()
    assert gateway in deployed.pod_names(GATEWAY)


def test_dry_run_sends_only_reads(deployed: DeployedStack, real_backend: Make, redis_url: str):
    backend = real_backend(dry_run=True, redis_url=redis_url)
    before = deployed.pod_names()
    plan = backend.kill_gpu_process(deployed.pod_names(GPU)[0])
    assert plan["dry_run"] is True
    backend.partition_node("node-gpu-0")
    backend.heal_partition("node-gpu-0")
    backend.crash_gateway(deployed.pod_names(GATEWAY)[0])
    backend.restore_gateway("x")
    assert backend.expire_token_cache(0) == 0
    backend.drain_node("node-gpu-1")
    backend.uncordon_node("node-gpu-1")
    assert [p["action"] for p in backend.plans] == [
        "kill_gpu_process",
        "partition_node",
        "heal_partition",
        "crash_gateway",
        "restore_gateway",
        "expire_token_cache",
        "cordon_node",
        "drain_node",
        "uncordon_node",
    ]
    assert {v for v, _, _ in verbs(deployed)} <= {"get", "list"}
    assert deployed.pod_names() == before
    assert not deployed.core.read_node("node-gpu-1").spec.unschedulable


def test_expire_token_cache_through_redis_url_needs_no_exec(
    deployed: DeployedStack, real_backend: Make, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.mset({**{f"token:t{i}": "tenant" for i in range(50)}, "other": "x"})
    assert real_backend(redis_url=redis_url, dry_run=True).expire_token_cache(0) == 0
    assert client.dbsize() == 51
    backend = real_backend(redis_url=redis_url)
    assert backend.expire_token_cache(30) == 50
    assert 0 < client.pttl("token:t7") <= 30_000 and client.ttl("other") == -1
    assert backend.expire_token_cache(0) == 50
    assert client.keys("*") == [b"other"]
    assert verbs(deployed) == []  # not one request to the API server
    client.close()


@pytest.mark.parametrize(
    ("exec_verbs", "allowed"),
    [(["get", "create"], True), (["get"], True), (["create"], False)],
    ids=["get+create", "get-only", "create-only"],
)
def test_exec_is_authorized_as_get(
    deployed: DeployedStack, real_backend: Make, exec_verbs: list[str], allowed: bool
) -> None:
    """The client's exec is a WebSocket GET, which Kubernetes 1.34 authorizes as `get`
    (kubectl's exec is a POST: `create`). deploy/10-rbac.yaml grants both."""
    pod = deployed.pod_names("app.kubernetes.io/component=redis")[0]
    deployed.map_exec(pod, {})
    deployed.wait_exec(pod)
    config = service_account(
        deployed,
        "chaos-exec-" + "-".join(exec_verbs),
        [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
            {"apiGroups": [""], "resources": ["pods/exec"], "verbs": exec_verbs},
        ],
    )
    backend = real_backend(kubeconfig=str(config), redis_cli=("true",))
    if allowed:
        assert backend.expire_token_cache(0) == 0  # `true --scan ...` lists no key
    else:
        with pytest.raises(StackError, match=r"exec true --scan in pod .* HTTP 403"):
            backend.expire_token_cache(0)
