"""The open-loop Locust user: one per worker process, following that worker's arrival schedule.

Locust's own users are closed-loop (a user waits for its answer before it sends again), so a
stalled target makes them stop sending and their latency looks fine. This user never waits for
answers: it sleeps until the next scheduled send time, hands the send to a greenlet of a bounded
gevent Pool, and measures every request from its *scheduled* time. A send that starts late shows
up as schedule lag; a send over the in-flight cap is counted as dropped.

Imports gevent and Locust: only Locust processes import this module (via locustfile.py).
Config, start time and live control reach it as Locust messages (see process.py), so the same
class runs unchanged on Locust workers in Kubernetes.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import gevent
import gevent.event
from geventhttpclient.connectionpool import ConnectionPool
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError, HTTPSocketResponse
from locust import User, task
from locust.exception import StopUser

from llmchaos.load.config import LoadConfig
from llmchaos.load.profiles import build_profile
from llmchaos.load.responses import Headers, classify, read_stream
from llmchaos.load.schedule import ArrivalSchedule
from llmchaos.load.timeline import Recorder
from llmchaos.load.traffic import RequestSpec, TrafficModel, TrafficSpec, load_tenants
from llmchaos.load.wire import START_MESSAGE_WAIT_S, config_from_options, request_head, split_url

__all__ = ["WORKER", "OpenLoopLLMUser"]

logger = logging.getLogger(__name__)

_YIELD_EVERY = 64
"""When behind schedule, let the send greenlets run at least every this many arrivals."""


class _Deadline(Exception):
    """The whole-request timeout fired."""


class _PeekingPool(ConnectionPool):
    """geventhttpclient's pool with a cheaper check of an idle connection before reuse."""

    @staticmethod
    def _is_socket_alive(sock: Any) -> bool:
        # The stock check runs gevent's select() (watchers, a switch to the hub: ~6% of this
        # user's CPU at 2500 QPS). One non-blocking peek tells the same: an idle keep-alive
        # connection has nothing to read; b"" is the server's FIN, bytes are stale data. On the
        # raw socket (`_sock`): gevent's recv would wait out the EAGAIN that means "alive".
        try:
            return not sock._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except (OSError, ValueError):
            return False


class WorkerState:
    """What this process's user needs from the master: start time, live control."""

    def __init__(self) -> None:
        self.start_epoch = gevent.event.AsyncResult()
        self.schedule: ArrivalSchedule | None = None
        self.start_mono = 0.0
        self.stop = gevent.event.Event()
        self.claimed = False

    def on_start(self, msg: Any, **_: Any) -> None:
        self.start_epoch.set(float(msg.data["start_epoch_s"]))

    def on_control(self, msg: Any, **_: Any) -> None:
        data = msg.data
        if data.get("stop"):
            self.stop.set()
        if self.schedule is None:
            return
        at_s = time.monotonic() - self.start_mono
        if "qps" in data:
            self.schedule.set_qps(float(data["qps"]), at_s)
        if "burst" in data:
            b = data["burst"]
            self.schedule.add_burst(
                at_s, float(b["duration_s"]), float(b["factor"]), int(b["seed"])
            )


