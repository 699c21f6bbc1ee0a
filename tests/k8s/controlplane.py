"""A real Kubernetes control plane for the tests, as processes of the test run.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler of one Kubernetes release,
and kwok, which plays the kubelets: it makes fake nodes Ready, moves pods scheduled on them
through their lifecycle (tests/k8s/kwok/stages.yaml) and runs exec into a pod as a local
command (its Exec resources). scripts/build-k8s.sh builds them (`make k8s-bin`).

Started by hand rather than with `kwokctl --runtime binary`: every process is a child of the
test run with PR_SET_PDEATHSIG, so none outlives it even after a kill -9 of pytest; nothing
is downloaded; every file (certificates, etcd data, logs) is under the run's folder, and the
flags the tests depend on (RBAC on, the controllers started, where "the kubelet" listens)
are written here where a reader sees them.

Authentication: a static token for the test's admin (group system:masters, also used by the
controllers, the scheduler and kwok) and service-account tokens (TokenRequest) for the
identities whose RBAC is under test.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

REPO = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO / "scripts" / "k8s" / "versions.env"
KWOK_DIR = Path(__file__).resolve().parent / "kwok"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
CONTROLLERS = "deployment,replicaset,disruption,garbagecollector,namespace,serviceaccount,podgc"
"""The controllers the backend's faults meet: Deployments/ReplicaSets recreate deleted pods,
disruption keeps PodDisruptionBudget status (evictions need it), garbage collection and the
namespace controller delete what the tests delete, serviceaccount makes `default` (pods need
it). Off: node lifecycle (no kubelet heartbeats to judge), HPA (no metrics API), endpoints."""
POD_READY_DELAY_S = 2.0
"""How long kwok takes to make a bound pod Ready (stages.yaml, durationMilliseconds)."""
_PR_SET_PDEATHSIG = 1


def versions() -> dict[str, str]:
    """KEY=value pairs of scripts/k8s/versions.env (what build-k8s.sh builds)."""
    pairs = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def bin_dir() -> Path:
    """Where build-k8s.sh puts the binaries: $LLMCHAOS_K8S_DIR/bin, else
    ~/.cache/llmchaos/k8s/<Kubernetes version>/bin."""
    configured = os.environ.get("LLMCHAOS_K8S_DIR")
    if configured:
        return Path(configured) / "bin"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "llmchaos" / "k8s" / versions()["KUBERNETES_VERSION"] / "bin"


def missing_binaries() -> list[str]:
    """Binaries of BINARIES not (executable) in bin_dir()."""
    folder = bin_dir()
    return [name for name in BINARIES if not os.access(folder / name, os.X_OK)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test run dies, however it dies. Only a C
    call (libc loaded beforehand), so it is safe between fork and exec."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass
class ControlPlane:
    """One control plane in `root` (a folder of the test run); start() then stop()."""

    root: Path
    binaries: Path = field(default_factory=bin_dir)
    api_url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    kwok_port: int = 0
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        """The API server's record of every request made as a service account
        (kwok/audit-policy.yaml), one JSON event per line."""
        return self.root / "audit.log"

    def audit_offset(self) -> int:
        """The audit log's size now: audit_events(since=) reads what comes after."""
        try:
            return self.audit_log.stat().st_size
        except FileNotFoundError:
            return 0

    def audit_events(self, user: str, since: int = 0) -> list[dict[str, Any]]:
        """Audit events (ResponseComplete) of requests by `user` from byte `since`, in order."""
        try:
            with self.audit_log.open("rb") as log:
                log.seek(since)
                lines = log.read().decode().splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if e.get("user", {}).get("username") == user]

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        """Start every component and wait until the API server is ready and kwok serves.

        Raises RuntimeError naming the component and the end of its log when one exits or
        does not come up in time; what was started is stopped by stop() (call it anyway).
        """
        deadline = time.monotonic() + timeout_s
        for folder in (self.root, self.pki, self.root / "logs", self.root / "home"):
            folder.mkdir(parents=True, exist_ok=True)
        self._write_pki()
        etcd_port, peer_port = _free_port(), _free_port()
        api_port, self.kwok_port = _free_port(), _free_port()
        self.api_url = f"https://127.0.0.1:{api_port}"
        tokens = f"{self.admin_token},llmchaos-admin,1,system:masters\n"
        (self.root / "tokens.csv").write_text(tokens)
        self.write_kubeconfig(self.admin_kubeconfig, self.admin_token, "llmchaos-admin")
        self._spawn(
            "etcd",
            "--name=llmchaos",
            f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=llmchaos=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",  # a test cluster: no fsync is worth the CPU and the wait
            "--log-level=warn",
        )
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--tls-cert-file={self.pki / 'serving.crt'}",
            f"--tls-private-key-file={self.pki / 'serving.key'}",
            f"--token-auth-file={self.root / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={self.pki / 'sa.pub'}",
            f"--service-account-signing-key-file={self.pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",  # no Endpoints for a loopback address
            # It taints new nodes not-ready until the node lifecycle controller (off, see
            # CONTROLLERS) sees a heartbeat; kwok's nodes are Ready from the start.
            "--disable-admission-plugins=TaintNodesByCondition",
            # "The kubelet" is kwok's server, at the nodes' only address (stages.yaml).
            "--kubelet-preferred-address-types=InternalIP",
            f"--audit-policy-file={KWOK_DIR / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
            "--profiling=false",
        )
        self._wait("kube-apiserver", deadline, self._api_ready)
        common = (f"--kubeconfig={self.admin_kubeconfig}", "--leader-elect=false")
        self._spawn(
            "kube-controller-manager",
            *common,
            f"--controllers={CONTROLLERS}",
            "--secure-port=0",
            "--use-service-account-credentials=false",
        )
        self._spawn("kube-scheduler", *common, "--secure-port=0")
        self.apply_file(KWOK_DIR / "exec-crd.yaml")
        self._wait("Exec CRD", deadline, self._exec_crd_served)
        self._spawn(
            "kwok",
            f"--kubeconfig={self.admin_kubeconfig}",
            f"--config={KWOK_DIR / 'stages.yaml'}",
            "--manage-all-nodes=true",
            "--enable-crds=Exec",
            "--node-ip=127.0.0.1",
            f"--node-port={self.kwok_port}",
            f"--server-address=127.0.0.1:{self.kwok_port}",
            f"--tls-cert-file={self.pki / 'serving.crt'}",
            f"--tls-private-key-file={self.pki / 'serving.key'}",
            "--node-lease-duration-seconds=0",
            # exec'd commands are looked up in kwok's PATH: the nvidia-smi stand-in first
            env={"PATH": f"{KWOK_DIR / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
        )
        self._wait("kwok", deadline, self._kwok_serving)

    def stop(self) -> None:
        """SIGTERM every component (the last started first), SIGKILL what is left after 10 s.
        Safe to call twice and after a failed start."""
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        self.processes.clear()

    def running(self) -> list[str]:
        """Components whose process is alive."""
        return [name for name, p in self.processes.items() if p.poll() is None]

    # -- clients -------------------------------------------------------------------------
    def write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        """A kubeconfig for this cluster authenticating with a bearer token."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "llmchaos-test",
                            "cluster": {
                                "server": self.api_url,
                                "certificate-authority": str(self.ca_file),
                            },
                        }
                    ],
                    "users": [{"name": user, "user": {"token": token}}],
                    "contexts": [
                        {"name": user, "context": {"cluster": "llmchaos-test", "user": user}}
                    ],
                    "current-context": user,
                }
            )
        )
        return path

    def admin_client(self) -> k8s.ApiClient:
        return k8s_config.new_client_from_config(
            config_file=str(self.admin_kubeconfig), persist_config=False
        )

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig acting as ServiceAccount namespace/name (a TokenRequest token)."""
        api = self.admin_client()
        try:
            answer = k8s.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, {"spec": {"expirationSeconds": 3600}}
            )
        finally:
            api.close()
        return self.write_kubeconfig(path, answer.status.token, f"{namespace}-{name}")

    def apply_file(self, path: Path) -> None:
        """Create every object of a YAML file (several documents) as admin."""
        import yaml

        self.create([d for d in yaml.safe_load_all(path.read_text()) if d])

    def dynamic_client(self, api: Any) -> Any:
        """A kubernetes DynamicClient over `api`, caching API discovery in this control
        plane's folder (by default a file in /tmp, which the tests must not leave behind)."""
        from kubernetes.dynamic import DynamicClient

        return DynamicClient(api, cache_file=str(self.root / "discovery-cache.json"))

    def create(self, docs: list[dict[str, Any]]) -> None:
        """Create objects of any kind as admin, in order (the server validates each)."""
        api = self.admin_client()
        try:
            dynamic = self.dynamic_client(api)
            for doc in docs:
                resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
                namespace = doc["metadata"].get("namespace") if resource.namespaced else None
                resource.create(body=doc, namespace=namespace)
        finally:
            api.close()

    # -- internals -----------------------------------------------------------------------
    def _write_pki(self) -> None:
        """A CA, a serving certificate for 127.0.0.1 (API server and kwok), the key that signs
        service-account tokens."""
        days = "2"
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", days,
            "-subj", "/CN=llmchaos-test-ca", "-keyout", "ca.key", "-out", "ca.crt",
            cwd=self.pki,
        )  # fmt: skip
        (self.pki / "serving.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "serving.key", "-out", "serving.csr",
            cwd=self.pki,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", days, "-extfile", "serving.ext", "-out", "serving.crt",
            cwd=self.pki,
        )  # fmt: skip
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=self.pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.pki)

    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = (self.root / "logs" / f"{name}.log").open("ab")
        try:
            self.processes[name] = subprocess.Popen(
                [str(self.binaries / name), *args],
                cwd=self.root,
                # HOME: kwok reads ~/.kwok/kwok.yaml when there is one; a user's must not count
                env={**os.environ, "HOME": str(self.root / "home"), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        while True:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {process.returncode} while waiting for {what}:\n"
                        + self.log_tail(name)
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                name = what if what in self.processes else list(self.processes)[-1]
                raise RuntimeError(f"{what} not ready in time:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {path})"

    def _get(self, url: str) -> int:
        """HTTP status of an admin GET (0 when nothing answers)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (OSError, ssl.SSLError):
            return 0

    def _api_ready(self) -> bool:
        return self._get(self.api_url + "/readyz") == 200

    def _exec_crd_served(self) -> bool:
        return self._get(self.api_url + "/apis/kwok.x-k8s.io/v1alpha1/execs") == 200

    def _kwok_serving(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.kwok_port), timeout=1):
                return True
        except OSError:
            return False


# -- the reference stack of deploy/ on fake nodes ------------------------------------------
DEPLOY = REPO / "deploy"
NAMESPACE = "llmchaos"
BACKEND_SERVICE_ACCOUNT = "llmchaos-chaos"
"""deploy/10-rbac.yaml's identity: the one the backend's tests act as."""
NODES = {"node-gpu-0": 1, "node-gpu-1": 1, "node-cpu-0": 0}
"""Fake nodes and their GPUs (nvidia.com/gpu allocatable): one GPU pod of deploy/ fits on each
GPU node; GPU nodes carry GPU feature discovery's label, which keeps the CPU engine off them."""


def fake_node(name: str, gpus: int) -> dict[str, Any]:
    resources = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    labels = {"kubernetes.io/hostname": name}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
        labels["nvidia.com/gpu.present"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": resources, "capacity": resources},
    }


def deploy_documents() -> list[dict[str, Any]]:
    """The objects of deploy/*.yaml in file-name order, as `kubectl apply -f deploy/` reads."""
    import yaml

    return [
        doc
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


class DeployedStack:
    """deploy/ applied to a ControlPlane on NODES, as admin; down() removes all of it."""

    def __init__(self, plane: ControlPlane, folder: Path):
        self.plane = plane
        self.folder = folder
        self.api = plane.admin_client()
        self.core = k8s.CoreV1Api(self.api)
        self.apps = k8s.AppsV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.backend_kubeconfig = folder / "backend.kubeconfig"
        self.backend_user = f"system:serviceaccount:{NAMESPACE}:{BACKEND_SERVICE_ACCOUNT}"
        """The backend's identity in the audit log."""

    def up(self, timeout_s: float = 60.0) -> None:
        """Nodes, the tokens Secret the README asks for, deploy/; then wait until every
        Deployment is fully available and the backend's service account has a token."""
        for name, gpus in NODES.items():
            self.core.create_node(fake_node(name, gpus))
        docs = deploy_documents()
        assert docs[0]["kind"] == "Namespace" and docs[0]["metadata"]["name"] == NAMESPACE
        self.create_namespace(NAMESPACE, docs[0])
        self.core.create_namespaced_secret(
            NAMESPACE,
            {
                "metadata": {"name": "llmchaos-tokens"},
                "stringData": {"tokens.json": json.dumps({"tokens": []})},
            },
        )
        self.plane.create(docs[1:])
        self.wait_available(timeout_s)
        self.plane.service_account_kubeconfig(
            NAMESPACE, BACKEND_SERVICE_ACCOUNT, self.backend_kubeconfig
        )
        self.audit_from = self.plane.audit_offset()

    def audit_events(self, user: str | None = None) -> list[dict[str, Any]]:
        """What `user` (default: the backend's service account) sent since up()."""
        return self.plane.audit_events(user or self.backend_user, self.audit_from)

    def down(self, timeout_s: float = 60.0) -> None:
        """Empty the namespaces the tests used (they are kept: deleting a namespace takes the
        namespace controller about 5 s even when it is empty), delete deploy/'s cluster-wide
        RBAC and the nodes; wait until no pod is left."""
        rbac = k8s.RbacAuthorizationV1Api(self.api)
        for delete, name in (
            (rbac.delete_cluster_role_binding, "llmchaos-chaos-nodes"),
            (rbac.delete_cluster_role, "llmchaos-chaos-nodes"),
        ):
            self._ignore_404(delete, name)
        namespaces = [
            ns.metadata.name
            for ns in self.core.list_namespace().items
            if not ns.metadata.name.startswith("kube-") and ns.metadata.name != "default"
        ]
        policy, autoscaling = k8s.PolicyV1Api(self.api), k8s.AutoscalingV2Api(self.api)
        net = k8s.NetworkingV1Api(self.api)
        for namespace in namespaces:
            # workloads before their pods, so nothing makes new ones
            for delete in (
                self.apps.delete_collection_namespaced_deployment,
                self.apps.delete_collection_namespaced_replica_set,
                autoscaling.delete_collection_namespaced_horizontal_pod_autoscaler,
                policy.delete_collection_namespaced_pod_disruption_budget,
                net.delete_collection_namespaced_network_policy,
                self.core.delete_collection_namespaced_service,
                self.core.delete_collection_namespaced_config_map,
                self.core.delete_collection_namespaced_secret,
                self.core.delete_collection_namespaced_service_account,
                rbac.delete_collection_namespaced_role,
                rbac.delete_collection_namespaced_role_binding,
            ):
                delete(namespace)
            self.custom.delete_collection_namespaced_custom_object(
                "kwok.x-k8s.io", "v1alpha1", namespace, "execs"
            )
            self.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        self.wait(
            lambda: not self.core.list_pod_for_all_namespaces().items,
            timeout_s,
            f"every pod of {namespaces} deleted",
        )
        for node in self.core.list_node().items:
            self._ignore_404(self.core.delete_node, node.metadata.name)
        self.api.close()

    def create_namespace(self, name: str, body: dict[str, Any] | None = None) -> None:
        """Create namespace `name` (from `body` if given) unless it is there (down() keeps
        them, emptied); wait for its default service account (pods need it)."""
        try:
            self.core.create_namespace(body or {"metadata": {"name": name}})
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
        self.wait(
            lambda: any(
                s.metadata.name == "default"
                for s in self.core.list_namespaced_service_account(name).items
            ),
            30,
            f"service account default of {name} (the serviceaccount controller)",
        )

    # -- reading and waiting -------------------------------------------------------------
    def pods(self, selector: str = "", namespace: str = NAMESPACE) -> list[Any]:
        """Pods (live and terminating) by name."""
        items = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        return sorted(items, key=lambda p: p.metadata.name)

    def pod_names(self, selector: str = "", namespace: str = NAMESPACE) -> list[str]:
        return [p.metadata.name for p in self.pods(selector, namespace)]

    def available(self) -> bool:
        """Every Deployment complete, by its status and by its pods (the status lags: just
        after a pod is deleted it still counts it)."""
        for deployment in self.apps.list_namespaced_deployment(NAMESPACE).items:
            status, replicas = deployment.status, deployment.spec.replicas
            selector = ",".join(
                f"{k}={v}" for k, v in deployment.spec.selector.match_labels.items()
            )
            pods = [p for p in self.pods(selector) if p.metadata.deletion_timestamp is None]
            ready = [
                p
                for p in pods
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            ]
            if (
                status.observed_generation != deployment.metadata.generation
                or (status.available_replicas or 0) != replicas
                or (status.updated_replicas or 0) != replicas
                or (status.replicas or 0) != replicas
                or len(pods) != replicas
                or len(ready) != replicas
            ):
                return False
        return True

    def wait_available(self, timeout_s: float = 60.0) -> None:
        self.wait(self.available, timeout_s, "every Deployment of deploy/ fully available")

    @staticmethod
    def wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s:g} s: {what}")
            time.sleep(0.1)

    # -- kwok's exec ---------------------------------------------------------------------
    def map_exec(self, pod: str, env: dict[str, str], namespace: str = NAMESPACE) -> None:
        """Exec into `pod` runs the command on this machine with `env` (a kwok Exec)."""
        self.custom.create_namespaced_custom_object(
            "kwok.x-k8s.io",
            "v1alpha1",
            namespace,
            "execs",
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "Exec",
                "metadata": {"name": pod, "namespace": namespace},
                "spec": {
                    "execs": [
                        {"local": {"envs": [{"name": k, "value": v} for k, v in env.items()]}}
                    ]
                },
            },
        )

    def exec_as_admin(self, pod: str, command: list[str], namespace: str = NAMESPACE) -> str:
        """Run `command` in `pod` through the API server as admin; its stdout+stderr.
        Raises ApiException (refused) or RuntimeError (the command failed)."""
        from kubernetes.stream import stream

        core = k8s.CoreV1Api(self.plane.admin_client())
        try:
            ws = stream(
                core.connect_get_namespaced_pod_exec,
                pod,
                namespace,
                command=command,
                stdout=True,
                stderr=True,
                stdin=False,
                tty=False,
                _preload_content=False,
            )
            ws.run_forever(timeout=10)
            output = ws.read_all()
            status = ws.read_channel(3) or "{}"
            ws.close()
        finally:
            core.api_client.close()
        if json.loads(status).get("status", "Success") != "Success":
            raise RuntimeError(f"{command} in {pod}: {status} {output}")
        return str(output)

    def wait_exec(self, pod: str, namespace: str = NAMESPACE, timeout_s: float = 10.0) -> None:
        """Wait until kwok has seen the pod's Exec: `true` runs through the API server."""

        def works() -> bool:
            try:
                self.exec_as_admin(pod, ["true"], namespace)
                return True
            except (k8s.ApiException, RuntimeError):
                return False

        self.wait(works, timeout_s, f"exec into {namespace}/{pod} mapped by kwok")

    # -- internals -----------------------------------------------------------------------
    @staticmethod
    def _ignore_404(delete: Callable[..., Any], *args: Any) -> None:
        try:
            delete(*args)
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise
