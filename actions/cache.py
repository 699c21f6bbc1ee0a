"""Token cache faults."""

from __future__ import annotations

from llmchaos import faults
from llmchaos.run import current_run

__all__ = ["expire_token_cache"]


def expire_token_cache(ttl_s: float = 0.0) -> int:
    """Delete every cached token (`token:*`, ttl_s = 0), or make them all expire together in
    `ttl_s` seconds. Returns the number of keys touched."""
    return faults.expire_token_cache(current_run(), ttl_s)
