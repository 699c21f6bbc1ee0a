"""The Chaos Toolkit control of llmchaos: target, load, guard and cleanup around an experiment.

Declare it once in the experiment:

    "controls": [{"name": "llmchaos",
                  "provider": {"type": "python", "module": "llmchaos.control",
                               "arguments": {"name": "gpu_kill"}}}]

- before the experiment: build RunSettings from the configuration and environment, check the
  whole experiment against the target (nothing starts when something is wrong: the run is
  interrupted with a message naming the field), open the run folder, start the embedded
  stack, start the load, warm up, start the safety guard;
- after the steady-state hypothesis: if it was not met *before* the method, interrupt the run
  (Chaos Toolkit would skip the method and exit 0);
- after the experiment (and in cleanup_control, whatever happened): undo every fault left in
  the ledger, stop the load, write the report while the stack stops, print the summary.

SIGINT and SIGTERM are turned into KeyboardInterrupt from the first hook on (Chaos Toolkit's
own SIGTERM handler raises an exception that a running probe would swallow, and a `chaos run`
started in the background may have inherited SIGINT as ignored), so both interrupt the
experiment in any phase, roll back and come here. From the first interrupt on, and while the
run is being undone and stopped, further SIGINT/SIGTERM are noted and ignored, so the cleanup
itself is not cut short. The run's phase is kept in run.json, so a run killed with SIGKILL
can still be finished and reported by `llmchaos cleanup`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

from chaoslib.exceptions import InterruptExecution

from llmchaos import signals
from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.measure import window_error_rate
from llmchaos.redact import redact
from llmchaos.report import write_run_report
from llmchaos.report.chart import import_matplotlib_in_background
from llmchaos.report.summary import hypothesis_outcome
from llmchaos.run import ChaosRun, planned_target
from llmchaos.settings import RunSettings
from llmchaos.targets import target_kind
from llmchaos.validation import check_experiment, other_configuration_keys

__all__ = [
    "after_experiment_control",
    "after_hypothesis_control",
    "before_experiment_control",
    "before_hypothesis_control",
    "before_method_control",
    "before_rollback_control",
    "cleanup_control",
]

log = logging.getLogger("chaostoolkit")

_GUARD_POLL_S = 1.0


class _Session:
    """The control's state between hooks (Chaos Toolkit calls plain functions)."""

    def __init__(self) -> None:
        self.run: ChaosRun | None = None
        self.method_started = False
        self.guard_stop = threading.Event()
        self.guard_lock = threading.Lock()
        """Held by the guard while it acts and by the finish while it stops the guard, so
        the two never undo at the same time."""
        self.guard_thread: threading.Thread | None = None
        self.before_state: dict[str, Any] | None = None
        """The steady state before the method, kept for the journal when it failed there
        (Chaos Toolkit records it only after the control has interrupted the run)."""
        self.interrupted_by: str | None = None
        """The signal that interrupted the run (see _raise_if_interrupted)."""


_session: _Session | None = None
_saved_handlers: dict[int, Any] = {}
_HELD = (*signals.INTERRUPTS, signal.SIGUSR1)
"""Signals held off while a run is undone and stopped (SIGUSR1: a late safety-guard stop)."""


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _session is not None:
        _session.interrupted_by = name
    if _session is not None and _session.run is not None:
        run = _session.run
        run.interrupted_because = f"interrupted by {name} during {run.phase}"
    # the rollbacks and the cleanup come next: a second Ctrl-C must not cut them short
    _set_signals(_hold_signals, _HELD)
    raise KeyboardInterrupt(name)


def _raise_if_interrupted() -> None:
    """Raise again an interrupt whose KeyboardInterrupt was lost: raised while Python ran a
    finalizer (`__del__`), it is printed as "Exception ignored" and dropped, and the run went
    on to pass (seen once in `starting-load` with both cores busy). Called between the steps
    that come before Chaos Toolkit has seen an interruption, never in rollbacks or cleanup;
    one lost after the method marks the journal interrupted in `_finish`."""
    if _session is not None and _session.interrupted_by is not None:
        raise KeyboardInterrupt(_session.interrupted_by)


