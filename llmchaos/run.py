"""One chaos run: its folder, its target, its load, its fault ledger, and how it ends.

    run = ChaosRun.open(settings, "gpu_kill", title)      # reports/runs/<time>-gpu_kill/
    run.start_target(); run.start_load(); run.warm_up()
    ... probes and actions use current_run() ...
    run.undo_faults(...); run.stop_load(); run.stop_target(); run.close(status)
                                                          # (the control, with the report)

The control (llmchaos.control) drives these steps; probes and actions reach the run through
`current_run()`, since Chaos Toolkit calls them as plain functions in the same process.

`run.json` in the run folder says who owns the run (pid), which phase it is in and what it
started (stack state folder, load folder), so `llmchaos cleanup` can finish what a killed
`chaos run` left: it undoes the ledger's open faults, stops the load, rebuilds the report from
the timeline and the ledger on disk ("rebuilt after the run was killed at <phase>"), and the
stack cleanup that follows stops the stack. A run whose owner still lives is never touched
unless it is named (`--run ID`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.files import read_json_object, write_json_atomic
from llmchaos.ledger import LEDGER_FILE, FaultDetails, FaultEntry, FaultLedger, Undo, Verification
from llmchaos.load import LoadConfig, LoadRun, Summary
from llmchaos.load.api import find_load_processes
from llmchaos.machine import CpuSample, MachineCpu
from llmchaos.processes import Owner, start_ticks, stop_pids
from llmchaos.redact import redact, redact_text
from llmchaos.report import RunFacts, RunResult, write_run_report
from llmchaos.settings import RunSettings
from llmchaos.surge import LongPromptSurge
from llmchaos.targets import Target, TargetInfo, target_kind

__all__ = [
    "JOURNAL_FILE",
    "RUN_FILE",
    "ChaosRun",
    "NoActiveRun",
    "current_run",
    "finish_dead_runs",
    "planned_target",
    "rebuild_report",
]

log = logging.getLogger("chaostoolkit")

RUN_FILE = "run.json"
JOURNAL_FILE = "journal.json"
LOAD_UNDO_OPS = frozenset({"set_qps", "stop_surge"})
"""Undo operations that act on the load (or the surge beside it) rather than on the target."""


class NoActiveRun(LLMChaosError):
    """A probe or action was called without a run (the control is not declared)."""


_current: ChaosRun | None = None
_current_lock = threading.Lock()


def current_run() -> ChaosRun:
    """The run of this process; raises NoActiveRun with what to add to the experiment."""
    run = _current
    if run is None:
        raise NoActiveRun(
            "no llmchaos run in this process: declare the control in the experiment, "
            '"controls": [{"name": "llmchaos", "provider": {"type": "python", '
            '"module": "llmchaos.control"}}]'
        )
    return run


def planned_target(settings: RunSettings) -> TargetInfo:
    """The target's names before anything changes (for checking an experiment first): the
    embedded stack's layout, what the cluster runs now (read-only API calls), the hosts
    file's names."""
    assert settings.target_settings is not None
    return target_kind(settings.target).plan(settings.target_settings)


def _close_faults(ledger: FaultLedger, run_data: dict[str, Any]) -> list[str]:
    """Close a dead run's open faults: those of the load (gone with it), then the target's,
    through its kind (undone on a cluster; removed with the embedded stack)."""
    for fault in ledger.open_faults():
        if fault.undo is not None and fault.undo.op in LOAD_UNDO_OPS:
            ledger.mark_undone(fault.id, by="cleanup (the load is gone)")
    if not ledger.open_faults():
        return []
    settings = RunSettings.from_record(run_data["settings"])
    assert settings.target_settings is not None
    record = run_data.get("target_record") or {}
    return target_kind(settings.target).finish_dead_run(settings.target_settings, record, ledger)


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", text).strip("-")[:60] or "experiment"


