"""The catalogue's experiment files run against Kubernetes by configuration only.

`chaos run experiments/gateway_crash.json` with LLMCHAOS_TARGET=k8s: the control checks the
experiment against what the (emulated) cluster runs, the names of the embedded stack
(`primary`, `gpu-0`, `node-a`) map to its pods and nodes, faults go through the Kubernetes
backend, and rollbacks and the ledger undo them. kmock stands in for the API server; an
embedded stack stands in for the service the traffic goes to (a real cluster has both in one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaoslib.configuration import load_configuration

from conftest import REPO, StackFactory, chaos_run
from llmchaos.backends.kubernetes import KubernetesBackend
from llmchaos.faults import kill_gpu_process, partition_node
from llmchaos.run import ChaosRun, finish_dead_runs, planned_target
from llmchaos.settings import RunSettings
from llmchaos.validation import check_experiment
from tests.k8s.conftest import NS, Emulator, ExecResult

pytestmark = pytest.mark.slow


def _k8s_env(kubeconfig: Path) -> dict[str, str]:
    return {
        "LLMCHAOS_TARGET": "k8s",
        "LLMCHAOS_K8S_NAMESPACE": NS,
        "LLMCHAOS_K8S_ALLOWED_NAMESPACES": NS,
        "LLMCHAOS_K8S_KUBECONFIG": str(kubeconfig),
        "LLMCHAOS_K8S_REQUEST_TIMEOUT_S": "5",
        "LLMCHAOS_K8S_READY_TIMEOUT_S": "10",
        "LLMCHAOS_K8S_POLL_INTERVAL_S": "0.2",
    }


def test_the_catalogues_names_map_to_the_clusters(cluster: object, kubeconfig: Path) -> None:
    settings = RunSettings.from_configuration({}, _k8s_env(kubeconfig))
    info = planned_target(settings)
    assert info.gpu_workers(worker="gpu-0") == ["vllm-gpu-a"]
    assert info.gpu_workers(node="node-b") == ["vllm-gpu-b"]
    assert info.node_name("node-a") == "node-a"  # a real name stays itself
    assert info.gateway_names("primary") == [info.gateways[0]]
    for name in ("gpu_kill", "node_partition", "gateway_crash", "gpu_kill_all"):
        experiment = json.loads((REPO / "experiments" / f"{name}.json").read_text())
        configuration = load_configuration(experiment["configuration"])
        assert check_experiment(experiment, configuration, info, settings) == [], name


def test_faults_go_through_the_cluster_and_a_dead_runs_are_undone_by_cleanup(
    emulator: Emulator, cluster: object, kubeconfig: Path, tmp_path: Path
) -> None:
    emulator.exec_answers["vllm-gpu-a"] = lambda cmd: ExecResult(
        stdout="4242\n" if cmd[0] == "nvidia-smi" else ""
    )
    settings = RunSettings.from_configuration(
        {"runs_root": str(tmp_path / "runs")}, _k8s_env(kubeconfig)
    )
    run = ChaosRun.open(settings, "k8s", "faults on a cluster")
    try:
        run.start_target()
        (killed,) = kill_gpu_process(run, worker="gpu-0")
        assert killed["pod"] == "vllm-gpu-a" and killed["pid"] == 4242
        assert partition_node(run, "node-b") == "node-b"
        backend = run.target
        assert isinstance(backend, KubernetesBackend)
        policies = [m for m, p in emulator.requests if "networkpolicies" in p and m == "POST"]
        assert policies, emulator.requests
        # the owner dies with the partition in place: cleanup undoes it through the cluster
        data = json.loads((run.run_dir / "run.json").read_text())
        data["pid"], data["pid_start_ticks"] = 999_999, -1
        (run.run_dir / "run.json").write_text(json.dumps(data))
        lines = finish_dead_runs(tmp_path / "runs").lines
        assert any("partition_node(node-b): undone by cleanup" in line for line in lines), lines
        assert not run.ledger.open_faults()
        deletes = [p for m, p in emulator.requests if m == "DELETE" and "networkpolicies" in p]
        assert deletes, "heal_partition deleted the NetworkPolicy"
    finally:
        run.stop_target()
        run.close("finished")


def test_chaos_run_gateway_crash_on_k8s_by_configuration_only(
    emulator: Emulator,
    cluster: object,
    kubeconfig: Path,
    tmp_path: Path,
    stack_factory: StackFactory,
) -> None:
    stack = stack_factory(netns="off")  # the service the traffic goes to
    env = {
        **_k8s_env(kubeconfig),
        "LLMCHAOS_K8S_GATEWAY_URL": stack.gateway_url,
        "LLMCHAOS_K8S_TOKENS_FILE": stack.tokens_file,
        "LLMCHAOS_QPS": "20",
        "LLMCHAOS_WARMUP_S": "4",
        "LLMCHAOS_RUNS_ROOT": str(tmp_path / "runs"),
    }
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
    assert fault["details"]["deleted_pod"] == fault["target"]
    deleted = [p for m, p in emulator.requests if m == "DELETE" and "/pods/" in p]
    assert any(p.endswith("/" + fault["target"]) for p in deleted), deleted


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
    assert done.returncode == 1, output[-3000:]
    assert "llmchaos:" in output and "127.0.0.1:9" in output, output[-3000:]
    assert json.loads((tmp_path / "journal.json").read_text())["run"] == []
    assert not (tmp_path / "runs").exists()
