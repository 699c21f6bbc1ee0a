"""A surge of long prompts from one tenant, sent beside the run's load: KV-cache pressure.

    surge = LongPromptSurge(url, token, model, qps=4, duration_s=15, prompt_tokens=6000,
                            max_tokens=200, stream=False)
    surge.start(); ...; surge.stop()         # stop() waits for the requests still out
    surge.acting_until()                     # now while requests are out, else the last answer
    surge.counts                             # {"ok": 51, "5xx": 2, "timeout": 0, ...}

The surge is the noisy neighbour, not the service's users: its answers are counted here and
reported with the fault, never mixed into the load's SLO figures. Requests go out at a
constant rate on their own threads (open loop, like the load), through the same front door.
Streamed answers (`stream`) send their first chunk after the prefill; a long plain answer
sends nothing until its last token, and a gateway's first-byte timeout (6 s here) takes it
for a hung worker.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

from llmchaos.errors import InvalidInput

__all__ = ["LongPromptSurge"]

log = logging.getLogger("chaostoolkit")

_TIMEOUT_S = 120.0
"""One surge request's client timeout: long prompts with long answers take tens of seconds
behind a full KV cache, and an abandoned request would free its KV at once."""


class LongPromptSurge:
    """See the module docstring."""

    def __init__(
        self,
        url: str,
        token: str | None,
        model: str,
        *,
        qps: float,
        duration_s: float,
        prompt_tokens: int,
        max_tokens: int,
        stream: bool = False,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise InvalidInput(f"surge: expected an http:// gateway URL, got {url!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # one word per token, the same count the load, the gateways and the engines use
        prompt = " ".join(["lorem"] * prompt_tokens)
        self._body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "stream": stream,
            }
        ).encode()
        self.qps = qps
        self.duration_s = duration_s
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._scheduler: threading.Thread | None = None
        self._last_answer_ts = 0.0

    def start(self) -> None:
        self._last_answer_ts = time.time()
        self._scheduler = threading.Thread(
            target=self._schedule, name="llmchaos-surge", daemon=True
        )
        self._scheduler.start()

    def _schedule(self) -> None:
        start = time.monotonic()
        sent = 0
        while not self._stop.is_set():
            # the offset, not `due - start`: start + 0.3 - start can come out just under 0.3
            offset_s = sent / self.qps
            if offset_s >= self.duration_s:
                return
            due = start + offset_s
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            thread = threading.Thread(target=self._send, name="llmchaos-surge-request", daemon=True)
            thread.start()
            self._threads.append(thread)
            sent += 1

    def _send(self) -> None:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/chat/completions", body=self._body, headers=self._headers)
            response = conn.getresponse()
            response.read()
            outcome = "ok" if response.status == 200 else f"{response.status // 100}xx"
        except TimeoutError:
            outcome = "timeout"
        except OSError:
            outcome = "connection"
        finally:
            conn.close()
        with self._lock:
            self.counts[outcome] += 1
            self._last_answer_ts = time.time()

    def acting_until(self) -> float:
        """Epoch seconds until which the surge acts on the engines: now while it still sends
        or waits for answers, else when its last answer came (a long answer holds its KV
        cache well after the last request went out)."""
        threads = [*([self._scheduler] if self._scheduler else []), *self._threads]
        if any(t.is_alive() for t in threads):
            return time.time()
        with self._lock:
            return self._last_answer_ts

    def stop(self, timeout_s: float = 2.0) -> dict[str, int]:
        """Send no more; wait up to `timeout_s` for the requests still out; the counts. Short:
        the run stops the surge after its verdict, which on a sound target came after the
        last answer, and on a broken one the requests still out are stuck (10 s of waiting
        held up each small-kv-cache run and they were counted unfinished all the same)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in [*([self._scheduler] if self._scheduler else []), *self._threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            counts = dict(self.counts)
        counts["unfinished"] = sum(1 for t in self._threads if t.is_alive())
        return counts
