"""Kubernetes APIs for the backend's tests.

The real one (`control_plane`, `deployed`): etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (tests/k8s/controlplane.py) with deploy/ applied on fake GPU nodes.
Its binaries come from scripts/build-k8s.sh (`make k8s-bin`); without them the tests that need
it are skipped, except under CI, where they fail.

kmock, an emulator, only where a real server cannot be made to misbehave on demand (injected
500s and 409s, a server ignoring label selectors, the pod proxy to /metrics). The official
client is synchronous, kmock is an aiohttp server: the emulator runs its own event loop in a
background thread and the client talks to it over HTTP, as to a real API server.
What kmock lacks is added here, by a hook in front of kmock that sees every request first:

- exec (pods/exec over WebSocket, `v4.channel.k8s.io`): answered from `exec_answers`, per pod;
- the pod proxy to /metrics: answered from `metrics`, per pod;
- injected API errors: `fail(method, path_regex, status)` answers with a Kubernetes Status.

Everything else (create/list/read/patch/delete) is kmock's own emulation. It ignores label
selectors; the backend filters them itself. Every request is logged in `requests`.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import pytest
import redis
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from llmchaos.targets.kubernetes import KubernetesSettings, KubernetesTarget

from .controlplane import NAMESPACE, ControlPlane, DeployedStack, bin_dir, missing_binaries

NS = "llmchaos"
OTHER_NS = "other-team"
V4 = "v4.channel.k8s.io"


@dataclass
class ExecResult:
    """What a command run through exec answers."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


ExecAnswer = Callable[[list[str]], "ExecResult | int"]
"""pod's command -> its result, or an HTTP status refusing the exec handshake."""


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    message: str
    times: int | None
    """How many requests it answers; None: until cleared."""


@dataclass
class Emulator:
    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)
    """(METHOD, path) of every request, in order."""
    exec_calls: list[tuple[str, list[str]]] = field(default_factory=list)
    exec_answers: dict[str, ExecAnswer] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    """pod name -> /metrics text; pods not listed do not answer (503)."""
    faults: list[Fault] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                with warnings.catch_warnings():
                    # load_bundled() reads its resource list with a deprecated importlib call
                    warnings.simplefilter("ignore", DeprecationWarning)
                    km = _KMock()
                    km.front = self._intercept  # type: ignore[attr-defined]
                    async with km, kmock.Server(km) as server:
                        km.resources.load_bundled()
                        self.url = str(server.url).rstrip("/")
                        ready.set()
                        await self._stop.wait()
            except BaseException as exc:  # surfaced by start()
                errors.append(exc)
                ready.set()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(main(),), daemon=True
        )
        self._thread.start()
        assert ready.wait(10), "kmock did not start"
        if errors:
            raise errors[0]

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    # -- test controls -------------------------------------------------------------------
    def fail(
        self, method: str, path: str, status: int, message: str = "", times: int | None = None
    ) -> Fault:
        """Answer requests `METHOD` on paths matching regex `path` with `status`."""
        fault = Fault(method.upper(), re.compile(path), status, message, times)
        self.faults.append(fault)
        return fault

    def writes(self) -> list[tuple[str, str]]:
        """Requests that could change something (everything but GET), exec included."""
        return [(m, p) for m, p in self.requests if m != "GET" or p.endswith("/exec")]

    # -- in front of kmock (runs on the emulator's loop) ---------------------------------
    async def _intercept(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse | None:
        """Answer faults, exec and the metrics proxy; None: kmock's emulation answers."""
        method, path = raw.method.upper(), raw.path
        self.requests.append((method, path))
        for fault in list(self.faults):
            if fault.method == method and fault.path.search(path):
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                return _status(fault.status, fault.message or f"injected {fault.status}")
        parts = path.strip("/").split("/")
        # /api/v1/namespaces/<ns>/pods/<name>/<subresource...>
        if len(parts) >= 7 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            name, subresource = parts[5], "/".join(parts[6:])
            if subresource == "exec":
                return await self._exec(raw, name)
            if subresource == "proxy/metrics":
                pod = name.split(":")[0]
                if pod in self.metrics:
                    return aiohttp.web.Response(text=self.metrics[pod], content_type="text/plain")
                return _status(503, f"no endpoints available for {pod}")
        return None

    async def _exec(self, raw: aiohttp.web.BaseRequest, pod: str) -> aiohttp.web.StreamResponse:
        command = raw.query.getall("command", [])
        self.exec_calls.append((pod, command))
        answer = self.exec_answers.get(pod)
        result: ExecResult | int = answer(command) if answer else 404
        if isinstance(result, int):
            return _status(result, f"exec refused for {pod}")
        ws = aiohttp.web.WebSocketResponse(protocols=(V4,))
        await ws.prepare(raw)
        if result.stdout:
            await ws.send_bytes(b"\x01" + result.stdout.encode())
        if result.stderr:
            await ws.send_bytes(b"\x02" + result.stderr.encode())
        if result.exit_code == 0:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        else:
            status = {
                "metadata": {},
                "status": "Failure",
                "message": f"command terminated with non-zero exit code: {result.exit_code}",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(result.exit_code)}]},
            }
        await ws.send_bytes(b"\x03" + json.dumps(status).encode())
        await ws.close()
        return ws


def _status(code: int, message: str) -> aiohttp.web.Response:
    """A Kubernetes Status answer, as the API server sends with an error."""
    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code}
    return aiohttp.web.json_response({**body, "message": message}, status=code)


