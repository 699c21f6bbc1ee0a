"""KubernetesTarget against kmock (tests/k8s/conftest.py), for what a real API server cannot
be made to do on demand: ignore label selectors, answer /metrics through the pod proxy with
scripted text (fake pods have no IP), carry scripted timestamps, have no Eviction API, fail
with 500 or 409. Everything else runs against the real control plane (test_backend_real.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import FaultLedger, Undo
from llmchaos.settings import RunSettings
from llmchaos.targets import Target
from llmchaos.targets.kubernetes import (
    KIND,
    KubernetesSettings,
    KubernetesTarget,
    parse_selector,
    selector_matches,
)

from .conftest import NS, OTHER_NS, Emulator, pod

Make = Callable[..., KubernetesTarget]
POLICY = "llmchaos-partition-node-a"
LABEL = "llmchaos.io/partitioned"


def labels(api: k8s.ApiClient, name: str, namespace: str = NS) -> dict[str, str]:
    return k8s.CoreV1Api(api).read_namespaced_pod(name, namespace).metadata.labels or {}


def pod_names(api: k8s.ApiClient, namespace: str = NS) -> list[str]:
    return sorted(p.metadata.name for p in k8s.CoreV1Api(api).list_namespaced_pod(namespace).items)


def policies(api: k8s.ApiClient) -> list[str]:
    items = k8s.NetworkingV1Api(api).list_namespaced_network_policy(NS).items
    return [p.metadata.name for p in items]


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


# -- nodes ---------------------------------------------------------------------------------
def test_drain_deletes_when_evictions_answer_404(make_backend: Make, emulator: Emulator, cluster):
    core = k8s.CoreV1Api(cluster)
    backend = make_backend()
    assert backend.cordon_node("node-b") == {"node": "node-b", "was_unschedulable": False}
    assert core.read_node("node-b").spec.unschedulable is True
    backend.uncordon_node("node-b")
    backend.uncordon_node("node-b")  # idempotent
    assert not core.read_node("node-b").spec.unschedulable
    assert "uncordon_node" in KubernetesTarget.UNDO_OPS
    assert "uncordon_node" not in Target.UNDO_OPS  # the base: no nodes to cordon

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
        KubernetesTarget(settings)
    assert emulator.requests == []


def test_settings_from_configuration_and_environment():
    settings = KIND.settings(
        {"k8s_allowed_namespaces": "llmchaos, staging", "k8s_dry_run": "true"},
        {"LLMCHAOS_K8S_METRICS_PORT": "9000"},
    )
    assert isinstance(settings, KubernetesSettings)
    assert settings.allowed_namespaces == ("llmchaos", "staging")
    assert settings.dry_run is True and settings.metrics_port == 9000
    with pytest.raises(InvalidInput, match=r"configuration.k8s_allowed_namespace: not a setting"):
        RunSettings.from_configuration({"target": "k8s", "k8s_allowed_namespace": ["llmchaos"]}, {})
    with pytest.raises(InvalidInput, match="gpu_selector: required"):
        KIND.settings({"k8s_allowed_namespaces": ["llmchaos"], "k8s_gpu_selector": " "}, {})
    with pytest.raises(InvalidInput, match="kubeconfig: cannot load /nonexistent"):
        KubernetesTarget(
            KubernetesSettings(allowed_namespaces=("llmchaos",), kubeconfig="/nonexistent")
        )


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


def test_unreachable_api_server(tmp_path: Path):
    config = tmp_path / "kubeconfig.json"
    config.write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "c",'
        ' "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:9"}}],'
        ' "users": [{"name": "u", "user": {}}],'
        ' "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}'
    )
    backend = KubernetesTarget(
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
