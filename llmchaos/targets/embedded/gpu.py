"""Gray GPU faults of the embedded stack: errors while alive (Xid), and a slow GPU.

The simulated GPU is switched into a fault mode through its worker's control endpoint
(`PUT /fault/gpu`, llmchaos.stack.gpu_fault), as an LD_PRELOAD shim switches CUDA calls to
errors in NVIDIA Dynamo's tests. The checks do not take the worker's word for it: they send a
request straight to the worker, as a client would, and look at what comes back: a 500 while
its health check says 200; steps that take `slowdown` times longer.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmchaos.errors import StackError
from llmchaos.ledger import Verification
from llmchaos.stack.procs import http_get_status
from llmchaos.stack.settings import WorkerSettings, load_settings

if TYPE_CHECKING:
    from llmchaos.stack.topology import Topology

__all__ = ["GpuFaults"]

_PROBE_TIMEOUT_S = 20.0
"""One check request straight to the worker: long enough for steps ten times slower behind a
batch that grew meanwhile."""
_STEP_PROBE_TOKENS = 42
"""The slow-GPU check streams one request of this many tokens straight to the worker and times
its decode steps from the chunks' arrival (continuous usage gives each chunk's token count).
It used to time the difference between a 2- and a 22-token request: a difference in their
waits for a batch slot on a worker of a 1,400-QPS fleet once made a 44-ms step look 26 ms."""


class _CheckAnswered(Exception):
    """A check request answered with this HTTP status, not 200."""


class GpuFaults:
    """The worker's fault modes (see the module docstring)."""

    if TYPE_CHECKING:

        @property
        def topology(self) -> Topology: ...

    def _worker_control(self, worker: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT `body` to the worker's fault control endpoint; its answer (the new state)."""
        url = self.topology.worker(worker).url + path
        request = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except (OSError, ValueError) as exc:
            raise StackError(f"{worker}: {url} did not take {body}: {exc}") from None
        return answer

    def gpu_errors(self, worker: str, xid: int) -> dict[str, Any]:
        self._worker_control(worker, "/fault/gpu", {"mode": "xid", "xid": xid})
        return {"worker": worker, "xid": xid}

    def slow_gpu(self, worker: str, factor: float) -> dict[str, Any]:
        self._worker_control(worker, "/fault/gpu", {"mode": "slow", "slowdown": factor})
        return {"worker": worker, "slowdown": factor}

    def clear_gpu_fault(self, worker: str) -> None:
        try:
            self._worker_control(worker, "/fault/gpu", {"mode": "none"})
        except StackError:
            # a worker that does not answer holds no fault mode: a restart starts clean
            if http_get_status(self.topology.worker(worker).url + "/healthz", 0.5) is not None:
                raise

    # -- checks --------------------------------------------------------------------------
    def _completion_request(self, worker: str, body: dict[str, Any]) -> urllib.request.Request:
        """A completion request straight to the worker, as a client would send it."""
        return urllib.request.Request(
            self.topology.worker(worker).url + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )

    def _completion_status(self, worker: str) -> tuple[int, str]:
        """(status, error code or "") of one plain completion sent to the worker."""
        request = self._completion_request(worker, {"prompt": "are you there", "max_tokens": 2})
        try:
            with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S) as response:
                response.read()
                return response.status, ""
        except urllib.error.HTTPError as exc:
            try:
                code = str(json.loads(exc.read())["error"].get("code") or "")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = ""
            return exc.code, code
        except OSError as exc:
            raise StackError(
                f"{worker}: check request to {request.full_url} failed: {exc}"
            ) from None

    def _decode_step_ms(self, worker: str) -> float:
        """Milliseconds per decode step of one streamed request sent straight to the worker.

        The slope is Theil-Sen's, the median of the slopes between every two chunks: the
        checker's process, descheduled under the load, reads a few chunks late, and those
        move a few slopes, not the median. The time to the first chunk (a wait for a batch
        slot, the prefill) is not in it."""
        body = {
            "prompt": "are you there",
            "max_tokens": _STEP_PROBE_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        request = self._completion_request(worker, body)
        points: list[tuple[int, float]] = []  # (tokens so far, seconds) per chunk
        try:
            with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S) as response:
                for line in response:
                    now = time.monotonic()
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):  # the last, usage-only chunk has none
                        points.append((int(chunk["usage"]["completion_tokens"]), now))
        except urllib.error.HTTPError as exc:
            raise _CheckAnswered(exc.code) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StackError(f"{worker}: the check stream from {request.full_url}: {exc}") from None
        slopes = [
            (t2 - t1) / (n2 - n1)
            for i, (n1, t1) in enumerate(points)
            for n2, t2 in points[i + 1 :]
            if n2 > n1
        ]
        if not slopes:
            raise StackError(f"{worker}: the check stream brought {len(points)} token chunks")
        return 1000 * statistics.median(slopes)

    def verify_gpu_errors(self, details: dict[str, Any]) -> Verification:
        """Health 200 and a request straight to the worker answered 500."""
        worker = str(details["worker"])
        health = http_get_status(self.topology.worker(worker).url + "/health", 2.0)
        status, code = self._completion_status(worker)
        evidence = (
            f"{worker}: /health {health}; a completion sent straight to it: {status}"
            f"{f' {code}' if code else ''}"
        )
        return Verification(health == 200 and status >= 500, evidence)

    def verify_slow_gpu(self, details: dict[str, Any]) -> Verification:
        """The decode step timed straight at the worker, against its profile's.

        A slowed engine never steps faster than its profile's base times the slowdown, so
        the check allows the checker's own timing 20% below that and should not miss a fault
        in effect (12 of 12 at 44 ms or more on a 1,400-QPS fleet, asked 44). It can take a
        fault that is not for one that is: an unslowed engine of a loaded fleet prefills in
        most steps, and the same checks timed one at 32-39 ms. No other engine is a fair
        yardstick (the routing gives the slowed one fewer arrivals, so fewer of its steps
        prefill); the experiment's known-bad control is what shows its probes see the
        slowdown."""
        worker = str(details["worker"])
        factor = float(details["slowdown"])
        settings = load_settings(WorkerSettings, Path(self.topology.worker(worker).settings_path))
        base_ms = settings.profile.decode_base_ms
        try:
            step_ms = self._decode_step_ms(worker)
        except _CheckAnswered as answered:
            return Verification(False, f"{worker}: the check request answered {answered}")
        # and at least halfway to it, for slowdowns too small for 20% to tell
        in_effect = step_ms >= base_ms * max(0.8 * factor, (1 + factor) / 2)
        return Verification(
            in_effect,
            f"{worker}: decode step {step_ms:.0f} ms timed straight at it (profile "
            f"{base_ms:g} ms x {factor:g} = {base_ms * factor:.0f} ms expected)",
        )
