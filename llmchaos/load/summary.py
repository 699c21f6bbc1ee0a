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
    """Still in flight when the run ended (normally 0: the drain outlasts the timeout)."""
    accounting_closed: bool
    """scheduled == ok + sum(failed) + dropped + in_flight, checked on the merged counts."""
    duration_s: float
    target_qps: float
    achieved_qps: float
    """Answered requests (any outcome) per second of schedule."""
    schedule_lag_p99_ms: float | None
    latency_ms: dict[str, float | None]
    ttft_ms: dict[str, float | None]
    tokens_per_s: dict[str, float | None]
    frame_drops: int
    """Gaps of 3 s or more without a successful response."""
    frame_drop_s: float
    serving_modes: dict[str, int]

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
