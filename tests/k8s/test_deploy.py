"""deploy/: the manifests parse, match the client's API schema, fit the backend's defaults,
and the RBAC rules grant exactly what KubernetesTarget sends (on a real API server)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from llmchaos.load.config import LoadConfig
from llmchaos.stack.settings import GatewaySettings, settings_from_dict
from llmchaos.targets.kubernetes import (
    KubernetesSettings,
    KubernetesTarget,
    parse_selector,
    worker_deployment,
)
from llmchaos.targets.kubernetes import selector_matches as matches

from .conftest import NS
from .controlplane import DeployedStack

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
Doc = dict[str, Any]


def documents() -> list[tuple[str, Doc]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = documents()


def find(kind: str, name: str) -> Doc:
    for _, doc in DOCS:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"deploy/ has no {kind} {name}")


def lost_fields(source: Any, kept: Any, path: str = "") -> list[str]:
    """Where `kept` (the object after the client's model) differs from `source`."""
    if isinstance(source, dict):
        if not isinstance(kept, dict):
            return [f"{path}: not an object"]
        problems = []
        for key, value in source.items():
            if key not in kept:
                problems.append(f"{path}.{key}: unknown field")
            else:
                problems += lost_fields(value, kept[key], f"{path}.{key}")
        return problems
    if isinstance(source, list):
        if not isinstance(kept, list) or len(kept) != len(source):
            return [f"{path}: list changed"]
        return [
            p
            for i, (a, b) in enumerate(zip(source, kept, strict=True))
            for p in lost_fields(a, b, f"{path}[{i}]")
        ]
    return [] if source == kept else [f"{path}: {source!r} became {kept!r}"]


def schema_problems(doc: Doc) -> list[str]:
    """Round trip through the official client's model of the kind: unknown or mistyped fields
    show up as lost or changed (the models ignore unknown keys, and reject wrong types)."""
    version = doc["apiVersion"].split("/")[-1]
    model = getattr(k8s, version.capitalize() + doc["kind"])
    kept = k8s.ApiClient().sanitize_for_serialization(model.from_dict(doc))
    return lost_fields(doc, kept)


@pytest.mark.parametrize(
    ("file", "doc"), DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS]
)
def test_manifest_matches_the_api_schema(file: str, doc: Doc):
    assert schema_problems(doc) == []
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert doc["metadata"].get("namespace") == (None if doc["kind"] in cluster_scoped else NS)
    assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llmchaos"


def test_schema_check_catches_a_typo():
    doc = json.loads(json.dumps(find("Deployment", "redis")))
    doc["spec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    assert schema_problems(doc) == [".spec.template.spec.containers[0].imagee: unknown field"]


def test_files_apply_in_order_and_the_namespace_comes_first():
    assert DOCS[0][1]["kind"] == "Namespace" and DOCS[0][1]["metadata"]["name"] == NS
    assert [f for f, _ in DOCS] == sorted(f for f, _ in DOCS)


def pod_template_labels(name: str) -> dict[str, str]:
    return find("Deployment", name)["spec"]["template"]["metadata"]["labels"]


def test_backend_defaults_select_the_manifests_pods():
    settings = KubernetesSettings(allowed_namespaces=(NS,))
    assert settings.namespace == NS
    for field, deployment in [
        ("gpu_selector", "vllm-gpu"),
        ("cpu_selector", "vllm-cpu"),
        ("gateway_selector", "gateway"),
        ("redis_selector", "redis"),
    ]:
        selector = parse_selector(getattr(settings, field))
        chosen = [
            d["metadata"]["name"]
            for _, d in DOCS
            if d["kind"] == "Deployment"
            and matches(selector, pod_template_labels(d["metadata"]["name"]))
        ]
        assert chosen == [deployment], field
    assert find("Deployment", settings.gateway_deployment)
    service = find("Service", "gateway")
    assert (
        settings.gateway_url
        == f"http://gateway.{NS}.svc.cluster.local:{service['spec']['ports'][0]['port']}"
    )


def test_deployments_and_services_fit_together():
    for _, doc in DOCS:
        if doc["kind"] == "Deployment":
            selector = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), doc["metadata"]["name"]
        if doc["kind"] == "Service":
            targets = [
                d
                for _, d in DOCS
                if d["kind"] == "Deployment"
                and doc["spec"]["selector"].items()
                <= pod_template_labels(d["metadata"]["name"]).items()
            ]
            assert len(targets) == 1, doc["metadata"]["name"]
            ports = {
                p["name"]
                for c in targets[0]["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            for port in doc["spec"]["ports"]:
                assert port["targetPort"] in ports, (doc["metadata"]["name"], port)


def test_gpu_deployment_requests_a_gpu_and_probes_health():
    container = find("Deployment", "vllm-gpu")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "http", "containerPort": 8000} in container["ports"]
    assert KubernetesSettings(allowed_namespaces=(NS,)).metrics_port == 8000
    cpu = find("Deployment", "vllm-cpu")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])


def test_hpa_scales_gpu_pods_at_70_percent_gpu_utilisation():
    hpa = find("HorizontalPodAutoscaler", "vllm-gpu")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "vllm-gpu",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "DCGM_FI_DEV_GPU_UTIL"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "70"}


def test_gateway_settings_load_as_the_gateway_would():
    config = json.loads(find("ConfigMap", "gateway-settings")["data"]["gateway.json"])
    settings = settings_from_dict(GatewaySettings, config, "gateway.json")
    container = find("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": settings.port} in container["ports"]
    services = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Service"}
    for worker in settings.workers:
        host, port = re.match(r"http://([^:/]+):(\d+)$", worker.url).groups()
        assert int(port) == services[host]["spec"]["ports"][0]["port"]
    assert settings.redis_url == "redis://redis:6379/0"


