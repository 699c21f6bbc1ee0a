"""Expiring a token cache in Redis: what every target's expire_token_cache does once it knows
where the cache is."""

from __future__ import annotations

from llmchaos.errors import StackError

__all__ = ["expire_keys"]


def expire_keys(
    url: str,
    password: str | None,
    pattern: str,
    ttl_s: float,
    shown: str,
    *,
    timeout_s: float = 5.0,
    dry_run: bool = False,
) -> int:
    """DEL (ttl_s 0) or PEXPIRE every key matching `pattern` in the Redis at `url`; returns
    how many (`dry_run`: how many it would touch, touching none). Raises StackError naming
    `shown` (the URL without its password)."""
    import redis  # only targets with a token cache need the client

    client = redis.Redis.from_url(url, password=password, socket_timeout=timeout_s)
    try:
        keys = list(client.scan_iter(pattern, count=1000))
        if keys and not dry_run:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                if ttl_s > 0:
                    pipe.pexpire(key, max(1, int(ttl_s * 1000)))
                else:
                    pipe.delete(key)
            pipe.execute()
    except redis.RedisError as exc:
        raise StackError(f"token cache {shown}: {exc}") from None
    finally:
        client.close()
    return len(keys)
