"""Locust workers in the cluster (ChaosRun.start_cluster_load, KubernetesTarget.*_load_workers) on
the real control plane: the Deployment of deploy/70-locust.yaml created through the API, sized
to the rate, scaled, deleted; recorded in the ledger, so a run killed with kill -9 leaves
nothing once `llmchaos cleanup` (finish_dead_runs) has run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from llmchaos.errors import InvalidInput, StackError
from llmchaos.load import LoadConfig, LoadRun
from llmchaos.run import ChaosRun, finish_dead_runs
from llmchaos.settings import RunSettings
from llmchaos.targets.kubernetes import KubernetesTarget, worker_deployment
from tests.k8s.controlplane import DEPLOY, DeployedStack
from tests.k8s.controlplane import NAMESPACE as NS

pytestmark = pytest.mark.slow
Make = Callable[..., KubernetesTarget]
MANIFEST = DEPLOY / "70-locust.yaml"
WORKERS = "app.kubernetes.io/component=load-worker"


def _remove_the_applied_workers(deployed: DeployedStack) -> None:
    """`deployed` applied deploy/ whole, locust-worker included: this test makes its own."""
    deployed.apps.delete_namespaced_deployment("locust-worker", NS)
    deployed.wait(lambda: not deployed.pod_names(WORKERS), 20, "the applied workers gone")


def _workers_running(deployed: DeployedStack, replicas: int) -> bool:
    ready = [
        p
        for p in deployed.pods(WORKERS)
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]
    return len(ready) == replicas == len(deployed.pods(WORKERS))


def test_load_workers_are_sized_scaled_and_deleted(
    deployed: DeployedStack, real_backend: Make
) -> None:
    backend = real_backend()
    deployment = worker_deployment(MANIFEST)
    # deploy/'s own locust-worker (applied by hand, not by llmchaos) is never touched
    with pytest.raises(StackError, match="exists and was not made by llmchaos"):
        backend.start_load_workers(deployment, 12_000)
    with pytest.raises(StackError, match="exists and was not made by llmchaos"):
        backend.stop_load_workers("locust-worker")
    _remove_the_applied_workers(deployed)

    assert backend.start_load_workers(deployment, 12_000) == {
        "deployment": "locust-worker",
        "replicas": 5,  # 12,000 QPS at 2,500 per worker
    }
    made = deployed.apps.read_namespaced_deployment("locust-worker", NS)
    assert made.metadata.labels["app.kubernetes.io/managed-by"] == "llmchaos"
    deployed.wait(lambda: _workers_running(deployed, 5), 30, "5 worker pods Ready")
    assert backend.scale_load_workers("locust-worker", 3_000) == 2
    deployed.wait(lambda: _workers_running(deployed, 2), 30, "2 worker pods")
    # a retry of the start resizes what is there
    assert backend.start_load_workers(deployment, 7_000)["replicas"] == 3
    deployed.wait(lambda: _workers_running(deployed, 3), 30, "3 worker pods")
    backend.stop_load_workers("locust-worker")
    deployed.wait(lambda: not deployed.pod_names(WORKERS), 30, "workers deleted with their pods")
    backend.stop_load_workers("locust-worker")  # idempotent
    with pytest.raises(InvalidInput, match="qps: expected a positive rate"):
        backend.start_load_workers(deployment, 0)


def test_the_manifest_must_hold_one_worker_deployment(tmp_path: Path) -> None:
    assert worker_deployment(MANIFEST)["metadata"]["name"] == "locust-worker"
    other = tmp_path / "no-workers.yaml"
    other.write_text((DEPLOY / "20-redis.yaml").read_text())
    with pytest.raises(InvalidInput, match=r"no-workers.yaml must hold exactly one Deployment"):
        worker_deployment(other)
    with pytest.raises(InvalidInput, match="cannot read"):
        worker_deployment(tmp_path / "missing.yaml")


OWNER = """
import os, sys, time
from llmchaos.run import ChaosRun
from llmchaos.settings import RunSettings
settings = RunSettings.from_configuration({"runs_root": sys.argv[1]}, dict(os.environ))
run = ChaosRun.open(settings, "cluster_load", "load workers in the cluster")
run.start_target()
print(run.start_cluster_load(float(sys.argv[2])), flush=True)
time.sleep(600)
"""


def _env(deployed: DeployedStack) -> dict[str, str]:
    return {
        "LLMCHAOS_TARGET": "k8s",
        "LLMCHAOS_K8S_NAMESPACE": NS,
        "LLMCHAOS_K8S_ALLOWED_NAMESPACES": NS,
        "LLMCHAOS_K8S_KUBECONFIG": str(deployed.backend_kubeconfig),
        "LLMCHAOS_K8S_LOAD_WORKERS_MANIFEST": str(MANIFEST),
        "LLMCHAOS_K8S_LOAD_MASTER_ADDRESS": "127.0.0.1:5557",
        "LLMCHAOS_K8S_REQUEST_TIMEOUT_S": "5",
    }


def test_a_killed_runs_load_workers_are_deleted_by_cleanup(
    deployed: DeployedStack, tmp_path: Path
) -> None:
    """The run's owner creates the workers for 7,000 QPS (above this machine's 5,000), then
    dies of kill -9: the ledger names the Deployment, cleanup deletes it."""
    _remove_the_applied_workers(deployed)
    runs = tmp_path / "runs"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(runs), "7000"],
        env={**os.environ, **_env(deployed)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip() == str({"deployment": "locust-worker", "replicas": 3}), (
            line + owner.stderr.read() if owner.poll() is not None else line
        )
        deployed.wait(lambda: _workers_running(deployed, 3), 30, "3 worker pods")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    (ledger,) = runs.glob("*/ledger.jsonl")
    assert '"cluster_load"' in ledger.read_text()
    lines = finish_dead_runs(runs)
    assert any("cluster_load(locust-worker): undone by cleanup" in line for line in lines), lines
    deployed.wait(lambda: not deployed.pod_names(WORKERS), 30, "workers deleted")
    assert "locust-worker" not in [
        d.metadata.name for d in deployed.apps.list_namespaced_deployment(NS).items
    ]


def test_no_workers_in_the_cluster_when_this_machine_sends_the_rate(
    deployed: DeployedStack, tmp_path: Path
) -> None:
    env = _env(deployed)
    settings = RunSettings.from_configuration({"runs_root": str(tmp_path / "runs")}, env)
    run = ChaosRun.open(settings, "cluster_load", "below the local rate")
    try:
        run.start_target()
        assert run.start_cluster_load(5_000) is None
        assert run.ledger.entries() == []
        target = run.target
        addressed = target.settings  # type: ignore[attr-defined]
        target.settings = replace(addressed, load_master_address=None)  # type: ignore[attr-defined]
        with pytest.raises(InvalidInput, match="load_master_address: not set; 7,000 QPS"):
            run.start_cluster_load(7_000)
        target.settings = addressed  # type: ignore[attr-defined]
        assert run.ledger.entries() == []
        assert json.loads((run.run_dir / "run.json").read_text())["pid"] == os.getpid()
    finally:
        run.stop_target()
        run.close("finished")


def test_a_run_beyond_this_machine_loads_through_the_clusters_workers(
    deployed: DeployedStack, tmp_path: Path
) -> None:
    """7,000 QPS, above this machine's 5,000: the run's Locust master listens for 3 workers
    and sends nothing itself; the worker Deployment is created (in the ledger first) dialling
    that master, the manifest's in-cluster master replaced. KWOK's pods run nothing, so none
    joins: after the join timeout the whole plan is lost_worker, counted, not silently gone.
    The run's end deletes the Deployment."""
    _remove_the_applied_workers(deployed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **_env(deployed),
        "LLMCHAOS_K8S_LOAD_MASTER_ADDRESS": f"127.0.0.1:{port}",
        "LLMCHAOS_K8S_READY_TIMEOUT_S": "3",
        "LLMCHAOS_QPS": "7000",
    }
    settings = RunSettings.from_configuration({"runs_root": str(tmp_path / "runs")}, env)
    run = ChaosRun.open(settings, "cluster_load", "load from the cluster's workers")
    configs: list[LoadConfig] = []

    def start(config: LoadConfig) -> LoadRun:  # 2 s of it, against no real gateway
        configs.append(config)
        return LoadRun.start(replace(config, duration_s=2.0, check_target=False))

    run.load_factory = start  # type: ignore[misc]
    try:
        run.start_target()
        run.start_load()
        (config,) = configs
        assert (config.workers, config.remote_workers, config.master_port) == (0, 3, port)
        made = deployed.apps.read_namespaced_deployment("locust-worker", NS)
        command = made.spec.template.spec.containers[0].command
        assert made.spec.replicas == 3
        assert command[-2:] == ["--master-host=127.0.0.1", f"--master-port={port}"], command
        assert "--master-host=locust-master" not in command
        assert '"cluster_load"' in (run.run_dir / "ledger.jsonl").read_text()
        summary = run.traffic.wait(timeout_s=60.0)
        assert summary.accounting_closed and summary.ok == 0
        assert summary.lost_worker == summary.scheduled > 10_000, summary
        run.undo_faults(by="control")
        deployed.wait(
            lambda: (
                "locust-worker"
                not in [d.metadata.name for d in deployed.apps.list_namespaced_deployment(NS).items]
            ),
            30,
            "the run's workers deleted",
        )
    finally:
        run.stop_load()
        run.stop_target()
        run.close("finished")
