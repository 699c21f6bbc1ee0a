"""Locust workers in the cluster (deploy/70-locust.yaml's worker Deployment), for rates beyond
what the runner's machine sends: created sized to the rate, scaled, deleted (the undo)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from llmchaos.configuration import plain
from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import Undo
from llmchaos.targets import LoadWorkersPlan
from llmchaos.targets.kubernetes.cluster import Cluster, http_status
from llmchaos.targets.kubernetes.settings import MANAGED_BY

__all__ = [
    "LOAD_WORKER_QPS",
    "LoadWorkers",
    "dialling",
    "load_workers_for",
    "worker_deployment",
]

log = logging.getLogger("llmchaos.targets.kubernetes")

LOAD_WORKER_QPS = 2500
"""What one Locust worker process sends open loop (llmchaos/load/README.md: ~2,500 QPS)."""


def load_workers_for(qps: float) -> int:
    """Locust worker replicas for `qps`: one per LOAD_WORKER_QPS, at least one."""
    if not isinstance(qps, int | float) or not math.isfinite(qps) or qps <= 0:
        raise InvalidInput(f"qps: expected a positive rate, got {qps!r}")
    return max(1, math.ceil(qps / LOAD_WORKER_QPS))


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


_MASTER_FLAGS = ("--master-host", "--master-port")


def dialling(deployment: Mapping[str, Any], master_address: str) -> dict[str, Any]:
    """A copy of the worker Deployment whose workers dial `master_address` (HOST:PORT): the
    manifest's --master-host/--master-port (deploy/70-locust.yaml: the in-cluster master's
    Service) give way to the run's own master."""
    host, _, port = master_address.rpartition(":")
    body: dict[str, Any] = json.loads(json.dumps(dict(deployment)))
    for container in body["spec"]["template"]["spec"]["containers"]:
        for key in ("command", "args"):
            items = container.get(key)
            if not items or "--worker" not in items:
                continue
            kept: list[str] = []
            skip_value = False
            for item in items:
                if skip_value:
                    skip_value = False
                elif item in _MASTER_FLAGS:
                    skip_value = True  # "--master-host HOST": the value goes too
                elif not item.startswith(tuple(f"{flag}=" for flag in _MASTER_FLAGS)):
                    kept.append(item)
            container[key] = [*kept, f"--master-host={host}", f"--master-port={port}"]
    return body


