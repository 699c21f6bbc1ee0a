"""GPU faults."""

from __future__ import annotations

from typing import Any

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["kill_gpu_process"]


def kill_gpu_process(worker: str = "", node: str = "") -> list[dict[str, Any]]:
    """SIGKILL the process holding a GPU, as `nvidia-smi --query-compute-apps=pid` lists it:
    of `worker` (a name, or "*" for every GPU worker) or of every GPU worker on `node`. The
    node agent (kubelet) restarts it after the model-load delay. Returns one record per worker:
    {"worker", "pid", ...}."""
    return faults.kill_gpu_process(current_run(), worker, node)
