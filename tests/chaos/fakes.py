"""A fake target and a scripted load behind the run layer's own seams, so the control, the
faults, the measurements and the report run for real without a stack, a Locust process or a
network (fast and deterministic).

- `FakeKind` is a TargetKind registered under the name "fake" (`register_kind`): the run
  reaches it through the targets' door like any other. Its `FakeTarget` keeps faults in memory
  and decides how each request would fare at a given moment (`answer`).
- `ScriptedLoad` is the load's own aggregation (llmchaos.load.aggregate.Aggregate) fed second by
  second with the answers of the fake target instead of Locust workers' reports: real windows,
  real per-second lines, real timeline and summary files. `ChaosRun.load_factory` starts it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from llmchaos.errors import StackError
from llmchaos.files import write_json_atomic
from llmchaos.ledger import Verification
from llmchaos.load import LoadConfig, Summary
from llmchaos.load.aggregate import Aggregate
from llmchaos.load.timeline import Recorder
from llmchaos.processes import Owner
from llmchaos.targets import Target, TargetInfo, TargetKind, TargetSettings, WorkerRef


@dataclass(frozen=True)
class FakeSettings(TargetSettings):
    """The fake target's behaviour (configuration keys `fake_<field>`)."""

    outage_s: float = 3.0
    """After a GPU kill, how long every request fails (the known-bad variant fails longer)."""
    latency_ms: float = 100.0
    """Latency of every answered request."""
    fail_injection: bool = False
    """Faults raise instead of going in (a fault that cannot be injected)."""
    unhealthy_before: bool = False
    """Every request fails from the start (a target that is not healthy to begin with)."""
    ineffective: bool = False
    """Faults go in without error and change nothing (a rule in the wrong namespace, a kill
    aimed at a pid that had exited): only their check can tell."""


@dataclass
class FakeTarget(Target):
    """In-memory faults; `answer(ts)` says how a request scheduled at `ts` fares."""

    settings: FakeSettings
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    killed_at: float | None = None
    partitioned: set[str] = field(default_factory=set)
    crashed: set[str] = field(default_factory=set)
    closed: bool = False

    UNDO_OPS: ClassVar[frozenset[str]] = Target.UNDO_OPS

    def info(self) -> TargetInfo:
        return FakeKind().plan(self.settings)

    @property
    def gateway_url(self) -> str:
        return "http://fake.invalid"

    @property
    def tokens_file(self) -> str | None:
        return None

    def close(self) -> None:
        self.closed = True

    def _fault(self, name: str, **args: Any) -> None:
        self.calls.append((name, args))
        if self.settings.fail_injection:
            raise StackError(f"{name}: the fake target refuses it")

    def kill_gpu_process(self, worker: str) -> dict[str, Any]:
        self._fault("kill_gpu_process", worker=worker)
        if not self.settings.ineffective:
            self.killed_at = time.time()
        return {"worker": worker, "pid": 4242}

    def verify_kill_gpu_process(self, details: dict[str, Any]) -> Verification:
        return Verification(self.killed_at is not None, f"killed at {self.killed_at}")

    def partition_node(self, node: str, direction: str = "both") -> None:
        self._fault("partition_node", node=node)
        if not self.settings.ineffective:
            self.partitioned.add(node)

    def verify_partition_node(self, details: dict[str, Any]) -> Verification:
        node = details["node"]
        return Verification(node in self.partitioned, f"partitioned: {sorted(self.partitioned)}")

    def heal_partition(self, node: str) -> None:
        self.calls.append(("heal_partition", {"node": node}))
        self.partitioned.discard(node)

    def crash_gateway(self, gateway: str) -> dict[str, Any]:
        self._fault("crash_gateway", gateway=gateway)
        self.crashed.add(gateway)
        return {"gateway": gateway, "pid": 4343}

    def restore_gateway(self, gateway: str) -> None:
        self.calls.append(("restore_gateway", {"gateway": gateway}))
        self.crashed.discard(gateway)

    def expire_token_cache(self, ttl_s: float) -> int:
        self._fault("expire_token_cache", ttl_s=ttl_s)
        return 8

    def queue_depth(self) -> float:
        return 0.0

    def healthy_workers(self, mode: str = "") -> int:
        return 2

    def answer(self, ts: float) -> tuple[str, float]:
        """(outcome, latency ms) of a request scheduled at `ts`: ok unless a fault hurts."""
        failing = (
            self.settings.unhealthy_before
            or bool(self.partitioned)
            or bool(self.crashed)
            or (
                self.killed_at is not None
                and self.killed_at <= ts < self.killed_at + self.settings.outage_s
            )
        )
        return ("5xx", 5.0) if failing else ("ok", self.settings.latency_ms)


