"""The fault ledger: every fault is written to disk before it is injected, with what undoes it.

One JSON object per line in `<run folder>/ledger.jsonl`, appended and fsynced:

    {"event": "inject", "id": 1, "at": 1733200000.1, "fault": "partition_node",
     "target": "node-a", "undo": {"op": "heal_partition", "args": {"node": "node-a"}}}
    {"event": "injected", "id": 1, "at": ...}                    # the action went through
    {"event": "failed", "id": 1, "at": ..., "error": "..."}      # it raised (may be half done)
    {"event": "verified", "id": 1, "at": ..., "in_effect": true,  # checked on the target
     "evidence": "DROP rules in llmc-1a2b-node-a matched 14 packets in 1.0 s"}
    {"event": "undone", "id": 1, "at": ..., "by": "rollback"}    # its undo ran
    {"event": "acted_until", "id": 1, "at": ..., "until": ...}   # a surge's last answer came

A fault is open from its `inject` line until an `undone` line, whatever happened in between:
an action that failed half-way may still have changed something, so its undo runs too. Undo
operations are idempotent (healing a healed node is a no-op), so undoing twice is harmless.
Faults without an undo (a killed process that its node agent restarts) are never open.

Every fault is checked after it went in (`Verification`): the field learned that a fault can
silently do nothing (a rule in the wrong namespace, a kill aimed at a pid that had exited), and
a run whose fault did nothing proves nothing. The evidence is kept with the fault; a fault found
not in effect fails the run's verdict.

Reading is tolerant of a last line cut off by a kill: it is skipped, not fatal.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LEDGER_FILE", "FaultDetails", "FaultEntry", "FaultLedger", "Undo", "Verification"]

LEDGER_FILE = "ledger.jsonl"


@dataclass(frozen=True)
class Undo:
    """A backend operation that reverses a fault, with its arguments (JSON values)."""

    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verification:
    """Whether a fault took effect, and what showed it (or showed it did not)."""

    in_effect: bool | None
    """True: seen in effect; False: seen not in effect (the run proves nothing); None: this
    target cannot tell (said in the evidence)."""
    evidence: str
    """What was looked at and found: pids, process states, packet counters, qdiscs, cgroup
    counters, keys."""


class FaultDetails(dict[str, Any]):
    """What an action reports about its fault (pids, keys, ...), with the fault's ledger id."""

    fault_id: int = 0


@dataclass
class FaultEntry:
    """One fault as the ledger knows it."""

    id: int
    fault: str
    """The action that injected it (kill_gpu_process, partition_node, ...)."""
    target: str
    """What it hit (a worker, a node, a gateway, the token cache, the load)."""
    at: float
    """Epoch seconds when the action started: the fault time t0."""
    undo: Undo | None
    lasts_s: float = 0.0
    """How long the fault keeps acting after `at` by itself (a surge or a burst of
    `duration_s`, longer once an `acted_until` says its last answer came later), or how much
    of a fault that acts until undone a recovery must outlast (the `hold_s` of throttle_cpu or
    hang_gpu_process); 0: its action is the whole of it (a kill), or it acts until undone and
    any stable run counts."""
    state: str = "inject"
    """inject (written, action not finished), injected, failed, undone."""
    details: dict[str, Any] = field(default_factory=dict)
    """What the action reported (pids killed, keys expired, ...)."""
    error: str | None = None
    in_effect: bool | None = None
    """The verification's verdict (see Verification); None also before it ran."""
    evidence: str | None = None
    """What the verification saw; None when it did not run (a failed action, a killed run)."""

    @property
    def open(self) -> bool:
        """Still to be undone."""
        return self.undo is not None and self.state != "undone"

    @property
    def active_until(self) -> float:
        """Epoch seconds when the fault stops acting by itself (`at` + `lasts_s`)."""
        return self.at + self.lasts_s


