"""Secrets out of everything llmchaos writes: run.json, summaries, reports, journals, logs.

    redact({"redis_url": "redis://:hunter2@redis:6379/0"})  -> {"redis_url": "redis://:***@redis:6379/0"}
    redact_text("Authorization: Bearer sk-123")             -> "Authorization: Bearer ***"

What counts as a secret: the password (and user) of a URL, a bearer token, the value after a
password flag in a command line (`redis-cli -a PW`, `--pass PW`, `--password=PW`), and the
value of a key named like a credential (password, token, api_key, secret, authorization).
Settings that merely mention tokens (`tokens_file`, `bad_tokens`) are not secrets.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "redact", "redact_text"]

MASK = "***"

_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")
_FLAG_VALUE = re.compile(
    r"(?i)((?:^|[\s,])(?:-a|--pass|--password|--token|--api-key)(?:[\s,]+|=))([^\s,]+)"
)
"""A password flag's value in a command line, also in a comma-separated list of arguments
(`LLMCHAOS_K8S_REDIS_CLI=redis-cli,-a,PW`)."""
_SECRET_KEY = re.compile(r"(?i)(?:.*_)?(password|passwd|token|api_key|apikey|secret|authorization)")
_PASSWORD_FLAGS = frozenset({"-a", "--pass", "--password", "--token", "--api-key"})


def redact_text(text: str) -> str:
    """`text` with URL credentials, bearer tokens and password flags' values masked."""
    text = _URL_USERINFO.sub(lambda m: m["scheme"] + _masked_userinfo(m["userinfo"]) + "@", text)
    text = _BEARER.sub(lambda m: m[1] + MASK, text)
    return _FLAG_VALUE.sub(lambda m: m[1] + MASK, text)


def _masked_userinfo(userinfo: str) -> str:
    user, sep, _password = userinfo.partition(":")
    return f"{user}:{MASK}" if sep else MASK


def redact(value: Any, key: str = "") -> Any:
    """A copy of JSON-like `value` with every secret masked (see the module docstring)."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [redact(v) for v in value]
        for i, item in enumerate(value[:-1]):
            if isinstance(item, str) and item in _PASSWORD_FLAGS:
                items[i + 1] = MASK
        return type(value)(items) if isinstance(value, tuple) else items
    if isinstance(value, str):
        if key and _SECRET_KEY.fullmatch(key) and value:
            return MASK
        return redact_text(value)
    return value
