"""Expiring a token cache in Redis: what every target's expire_token_cache does once it knows
where the cache is."""

from __future__ import annotations

from collections.abc import Iterable

from llmchaos.errors import StackError
from llmchaos.ledger import Verification

__all__ = ["expire_keys", "expiry_verification", "key_ttls"]


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


def key_ttls(
    url: str,
    password: str | None,
    shown: str,
    *,
    pattern: str = "",
    keys: Iterable[bytes] = (),
    timeout_s: float = 5.0,
) -> dict[bytes, int]:
    """The TTL in ms of each key matching `pattern` (or of `keys`): -2 no such key, -1 none.
    Kept in memory only: the keys hold the tokens."""
    import redis

    client = redis.Redis.from_url(url, password=password, socket_timeout=timeout_s)
    try:
        names = list(client.scan_iter(pattern, count=1000)) if pattern else list(keys)
        pipe = client.pipeline(transaction=False)
        for key in names:
            pipe.pttl(key)
        return dict(zip(names, (int(v) for v in pipe.execute()), strict=True))
    except redis.RedisError as exc:
        raise StackError(f"token cache {shown}: {exc}") from None
    finally:
        client.close()


def expiry_verification(
    ttl_s: float, pattern: str, before: dict[bytes, int], now: dict[bytes, int]
) -> Verification:
    """Each key of `before` (TTLs just before expire_keys) against `now`: gone, or expiring
    within ttl_s, or cached again since (a TTL longer than it had left before); a key whose
    TTL just kept counting down was not touched."""
    if not before:
        return Verification(True, f"no {pattern} key was cached: nothing to expire")
    limit_ms = ttl_s * 1000 if ttl_s > 0 else 0
    gone = sum(1 for k in before if now[k] == -2 or (limit_ms and 0 <= now[k] <= limit_ms))
    again = sum(1 for k in before if now[k] > before[k] > 0 and now[k] > limit_ms)
    untouched = len(before) - gone - again
    what = "gone" if ttl_s == 0 else f"gone or expiring within {ttl_s:g} s"
    return Verification(
        untouched == 0,
        f"{len(before)} {pattern} keys: {gone} {what}, {again} cached again since, "
        f"{untouched} untouched",
    )