class _KMock(kmock.KubernetesEmulator):
    """kmock with a hook in front: requests the hook answers never reach the emulation."""

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        answered = await self.front(raw_request)  # type: ignore[attr-defined]
        if answered is not None:
            return answered
        return await super().__call__(raw_request)


# -- objects of a small inference stack ------------------------------------------------------
def pod(
    name: str,
    component: str,
    node: str,
    *,
    namespace: str = NS,
    ready: bool = True,
    created: str = "2026-12-02T09:00:00Z",
    scheduled: str | None = None,
    ready_at: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    conditions = [
        {
            "type": "PodScheduled",
            "status": "True",
            "lastTransitionTime": scheduled or created,
        },
        {
            "type": "Ready",
            "status": "True" if ready else "False",
            "lastTransitionTime": ready_at or scheduled or created,
        },
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "creationTimestamp": created,
            "labels": {"app.kubernetes.io/component": component, **(labels or {})},
        },
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "example"}]},
        "status": {"phase": "Running", "conditions": conditions},
    }


STACK_PODS = [
    pod("vllm-gpu-a", "engine-gpu", "node-a"),
    pod("vllm-gpu-b", "engine-gpu", "node-b"),
    pod("vllm-cpu-c", "engine-cpu", "node-c"),
    pod("gateway-1", "gateway", "node-a"),
    pod("gateway-2", "gateway", "node-b"),
    pod("redis-0", "redis", "node-c"),
]
OTHER_PODS = [pod("their-gpu-job", "engine-gpu", "node-a", namespace=OTHER_NS)]
"""Another team's pod on node-a, with the same labels: chaos must never touch it."""


def deployment(name: str, replicas: int, ready: int) -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "example"}]},
            },
        },
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas,
        },
    }


def node(name: str, gpus: int) -> dict[str, Any]:
    allocatable = {"cpu": "16", "memory": "64Gi"}
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "spec": {},
        "status": {"allocatable": allocatable},
    }


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    emu = Emulator()
    emu.start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def kubeconfig(emulator: Emulator, tmp_path: Path) -> Path:
    """A kubeconfig pointing at the emulator, as a user would have for a real cluster."""
    path = tmp_path / "kubeconfig.json"  # JSON is YAML
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": emulator.url}}],
                "users": [{"name": "chaos", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "chaos"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


@pytest.fixture
def cluster(emulator: Emulator, kubeconfig: Path) -> Iterator[k8s.ApiClient]:
    """The stack's pods, Deployments and nodes created in the emulator; the client used."""
    api = k8s_config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    for name, gpus in (("node-a", 1), ("node-b", 1), ("node-c", 0)):
        core.create_node(node(name, gpus))
    for item in STACK_PODS + OTHER_PODS:
        core.create_namespaced_pod(item["metadata"]["namespace"], item)
    apps.create_namespaced_deployment(NS, deployment("gateway", replicas=2, ready=2))
    emulator.requests.clear()  # tests count their own requests
    try:
        yield api
    finally:
        api.close()


def _backend_factory(**defaults: Any) -> Iterator[Callable[..., KubernetesTarget]]:
    """make(**overrides) -> KubernetesTarget with `defaults`; all closed at the end."""
    made: list[KubernetesTarget] = []

    def make(**overrides: Any) -> KubernetesTarget:
        backend = KubernetesTarget(KubernetesSettings(**{**defaults, **overrides}))
        made.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in made:
            backend.close()


@pytest.fixture
def make_backend(cluster: k8s.ApiClient, kubeconfig: Path) -> Iterator[Callable[..., Any]]:
    """KubernetesTarget over the kubeconfig, with test-friendly timeouts."""
    yield from _backend_factory(
        namespace=NS,
        allowed_namespaces=(NS,),
        kubeconfig=str(kubeconfig),
        request_timeout_s=5.0,
        exec_timeout_s=5.0,
        ready_timeout_s=5.0,
        poll_interval_s=0.05,
    )


# -- the real control plane ------------------------------------------------------------------
@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, controllers, scheduler and kwok for the whole test session;
    stopped at its end, pass or fail (and killed with the test run if it is killed)."""
    missing = missing_binaries()
    if missing:
        reason = (
            f"Kubernetes binaries missing in {bin_dir()}: {', '.join(missing)} "
            "(build them with `make k8s-bin`)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI must test against the real control plane: {reason}")
        pytest.skip(reason)
    plane = ControlPlane(tmp_path_factory.mktemp("k8s"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def deployed(control_plane: ControlPlane, tmp_path: Path) -> Iterator[DeployedStack]:
    """deploy/ on the fake nodes, every Deployment available; all of it removed afterwards."""
    stack = DeployedStack(control_plane, tmp_path)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


@pytest.fixture
def real_backend(deployed: DeployedStack) -> Iterator[Callable[..., KubernetesTarget]]:
    """KubernetesTarget acting as deploy/10-rbac.yaml's service account."""
    yield from _backend_factory(
        namespace=NAMESPACE,
        allowed_namespaces=(NAMESPACE,),
        kubeconfig=str(deployed.backend_kubeconfig),
        request_timeout_s=10.0,
        exec_timeout_s=10.0,
        ready_timeout_s=30.0,
        poll_interval_s=0.1,
    )


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


@pytest.fixture
def gpu_processes() -> Iterator[Callable[[list[int]], str]]:
    """A scripted /gpu/processes listing given pids (for pids that cannot be killed)."""
    servers: list[http.server.HTTPServer] = []

    def serve(pids: list[int]) -> str:
        body = json.dumps([{"pid": pid, "process_name": "python"} for pid in pids]).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    try:
        yield serve
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
