"""The catalogue's experiment files run against Kubernetes by configuration only, here a real
API server with deploy/ on fake GPU nodes (tests/k8s/controlplane.py).

`chaos run` with LLMCHAOS_TARGET=k8s: the control checks the experiment against what the
cluster runs, the names of the embedded stack (`primary`, `gpu-0`, `node-a`) map to its pods
and nodes, faults go through the Kubernetes backend as deploy/10-rbac.yaml's service account,
rollbacks and the ledger undo them. An embedded stack serves the traffic behind the fake pods:
each fake GPU pod's exec is mapped (kwok's Exec) to the embedded GPU worker of the same alias,
so nvidia-smi in the pod lists that worker's process and kill -9 in the pod kills it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaoslib.configuration import load_configuration

from conftest import REPO, StackFactory, chaos_run
from llmchaos.faults import drain_node, kill_gpu_process, partition_node
from llmchaos.run import ChaosRun, finish_dead_runs, planned_target
from llmchaos.settings import RunSettings
from llmchaos.stack.topology import Topology, read_agent_state
from llmchaos.targets.kubernetes import KubernetesTarget
from llmchaos.validation import check_experiment, other_configuration_keys
from tests.k8s.controlplane import NAMESPACE as NS
from tests.k8s.controlplane import DeployedStack

pytestmark = pytest.mark.slow
GPU = "app.kubernetes.io/component=engine-gpu"


def _k8s_env(kubeconfig: Path) -> dict[str, str]:
    return {
        "LLMCHAOS_TARGET": "k8s",
        "LLMCHAOS_K8S_NAMESPACE": NS,
        "LLMCHAOS_K8S_ALLOWED_NAMESPACES": NS,
        "LLMCHAOS_K8S_KUBECONFIG": str(kubeconfig),
        "LLMCHAOS_K8S_REQUEST_TIMEOUT_S": "5",
        "LLMCHAOS_K8S_READY_TIMEOUT_S": "30",
        "LLMCHAOS_K8S_POLL_INTERVAL_S": "0.2",
    }


def _run_env(deployed: DeployedStack, stack: Topology, tmp_path: Path, qps: int) -> dict[str, str]:
    """chaos run's environment: the cluster, and the embedded stack's gateway for traffic."""
    return {
        **_k8s_env(deployed.backend_kubeconfig),
        "LLMCHAOS_K8S_GATEWAY_URL": stack.gateway_url,
        "LLMCHAOS_K8S_TOKENS_FILE": stack.tokens_file,
        "LLMCHAOS_QPS": str(qps),
        "LLMCHAOS_WARMUP_S": "4",
        "LLMCHAOS_RUNS_ROOT": str(tmp_path / "runs"),
    }


def _back_gpu_pods_with(deployed: DeployedStack, stack: Topology) -> dict[str, str]:
    """Map exec of the i-th GPU pod (by name, as the alias gpu-<i>) to the embedded worker
    gpu-<i>: {pod: worker}."""
    pods = deployed.pod_names(GPU)
    mapping = {pod: f"gpu-{i}" for i, pod in enumerate(pods)}
    for pod, worker in mapping.items():
        deployed.map_exec(pod, {"LLMCHAOS_FAKE_GPU_URL": stack.worker(worker).url})
    for pod in pods:
        deployed.wait_exec(pod)
    return mapping


def test_the_catalogues_names_map_to_the_clusters(deployed: DeployedStack) -> None:
    settings = RunSettings.from_configuration({}, _k8s_env(deployed.backend_kubeconfig))
    info = planned_target(settings)
    gpu_pods = deployed.pod_names(GPU)
    assert info.gpu_workers(worker="gpu-0") == gpu_pods[:1]
    node_b = deployed.core.read_namespaced_pod(gpu_pods[1], NS).spec.node_name
    assert info.node_name("node-b") == node_b  # the node of gpu-1
    assert info.gpu_workers(node="node-b") == gpu_pods[1:]
    assert info.node_name("node-cpu-0") == "node-cpu-0"  # a real name stays itself
    assert info.gateway_names("primary") == [info.gateways[0]]
    for name in ("gpu_kill", "node_partition", "gateway_crash", "gpu_kill_all"):
        experiment = json.loads((REPO / "experiments" / f"{name}.json").read_text())
        configuration = load_configuration(experiment["configuration"])
        env = _k8s_env(deployed.backend_kubeconfig)
        settings = RunSettings.from_configuration(
            configuration, env, other_keys=other_configuration_keys(experiment)
        )
        assert check_experiment(experiment, configuration, info, settings) == [], name


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_faults_go_through_the_cluster_and_a_dead_runs_are_undone_by_cleanup(
    deployed: DeployedStack, tmp_path: Path, stack_factory: StackFactory
) -> None:
    stack = stack_factory(netns="off")
    mapping = _back_gpu_pods_with(deployed, stack)
    settings = RunSettings.from_configuration(
        {"runs_root": str(tmp_path / "runs")}, _k8s_env(deployed.backend_kubeconfig)
    )
    run = ChaosRun.open(settings, "k8s", "faults on a cluster")
    try:
        run.start_target()
        state_path = Path(stack.node(stack.worker("gpu-0").node).agent_state_path)
        before = read_agent_state(state_path)
        assert before is not None
        (killed,) = kill_gpu_process(run, worker="gpu-0")
        assert mapping[killed["pod"]] == "gpu-0"
        assert killed["pid"] == before.workers["gpu-0"].pid  # the embedded worker's process
        backend = run.target
        assert isinstance(backend, KubernetesTarget)
        node_b = backend.info().aliases["node-b"]  # the node of gpu-1
        assert partition_node(run, "node-b") == node_b
        assert k8s_policies(deployed) == [f"llmchaos-partition-{node_b}"]
        drained = drain_node(run, "node-b")
        assert drained["node"] == node_b and not drained["was_unschedulable"]
        assert deployed.core.read_node(node_b).spec.unschedulable
        # the owner dies with the partition and the drain in place: cleanup undoes both
        # through the cluster
        data = json.loads((run.run_dir / "run.json").read_text())
        data["pid"], data["pid_start_ticks"] = 999_999, -1
        (run.run_dir / "run.json").write_text(json.dumps(data))
        lines = finish_dead_runs(tmp_path / "runs")
        assert any(f"partition_node({node_b}): undone by cleanup" in line for line in lines), lines
        assert any(f"drain_node({node_b}): undone by cleanup" in line for line in lines), lines
        assert not run.ledger.open_faults()
        assert k8s_policies(deployed) == []
        assert not deployed.core.read_node(node_b).spec.unschedulable
    finally:
        run.stop_target()
        run.close("finished")


def k8s_policies(deployed: DeployedStack) -> list[str]:
    from kubernetes import client as k8s

    items = k8s.NetworkingV1Api(deployed.api).list_namespaced_network_policy(NS).items
    return [p.metadata.name for p in items]


def test_chaos_run_gateway_crash_on_k8s_by_configuration_only(
    deployed: DeployedStack, tmp_path: Path, stack_factory: StackFactory
) -> None:
    stack = stack_factory(netns="off")  # the service the traffic goes to
    gateways = deployed.pod_names("app.kubernetes.io/component=gateway")
    env = _run_env(deployed, stack, tmp_path, qps=20)
    experiment = REPO / "experiments" / "gateway_crash.json"
    done = chaos_run(experiment, tmp_path / "journal.json", env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (summary_path,) = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["target"] == "k8s" and summary["verdict"] == "pass"
    assert summary["qps_run"] == 20  # no embedded cap on a cluster
    (fault,) = summary["faults"]
    assert fault["fault"] == "crash_gateway" and fault["state"] == "undone"
    assert fault["details"]["deleted_pod"] == fault["target"] == gateways[0]
    # the Deployment replaced it and the rollback waited for the replacement
    after = deployed.pod_names("app.kubernetes.io/component=gateway")
    assert gateways[0] not in after and len(after) == 2 and deployed.available()


@pytest.mark.parametrize(
    ("variant", "verdict", "exit_code"),
    [("hardened", "pass", 0), ("no-failover", "fail", 1)],
)
def test_chaos_run_gpu_kill_on_k8s_end_to_end(
    deployed: DeployedStack,
    tmp_path: Path,
    stack_factory: StackFactory,
    variant: str,
    verdict: str,
    exit_code: int,
) -> None:
    """`chaos run experiments/gpu_kill.json` against the real API server: the action execs
    nvidia-smi in the fake GPU pod of gpu-0 (kwok runs the stand-in, which lists the
    embedded worker gpu-0's process), then kill -9 there; the embedded stack's agent restarts
    it like a kubelet, and the traffic tells whether the service kept its SLO. The known-bad
    variant (no failover in the gateways) must fail the same experiment."""
    # A killed GPU worker takes longer to come back than the SLA (10 s): only failover in the
    # gateways keeps the service inside it.
    stack = stack_factory(netns="off", variant=variant, gpu_load_s=12.0, first_load_s=1.5)
    mapping = _back_gpu_pods_with(deployed, stack)
    state_path = Path(stack.node(stack.worker("gpu-0").node).agent_state_path)
    before = read_agent_state(state_path)
    assert before is not None
    env = _run_env(deployed, stack, tmp_path, qps=40)
    done = chaos_run(REPO / "experiments" / "gpu_kill.json", tmp_path / "journal.json", env=env)
    output = done.stdout + done.stderr
    assert done.returncode == exit_code, output[-4000:]
    (summary_path,) = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["target"] == "k8s" and summary["verdict"] == verdict, summary
    (fault,) = summary["faults"]
    assert fault["fault"] == "kill_gpu_process"
    (killed,) = fault["details"]["killed"]
    assert mapping[killed["pod"]] == "gpu-0" and "deleted_pod" not in killed
    assert killed["pids"] == [before.workers["gpu-0"].pid]  # killed through exec
    pod = killed["pod"]
    after = read_agent_state(state_path)
    assert after is not None and after.workers["gpu-0"].restarts == 1
    assert after.workers["gpu-0"].last_exit_code == -9
    assert pod in deployed.pod_names(GPU)  # the pod stays: only its process died


def test_an_unreachable_cluster_stops_chaos_run_before_anything(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig.json"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    env = {
        **_k8s_env(kubeconfig),
        "LLMCHAOS_K8S_REQUEST_TIMEOUT_S": "2",
        "LLMCHAOS_RUNS_ROOT": str(tmp_path / "runs"),
    }
    experiment = REPO / "experiments" / "gpu_kill.json"
    done = chaos_run(experiment, tmp_path / "journal.json", env=env, timeout_s=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert "llmchaos:" in output and "127.0.0.1:9" in output, output[-3000:]
    assert json.loads((tmp_path / "journal.json").read_text())["run"] == []
    assert not (tmp_path / "runs").exists()
