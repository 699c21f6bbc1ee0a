"""The embedded autoscaler: a HorizontalPodAutoscaler for the stack's GPU workers.

    python -m llmchaos.stack.autoscaler --settings autoscaler.json

Every `sync_period_s` it reads each current replica's /healthz and writes the replica count
the HPA's algorithm gives into the stack's replicas file, which the node agents follow
(starting a worker is a new pod: a full model load; stopping one is a scale-in). The metric
is the batch utilisation of a replica, (running + waiting) / max_num_seqs, averaged over the
ready replicas against `target_utilization` (70%): what KServe/Knative's concurrency target
and a vLLM HPA on `vllm:num_requests_running + waiting` per pod express, and what a GPU
utilisation target means for a continuous-batching engine (its GPU is busy whenever one
sequence runs, so DCGM_FI_DEV_GPU_UTIL says little below a full batch).

The algorithm is Kubernetes' (pkg/controller/podautoscaler, replica_calculator.go and
horizontal.go), step by step:

- ratio = average utilisation of the ready replicas / target; within `tolerance` (0.1) of 1
  the count stays. Replicas that are not ready yet (loading their model) are set aside; when
  the ratio says scale up, they count as 0% and the ratio is computed again, and a change of
  direction (or a ratio now within tolerance) keeps the count. Replicas that do not answer
  at all count as 0% for a scale-up and 100% for a scale-down.
- desired = ceil(ratio * replicas counted);
- stabilisation: a scale-down takes the highest recommendation of the last
  `scale_down_window_s` (300 s), a scale-up the lowest of `scale_up_window_s` (0);
- rate: at most max(`scale_up_pods` (4), `scale_up_percent` (100%)) more per
  `policy_period_s` (15 s) than at the period's start, and at most `scale_down_percent`
  (100%) fewer;
- clamped to [min_replicas, max_replicas].

State (the decisions, newest last) is written to `state_path` after every sync.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.files import write_json_atomic
from llmchaos.stack.settings import run_loop_process
from llmchaos.stack.topology import read_replicas, write_replicas

__all__ = [
    "AutoscalerSettings",
    "Decision",
    "Hpa",
    "ReplicaReading",
    "ScaledWorker",
    "main",
    "read_replica",
]

log = logging.getLogger("llmchaos.autoscaler")

_HISTORY = 500
"""Decisions kept in the state file."""


@dataclass(frozen=True)
class ScaledWorker:
    """One replica slot of the pool, in ordinal order."""

    name: str
    health_url: str


@dataclass(frozen=True)
class AutoscalerSettings:
    """The HPA of one worker pool (defaults: Kubernetes' own, target 70% as in the seed)."""

    replicas_path: str = "replicas.json"
    """The stack's replicas file, which the node agents follow."""
    state_path: str = "autoscaler-state.json"
    """Where the decisions are written."""
    pool: str = "gpu"
    workers: tuple[ScaledWorker, ...] = ()
    """The pool's replica slots; at most this many replicas."""
    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.7
    """Average (running + waiting) / max_num_seqs the HPA aims at (the seed's 70%)."""
    tolerance: float = 0.1
    """No change while the ratio is within this of 1 (kube-controller-manager's default)."""
    sync_period_s: float = 15.0
    """How often it decides (--horizontal-pod-autoscaler-sync-period, 15 s)."""
    scale_up_window_s: float = 0.0
    """Scale-up stabilisation window (behavior.scaleUp default: 0)."""
    scale_down_window_s: float = 300.0
    """Scale-down stabilisation window (behavior.scaleDown default: 300 s)."""
    policy_period_s: float = 15.0
    """periodSeconds of the rate policies (the defaults' 15 s)."""
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_down_percent: float = 100.0
    read_timeout_s: float = 1.0
    """Timeout of one replica's /healthz read."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise InvalidInput(
                f"autoscaler: expected 1 <= min_replicas <= max_replicas, got "
                f"{self.min_replicas}..{self.max_replicas}"
            )
        if self.workers and self.max_replicas > len(self.workers):
            raise InvalidInput(
                f"autoscaler: max_replicas {self.max_replicas} > the pool's "
                f"{len(self.workers)} worker slots"
            )
        if self.target_utilization <= 0:
            raise InvalidInput(
                f"autoscaler: target_utilization: expected > 0, got {self.target_utilization}"
            )
        if self.sync_period_s <= 0:
            raise InvalidInput(f"autoscaler: sync_period_s: expected > 0, got {self.sync_period_s}")


@dataclass(frozen=True)
class ReplicaReading:
    """One current replica as its /healthz showed it."""

    name: str
    ready: bool
    """Serving (not loading)."""
    utilization: float | None
    """(running + waiting) / max_num_seqs when ready; None when it did not answer."""


@dataclass(frozen=True)
class Decision:
    """One sync: what was read and what was decided."""

    at: float
    current: int
    desired: int
    ready: int
    utilization: float | None
    """Average over the ready replicas."""
    recommendation: int
    """The algorithm's count before stabilisation and rate limits."""
    reason: str


def read_replica(worker: ScaledWorker, timeout_s: float) -> ReplicaReading:
    """A replica's state from its /healthz (the worker's JSON: status, running, waiting,
    max_num_seqs)."""
    try:
        with urllib.request.urlopen(worker.health_url, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 loading: alive, not ready
        return ReplicaReading(worker.name, False, None if exc.code != 503 else 0.0)
    except (OSError, ValueError):
        return ReplicaReading(worker.name, False, None)
    if body.get("status") != "ready":
        return ReplicaReading(worker.name, False, 0.0)
    seqs = max(1, int(body.get("max_num_seqs") or 1))
    busy = float(body.get("running", 0)) + float(body.get("waiting", 0))
    return ReplicaReading(worker.name, True, busy / seqs)


class Hpa:
    """The algorithm of the module docstring, over readings at times `now` (seconds)."""

    def __init__(self, settings: AutoscalerSettings, current: int) -> None:
        self.settings = settings
        self.current = current
        self._recommendations: deque[tuple[float, int]] = deque()
        self._events: deque[tuple[float, int]] = deque()
        """(time, replicas added (+) or removed (-)) of the last policy period."""

    def recommend(self, readings: list[ReplicaReading]) -> tuple[int, str]:
        """The count Kubernetes' replica calculator gives, and why. Values are in milli-units
        (integers), as Kubernetes keeps metrics, so a ratio of exactly 2 is 2."""
        s = self.settings
        target = round(s.target_utilization * 1000)
        ready = [_milli(r.utilization) for r in readings if r.ready and r.utilization is not None]
        unready = [r for r in readings if not r.ready and r.utilization is not None]
        missing = [r for r in readings if r.utilization is None]
        if not ready:
            return self.current, "no ready replica to read: count kept"
        ratio = sum(ready) / (target * len(ready))
        if not unready and not missing:
            if abs(ratio - 1.0) <= s.tolerance:
                return self.current, f"ratio {ratio:.2f} within tolerance"
            return math.ceil(ratio * len(ready)), f"ratio {ratio:.2f}"
        assumed = list(ready)
        if ratio > 1.0:
            assumed += [0] * (len(unready) + len(missing))
        else:
            assumed += [target] * len(missing)
        new_ratio = sum(assumed) / (target * len(assumed))
        if (
            abs(new_ratio - 1.0) <= s.tolerance
            or (ratio < 1.0 and new_ratio > 1.0)
            or (ratio > 1.0 and new_ratio < 1.0)
        ):
            return self.current, (
                f"ratio {ratio:.2f}, {new_ratio:.2f} with the unready/missing replicas: kept"
            )
        return math.ceil(new_ratio * len(assumed)), (
            f"ratio {ratio:.2f}, {new_ratio:.2f} with {len(unready)} unready and "
            f"{len(missing)} missing replica(s)"
        )

    def decide(self, now: float, readings: list[ReplicaReading]) -> Decision:
        """One sync: recommend, stabilise, limit the rate, clamp; `current` becomes it."""
        s = self.settings
        recommendation, reason = self.recommend(readings)
        self._recommendations.append((now, recommendation))
        longest = max(s.scale_down_window_s, s.scale_up_window_s)
        while self._recommendations and self._recommendations[0][0] < now - longest:
            self._recommendations.popleft()
        desired = recommendation
        if desired > self.current:
            window = [r for t, r in self._recommendations if t >= now - s.scale_up_window_s]
            desired = max(self.current, min(window))
        elif desired < self.current:
            window = [r for t, r in self._recommendations if t >= now - s.scale_down_window_s]
            desired = min(self.current, max(window))
        while self._events and self._events[0][0] <= now - s.policy_period_s:
            self._events.popleft()
        added = sum(n for _, n in self._events if n > 0)
        removed = -sum(n for _, n in self._events if n < 0)
        if desired > self.current:
            start = self.current - added
            limit = max(start + s.scale_up_pods, math.ceil(start * (1 + s.scale_up_percent / 100)))
            desired = min(desired, limit)
        elif desired < self.current:
            start = self.current + removed
            limit = math.floor(start * (1 - s.scale_down_percent / 100))
            desired = max(desired, limit)
        desired = max(s.min_replicas, min(s.max_replicas, desired))
        if desired != self.current:
            self._events.append((now, desired - self.current))
        ready = [r for r in readings if r.ready and r.utilization is not None]
        decision = Decision(
            at=now,
            current=self.current,
            desired=desired,
            ready=len(ready),
            utilization=None
            if not ready
            else round(sum(r.utilization or 0.0 for r in ready) / len(ready), 3),
            recommendation=recommendation,
            reason=reason,
        )
        self.current = desired
        return decision


def _milli(value: float | None) -> int:
    return round((value or 0.0) * 1000)


class _Autoscaler:
    def __init__(self, settings: AutoscalerSettings) -> None:
        self.settings = settings
        replicas_path = Path(settings.replicas_path)
        current = read_replicas(replicas_path).get(settings.pool, settings.min_replicas)
        self.hpa = Hpa(settings, current)
        self.history: deque[dict[str, object]] = deque(maxlen=_HISTORY)
        self.stopping = False

    def sync(self) -> Decision:
        s = self.settings
        readings = [read_replica(w, s.read_timeout_s) for w in s.workers[: self.hpa.current]]
        decision = self.hpa.decide(time.time(), readings)
        if decision.desired != decision.current:
            replicas = read_replicas(Path(s.replicas_path))
            replicas[s.pool] = decision.desired
            write_replicas(Path(s.replicas_path).parent, replicas)
            log.info(
                "scaled %s %d -> %d (utilisation %s, %s)",
                s.pool,
                decision.current,
                decision.desired,
                decision.utilization,
                decision.reason,
            )
        self.history.append(asdict(decision))
        write_json_atomic(
            Path(s.state_path),
            {"pool": s.pool, "replicas": decision.desired, "decisions": list(self.history)},
        )
        return decision

    def run(self) -> int:
        period = self.settings.sync_period_s
        next_at = time.monotonic() + period
        while not self.stopping:
            time.sleep(max(0.0, min(0.1, next_at - time.monotonic())))
            if time.monotonic() >= next_at:
                self.sync()
                next_at += period
        return 0


def main(argv: list[str] | None = None) -> int:
    return run_loop_process(
        "autoscaler",
        AutoscalerSettings,
        _Autoscaler,
        lambda a: f"autoscaling {a.settings.pool} at {a.hpa.current} replicas",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