@dataclass
class ChaosRun:
    """See the module docstring."""

    settings: RunSettings
    name: str
    """Short name of the experiment (its file name without .json)."""
    title: str
    run_dir: Path
    ledger: FaultLedger
    backend: Target | None = None
    load: LoadRun | None = None
    load_start_ts: float | None = None
    current_qps: float = 0.0
    """The load's rate now (actions may change it)."""
    notes: list[str] = field(default_factory=list)
    """Things the run decided or noticed, for the report (qps capped, guard tripped...)."""
    findings: dict[str, Any] = field(default_factory=dict)
    """What a probe of the method measured for the hypothesis after it (the degradation
    trigger's delay, the autoscaler's times), by name."""
    aborted_by_guard: str | None = None
    interrupted_because: str | None = None
    """Why the control interrupted the run (steady state unmet before the method, start
    failed): the journal itself only says `interrupted`."""
    finished: bool = False
    phase: str = "opening"
    """Where the run is (starting-target, warming-up, method, report, ...): in run.json, so a
    report rebuilt after a kill can say where the run died."""
    started_at: float = field(default_factory=time.time)
    target_stopped_at: float | None = None
    """When stop_target() returned: from then on the run only reports and exits (a suite
    starts its next run then)."""
    surge: LongPromptSurge | None = None
    """The long-prompt surge sent beside the load, if one was started."""
    load_cpu_start: CpuSample | None = None
    machine_cpu: MachineCpu | None = None
    """This machine's spare CPU from the load's start to its stop (llmchaos.machine)."""
    _surge_fault_id: int = 0
    """The ledger id of the surge's fault: where stop_surge writes when it stopped acting."""
    _state_lock: threading.Lock = field(default_factory=threading.Lock)
    """run.json is written from the finish's two threads (the report, the target's stop)."""

    load_factory: ClassVar[Callable[[LoadConfig], LoadRun]] = LoadRun.start
    """How the load starts: a Locust process of its own (the run layer's tests give it a
    scripted load instead)."""

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, settings: RunSettings, name: str, title: str) -> ChaosRun:
        """Create the run folder and make this the process's current run."""
        global _current
        run_dir = Path(settings.runs_root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(name)}"
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = run_dir.with_name(f"{run_dir.name.rsplit('~', 1)[0]}~{suffix}")
        run_dir.mkdir(parents=True)
        run = cls(settings, name, title, run_dir.resolve(), FaultLedger(run_dir / LEDGER_FILE))
        run.write_state("running")
        with _current_lock:
            _current = run
        return run

    def write_state(self, status: str, **extra: Any) -> None:
        """(Re)write run.json: owner pid, status, phase, what was started."""
        with self._state_lock:  # what a thread set before it got here is in the last write
            self._write_state(status, **extra)

    def _write_state(self, status: str, **extra: Any) -> None:
        data = {
            "pid": os.getpid(),
            "pid_start_ticks": start_ticks(os.getpid()),
            "status": status,
            "phase": self.phase,
            "name": self.name,
            "title": self.title,
            "target": self.settings.target,
            "target_record": self.backend.record() if self.backend else None,
            "load_run_dir": str(self.load.run_dir.resolve()) if self.load else None,
            "load_start_ts": self.load_start_ts,
            "qps_run": self.settings.effective_qps,
            "started_at": self.started_at,
            "target_stopped_at": self.target_stopped_at,
            "interrupted_because": self.interrupted_because,
            "notes": self.notes,
            "settings": self.settings.to_dict(),
            **extra,
        }
        write_json_atomic(self.run_dir / RUN_FILE, redact(data))

    def enter_phase(self, phase: str) -> None:
        """Note in run.json that the run is now in `phase`."""
        self.phase = phase
        if not self.finished:
            self.write_state("running")

    def save_journal(self, journal: dict[str, Any]) -> None:
        """The journal as Chaos Toolkit handed it to the control, before the finish, so a kill
        during the finish still leaves the verdict's inputs on disk."""
        write_json_atomic(self.run_dir / JOURNAL_FILE, redact(journal))

    def facts(
        self,
        load_summary: Summary | None,
        frame_drops: int | None,
        target_recovery: dict[str, Any] | None = None,
    ) -> RunFacts:
        """What the report needs, from this live run."""
        return RunFacts(
            name=self.name,
            title=self.title,
            run_dir=self.run_dir,
            settings=self.settings,
            qps_run=self.settings.effective_qps,
            faults=self.faults(),
            load_start_ts=self.load_start_ts,
            timeline_path=self.load.timeline_path if self.load else None,
            load_summary=load_summary.to_dict() if load_summary else None,
            frame_drops_since_fault=frame_drops,
            guard=self.aborted_by_guard,
            interrupted_because=self.interrupted_because,
            notes=self.notes,
            started_at=self.started_at,
            target_recovery=target_recovery,
            machine=self.machine_cpu.to_dict() if self.machine_cpu else None,
        )

    def target_recovery(self) -> dict[str, Any] | None:
        """The target's recovery facts since the first fault (None: no fault, or it cannot
        tell)."""
        first_fault = min((f.at for f in self.faults()), default=None)
        if self.backend is None or first_fault is None:
            return None
        return self.backend.recovery_facts(first_fault)

    # -- starting ------------------------------------------------------------------------
    def start_target(self) -> Target:
        """Start the target (the embedded stack) or connect to it; recorded in run.json."""
        s = self.settings
        assert s.target_settings is not None
        log.info("llmchaos: opening the %s target (variant %s)", s.target, s.variant)
        owner = Owner.this_process("run", str(self.run_dir))
        self.backend = target_kind(s.target).open(s.target_settings, owner)
        self.write_state("running")
        return self.backend

    def start_load(self) -> LoadRun:
        """Start the open-loop load against the target, owned by this process."""
        backend = self._backend()
        s = self.settings
        assert s.target_settings is not None
        kind = target_kind(s.target)
        if s.effective_qps < s.qps:
            source = kind.max_qps_source(s.target_settings)
            note = (
                f"qps: the experiment asks {s.qps:g}; the {s.target} target takes "
                f"{s.effective_qps:g} ({source})"
            )
            self.notes.append(note)
            log.warning("llmchaos: %s", note)
        for note in kind.layout_notes(
            s.target_settings, s.effective_qps * s.peak_factor, s.traffic
        ):
            self.notes.append(note)
            log.warning("llmchaos: %s", note)
        # beyond this machine's rate the target's own workers (a cluster's) send it all,
        # dialling this run's master; it waits for them before time zero
        cluster = backend.plan_load_workers(s.effective_qps)
        remote: dict[str, Any] = {}
        if cluster is not None:
            remote = {
                "remote_workers": cluster.replicas,
                "master_bind_host": "0.0.0.0",
                "master_port": int(cluster.master_address.rpartition(":")[2]),
                "join_timeout_s": cluster.join_timeout_s,
            }
        config = LoadConfig(
            url=backend.gateway_url,
            qps=s.effective_qps,
            duration_s=s.max_duration_s,
            workers=0 if cluster else s.load_processes,
            profile=s.load_profile,
            tokens_file=backend.tokens_file,
            traffic=s.traffic,
            timeout_s=s.request_timeout_s,
            inflight_cap=s.load_inflight_cap,
            goodput_ttft_ms=s.ttft_slo_ms,
            goodput_tpot_ms=s.tpot_slo_ms,
            goodput_e2e_ms=s.p99_slo_ms,
            run_dir=str(self.run_dir / "load"),
            owner_pid=os.getpid(),
            **remote,
        )
        log.info(
            "llmchaos: starting the load: %g QPS %s to %s",
            config.qps,
            s.load_profile,
            redact_text(config.url),
        )
        self.load = self.load_factory(config)
        self.current_qps = config.qps
        self.write_state("running")
        if cluster is not None:
            self.start_cluster_load(config.qps)
        self.load_start_ts = self.load.wait_started()  # the join timeout + 30 s at most
        self.load_cpu_start = CpuSample.now()
        return self.load

    def start_cluster_load(self, qps: float) -> dict[str, Any] | None:
        """Start the target's own load workers for `qps` when it has them (a cluster's Locust
        worker Deployment, dialling the run's master), recorded in the ledger first so the
        run's end or `llmchaos cleanup` removes them; None when this machine sends the whole
        rate. `start_load` calls it once the master listens."""
        planned = self._backend().plan_load_workers(qps)
        if planned is None:
            return None
        with self.fault("cluster_load", planned.name, planned.undo) as details:
            details.update(self._backend().run_load_workers(qps))
        return dict(details)

    def warm_up(self) -> None:
        """Let the load run `warmup_s` before the first steady-state check."""
        remaining_s = (self.load_start_ts or time.time()) + self.settings.warmup_s - time.time()
        if remaining_s > 0:
            log.info("llmchaos: warming up for %.0f s", remaining_s)
            time.sleep(remaining_s)

    def _backend(self) -> Target:
        if self.backend is None:
            raise NoActiveRun("the run's target is not started")
        return self.backend

    def _load(self) -> LoadRun:
        if self.load is None:
            raise NoActiveRun("the run's load is not started")
        return self.load

    @property
    def target(self) -> Target:
        return self._backend()

    @property
    def traffic(self) -> LoadRun:
        return self._load()

    # -- faults --------------------------------------------------------------------------
    @contextlib.contextmanager
    def fault(
        self,
        fault: str,
        target: str,
        undo: Undo | None,
        verify: Callable[[FaultDetails], Verification] | None = None,
        lasts_s: float = 0.0,
    ) -> Iterator[FaultDetails]:
        """Ledger first, then the action (the body), then the check that it took effect,
        whose evidence the ledger keeps: `verify(details)`, by default the target's own
        (`Target.verify`). See FaultLedger.inject; `lasts_s`, FaultEntry."""
        log.info("llmchaos: fault %s on %s", fault, target)
        with self.ledger.inject(fault, target, undo, lasts_s) as details:
            yield details
        check = verify or (lambda d: self._backend().verify(fault, d))
        try:
            verification = check(details)
        except LLMChaosError as exc:  # a check that cannot run proves nothing either way
            verification = Verification(None, f"the check could not run: {exc}")
        level = logging.WARNING if verification.in_effect is False else logging.INFO
        log.log(
            level,
            "llmchaos: %s in effect: %s (%s)",
            fault,
            verification.in_effect,
            verification.evidence,
        )
        self.ledger.record_verification(details.fault_id, verification)

    def start_surge(
        self,
        fault_id: int,
        qps: float,
        duration_s: float,
        prompt_tokens: int,
        max_tokens: int,
        stream: bool,
    ) -> dict[str, Any]:
        """Start a long-prompt surge beside the load (llmchaos.surge), as the first valid
        tenant of the target's tokens file, for the ledger's fault `fault_id`; returns what
        was started."""
        from llmchaos.load.traffic import load_tenants

        backend = self._backend()
        tenants = (
            [t for t in load_tenants(backend.tokens_file) if not t.revoked]
            if (backend.tokens_file)
            else []
        )
        self.stop_surge()
        self.surge = LongPromptSurge(
            backend.gateway_url,
            tenants[0].token if tenants else None,
            self.settings.traffic.model,
            qps=qps,
            duration_s=duration_s,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stream=stream,
        )
        self._surge_fault_id = fault_id
        self.surge.start()
        return {
            "tenant": tenants[0].tenant if tenants else None,
            "qps": qps,
            "duration_s": duration_s,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "stream": stream,
        }

    def stop_surge(self) -> None:
        """Stop the surge, if any, and note what became of its requests and how long it acted
        (its fault's end in the ledger)."""
        surge, self.surge = self.surge, None
        if surge is not None:
            counts = surge.stop()
            self.notes.append(f"long-prompt surge answers: {counts}")
            self.ledger.record_acted_until(self._surge_fault_id, surge.acting_until())

    def max_qps(self) -> float | None:
        """The most the target takes (the embedded stack: this machine's calibrated rate, or
        embedded_max_qps), None: no cap."""
        return self.settings.target_max_qps

    def last_fault_ts(self) -> float | None:
        return self.ledger.last_fault_at()

    def faults_active_until(self) -> float | None:
        """When the faults that act for a while by themselves stop (FaultLedger), a surge's
        answers still out included."""
        until = self.ledger.active_until()
        surge = self.surge
        if until is not None and surge is not None:
            until = max(until, surge.acting_until())
        return until

    def faults(self) -> list[FaultEntry]:
        return self.ledger.entries()

    def run_undo(self, undo: Undo) -> None:
        """Run one undo operation on the load or the target."""
        if undo.op == "stop_surge":
            self.stop_surge()
            return
        if undo.op in LOAD_UNDO_OPS:
            if self.load is not None and self.load.running:
                self.load.set_qps(float(undo.args["qps"]))
                self.current_qps = float(undo.args["qps"])
            return
        self._backend().undo(undo.op, undo.args)

    def undo_faults(self, by: str) -> list[str]:
        """Undo every open fault (most recent first); returns what was done."""
        lines = self.ledger.undo_all(self.run_undo, by)
        for line in lines:
            log.info("llmchaos: %s", line)
        return lines

    # -- ending --------------------------------------------------------------------------
    def stop_load(self) -> Summary | None:
        """Stop the load and return its summary (None when it never started or broke). Load
        processes of this run that no handle reaches (a start that failed half-way) are
        stopped too, found by their marker: the owner watchdog would, but only seconds after
        the run has ended."""
        summary: Summary | None = None
        if self.load_cpu_start is not None and self.machine_cpu is None:
            self.machine_cpu = MachineCpu.since(self.load_cpu_start)
            if self.machine_cpu.short_of_cpu:
                self.notes.append(
                    f"this machine was short of CPU while the load ran "
                    f"({self.machine_cpu.describe()}): the figures include the load's and the "
                    f"target's wait for a core"
                )
        if self.load is not None:
            try:
                summary = self.load.stop()
            except LLMChaosError as exc:
                self.notes.append(f"load did not stop cleanly: {exc}")
                self.load.close()
                with contextlib.suppress(LLMChaosError):
                    summary = Summary.read(self.load.summary_path)
        run_dir = self.run_dir.resolve()
        strays = [
            p for p, where in find_load_processes().items() if Path(where).is_relative_to(run_dir)
        ]
        if strays:
            self.notes.append(f"load processes {' '.join(map(str, strays))} had no handle: stopped")
            stop_pids(strays, grace_s=3.0)
        return summary

    def stop_target(self) -> None:
        """Close the target: the embedded stack is stopped, a cluster is left as it is (its
        faults are undone)."""
        if self.backend is not None:
            log.info("llmchaos: closing the %s target", self.settings.target)
            self.backend.close()
        self.target_stopped_at = time.time()
        if not self.finished:
            self.write_state("running")

    def close(self, status: str) -> None:
        """Mark the run ended and no longer current."""
        global _current
        self.finished = True
        self.write_state(status)
        with _current_lock:
            if _current is self:
                _current = None


