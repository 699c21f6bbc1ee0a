"""An inference stack on Kubernetes as a chaos target, through the official `kubernetes` client.

    settings = KubernetesSettings(namespace="llmchaos", allowed_namespaces=("llmchaos",))
    backend = KubernetesBackend(settings)
    backend.kill_gpu_process("vllm-gpu-7d9f-abcde"); backend.partition_node("gpu-node-1"); ...
    backend.heal_partition("gpu-node-1"); backend.close()

What each fault does on the cluster:

    kill_gpu_process   exec `nvidia-smi --query-compute-apps=pid` in the pod, `kill -9` the pids;
                       when exec fails or lists nothing: delete the pod with grace period 0
    partition_node     label the namespace's pods on the node `llmchaos.io/partitioned=<node>`
                       and create a deny-all ingress+egress NetworkPolicy selecting that label
    crash_gateway      delete the gateway pod with grace period 0 (its Deployment recreates it)
    expire_token_cache DEL / PEXPIRE `token:*` through redis_url, else `redis-cli` in the pod
    cordon/drain_node  spec.unschedulable, then evictions (delete when evictions are refused)

Safety: the namespace must be listed in `allowed_namespaces` and is never a system namespace;
this is checked when the settings are built, before any API call. Only pods of that namespace
are touched (a drain evicts the stack's pods, not other tenants'); nodes only by cordoning.
With `dry_run` every change is planned (logged and kept in `plans`), nothing is changed.

Label selectors are sent to the API server and applied again here: a server (or emulator)
that ignores them must not widen a fault to pods it was not aimed at.

Every API error becomes a StackError saying what was attempted, on what, and the HTTP status
(InvalidInput for a 404 on a name the user gave). Undo operations (heal_partition,
restore_gateway, uncordon_node) are idempotent: a 404 while undoing means already undone.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families

from llmchaos.backends import Backend, TargetInfo, WorkerRef
from llmchaos.errors import ComponentNotReady, InvalidInput, StackError

__all__ = [
    "PROTECTED_NAMESPACES",
    "KubernetesBackend",
    "KubernetesSettings",
    "check_settings",
    "parse_selector",
    "selector_matches",
]

log = logging.getLogger(__name__)

PROTECTED_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})
"""Never a chaos target, even when listed: the control plane and the cluster's own add-ons."""
TOKEN_PATTERN = "token:*"
"""Keys of the gateways' token cache (the same as on the embedded stack)."""
NVIDIA_SMI = ("nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader")
MANAGED_BY = {"app.kubernetes.io/managed-by": "llmchaos"}
"""Label on every object this backend creates, so a cleanup can find them."""
_POLICY_PREFIX = "llmchaos-partition-"
_REDIS_BATCH_CHARS = 4000
"""Characters of keys per redis-cli exec: the command travels in the exec URL's query, and
proxies in front of API servers often cap a request line at 8 KiB."""
_PEXPIRE_SCRIPT = (
    "local n = 0 for _, k in ipairs(KEYS) do n = n + redis.call('PEXPIRE', k, ARGV[1]) end return n"
)
"""One EVAL per batch: PEXPIRE takes one key, and one exec per key would take minutes."""
# Always used with fullmatch: `$` would also match before a trailing newline ("kube-system\n").
_DNS_LABELISH = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_HANDSHAKE_STATUS = re.compile(r"Handshake status (\d{3})")


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings:
    """Where the inference stack runs on the cluster and how far chaos may reach.

    Validated when built: InvalidInput names the field and what would be right.
    """

    allowed_namespaces: tuple[str, ...]
    """Required, non-empty: the only namespaces chaos may act in; `namespace` must be one of
    them, system namespaces (kube-system, kube-public, kube-node-lease) may not be listed.
    No default on purpose: a run must say where it is allowed to break things."""
    namespace: str = "llmchaos"
    """Namespace of the inference stack (deploy/00-namespace.yaml creates `llmchaos`)."""
    kubeconfig: str | None = None
    """Path of the kubeconfig file. None: the in-cluster service account when running in a
    pod (KUBERNETES_SERVICE_HOST set), else the default kubeconfig (~/.kube/config)."""
    context: str | None = None
    """Kubeconfig context; None: the file's current context."""
    gpu_selector: str = "app.kubernetes.io/component=engine-gpu"
    """Label selector of the GPU inference pods (the labels of deploy/30-vllm-gpu.yaml)."""
    cpu_selector: str = "app.kubernetes.io/component=engine-cpu"
    """Label selector of the CPU fallback inference pods (deploy/40-vllm-cpu.yaml)."""
    gateway_selector: str = "app.kubernetes.io/component=gateway"
    """Label selector of the gateway pods (deploy/50-gateway.yaml)."""
    redis_selector: str = "app.kubernetes.io/component=redis"
    """Label selector of the Redis pod holding the token cache (deploy/20-redis.yaml)."""
    gateway_deployment: str = "gateway"
    """Deployment of the gateways: restore_gateway waits until it is fully ready again."""
    gateway_url: str = "http://gateway.llmchaos.svc.cluster.local:8000"
    """Base URL the load sends to: the gateway Service seen from inside the cluster (where the
    Locust workers of deploy/70-locust.yaml run). From outside, an ingress or port-forward URL."""
    tokens_file: str | None = None
    """Tokens file for the load ({"tokens": [...]}, as the embedded stack writes); None: the
    load sends no Authorization header."""
    redis_url: str | None = None
    """Token cache URL (redis://host:6379/0) reachable from where this runs; None: exec
    redis-cli in the Redis pod instead (needs pods/exec, no network path to Redis)."""
    redis_cli: tuple[str, ...] = ("redis-cli",)
    """Command run in the Redis pod when redis_url is None; add e.g. ("-a", "...") for auth."""
    engine_container: str | None = None
    """Container to exec nvidia-smi in; None: the pod's default (its only) container."""
    metrics_port: int = 8000
    """Port of the engines' /metrics (vLLM serves it on its API port, 8000)."""
    partition_label: str = "llmchaos.io/partitioned"
    """Label key put on the pods of a partitioned node; its NetworkPolicy selects it."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of GPUs in node.status.allocatable (NVIDIA device plugin)."""
    dry_run: bool = False
    """Plan only: every change is logged and appended to `KubernetesBackend.plans` instead of
    being made; reads still happen (to say which pods a fault would hit)."""
    request_timeout_s: float = 10.0
    """Timeout of one API request, s: an unanswering API server fails the action, not the run."""
    exec_timeout_s: float = 15.0
    """Longest an exec (nvidia-smi, kill, redis-cli) may run, s."""
    metrics_timeout_s: float = 2.0
    """Timeout of one pod's /metrics read through the API server proxy, s: a partitioned pod
    must not stall a queue-depth probe (it counts as 0)."""
    ready_timeout_s: float = 180.0
    """Deadline of restore_gateway, s: pod scheduling, image pull and readiness probe; a
    cluster that needs longer is itself a finding."""
    poll_interval_s: float = 1.0
    """Readiness polling period, s (the readiness probes themselves run every few seconds)."""

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> KubernetesSettings:
        """Settings from plain values (JSON, configuration, environment strings).

        Lists become tuples; a string for a tuple field is split on commas; "true"/"false"
        and numeric strings are converted. Unknown keys are an InvalidInput with a suggestion.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            hints = [
                f"{key} (did you mean {close[0]}?)" if close else key
                for key in unknown
                for close in [difflib.get_close_matches(key, list(fields), n=1)]
            ]
            raise InvalidInput(
                f"kubernetes settings: unknown key(s) {', '.join(hints)}; known: "
                f"{', '.join(fields)}"
            )
        converted: dict[str, Any] = {}
        for key, value in values.items():
            converted[key] = _convert_field(key, fields[key].default, value)
        return cls(**converted)


def _convert_field(key: str, default: Any, value: Any) -> Any:
    if key in ("allowed_namespaces", "redis_cli"):
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list | tuple):
            return tuple(value)
        return value
    if isinstance(value, str) and isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise InvalidInput(f"{key}: expected true or false, got {value!r}")
    if isinstance(value, str) and isinstance(default, int | float):
        try:
            return type(default)(value)
        except ValueError:
            raise InvalidInput(
                f"{key}: expected a number ({type(default).__name__}), got {value!r}"
            ) from None
    return value


def check_settings(settings: KubernetesSettings) -> None:
    """Raise InvalidInput for settings that must never reach the cluster (see the fields)."""
    allowed = settings.allowed_namespaces
    if isinstance(allowed, str) or not isinstance(allowed, tuple):
        raise InvalidInput(
            f"allowed_namespaces: expected a tuple of namespace names, got {allowed!r} "
            f"(write ({allowed!r},) for one namespace)"
        )
    if not allowed:
        raise InvalidInput(
            "allowed_namespaces: required and non-empty: list the namespace(s) chaos may act "
            f"in, e.g. ({settings.namespace!r},)"
        )
    for name in allowed:
        if name in PROTECTED_NAMESPACES:
            raise InvalidInput(
                f"allowed_namespaces: {name!r} is a system namespace and may never be a chaos "
                f"target; list only the inference stack's namespace"
            )
        if not isinstance(name, str) or not _NAMESPACE_RE.fullmatch(name):
            raise InvalidInput(
                f"allowed_namespaces: {name!r} is not a namespace name (lower-case DNS label)"
            )
    if settings.namespace in PROTECTED_NAMESPACES:
        raise InvalidInput(
            f"namespace: {settings.namespace!r} is a system namespace and is never a chaos "
            f"target; use the namespace the inference stack runs in"
        )
    if settings.namespace not in allowed:
        raise InvalidInput(
            f"namespace: {settings.namespace!r} is not in allowed_namespaces "
            f"({', '.join(allowed)}); add it there to allow chaos in it"
        )
    for field in ("gpu_selector", "cpu_selector", "gateway_selector", "redis_selector"):
        selector = getattr(settings, field)
        if not selector.strip():
            raise InvalidInput(f"{field}: required: an empty selector would match every pod")
        parse_selector(selector, field)
    if not settings.gateway_url.startswith(("http://", "https://")):
        raise InvalidInput(
            f"gateway_url: expected http://host[:port], got {settings.gateway_url!r}"
        )
    if settings.redis_url is not None and not settings.redis_url.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        raise InvalidInput(
            f"redis_url: expected redis://host:port/db (or None to exec redis-cli in the "
            f"Redis pod), got {settings.redis_url!r}"
        )
    if not settings.redis_cli or not all(isinstance(a, str) and a for a in settings.redis_cli):
        raise InvalidInput(
            f"redis_cli: expected a command, e.g. ('redis-cli',), got {settings.redis_cli!r}"
        )
    if not 0 < settings.metrics_port < 65536:
        raise InvalidInput(f"metrics_port: expected 1..65535, got {settings.metrics_port}")
    for field in (
        "request_timeout_s",
        "exec_timeout_s",
        "metrics_timeout_s",
        "ready_timeout_s",
        "poll_interval_s",
    ):
        value = getattr(settings, field)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise InvalidInput(f"{field}: expected a positive number of seconds, got {value!r}")
    if not settings.partition_label or "=" in settings.partition_label:
        raise InvalidInput(
            f"partition_label: expected a label key such as llmchaos.io/partitioned, got "
            f"{settings.partition_label!r}"
        )


# -- label selectors (applied client-side too) ---------------------------------------------
Requirement = tuple[str, str, frozenset[str]]
"""(key, operator, values): operator is one of =, !=, in, notin, exists, !exists."""

_SET_REQ = re.compile(r"([^\s!=(),]+)\s+(in|notin)\s*\(([^()]*)\)")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def parse_selector(selector: str, field: str = "selector") -> list[Requirement]:
    """Parse a Kubernetes label selector (equality- and set-based). InvalidInput names `field`."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    requirements: list[Requirement] = []
    for raw in parts:
        part = raw.strip()
        if not part:
            continue
        set_match = _SET_REQ.fullmatch(part)
        if set_match:
            key, op, values = set_match.groups()
            items = frozenset(v.strip() for v in values.split(",") if v.strip())
            requirements.append((key, op, items))
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            requirements.append((key, "!=", frozenset({value})))
        elif "=" in part:
            key, value = (s.strip() for s in part.replace("==", "=").split("=", 1))
            requirements.append((key, "=", frozenset({value})))
        elif part.startswith("!"):
            requirements.append((part[1:].strip(), "!exists", frozenset()))
        else:
            requirements.append((part, "exists", frozenset()))
        key, _, values = requirements[-1]
        if not _LABEL_KEY.fullmatch(key) or not all(_LABEL_VALUE.fullmatch(v) for v in values):
            raise InvalidInput(
                f"{field}: cannot parse {part!r} in label selector {selector!r} (expected "
                f"key=value, key!=value, key in (a,b), key notin (a,b), key or !key)"
            )
    if not requirements:
        raise InvalidInput(f"{field}: empty label selector {selector!r}")
    return requirements