class LoadWorkers(Cluster):
    """The load worker Deployment of a run."""

    def plan_load_workers(self, qps: float) -> LoadWorkersPlan | None:
        """The workers this target runs for `qps` (see Target.plan_load_workers): the worker
        Deployment of `load_workers_manifest` when the rate is over `local_max_qps`, dialling
        this run's master at `load_master_address`."""
        manifest = self.settings.load_workers_manifest
        if manifest is None or qps <= self.settings.local_max_qps:
            return None
        master = self.settings.load_master_address
        if master is None:
            raise InvalidInput(
                f"load_master_address: not set; {plain(qps)} QPS is above local_max_qps "
                f"({plain(self.settings.local_max_qps)}), so the load workers of "
                f"{manifest} run in the cluster and must dial this run's Locust master: give "
                "HOST:PORT, this machine as the pods reach it"
            )
        name = str(worker_deployment(Path(manifest))["metadata"]["name"])
        return LoadWorkersPlan(
            name=name,
            undo=Undo("stop_load_workers", {"deployment": name}),
            replicas=load_workers_for(qps),
            master_address=master,
            join_timeout_s=self.settings.ready_timeout_s,
        )

    def run_load_workers(self, qps: float) -> dict[str, Any]:
        manifest = self.settings.load_workers_manifest
        if manifest is None:
            raise InvalidInput("load_workers_manifest: not set; no load workers to start")
        deployment = worker_deployment(Path(manifest))
        if self.settings.load_master_address is not None:
            deployment = dialling(deployment, self.settings.load_master_address)
        return self.start_load_workers(deployment, qps)

    def start_load_workers(self, deployment: Mapping[str, Any], qps: float) -> dict[str, Any]:
        """Create the Locust worker Deployment `deployment` (deploy/70-locust.yaml's
        `locust-worker`) in the namespace, sized to `qps`: one replica per LOAD_WORKER_QPS.
        Labelled as llmchaos's; one left by an earlier attempt is scaled instead.
        Returns {"deployment", "replicas"}; undo with stop_load_workers(deployment)."""
        name = str(deployment.get("metadata", {}).get("name") or "")
        if deployment.get("kind") != "Deployment" or not name:
            raise InvalidInput(
                "load workers: expected a Deployment with a name (deploy/70-locust.yaml's "
                f"locust-worker), got kind {deployment.get('kind')!r} named {name!r}"
            )
        replicas = load_workers_for(qps)
        body = json.loads(json.dumps(dict(deployment)))  # a copy to change
        metadata = body["metadata"]
        metadata["namespace"] = self.namespace
        metadata["labels"] = {**metadata.get("labels", {}), **MANAGED_BY}
        body["spec"]["replicas"] = replicas
        if self.settings.dry_run:
            return self._plan("start_load_workers", deployment=name, replicas=replicas)
        try:
            self._apps.create_namespaced_deployment(
                self.namespace, body, _request_timeout=self.settings.request_timeout_s
            )
        except ApiException as exc:
            if http_status(exc) != 409:
                raise self._error("create", f"deployment {self.namespace}/{name}", exc) from None
            self._own_load_workers(name)  # 409: there already: ours (a retry) is resized
            self.scale_load_workers(name, qps)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StackError(
                f"kubernetes: create deployment {self.namespace}/{name} failed: cannot reach "
                f"the API server at {self._api.configuration.host}: {exc}"
            ) from None
        log.info("load workers: deployment %s/%s, %d replica(s)", self.namespace, name, replicas)
        return {"deployment": name, "replicas": replicas}

    def scale_load_workers(self, deployment: str, qps: float) -> int:
        """Resize the load worker Deployment to `qps`; returns the replicas."""
        replicas = load_workers_for(qps)
        if self.settings.dry_run:
            self._plan("scale_load_workers", deployment=deployment, replicas=replicas)
            return replicas
        self._call(
            "scale",
            f"deployment {self.namespace}/{deployment} to {replicas}",
            self._apps.patch_namespaced_deployment,
            deployment,
            self.namespace,
            {"spec": {"replicas": replicas}},
            _content_type="application/merge-patch+json",
            missing=f"deployment: no load worker deployment {deployment!r} in {self.namespace}",
        )
        return replicas

    def stop_load_workers(self, deployment: str) -> None:
        """Delete the load worker Deployment (its pods go with it), when llmchaos made it.
        Idempotent: one already gone is nothing to undo."""
        if self.settings.dry_run:
            self._plan("stop_load_workers", deployment=deployment)
            return
        if self._own_load_workers(deployment, missing_ok=True) is None:
            return
        self._call(
            "delete",
            f"deployment {self.namespace}/{deployment}",
            self._apps.delete_namespaced_deployment,
            deployment,
            self.namespace,
            propagation_policy="Background",
            missing_ok=True,
        )

    def _own_load_workers(self, deployment: str, missing_ok: bool = False) -> Any:
        """The Deployment, when it carries llmchaos's label; None when gone (missing_ok).
        Raises StackError for one llmchaos did not create: it is never resized or deleted."""
        found = self._call(
            "read",
            f"deployment {self.namespace}/{deployment}",
            self._apps.read_namespaced_deployment,
            deployment,
            self.namespace,
            missing=f"deployment: no load worker deployment {deployment!r} in {self.namespace}",
            missing_ok=missing_ok,
        )
        if found is None:
            return None
        labels = found.metadata.labels or {}
        if not MANAGED_BY.items() <= labels.items():
            raise StackError(
                f"kubernetes: deployment {self.namespace}/{deployment} exists and was not made "
                f"by llmchaos (no label app.kubernetes.io/managed-by=llmchaos): it is left as "
                f"is; delete it, or leave load_workers_manifest unset to use it as it is"
            )
        return found