def test_locust_master_and_workers_agree():
    config = LoadConfig.from_json(find("ConfigMap", "locust-load")["data"]["load.json"])
    master = find("Deployment", "locust-master")["spec"]["template"]["spec"]["containers"][0]
    argv = shlex.split(master["args"][0])
    workers = find("Deployment", "locust-worker")
    replicas = workers["spec"]["replicas"]
    assert argv[argv.index("--expect-workers") + 1] == str(replicas) == argv[argv.index("-u") + 1]
    assert replicas >= 2 and config.qps / replicas <= 2500  # one process: ~2,500 QPS
    assert argv[argv.index("--host") + 1] == config.url
    assert argv[:5] == ["exec", "python", "-m", "locust", "-f"] and "--master" in argv
    worker = workers["spec"]["template"]["spec"]["containers"][0]
    assert "--worker" in worker["command"] and "--master-host=locust-master" in worker["command"]
    assert config.live_host == "0.0.0.0" and config.live_port == 8090


@pytest.mark.slow
def test_deploy_applies_to_a_real_api_server(deployed: DeployedStack) -> None:
    """`deployed` applied deploy/ (the server validated every object, admission included) and
    waited for every Deployment; here: all objects are there, and the scheduler put each GPU
    pod on its own GPU node, the CPU engine on the node without a GPU."""
    dynamic = deployed.plane.dynamic_client(deployed.api)
    for _, doc in DOCS:
        resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        namespace = doc["metadata"].get("namespace")
        assert resource.get(name=doc["metadata"]["name"], namespace=namespace)
    gpu_nodes = [p.spec.node_name for p in deployed.pods("app.kubernetes.io/component=engine-gpu")]
    assert sorted(gpu_nodes) == ["node-gpu-0", "node-gpu-1"]
    (cpu,) = deployed.pods("app.kubernetes.io/component=engine-cpu")
    assert cpu.spec.node_name == "node-cpu-0"
    assert len(deployed.pods()) == sum(
        d["spec"]["replicas"] for _, d in DOCS if d["kind"] == "Deployment"
    )


# -- RBAC: exactly what the backend sends ----------------------------------------------------
def granted() -> set[tuple[str, str, str]]:
    rules = (
        find("Role", "llmchaos-chaos")["rules"]
        + find("ClusterRole", "llmchaos-chaos-nodes")["rules"]
    )
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.slow
def test_rbac_grants_exactly_the_verbs_the_backend_uses(
    deployed: DeployedStack,
    real_backend: Callable[..., KubernetesTarget],
    gpu_processes: Callable[[list[int]], str],
) -> None:
    """Every operation as deploy/10-rbac.yaml's service account on a real API server: none is
    refused, and the audit log's requests use every rule and nothing else."""
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        gpu_0, gpu_1 = deployed.pod_names("app.kubernetes.io/component=engine-gpu")
        redis_pod = deployed.pod_names("app.kubernetes.io/component=redis")[0]
        deployed.map_exec(gpu_0, {"LLMCHAOS_FAKE_GPU_URL": gpu_processes([sleeper.pid])})
        deployed.map_exec(redis_pod, {})
        deployed.wait_exec(gpu_0)
        deployed.wait_exec(redis_pod)
        backend = real_backend(redis_cli=("true",))
        backend.info()
        assert backend.kill_gpu_process(gpu_0)["pids"] == [sleeper.pid]  # exec
        assert sleeper.wait(10) == -signal.SIGKILL
        assert "deleted_pod" in backend.kill_gpu_process(gpu_1)  # no exec mapping: delete
        backend.partition_node("node-cpu-0")
        partition = {"node": "node-cpu-0", "direction": "both"}
        assert backend.verify("partition_node", partition).in_effect  # get the policy
        backend.heal_partition("node-cpu-0")
        gateway = deployed.pod_names("app.kubernetes.io/component=gateway")[0]
        backend.crash_gateway(gateway)
        backend.restore_gateway(gateway)
        backend.expire_token_cache(0)  # exec redis-cli (here `true`: no keys)
        backend.queue_depth()
        backend.healthy_workers()
        backend.replicas()  # the GPU Deployment and its HPA
        backend.pod_recovery_times("app.kubernetes.io/component=engine-gpu", 0)
        backend.drain_node("node-gpu-0")  # cordon + evictions
        backend.uncordon_node("node-gpu-0")
        deployed.apps.delete_namespaced_deployment("locust-worker", NS)  # deploy/'s, by hand
        workers = worker_deployment(DEPLOY / "70-locust.yaml")
        backend.start_load_workers(workers, 6000)  # load workers in the cluster
        backend.scale_load_workers("locust-worker", 2000)
        backend.stop_load_workers("locust-worker")
    finally:
        sleeper.kill()
        sleeper.wait()
    events = deployed.audit_events()
    assert [e for e in events if e["responseStatus"]["code"] == 403] == []
    assert {e["objectRef"].get("namespace") for e in events} <= {NS, None}
    used = {
        (
            e["objectRef"].get("apiGroup", ""),
            e["objectRef"]["resource"]
            + ("/" + e["objectRef"]["subresource"] if e["objectRef"].get("subresource") else ""),
            e["verb"],
        )
        for e in events
    }
    # exec is a WebSocket GET, authorized as get; create is kubectl's (POST) exec verb
    assert ("", "pods/exec", "get") in used
    used.add(("", "pods/exec", "create"))
    assert used == granted()
