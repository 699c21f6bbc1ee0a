"""An inference stack on Kubernetes as a chaos target, through the official `kubernetes` client.

    settings = KubernetesSettings(namespace="llmchaos", allowed_namespaces=("llmchaos",))
    backend = KubernetesTarget(settings)
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

import hashlib
import logging
import math
import re
import time
from typing import Any, ClassVar

import urllib3
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from llmchaos.errors import ComponentNotReady, InvalidInput, StackError
from llmchaos.ledger import Verification
from llmchaos.redact import redact_text
from llmchaos.targets import Replicas, Target, TargetInfo, WorkerRef
from llmchaos.targets.cache import expire_keys
from llmchaos.targets.kubernetes.checks import NVIDIA_SMI, POLICY_TYPES, UNSUPPORTED, Checks
from llmchaos.targets.kubernetes.cluster import http_status, node_of, pod_ready
from llmchaos.targets.kubernetes.load_workers import LoadWorkers
from llmchaos.targets.kubernetes.nodes import NodeFaults
from llmchaos.targets.kubernetes.recovery import Recovery
from llmchaos.targets.kubernetes.settings import MANAGED_BY

__all__ = ["KubernetesTarget"]

log = logging.getLogger("llmchaos.targets.kubernetes")

TOKEN_PATTERN = "token:*"
"""Keys of the gateways' token cache (the same as on the embedded stack)."""
_POLICY_PREFIX = "llmchaos-partition-"
_REDIS_BATCH_CHARS = 4000
"""Characters of keys per redis-cli exec: the command travels in the exec URL's query, and
proxies in front of API servers often cap a request line at 8 KiB."""
_PEXPIRE_SCRIPT = (
    "local n = 0 for _, k in ipairs(KEYS) do n = n + redis.call('PEXPIRE', k, ARGV[1]) end return n"
)
"""One EVAL per batch: PEXPIRE takes one key, and one exec per key would take minutes."""
# Always used with fullmatch: `$` would also match before a trailing newline.
_DNS_LABELISH = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")


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


