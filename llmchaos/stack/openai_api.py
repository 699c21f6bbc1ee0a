"""The slice of the OpenAI chat-completions API that the gateway and the workers speak.

Request parsing and OpenAI-style error bodies live here so that the gateway and the engine
workers reject bad input the same way: never a stack trace, always
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ApiError",
    "ChatRequest",
    "error_response",
    "parse_chat_request",
]

DEFAULT_MAX_TOKENS = 32
"""Output tokens when a request gives no max_tokens (vLLM would fill the context; a chaos
target wants short, predictable answers)."""


class ApiError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """The aiohttp response for `exc`, with its own headers and any extra ones."""
    merged = {**exc.headers, **(headers or {})}
    return web.json_response(exc.body(), status=exc.status, headers=merged)


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completion request."""

    model: str
    prompt_text: str
    """All message contents joined by newlines: what the engine charges prefill for."""
    max_tokens: int
    stream: bool
    include_usage: bool
    """`stream_options.include_usage`: send a usage chunk before [DONE]."""


def parse_chat_request(raw: bytes, models: Collection[str]) -> ChatRequest:
    """Validate a POST /v1/chat/completions body.

    Raises ApiError 400 for invalid JSON or fields, 404 `model_not_found` for an unknown model.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list", param="messages")
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        parts.append(content)
    if model not in models:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; available: {', '.join(sorted(models))}",
            code="model_not_found",
            param="model",
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    return ChatRequest(
        model=model,
        prompt_text="\n".join(parts),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )
