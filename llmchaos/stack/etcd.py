"""etcd's v3 JSON API (its gRPC gateway on the client port, `/v3/...`), the little of it the
stack uses: keys and values are base64 in the JSON, int64s are strings.

    call(url, "/v3/kv/range", prefix_range("/llmchaos/x/workers/"), timeout_s=0.5)
    endpoints_of(response)  # the workers registered, from a range answer

The registrar (a plain process) calls it with urllib here; the gateway, on its asyncio loop,
sends the same bodies with aiohttp (gateway/discovery.py).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

from llmchaos.errors import StackError
from llmchaos.stack.settings import UpstreamWorker

__all__ = ["b64", "call", "endpoints_of", "prefix_range", "unb64", "worker_value"]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def prefix_range(prefix: str) -> dict[str, str]:
    """A range request body for every key under `prefix` (range_end: the prefix with its
    last byte plus one, as etcdctl's --prefix)."""
    raw = prefix.encode()
    end = raw[:-1] + bytes([raw[-1] + 1])
    return {"key": b64(prefix), "range_end": base64.b64encode(end).decode()}


def worker_value(worker: UpstreamWorker) -> str:
    """What the registrar stores for a worker (its key is the prefix + its name)."""
    return json.dumps(
        {"name": worker.name, "url": worker.url, "mode": worker.mode, "node": worker.node}
    )


def endpoints_of(response: dict[str, Any]) -> tuple[UpstreamWorker, ...]:
    """The workers of a range answer, by name; values that are not a worker are skipped."""
    workers = []
    for kv in response.get("kvs") or []:
        try:
            data = json.loads(unb64(kv["value"]))
            workers.append(
                UpstreamWorker(
                    name=str(data["name"]),
                    url=str(data["url"]),
                    mode="cpu" if data.get("mode") == "cpu" else "gpu",
                    node=str(data.get("node", "")),
                )
            )
        except (KeyError, ValueError, TypeError):
            continue
    return tuple(sorted(workers, key=lambda w: w.name))


def call(url: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST `body` to `url` + `path`; the JSON answer. Raises StackError naming the member
    and what went wrong (refused, timed out, an etcd error such as no leader)."""
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise StackError(f"etcd {url}{path}: HTTP {exc.code}: {detail}") from None
    except (OSError, ValueError) as exc:
        raise StackError(f"etcd {url}{path}: {exc}") from None
    if isinstance(answer, dict) and "error" in answer:
        raise StackError(f"etcd {url}{path}: {answer.get('error')}")
    return answer if isinstance(answer, dict) else {}