def _hold_signals(signum: int, _frame: FrameType | None) -> None:
    log.warning(
        "llmchaos: %s received while undoing faults and stopping the run; finishing cleanup "
        "first (kill -9 and `llmchaos cleanup` if it hangs)",
        signal.Signals(signum).name,
    )


def _set_signals(handler: Any, which: tuple[int, ...]) -> None:
    """Install `handler`, remembering the handlers found first, which the end restores."""
    for sig, previous in signals.install(handler, which).items():
        _saved_handlers.setdefault(sig, previous)


def _log_progress(line: str) -> None:
    log.info("llmchaos: %s", line)


def _restore_signals() -> None:
    signals.restore(_saved_handlers)
    _saved_handlers.clear()


def before_experiment_control(
    context: dict[str, Any],
    configuration: dict[str, Any] | None = None,
    secrets: dict[str, Any] | None = None,
    name: str = "",
    **kwargs: Any,
) -> None:
    """Check everything, then start the target, the load and the guard (see module doc)."""
    global _session
    _session = _Session()
    _set_signals(_interrupt, signals.INTERRUPTS)
    title = str(context.get("title", "experiment"))
    # Chaos Toolkit swallows any other exception of a control and runs the experiment on
    # without it, so every failure here becomes an interruption.
    try:
        settings = RunSettings.from_configuration(
            configuration, other_keys=other_configuration_keys(context)
        )
        assert settings.target_settings is not None
        if target_kind(settings.target).prepare(settings.target_settings, _log_progress):
            settings = RunSettings.from_configuration(
                configuration, other_keys=other_configuration_keys(context)
            )
        info = planned_target(settings)
        problems = check_experiment(context, dict(configuration or {}), info, settings)
        if problems:
            raise InvalidInput("the experiment is invalid:\n  " + "\n  ".join(problems))
        run = ChaosRun.open(settings, name or title, title)
    except Exception as exc:
        _session = None
        _restore_signals()  # nothing started: nothing for the finish to do
        what = str(exc) if isinstance(exc, LLMChaosError) else f"{type(exc).__name__}: {exc}"
        raise InterruptExecution(f"llmchaos: {what}") from None
    _session.run = run
    if (context.get("runtime") or {}).get("rollbacks", {}).get("strategy") != "always":
        run.notes.append(
            "runtime.rollbacks.strategy is not 'always': an interrupted run skips the "
            "experiment's rollbacks (this control still undoes every fault in the ledger)"
        )
    try:
        for phase, step in (
            ("starting-target", run.start_target),
            ("starting-load", run.start_load),
            ("warming-up", run.warm_up),
        ):
            run.enter_phase(phase)
            step()
            _raise_if_interrupted()
    except Exception as exc:  # see above: the experiment must not go on without its target
        what = str(exc) if isinstance(exc, LLMChaosError) else f"{type(exc).__name__}: {exc}"
        run.interrupted_because = f"could not start the run: {what}"
        raise InterruptExecution(f"llmchaos: {run.interrupted_because}") from None
    _start_guard(run)


def before_hypothesis_control(context: dict[str, Any], **kwargs: Any) -> None:
    _raise_if_interrupted()
    if _session is not None and _session.run is not None:
        after = _session.method_started
        _session.run.enter_phase("steady-state-after" if after else "steady-state-before")