class KubernetesTarget(Checks, NodeFaults, LoadWorkers, Recovery, Target):
    """The inference stack in one namespace of a cluster; see the module docstring.""" ""

    UNDO_OPS: ClassVar[frozenset[str]] = Target.UNDO_OPS | {"uncordon_node", "stop_load_workers"}
    """The door's (heal_partition, restore_gateway, resume_gpu_process, ...), uncordon_node
    (undoes cordon_node/drain_node) and stop_load_workers (undoes start_load_workers)."""

    # -- Backend: names ------------------------------------------------------------------
    def info(self) -> TargetInfo:
        """Workers = inference pods (name = pod name), nodes = nodes running the stack's pods
        (from spec.nodeName: needs no cluster-wide permission), gateways = gateway pod names."""
        inference = self._inference_pods()
        gateways = self._role_pods("gateway")
        redis = self._role_pods("redis")
        nodes = {node_of(p) for p in [*(p for _, p in inference), *gateways, *redis] if node_of(p)}
        workers = tuple(WorkerRef(p.metadata.name, mode, node_of(p)) for mode, p in inference)
        gateway_names = tuple(sorted(p.metadata.name for p in gateways))
        return TargetInfo(
            nodes=tuple(sorted(nodes)),
            workers=workers,
            gateways=gateway_names,
            partitions_supported=True,
            drains_supported=True,
            aliases=_embedded_aliases(workers, sorted(nodes), gateway_names),
            unsupported=dict(UNSUPPORTED),
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
        pod = self._named_pod("gpu", worker)
        node = node_of(pod)
        uid = pod.metadata.uid
        base = {"worker": worker, "pod": worker, "node": node, "uid": uid}
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

    def partition_node(self, node: str, direction: str = "both") -> None:
        """Cut the namespace's pods on `node` off: label them and apply a deny-all
        NetworkPolicy selecting that label, of ingress and egress ("both"), or of one of them
        (a one-way partition). Idempotent.

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
        pods = [p.metadata.name for p in self._list_pods() if node_of(p) == node]
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": _policy_name(node),
                "namespace": self.namespace,
                "labels": dict(MANAGED_BY),
                "annotations": {"llmchaos.io/node": node},
            },
            # No rules for a policy type: all of its traffic is denied.
            "spec": {
                "podSelector": {"matchLabels": {self.settings.partition_label: key}},
                "policyTypes": POLICY_TYPES[direction],
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
            if http_status(exc) != 409:  # 409: already partitioned, nothing to add
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

    def verify_partition_node(self, details: dict[str, Any]) -> Verification:
        """The NetworkPolicy present, of the direction asked, selecting labelled pods."""
        node, direction = str(details["node"]), str(details.get("direction", "both"))
        name, key = _policy_name(node), _partition_key(node)
        try:
            policy = self._net.read_namespaced_network_policy(
                name, self.namespace, _request_timeout=self.settings.request_timeout_s
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return Verification(False, f"no NetworkPolicy {name} in {self.namespace}")
        label = self.settings.partition_label
        selected = [
            p.metadata.name
            for p in self._list_pods()
            if (p.metadata.labels or {}).get(label) == key and node_of(p) == node
        ]
        types = sorted(policy.spec.policy_types or [])
        return Verification(
            bool(selected) and types == sorted(POLICY_TYPES[direction]),
            f"NetworkPolicy {name} ({'/'.join(types)}) selects {len(selected)} pod(s) on "
            f"{node}: {', '.join(selected) or 'none'}; whether the CNI enforces it is not "
            "visible through the API",
        )

    def _named_pod(self, role: str, name: str) -> Any:
        """The pod `name` of `role` (gpu: a GPU inference pod, gateway); InvalidInput naming
        the argument, the selector and the pods there are otherwise."""
        pods = {p.metadata.name: p for p in self._role_pods(role)}
        if name not in pods:
            gpu = role == "gpu"
            field, what = ("worker", "GPU inference pod") if gpu else (role, f"{role} pod")
            selector = getattr(self.settings, f"{role}_selector")
            raise InvalidInput(
                f"{field}: {name!r} is not a {what} in namespace {self.namespace} "
                f"({role}_selector {selector!r}); {what.split()[0]} pods: "
                f"{', '.join(pods) or 'none'}"
            )
        return pods[name]

    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        """Delete the gateway pod with grace period 0; returns {"gateway", "pod", "node",
        "deleted_pod"} (no pid: the process is the container's)."""
        pod = self._named_pod("gateway", gateway)
        result = {
            "gateway": gateway,
            "pod": gateway,
            "node": node_of(pod),
            "uid": pod.metadata.uid,
        }
        if self.settings.dry_run:
            return self._plan(
                "crash_gateway", **result, steps=[f"delete {self._pod_ref(gateway)} grace 0"]
            )
        self._delete_pod(gateway, "gateway")
        return {**result, "deleted_pod": gateway}

    def restore_gateway(self, gateway: str) -> None:
        """Nothing to start (the Deployment recreates the pod): wait until the gateway
        Deployment has all its replicas ready, in its status and as Ready gateway pods, at
        most ready_timeout_s. Idempotent.

        Raises ComponentNotReady past the deadline.
        """
        name = self.settings.gateway_deployment
        if self.settings.dry_run:
            self._plan("restore_gateway", gateway=gateway, wait_for=f"deployment {name} ready")
            return
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            ready, desired = self._deployment_ready(name, "gateway_deployment")
            # The Deployment's status lags the pods: right after a crash it still counts the
            # deleted pod as ready. The pods themselves say whether a replacement is Ready.
            pods = sum(1 for p in self._role_pods("gateway") if pod_ready(p))
            if min(ready, pods) >= desired:
                return
            if time.monotonic() >= deadline:
                raise ComponentNotReady(
                    f"kubernetes: gateway deployment {self.namespace}/{name}: "
                    f"{min(ready, pods)}/{desired} replicas ready after "
                    f"{self.settings.ready_timeout_s:g} s (ready_timeout_s) since {gateway} "
                    f"was restored"
                )
            time.sleep(self.settings.poll_interval_s)

    def replicas(self) -> Replicas:
        """The GPU Deployment's spec.replicas (what the HPA, or anyone, asked) and its Ready
        pods, with the HPA's bounds and what its status says (autoscaling/v2). A pool
        without an HPA (404) is not autoscaled."""
        deployment = self._deployment(self.settings.gpu_deployment, "gpu_deployment")
        desired = deployment.spec.replicas if deployment.spec.replicas is not None else 1
        ready = sum(1 for p in self._role_pods("gpu") if pod_ready(p))
        hpa = self._call(
            "read",
            f"horizontalpodautoscaler {self.namespace}/{self.settings.gpu_hpa}",
            self._autoscaling.read_namespaced_horizontal_pod_autoscaler,
            self.settings.gpu_hpa,
            self.namespace,
            missing_ok=True,
        )
        if hpa is None:
            return Replicas(desired=desired, ready=ready, detail="no HorizontalPodAutoscaler")
        return Replicas(
            desired=desired,
            ready=ready,
            min_replicas=hpa.spec.min_replicas if hpa.spec.min_replicas is not None else 1,
            max_replicas=hpa.spec.max_replicas,
            autoscaled=True,
            detail=_hpa_detail(hpa),
        )

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
            return self._expire_via_url(ttl_s)
        return self._expire_via_exec(ttl_s, ttl_ms)

    def _expire_via_url(self, ttl_s: float) -> int:
        url = str(self.settings.redis_url)
        shown = f"{redact_text(url)} (redis_url)"
        timeout_s = self.settings.request_timeout_s
        dry_run = self.settings.dry_run
        keys = expire_keys(
            url, None, TOKEN_PATTERN, ttl_s, shown, timeout_s=timeout_s, dry_run=dry_run
        )
        if dry_run:
            self._plan("expire_token_cache", via=redact_text(url), keys=keys, ttl_s=ttl_s)
            return 0
        return keys

    def _expire_via_exec(self, ttl_s: float, ttl_ms: int) -> int:
        ready = [p for p in self._role_pods("redis") if pod_ready(p)]
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

    def verify_expire_token_cache(self, details: dict[str, Any]) -> Verification:
        """Deleted: fewer token keys now than were deleted (the load caches some again at
        once, never all). Expiring later: not checkable now (None)."""
        if details.get("ttl_s"):
            return Verification(None, "keys set to expire later: not checked on a cluster")
        before = int(details.get("keys") or 0)
        now = self._token_key_count()
        return Verification(
            before == 0 or now < before, f"{before} token:* keys deleted, {now} cached now"
        )

    def _token_key_count(self) -> int:
        if self.settings.redis_url:
            import redis

            url = self.settings.redis_url
            client = redis.Redis.from_url(url, socket_timeout=self.settings.request_timeout_s)
            try:
                return sum(1 for _ in client.scan_iter(TOKEN_PATTERN, count=1000))
            except redis.RedisError as exc:
                raise StackError(f"token cache {url} (redis_url): {exc}") from None
            finally:
                client.close()
        ready = [p for p in self._role_pods("redis") if pod_ready(p)]
        if not ready:
            raise StackError(f"kubernetes: no ready Redis pod in namespace {self.namespace}")
        cli = list(self.settings.redis_cli)
        listed = self._exec(ready[0].metadata.name, [*cli, "--scan", "--pattern", TOKEN_PATTERN])
        return len({line.strip() for line in listed.splitlines() if line.strip()})

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

    def kv_cache_usage(self) -> float | None:
        shares = [
            self._pod_metric(pod.metadata.name, "vllm:kv_cache_usage_perc")
            for _, pod in self._inference_pods()
            if pod.status and pod.status.phase == "Running"
        ]
        return max(shares, default=None)

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
            1 for m, pod in self._inference_pods() if (not mode or m == mode) and pod_ready(pod)
        )


def _hpa_detail(hpa: Any) -> str:
    """What an HPA's status says: its desired count and its conditions that are not True
    (FailedGetPodsMetric without a metrics API, ...)."""
    status = hpa.status
    if status is None or not status.conditions:  # a controller always sets AbleToScale
        return "the HPA has no status yet (no HPA controller has acted on it)"
    problems = [
        f"{c.type}={c.status} ({c.reason}: {c.message})"
        for c in status.conditions or []
        if c.status != "True"
    ]
    return f"HPA desires {status.desired_replicas}" + (
        f"; {'; '.join(problems)}" if problems else ""
    )


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
