"""The open-loop Locust user: one per worker process, following that worker's arrival schedule.

Locust's own users are closed-loop (a user waits for its answer before it sends again), so a
stalled target makes them stop sending and their latency looks fine. This user never waits for
answers: it sleeps until the next scheduled send time, sends (one non-blocking send, see
client.py; the answer is read in a callback of the gevent loop), and measures every request
from its *scheduled* time. A send that starts late shows up as schedule lag; a send over the
in-flight cap is counted as dropped.

Imports gevent and Locust: only Locust processes import this module (via locustfile.py).
Config, start time and live control reach it as Locust messages (see process.py), so the same
class runs unchanged on Locust workers in Kubernetes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import gevent
import gevent.event
from locust import User, task
from locust.exception import StopUser

from llmchaos.load.client import Client, Exchange
from llmchaos.load.config import LoadConfig
from llmchaos.load.profiles import build_profile
from llmchaos.load.responses import Answer
from llmchaos.load.schedule import ArrivalSchedule
from llmchaos.load.timeline import Recorder
from llmchaos.load.traffic import TrafficModel, tenants_of
from llmchaos.load.wire import START_MESSAGE_WAIT_S, config_from_options, request_head, split_url
from llmchaos.processes import allow_open_files

__all__ = ["WORKER", "OpenLoopLLMUser"]

logger = logging.getLogger(__name__)

_YIELD_EVERY = 64
"""When behind schedule, let the loop read answers at least every this many arrivals."""
_REPORT_LAG_S = 0.05
"""A periodic report goes this long after its `report_interval_s` ends: the sends due at the
end (at most a send tick late when on time, and `send_tick_ms` is 1) are in it."""


class WorkerState:
    """What this process's user needs from the master: start time, its share, live control."""

    def __init__(self) -> None:
        self.start = gevent.event.AsyncResult()
        """The master's start message: {"start_epoch_s", "share": index or None, "shares"}."""
        self.schedule: ArrivalSchedule | None = None
        self.start_mono = 0.0
        self.stop = gevent.event.Event()
        self.claimed = False
        self.report_stop: Callable[[], None] | None = None
        """Sends the running user's report of a stop (None when no user runs a share)."""

    def on_start(self, msg: Any, **_: Any) -> None:
        if not self.start.ready():  # the master sends it more than once (process.py)
            self.start.set(msg.data)

    def on_quitting(self, **_: Any) -> None:
        """The process quits (SIGTERM): report what was sent so far at once. Locust's worker
        tells the master it quits in a `quitting` listener of its own, registered earlier and
        so called after this one, and stops its users only later: reported from the user's
        exit, the counts would reach the master after the worker had left."""
        self.stop.set()
        if self.report_stop is not None:
            self.report_stop()

    def on_control(self, msg: Any, **_: Any) -> None:
        data = msg.data
        if data.get("stop"):
            self.stop.set()
        if self.schedule is None:
            return
        self.schedule.apply_control(data, time.monotonic() - self.start_mono)


WORKER = WorkerState()


_SPARE_FILES = 1024
"""Descriptors beyond one connection per request in flight (the hub, logs, the master)."""


def _inflight_cap_within_open_files(cap: int) -> int:
    """`cap`, or less when the open-file limit cannot be raised that far: a send over the
    limit would fail as `connection`, one over the cap is counted as dropped."""
    # Locust raises the soft limit to 10,000 only, and a chaos run's cap at 1,200 QPS is past it
    limit = allow_open_files(cap + _SPARE_FILES)
    if limit >= cap + _SPARE_FILES:
        return cap
    lowered = max(1, limit - _SPARE_FILES)
    logger.warning(
        "llmchaos load: %d requests in flight need %d open files, %d allowed: cap %d",
        cap,
        cap + _SPARE_FILES,
        limit,
        lowered,
    )
    return lowered


