"""Run one experiment file through `chaos run` and collect what it left: the suites' runner.

    outcome = run_experiment(Path("experiments/gpu_kill.json"), variant="no-failover",
                             runs_root=Path("reports/suites/x"))
    outcome.exit_code, outcome.journal, outcome.result (summary.json), outcome.run_dir

`chaos run` runs as a child process: an experiment that hangs, crashes or is killed cannot
take the test session with it, and signals and the control's state stay per run. On timeout
it gets SIGTERM (the control then undoes its faults and stops its stack), and SIGKILL plus
`llmchaos cleanup`'s work if that does not end it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmchaos.files import read_json_object
from llmchaos.report.summary import RunResult
from llmchaos.run import RUN_FILE, finish_dead_runs
from llmchaos.signals import held

__all__ = [
    "ExperimentOutcome",
    "StartedExperiment",
    "failure_message",
    "run_experiment",
    "start_experiment",
]

_TERM_GRACE_S = 90.0
"""After SIGTERM, how long the control may take to undo, report and stop the stack."""
_POLL_S = 0.2
"""How often StartedExperiment.wait calls its `while_waiting`."""


@dataclass(frozen=True)
class ExperimentOutcome:
    """What one `chaos run` produced."""

    experiment: Path
    variant: str
    exit_code: int
    journal: dict[str, Any] | None
    """Chaos Toolkit's journal, None when chaos run died before writing it."""
    result: RunResult | None
    """summary.json of the run folder, None when the run never got one."""
    run_dir: Path | None
    log_path: Path
    duration_s: float
    timed_out: bool = False

    @property
    def output_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def run_experiment(
    experiment: Path,
    *,
    variant: str,
    runs_root: Path,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
) -> ExperimentOutcome:
    """`chaos run` `experiment` against `variant`, its run folder under `runs_root`."""
    return start_experiment(
        experiment, variant=variant, runs_root=runs_root, extra_env=extra_env
    ).wait(timeout_s)


def start_experiment(
    experiment: Path,
    *,
    variant: str,
    runs_root: Path,
    extra_env: dict[str, str] | None = None,
) -> StartedExperiment:
    """Start `chaos run` `experiment` against `variant`, its run folder under `runs_root`;
    `wait()` on what it returns for the outcome."""
    runs_root.mkdir(parents=True, exist_ok=True)
    journal_path = runs_root / "journal.json"
    log_path = runs_root / "chaos.log"
    chaos = str(Path(sys.executable).with_name("chaos"))
    argv = [chaos, "--log-file", str(runs_root / "chaostoolkit.log"), "run"]
    # --var reaches a declared `variant` key; the environment reaches an undeclared one
    argv += ["--journal-path", str(journal_path), "--var", f"variant={variant}", str(experiment)]
    env = {
        **os.environ,
        **(extra_env or {}),
        "LLMCHAOS_RUNS_ROOT": str(runs_root),
        "LLMCHAOS_VARIANT": variant,
    }
    with log_path.open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return StartedExperiment(experiment, variant, runs_root, proc, time.monotonic())


@dataclass
class StartedExperiment:
    """A `chaos run` under way (start_experiment)."""

    experiment: Path
    variant: str
    runs_root: Path
    process: subprocess.Popen[bytes]
    started_s: float
    """time.monotonic() at its start."""

    def target_stopped(self) -> bool:
        """Whether the run has stopped its load and then its target (run.json's
        `target_stopped_at`: all it still does is finish its report and exit), or has ended."""
        if self.process.poll() is not None:
            return True
        run_dir = _run_dir(self.runs_root)
        data = read_json_object(run_dir / RUN_FILE) if run_dir is not None else None
        return (data or {}).get("target_stopped_at") is not None

    def wait(
        self, timeout_s: float = 900.0, while_waiting: Callable[[], None] | None = None
    ) -> ExperimentOutcome:
        """Wait for the run's end (SIGTERM, then SIGKILL and cleanup, `timeout_s` after its
        start) and collect its outcome; `while_waiting()` is called at once and then every
        0.2 s until the run ends. A KeyboardInterrupt, or an error in `while_waiting`, stops
        the run first."""
        deadline_s = self.started_s + timeout_s
        timed_out = False
        try:
            while True:
                if while_waiting is not None:
                    while_waiting()
                remaining_s = max(0.0, deadline_s - time.monotonic())
                try:
                    code = self.process.wait(
                        timeout=min(remaining_s, _POLL_S) if while_waiting else remaining_s
                    )
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline_s:
                        timed_out = True
                        code = _stop(self.process, self.runs_root)
                        break
        except BaseException:  # a Ctrl-C: in its own session, the run would go on without us
            self.stop()
            raise
        run_dir = _run_dir(self.runs_root)
        return ExperimentOutcome(
            experiment=self.experiment,
            variant=self.variant,
            exit_code=code,
            journal=read_json_object(self.runs_root / "journal.json"),
            result=_read_result(run_dir),
            run_dir=run_dir,
            log_path=self.runs_root / "chaos.log",
            duration_s=round(time.monotonic() - self.started_s, 1),
            timed_out=timed_out,
        )

    def stop(self) -> None:
        """Stop the run as a signal would (its control undoes, reports and stops its stack),
        finishing it from outside if it does not end; no KeyboardInterrupt cuts this short."""
        with held("stopping the experiment"):
            _stop(self.process, self.runs_root)


