"""The API plumbing of the Kubernetes target: the client, calls with errors a user can act on,
pods of the stack by role, exec, deletes and label patches. The target's concerns (faults, nodes,
load workers, recovery) are mixins of `Cluster`."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream

from llmchaos.errors import InvalidInput, StackError
from llmchaos.targets.kubernetes.selectors import parse_selector, selector_matches
from llmchaos.targets.kubernetes.settings import KubernetesSettings, check_settings

__all__ = ["Cluster"]

log = logging.getLogger("llmchaos.targets.kubernetes")

_HANDSHAKE_STATUS = re.compile(r"Handshake status (\d{3})")


def status_detail(exc: ApiException) -> str:
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


def http_status(exc: ApiException) -> int:
    """HTTP status of an API error; for a failed WebSocket handshake (exec) the handshake's."""
    if exc.status:
        return int(exc.status)
    match = _HANDSHAKE_STATUS.search(str(exc.reason or ""))
    return int(match.group(1)) if match else 0


def ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def condition(pod: Any, kind: str) -> Any:
    for condition in (pod.status.conditions if pod.status else None) or []:
        if condition.type == kind:
            return condition
    return None


def pod_ready(pod: Any) -> bool:
    """Running, not terminating, and its Ready condition True."""
    if pod.metadata.deletion_timestamp is not None:
        return False
    if not pod.status or pod.status.phase != "Running":
        return False
    ready = condition(pod, "Ready")
    return ready is not None and ready.status == "True"


def node_of(pod: Any) -> str:
    return (pod.spec.node_name if pod.spec else None) or ""


def load_api_client(settings: KubernetesSettings) -> k8s.ApiClient:
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


_T = TypeVar("_T")


class Cluster:
    """The inference stack in one namespace of a cluster, as the API sees it."""

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
        self._api = api_client or load_api_client(settings)
        self._core = k8s.CoreV1Api(self._api)
        self._apps = k8s.AppsV1Api(self._api)
        self._net = k8s.NetworkingV1Api(self._api)
        self._autoscaling = k8s.AutoscalingV2Api(self._api)
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
            status = http_status(exc)
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
        status = http_status(exc)
        detail = status_detail(exc)
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
                # A kubelet names the exit code in a cause; other runtimes (kwok) only say
                # why in the message.
                causes = (status.get("details") or {}).get("causes") or []
                code = next(
                    (c.get("message") for c in causes if c.get("reason") == "ExitCode"), None
                )
                verdict = f"exit code {code}" if code else str(status.get("message") or "failed")
                output = stderr.strip()
                raise StackError(
                    f"kubernetes: {what} {self._pod_ref(pod)}: {verdict[:300]}"
                    + (f": {output[:300]}" if output and output not in verdict else "")
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