def after_hypothesis_control(
    context: dict[str, Any],
    state: dict[str, Any] | None = None,
    experiment: dict[str, Any] | None = None,
    configuration: dict[str, Any] | None = None,
    secrets: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """Before the method, an unmet steady state interrupts the run (a failure, exit 1).
    After it, the probes Chaos Toolkit left unjudged are judged for the resilience score."""
    if _session is None or not state:
        return
    if _session.method_started:
        if state.get("steady_state_met") is False and experiment is not None:
            _judge_the_rest(context, state, experiment, configuration, secrets)
        return
    _session.before_state = state
    if state.get("steady_state_met") is False:
        _, why = hypothesis_outcome({"steady_states": {"before": state}}, "before")
        reason = f"steady state not met before the method: {why}"
        if _session.run is not None:
            _session.run.interrupted_because = reason
        raise InterruptExecution(
            f"llmchaos: {reason}; the target is not healthy, so no fault is injected and the "
            "run fails"
        )


def _judge_the_rest(
    hypothesis: dict[str, Any],
    state: dict[str, Any],
    experiment: dict[str, Any],
    configuration: dict[str, Any] | None,
    secrets: dict[str, Any] | None,
) -> None:
    """Chaos Toolkit stops a hypothesis at its first miss; the resilience score (Krkn's)
    weighs every SLO, so the probes after it are run and judged here, kept beside Chaos
    Toolkit's own in state["llmchaos_rest"] (its verdict unchanged)."""
    from chaoslib.activity import execute_activity
    from chaoslib.hypothesis import within_tolerance

    rest = []
    for activity in (hypothesis.get("probes") or [])[len(state.get("probes") or []) :]:
        run = execute_activity(experiment, activity, configuration or {}, secrets or {}, None)
        met = run["status"] != "failed" and within_tolerance(
            activity.get("tolerance"), run.get("output"), configuration, secrets
        )
        rest.append({"activity": activity, "status": run["status"], "tolerance_met": met})
    state["llmchaos_rest"] = rest


def before_method_control(context: dict[str, Any], **kwargs: Any) -> None:
    _raise_if_interrupted()
    if _session is not None:
        _session.method_started = True
        if _session.run is not None:
            _session.run.enter_phase("method")


def before_rollback_control(context: dict[str, Any], **kwargs: Any) -> None:
    if _session is not None and _session.run is not None:
        _session.run.enter_phase("rollbacks")


def after_experiment_control(
    context: dict[str, Any], state: dict[str, Any] | None = None, **kwargs: Any
) -> None:
    """Undo, stop, report (see module doc)."""
    _finish(state)


def cleanup_control(**kwargs: Any) -> None:
    """Last resort: finish a run that after_experiment_control did not (it always runs)."""
    _finish(None)


def _finish(journal: dict[str, Any] | None) -> None:
    global _session
    session = _session
    if session is None:
        return
    run = session.run
    _set_signals(_hold_signals, _HELD)  # first: nothing may cut the cleanup short
    try:
        with session.guard_lock:
            session.guard_stop.set()
        if session.guard_thread is not None:
            session.guard_thread.join(timeout=30)
        states = (journal or {}).get("steady_states")
        if isinstance(states, dict) and not states.get("before") and session.before_state:
            states["before"] = session.before_state  # chaos writes the journal after us
        if journal is not None:
            journal.update(redact(journal))  # and its journal file without secrets
            if session.interrupted_by is not None and journal.get("status") == "completed":
                # its KeyboardInterrupt was lost after the method (steady-state-after,
                # rollbacks: nothing raises it again there); the run still ends interrupted
                journal["status"] = "interrupted"
        if run is not None and not run.finished:
            _finish_run(run, journal)
    finally:
        _session = None
        if run is not None and not run.finished:
            run.close("failed")
        _restore_signals()


def _step(what: str, action: Callable[[], Any]) -> tuple[bool, Any]:
    """Run one step of the finish; a failure is logged and the next steps still run."""
    try:
        return True, action()
    except Exception:
        log.exception("llmchaos: %s failed; going on with the rest of the cleanup", what)
        return False, None


def _frame_drops_since_fault(run: ChaosRun) -> int | None:
    first_fault = min((f.at for f in run.faults()), default=None)
    if run.load is None or not run.load.running or first_fault is None:
        return None
    return int(run.load.window(since_ts=first_fault)["frame_drops"])


def _finish_run(run: ChaosRun, journal: dict[str, Any] | None) -> None:
    """Undo, stop the load, then report while the target stops: each step whatever became
    of the last. The run is closed `finished`, or `faults-open` when an undo failed
    (llmchaos cleanup tries those again), or `failed` when another step did."""
    if journal is not None:
        _step("saving the journal", lambda: run.save_journal(journal))
    importing = import_matplotlib_in_background()  # for the chart, while the load drains
    run.enter_phase("undoing-faults")
    ok_undo, _ = _step("undoing the faults", lambda: run.undo_faults(by="control"))
    ok_drops, frame_drops = _step("reading frame drops", lambda: _frame_drops_since_fault(run))
    run.enter_phase("stopping-load")
    ok_load, summary = _step("stopping the load", run.stop_load)

    _, recovery = _step("reading the target's recovery", run.target_recovery)

    def report() -> None:
        status = (journal or {}).get("status")
        result = write_run_report(run.facts(summary, frame_drops, recovery), journal)
        print(f"\nllmchaos summary\n{result.table()}\n", flush=True)
        if journal is not None and journal.get("status") != status:
            run.save_journal(journal)  # the report set it failed: a FAIL verdict exits 1

    # The report needs nothing more from the target, and stopping a stack (tens of processes
    # waited for, namespaces deleted) and drawing the chart each take seconds: both at once.
    # Leaving the block waits for the stop, whatever happened: the finish must not return
    # (and restore the signals) while the stack stops.
    with ThreadPoolExecutor(1, thread_name_prefix="llmchaos-stop-target") as pool:
        stopping = pool.submit(_step, "stopping the target", run.stop_target)
        run.enter_phase("report")
        ok_report, _ = _step("writing the report", report)
        run.enter_phase("stopping-target")
    ok_target, _ = stopping.result()
    importing.join()  # ended with the chart's own import, unless the report failed earlier
    run.phase = "ended"
    if run.ledger.open_faults():
        run.close("faults-open")
    elif all((ok_undo, ok_drops, ok_load, ok_report, ok_target)):
        run.close("finished")
    else:
        run.close("failed")


def _start_guard(run: ChaosRun) -> None:
    assert _session is not None
    args = (run, _session.guard_stop, _session.guard_lock)
    thread = threading.Thread(target=_guard, args=args, name="llmchaos-guard", daemon=True)
    _session.guard_thread = thread
    thread.start()


def _guard_error_rate(run: ChaosRun) -> float:
    """The worse of the last window and the last window whose requests have all timed out
    or answered: a hanging target fails by timeouts, which show `request_timeout_s` late."""
    s = run.settings
    now = time.time()
    recent = run.traffic.window(last_s=s.window_s)
    settled_until = now - s.request_timeout_s - 1
    settled = run.traffic.window(since_ts=settled_until - s.window_s, until_ts=settled_until)
    return max(window_error_rate(w, s.error_classes) for w in (recent, settled))


def _guard(run: ChaosRun, stop: threading.Event, lock: threading.Lock) -> None:
    """Abort the run when the error rate stays above the limit for too long."""
    s = run.settings
    above_since: float | None = None
    while not stop.wait(_GUARD_POLL_S):
        try:
            rate = _guard_error_rate(run)
        except LLMChaosError:
            continue
        now = time.time()
        if rate <= s.guard_error_rate:
            above_since = None
            continue
        above_since = above_since or now
        if now - above_since < s.guard_for_s:
            continue
        with lock:
            if stop.is_set():  # the run is finishing: its own undo runs
                return
            reason = (
                f"error rate above {s.guard_error_rate:.0%} for {s.guard_for_s:g} s "
                f"(last window {rate:.0%}): faults undone, run aborted"
            )
            log.critical("llmchaos: safety guard: %s", reason)
            run.aborted_by_guard = reason
            run.undo_faults(by="guard")
            # SIGUSR1 is Chaos Toolkit's "stop now, gracefully" (rollbacks still run)
            os.kill(os.getpid(), signal.SIGUSR1)
            return
