"""GPU faults: a process killed or hung, a GPU that fails or slows down while alive."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = [
    "clear_gpu_fault",
    "gpu_errors",
    "hang_gpu_process",
    "kill_gpu_process",
    "resume_gpu_process",
    "slow_gpu",
]


def kill_gpu_process(worker: str = "", node: str = "") -> list[dict[str, Any]]:
    """SIGKILL the process holding a GPU, as `nvidia-smi --query-compute-apps=pid` lists it:
    of `worker` (a name, or "*" for every GPU worker) or of every GPU worker on `node`. The
    node agent (kubelet) restarts it after the model-load delay. Returns one record per worker:
    {"worker", "pid", ...}."""
    return faults.kill_gpu_process(current_run(), worker, node)


def hang_gpu_process(worker: str = "", node: str = "", hold_s: float = 0.0) -> list[dict[str, Any]]:
    """SIGSTOP the process holding a GPU (of `worker`, or of each GPU worker on `node`): it
    hangs with its port open, so only health checks with a timeout see it. Resumed (SIGCONT)
    by resume_gpu_process or at the run's end. `hold_s`: a recovery counts only once its
    stable run outlasts this much of the hang. Returns [{"worker", "pid"}]."""
    return faults.hang_gpu_process(current_run(), worker, node, hold_s)


def resume_gpu_process(worker: str = "", node: str = "") -> list[str]:
    """SIGCONT what hang_gpu_process stopped (idempotent). Returns the workers."""
    return faults.resume_gpu_process(current_run(), worker, node)


def gpu_errors(worker: str, xid: int = 79) -> dict[str, Any]:
    """GPU errors while the worker stays alive, as after an Xid error: its health checks
    answer 200, plain requests get 500, streams break after their first token. Until
    clear_gpu_fault or the run's end."""
    return faults.gpu_errors(current_run(), worker, xid)


def slow_gpu(worker: str, slowdown: float = 10.0) -> dict[str, Any]:
    """Every engine step of `worker` `slowdown` times slower, without an error (a GPU clocked
    down by a thermal or power brake). Until clear_gpu_fault or the run's end."""
    return faults.slow_gpu(current_run(), worker, slowdown)


def clear_gpu_fault(worker: str) -> str:
    """End gpu_errors or slow_gpu on `worker` (idempotent)."""
    return faults.clear_gpu_fault(current_run(), worker)