def selector_matches(requirements: list[Requirement], labels: Mapping[str, str]) -> bool:
    """Whether `labels` satisfy every requirement (Kubernetes semantics)."""
    for key, op, values in requirements:
        present = key in labels
        value = labels.get(key)
        ok = {
            "=": present and value in values,
            "!=": not present or value not in values,
            "in": present and value in values,
            "notin": not present or value not in values,
            "exists": present,
            "!exists": not present,
        }[op]
        if not ok:
            return False
    return True


# -- helpers -------------------------------------------------------------------------------
def _partition_key(node: str) -> str:
    """The node as a label value and NetworkPolicy name suffix (both <= 63 characters)."""
    if _DNS_LABELISH.fullmatch(node):
        return node
    return "n-" + hashlib.sha256(node.encode()).hexdigest()[:16]


def _batches(items: list[str], max_chars: int) -> list[list[str]]:
    """Consecutive batches of `items` of at most `max_chars` characters (at least one item)."""
    batches: list[list[str]] = []
    size = 0
    for item in items:
        if not batches or size + len(item) > max_chars:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += len(item) + 1
    return batches


def _policy_name(node: str) -> str:
    return _POLICY_PREFIX + _partition_key(node)


def _status_detail(exc: ApiException) -> str:
    """The server's own words from a Status body, else the HTTP reason."""
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if body:
        try:
            message = json.loads(body).get("message")
        except (ValueError, AttributeError):
            message = body.strip().splitlines()[0][:200] if body.strip() else None
        if message:
            return str(message)
    return str(exc.reason or "").strip() or "no detail"