class OpenLoopLLMUser(User):
    """Runs this worker's share of the schedule; spawn one per worker (-u = worker count)."""

    next_due_s: float | None = 0.0
    """Offset of the arrival being scheduled (reports say which seconds are complete)."""

    def wait_time(self) -> float:
        return 1.0

    @task
    def follow_schedule(self) -> None:
        if WORKER.claimed:  # only one schedule per process; extra users have nothing to do
            raise StopUser()
        WORKER.claimed = True
        config = config_from_options(self.environment.parsed_options)
        config = dataclasses.replace(
            config, inflight_cap=_inflight_cap_within_open_files(config.inflight_cap)
        )
        start = WORKER.start.get(timeout=START_MESSAGE_WAIT_S)
        index = start["share"]
        if index is None:  # joined after time zero, or one worker more than expected
            logger.warning("llmchaos load: no share of the schedule for this worker")
            raise StopUser()
        WORKER.start_mono = time.monotonic() + (float(start["start_epoch_s"]) - time.time())
        profile = build_profile(config)
        WORKER.schedule = ArrivalSchedule(
            profile, share=1.0 / int(start["shares"]), index=index, seed=config.seed
        )
        tenants = tenants_of(config.tokens_file, config.api_key_env)
        traffic = TrafficModel(config.traffic, tenants, config.seed * 7919 + index)
        stats_events = self.environment.events if config.locust_stats else None
        sender = _Sender(config, traffic, stats_events)
        reporter = gevent.spawn(self._report_loop, sender.recorder, config.report_interval_s)
        completed = False
        WORKER.report_stop = lambda: self._send_report(sender.recorder, False, abandoned=True)
        try:
            self._run(WORKER.schedule, sender, profile.duration_s)
            self._drain(sender.recorder, config.drain_s)
            completed = True
        finally:
            WORKER.report_stop = None
            reporter.kill()
            # a user stopped by Locust before its share's end (a rebalance, a quit) says so:
            # the master counts the rest of its share as lost_worker, never silently gone
            self._send_report(sender.recorder, final=completed, abandoned=not completed)
            sender.client.close()
        raise StopUser()

    def _run(self, schedule: ArrivalSchedule, sender: _Sender, duration_s: float) -> None:
        recorder, start = sender.recorder, WORKER.start_mono
        cap, tick_s = sender.config.inflight_cap, sender.config.send_tick_ms / 1000.0
        since_yield = 0
        while not WORKER.stop.is_set():
            offset_s = schedule.next_s()
            if offset_s is None or offset_s >= duration_s:
                break
            self.next_due_s = offset_s
            due = start + offset_s
            delay = due - time.monotonic()
            if delay > 0:
                # At least one tick: the sends that fall due meanwhile go out together right
                # after it (at most a tick late, and counted as lag), so one wake-up of the
                # hub serves several requests instead of one. The answers are read meanwhile.
                gevent.sleep(max(delay, tick_s))
                since_yield = 0
            else:
                since_yield += 1
                if since_yield >= _YIELD_EVERY:
                    gevent.sleep(0)
                    since_yield = 0
            sec = int(offset_s)
            recorder.scheduled(sec)
            if recorder.in_flight >= cap:
                recorder.dropped(sec)
            else:
                recorder.launched()
                sender.send(sec, due)  # never blocks: the answer is read in a loop callback
        self.next_due_s = None

    @staticmethod
    def _drain(recorder: Recorder, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while recorder.in_flight > 0 and time.monotonic() < deadline:
            gevent.sleep(0.05)

    def _report_loop(self, recorder: Recorder, interval_s: float) -> None:
        # just after each interval's end counted from time zero, not from this loop's start:
        # a second's sends are then all in the report that follows it, and the live probes
        # see it whole at once, whenever the user started before time zero
        start = WORKER.start_mono
        while True:
            elapsed_s = time.monotonic() - start
            due = start + (math.floor(elapsed_s / interval_s) + 1) * interval_s + _REPORT_LAG_S
            gevent.sleep(max(0.0, due - time.monotonic()))
            self._send_report(recorder, final=False)

    def _send_report(self, recorder: Recorder, final: bool, abandoned: bool = False) -> None:
        report = recorder.take_report(self.next_due_s, final=final)
        report["abandoned"] = abandoned
        self.environment.runner.send_message("llmchaos_report", report)


class _Sender:
    """Sends one request at a time on a pooled keep-alive connection (client.Client) and
    records each outcome once."""

    def __init__(self, config: LoadConfig, traffic: TrafficModel, stats_events: Any) -> None:
        self.config = config
        self.stats_events = stats_events
        self.traffic = traffic
        self.recorder = Recorder()
        self.goodput = config.goodput_slo
        host, port, self.path = split_url(config.url)
        self.host_header = f"{host}:{port}"
        self.client = Client(host, port, config.timeout_s, self._done)

    def send(self, sec: int, due: float) -> None:
        spec = self.traffic.next_request()
        exchange = Exchange(sec, due, spec.tenant, spec.stream)
        self.client.request(request_head(self.path, self.host_header, spec) + spec.body, exchange)
        # the lag is taken once the request is on the socket: a preemption while it was
        # being built is lag too, not time the target took
        self.recorder.sent(sec, (time.monotonic() - due) * 1000.0)

    def _done(self, ex: Exchange, answer: Answer, mode: str | None, now: float) -> None:
        latency_ms = (now - ex.due) * 1000.0
        outcome = answer.outcome
        good = (
            outcome == "ok"
            and self.goodput.defined
            and self.goodput.met(latency_ms, answer.ttft_ms, answer.tpot_ms)
        )
        self.recorder.finished(
            ex.sec,
            outcome,
            latency_ms,
            now - WORKER.start_mono,
            ttft_ms=answer.ttft_ms,
            itl_ms=answer.itl_ms,
            tpot_ms=answer.tpot_ms,
            output_tokens=answer.output_tokens,
            good=good,
            mode=mode,
            tenant=ex.tenant,
        )
        if self.stats_events is not None:
            self.stats_events.request.fire(
                request_type="POST",
                name=self.path,
                response_time=latency_ms,
                response_length=0,
                exception=None if outcome == "ok" else RuntimeError(outcome),
                context={},
            )
