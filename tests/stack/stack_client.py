"""A small blocking client and bounded background traffic for the stack's tests.

Deliberately not the load engine: these tests check the target, so the client is the
simplest thing that can tell which worker, mode and gateway served each request.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from llmchaos.stack.tokendb import read_tokens_file
from llmchaos.stack.topology import Topology


@dataclass(frozen=True)
class Reply:
    status: int | None
    """HTTP status, None for a connection error or timeout."""
    headers: dict[str, str]
    body: bytes
    sent_at: float
    elapsed_s: float

    @property
    def worker(self) -> str | None:
        return self.headers.get("x-worker")

    @property
    def mode(self) -> str | None:
        return self.headers.get("x-serving-mode")

    @property
    def gateway(self) -> str | None:
        return self.headers.get("x-gateway")


def valid_token(topology: Topology, index: int = 0) -> str:
    return [t.token for t in read_tokens_file(topology.tokens_file) if not t.revoked][index]


def chat(
    url: str,
    token: str | None,
    *,
    model: str = "llmchaos-7b",
    max_tokens: int = 4,
    timeout_s: float = 8.0,
    body: bytes | None = None,
) -> Reply:
    payload = (
        body
        or json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
            }
        ).encode()
    )
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", payload, headers)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data = response.read()
            return Reply(response.status, _lower(response.headers), data, started, _since(started))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, _lower(exc.headers), exc.read(), started, _since(started))
    except (OSError, ValueError):
        return Reply(None, {}, b"", started, _since(started))


def _lower(headers: object) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}  # type: ignore[attr-defined]


def _since(started: float) -> float:
    return time.monotonic() - started


@dataclass
class Traffic:
    """Requests at `rate_per_s` from a background thread until stopped, at most `max_s`
    seconds and `max_requests` requests."""

    url: str
    token: str
    rate_per_s: float = 20.0
    max_s: float = 60.0
    max_requests: int = 3000
    replies: list[Reply] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with ThreadPoolExecutor(max_workers=32) as pool:
            sent = 0
            next_at = time.monotonic()
            while (
                not self._stop.is_set() and time.monotonic() < deadline and sent < self.max_requests
            ):
                pool.submit(self._one)
                sent += 1
                next_at += 1.0 / self.rate_per_s
                self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self) -> None:
        self.replies.append(chat(self.url, self.token))

    def since(self, t: float) -> list[Reply]:
        """Replies to requests sent at or after monotonic time `t`."""
        return [r for r in list(self.replies) if r.sent_at >= t]

    def wait_for(self, predicate: object, timeout_s: float, after: float) -> float | None:
        """Seconds from `after` until a reply sent after it satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for reply in self.since(after):
                if predicate(reply):  # type: ignore[operator]
                    return reply.sent_at - after
            time.sleep(0.05)
        return None
