"""Locust event hooks: the master's Controller (merge, live endpoint, timeline, summary, end of
run) and the worker's message handlers. Imported by locustfile.py in every Locust process.

Roles: a LocalRunner is both master and worker; with `--processes N` (or Kubernetes) the master
merges reports and the workers send load. The master picks the schedule's time zero when the
test starts and tells the workers; the run ends when every worker sent its final report (or a
deadline passes: a dead worker must not hang the run), then the summary is written and Locust
quits. With `owner_pid` set, the master also stops the run once that process is gone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.event
from gevent.pywsgi import WSGIServer
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from llmchaos.files import write_json_atomic
from llmchaos.load.aggregate import Aggregate
from llmchaos.load.config import LoadConfig, default_run_dir
from llmchaos.load.live import make_app
from llmchaos.load.profiles import build_profile
from llmchaos.load.user import WORKER
from llmchaos.load.wire import (
    CONFIG_ARGUMENT,
    CONTROL_MESSAGE,
    LIVE_FILE,
    REPORT_MESSAGE,
    START_DELAY_S,
    START_MESSAGE,
    config_from_options,
)
from llmchaos.processes import Owner

__all__ = ["Controller"]

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_OWNER_CHECK_S = 1.0
"""How often the master checks that the owner process is still there (one /proc read)."""
START_RESEND_S = 5.0
"""How long after time zero the start is sent again, for workers that registered late."""


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
        self.aggregate: Aggregate | None = None
        self.state = "waiting"
        self.stop_requested = gevent.event.Event()
        self.expected_workers = 1
        self.server: WSGIServer | None = None

    def install(self) -> None:
        runner = self.env.runner
        runner.register_message(REPORT_MESSAGE, self.on_report)
        self.env.events.test_start.add_listener(self.on_test_start)
        self.env.events.quit.add_listener(self._on_quit)
        if isinstance(runner, MasterRunner):
            self.expected_workers = max(1, int(self.env.parsed_options.expect_workers or 1))
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
        if self.aggregate is not None:
            self.aggregate.add_report(str(msg.node_id), msg.data)

    def on_test_start(self, **_: Any) -> None:
        if self.aggregate is not None:  # a restart from the web UI keeps the first run
            return
        start = time.time() + START_DELAY_S
        self.aggregate = Aggregate(
            start, self.duration_s, self.target_qps, goodput=self.config.goodput_slo.defined
        )
        self.state = "running"
        gevent.spawn(self._announce_start, start)
        gevent.spawn(self._lifecycle)

    def _announce_start(self, start: float) -> None:
        """Send time zero, and again for a while: a worker whose handler was not registered
        yet drops the message ("Unknown message type"), and its whole share of the schedule
        would be lost. Workers keep the first one they get."""
        until = time.monotonic() + START_DELAY_S + START_RESEND_S
        while True:
            self.env.runner.send_message(START_MESSAGE, {"start_epoch_s": start})
            if time.monotonic() >= until:
                return
            gevent.sleep(0.25)

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
        assert self.aggregate is not None
        return self.aggregate.summary()

    def set_qps(self, qps: float) -> None:
        self.env.runner.send_message(CONTROL_MESSAGE, {"qps": qps})

    def burst(self, duration_s: float, factor: float) -> None:
        seed = int(time.time() * 1000) & 0x7FFFFFFF  # one seed so all workers burst together
        burst = {"duration_s": duration_s, "factor": factor, "seed": seed}
        self.env.runner.send_message(CONTROL_MESSAGE, {"burst": burst})

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
        agg = self.aggregate
        assert agg is not None
        slack_s = self.config.drain_s + 3 * self.config.report_interval_s + 2.0
        deadline_s = self.duration_s + slack_s
        while True:
            gevent.sleep(_TICK_S)
            self._write_timeline(agg.final_lines())
            if self.state == "running" and self.stop_requested.is_set():
                agg.mark_stopped()
                self.env.runner.send_message(CONTROL_MESSAGE, {"stop": True})
                deadline_s = min(deadline_s, agg.now_s() + slack_s)
                self.state = "draining"
            elif self.state == "running" and agg.now_s() >= self.duration_s:
                self.state = "draining"
            finals = agg.final_workers
            if finals >= self.expected_workers or agg.now_s() >= deadline_s:
                break
        self._finish()
        gevent.sleep(_TICK_S)  # let a reader of /status see "done"
        if self.server is not None:
            self.server.stop(timeout=1)
        if getattr(self.env, "web_ui", None) is not None:
            self.env.web_ui.stop()
        self.env.runner.quit()

    def _finish(self) -> None:
        """Write the rest of the timeline and the summary (once)."""
        agg = self.aggregate
        if agg is None or self.state == "done":
            return
        if self.state == "running":  # stopped from outside before its end (SIGTERM)
            agg.mark_stopped(agg.reported_until_s())
        self._write_timeline(agg.final_lines(flush_all=True))
        write_json_atomic(self.summary_path, agg.summary())
        self.state = "done"

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


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    runner = environment.runner
    if not isinstance(runner, MasterRunner):
        runner.register_message(START_MESSAGE, WORKER.on_start)
        runner.register_message(CONTROL_MESSAGE, WORKER.on_control)
    if not isinstance(runner, WorkerRunner):
        Controller(environment, config_from_options(environment.parsed_options)).install()
