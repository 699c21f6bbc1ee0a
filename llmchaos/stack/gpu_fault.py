"""Fault modes of a worker's simulated GPU, switched through its control endpoint.

    PUT /fault/gpu     {"mode": "xid", "xid": 79}       GPU errors while alive
                       {"mode": "slow", "slowdown": 10}  every engine step 10x slower
                       {"mode": "none"}                  back to normal
    PUT /fault/memory  {"grow_mib_s": 64}                the process grows 64 MiB/s (0: stops)
    GET /fault         {"gpu": {...}, "memory": {...}}

- xid: what a worker looks like after an Xid error (79: GPU fallen off the bus, 48: double
  bit ECC, 94/95: contained/uncontained ECC) while its pod stays Ready: /health and /healthz
  still answer 200 (the HTTP server is fine), but inference fails. A plain request gets 500
  `gpu_error` once the engine has run it; a stream is cut after its first token (the
  connection closes without the chunked encoding's end, as when the engine dies under it).
- slow: the engine's step cost times `slowdown`, no error (a GPU clocked down by a thermal or
  power brake: HW_SLOWDOWN).
- memory growth: the process allocates and touches `grow_mib_s` MiB a second, as a leak or
  host memory that grows with load would, until the kernel's memory limit (a cgroup the
  fault put it in) has the OOM killer end it.

These endpoints are on the worker's own port, which only the stack reaches: the gateways
proxy the generation routes alone. A restarted worker starts with no fault mode.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from llmchaos.stack.engine import Engine
from llmchaos.stack.httpserver import Handler, Request, Responder, Response
from llmchaos.stack.openai_api import ApiError

__all__ = ["GpuFault", "fault_routes"]

_GROW_STEP_S = 0.1
"""Memory grows in steps this far apart (a smooth line, not one big allocation)."""
_MODES = ("none", "xid", "slow")


class GpuFault:
    """One worker's fault modes (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.mode = "none"
        self.xid = 0
        self.grow_mib_s = 0.0
        self._grown: list[bytearray] = []
        self._grower: asyncio.Task[None] | None = None

    @property
    def breaks_inference(self) -> bool:
        """Inference fails (xid mode)."""
        return self.mode == "xid"

    def error(self) -> ApiError:
        """The 500 a plain request gets in xid mode (CUDA's message, vLLM's 500)."""
        return ApiError(
            500,
            f"CUDA error: an illegal memory access was encountered (Xid {self.xid}); the "
            "GPU needs a reset",
            type="internal_server_error",
            code="gpu_error",
        )

    def set_gpu(self, body: dict[str, Any]) -> None:
        """Switch the GPU's mode; raises ApiError 400 for a body it cannot take."""
        mode = body.get("mode")
        if mode not in _MODES:
            raise ApiError(400, f"mode: expected one of {', '.join(_MODES)}, got {mode!r}")
        slowdown = body.get("slowdown", 1.0) if mode == "slow" else 1.0
        xid = body.get("xid", 79) if mode == "xid" else 0
        if not isinstance(slowdown, int | float) or not 1 <= slowdown <= 1000:
            raise ApiError(400, f"slowdown: expected a number within 1..1000, got {slowdown!r}")
        if not isinstance(xid, int) or xid < 0:
            raise ApiError(400, f"xid: expected an Xid error number, got {xid!r}")
        self.mode, self.xid = mode, xid
        self._engine.step_factor = float(slowdown)

    def set_memory(self, body: dict[str, Any]) -> None:
        """Start (or stop, with 0) growing; raises ApiError 400 for a bad rate."""
        rate = body.get("grow_mib_s")
        if not isinstance(rate, int | float) or rate < 0:
            raise ApiError(400, f"grow_mib_s: expected MiB per second >= 0, got {rate!r}")
        self.grow_mib_s = float(rate)
        if self._grower is not None:
            self._grower.cancel()
            self._grower = None
        if rate > 0:
            self._grower = asyncio.get_running_loop().create_task(self._grow())
        else:
            self._grown.clear()

    async def _grow(self) -> None:
        step = max(1, int(self.grow_mib_s * (1 << 20) * _GROW_STEP_S))
        while True:
            # filled, not zeroed: a zeroed buffer can stay unbacked until written
            self._grown.append(bytearray(b"\x01") * step)
            await asyncio.sleep(_GROW_STEP_S)

    def state(self) -> dict[str, Any]:
        return {
            "gpu": {"mode": self.mode, "xid": self.xid, "slowdown": self._engine.step_factor},
            "memory": {
                "grow_mib_s": self.grow_mib_s,
                "grown_mib": round(sum(len(b) for b in self._grown) / (1 << 20), 1),
            },
        }

    def close(self) -> None:
        if self._grower is not None:
            self._grower.cancel()


def fault_routes(
    fault: GpuFault, json_response: Callable[[Any], Response]
) -> dict[str, dict[str, Handler]]:
    """The control endpoints of `fault`, as httpserver routes answering `json_response`."""

    def read_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(request.body or b"{}")
        except ValueError as exc:
            raise ApiError(400, f"not JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "expected a JSON object", code="invalid_type")
        return body

    async def put_gpu(request: Request, _: Responder) -> Response:
        fault.set_gpu(read_body(request))
        return json_response(fault.state())

    async def put_memory(request: Request, _: Responder) -> Response:
        fault.set_memory(read_body(request))
        return json_response(fault.state())

    async def get_state(request: Request, _: Responder) -> Response:
        return json_response(fault.state())

    return {
        "/fault/gpu": {"PUT": put_gpu},
        "/fault/memory": {"PUT": put_memory},
        "/fault": {"GET": get_state},
    }