_HINTS = {
    401: "credentials rejected: check kubeconfig/context or the service account token",
    403: "forbidden: the service account lacks this verb; deploy/10-rbac.yaml lists what the "
    "backend needs",
    404: "not found",
    409: "conflict: the object exists already or was changed concurrently; retry",
    422: "the API server rejected the object as invalid",
    429: "throttled by the API server (or a PodDisruptionBudget for evictions); retry later",
}


def _http_status(exc: ApiException) -> int:
    """HTTP status of an API error; for a failed WebSocket handshake (exec) the handshake's."""
    if exc.status:
        return int(exc.status)
    match = _HANDSHAKE_STATUS.search(str(exc.reason or ""))
    return int(match.group(1)) if match else 0


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _condition(pod: Any, kind: str) -> Any:
    for condition in (pod.status.conditions if pod.status else None) or []:
        if condition.type == kind:
            return condition
    return None


def _pod_ready(pod: Any) -> bool:
    """Running, not terminating, and its Ready condition True."""
    if pod.metadata.deletion_timestamp is not None:
        return False
    if not pod.status or pod.status.phase != "Running":
        return False
    ready = _condition(pod, "Ready")
    return ready is not None and ready.status == "True"


def _node_of(pod: Any) -> str:
    return (pod.spec.node_name if pod.spec else None) or ""


_T = TypeVar("_T")