WORKER = WorkerState()


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
        options = self.environment.parsed_options
        config = config_from_options(options)
        workers = max(1, int(getattr(options, "expect_workers", 1) or 1))
        index = max(0, getattr(self.environment.runner, "worker_index", 0)) % workers
        start_epoch = WORKER.start_epoch.get(timeout=START_MESSAGE_WAIT_S)
        WORKER.start_mono = time.monotonic() + (start_epoch - time.time())
        profile = build_profile(config)
        WORKER.schedule = ArrivalSchedule(
            profile, share=1.0 / workers, index=index, seed=config.seed
        )
        tenants = load_tenants(config.tokens_file) if config.tokens_file else None
        traffic = TrafficModel(_traffic_spec(config), tenants, config.seed * 7919 + index)
        stats_events = self.environment.events if config.locust_stats else None
        sender = _Sender(config, traffic, stats_events)
        reporter = gevent.spawn(self._report_loop, sender.recorder, config.report_interval_s)
        try:
            self._run(WORKER.schedule, sender, profile.duration_s)
            self._drain(sender.recorder, config.drain_s)
        finally:
            reporter.kill()
            self._send_report(sender.recorder, final=True)
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
                # hub serves several requests instead of one.
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
                # A raw greenlet: no Greenlet object or links, the cheapest way to start one.
                gevent.spawn_raw(sender.send, sec, due)
        self.next_due_s = None

    @staticmethod
    def _drain(recorder: Recorder, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while recorder.in_flight > 0 and time.monotonic() < deadline:
            gevent.sleep(0.05)

    def _report_loop(self, recorder: Recorder, interval_s: float) -> None:
        while True:
            gevent.sleep(interval_s)
            self._send_report(recorder, final=False)

    def _send_report(self, recorder: Recorder, final: bool) -> None:
        report = recorder.take_report(self.next_due_s, final=final)
        self.environment.runner.send_message("llmchaos_report", report)


def _traffic_spec(config: LoadConfig) -> TrafficSpec:
    return TrafficSpec(
        model=config.model,
        prompt_alpha=config.prompt_alpha,
        prompt_min_tokens=config.prompt_min_tokens,
        prompt_max_tokens=config.prompt_max_tokens,
        context_tokens=config.context_tokens,
        output_median_tokens=config.output_median_tokens,
        output_max_tokens=config.output_max_tokens,
        stream_share=config.stream_share,
        bad_token_share=config.bad_token_share,
        bad_tokens=config.bad_tokens,
    )


class _Sender:
    """Sends one request on a pooled keep-alive connection and records its outcome."""

    def __init__(self, config: LoadConfig, traffic: TrafficModel, stats_events: Any) -> None:
        self.config = config
        self.stats_events = stats_events
        self.traffic = traffic
        self.recorder = Recorder()
        host, port, self.path = split_url(config.url)
        self.host_header = f"{host}:{port}"
        # The per-request deadline (one gevent.Timeout) bounds every socket operation, so the
        # sockets need no timeout of their own (each would cost a timer per recv).
        self.connections = _PeekingPool(
            host,
            port,
            host,
            port,
            size=config.inflight_cap,
            connection_timeout=config.timeout_s,
            network_timeout=None,  # type: ignore[arg-type]
        )

    def send(self, sec: int, due: float) -> None:
        self.recorder.sent(sec, (time.monotonic() - due) * 1000.0)
        spec = self.traffic.next_request()
        outcome, mode, ttft_ms, tokens_per_s = "connection", None, None, None
        deadline = gevent.Timeout(self.config.timeout_s, _Deadline)
        deadline.start()
        try:
            outcome, mode, ttft_ms, tokens_per_s = self._exchange(spec, due)
        except _Deadline:
            outcome = "timeout"
        except TimeoutError:
            outcome = "timeout"
        except (OSError, HTTPConnectionClosed):
            outcome = "connection"
        except HTTPParseError:
            outcome = "bad_body"
        except Exception:
            # A bug must not leave the request unaccounted; it is logged and counted.
            logger.exception("unexpected error while sending a request")
            outcome = "connection"
        finally:
            deadline.close()
        now = time.monotonic()
        self.recorder.finished(
            sec,
            outcome,
            (now - due) * 1000.0,
            now - WORKER.start_mono,
            ttft_ms=ttft_ms,
            tokens_per_s=tokens_per_s,
            mode=mode,
            tenant=spec.tenant,
        )
        if self.stats_events is not None:
            self.stats_events.request.fire(
                request_type="POST",
                name=self.path,
                response_time=(now - due) * 1000.0,
                response_length=0,
                exception=None if outcome == "ok" else RuntimeError(outcome),
                context={},
            )

    def _exchange(
        self, spec: RequestSpec, due: float
    ) -> tuple[str, str | None, float | None, float | None]:
        sock = self.connections.get_socket()
        reusable = False
        try:
            _send_all(sock, request_head(self.path, self.host_header, spec) + spec.body)
            response = HTTPSocketResponse(
                sock,
                block_size=65536,
                method="POST",
                headers_type=Headers,  # type: ignore[arg-type]
            )
            status = response.status_code
            mode = response.get("x-serving-mode")
            ttft_ms = tokens_per_s = None
            if status == 200 and spec.stream:
                outcome, ttft_ms, tokens_per_s = read_stream(response, due)
            else:
                outcome = classify(status, response.read())
            reusable = response.message_complete and not response.should_close()
            return outcome, mode if isinstance(mode, str) else None, ttft_ms, tokens_per_s
        finally:
            # A connection left mid-response would hand stale bytes to the next request.
            if reusable:
                self.connections.return_socket(sock)
            else:
                self.connections.release_socket(sock)


def _send_all(sock: Any, data: bytes) -> None:
    """sock.sendall without its per-call getsockopt(SO_SNDBUF) and chunking (~4% of this
    user's CPU): a request fits the loopback send buffer, so one send() normally takes it."""
    view = memoryview(data)
    while view:
        view = view[sock.send(view) :]
