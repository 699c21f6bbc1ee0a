"""Where the inference stack runs on a cluster and how far chaos may reach:
`KubernetesSettings`, checked when built (InvalidInput names the field), before any API call."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmchaos.errors import InvalidInput
from llmchaos.targets import TargetSettings
from llmchaos.targets.kubernetes.selectors import parse_selector, valid_label_key

__all__ = ["MANAGED_BY", "PROTECTED_NAMESPACES", "KubernetesSettings", "check_settings"]

PROTECTED_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})
"""Never a chaos target, even when listed: the control plane and the cluster's own add-ons."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "llmchaos"}
"""Label on every object this backend creates, so a cleanup can find them."""
# Always used with fullmatch: `$` would also match before a trailing newline ("kube-system\n").
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings(TargetSettings):
    """Where the inference stack runs on the cluster and how far chaos may reach.

    Validated when built: InvalidInput names the field and what would be right.
    """

    allowed_namespaces: tuple[str, ...] = ()
    """Required, non-empty: the only namespaces chaos may act in; `namespace` must be one of
    them, system namespaces (kube-system, kube-public, kube-node-lease) may not be listed.
    Empty by default, which is refused: a run must say where it may break things."""
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
    gpu_deployment: str = "vllm-gpu"
    """Deployment of the GPU inference pods (deploy/30-vllm-gpu.yaml): `replicas()` reads its
    spec.replicas (what the HPA asked) and ready pods."""
    gpu_hpa: str = "vllm-gpu"
    """HorizontalPodAutoscaler of the GPU Deployment (deploy/60-hpa.yaml): its bounds and
    status; a pool without one is not autoscaled."""
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
    dry_run: bool = False
    """Plan only: every change is logged and appended to `KubernetesTarget.plans` instead of
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
    load_workers_manifest: str | None = None
    """A YAML file holding the Locust worker Deployment (deploy/70-locust.yaml's
    `locust-worker`): for rates above `local_max_qps` it is created in the namespace, one
    replica per 2,500 QPS, and deleted at the run's end. None: all load from this machine."""
    local_max_qps: float = 5000.0
    """Highest rate sent from this machine, QPS (two Locust processes held 4,992 of 5,000 QPS
    here: llmchaos/load/README.md); above it the load workers run in the cluster."""
    load_master_address: str | None = None
    """HOST:PORT the cluster's load workers dial to reach the run's Locust master: this
    machine as the pods reach it (a node port, a LoadBalancer, a VPN address). The master
    listens on every address at that port and waits `ready_timeout_s` for the workers; their
    Deployment's --master-host/--master-port are replaced by it. Needed when the workers run
    (a rate above `local_max_qps`)."""

    def __post_init__(self) -> None:
        check_settings(self)


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
    master = settings.load_master_address
    if master is not None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidInput(
                f"load_master_address: expected HOST:PORT (port 1-65535), got {master!r}"
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
    if not isinstance(settings.partition_label, str) or not valid_label_key(
        settings.partition_label
    ):
        raise InvalidInput(
            f"partition_label: expected a label key such as llmchaos.io/partitioned ([prefix/]"
            f"name: a name of at most 63 letters, digits, '-', '_', '.'), got "
            f"{settings.partition_label!r}"
        )


# -- label selectors (applied client-side too) ---------------------------------------------