def _stop(proc: subprocess.Popen[bytes], runs_root: Path) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    run_dir = _run_dir(runs_root)
    if run_dir is not None:
        finish_dead_runs(runs_root, [run_dir.name])
    return code


def _run_dir(runs_root: Path) -> Path | None:
    found = sorted(p.parent for p in runs_root.glob(f"*/{RUN_FILE}"))
    return found[-1] if found else None


def _read_result(run_dir: Path | None) -> RunResult | None:
    if run_dir is None or not (run_dir / "summary.json").exists():
        return None
    try:
        return RunResult.read(run_dir / "summary.json")
    except (OSError, ValueError, TypeError):
        return None


def _over(name: str, value: float | None, limit: float, unit: str) -> str | None:
    """ "worst P99 4652 ms > 3000 ms (by 1652 ms, +55%)", or None when within the limit."""
    if value is None or value <= limit:
        return None
    excess = value - limit
    share = f", +{excess / limit:.0%}" if limit else ""
    return f"{name} {value:.4g} {unit} > {limit:.4g} {unit} (by {excess:.3g} {unit}{share})"


def failure_message(outcome: ExperimentOutcome) -> str:
    """Why a run did not pass, by category first ("SLO breached", "fault not in effect",
    "target unavailable", "framework error"), then by how much, then where its run folder
    is."""
    where = f"run folder {outcome.run_dir}" if outcome.run_dir else f"log {outcome.log_path}"
    result = outcome.result
    if outcome.timed_out:
        return f"framework error: chaos run did not finish in time and was stopped; {where}"
    if result is None or outcome.journal is None:
        missing = "journal" if outcome.journal is None else "summary"
        return (
            f"framework error: chaos run exited {outcome.exit_code} without a {missing}; "
            f"{where}\n{outcome.output_tail}"
        )
    reasons = "; ".join(result.reasons) or "verdict fail"
    not_in_effect = [r for r in result.reasons if r.startswith("fault not in effect")]
    if not_in_effect:  # the run tested nothing: its SLO figures say nothing either way
        return f"{'; '.join(not_in_effect)}; {where}"
    if result.journal_status == "interrupted" and not result.deviated:
        return f"target unavailable: {reasons}; {_conditions(result)}; {where}"
    slo = result.slo
    breaches = [
        f"recovery: not recovered (SLA {result.sla_s:g} s)" if result.recovered is False else None,
        _over("recovery", result.recovery_time_s, result.sla_s, "s"),
        _over("worst P99", result.worst_p99_ms, slo["p99_ms"], "ms"),
        _over(
            "peak error rate",
            None if result.peak_error_rate is None else result.peak_error_rate * 100,
            slo["error_rate"] * 100,
            "%",
        ),
    ]
    figures = "; ".join(b for b in breaches if b)
    return (
        f"SLO breached: {reasons}. {figures or 'no figure over its limit'}; {_conditions(result)}"
        f"; {where}"
    )


def _conditions(result: RunResult) -> str:
    """The rate and the machine's spare CPU: whether a breach may be the machine's."""
    return f"at {result.qps_run:g} QPS, machine CPU: {result.machine_line()}"
