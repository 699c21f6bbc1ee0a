"""The gateway's view of its upstream workers: health, load and which one gets a request.

Rules (also in the gateway's README section):

- healthy = the last active check passed (GET /healthz answered 200 and, if the body is JSON,
  `status` is "ready") and the worker is not ejected. A worker starts unhealthy until its
  first check passes, so a restarted worker that is still loading the model gets no traffic.
  A refused connection or a non-ready answer fails a worker at once; timeouts only after
  `health_timeouts_to_fail` in a row (one can be the gateway's own loop lag in a burst).
- passive health: a request that fails on a worker (connect error, timeout, 5xx, broken
  stream) ejects it for `eject_s` (a request that got no answer and was sent before its last
  ejection does not eject it again: the same outage); an active check that *started after* the
  ejection and passes readmits it early, so a worker restarted by its node agent is back
  within one health interval instead of `eject_s`, unless the worker was ejected for a bad
  *answer* (a 5xx or a broken stream): its /healthz saying ready proves nothing then (a GPU
  failing after an Xid error), so it stays out for `eject_s` times the number of such
  ejections in a row (Envoy's outlier detection, with
  successful_active_health_check_uneject_host off); a run of them is forgotten once the worker
  stays clean as long as its last ejection lasted. A request that timed out while an active
  check of the same worker passed counts as a bad answer too: the worker answers its checks
  but not its requests (a slow or lossy link, a gray failure), and readmitting it on the next
  check would send it requests to time out again and again. So does a worker outrun by a hedge
  that another worker answered within `hedge_after_s` (proxy.py). Such gray ejections stop at
  `max_ejection_ratio` of a mode's workers out at once, dead ones included (no cap by default:
  settings.py says why). Without `passive_ejection` (a known-bad variant) nothing is ejected.
- capacity: a worker can take a request while outstanding < max_num_seqs * (1 + ratio), ratio
  = `worker_queue_allowance_ratio` for gpu workers, `cpu_queue_allowance_ratio` (0) for cpu
  ones (max_num_seqs read from /healthz).
- selection: least outstanding (in turn with `round_robin`, a known-bad variant) among
  healthy gpu workers with capacity; else (cpu_fallback)
  healthy cpu workers with capacity, for an answer of at most `cpu_spill_max_tokens` while a
  gpu worker is healthy (a longer one takes a cpu worker past the first-byte timeout); else
  the least loaded healthy gpu worker even though it is full (its queue is shorter to wait in
  than a cpu one), else a full cpu worker; else none (-> 503 no_healthy_upstream). Ties
  rotate so that an idle pool spreads requests.
- without `failover` (the `no-failover` variant): round-robin over all gpu workers (cpu
  workers only when there is no gpu worker and `cpu_fallback` is on), ignoring health,
  ejection and capacity, and the proxy does not retry: a Kubernetes Service without readiness
  probes. Health is still checked, for metrics, logs and `max_num_seqs`. Round-robin rather
  than least outstanding: a dead worker fails fast and so always looks least loaded, which
  would pull nearly all traffic into it instead of its share.
- estimated queue = sum over workers of max(0, outstanding - max_num_seqs): what admission
  control sheds on.
- CPU fallback is bounded: when no gpu worker is healthy and every healthy cpu worker is at
  capacity, admission control sheds (429) instead of queueing on the cpu workers. A cpu
  worker's queue is seconds per request deep, so queueing there ends in client timeouts and
  gateway 504s; a fast 429 is the degraded answer a client can act on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence

import aiohttp
from yarl import URL

from llmchaos.stack.openai_api import CHAT_PATH, COMPLETIONS_PATH
from llmchaos.stack.settings import GatewaySettings, UpstreamWorker

__all__ = ["Worker", "WorkerPool"]

log = logging.getLogger(__name__)


class Worker:
    """One upstream worker and what the gateway knows about it."""

    __slots__ = (
        "_queue_ratio",
        "bad_answers",
        "capacity",
        "check_timeouts",
        "checked_at",
        "ejected_at",
        "ejected_until",
        "health_url",
        "max_num_seqs",
        "mode",
        "name",
        "outstanding",
        "ready",
        "upstream",
        "urls",
    )

    def __init__(self, upstream: UpstreamWorker, queue_ratio: float) -> None:
        base = upstream.url.rstrip("/")
        self.upstream = upstream
        self.name = upstream.name
        self.mode: str = upstream.mode
        # parsed once: aiohttp would parse a str URL on every request
        self.urls = {path: URL(base + path) for path in (CHAT_PATH, COMPLETIONS_PATH)}
        """The worker's generation routes by API path."""
        self.health_url = URL(base + "/healthz")
        self.outstanding = 0
        self.ready = False
        self.check_timeouts = 0
        """Active checks in a row that timed out."""
        self.checked_at = -math.inf
        """When the last active check that passed ended (monotonic)."""
        self.ejected_until = 0.0
        self.ejected_at = -math.inf
        self.bad_answers = 0
        """Ejections in a row for a bad answer (the outlier multiplier); 0 for a timeout's."""
        self._queue_ratio = queue_ratio
        self.max_num_seqs = 1
        self.capacity = 1
        self.set_max_num_seqs(1)

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Record the batch size the worker reported and the capacity that follows."""
        self.max_num_seqs = max_num_seqs
        self.capacity = max_num_seqs + math.ceil(max_num_seqs * self._queue_ratio)

    def healthy(self, now: float) -> bool:
        """Passes active checks and is not ejected at monotonic time `now`."""
        return self.ready and now >= self.ejected_until


class WorkerPool:
    """All upstream workers of one gateway, with selection and health checking."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._ratios = {
            "gpu": max(0.0, settings.worker_queue_allowance_ratio),
            "cpu": max(0.0, settings.cpu_queue_allowance_ratio),
        }
        self._cpu_fallback = settings.cpu_fallback
        self._cpu_spill_max_tokens = settings.cpu_spill_max_tokens
        self._failover = settings.failover
        self._set(tuple(Worker(w, self._ratios[w.mode]) for w in settings.workers))
        self._eject_s = settings.eject_s
        self._health_interval_s = settings.health_interval_s
        self._health_timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s or None)
        self._timeouts_to_fail = max(1, settings.health_timeouts_to_fail)
        self._passive_ejection = settings.passive_ejection
        self._max_ejection_ratio = settings.max_ejection_ratio
        self._in_turn = settings.round_robin
        self._rotation = 0

    def _set(self, workers: tuple[Worker, ...]) -> None:
        self.workers = workers
        self._gpu = tuple(w for w in workers if w.mode == "gpu")
        self._cpu = tuple(w for w in workers if w.mode == "cpu")
        # what a Service without readiness probes spreads over: every gpu worker, always
        self._always_eligible = self._gpu or (self._cpu if self._cpu_fallback else ())

    def set_workers(self, upstreams: Sequence[UpstreamWorker]) -> None:
        """Route to `upstreams` from now on (what the registry gave: gateway/discovery.py). A
        worker known by name and URL keeps its health and load; a new one starts unhealthy
        until its first check."""
        known = {(w.name, w.upstream.url): w for w in self.workers}
        self._set(
            tuple(known.get((u.name, u.url)) or Worker(u, self._ratios[u.mode]) for u in upstreams)
        )

    @property
    def upstreams(self) -> tuple[UpstreamWorker, ...]:
        return tuple(w.upstream for w in self.workers)

    def select(self, exclude: Collection[Worker] = (), output_tokens: int = 0) -> Worker | None:
        """The worker for the next request, which asks for up to `output_tokens` (rules in the
        module docstring), or None."""
        self._rotation += 1
        if not self._failover:
            return self._round_robin(exclude)
        now = time.monotonic()
        chosen = self._least_loaded(self._gpu, now, exclude, within_capacity=True)
        # a long answer spilled to a cpu worker outlasts the first-byte timeout there: it waits
        # on a full gpu worker instead (with no healthy gpu worker, the cpu step below takes it)
        spill = output_tokens <= self._cpu_spill_max_tokens
        if chosen is None and self._cpu_fallback and spill:
            chosen = self._least_loaded(self._cpu, now, exclude, within_capacity=True)
        if chosen is None:
            chosen = self._least_loaded(self._gpu, now, exclude, within_capacity=False)
        if chosen is None and self._cpu_fallback:
            chosen = self._least_loaded(self._cpu, now, exclude, within_capacity=False)
        return chosen

    def _round_robin(self, exclude: Collection[Worker]) -> Worker | None:
        workers = self._always_eligible
        count = len(workers)
        for i in range(count):
            worker = workers[(self._rotation + i) % count]
            if worker not in exclude:
                return worker
        return None

    def _least_loaded(
        self,
        workers: tuple[Worker, ...],
        now: float,
        exclude: Collection[Worker],
        within_capacity: bool,
    ) -> Worker | None:
        best: Worker | None = None
        count = len(workers)
        for i in range(count):
            worker = workers[(self._rotation + i) % count]
            if not worker.healthy(now) or worker in exclude:
                continue
            if within_capacity and worker.outstanding >= worker.capacity:
                continue
            if self._in_turn:
                return worker  # the first eligible in turn
            if best is None or worker.outstanding < best.outstanding:
                best = worker
        return best

    def eject(
        self, worker: Worker, reason: str, answered: bool = False, sent_at: float = math.inf
    ) -> None:
        """Skip `worker` after a failed request (passive health): `answered` when it answered
        badly (5xx, broken stream), else it did not answer; `sent_at` (monotonic) when the
        request went out (rules in the module docstring)."""
        if not self._passive_ejection:
            return
        now = time.monotonic()
        if not answered and reason.endswith("timeout") and worker.checked_at > sent_at:
            answered = True  # its checks pass while its requests time out: a gray failure
            reason += " while its health checks passed"
        if not answered and sent_at < worker.ejected_at:
            # in flight when it was last ejected, whether that ejection has ended or not: the
            # outage already acted on. Each such timeout renewing the ejection kept a hung
            # worker out a first-byte timeout longer than `eject_s`, long enough to look
            # recovered between two of its turns
            return
        if answered:
            if now < worker.ejected_until and worker.bad_answers:
                return  # sent before its ejection: the same outlier, not a new ejection
            if not self._can_spare(worker, now):
                log.warning("worker %s kept despite %s: too few healthy peers", worker.name, reason)
                return
            last_s = worker.ejected_until - worker.ejected_at
            if now > worker.ejected_until + last_s:
                worker.bad_answers = 0  # clean as long as its last ejection: forgiven
            worker.bad_answers += 1
        eject_s = self._eject_s * max(1, worker.bad_answers if answered else 0)
        if worker.healthy(now):
            log.warning("worker %s ejected for %.1f s: %s", worker.name, eject_s, reason)
        worker.ejected_at = now
        worker.ejected_until = now + eject_s

    def _can_spare(self, worker: Worker, now: float) -> bool:
        """Whether `worker` may be ejected for a gray failure: at most `max_ejection_ratio` of
        its mode's workers out at once (Envoy's max_ejection_percent). A worker without peers
        is always ejectable: its mode's fallback is all there is."""
        peers = self._gpu if worker.mode == "gpu" else self._cpu
        if len(peers) < 2:
            return True
        out_after = 1 + sum(1 for w in peers if w is not worker and not w.healthy(now))
        return out_after <= self._max_ejection_ratio * len(peers)

    def cpu_fallback_full(self) -> bool:
        """No healthy gpu worker, and every healthy cpu worker at capacity (at least one)."""
        if not self._failover or not self._cpu_fallback:
            return False
        now = time.monotonic()
        if any(w.healthy(now) for w in self._gpu):
            return False
        cpus = [w for w in self._cpu if w.healthy(now)]
        return bool(cpus) and all(w.outstanding >= w.capacity for w in cpus)

    def estimated_queue(self) -> int:
        """Requests beyond the workers' running batches, summed over all workers."""
        return sum(max(0, w.outstanding - w.max_num_seqs) for w in self.workers)

    def healthy_counts(self) -> dict[str, int]:
        """Healthy workers per serving mode (both modes always present)."""
        now = time.monotonic()
        counts = {"gpu": 0, "cpu": 0}
        for worker in self.workers:
            if worker.healthy(now):
                counts[worker.mode] = counts.get(worker.mode, 0) + 1
        return counts

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One round of active health checks, all workers at once."""
        await asyncio.gather(*(self._check(session, w) for w in self.workers))

    async def run_health_checks(self, session: aiohttp.ClientSession) -> None:
        """Check every `health_interval_s` (the first round one interval from now) until
        cancelled."""
        started = time.monotonic()
        while True:
            await asyncio.sleep(max(0.0, self._health_interval_s - (time.monotonic() - started)))
            started = time.monotonic()
            await self.check_all(session)

    async def _check(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        started = time.monotonic()
        problem = None
        body: object = None
        try:
            async with session.get(worker.health_url, timeout=self._health_timeout) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
                if resp.status != 200:
                    problem = f"/healthz answered {resp.status}"
            worker.check_timeouts = 0
        except TimeoutError:
            worker.check_timeouts += 1
            if worker.check_timeouts < self._timeouts_to_fail:
                return  # keep the last verdict until the timeout repeats
            problem = f"/healthz timed out {worker.check_timeouts} times in a row"
        except (aiohttp.ClientError, ValueError) as exc:
            worker.check_timeouts = 0
            problem = f"/healthz failed: {type(exc).__name__} {exc}".rstrip()
        if problem is None and isinstance(body, dict):
            if body.get("status", "ready") != "ready":
                problem = f"/healthz status {body.get('status')!r}"
            max_num_seqs = body.get("max_num_seqs")
            if isinstance(max_num_seqs, int) and max_num_seqs > 0:
                worker.set_max_num_seqs(max_num_seqs)
        ready = problem is None
        if ready:
            worker.checked_at = time.monotonic()
        if ready != worker.ready:
            log.info("worker %s %s", worker.name, "healthy" if ready else f"unhealthy: {problem}")
        worker.ready = ready
        if not ready:
            worker.bad_answers = 0  # restarted or loading: a new process gets a clean slate
        elif started >= worker.ejected_at and not worker.bad_answers:
            worker.ejected_until = 0.0
