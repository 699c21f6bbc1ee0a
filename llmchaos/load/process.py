"""Locust event hooks: the master's Controller (merge, live endpoint, timeline, summary, end of
run) and the worker's message handlers. Imported by locustfile.py in every Locust process.

Roles: a LocalRunner is both master and worker; with `--processes N`, remote workers
(`llmchaos load-worker`) or Kubernetes the master merges reports and the workers send load. The
master waits for `total_workers` workers (at most `join_timeout_s`), then picks the schedule's
time zero and tells each worker that joined its share (shares.py). The run ends when every
share is done (final report in) or lost (never joined, Locust's heartbeat says missing, quit,
silent, stopped early; its rest is replayed and counted as lost_worker), or a deadline passes;
then the summary is written and Locust quits. With `owner_pid` set, the master also stops the
run once that process is gone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import locust.runners
from gevent.pywsgi import WSGIServer
from locust import events
from locust.runners import STATE_MISSING, MasterRunner, WorkerRunner

from llmchaos.files import write_json_atomic
from llmchaos.load.aggregate import Aggregate
from llmchaos.load.config import LoadConfig, default_run_dir
from llmchaos.load.live import make_app
from llmchaos.load.profiles import build_profile
from llmchaos.load.shares import LostShare, Share
from llmchaos.load.user import WORKER
from llmchaos.load.wire import (
    CONFIG_ARGUMENT,
    CONNECT_TIMEOUT_ENV,
    CONTROL_MESSAGE,
    LIVE_FILE,
    LOCAL_START_DELAY_S,
    REPORT_MESSAGE,
    START_DELAY_S,
    START_MESSAGE,
    config_from_options,
)
from llmchaos.processes import Owner

__all__ = ["Controller"]

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_DRAIN_TICK_S = 0.05
"""The master's tick once the schedule has ended or a stop came (which also ends a tick): the
last share's final report is then seen within 50 ms instead of 0.5 s, and every chaos run's
finish waits for it."""
_OWNER_CHECK_S = 1.0
"""How often the master checks that the owner process is still there (one /proc read)."""
START_RESEND_S = 5.0
"""How long after time zero the start is sent again, for workers that registered late."""
MASTER_GONE_S = 10.0
"""A worker quits when it has heard no heartbeat from its master for this long (Locust's own
default is 60 s): a remote worker whose master died must not linger."""
LOCAL_WORKER = "local"
"""The node id of the messages a LocalRunner (master and worker in one) sends itself."""
QUIT_GRACE_S = 2.0
"""How long a share whose worker quit early stays in `ending` before it is lost (above)."""
QUIT_REPORT_WAIT_S = 3.0
"""How long a master that is quitting (SIGTERM) waits for the report each worker sends as it
stops; a share whose report does not come is counted lost from its last report on. With
Locust's own 0.5 s after it, well inside the 5 s a stopped load gets before SIGKILL
(api.py)."""
SILENT_WORKER_S = 15.0
"""A worker with a share that sent no report for this long is lost, even if Locust still gets
its heartbeats (its reports are sent every report_interval_s)."""


class Controller:
    """The master side of one run; also the LiveSource of the live endpoint."""

    def __init__(self, environment: Any, config: LoadConfig) -> None:
        self.env = environment
        self.config = config
        self.run_dir = Path(config.run_dir or default_run_dir())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        profile = build_profile(config)
        self.duration_s = profile.duration_s
        self.target_qps = sum(s.qps * s.duration_s for s in profile.stages) / profile.duration_s
        self.timeline_path = Path(config.timeline or self.run_dir / "timeline.jsonl")
        self.summary_path = Path(config.summary_json or self.run_dir / "summary.json")
        self.profile = profile
        self.aggregate: Aggregate | None = None
        self.state = "waiting"
        self.stop_requested = gevent.event.Event()
        self.share_count = 1
        """Shares the schedule is split into: one per expected worker (install)."""
        self.shares: list[Share] = []
        self.by_worker: dict[str, Share] = {}
        self.controls: list[tuple[float, dict[str, Any]]] = []
        """Live controls sent so far, (offset s, message): lost shares replay them."""
        self.server: WSGIServer | None = None

    def install(self) -> None:
        runner = self.env.runner
        runner.register_message(REPORT_MESSAGE, self.on_report)
        self.env.events.test_start.add_listener(self.on_test_start)
        self.env.events.quitting.add_listener(self._on_quitting)
        self.env.events.quit.add_listener(self._on_quit)
        if isinstance(runner, MasterRunner):
            # Locust's --processes sets it to the local processes only, remote ones count too;
            # a master started by hand (Kubernetes: --master --expect-workers N) may say more
            options = self.env.parsed_options
            self.share_count = max(self.config.total_workers, int(options.expect_workers or 1))
            options.expect_workers = self.share_count
            self.env.events.worker_connect.add_listener(self._on_worker_connect)
            gevent.spawn(self._bound_join)
        self.server = WSGIServer(
            (self.config.live_host, self.config.live_port), make_app(self), log=None
        )
        self.server.start()
        host = "127.0.0.1" if self.config.live_host in ("0.0.0.0", "") else self.config.live_host
        url = f"http://{host}:{self.server.server_port}"
        write_json_atomic(self.run_dir / LIVE_FILE, {"url": url, "pid": os.getpid()})
        if self.config.owner_pid is not None:
            gevent.spawn(self._watch_owner, Owner.of(self.config.owner_pid))

    # Locust hooks

    def on_report(self, msg: Any, **_: Any) -> None:
        share = self.by_worker.get(str(msg.node_id))
        if self.aggregate is None or share is None or share.state not in ("running", "ending"):
            return  # a lost share is replayed and counted: a late report would count twice
        self.aggregate.add_report(share.key, msg.data)
        if msg.data.get("abandoned"):
            share.end("stopped")
        elif msg.data["final"]:
            share.state = "done"

    def _bound_join(self) -> None:
        """After join_timeout_s, start with the workers that joined: Locust's headless master
        waits for `expect_workers` ready ones and reads it again every second. With none at
        all, the run starts without Locust (every share is lost) and ends at once."""
        deadline = time.monotonic() + self.config.join_timeout_s
        runner = self.env.runner
        while time.monotonic() < deadline:
            if self.aggregate is not None or len(runner.clients.ready) >= self.share_count:
                return
            gevent.sleep(0.2)
        if self.aggregate is not None:
            return
        joined = len(runner.clients.ready)
        logger.warning(
            "llmchaos load: %d of %d workers joined within %.0f s; starting without the others",
            joined,
            self.share_count,
            self.config.join_timeout_s,
        )
        # 0 too: Locust's loop must end, else it waits in the main greenlet whatever quits
        self.env.parsed_options.expect_workers = joined
        if not joined:
            self.on_test_start()

    def _on_worker_connect(self, client_id: str, **_: Any) -> None:
        """A worker that joins after time zero has no share: tell it so it does not wait."""
        if self.aggregate is not None and client_id not in self.by_worker:
            gevent.spawn(self._announce, client_id, self._start_message(None))

    def on_test_start(self, **_: Any) -> None:
        if self.aggregate is not None:  # a restart from the web UI keeps the first run
            return
        with_workers = isinstance(self.env.runner, MasterRunner)
        start = time.time() + (START_DELAY_S if with_workers else LOCAL_START_DELAY_S)
        self.aggregate = Aggregate(
            start, self.duration_s, self.target_qps, goodput=self.config.goodput_slo.defined
        )
        self.state = "running"
        self._assign_shares()
        gevent.spawn(self._lifecycle)

    def _joined(self) -> list[str]:
        """Client ids of the workers ready now, in the order they joined."""
        runner = self.env.runner
        if not isinstance(runner, MasterRunner):
            return [LOCAL_WORKER]
        ready = [c.id for c in runner.clients.all if c.state != STATE_MISSING]
        return sorted(ready, key=runner.get_worker_index)

    def _assign_shares(self) -> None:
        """Share i to the i-th worker that joined; the shares nobody joined for are lost from
        time zero, workers beyond the expected count get none."""
        agg = self.aggregate
        assert agg is not None
        joined = self._joined()
        total = self.share_count
        for index in range(total):
            worker = joined[index] if index < len(joined) else None
            share = Share(index, worker)
            self.shares.append(share)
            if worker is None:
                self._lose(share, "never joined", 0)
            else:
                self.by_worker[worker] = share
                agg.expect(share.key)
                gevent.spawn(self._announce, worker, self._start_message(index))
        for extra in joined[total:]:
            gevent.spawn(self._announce, extra, self._start_message(None))

    def _start_message(self, index: int | None) -> dict[str, Any]:
        assert self.aggregate is not None
        start = self.aggregate.start_epoch_s
        return {"start_epoch_s": start, "share": index, "shares": self.share_count}

    def _announce(self, worker: str, message: dict[str, Any]) -> None:
        """Send a worker its start, and again for a while: a worker whose handler was not
        registered yet drops the message ("Unknown message type"), and its whole share of the
        schedule would be lost. Workers keep the first one they get."""
        until = time.monotonic() + START_DELAY_S + START_RESEND_S
        client_id = None if worker == LOCAL_WORKER else worker
        while True:
            self.env.runner.send_message(START_MESSAGE, message, client_id)
            if time.monotonic() >= until:
                return
            gevent.sleep(0.25)

    def _lose(self, share: Share, reason: str, skip: int) -> None:
        """From now on the share is replayed and its unreported arrivals counted."""
        agg = self.aggregate
        assert agg is not None
        share.state, share.lost_reason = "lost", reason
        share.lost = LostShare(
            self.profile,
            shares=self.share_count,
            index=share.index,
            seed=self.config.seed,
            skip=skip,
            controls=self.controls,
        )
        agg.mark_lost(share.key)
        if share.worker is not None and reason != "stopped":
            logger.warning(
                "llmchaos load: worker %s (share %d) lost (%s); its unsent arrivals are "
                "counted as lost_worker",
                share.worker,
                share.index,
                reason,
            )
            if isinstance(self.env.runner, MasterRunner):  # if it is still there, it stops
                self.env.runner.send_message(CONTROL_MESSAGE, {"stop": True}, share.worker)
        self._count_lost()

    def _count_lost(self, until_s: float | None = None) -> None:
        """Replay the lost shares up to `until_s`, by default where the run's schedule is."""
        agg = self.aggregate
        assert agg is not None
        until_s = agg.ran_s() if until_s is None else until_s
        for share in self.shares:
            lost = share.lost
            if lost is None or lost.finished:
                continue
            counts = lost.advance(until_s)
            done = lost.finished or until_s >= self.duration_s or agg.stopped_at_s is not None
            agg.add_lost(share.key, counts, None if done else lost.position_s)

    def _check_workers(self) -> None:
        """Lose the shares whose worker Locust says is missing (no heartbeat for ~4 s), that
        stopped reporting, or that quit or were stopped before their end QUIT_GRACE_S ago (no
        longer in Locust's workers, or an `abandoned` report): if the whole load is being
        stopped (SIGTERM to its processes), the master ends within that grace, and those
        workers' arrivals after their last report are the early stop's, not lost."""
        runner = self.env.runner
        agg = self.aggregate
        assert agg is not None
        for share in self.shares:
            if share.state == "ending" and share.ended_for_s() > QUIT_GRACE_S:
                self._lose(share, share.lost_reason or "quit", agg.scheduled_total(share.key))
            if share.state != "running" or not isinstance(runner, MasterRunner):
                continue
            client = runner.clients.get(share.worker)
            if client is None:
                share.end("quit")
            elif client.state == STATE_MISSING:
                self._lose(share, "missing", agg.scheduled_total(share.key))
            elif agg.silent_s(share.key) > SILENT_WORKER_S:
                self._lose(share, "silent", agg.scheduled_total(share.key))

    # LiveSource

    def start_epoch_s(self) -> float | None:
        return None if self.aggregate is None else self.aggregate.start_epoch_s

    def now_s(self) -> float:
        return 0.0 if self.aggregate is None else self.aggregate.now_s()

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "start_ts": self.start_epoch_s(),
            "now_s": round(self.now_s(), 3),
            "duration_s": self.duration_s,
            "target_qps": self.target_qps,
            "run_dir": str(self.run_dir),
            "summary_json": str(self.summary_path),
            "timeline": str(self.timeline_path),
        }

    def window(self, from_s: float, to_s: float) -> dict[str, Any]:
        assert self.aggregate is not None
        return self.aggregate.window(from_s, to_s)

    def seconds(self, from_s: float, to_s: float) -> list[dict[str, Any]]:
        assert self.aggregate is not None
        return self.aggregate.seconds_lines(from_s, to_s)

    def summary(self) -> dict[str, Any]:
        """The Aggregate's summary and, per share, its worker, state and counts."""
        agg = self.aggregate
        assert agg is not None
        workers = [{**s.to_json(), **agg.worker_counts(s.key)} for s in self.shares]
        return {**agg.summary(), "workers": workers}

    def set_qps(self, qps: float) -> None:
        self._control({"qps": qps})

    def burst(self, duration_s: float, factor: float) -> None:
        seed = int(time.time() * 1000) & 0x7FFFFFFF  # one seed so all workers burst together
        self._control({"burst": {"duration_s": duration_s, "factor": factor, "seed": seed}})

    def _control(self, message: dict[str, Any]) -> None:
        if self.aggregate is not None:
            self.controls.append((self.aggregate.now_s(), message))
        self.env.runner.send_message(CONTROL_MESSAGE, message)

    def stop(self) -> None:
        self.stop_requested.set()

    # The run

    def _watch_owner(self, owner: Owner) -> None:
        """Stop the run once the owner is gone: nobody is left to stop it (a SIGKILLed
        `chaos run`), and load must not keep hitting the target. A stop before the test
        started takes effect at its first tick."""
        while owner.alive():
            gevent.sleep(_OWNER_CHECK_S)
        logger.warning("llmchaos load: owner process %d is gone, stopping", owner.pid)
        self.stop()

    def _lifecycle(self) -> None:
        """Run to the end, write the rest, quit. The quit happens whatever failed before it:
        with its folder deleted under it the run cannot write, but must not keep loading the
        target, idle in Locust's loop, with nobody left to stop it."""
        try:
            self._run_to_end()
        except OSError as exc:
            logger.error("llmchaos load: cannot write the run's files (%s); stopping", exc)
            self.state = "unwritable"  # so the quit does not try (and fail) to write again
        finally:
            if self.server is not None:
                self.server.stop(timeout=1)
            if getattr(self.env, "web_ui", None) is not None:
                self.env.web_ui.stop()
            self.env.runner.quit()

    def _run_to_end(self) -> None:
        agg = self.aggregate
        assert agg is not None
        slack_s = self.config.drain_s + 3 * self.config.report_interval_s + 2.0
        deadline_s = self.duration_s + slack_s
        while True:
            if self.state == "running":
                self.stop_requested.wait(_TICK_S)
            else:
                gevent.sleep(_DRAIN_TICK_S)
            self._check_workers()
            self._count_lost()
            self._write_timeline(agg.final_lines())
            if self.state == "running" and self.stop_requested.is_set():
                agg.mark_stopped()
                self.env.runner.send_message(CONTROL_MESSAGE, {"stop": True})
                deadline_s = min(deadline_s, agg.now_s() + slack_s)
                self.state = "draining"
            elif self.state == "running" and agg.now_s() >= self.duration_s:
                self.state = "draining"
            ended = all(s.state in ("done", "lost") for s in self.shares)
            if ended or agg.now_s() >= deadline_s:
                break
        self._finish()  # and quit at once: every run waits for this process's exit

    def _finish(self) -> None:
        """Write the rest of the timeline and the summary (once). A run Locust quits before
        its end was marked stopped by `_on_quitting`, which Locust calls before `quit`."""
        agg = self.aggregate
        if agg is None or self.state in ("done", "unwritable"):
            return
        for share in self.shares:
            # no final report (deadline, SIGTERM): what its reports do not hold, up to the
            # end of the run, is counted, never silently missing
            if share.state in ("running", "ending"):
                reason = share.lost_reason or "no final report"
                self._lose(share, reason, agg.scheduled_total(share.key))
        # not stopped: the whole plan (a run whose every worker is lost ends early, and the
        # rest of its schedule is theirs); stopped: up to the stop
        self._count_lost(self.duration_s if agg.stopped_at_s is None else None)
        self._write_timeline(agg.final_lines(flush_all=True))
        write_json_atomic(self.summary_path, self.summary())
        self.state = "done"

    def _on_quitting(self, **_: Any) -> None:
        """Locust is quitting (SIGTERM) before the run's end: the run stops now, and the master
        waits a bounded while for every worker's stop report. Its rates then divide counts
        that all end at the stop by the time up to it; without the wait, one worker's counts up
        to the stop and another's up to its last periodic report were divided by either span
        (a SIGTERMed 50 QPS run once reported 70)."""
        agg = self.aggregate
        if agg is None or self.state != "running":
            return
        agg.mark_stopped()
        self.state = "draining"
        if not isinstance(self.env.runner, MasterRunner):
            return  # a local worker reports as Locust stops its user, before `quit`
        runner = self.env.runner
        runner.send_message(CONTROL_MESSAGE, {"stop": True})
        since = time.monotonic()
        deadline = since + QUIT_REPORT_WAIT_S

        def awaited(share: Share) -> bool:
            # a worker that left has sent all it will: its report comes before its quit
            return (
                share.state in ("running", "ending")
                and runner.clients.get(share.worker) is not None
                and not agg.reported_since(share.key, since)
            )

        while time.monotonic() < deadline and any(awaited(s) for s in self.shares):
            gevent.sleep(0.05)

    def _on_quit(self, **_: Any) -> None:
        """Locust quits (SIGTERM, or the end of the run): a run that did not finish still
        leaves its timeline and a summary whose rates cover the time it ran. `quit` comes
        after the runner stopped its users, so a local run's last report is in."""
        self._finish()

    def _write_timeline(self, lines: list[dict[str, Any]]) -> None:
        if not lines:
            return
        with self.timeline_path.open("a") as stream:
            for line in lines:
                stream.write(json.dumps(line, separators=(",", ":")) + "\n")


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    parser.add_argument(
        CONFIG_ARGUMENT,
        type=str,
        default="",
        include_in_web_ui=False,
        help="llmchaos LoadConfig as JSON (forwarded by the master to its workers)",
    )


def _bound_the_connect_to_master() -> None:
    """Under `llmchaos load-worker`, Locust's worker tries to connect to its master for
    --connect-timeout-s, not Locust's 60 tries of 5 s: a worker whose master quit just after
    it was seen listening stayed 5 min. Set at import: Locust connects while it builds the
    worker's runner, before any init hook, and reads the module global at every try."""
    try:
        seconds = float(os.environ.get(CONNECT_TIMEOUT_ENV) or "nan")
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        return  # unset (not under load-worker) or not a number: Locust's own tries
    tries = math.ceil(seconds / locust.runners.CONNECT_TIMEOUT)
    # retries after the first; never more than Locust's own (each try is a recursive call)
    locust.runners.CONNECT_RETRY_COUNT = min(max(0, tries - 1), locust.runners.CONNECT_RETRY_COUNT)


_bound_the_connect_to_master()


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        # Locust's module default: read by the worker's heartbeat checker at every check
        locust.runners.MASTER_HEARTBEAT_TIMEOUT = MASTER_GONE_S
    if not isinstance(runner, MasterRunner):
        runner.register_message(START_MESSAGE, WORKER.on_start)
        runner.register_message(CONTROL_MESSAGE, WORKER.on_control)
        environment.events.quitting.add_listener(WORKER.on_quitting)
    if not isinstance(runner, WorkerRunner):
        Controller(environment, config_from_options(environment.parsed_options)).install()
