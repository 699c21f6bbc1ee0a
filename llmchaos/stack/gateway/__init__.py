"""The API gateway of the embedded reference stack.

    python -m llmchaos.stack.gateway --settings gateway.json

Modules by concern: `auth` (token cache over the SQLite token table), `routing` (worker
health, capacity and selection), `proxy` (forwarding with retry, plain and streamed),
`metrics`, `server` (HTTP handlers and lifecycle), `__main__` (the process).
"""

from __future__ import annotations

from llmchaos.stack.gateway.server import Gateway

__all__ = ["Gateway"]