class KubernetesBackend(Backend):
    """The inference stack in one namespace of a cluster; see the module docstring."""

    UNDO_OPS: ClassVar[frozenset[str]] = Backend.UNDO_OPS | {"uncordon_node"}
    """heal_partition, restore_gateway, and uncordon_node (undoes cordon_node/drain_node)."""

    def __init__(self, settings: KubernetesSettings, api_client: k8s.ApiClient | None = None):
        """Connect lazily: building the client reads the kubeconfig, it sends no request.

        `api_client` overrides the kubeconfig (tests, or a caller with its own client).
        Raises InvalidInput for bad settings or an unreadable kubeconfig.
        """
        check_settings(settings)  # again: a caller may have bypassed __post_init__
        self.settings = settings
        self.namespace = settings.namespace
        self.plans: list[dict[str, Any]] = []
        """Changes planned instead of made (dry_run), in order."""
        self._selectors = {
            mode: parse_selector(getattr(settings, f"{mode}_selector"), f"{mode}_selector")
            for mode in ("gpu", "cpu", "gateway", "redis")
        }
        self._api = api_client or _load_api_client(settings)
        self._core = k8s.CoreV1Api(self._api)
        self._apps = k8s.AppsV1Api(self._api)
        self._net = k8s.NetworkingV1Api(self._api)
        # kubernetes.stream swaps call_api on the client it is given: exec gets a client of
        # its own (and a lock), so reads running in other threads are not sent over WebSocket.
        self._exec_core = k8s.CoreV1Api(k8s.ApiClient(self._api.configuration))
        self._exec_lock = threading.Lock()

    def close(self) -> None:
        """Release the HTTP connection pools; safe to call twice."""
        for api in (self._api, self._exec_core.api_client):
            api.close()

    # -- API plumbing --------------------------------------------------------------------
    def _call(
        self,
        action: str,
        target: str,
        fn: Callable[..., _T],
        *args: Any,
        missing: str | None = None,
        missing_ok: bool = False,
        **kwargs: Any,
    ) -> _T | None:
        """Run one API call; errors become StackError naming `action`, `target`, status.

        A 404 returns None when `missing_ok`, raises InvalidInput(`missing`) when given.
        """
        kwargs.setdefault("_request_timeout", self.settings.request_timeout_s)
        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            status = _http_status(exc)
            if status == 404 and missing_ok:
                return None
            if status == 404 and missing is not None:
                raise InvalidInput(missing) from None
            raise self._error(action, target, exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StackError(
                f"kubernetes: {action} {target} failed: cannot reach the API server at "
                f"{self._api.configuration.host}: {exc}"
            ) from None

    def _error(self, action: str, target: str, exc: ApiException) -> StackError:
        status = _http_status(exc)
        detail = _status_detail(exc)
        hint = _HINTS.get(status) or ("API server error" if status >= 500 else "")
        if status == 0:
            return StackError(
                f"kubernetes: {action} {target} failed: no HTTP answer from "
                f"{self._api.configuration.host}: {detail}"
            )
        return StackError(
            f"kubernetes: {action} {target} failed: HTTP {status} "
            f"({hint + '; ' if hint else ''}server said: {detail})"
        )

    def _pod_ref(self, name: str) -> str:
        return f"pod {self.namespace}/{name}"

    def _plan(self, action: str, **details: Any) -> dict[str, Any]:
        plan = {"dry_run": True, "action": action, **details}
        self.plans.append(plan)
        log.info("dry run: would %s: %s", action, json.dumps(details, default=str))
        return plan

    def _list_pods(self, selector: str | None = None) -> list[Any]:
        """Pods of the namespace matching `selector` (filtered here too), terminating or not."""
        result = self._call(
            "list pods",
            f"in namespace {self.namespace}" + (f" with selector {selector!r}" if selector else ""),
            self._core.list_namespaced_pod,
            self.namespace,
            **({"label_selector": selector} if selector else {}),
        )
        assert result is not None
        pods = list(result.items or [])
        if selector:
            requirements = parse_selector(selector)
            pods = [p for p in pods if selector_matches(requirements, p.metadata.labels or {})]
        return sorted(pods, key=lambda p: p.metadata.name)

    def _role_pods(self, role: str) -> list[Any]:
        """Live (not terminating) pods of a role: gpu, cpu, gateway, redis."""
        selector = getattr(self.settings, f"{role}_selector")
        return [p for p in self._list_pods(selector) if p.metadata.deletion_timestamp is None]

    def _inference_pods(self) -> list[tuple[str, Any]]:
        """(mode, pod) for every live inference pod; a pod matching both selectors is gpu."""
        seen: set[str] = set()
        pods: list[tuple[str, Any]] = []
        for mode in ("gpu", "cpu"):
            for pod in self._role_pods(mode):
                if pod.metadata.name not in seen:
                    seen.add(pod.metadata.name)
                    pods.append((mode, pod))
        return pods

    def _exec(self, pod: str, command: list[str], container: str | None = None) -> str:
        """Run `command` in `pod`; its stdout. StackError when exec is refused, times out or
        the command exits non-zero (with its stderr)."""
        what = f"exec {' '.join(command[:2])} in"
        kwargs: dict[str, Any] = {"container": container} if container else {}
        with self._exec_lock:
            try:
                ws = stream(
                    self._exec_core.connect_get_namespaced_pod_exec,
                    pod,
                    self.namespace,
                    command=command,
                    stdout=True,
                    stderr=True,
                    stdin=False,
                    tty=False,
                    _preload_content=False,
                    _request_timeout=self.settings.exec_timeout_s,
                    **kwargs,
                )
            except ApiException as exc:
                raise self._error(what, self._pod_ref(pod), exc) from None
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise StackError(f"kubernetes: {what} {self._pod_ref(pod)} failed: {exc}") from None
            try:
                ws.run_forever(timeout=self.settings.exec_timeout_s)
                if ws.is_open():
                    raise StackError(
                        f"kubernetes: {what} {self._pod_ref(pod)}: no exit within "
                        f"{self.settings.exec_timeout_s:g} s (exec_timeout_s)"
                    )
                stdout = ws.read_channel(1)
                stderr = ws.read_channel(2)
                status_text = ws.read_channel(3)
            except Exception as exc:  # websocket-client raises its own hierarchy
                if isinstance(exc, StackError):
                    raise
                raise StackError(f"kubernetes: {what} {self._pod_ref(pod)} failed: {exc}") from None
            finally:
                ws.close()
                # websocket-client's close() skips the socket when the server closed first
                # (as the API server does at exit): shut it down, or each exec leaks one.
                if getattr(ws, "sock", None) is not None:
                    ws.sock.shutdown()
        # v4.channel.k8s.io: channel 3 carries a Status; absent = no verdict, take stdout.
        if status_text.strip():
            try:
                status = json.loads(status_text)
            except ValueError:
                status = {"status": "Failure", "message": status_text.strip()}
            if status.get("status") != "Success":
                causes = (status.get("details") or {}).get("causes") or [{}]
                code = causes[0].get("message", "?")
                raise StackError(
                    f"kubernetes: {what} {self._pod_ref(pod)}: exit code {code}: "
                    f"{(stderr.strip() or status.get('message') or 'no output')[:300]}"
                )
        return stdout

    def _delete_pod(self, name: str, field: str) -> None:
        """Delete a pod at once (grace period 0); InvalidInput when it is already gone."""
        self._call(
            "delete",
            self._pod_ref(name) + " (grace period 0)",
            self._core.delete_namespaced_pod,
            name,
            self.namespace,
            grace_period_seconds=0,
            missing=f"{field}: {self._pod_ref(name)} no longer exists (already deleted?)",
        )

    def _patch_labels(self, name: str, labels: dict[str, str | None]) -> None:
        """Merge-patch labels of a pod (None removes one); a vanished pod is skipped."""
        self._call(
            "patch labels of",
            self._pod_ref(name),
            self._core.patch_namespaced_pod,
            name,
            self.namespace,
            {"metadata": {"labels": labels}},
            _content_type="application/merge-patch+json",
            missing_ok=True,
        )

    # -- Backend: names ------------------------------------------------------------------
    def info(self) -> TargetInfo:
        """Workers = inference pods (name = pod name), nodes = nodes running the stack's pods
        (from spec.nodeName: needs no cluster-wide permission), gateways = gateway pod names."""
        inference = self._inference_pods()
        gateways = self._role_pods("gateway")
        redis = self._role_pods("redis")
        nodes = {
            _node_of(p) for p in [*(p for _, p in inference), *gateways, *redis] if _node_of(p)
        }
        workers = tuple(WorkerRef(p.metadata.name, mode, _node_of(p)) for mode, p in inference)
        gateway_names = tuple(sorted(p.metadata.name for p in gateways))
        return TargetInfo(
            nodes=tuple(sorted(nodes)),
            workers=workers,
            gateways=gateway_names,
            partitions_supported=True,
            aliases=_embedded_aliases(workers, sorted(nodes), gateway_names),
        )

    @property
    def gateway_url(self) -> str:
        return self.settings.gateway_url

    @property
    def tokens_file(self) -> str | None:
        return self.settings.tokens_file

    # -- Backend: faults -----------------------------------------------------------------
    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        """SIGKILL the processes holding the pod's GPU, else delete the pod.

        Returns {"worker", "pod", "node", "pid", "pids"} after a kill, or {"worker", "pod",
        "node", "deleted_pod", "reason"} after the fallback. nvidia-smi in a container often
        lists host pids, or nothing: then kill fails or has nothing to do, and deleting the
        pod is the closest fault (the container's process dies, the pod is rescheduled).
        """
        gpu_pods = {p.metadata.name: p for p in self._role_pods("gpu")}
        if worker not in gpu_pods:
            raise InvalidInput(
                f"worker: {worker!r} is not a GPU inference pod in namespace {self.namespace} "
                f"(gpu_selector {self.settings.gpu_selector!r}); GPU pods: "
                f"{', '.join(gpu_pods) or 'none'}"
            )
        node = _node_of(gpu_pods[worker])
        base = {"worker": worker, "pod": worker, "node": node}
        if self.settings.dry_run:
            return self._plan(
                "kill_gpu_process",
                **base,
                steps=[
                    f"exec {' '.join(NVIDIA_SMI)} in {self._pod_ref(worker)}",
                    "exec kill -9 <each pid listed>",
                    f"if exec fails or lists nothing: delete {self._pod_ref(worker)} "
                    "with grace period 0",
                ],
            )
        container = self.settings.engine_container
        try:
            listed = self._exec(worker, list(NVIDIA_SMI), container)
        except StackError as exc:
            return self._kill_by_deletion(base, f"nvidia-smi failed: {exc}")
        pids = [int(line.strip()) for line in listed.splitlines() if line.strip().isdigit()]
        if not pids:
            return self._kill_by_deletion(base, "nvidia-smi lists no compute process")
        try:
            self._exec(worker, ["kill", "-9", *map(str, pids)], container)
        except StackError as exc:
            return self._kill_by_deletion(base, f"kill -9 {pids} failed: {exc}")
        log.info("killed GPU process(es) %s in %s", pids, self._pod_ref(worker))
        return {**base, "pid": pids[0], "pids": pids}

    def _kill_by_deletion(self, base: dict[str, Any], reason: str) -> dict[str, Any]:
        log.info("%s: %s; deleting the pod instead", self._pod_ref(base["pod"]), reason)
        self._delete_pod(base["pod"], "worker")
        return {**base, "deleted_pod": base["pod"], "reason": reason}

    def partition_node(self, node: str) -> None:
        """Cut the namespace's pods on `node` off: label them and apply a deny-all ingress and
        egress NetworkPolicy selecting that label. Idempotent.

        Pods created on the node afterwards are not labelled (a NetworkPolicy cannot select
        by node); a partition is a short fault and rescheduled pods go elsewhere anyway.
        Enforcement needs a CNI that implements NetworkPolicy (Calico, Cilium, ...).
        """
        known = self.info().nodes
        if node not in known:
            raise InvalidInput(
                f"node: {node!r} runs no pod of namespace {self.namespace}; nodes: "
                f"{', '.join(known) or 'none'}"
            )
        key = _partition_key(node)
        pods = [p.metadata.name for p in self._list_pods() if _node_of(p) == node]
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": _policy_name(node),
                "namespace": self.namespace,
                "labels": dict(MANAGED_BY),
                "annotations": {"llmchaos.io/node": node},
            },
            # No ingress or egress rules with both policy types: all traffic is denied.
            "spec": {
                "podSelector": {"matchLabels": {self.settings.partition_label: key}},
                "policyTypes": ["Ingress", "Egress"],
            },
        }
        if self.settings.dry_run:
            self._plan(
                "partition_node",
                node=node,
                networkpolicy=policy["metadata"]["name"],
                label=f"{self.settings.partition_label}={key}",
                pods=pods,
            )
            return
        try:
            self._net.create_namespaced_network_policy(
                self.namespace, policy, _request_timeout=self.settings.request_timeout_s
            )
        except ApiException as exc:
            if _http_status(exc) != 409:  # 409: already partitioned, nothing to add
                raise self._error(
                    "create", f"networkpolicy {self.namespace}/{_policy_name(node)}", exc
                ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise StackError(
                f"kubernetes: create networkpolicy {self.namespace}/{_policy_name(node)} "
                f"failed: cannot reach the API server at {self._api.configuration.host}: {exc}"
            ) from None
        for pod in pods:
            self._patch_labels(pod, {self.settings.partition_label: key})
        log.info("partitioned %s: %d pod(s) labelled, %s", node, len(pods), _policy_name(node))

    def heal_partition(self, node: str) -> None:
        """Remove the NetworkPolicy, then the labels. Idempotent: what is gone is skipped, and
        the node need not exist any more."""
        key = _partition_key(node)
        label = self.settings.partition_label
        pods = [
            p.metadata.name
            for p in self._list_pods(f"{label}={key}")
            if (p.metadata.labels or {}).get(label) == key
        ]
        if self.settings.dry_run:
            self._plan("heal_partition", node=node, networkpolicy=_policy_name(node), unlabel=pods)
            return
        # The policy first: traffic flows again at once; a stale label alone does nothing.
        self._call(
            "delete",
            f"networkpolicy {self.namespace}/{_policy_name(node)}",
            self._net.delete_namespaced_network_policy,
            _policy_name(node),
            self.namespace,
            missing_ok=True,
        )
        for pod in pods:
            self._patch_labels(pod, {label: None})

    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        """Delete the gateway pod with grace period 0; returns {"gateway", "pod", "node",
        "deleted_pod"} (no pid: the process is the container's)."""
        pods = {p.metadata.name: p for p in self._role_pods("gateway")}
        if gateway not in pods:
            raise InvalidInput(
                f"gateway: {gateway!r} is not a gateway pod in namespace {self.namespace} "
                f"(gateway_selector {self.settings.gateway_selector!r}); gateway pods: "
                f"{', '.join(pods) or 'none'}"
            )
        result = {"gateway": gateway, "pod": gateway, "node": _node_of(pods[gateway])}
        if self.settings.dry_run:
            return self._plan(
                "crash_gateway", **result, steps=[f"delete {self._pod_ref(gateway)} grace 0"]
            )
        self._delete_pod(gateway, "gateway")
        return {**result, "deleted_pod": gateway}

    def restore_gateway(self, gateway: str) -> None:
        """Nothing to start (the Deployment recreates the pod): wait until the gateway
        Deployment has all its replicas ready, at most ready_timeout_s. Idempotent.

        Raises ComponentNotReady past the deadline.
        """
        name = self.settings.gateway_deployment
        if self.settings.dry_run:
            self._plan("restore_gateway", gateway=gateway, wait_for=f"deployment {name} ready")
            return
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            ready, desired = self._deployment_ready(name, "gateway_deployment")
            if ready >= desired:
                return
            if time.monotonic() >= deadline:
                raise ComponentNotReady(
                    f"kubernetes: gateway deployment {self.namespace}/{name}: {ready}/{desired} "
                    f"replicas ready after {self.settings.ready_timeout_s:g} s "
                    f"(ready_timeout_s) since {gateway} was restored"
                )
            time.sleep(self.settings.poll_interval_s)

    def _deployment(self, name: str, field: str) -> Any:
        return self._call(
            "read",
            f"deployment {self.namespace}/{name}",
            self._apps.read_namespaced_deployment,
            name,
            self.namespace,
            missing=f"{field}: no deployment {name!r} in namespace {self.namespace}",
        )

    def _deployment_ready(self, name: str, field: str) -> tuple[int, int]:
        """(ready replicas, desired replicas) of a Deployment."""
        deployment = self._deployment(name, field)
        desired = deployment.spec.replicas if deployment.spec.replicas is not None else 1
        ready = (deployment.status.ready_replicas or 0) if deployment.status else 0
        return ready, desired

    def expire_token_cache(self, ttl_s: float) -> int:
        """DEL every `token:*` key (ttl_s = 0) or PEXPIRE it to ttl_s; returns the count.

        Through redis_url when set (redis-py), else `redis-cli` exec'd in the Redis pod.
        """
        if not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s < 0:
            raise InvalidInput(f"ttl_s: expected seconds >= 0 (0 deletes), got {ttl_s!r}")
        ttl_ms = max(1, int(ttl_s * 1000))
        if self.settings.redis_url:
            return self._expire_via_url(ttl_s, ttl_ms)
        return self._expire_via_exec(ttl_s, ttl_ms)

    def _expire_via_url(self, ttl_s: float, ttl_ms: int) -> int:
        import redis

        url = self.settings.redis_url
        client = redis.Redis.from_url(url, socket_timeout=self.settings.request_timeout_s)
        try:
            keys = list(client.scan_iter(TOKEN_PATTERN, count=1000))
            if self.settings.dry_run:
                self._plan("expire_token_cache", via=url, keys=len(keys), ttl_s=ttl_s)
                return 0
            if not keys:
                return 0
            pipe = client.pipeline(transaction=False)
            for key in keys:
                if ttl_s > 0:
                    pipe.pexpire(key, ttl_ms)
                else:
                    pipe.delete(key)
            pipe.execute()
        except redis.RedisError as exc:
            raise StackError(f"token cache {url} (redis_url): {exc}") from None
        finally:
            client.close()
        return len(keys)

    def _expire_via_exec(self, ttl_s: float, ttl_ms: int) -> int:
        ready = [p for p in self._role_pods("redis") if _pod_ready(p)]
        if not ready:
            raise StackError(
                f"kubernetes: no ready Redis pod in namespace {self.namespace} "
                f"(redis_selector {self.settings.redis_selector!r}); set redis_url to reach "
                f"Redis directly"
            )
        pod = ready[0].metadata.name
        cli = list(self.settings.redis_cli)
        listed = self._exec(pod, [*cli, "--scan", "--pattern", TOKEN_PATTERN])
        keys = sorted({line.strip() for line in listed.splitlines() if line.strip()})
        if self.settings.dry_run:
            self._plan("expire_token_cache", via=self._pod_ref(pod), keys=len(keys), ttl_s=ttl_s)
            return 0
        touched = 0
        for batch in _batches(keys, _REDIS_BATCH_CHARS):
            if ttl_s > 0:
                command = [*cli, "EVAL", _PEXPIRE_SCRIPT, str(len(batch)), *batch, str(ttl_ms)]
            else:
                command = [*cli, "DEL", *batch]
            answer = self._exec(pod, command).strip().split()
            try:
                touched += int(answer[-1])
            except (IndexError, ValueError):
                raise StackError(
                    f"kubernetes: redis-cli in {self._pod_ref(pod)} answered "
                    f"{' '.join(answer)[:200]!r}, expected a count"
                ) from None
        return touched

    # -- Backend: readings ---------------------------------------------------------------
    def queue_depth(self) -> float:
        """Sum of vllm:num_requests_waiting over the inference pods, each read through the API
        server's pod proxy (no metrics stack needed); a pod that does not answer counts 0."""
        total = 0.0
        for _, pod in self._inference_pods():
            if not pod.status or pod.status.phase != "Running":
                continue
            total += self._pod_metric(pod.metadata.name, "vllm:num_requests_waiting")
        return total

    def _pod_metric(self, pod: str, name: str) -> float:
        try:
            response = self._core.connect_get_namespaced_pod_proxy_with_path(
                f"{pod}:{self.settings.metrics_port}",
                self.namespace,
                "metrics",
                _preload_content=False,  # raw text: the client cannot deserialize Prometheus
                _request_timeout=self.settings.metrics_timeout_s,
            )
            text = response.data.decode(errors="replace")
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            log.debug("metrics of %s: %s", self._pod_ref(pod), exc)
            return 0.0
        total = 0.0
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name:
                        total += sample.value
        except ValueError as exc:
            log.debug("metrics of %s: unparsable: %s", self._pod_ref(pod), exc)
            return 0.0
        return total

    def healthy_workers(self, mode: str = "") -> int:
        """Inference pods that are Ready (and not terminating), of `mode` ("" = any)."""
        if mode not in ("", "gpu", "cpu"):
            raise InvalidInput(f"mode: expected gpu, cpu or '' (any), got {mode!r}")
        return sum(
            1 for m, pod in self._inference_pods() if (not mode or m == mode) and _pod_ready(pod)
        )

    # -- beyond Backend: nodes -----------------------------------------------------------
    def cordon_node(self, node: str) -> dict[str, Any]:
        """Mark a node of the stack unschedulable; returns {"node", "was_unschedulable"}.

        When it was cordoned already, undoing with uncordon_node would uncordon what someone
        else cordoned: callers should record an undo only when was_unschedulable is False.
        """
        known = self.info().nodes
        if node not in known:
            raise InvalidInput(
                f"node: {node!r} runs no pod of namespace {self.namespace}; nodes: "
                f"{', '.join(known) or 'none'}"
            )
        current = self._call(
            "read",
            f"node {node}",
            self._core.read_node,
            node,
            missing=f"node: no node named {node!r}",
        )
        was = bool(current.spec.unschedulable) if current.spec else False
        if self.settings.dry_run:
            return self._plan("cordon_node", node=node, was_unschedulable=was)
        self._set_unschedulable(node, True)
        return {"node": node, "was_unschedulable": was}

    def uncordon_node(self, node: str) -> None:
        """Make a node schedulable again. Idempotent; a node that is gone is nothing to undo."""
        if self.settings.dry_run:
            self._plan("uncordon_node", node=node)
            return
        self._set_unschedulable(node, False, missing_ok=True)

    def _set_unschedulable(self, node: str, value: bool, missing_ok: bool = False) -> None:
        self._call(
            "cordon" if value else "uncordon",
            f"node {node} (patch spec.unschedulable={str(value).lower()})",
            self._core.patch_node,
            node,
            {"spec": {"unschedulable": value or None}},
            _content_type="application/merge-patch+json",
            missing=None if missing_ok else f"node: no node named {node!r}",
            missing_ok=missing_ok,
        )

    def drain_node(self, node: str) -> dict[str, Any]:
        """Cordon `node`, then evict the namespace's pods on it (other namespaces' pods stay:
        the allowlist applies). Undo with uncordon_node.

        Returns {"node", "was_unschedulable", "evicted", "deleted", "blocked", "notes"}. An
        eviction answered 404 (no Eviction API, e.g. an emulator) falls back to deleting the
        pod, which ignores PodDisruptionBudgets, and says so in notes; 429 (a PDB forbids it)
        leaves the pod in place and lists it under blocked.
        """
        cordon = self.cordon_node(node)
        pods = [p.metadata.name for p in self._list_pods() if _node_of(p) == node]
        if self.settings.dry_run:
            plan = self._plan("drain_node", node=node, evict=pods)
            return {**plan, "was_unschedulable": cordon["was_unschedulable"]}
        result: dict[str, Any] = {
            "node": node,
            "was_unschedulable": cordon["was_unschedulable"],
            "evicted": [],
            "deleted": [],
            "blocked": [],
            "notes": [],
        }
        for pod in pods:
            eviction = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pod, "namespace": self.namespace},
            }
            try:
                self._core.create_namespaced_pod_eviction(
                    pod, self.namespace, eviction, _request_timeout=self.settings.request_timeout_s
                )
                result["evicted"].append(pod)
                continue
            except ApiException as exc:
                status = _http_status(exc)
                if status == 429:
                    result["blocked"].append(pod)
                    continue
                if status != 404:
                    raise self._error("evict", self._pod_ref(pod), exc) from None
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise StackError(
                    f"kubernetes: evict {self._pod_ref(pod)} failed: cannot reach the API "
                    f"server at {self._api.configuration.host}: {exc}"
                ) from None
            # 404: no Eviction API here, or the pod is gone; deleting tells which.
            gone = (
                self._call(
                    "delete",
                    self._pod_ref(pod) + " (eviction fallback)",
                    self._core.delete_namespaced_pod,
                    pod,
                    self.namespace,
                    missing_ok=True,
                )
                is None
            )
            if not gone:
                result["deleted"].append(pod)
                result["notes"].append(
                    f"{pod}: eviction answered 404, pod deleted instead "
                    "(PodDisruptionBudgets not consulted)"
                )
        return result

    # -- beyond Backend: readings --------------------------------------------------------
    def pod_recovery_times(self, selector: str, since_ts: float) -> dict[str, list[dict[str, Any]]]:
        """Recovery of pods created at or after `since_ts` (epoch s, e.g. the kill) matching
        `selector`, in Krkn's terms: {"recovered": [...], "unrecovered": [...]}.

        Each entry: pod_name, namespace, node, pod_rescheduling_time (since_ts until
        scheduled: PodScheduled, else creation), pod_readiness_time (scheduled until Ready)
        and total_recovery_time (their sum), in seconds. Unrecovered pods (not Ready yet) have
        the rescheduling time when scheduled, else None. API timestamps have one-second
        resolution and the server's clock: times are clamped at 0.
        """
        parse_selector(selector, "selector")  # InvalidInput before any request
        floor = math.floor(since_ts)  # creationTimestamp is whole seconds
        recovered: list[dict[str, Any]] = []
        unrecovered: list[dict[str, Any]] = []
        for pod in self._list_pods(selector):
            created = _ts(pod.metadata.creation_timestamp)
            if created is None or created < floor or pod.metadata.deletion_timestamp:
                continue
            scheduled_condition = _condition(pod, "PodScheduled")
            scheduled = (
                _ts(scheduled_condition.last_transition_time)
                if scheduled_condition is not None and scheduled_condition.status == "True"
                else None
            )
            if scheduled is None and _node_of(pod):
                scheduled = created
            entry: dict[str, Any] = {
                "pod_name": pod.metadata.name,
                "namespace": self.namespace,
                "node": _node_of(pod),
                "pod_rescheduling_time": (
                    max(0.0, scheduled - since_ts) if scheduled is not None else None
                ),
            }
            ready_condition = _condition(pod, "Ready")
            ready_at = (
                _ts(ready_condition.last_transition_time)
                if _pod_ready(pod) and ready_condition is not None
                else None
            )
            if ready_at is None or scheduled is None:
                unrecovered.append(entry)
                continue
            entry["pod_readiness_time"] = max(0.0, ready_at - max(scheduled, since_ts))
            entry["total_recovery_time"] = (
                entry["pod_rescheduling_time"] + entry["pod_readiness_time"]
            )
            recovered.append(entry)
        return {"recovered": recovered, "unrecovered": unrecovered}

    def available_replicas(self, deployment: str) -> int:
        """status.availableReplicas of a Deployment of the namespace (0 when unset)."""
        found = self._deployment(deployment, "deployment")
        return int((found.status.available_replicas if found.status else None) or 0)

    def gpu_allocatable(self, node: str) -> int:
        """GPUs the node offers to pods (`gpu_resource` in status.allocatable; 0 if absent)."""
        found = self._call(
            "read", f"node {node}", self._core.read_node, node, missing=f"node: no node {node!r}"
        )
        allocatable = (found.status.allocatable if found.status else None) or {}
        value = allocatable.get(self.settings.gpu_resource)
        return int(parse_quantity(value)) if value is not None else 0


