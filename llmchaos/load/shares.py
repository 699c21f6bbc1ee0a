"""The schedule's shares, one per worker, and what happens to the share of a worker that is lost.

The master splits the schedule into `total_workers` shares at time zero (share i: the arrival
schedule with share 1/N and index i, schedule.py) and tells each worker that joined which one
it follows. A share whose worker never joined, died, went silent or was stopped before its end
is *lost*: from then on the master replays it (`LostShare`) exactly as its worker would have
followed it, the same seed and the same live controls, without sending anything, and counts
every arrival the worker's reports do not hold as `lost_worker` in its scheduled second. So
scheduled = dropped + answered + unanswered + lost_worker closes for every second and the run.

Why counted and not re-assigned to the survivors: the survivors were sized for their own share
(in-flight cap, CPU), a dead host's share landing on them would change the load each of them
sends mid-run and mix a capacity problem of the load into the target's results, and the
arrivals the dead worker may have sent after its last report cannot be told apart from unsent
ones. Counting keeps the offered load per host what it was and says what went missing.

Plain Python (no gevent): tests use it directly.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from llmchaos.load.schedule import ArrivalSchedule, Profile

__all__ = ["LostShare", "Share"]


class LostShare:
    """The rest of one share, replayed without sending; see the module docstring.

    `skip`: arrivals of the share that the worker's reports hold (its last `scheduled_total`).
    `controls`: the master's log of live controls, (offset s, message), appended to as the run
    goes; each is applied when the replay passes its offset, as a worker applies it while it
    sleeps until its next arrival (that one is kept, as the worker sends it, and the change
    starts there: ArrivalSchedule.apply_control). A worker applies
    it when the message arrives, a few ms later: with live controls the replay may differ from
    what the worker would have sent by the arrivals of those few ms.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        shares: int,
        index: int,
        seed: int,
        skip: int,
        controls: list[tuple[float, dict[str, Any]]],
    ) -> None:
        self._schedule = ArrivalSchedule(profile, share=1.0 / shares, index=index, seed=seed)
        self._controls = controls
        self._applied = 0
        self._held: float | None = None
        self._skip = skip
        self.finished = False
        """The share's schedule is over: nothing more to count."""
        self.position_s = 0.0
        """Every arrival before this offset is counted."""

    def advance(self, until_s: float) -> Counter[int]:
        """Count the arrivals scheduled before offset `until_s` and not yet counted, by second."""
        out: Counter[int] = Counter()
        while True:
            if self._held is None:
                self._held = self._schedule.next_s()
                if self._held is None:
                    self.finished = True
                    break
            if self._applied < len(self._controls):
                at_s, control = self._controls[self._applied]
                if at_s < self._held:
                    self._schedule.apply_control(control, at_s)
                    self._applied += 1
                    continue
            if self._held >= until_s:
                break
            if self._skip > 0:
                self._skip -= 1
            else:
                out[int(self._held)] += 1
            self._held = None
        self.position_s = max(self.position_s, until_s)
        return out


@dataclass
class Share:
    """One worker's part of the schedule, as the master tracks it."""

    index: int
    worker: str | None
    """Locust client id of the worker following it; None: no worker joined for it."""
    state: str = "running"
    """running | ending (its worker quit or was stopped before the end; lost unless the run
    ends first) | done (final report in) | lost."""
    lost_reason: str | None = None
    """Why it was lost: never joined | missing (no heartbeat) | quit | silent | stopped."""
    lost: LostShare | None = field(default=None, repr=False)
    ended_at: float = 0.0
    """time.monotonic() when it went `ending`."""

    def end(self, reason: str) -> None:
        """Its worker quit (`quit`) or its user was stopped (`stopped`) before the end."""
        self.state, self.lost_reason, self.ended_at = "ending", reason, time.monotonic()

    def ended_for_s(self) -> float:
        return time.monotonic() - self.ended_at

    @property
    def key(self) -> str:
        """The name its records go under in the master's Aggregate."""
        return self.worker or f"share-{self.index}"

    def to_json(self) -> dict[str, Any]:
        return {
            "share": self.index,
            "worker": self.worker,
            "state": self.state,
            "lost_reason": self.lost_reason,
        }
