"""The registrar: keeps the stack's ready workers in the registry, as Kubernetes' endpoints
controller keeps a Service's ready pods in its EndpointSlices.

    python -m llmchaos.stack.registrar --settings registrar.json

Every `interval_s` it reads each worker's /healthz; the ready ones are kept under
`<prefix><name>` (their URL, mode and node) with one lease of `lease_ttl_s`, kept alive each
round, and a worker that stops being ready is deleted. When the registry cannot be reached (a
member partitioned or killed, the whole cluster gone) it tries the next member, and after a
failure it grants a new lease and writes every ready worker again, so a registry that comes
back (or expired the lease meanwhile) is whole again within a round.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from llmchaos.errors import StackError
from llmchaos.stack import etcd
from llmchaos.stack.procs import http_get_status
from llmchaos.stack.settings import UpstreamWorker, run_loop_process

__all__ = ["RegistrarSettings", "main"]

log = logging.getLogger("llmchaos.registrar")


@dataclass(frozen=True)
class RegistrarSettings:
    """What the registrar keeps where."""

    endpoints: tuple[str, ...] = ()
    """The registry members' client URLs."""
    prefix: str = "/llmchaos/workers/"
    """Key prefix of the stack's workers."""
    workers: tuple[UpstreamWorker, ...] = ()
    """Every worker that may run (a scaled-in one is simply not ready)."""
    interval_s: float = 1.0
    lease_ttl_s: int = 5
    """A crashed registrar's workers leave the registry after this."""
    timeout_s: float = 0.5
    """One request to one member."""


class _Registrar:
    def __init__(self, settings: RegistrarSettings) -> None:
        self.settings = settings
        self.lease: str | None = None
        self.registered: set[str] = set()
        self.stopping = False
        self._member = 0

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request to the first member that answers, starting with the last good one.
        Raises StackError when none does."""
        endpoints = self.settings.endpoints
        problems = []
        for i in range(len(endpoints)):
            index = (self._member + i) % len(endpoints)
            try:
                answer = etcd.call(endpoints[index], path, body, self.settings.timeout_s)
            except StackError as exc:
                problems.append(str(exc))
                continue
            self._member = index
            return answer
        raise StackError("; ".join(problems))

    def ready(self) -> dict[str, UpstreamWorker]:
        return {
            w.name: w
            for w in self.settings.workers
            if http_get_status(f"{w.url}/healthz", self.settings.timeout_s) == 200
        }

    def round(self) -> None:
        """Read the workers, then bring the registry in line. Raises StackError."""
        ready = self.ready()
        if self.lease is not None:
            alive = self.call("/v3/lease/keepalive", {"ID": self.lease}).get("result", {})
            if int(alive.get("TTL", 0)) <= 0:
                log.warning("lease %s expired in the registry: registering again", self.lease)
                self.lease = None
        if self.lease is None:
            granted = self.call("/v3/lease/grant", {"TTL": self.settings.lease_ttl_s})
            self.lease, self.registered = str(granted["ID"]), set()
        for name in sorted(set(ready) - self.registered):
            value = etcd.worker_value(ready[name])
            key = etcd.b64(self.settings.prefix + name)
            self.call("/v3/kv/put", {"key": key, "value": etcd.b64(value), "lease": self.lease})
            self.registered.add(name)
            log.info("registered %s", name)
        for name in sorted(self.registered - set(ready)):
            self.call("/v3/kv/deleterange", {"key": etcd.b64(self.settings.prefix + name)})
            self.registered.discard(name)
            log.info("deregistered %s (not ready)", name)

    def run(self) -> int:
        failing = False
        while not self.stopping:
            started = time.monotonic()
            try:
                self.round()
                if failing:
                    log.info("registry reachable again")
                failing = False
            except (StackError, KeyError, ValueError) as exc:
                if not failing:
                    log.warning("registry unreachable: %s", exc)
                failing, self.lease = True, None
            time.sleep(max(0.0, self.settings.interval_s - (time.monotonic() - started)))
        return 0


def main(argv: list[str] | None = None) -> int:
    return run_loop_process(
        "registrar",
        RegistrarSettings,
        _Registrar,
        lambda r: (
            f"keeping {len(r.settings.workers)} worker(s) under {json.dumps(r.settings.prefix)}"
        ),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