def finish_dead_runs(
    runs_root: Path, run_ids: Sequence[str] = (), dry_run: bool = False
) -> list[str]:
    """Finish what runs whose `chaos run` was killed left behind (or the runs named in
    `run_ids`, whatever their owner); see the module docstring.

    A run counts as dead when run.json says running and its owner process is gone (or its
    pid now belongs to another process); a run that ended with an undo that failed
    (`faults-open`) is tried again too. Its load processes are stopped and its open faults
    closed: on a cluster each is undone through the Kubernetes backend; on the embedded stack
    every fault lives in the stack's processes and namespaces, which the stack cleanup that
    follows removes. A killed run's report is rebuilt from what is on disk, and the run is
    marked abandoned. A run named in `run_ids` also has its target's leftovers removed here,
    though its owner may live. One line per thing done; raises InvalidInput for a named run
    that does not exist.
    """
    lines: list[str] = []
    loads = find_load_processes()
    named = set(run_ids)
    missing = sorted(r for r in named if not (Path(runs_root) / r / RUN_FILE).exists())
    if missing:
        raise InvalidInput(f"--run {missing[0]}: no run folder with a {RUN_FILE} under {runs_root}")
    for run_file in sorted(Path(runs_root).glob(f"*/{RUN_FILE}")):
        data = read_json_object(run_file)
        run_dir = run_file.parent.resolve()
        if data is None or (named and run_dir.name not in named):
            continue
        status = data.get("status")
        started = data.get("pid_start_ticks")
        owner = Owner("run", int(data.get("pid", 0)), started, str(run_dir))
        ended_or_live = status not in ("running", "faults-open") or (
            status == "running" and owner.alive()
        )
        if ended_or_live and run_dir.name not in named:
            continue  # not ours to clean
        pids = [pid for pid, where in loads.items() if Path(where).is_relative_to(run_dir)]
        ledger = FaultLedger(run_dir / LEDGER_FILE)
        faults = ledger.open_faults()
        lines.append(
            f"run {run_dir.name}: owner {owner.describe()}; load processes "
            f"{' '.join(map(str, pids)) or '-'}; open faults "
            f"{', '.join(f'{f.fault}({f.target})' for f in faults) or '-'}"
        )
        if dry_run:
            continue
        stop_pids(pids, grace_s=3.0)
        try:
            lines += _close_faults(ledger, data)
        except LLMChaosError as exc:  # a cluster out of reach: say so, go on with the rest
            lines.append(f"run {run_dir.name}: faults left open: {exc}")
        if status == "running":
            lines.append(_rebuild_line(run_dir, data))
        if run_dir.name in named:
            lines += _remove_target(data)
        data["status"] = "faults-open" if ledger.open_faults() else "abandoned"
        write_json_atomic(run_file, data)
    return lines


