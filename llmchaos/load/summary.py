"""The end-of-run summary as a typed, frozen record (what `--summary-json` holds)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmchaos.errors import LLMChaosError

__all__ = ["Summary"]


@dataclass(frozen=True)
class Summary:
    """Totals of one run; latency figures are from the scheduled send time, in ms."""

    scheduled: int
    ok: int
    failed: dict[str, int]
    """By class: 5xx, 429, timeout, connection, bad_body, 4xx."""
    dropped: int
    in_flight: int
    """Still in flight when the run ended (normally 0: the drain outlasts the timeout; a lost
    worker's requests in flight at its last report stay here: never answered)."""
    accounting_closed: bool
    """scheduled == ok + sum(failed) + dropped + in_flight + lost_worker, checked on the merged
    counts."""
    duration_s: float
    """The planned schedule length."""
    target_qps: float
    achieved_qps: float
    """Answered requests (any outcome) per second of the time the load ran (`ran_s`)."""
    schedule_lag_p99_ms: float | None
    latency_ms: dict[str, float | None]
    """End to end: p50, p90, p99, p999."""
    ttft_ms: dict[str, float | None]
    """Time to first token of the streams (first non-empty content chunk)."""
    frame_drops: int
    """Gaps of 3 s or more without a successful response, within `ran_s`."""
    frame_drop_s: float
    serving_modes: dict[str, int]
    ran_s: float = 0.0
    """Seconds of schedule that ran: the planned length, or less when the run was stopped."""
    stopped_early: bool = False
    goodput_qps: float | None = None
    """Requests per second (of `ran_s`) that met every goodput SLO; None without SLOs."""
    output_tokens_per_s: float = 0.0
    """Output tokens of the successes per second of `ran_s`."""
    itl_ms: dict[str, float | None] = dataclasses.field(default_factory=dict)
    """Gaps between successive content chunks of the streams."""
    tpot_ms: dict[str, float | None] = dataclasses.field(default_factory=dict)
    """(e2e - TTFT) / (output tokens - 1) of the streams."""
    schedule_lag_ms: dict[str, float | None] = dataclasses.field(default_factory=dict)
    """Actual send minus scheduled send time (part of every latency above)."""
    frame_drop_events: list[list[float]] = dataclasses.field(default_factory=list)
    """[start offset s, length s] of each frame drop, in time order (`frame_drops` of them)."""
    lost_worker: int = 0
    """Arrivals of the shares of lost workers (never joined, died, went silent, stopped early)
    that no report of theirs holds: counted by the master's replay of the share (shares.py),
    part of `scheduled`. Some may have been sent by a worker that died before reporting them."""
    workers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per share of the schedule: "share", "worker" (Locust client id or None), "state" (done |
    lost), "lost_reason", and its scheduled, dropped, ok, failed, unanswered, lost_worker."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def read(cls, path: str | Path) -> Summary:
        """Raises LLMChaosError when the file is missing or not a summary."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise LLMChaosError(f"no load summary at {path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
