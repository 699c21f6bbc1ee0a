"""What the Locust processes say to each other and to the library, without gevent.

Message names, the custom Locust argument that carries the config, file names in the run
folder, URL splitting and the raw HTTP/1.1 request head the user sends.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from llmchaos.errors import InvalidInput
from llmchaos.load.config import LoadConfig
from llmchaos.load.traffic import RequestSpec

__all__ = [
    "CONFIG_ARGUMENT",
    "CONNECT_TIMEOUT_ENV",
    "CONTROL_MESSAGE",
    "LIVE_FILE",
    "LOCAL_START_DELAY_S",
    "REPORT_MESSAGE",
    "START_DELAY_S",
    "START_MESSAGE",
    "START_MESSAGE_WAIT_S",
    "config_from_options",
    "request_head",
    "split_url",
]

CONFIG_ARGUMENT = "--llmchaos-config"
"""Custom Locust argument: the LoadConfig as JSON. Locust forwards custom arguments from the
master to its workers with every spawn message, so workers need no file of their own."""
CONNECT_TIMEOUT_ENV = "LLMCHAOS_LOAD_WORKER_CONNECT_S"
"""Set by `llmchaos load-worker` for its Locust worker: how long it may try to connect to the
master (its --connect-timeout-s), instead of Locust's 60 tries of 5 s."""
START_MESSAGE = "llmchaos_start"
"""master -> workers: {"start_epoch_s"}: the schedule's time zero, shared by all workers."""
CONTROL_MESSAGE = "llmchaos_control"
"""master -> workers: {"qps"} | {"burst": {"duration_s", "factor", "seed"}} | {"stop": true}."""
REPORT_MESSAGE = "llmchaos_report"
"""worker -> master: a Recorder.take_report() delta."""
START_DELAY_S = 1.0
"""Time zero is this far after the master's test_start, so every worker is ready for it."""
LOCAL_START_DELAY_S = 0.5
"""Time zero after test_start for a load with no worker processes: its one user is in the
same process and got its start message handler at init, so the start reaches it at once
(half a second less of every chaos run's start)."""
START_MESSAGE_WAIT_S = 30.0
"""How long a worker's user waits for the start message before giving up."""
LIVE_FILE = "live.json"
"""Written by the master once its live endpoint listens: {"url", "pid"}."""
CHAT_PATH = "/v1/chat/completions"


def config_from_options(options: Any) -> LoadConfig:
    """The LoadConfig carried by Locust's parsed options. Raises InvalidInput when missing."""
    text = getattr(options, "llmchaos_config", None)
    if not text:
        raise InvalidInput(f"locust: {CONFIG_ARGUMENT} is missing (the LoadConfig as JSON)")
    return LoadConfig.from_json(text)


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, chat path) of a base URL. Raises InvalidInput naming --url."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise InvalidInput(f"--url: expected http://host[:port][/prefix], got {url!r}")
    prefix = parts.path.rstrip("/")
    if prefix.endswith(CHAT_PATH):
        prefix = prefix[: -len(CHAT_PATH)]
    return parts.hostname, parts.port or 80, prefix + CHAT_PATH


def request_head(path: str, host_header: str, spec: RequestSpec) -> bytes:
    """The HTTP/1.1 request line and headers for `spec` (keep-alive, fixed length body)."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host_header}",
        f"Content-Length: {len(spec.body)}",
        *(f"{name}: {value}" for name, value in spec.headers.items()),
        "",
        "",
    ]
    return "\r\n".join(lines).encode("latin-1")
