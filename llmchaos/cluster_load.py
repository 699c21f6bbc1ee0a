"""Locust workers in the cluster, for rates beyond what this machine sends.

When the target is Kubernetes, `load_workers_manifest` is set and the experiment's rate is
above `local_max_qps`, the Locust worker Deployment of that file (deploy/70-locust.yaml's
`locust-worker`) is created in the stack's namespace through the API, sized to the rate (one
replica per 2,500 QPS). It is recorded in the run's fault ledger before it is created, with
`stop_load_workers` as its undo, so the run's end, a rollback or `llmchaos cleanup` after a
kill -9 deletes it like any open fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from llmchaos.backends.kubernetes import KubernetesBackend
from llmchaos.errors import InvalidInput
from llmchaos.ledger import Undo
from llmchaos.run import ChaosRun

__all__ = ["FAULT", "start_cluster_load", "worker_deployment"]

FAULT = "cluster_load"
"""The ledger's name for the load workers: its target is the Deployment's name."""


def worker_deployment(manifest: Path) -> dict[str, Any]:
    """The Locust worker Deployment of `manifest` (the one Deployment whose pods run
    `--worker`). InvalidInput names the file and what it holds instead."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(manifest).read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"load_workers_manifest: cannot read {manifest}: {exc}") from None
    workers = [
        doc
        for doc in docs
        if isinstance(doc, dict)
        and doc.get("kind") == "Deployment"
        and any(
            "--worker" in (c.get("command") or []) + (c.get("args") or [])
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        )
    ]
    if len(workers) != 1:
        found = [f"{d.get('kind')}/{d.get('metadata', {}).get('name')}" for d in docs]
        raise InvalidInput(
            f"load_workers_manifest: {manifest} must hold exactly one Deployment of Locust "
            f"workers (a container running --worker), found {len(workers)} among {found}"
        )
    return workers[0]


def start_cluster_load(run: ChaosRun, qps: float) -> dict[str, Any] | None:
    """Create the load workers in the cluster when the run needs them (see the module);
    returns {"deployment", "replicas"}, or None when this machine sends the whole rate."""
    backend = run.target
    if not isinstance(backend, KubernetesBackend):
        return None
    settings = backend.settings
    if settings.load_workers_manifest is None or qps <= settings.local_max_qps:
        return None
    deployment = worker_deployment(Path(settings.load_workers_manifest))
    name = deployment["metadata"]["name"]
    with run.fault(FAULT, name, Undo("stop_load_workers", {"deployment": name})) as details:
        details.update(backend.start_load_workers(deployment, qps))
    return dict(details)