def _remove_target(run_data: dict[str, Any]) -> list[str]:
    settings = RunSettings.from_record(run_data["settings"])
    assert settings.target_settings is not None
    record = run_data.get("target_record") or {}
    return target_kind(settings.target).remove_run_target(settings.target_settings, record)


def _rebuild_line(run_dir: Path, data: dict[str, Any]) -> str:
    try:
        rebuilt = rebuild_report(run_dir, data)
    except (LLMChaosError, OSError, ValueError, KeyError, TypeError) as exc:
        return f"run {run_dir.name}: report not rebuilt: {type(exc).__name__}: {exc}"
    return f"run {run_dir.name}: report {rebuilt.rebuilt}: {run_dir / 'report.html'}"


def rebuild_report(run_dir: Path, data: dict[str, Any]) -> RunResult:
    """Write the report of a killed run again from its folder: run.json (`data`), the
    ledger, the load's timeline and summary, and the journal when the run got that far."""
    settings = RunSettings.from_record(data["settings"])
    load_dir = Path(data["load_run_dir"]) if data.get("load_run_dir") else None
    load_summary = read_json_object(load_dir / "summary.json") if load_dir else None
    rebuilt = f"rebuilt after the run was killed at {data.get('phase') or 'an unknown phase'}"
    facts = RunFacts(
        name=str(data.get("name", run_dir.name)),
        title=str(data.get("title", run_dir.name)),
        run_dir=run_dir,
        settings=settings,
        qps_run=float(data.get("qps_run") or settings.effective_qps),
        faults=FaultLedger(run_dir / LEDGER_FILE).entries(),
        load_start_ts=data.get("load_start_ts"),
        timeline_path=load_dir / "timeline.jsonl" if load_dir else None,
        load_summary=load_summary,
        frame_drops_since_fault=None,  # counted live from success instants, not kept on disk
        guard=None,
        interrupted_because=data.get("interrupted_because"),
        notes=[*data.get("notes", []), f"report {rebuilt} (frame drops are not on disk)"],
        started_at=float(data.get("started_at") or 0.0),
        rebuilt=rebuilt,
    )
    return write_run_report(facts, read_json_object(run_dir / JOURNAL_FILE))
