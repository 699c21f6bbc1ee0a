"""KubernetesBackend against kmock (tests/k8s/conftest.py): faults, undo, safety, errors."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kubernetes import client as k8s

from llmchaos.backends import Backend
from llmchaos.backends.kubernetes import (
    KubernetesBackend,
    KubernetesSettings,
    parse_selector,
    selector_matches,
)
from llmchaos.errors import ComponentNotReady, InvalidInput, StackError
from llmchaos.ledger import FaultLedger, Undo

from .conftest import NS, OTHER_NS, Emulator, ExecResult, pod

Make = Callable[..., KubernetesBackend]
POLICY = "llmchaos-partition-node-a"
LABEL = "llmchaos.io/partitioned"


def labels(api: k8s.ApiClient, name: str, namespace: str = NS) -> dict[str, str]:
    return k8s.CoreV1Api(api).read_namespaced_pod(name, namespace).metadata.labels or {}


def pod_names(api: k8s.ApiClient, namespace: str = NS) -> list[str]:
    return sorted(p.metadata.name for p in k8s.CoreV1Api(api).list_namespaced_pod(namespace).items)


def policies(api: k8s.ApiClient) -> list[str]:
    items = k8s.NetworkingV1Api(api).list_namespaced_network_policy(NS).items
    return [p.metadata.name for p in items]


def nvidia_smi(pids: str) -> Callable[[list[str]], ExecResult]:
    def answer(command: list[str]) -> ExecResult:
        if command[0] == "nvidia-smi":
            return ExecResult(stdout=pids)
        if command[0] == "kill":
            return ExecResult()
        return ExecResult(stderr=f"{command[0]}: not found", exit_code=127)

    return answer


# -- names ---------------------------------------------------------------------------------
def test_info_filters_label_selectors_client_side(make_backend: Make, emulator: Emulator):
    info = make_backend().info()
    # kmock ignores labelSelector: without the backend's own filtering every pod would match
    assert [(w.name, w.mode, w.node) for w in info.workers] == [
        ("vllm-gpu-a", "gpu", "node-a"),
        ("vllm-gpu-b", "gpu", "node-b"),
        ("vllm-cpu-c", "cpu", "node-c"),
    ]
    assert info.gateways == ("gateway-1", "gateway-2")
    assert info.nodes == ("node-a", "node-b", "node-c")
    assert info.partitions_supported
    assert all(m == "GET" for m, _ in emulator.requests)
    assert any(p == f"/api/v1/namespaces/{NS}/pods" for _, p in emulator.requests)
    assert not any(OTHER_NS in p for _, p in emulator.requests)


def test_selector_parsing_and_matching():
    reqs = parse_selector("a=1, b!=2, c in (x, y), d notin (z), e, !f")
    assert selector_matches(reqs, {"a": "1", "c": "y", "e": ""})
    assert not selector_matches(reqs, {"a": "1", "c": "y", "e": "", "f": "1"})
    assert not selector_matches(reqs, {"a": "1", "b": "2", "c": "x", "e": ""})
    assert not selector_matches(reqs, {"a": "1", "c": "w", "e": ""})
    with pytest.raises(InvalidInput, match="gpu_selector"):
        parse_selector("a=(", "gpu_selector")


# -- kill ----------------------------------------------------------------------------------
def test_kill_gpu_process_via_exec(make_backend: Make, emulator: Emulator, cluster):
    emulator.exec_answers["vllm-gpu-a"] = nvidia_smi("4242\n4343\n")
    result = make_backend().kill_gpu_process("vllm-gpu-a")
    assert result == {
        "worker": "vllm-gpu-a",
        "pod": "vllm-gpu-a",
        "node": "node-a",
        "pid": 4242,
        "pids": [4242, 4343],
    }
    assert emulator.exec_calls == [
        ("vllm-gpu-a", ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]),
        ("vllm-gpu-a", ["kill", "-9", "4242", "4343"]),
    ]
    assert "vllm-gpu-a" in pod_names(cluster)  # killed inside, not deleted


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (lambda command: 403, "nvidia-smi failed: .*HTTP 403"),
        (
            lambda command: ExecResult(stderr="nvidia-smi: not found", exit_code=127),
            "exit code 127",
        ),
        (nvidia_smi("No running processes found\n"), "lists no compute process"),
        (
            lambda c: (
                ExecResult("7\n") if c[0] == "nvidia-smi" else ExecResult("", "No such process", 1)
            ),
            r"kill -9 \[7\] failed",
        ),
    ],
    ids=["exec-refused", "nvidia-smi-missing", "no-pids", "kill-fails"],
)
def test_kill_falls_back_to_deleting_the_pod(
    make_backend: Make, emulator: Emulator, cluster, answer: Any, reason: str
):
    emulator.exec_answers["vllm-gpu-b"] = answer
    result = make_backend().kill_gpu_process("vllm-gpu-b")
    assert result["deleted_pod"] == "vllm-gpu-b"
    assert "pid" not in result
    assert re.search(reason, result["reason"]), result["reason"]
    assert "vllm-gpu-b" not in pod_names(cluster)
    deletes = [(m, p) for m, p in emulator.requests if m == "DELETE"]
    assert deletes == [("DELETE", f"/api/v1/namespaces/{NS}/pods/vllm-gpu-b")]


def test_kill_unknown_or_cpu_worker_is_invalid_input(make_backend: Make, emulator: Emulator):
    backend = make_backend()
    with pytest.raises(InvalidInput, match=r"worker: 'vllm-cpu-c' is not a GPU inference pod"):
        backend.kill_gpu_process("vllm-cpu-c")
    with pytest.raises(InvalidInput, match="GPU pods: vllm-gpu-a, vllm-gpu-b"):
        backend.kill_gpu_process("nope")
    assert emulator.writes() == []


# -- partition -----------------------------------------------------------------------------
def test_partition_labels_pods_and_creates_deny_all_policy(make_backend: Make, cluster):
    backend = make_backend()
    backend.partition_node("node-a")
    assert policies(cluster) == [POLICY]
    policy = k8s.NetworkingV1Api(cluster).read_namespaced_network_policy(POLICY, NS)
    assert policy.spec.pod_selector.match_labels == {LABEL: "node-a"}
    assert sorted(policy.spec.policy_types) == ["Egress", "Ingress"]
    assert not policy.spec.ingress and not policy.spec.egress  # no rule: deny all
    assert labels(cluster, "vllm-gpu-a")[LABEL] == "node-a"
    assert labels(cluster, "gateway-1")[LABEL] == "node-a"
    assert LABEL not in labels(cluster, "vllm-gpu-b")  # another node
    assert LABEL not in labels(cluster, "their-gpu-job", OTHER_NS)  # another namespace

    backend.partition_node("node-a")  # idempotent: 409 on the policy is "already there"
    assert policies(cluster) == [POLICY]

    backend.heal_partition("node-a")
    assert policies(cluster) == []
    assert LABEL not in labels(cluster, "vllm-gpu-a")
    assert LABEL not in labels(cluster, "gateway-1")
    assert labels(cluster, "vllm-gpu-a")["app.kubernetes.io/component"] == "engine-gpu"

    backend.heal_partition("node-a")  # twice: nothing left, no error
    backend.heal_partition("node-gone")  # a node that never was: nothing to undo


def test_partition_unknown_node_is_invalid_input(make_backend: Make, emulator: Emulator):
    with pytest.raises(InvalidInput, match=r"node: 'node-x' runs no pod of namespace llmchaos"):
        make_backend().partition_node("node-x")
    assert emulator.writes() == []


# -- gateways ------------------------------------------------------------------------------
def test_crash_gateway_deletes_the_pod_and_restore_waits_for_the_deployment(
    make_backend: Make, emulator: Emulator, cluster
):
    backend = make_backend()
    result = backend.crash_gateway("gateway-1")
    assert result == {
        "gateway": "gateway-1",
        "pod": "gateway-1",
        "node": "node-a",
        "deleted_pod": "gateway-1",
    }
    assert "gateway-1" not in pod_names(cluster)
    assert [p for m, p in emulator.requests if m == "DELETE"] == [
        f"/api/v1/namespaces/{NS}/pods/gateway-1"
    ]
    # The Deployment controller is not emulated: show 1/2 ready, then 2/2 a moment later.
    apps = k8s.AppsV1Api(cluster)
    apps.patch_namespaced_deployment("gateway", NS, {"status": {"readyReplicas": 1}})
    timer = threading.Timer(
        0.3,
        lambda: apps.patch_namespaced_deployment("gateway", NS, {"status": {"readyReplicas": 2}}),
    )
    started = time.monotonic()
    timer.start()
    backend.restore_gateway("gateway-1")
    assert 0.25 < time.monotonic() - started < 3
    backend.restore_gateway("gateway-1")  # idempotent: ready already


def test_restore_gateway_deadline(make_backend: Make, cluster):
    k8s.AppsV1Api(cluster).patch_namespaced_deployment(
        "gateway", NS, {"status": {"readyReplicas": 0}}
    )
    backend = make_backend(ready_timeout_s=0.3)
    with pytest.raises(ComponentNotReady, match=r"gateway deployment llmchaos/gateway: 0/2"):
        backend.restore_gateway("gateway-1")


def test_crash_unknown_gateway_is_invalid_input(make_backend: Make):
    with pytest.raises(InvalidInput, match="gateway pods: gateway-1, gateway-2"):
        make_backend().crash_gateway("vllm-gpu-a")


def test_restore_with_a_missing_deployment_names_the_setting(make_backend: Make):
    with pytest.raises(InvalidInput, match="gateway_deployment: no deployment 'gw'"):
        make_backend(gateway_deployment="gw").restore_gateway("gateway-1")


# -- token cache ---------------------------------------------------------------------------
class FakeRedisCli:
    """redis-cli in the Redis pod, over a dict: --scan, DEL, EVAL (the PEXPIRE script)."""

    def __init__(self, keys: list[str]):
        self.keys = {k: None for k in keys}
        self.ttls: dict[str, int] = {}

    def __call__(self, command: list[str]) -> ExecResult:
        assert command[0] == "redis-cli"
        args = command[1:]
        if args[:3] == ["--scan", "--pattern", "token:*"]:
            return ExecResult("".join(f"{k}\n" for k in self.keys if k.startswith("token:")))
        if args[0] == "DEL":
            gone = [k for k in args[1:] if self.keys.pop(k, 0) is None]
            return ExecResult(f"{len(gone)}\n")
        if args[0] == "EVAL":
            n = int(args[2])
            keys, ttl = args[3 : 3 + n], int(args[3 + n])
            for key in keys:
                self.ttls[key] = ttl
            return ExecResult(f"{len(keys)}\n")
        return ExecResult(stderr="ERR unknown command", exit_code=1)


def test_expire_token_cache_through_redis_cli_exec(make_backend: Make, emulator: Emulator):
    fake = FakeRedisCli([f"token:t{i}" for i in range(1203)] + ["other:key"])
    emulator.exec_answers["redis-0"] = fake
    backend = make_backend()
    assert backend.expire_token_cache(2.5) == 1203
    assert set(fake.ttls) == {f"token:t{i}" for i in range(1203)}
    assert set(fake.ttls.values()) == {2500}
    assert backend.expire_token_cache(0) == 1203
    assert list(fake.keys) == ["other:key"]
    deletes = [c for p, c in emulator.exec_calls if c[1] == "DEL"]
    # batched: the keys travel in the exec URL, which stays under 8 KiB
    assert sum(len(c) - 2 for c in deletes) == 1203 and len(deletes) > 1
    assert max(len(" ".join(c)) for c in deletes) < 4100
    assert backend.expire_token_cache(0) == 0
    with pytest.raises(InvalidInput, match="ttl_s"):
        backend.expire_token_cache(-1)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server (Debian's) on a free port, as a cluster's Redis behind redis_url."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make setup installs it)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_expire_token_cache_through_redis_url(make_backend: Make, emulator: Emulator, redis_url):
    client = redis.Redis.from_url(redis_url)
    client.mset({**{f"token:t{i}": "tenant" for i in range(50)}, "other": "x"})
    backend = make_backend(redis_url=redis_url)
    assert make_backend(redis_url=redis_url, dry_run=True).expire_token_cache(0) == 0
    assert client.dbsize() == 51
    assert backend.expire_token_cache(30) == 50
    assert 0 < client.pttl("token:t7") <= 30_000 and client.ttl("other") == -1
    assert backend.expire_token_cache(0) == 50
    assert client.keys("*") == [b"other"]
    assert emulator.exec_calls == []  # no exec needed
    client.close()


def test_expire_token_cache_needs_a_ready_redis_pod(make_backend: Make, cluster):
    k8s.CoreV1Api(cluster).delete_namespaced_pod("redis-0", NS)
    with pytest.raises(StackError, match=r"no ready Redis pod .* set redis_url"):
        make_backend().expire_token_cache(0)


# -- readings ------------------------------------------------------------------------------
METRICS = """# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} %s
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 50.0
"""


def test_queue_depth_through_the_pod_proxy(make_backend: Make, emulator: Emulator):
    emulator.metrics["vllm-gpu-a"] = METRICS % "7.0"
    emulator.metrics["vllm-cpu-c"] = METRICS % "2.0"
    # vllm-gpu-b does not answer (503): it counts 0
    assert make_backend(metrics_port=8000).queue_depth() == 9.0
    proxied = sorted(p for _, p in emulator.requests if "/proxy/" in p)
    assert proxied == [
        f"/api/v1/namespaces/{NS}/pods/vllm-cpu-c:8000/proxy/metrics",
        f"/api/v1/namespaces/{NS}/pods/vllm-gpu-a:8000/proxy/metrics",
        f"/api/v1/namespaces/{NS}/pods/vllm-gpu-b:8000/proxy/metrics",
    ]


def test_healthy_workers_counts_ready_pods(make_backend: Make, cluster):
    core = k8s.CoreV1Api(cluster)
    backend = make_backend()
    assert (backend.healthy_workers(), backend.healthy_workers("gpu")) == (3, 2)
    core.create_namespaced_pod(NS, pod("vllm-gpu-d", "engine-gpu", "node-b", ready=False))
    core.patch_namespaced_pod(
        "vllm-gpu-a", NS, {"metadata": {"deletionTimestamp": "2026-12-02T10:00:05Z"}}
    )
    assert backend.healthy_workers("gpu") == 1
    assert backend.healthy_workers("cpu") == 1
    with pytest.raises(InvalidInput, match="mode"):
        backend.healthy_workers("tpu")


def test_pod_recovery_times_in_krkn_terms(make_backend: Make, cluster):
    core = k8s.CoreV1Api(cluster)
    kill_ts = 1_796_205_600.0  # 2026-12-02T10:00:00Z
    core.create_namespaced_pod(
        NS,
        pod(
            "vllm-gpu-new",
            "engine-gpu",
            "node-b",
            created="2026-12-02T10:00:02Z",
            scheduled="2026-12-02T10:00:03Z",
            ready_at="2026-12-02T10:00:48Z",
        ),
    )
    core.create_namespaced_pod(
        NS,
        pod(
            "vllm-gpu-loading", "engine-gpu", "node-a", created="2026-12-02T10:00:05Z", ready=False
        ),
    )
    times = make_backend().pod_recovery_times("app.kubernetes.io/component=engine-gpu", kill_ts)
    assert times["recovered"] == [
        {
            "pod_name": "vllm-gpu-new",
            "namespace": NS,
            "node": "node-b",
            "pod_rescheduling_time": 3.0,
            "pod_readiness_time": 45.0,
            "total_recovery_time": 48.0,
        }
    ]
    assert times["unrecovered"] == [
        {
            "pod_name": "vllm-gpu-loading",
            "namespace": NS,
            "node": "node-a",
            "pod_rescheduling_time": 5.0,
        }
    ]


def test_available_replicas_and_gpu_allocatable(make_backend: Make):
    backend = make_backend()
    assert backend.available_replicas("gateway") == 2
    assert backend.gpu_allocatable("node-a") == 1
    assert backend.gpu_allocatable("node-c") == 0
    with pytest.raises(InvalidInput, match="deployment: no deployment 'nope'"):
        backend.available_replicas("nope")
    with pytest.raises(InvalidInput, match="node: no node 'node-z'"):
        backend.gpu_allocatable("node-z")


# -- nodes ---------------------------------------------------------------------------------
def test_cordon_uncordon_and_drain(make_backend: Make, emulator: Emulator, cluster):
    core = k8s.CoreV1Api(cluster)
    backend = make_backend()
    assert backend.cordon_node("node-b") == {"node": "node-b", "was_unschedulable": False}
    assert core.read_node("node-b").spec.unschedulable is True
    backend.uncordon_node("node-b")
    backend.uncordon_node("node-b")  # idempotent
    assert not core.read_node("node-b").spec.unschedulable
    assert "uncordon_node" in KubernetesBackend.UNDO_OPS
    assert frozenset({"heal_partition", "restore_gateway"}) == Backend.UNDO_OPS  # base: as is

    drained = backend.drain_node("node-a")
    # kmock has no Eviction API (404): the pods were deleted instead, and it says so
    assert drained["evicted"] == [] and drained["blocked"] == []
    assert drained["deleted"] == ["gateway-1", "vllm-gpu-a"]
    assert all("eviction answered 404, pod deleted instead" in n for n in drained["notes"])
    assert core.read_node("node-a").spec.unschedulable is True
    assert pod_names(cluster) == ["gateway-2", "redis-0", "vllm-cpu-c", "vllm-gpu-b"]
    assert pod_names(cluster, OTHER_NS) == ["their-gpu-job"]  # other namespaces stay
    evictions = [p for m, p in emulator.requests if m == "POST" and p.endswith("/eviction")]
    assert len(evictions) == 2
    backend.undo("uncordon_node", {"node": "node-a"})
    assert not core.read_node("node-a").spec.unschedulable


def test_drain_respects_a_disruption_budget(make_backend: Make, emulator: Emulator, cluster):
    emulator.fail("POST", r"/pods/vllm-gpu-b/eviction$", 429, "Cannot evict: PDB")
    emulator.fail("POST", r"/pods/gateway-2/eviction$", 201)
    drained = make_backend().drain_node("node-b")
    assert drained["blocked"] == ["vllm-gpu-b"]
    assert drained["evicted"] == ["gateway-2"]
    assert "vllm-gpu-b" in pod_names(cluster)


# -- safety --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("namespace", "allowed", "message"),
    [
        ("kube-system", ("kube-system",), r"allowed_namespaces: 'kube-system' is a system"),
        ("kube-system", ("llmchaos",), r"namespace: 'kube-system' is a system namespace"),
        ("llmchaos", ("staging",), r"namespace: 'llmchaos' is not in allowed_namespaces"),
        ("llmchaos", (), r"allowed_namespaces: required and non-empty"),
        ("llmchaos", "llmchaos", r"allowed_namespaces: expected a tuple"),
    ],
    ids=["kube-system-listed", "kube-system", "unlisted", "empty", "str"],
)
def test_namespace_allowlist_refuses_before_any_request(
    emulator: Emulator, kubeconfig: Path, namespace: str, allowed: Any, message: str
):
    before = list(emulator.requests)
    with pytest.raises(InvalidInput, match=message):
        KubernetesSettings(
            namespace=namespace, allowed_namespaces=allowed, kubeconfig=str(kubeconfig)
        )
    assert emulator.requests == before == []


def test_allowlist_is_checked_again_by_the_backend(emulator: Emulator, kubeconfig: Path):
    settings = KubernetesSettings(allowed_namespaces=("llmchaos",), kubeconfig=str(kubeconfig))
    # a caller bypassing the dataclass check (object.__setattr__) is still refused
    object.__setattr__(settings, "namespace", "kube-system")
    with pytest.raises(InvalidInput, match="namespace: 'kube-system'"):
        KubernetesBackend(settings)
    assert emulator.requests == []


def test_settings_from_mapping():
    settings = KubernetesSettings.from_mapping(
        {"allowed_namespaces": "llmchaos, staging", "dry_run": "true", "metrics_port": "9000"}
    )
    assert settings.allowed_namespaces == ("llmchaos", "staging")
    assert settings.dry_run is True and settings.metrics_port == 9000
    with pytest.raises(InvalidInput, match=r"allowed_namespace \(did you mean allowed_namespaces"):
        KubernetesSettings.from_mapping({"allowed_namespace": ["llmchaos"]})
    with pytest.raises(InvalidInput, match="gpu_selector: required"):
        KubernetesSettings.from_mapping({"allowed_namespaces": ["llmchaos"], "gpu_selector": " "})
    with pytest.raises(InvalidInput, match="kubeconfig: cannot load /nonexistent"):
        KubernetesBackend(
            KubernetesSettings(allowed_namespaces=("llmchaos",), kubeconfig="/nonexistent")
        )


def test_dry_run_changes_nothing(make_backend: Make, emulator: Emulator, cluster):
    emulator.exec_answers["vllm-gpu-a"] = nvidia_smi("4242\n")
    emulator.exec_answers["redis-0"] = FakeRedisCli(["token:a"])
    backend = make_backend(dry_run=True)
    plan = backend.kill_gpu_process("vllm-gpu-a")
    assert plan["dry_run"] is True and plan["pod"] == "vllm-gpu-a"
    backend.partition_node("node-a")
    backend.heal_partition("node-a")
    assert backend.crash_gateway("gateway-1")["dry_run"] is True
    backend.restore_gateway("gateway-1")
    assert backend.expire_token_cache(0) == 0
    backend.cordon_node("node-b")
    backend.drain_node("node-b")
    backend.uncordon_node("node-b")
    assert [p["action"] for p in backend.plans] == [
        "kill_gpu_process",
        "partition_node",
        "heal_partition",
        "crash_gateway",
        "restore_gateway",
        "expire_token_cache",
        "cordon_node",
        "cordon_node",
        "drain_node",
        "uncordon_node",
    ]
    partition = backend.plans[1]
    assert partition["networkpolicy"] == POLICY
    assert partition["pods"] == ["gateway-1", "vllm-gpu-a"]
    # Only reads, and the one read-only exec (redis-cli --scan to count the keys)
    assert [c for _, c in emulator.exec_calls] == [["redis-cli", "--scan", "--pattern", "token:*"]]
    assert [w for w in emulator.writes() if not w[1].endswith("/exec")] == []
    assert pod_names(cluster) == [
        "gateway-1",
        "gateway-2",
        "redis-0",
        "vllm-cpu-c",
        "vllm-gpu-a",
        "vllm-gpu-b",
    ]
    assert policies(cluster) == []
    assert not k8s.CoreV1Api(cluster).read_node("node-b").spec.unschedulable


# -- API errors ----------------------------------------------------------------------------
def test_api_500_on_delete_is_a_stack_error(make_backend: Make, emulator: Emulator):
    emulator.fail("DELETE", r"/pods/gateway-1$", 500, "etcdserver: request timed out")
    with pytest.raises(StackError) as caught:
        make_backend().crash_gateway("gateway-1")
    message = str(caught.value)
    assert message.startswith("kubernetes: delete pod llmchaos/gateway-1 (grace period 0) failed")
    assert "HTTP 500" in message and "etcdserver: request timed out" in message


def test_api_409_is_a_stack_error(make_backend: Make, emulator: Emulator):
    emulator.fail("PATCH", r"/pods/vllm-gpu-a$", 409, "the object has been modified")
    with pytest.raises(
        StackError, match=r"patch labels of pod llmchaos/vllm-gpu-a failed: HTTP 409 \(conflict"
    ):
        make_backend().partition_node("node-a")


def test_api_403_is_a_stack_error_pointing_at_rbac(make_backend: Make, emulator: Emulator):
    emulator.fail("GET", r"/namespaces/llmchaos/pods$", 403, 'pods is forbidden: User "x"')
    with pytest.raises(StackError) as caught:
        make_backend().info()
    message = str(caught.value)
    assert "list pods in namespace llmchaos with selector" in message
    assert "HTTP 403 (forbidden" in message and "deploy/10-rbac.yaml" in message
    assert 'pods is forbidden: User "x"' in message


def test_exec_403_names_exec(make_backend: Make, emulator: Emulator):
    emulator.exec_answers["redis-0"] = lambda command: 403
    with pytest.raises(
        StackError, match=r"exec redis-cli --scan in pod llmchaos/redis-0 failed: HTTP 403"
    ):
        make_backend().expire_token_cache(0)


def test_unreachable_api_server(tmp_path: Path):
    config = tmp_path / "kubeconfig.json"
    config.write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "c",'
        ' "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:9"}}],'
        ' "users": [{"name": "u", "user": {}}],'
        ' "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}'
    )
    backend = KubernetesBackend(
        KubernetesSettings(
            allowed_namespaces=("llmchaos",), kubeconfig=str(config), request_timeout_s=2
        )
    )
    with pytest.raises(StackError, match=r"cannot reach the API server at http://127\.0\.0\.1:9"):
        backend.healthy_workers()
    backend.close()


def test_ledger_undoes_a_partition_after_a_later_500(
    make_backend: Make, emulator: Emulator, cluster, tmp_path: Path
):
    backend = make_backend()
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        backend.partition_node("node-a")
    emulator.fail("DELETE", r"/pods/gateway-2$", 500)
    with (
        pytest.raises(StackError, match="HTTP 500"),
        ledger.inject(
            "crash_gateway", "gateway-2", Undo("restore_gateway", {"gateway": "gateway-2"})
        ),
    ):
        backend.crash_gateway("gateway-2")
    assert [(e.fault, e.state) for e in ledger.open_faults()] == [
        ("crash_gateway", "failed"),
        ("partition_node", "injected"),
    ]
    report = ledger.undo_all(lambda undo: backend.undo(undo.op, undo.args), by="test")
    assert report == [
        "fault 2 crash_gateway(gateway-2): undone by test",
        "fault 1 partition_node(node-a): undone by test",
    ]
    assert policies(cluster) == []
    assert LABEL not in labels(cluster, "vllm-gpu-a")
    assert ledger.open_faults() == []


def test_ledger_keeps_a_partition_open_while_heal_fails_then_undoes_it(
    make_backend: Make, emulator: Emulator, cluster, tmp_path: Path
):
    backend = make_backend()
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        backend.partition_node("node-a")
    emulator.fail("DELETE", r"/networkpolicies/", 500, times=1)
    first = ledger.undo_all(lambda undo: backend.undo(undo.op, undo.args), by="rollback")
    assert "undo FAILED: kubernetes: delete networkpolicy llmchaos/" in first[0]
    assert "HTTP 500" in first[0]
    assert len(ledger.open_faults()) == 1
    second = ledger.undo_all(lambda undo: backend.undo(undo.op, undo.args), by="cleanup")
    assert second == ["fault 1 partition_node(node-a): undone by cleanup"]
    assert policies(cluster) == [] and LABEL not in labels(cluster, "gateway-1")