def _load_api_client(settings: KubernetesSettings) -> k8s.ApiClient:
    """An ApiClient from the kubeconfig, or the in-cluster service account (no request)."""
    where = settings.kubeconfig or "the default kubeconfig (~/.kube/config, $KUBECONFIG)"
    try:
        if (
            settings.kubeconfig is None
            and settings.context is None
            and os.environ.get("KUBERNETES_SERVICE_HOST")
        ):
            configuration = k8s.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration)
        return k8s_config.new_client_from_config(
            config_file=settings.kubeconfig, context=settings.context, persist_config=False
        )
    except (k8s_config.ConfigException, OSError, ValueError, TypeError) as exc:
        raise InvalidInput(
            f"kubeconfig: cannot load {where}"
            + (f" (context {settings.context!r})" if settings.context else "")
            + f": {exc}"
        ) from None


def _embedded_aliases(
    workers: tuple[WorkerRef, ...], nodes: list[str], gateways: tuple[str, ...]
) -> dict[str, str]:
    """The embedded stack's names for this cluster's, so the catalogue's experiments run
    unchanged: gpu-<i> / cpu-<i> = the i-th pod of the mode by name; node-a, node-b, ... =
    the nodes of gpu-0, gpu-1, ... first (as on the embedded stack), then the others;
    primary / backup = the first / second gateway pod by name."""
    aliases: dict[str, str] = {}
    for mode in ("gpu", "cpu"):
        named = sorted(w.name for w in workers if w.mode == mode)
        aliases.update({f"{mode}-{i}": name for i, name in enumerate(named)})
    ordered = [aliases[f"gpu-{i}"] for i in range(len(workers)) if f"gpu-{i}" in aliases]
    by_worker = {w.name: w.node for w in workers}
    node_order = list(dict.fromkeys([by_worker[w] for w in ordered if by_worker[w]] + nodes))
    aliases.update({f"node-{chr(ord('a') + i)}": n for i, n in enumerate(node_order[:26])})
    aliases.update(dict(zip(("primary", "backup"), gateways, strict=False)))
    return aliases
