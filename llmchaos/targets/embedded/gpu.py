"""Gray GPU faults of the embedded stack: errors while alive (Xid), and a slow GPU.

The simulated GPU is switched into a fault mode through its worker's control endpoint
(`PUT /fault/gpu`, llmchaos.stack.gpu_fault), as an LD_PRELOAD shim switches CUDA calls to
errors in NVIDIA Dynamo's tests. The checks do not take the worker's word for it: they send a
request straight to the worker, as a client would, and look at what comes back: a 500 while
its health check says 200; steps that take `slowdown` times longer.
"""

from __future__ import annotations

import json
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
_STEP_PROBE_TOKENS = (2, 22)
"""The check times two plain requests of these lengths; the difference over the extra tokens
is the decode step, free of the API overhead and the prefill. Twenty extra steps, so a
difference in the two requests' waits for a batch (tens of ms at 1,000 QPS) moves the step by
a few ms: with four (2 and 6), a slowed worker of a busy fleet once measured 21 ms against
the 44 asked and the check said not in effect."""


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
    def _completion(self, worker: str, max_tokens: int) -> tuple[int, str, float]:
        """(status, error code or "", seconds) of one plain completion sent to the worker."""
        url = self.topology.worker(worker).url + "/v1/completions"
        body = json.dumps({"prompt": "are you there", "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S) as response:
                response.read()
                return response.status, "", time.monotonic() - start
        except urllib.error.HTTPError as exc:
            try:
                code = str(json.loads(exc.read())["error"].get("code") or "")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = ""
            return exc.code, code, time.monotonic() - start
        except OSError as exc:
            raise StackError(f"{worker}: check request to {url} failed: {exc}") from None

    def verify_gpu_errors(self, details: dict[str, Any]) -> Verification:
        """Health 200 and a request straight to the worker answered 500."""
        worker = str(details["worker"])
        health = http_get_status(self.topology.worker(worker).url + "/health", 2.0)
        status, code, _ = self._completion(worker, 2)
        evidence = (
            f"{worker}: /health {health}; a completion sent straight to it: {status}"
            f"{f' {code}' if code else ''}"
        )
        return Verification(health == 200 and status >= 500, evidence)

    def verify_slow_gpu(self, details: dict[str, Any]) -> Verification:
        """The decode step timed straight at the worker, against its profile's."""
        worker = str(details["worker"])
        factor = float(details["slowdown"])
        settings = load_settings(WorkerSettings, Path(self.topology.worker(worker).settings_path))
        base_ms = settings.profile.decode_base_ms
        short, long = _STEP_PROBE_TOKENS
        timings = [self._completion(worker, n) for n in (short, long)]
        if any(status != 200 for status, _, _ in timings):
            return Verification(
                False, f"{worker}: check requests answered {[t[0] for t in timings]}"
            )
        step_ms = (timings[1][2] - timings[0][2]) * 1000 / (long - short)
        # halfway to the asked slowdown: a busy engine's steps are a bit longer anyway
        in_effect = step_ms >= base_ms * (1 + (factor - 1) / 2)
        return Verification(
            in_effect,
            f"{worker}: decode step {step_ms:.0f} ms timed straight at it (profile "
            f"{base_ms:g} ms x {factor:g} = {base_ms * factor:.0f} ms expected)",
        )