class FaultLedger:
    """The ledger file of one run; safe to use from several threads of one process."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # reentrant: an inject allocates its id and appends under one hold of it
        self._lock = threading.RLock()

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a+b") as f:
                # after a line cut off by a kill, start a new line rather than join it
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = "\n" + line
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())

    def entries(self) -> list[FaultEntry]:
        """All faults, in injection order."""
        faults: dict[int, FaultEntry] = {}
        for record in self._records():
            fault_id = record.get("id")
            if not isinstance(fault_id, int):
                continue
            event = record.get("event")
            if event == "inject":
                undo = record.get("undo")
                faults[fault_id] = FaultEntry(
                    id=fault_id,
                    fault=str(record.get("fault")),
                    target=str(record.get("target")),
                    at=float(record.get("at", 0.0)),
                    undo=Undo(undo["op"], dict(undo.get("args", {}))) if undo else None,
                    lasts_s=float(record.get("lasts_s", 0.0)),
                )
            elif fault_id in faults and event == "acted_until":
                entry = faults[fault_id]
                acted_s = float(record.get("until", entry.at)) - entry.at
                entry.lasts_s = max(entry.lasts_s, acted_s)
            elif fault_id in faults and event == "verified":
                faults[fault_id].in_effect = record.get("in_effect")
                faults[fault_id].evidence = str(record.get("evidence", ""))
            elif fault_id in faults and event in ("injected", "failed", "undone"):
                entry = faults[fault_id]
                entry.state = str(event)
                entry.details.update(record.get("details") or {})
                entry.error = record.get("error", entry.error)
        return list(faults.values())

    def _records(self) -> Iterator[dict[str, Any]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut off by a kill
            if isinstance(record, dict):
                yield record

    def open_faults(self) -> list[FaultEntry]:
        """Faults still to be undone, most recent first (the order to undo them in)."""
        return [e for e in reversed(self.entries()) if e.open]

    def last_fault_at(self) -> float | None:
        """Epoch seconds of the most recent fault, None before the first."""
        entries = self.entries()
        return max((e.at for e in entries), default=None)

    def active_until(self) -> float | None:
        """Epoch seconds when the last of the faults that act by themselves for a while stops
        (FaultEntry.active_until), None before the first fault."""
        entries = self.entries()
        return max((e.active_until for e in entries), default=None)

    @contextmanager
    def inject(
        self, fault: str, target: str, undo: Undo | None, lasts_s: float = 0.0
    ) -> Iterator[FaultDetails]:
        """Record a fault, then let the caller inject it.

        The `inject` line is on disk before the body runs. The body may fill the yielded
        dict with details (pids, keys); they are recorded with the outcome. An exception in
        the body is recorded as `failed` and raised again. `lasts_s`: see FaultEntry.
        """
        with self._lock:
            fault_id = max((e.id for e in self.entries()), default=0) + 1
            record = {
                "event": "inject",
                "id": fault_id,
                "at": time.time(),
                "fault": fault,
                "target": target,
                "undo": {"op": undo.op, "args": undo.args} if undo else None,
            }
            if lasts_s > 0:
                record["lasts_s"] = lasts_s
            self._append(record)
        details = FaultDetails()
        details.fault_id = fault_id
        try:
            yield details
        except BaseException as exc:
            self._append(
                {
                    "event": "failed",
                    "id": fault_id,
                    "at": time.time(),
                    "details": details,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
            raise
        self._append({"event": "injected", "id": fault_id, "at": time.time(), "details": details})

    def record_verification(self, fault_id: int, verification: Verification) -> None:
        """Keep what the check after the injection found."""
        self._append(
            {
                "event": "verified",
                "id": fault_id,
                "at": time.time(),
                "in_effect": verification.in_effect,
                "evidence": verification.evidence,
            }
        )

    def record_acted_until(self, fault_id: int, until_ts: float) -> None:
        """Keep when a fault that acts for a while really stopped (a surge's last answer),
        when that is later than its `lasts_s` said."""
        self._append({"event": "acted_until", "id": fault_id, "at": time.time(), "until": until_ts})

    def mark_undone(self, fault_id: int, by: str) -> None:
        self._append({"event": "undone", "id": fault_id, "at": time.time(), "by": by})

    def close_matching(self, undo: Undo, by: str) -> list[int]:
        """Mark open faults whose undo is `undo` as undone (an action such as heal_partition
        did it); returns their ids."""
        ids = [e.id for e in self.open_faults() if e.undo == undo]
        for fault_id in ids:
            self.mark_undone(fault_id, by)
        return ids

    def undo_all(self, run_undo: Callable[[Undo], None], by: str) -> list[str]:
        """Undo every open fault, most recent first. Returns one line per fault.

        An undo that fails, whatever the error, is reported and left open (so a later cleanup
        tries again); the others still run.
        """
        report = []
        for entry in self.open_faults():
            assert entry.undo is not None
            try:
                run_undo(entry.undo)
            except Exception as exc:  # one broken undo must not keep the others from running
                report.append(f"fault {entry.id} {entry.fault}({entry.target}): undo FAILED: {exc}")
                continue
            self.mark_undone(entry.id, by)
            report.append(f"fault {entry.id} {entry.fault}({entry.target}): undone by {by}")
        return report
