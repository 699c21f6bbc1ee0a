"""Fixtures shared by tests/ and suites/: the embedded stack (started and always stopped), the
experiment runner of the resilience suites and its Allure reporting, hypothesis profiles."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import allure
import pytest
from hypothesis import settings as hypothesis_settings

from llmchaos.processes import stat_fields
from llmchaos.runner import ExperimentOutcome
from llmchaos.signals import install, raise_on_interrupt
from llmchaos.stack.config import StackConfig
from llmchaos.stack.netns import check_netns_support
from llmchaos.stack.stack import start_stack, stop_stack
from llmchaos.stack.topology import Topology

if TYPE_CHECKING:
    from suites.catalogue import SuiteRuns

REPO = Path(__file__).resolve().parent
TEST_STACK_CONFIG = StackConfig(port=0, gpu_load_s=1.5, cpu_load_s=0.5, ready_timeout_s=60)
"""Stacks in tests: any free port, short model loads (the restart gap still shows)."""

StackFactory = Callable[..., Topology]
ExperimentRunner = Callable[[Path, str, Mapping[str, str]], ExperimentOutcome]
"""run(experiment file, variant, settings from the environment over CI's)."""
TMP_ROOT = REPO / "reports" / "pytest"
ALLURE_RESULTS = REPO / "reports" / "allure-results"
"""Where `pytest suites/` writes Allure results (emptied first) unless --alluredir says
otherwise; `llmchaos gameday` keeps its own per night."""
SUITE_RAN = pytest.StashKey[bool]()
"""Set when the session has resilience suite cases (its last lines then say their rate)."""
SUITE_ENV = "LLMCHAOS_SUITE_DIR"
"""Folder for the suite's run folders (llmchaos gameday sets it); default reports/suites/<time>."""
CI_RUN_ENV = {
    "LLMCHAOS_WARMUP_S": "4",
    "LLMCHAOS_WINDOW_S": "3",
    "LLMCHAOS_STABLE_FOR_S": "5",
    "LLMCHAOS_REGISTRY_DOWN_S": "5",
    "LLMCHAOS_SCALE_OUT_WATCH_S": "20",
    "LLMCHAOS_PULSE_HOLD_S": "10",
    "LLMCHAOS_AUTOSCALE_SCALE_DOWN_WINDOW_S": "8",
    "LLMCHAOS_WATCH_TIMEOUT_S": "8",
    "LLMCHAOS_DEGRADED_FOR_S": "6",
    "LLMCHAOS_STEP_S": "7",
    "LLMCHAOS_HOLD_S": "12",
    "LLMCHAOS_FIRST_LOAD_S": "0.1",
}
"""Shorter phases when CI is set: the SLO judged over 3-s windows instead of 5 (4,200 requests each
at 1,400 QPS), so 4 s of warm-up instead of 8 still leaves the load's first second out of the
window judged before the method (that second, cold connections at the full rate, had a P99 of
2.3 s on a 1.4 s run, and a window over it once failed CI's steady state before any fault at
3.2 s; at 400 QPS its P99 was that of the seconds after it in all 40 cases of a suite), and
recovery is confirmed by 5 windows in a row that meet the SLO instead of 10 (7 s of requests
instead of 14: a relapse later than that goes unseen under CI, as one later than 14 s
does in a full run; with 3 windows, 5 s, gpu_hang's known-bad variant passed between two of its
hung worker's ejections); the stack's first model loads 0.1 s instead of 2 (a restart's, what
the faults measure, stays gpu_load_s; a stack for 400 QPS started in 2.3 s instead of 2.6); the
registry down 5 s instead of 15 (the gateways read it every 0.25 s); the autoscaling pulse
watched 20 s (the limit is 15) and held 10 s once scaled out, the scale-down window 8 s; the
degradation watch 8 s (the queue passes 1,000 within a second, the hardened variant's
counter moves at once; the known-bad one's never moved in 15) and 6 s of the overload in
degraded mode; the stepped load's steps 7 s instead of 20 (4.9 s of each judged, at 200-1,200
QPS 980-5,900 requests; at 5 s the hardened variant failed 1 of 9 runs on a 400-QPS box: its
gateways' queue passed the degradation threshold only about 5 s into the 800-QPS step, and
the 1,000-QPS step piled onto that queue; at 7 s it passed 2 of 2, shedding at 800);
cpu_throttle's throttle held 12 s instead of 20 (its known-bad variant misses the SLO from 5 s
in, and fails its no-failure probe whatever the hold)."""


_CI_SLA_ENV = {"LLMCHAOS_SLA_S": "5"}
_CI_HALF_MACHINE_ENV = {"LLMCHAOS_MACHINE_SHARE": "0.5"}
_CI_THIRD_MACHINE_ENV = {"LLMCHAOS_MACHINE_SHARE": "0.33"}
CI_EXPERIMENT_ENV: dict[str, dict[str, str]] = {
    **{
        name: {**_CI_SLA_ENV, **_CI_THIRD_MACHINE_ENV}
        for name in (
            "gpu_kill",
            "gateway_crash",
            "worker_oom",
            "registry_kill",
            "registry_partition",
            "network_degradation",
            "node_partition",
            "partial_partition",
        )
    },
    **{
        name: {**_CI_SLA_ENV, **_CI_HALF_MACHINE_ENV}
        for name in ("gpu_xid_errors", "gpu_slow", "registry_leader_loss", "kv_cache_surge")
    },
    "cpu_throttle": dict(_CI_SLA_ENV),
    "token_cache_expiry": dict(_CI_SLA_ENV),
    "burst_during_failover": {**_CI_SLA_ENV, "LLMCHAOS_BURST_S": "10"},
    "gpu_hang": {**_CI_SLA_ENV, **_CI_THIRD_MACHINE_ENV, "LLMCHAOS_HANG_HOLD_S": "15"},
    "gpu_kill_all": {**_CI_THIRD_MACHINE_ENV, "LLMCHAOS_GPU_LOAD_S": "8"},
}
"""The suite's experiments shorter still under CI, each by its own settings over CI_RUN_ENV
(measured on a machine calibrated at 400 QPS, 2026-12-07, both variants of each at least
once). A recovery SLA of 5 s instead of 10-15 where the hardened variant held the SLO through
the fault (recovered in 0-0.35 s): a known-bad variant that does not recover is judged about
one window after the SLA (8 s after the fault instead of 13-18), and the hardened variant
meets the stricter SLA. burst_during_failover's burst 10 s instead of 20 (the gateway crash
comes 3 s into it); gpu_hang's hang held 15 s instead of 20 (a recovery counts once its
stable run outlasts the hang: held 10 s, the known-bad variant's hung worker, ejected after
its first 6-s timeouts, was not given its turn again before the hang ended, and it
recovered in 5.6 s, a hair past the SLA; held 15 s, it gets its turn again and misses the
SLO again); gpu_kill_all's GPUs reload in 8 s instead of 15 (recovered in 8-9 s instead of
17; the known-bad variant fails on its CPU share, not on its recovery). kv_cache_surge keeps
its 15-s surge: in 8 s no engine's KV cache filled enough for the fault to be in effect, and
the small-cache variant passed.

And the suite runs them side by side (suites.catalogue.SuiteRuns starts the cases' runs in
order while their shares of this machine's rate, `LLMCHAOS_MACHINE_SHARE`, fit beside those of
the runs still under load; whole_machine_first puts the cases that take all of it first). A
third each, three at a time: the eight whose known-bad variant does not recover at all
(gpu_kill, gateway_crash, worker_oom, registry_kill, registry_partition, network_degradation,
node_partition, partial_partition), gpu_hang and gpu_kill_all (its known-bad variant serves
nothing from CPU). Half each: gpu_xid_errors, gpu_slow, registry_leader_loss and
kv_cache_surge, whose known-bad variants are judged on a share of the traffic, a P99 (gpu_slow's
6.3-7.2 s against 6 s in 5 runs at 200-300 QPS, about what it is alone) or an engine's KV cache.
The whole machine: autoscale_pulse's pulse would stop at its share; degradation_trigger and
stepped_capacity overload the machine at their own rates (up to 1,200 QPS) on purpose;
burst_during_failover's 2x burst beside another run once kept its load from its core (147
requests/s scheduled in the 2 s after it, asked 200: the fault was not in effect); and two
whose fault bites with the rate: token_cache_expiry's stampede on the token table (at 200 QPS
its known-bad variant's worst P99 since the flush was 2.3 s, inside the 3-s SLO, and it
passed; 5.0 s at 300 QPS, 8.2 s at 1,400) and cpu_throttle's worker at 1% of a CPU (at 200 QPS
it kept up with its share of the requests, and the known-bad variant passed once in three).
On this box calibrated at 400 QPS the 40 runs then spanned 677 s, where their durations add up
to 1,017 s, and every case reached its verdict."""


def ci_run_env(experiment: str = "") -> dict[str, str]:
    """CI's settings when CI is set, else nothing: CI_RUN_ENV, and `experiment`'s own
    CI_EXPERIMENT_ENV (its file's stem), for the suite's chaos runs. The hosts catalogue's
    (tests/hosts/test_catalogue.py) take CI_RUN_ENV alone: LiteLLM's and nginx's recoveries
    were not measured against the shorter SLAs."""
    if not os.environ.get("CI"):
        return {}
    return {**CI_RUN_ENV, **CI_EXPERIMENT_ENV.get(experiment, {})}


hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The suites write Allure results by default (allure-pytest reads the option later), and
    temporary files go to reports/pytest/."""
    if getattr(config.option, "allure_report_dir", None) is None and any(
        str(arg).startswith("suites") for arg in config.args
    ):
        config.option.allure_report_dir = str(ALLURE_RESULTS)
        config.option.clean_alluredir = True  # this run's results, not every run's
    _set_basetemp(config)
    # SIGTERM (a CI runner cancelling the job) ends the session like Ctrl-C: fixtures stop
    # the stacks and runs they started instead of leaving them behind.
    raise_on_interrupt()
    if hasattr(config, "workerinput"):
        install(_interrupt_once)


def _interrupt_once(signum: int, _frame: object) -> None:
    """An xdist worker's SIGINT/SIGTERM: KeyboardInterrupt the first time, later ones ignored.
    A Ctrl-C reaches the controller and its workers both, and the controller passes it on
    (below): a second KeyboardInterrupt would cut short the teardown the first started."""
    install(signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def pytest_sessionstart(session: pytest.Session) -> None:
    """In xdist's controller (a run with -n, not --collect-only), pass interrupts on."""
    dsession = session.config.pluginmanager.getplugin("dsession")
    if dsession is not None:
        install(functools.partial(_pass_interrupt_to_xdist_workers, dsession))


def _pass_interrupt_to_xdist_workers(dsession: Any, signum: int, _frame: object) -> None:
    """The xdist controller's first SIGINT or SIGTERM goes on to its workers (its children;
    it runs no test itself), and the session ends through them: each worker's test is
    interrupted as in a plain run, its fixtures stop what it started, and the workers report
    back. A second signal stops the controller (xdist then gives its workers 10 s). Left to
    xdist, a signal to the controller alone (a CI runner's cancel, `kill`) shut the workers
    down with a 10 s limit, then SIGKILL: a chaos run's teardown was cut short and its stack
    left behind (tests/test_harness.py)."""
    raise_on_interrupt()  # the second
    # the session stops: a worker that ends interrupted is not replaced by one that would
    # take up its tests again (xdist replaces a worker whose channel closed mid-test)
    dsession.shouldstop = f"{signal.Signals(signum).name} received"
    me = str(os.getpid())
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (stat_fields(proc.name) or ["", ""])[1] == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGTERM)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before the resilience suite's first case, measure this machine's rate when it is
    missing (suites.catalogue.calibrate_target): in a hook, not a fixture, so that
    pytest-timeout's 300 s per test does not count a calibration's minutes against the first
    case."""
    if session.config.option.collectonly:
        return
    if any(item.path == REPO / "suites" / "test_catalogue.py" for item in session.items):
        from suites.catalogue import calibrate_target  # the suites import this module

        calibrate_target()
        session.config.stash[SUITE_RAN] = True


@pytest.hookimpl(trylast=True)  # after the durations: a CI log's tail shows it
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After the resilience suite, the rate its cases ran at (suites.catalogue.target_rate)."""
    if terminalreporter.config.stash.get(SUITE_RAN, False):
        from suites.catalogue import target_rate

        terminalreporter.write_line(f"catalogue rate: {target_rate()}")


def _set_basetemp(config: pytest.Config) -> None:
    """Temporary files go to reports/pytest/run-<pid>/ instead of /tmp: nothing of a test run
    may stay outside the repo and reports/. One folder per run, so runs side by side do not
    clear each other's files; folders of finished runs are removed at the next start."""
    if config.option.basetemp or hasattr(config, "workerinput"):
        return
    TMP_ROOT.mkdir(parents=True, exist_ok=True)
    for old in TMP_ROOT.glob("run-*"):
        pid = old.name.removeprefix("run-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = str(TMP_ROOT / f"run-{os.getpid()}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Keep a failed run's files for a look; remove a passed run's."""
    basetemp = Path(session.config.option.basetemp or "")
    if exitstatus == 0 and basetemp.parent == TMP_ROOT:
        shutil.rmtree(basetemp, ignore_errors=True)


@pytest.fixture(scope="session")
def stack_state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stacks")


def _factory(state_root: Path) -> Iterator[StackFactory]:
    started: list[Topology] = []

    def start(**overrides: object) -> Topology:
        config = replace(TEST_STACK_CONFIG, state_root=state_root, **overrides)  # type: ignore[arg-type]
        topology = start_stack(config)
        started.append(topology)
        return topology

    try:
        yield start
    finally:
        for topology in started:
            stop_stack(topology)


@pytest.fixture(scope="module")
def module_stack_factory(stack_state_root: Path) -> Iterator[StackFactory]:
    """Start stacks shared by a module's tests; all are stopped when the module ends."""
    yield from _factory(stack_state_root)


@pytest.fixture
def stack_factory(stack_state_root: Path) -> Iterator[StackFactory]:
    """Start stacks for one test; all are stopped when it ends, pass or fail."""
    yield from _factory(stack_state_root)


BUSY_LOOP = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end: pass"
"""A core kept busy for at most 15 minutes, even if nobody stops it."""
REPEAT_ENV = "LLMCHAOS_INTERRUPT_REPEAT"
"""How many times in a row the interrupt tests repeat each case (default 1; the README says
how they were run 20 times with both cores busy)."""


PER_ATTEMPT_TIMEOUT_S = 300
"""pytest-timeout's limit for one attempt of an interrupt test (the ini's `timeout`)."""


def repeat_count() -> int:
    return max(1, int(os.environ.get(REPEAT_ENV, "1")))


def interrupt_cases(phases: tuple[str, ...]) -> list[Any]:
    """(signal, phase) cases of an interrupt test: every phase once, SIGINT and SIGTERM in
    turn (the two take the same path; this keeps CI short), or both signals in every phase
    when the tests are repeated (LLMCHAOS_INTERRUPT_REPEAT > 1)."""
    signals = (signal.SIGINT, signal.SIGTERM)
    if repeat_count() > 1:
        cases = [(sig, phase) for phase in phases for sig in signals]
    else:
        cases = [(signals[i % 2], phase) for i, phase in enumerate(phases)]
    # pytest-timeout's limit holds per attempt: 20 attempts of a `stack up` that waits 30 s
    # for its workers overran one 300 s limit, and its stop SIGTERMed the attempt under way
    timeout = pytest.mark.timeout(PER_ATTEMPT_TIMEOUT_S * repeat_count())
    return [
        pytest.param(sig, phase, id=f"{sig.name}-{phase}", marks=timeout) for sig, phase in cases
    ]


@contextlib.contextmanager
def sigterm_during_popen(popen: str) -> Iterator[None]:
    """SIGTERM arrives the moment the process that `popen` (a module's `subprocess.Popen`)
    starts exists, as a Ctrl-C or `kill` can on a busy machine; the handler raises
    KeyboardInterrupt as a command's does. The block expects it to propagate; the patch ends
    with the block (a later Popen must not signal the test runner)."""
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = real_popen(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)
        return process

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(popen, popen_then_sigterm)
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_and_wait(
    proc: subprocess.Popen[str], sig: signal.Signals, timeout_s: float
) -> tuple[str, str, float]:
    """Send `sig` to `proc` and wait for it to end: (rest of its stdout, rest of its stderr,
    seconds it took). Raises subprocess.TimeoutExpired when it does not end in time; the
    caller kills it in its `finally`."""
    proc.send_signal(sig)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=timeout_s)
    return out or "", err or "", time.monotonic() - sent


def stop_gracefully(proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """End a process a test started as a user would: SIGTERM (it stops what it started), then
    SIGKILL only if it has not ended within `timeout_s`. A test that fails or is interrupted
    (Ctrl-C, CI cancelling) must not leave its run's stack behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Every core kept busy by a spinning process while the test runs: signal and timing
    code must work on a loaded machine, as CI and users' machines often are."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.fixture(scope="session")
def netns_available() -> bool:
    return check_netns_support() is None


@pytest.fixture
def needs_netns(netns_available: bool) -> None:
    if not netns_available:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root and must test namespaces: {check_netns_support()}")
        pytest.skip(str(check_netns_support()))


@pytest.fixture(scope="session")
def suite_dir() -> Path:
    """The session's folder of run folders: $LLMCHAOS_SUITE_DIR or reports/suites/<time>."""
    configured = os.environ.get(SUITE_ENV)
    path = (
        Path(configured)
        if configured
        else REPO / "reports" / "suites" / time.strftime("%Y%m%d-%H%M%S")
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def suite_runs(suite_dir: Path, request: pytest.FixtureRequest) -> Iterator[SuiteRuns]:
    """The session's chaos runs (suites.catalogue.SuiteRuns), each started before its test
    comes (while the one before it reports, or beside it when their machine shares fit),
    except on an xdist worker (the next test may be another worker's)."""
    from suites.catalogue import SuiteRuns  # the suites import this module

    runs = SuiteRuns(suite_dir, ahead=not hasattr(request.config, "workerinput"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture
def run_experiment(suite_runs: SuiteRuns, request: pytest.FixtureRequest) -> ExperimentRunner:
    """Run an experiment file against a variant through `chaos run`, in its own folder."""

    def run(path: Path, variant: str, env: Mapping[str, str]) -> ExperimentOutcome:
        return suite_runs.run(request.node, path, variant, env)

    return run


_ATTACHMENTS = (
    ("recovery.png", "recovery chart (PNG)", allure.attachment_type.PNG),
    ("recovery.svg", "recovery chart (SVG)", allure.attachment_type.SVG),
    ("timeline.csv", "timeline", allure.attachment_type.CSV),
    ("summary.json", "summary", allure.attachment_type.JSON),
    (
        "load/summary.json",
        "load summary (achieved QPS, goodput, TTFT/ITL/TPOT/e2e p50..p99.9)",
        allure.attachment_type.JSON,
    ),
    ("journal.json", "Chaos Toolkit journal", allure.attachment_type.JSON),
    ("report.html", "run report", allure.attachment_type.HTML),
)


def report_outcome(outcome: ExperimentOutcome) -> None:
    """Allure parameters, one step per Chaos Toolkit phase, and the run's files attached."""
    result = outcome.result
    if result is not None:
        allure.dynamic.parameter("target", result.target)
        allure.dynamic.parameter("variant", result.variant)
        allure.dynamic.parameter("qps", f"{result.qps_run:g} (asked {result.qps_asked:g})")
        allure.dynamic.parameter("SLA", f"{result.sla_s:g} s")
        allure.dynamic.parameter("recovery time", f"{result.recovery_time_s} s")
        load = result.load or {}
        for name, key in (("TTFT p99", "ttft_ms"), ("TPOT p99", "tpot_ms")):
            allure.dynamic.parameter(name, f"{(load.get(key) or {}).get('p99')} ms")
        allure.dynamic.parameter("goodput", f"{load.get('goodput_qps')} QPS")
    journal = outcome.journal or {}
    states = journal.get("steady_states") or {}
    _phase_step("steady state before the method", (states.get("before") or {}).get("probes"))
    _phase_step("method", journal.get("run"))
    _phase_step("steady state after the method", (states.get("after") or {}).get("probes"))
    _phase_step("rollbacks", journal.get("rollbacks"))
    if outcome.run_dir is not None:
        for file_name, title, kind in _ATTACHMENTS:
            path = outcome.run_dir / file_name
            if path.exists():
                allure.attach.file(str(path), name=title, attachment_type=kind)
    allure.attach.file(str(outcome.log_path), name="chaos run output", attachment_type="text/plain")


def _phase_step(title: str, runs: list[dict[str, Any]] | None) -> None:
    """A step for the phase with one sub-step per activity; failed ones are marked failed."""
    if not runs:
        return
    with allure.step(title):
        for run in runs:
            activity = run.get("activity", {})
            output = json.dumps(run.get("output"), default=str)[:200]
            ok = run.get("status") == "succeeded" and run.get("tolerance_met", True)
            try:
                with allure.step(f"{activity.get('type')} {activity.get('name')}: {output}"):
                    if not ok:
                        error = (run.get("exception") or ["out of tolerance"])[-1].strip()
                        raise AssertionError(error)
            except AssertionError:
                pass  # the step is marked failed; the test's verdict comes from the run


def chaos_run(
    experiment: Path,
    journal: Path,
    *options: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> subprocess.CompletedProcess[str]:
    """`chaos run [options] experiment` from the repo root, journal at `journal`, output
    captured; `env` is added to this process's environment."""
    argv = [str(Path(sys.executable).with_name("chaos")), "run", "--journal-path", str(journal)]
    return subprocess.run(
        [*argv, *options, str(experiment)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