class FakeKind(TargetKind):
    """The fake target as a kind: one fake GPU worker per node, two gateways."""

    name = "fake"
    settings_type = FakeSettings
    prefix = "fake_"
    opened: ClassVar[list[FakeTarget]] = []

    def variants(self, settings: TargetSettings) -> tuple[str, ...]:
        return ("hardened", "no-failover")

    def plan(self, settings: TargetSettings) -> TargetInfo:
        return TargetInfo(
            nodes=("node-a", "node-b"),
            workers=(WorkerRef("gpu-0", "gpu", "node-a"), WorkerRef("gpu-1", "gpu", "node-b")),
            gateways=("gateway-primary", "gateway-backup"),
            partitions_supported=True,
        )

    def open(self, settings: TargetSettings, owner: Owner) -> Target:
        assert isinstance(settings, FakeSettings)
        if settings.variant == "no-failover":  # the known-bad variant: a long outage
            settings = replace(settings, outage_s=settings.outage_s * 10)
        target = FakeTarget(settings)
        FakeKind.opened.append(target)
        return target

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        return FakeKind.opened[-1]


class ScriptedLoad:
    """See the module docstring. Only the calls the run layer makes on a LoadRun."""

    def __init__(self, config: LoadConfig, target: FakeTarget) -> None:
        self.config = config
        self.target = target
        self.run_dir = Path(config.run_dir or ".")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start_ts = time.time()
        duration_s = float(config.duration_s or 60)
        self.aggregate = Aggregate(self.start_ts, duration_s, config.qps)
        self.qps = config.qps
        self.filled_upto_s = 0.0
        self.running = True
        self.qps_changes: list[float] = []
        self.bursts: list[tuple[float, float]] = []

    @property
    def timeline_path(self) -> Path:
        return self.run_dir / "timeline.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    def _fill(self) -> None:
        """Every request scheduled up to now gets its answer from the target (as the real
        load's workers report each request when it ends)."""
        now_s = time.time() - self.start_ts
        recorder = Recorder()
        step_s = 1 / max(self.qps, 1.0)
        while self.filled_upto_s < now_s:
            offset_s = self.filled_upto_s
            sec = int(offset_s)
            recorder.scheduled(sec)
            recorder.launched()
            outcome, latency_ms = self.target.answer(self.start_ts + offset_s)
            recorder.finished(sec, outcome, latency_ms, offset_s + latency_ms / 1000, mode="gpu")
            self.filled_upto_s += step_s
        report = recorder.take_report(self.filled_upto_s, final=not self.running)
        self.aggregate.add_report("scripted", report)

    def wait_started(self, timeout_s: float = 30.0) -> float:
        return self.start_ts

    def window(
        self, last_s: float = 10.0, *, since_ts: float | None = None, until_ts: float | None = None
    ) -> dict[str, Any]:
        self._fill()
        now_s = time.time() - self.start_ts
        if since_ts is None:
            return self.aggregate.window(now_s - last_s, now_s)
        to_s = (until_ts if until_ts is not None else time.time()) - self.start_ts
        return self.aggregate.window(since_ts - self.start_ts, to_s)

    def seconds(self, since_ts: float, until_ts: float | None = None) -> list[dict[str, Any]]:
        self._fill()
        to_s = (until_ts if until_ts is not None else time.time()) - self.start_ts
        return self.aggregate.seconds_lines(since_ts - self.start_ts, to_s)

    def set_qps(self, qps: float) -> None:
        self._fill()
        self.qps = qps
        self.qps_changes.append(qps)

    def inject_burst(self, duration_s: float = 10.0, factor: float = 1.0) -> None:
        self.bursts.append((duration_s, factor))

    def stop(self, timeout_s: float | None = None) -> Summary:
        self._fill()
        self.running = False
        self.aggregate.mark_stopped()
        with self.timeline_path.open("w") as out:
            for line in self.aggregate.final_lines(flush_all=True):
                out.write(json.dumps(line) + "\n")
        write_json_atomic(self.summary_path, self.aggregate.summary())
        return Summary.read(self.summary_path)

    def close(self) -> None:
        self.running = False
