"""The slice of vLLM's OpenAI-compatible server that the gateway and the workers speak: request
parsing and validation, and OpenAI-shaped errors, so that a client's mistake is never answered
with a 5xx or a traceback (the HTTP side, malformed requests included: httpserver.py).

Requests are checked the way vLLM checks them (`vllm/entrypoints/openai/protocol.py` for
types and cross-field rules, `SamplingParams._verify_args` for ranges); unknown fields are
ignored, as vLLM ignores them. Every refusal is an `ApiError`: a 4xx with
`{"error": {"message", "type", "param", "code"}}` whose `code` says what kind of mistake it was:

    invalid_json                the body is not JSON (or not UTF-8, or nested too deep)
    invalid_type                a field of the wrong type (param names it)
    invalid_value               a value out of range or not one of the allowed ones
    missing_required_parameter  messages / prompt missing
    unsupported_parameter       a feature the simulated engine cannot honour (logprobs ...)
    model_not_found             (404) a model that is not served
    request_too_large           (413) a body over the size limit
    invalid_http_request        malformed HTTP (bad request line, header, framing)
    invalid_api_key             (401) the gateway's auth
Where vLLM differs (it answers `type: BadRequestError` with the numeric status as `code`),
the README lists it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from llmchaos.stack.httpserver import HttpError, Request, Response
from llmchaos.stack.tokens import count_tokens

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "MAX_BODY_BYTES",
    "MAX_N",
    "VERSION",
    "ApiError",
    "GenerationRequest",
    "ToolCallPlan",
    "api_error_for",
    "error_answer",
    "json_answer",
    "parse_generation_request",
    "server_error",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
DEFAULT_MAX_TOKENS = 32
"""Chat output tokens when a request gives no max_tokens (vLLM would fill the context; a chaos
target wants short, predictable answers)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""/v1/completions' default max_tokens (vLLM's and OpenAI's)."""
MAX_N = 128
"""Most choices per request (vLLM allows VLLM_MAX_N_SEQUENCES, 16384; the simulator runs each
choice as a sequence of its own, so a bound keeps one request from flooding the batch)."""
MAX_PROMPTS = 64
"""Most prompts in one /v1/completions batch."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body (a 4096-token context is ~30 KiB of text): over it, 413."""
try:
    VERSION = importlib.metadata.version("llmchaos")
    """What GET /version answers (vLLM answers its own version there)."""
except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
    VERSION = "0+unknown"
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
"""vLLM's range of `seed` (torch.long)."""


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


def json_answer(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """`body` as a JSON answer."""
    return Response(status, json.dumps(body).encode(), headers=(headers or {}).items())


def error_answer(exc: ApiError) -> Response:
    """The OpenAI error body of `exc`, with its headers (Retry-After, Allow)."""
    return json_answer(exc.body(), exc.status, exc.headers)


_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    400: "invalid_http_request",
}


def api_error_for(
    exc: BaseException, request: Request | None, internal: ApiError, log: logging.Logger
) -> ApiError:
    """What to answer for `exc`, raised while serving `request` (None: it could not be
    parsed): itself if an ApiError, the server's own errors (httpserver.HttpError) as
    server_error says, and anything else `internal`, its traceback in `log` only."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, HttpError):
        where = None if request is None else (request.method, request.path)
        return server_error(exc.status, exc.reason, where, exc.allow)
    where_text = "?" if request is None else f"{request.method} {request.path}"
    log.error("unexpected error in %s", where_text, exc_info=exc)
    return internal


def server_error(
    status: int, reason: str, request: tuple[str, str] | None, allow: str | None = None
) -> ApiError:
    """What a server answers itself (no route, wrong method, body over the limit; malformed
    HTTP when `request`, its method and path, is None) as an ApiError."""
    code = _HTTP_CODES.get(status, reason.lower().replace(" ", "_"))
    if status == 413:
        message = f"request body over the limit of {MAX_BODY_BYTES} bytes"
    elif request is None:
        message = f"malformed HTTP request: {reason}"
    else:
        message = f"{request[0]} {request[1]}: {reason}"
    return ApiError(status, message, code=code, headers={"Allow": allow} if allow else None)


@dataclass(frozen=True)
class ToolCallPlan:
    """The tool call a request forces (`tool_choice` named or "required")."""

    name: str
    arguments: str
    """JSON text of arguments that fit the function's `parameters` schema."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    chat: bool
    model: str
    prompts: tuple[str, ...]
    """The text the engine charges prefill for: a chat's message contents joined by newlines
    (one prompt), or each prompt of a completions batch (token-id prompts as that many
    words)."""
    max_tokens: int | None
    """None: the endpoint's default (the worker fills it in)."""
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    """`stream_options.include_usage`: a usage chunk before [DONE]."""
    continuous_usage: bool
    """`stream_options.continuous_usage_stats` (with include_usage): usage in every chunk."""
    tool_call: ToolCallPlan | None = None
    echo: bool = False

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return tuple(count_tokens(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """The most tokens a sequence may get: max_tokens, else the endpoint's default (the
        worker may cut the default further to fit the context window)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return DEFAULT_MAX_TOKENS if self.chat else DEFAULT_COMPLETION_MAX_TOKENS


_LONG_DIGITS = re.compile(rb"\d{19}")
"""orjson reads an integer past 64 bits as a float (seed 2**64 would pass as 1.8e19): a
body with a run this long is read by json, which keeps it an int."""
_DIGITS = b"0123456789"


def _load_json(raw: bytes) -> dict[str, Any]:
    # counting digits first is a seventh of the search's cost, and most bodies have few
    if len(raw) - len(raw.translate(None, _DIGITS)) >= 19 and _LONG_DIGITS.search(raw):
        body = _load_json_slowly(raw)
    else:
        try:
            body = orjson.loads(raw)  # a fifth of json's cost, on the worker's hot path
        except orjson.JSONDecodeError:
            body = _load_json_slowly(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _load_json_slowly(raw: bytes) -> Any:
    """json's reading of what orjson refuses: NaN, UTF-16, integers past 64 bits, lone
    surrogates are accepted as before, and the errors keep their messages."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # includes UnicodeDecodeError and over-long integers
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


def _type_error(param: str, expected: str, value: object) -> ApiError:
    shown = json.dumps(value)[:80] if not isinstance(value, float) else repr(value)
    return ApiError(
        400, f"'{param}' must be {expected}, got {shown}", code="invalid_type", param=param
    )


def _value_error(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' {message}", code="invalid_value", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(
    body: dict[str, Any], name: str, low: float, high: float, low_open: bool = False
) -> None:
    """An optional finite number within [low, high] (or (low, high])."""
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number", value)
    finite = isinstance(value, int) or math.isfinite(value)  # a huge int has no float
    if not finite or value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise _value_error(name, f"must be a finite number in {interval}, got {value!r}")


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(name, "an integer", value)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise _value_error(name, f"must be {bound}, got {value}")
    return int(value)


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


_SAMPLING_KEYS = frozenset(
    (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_k",
        "seed",
        "ignore_eos",
        "user",
        "logit_bias",
        "response_format",
    )
)


def _check_sampling(body: dict[str, Any]) -> None:
    """Types and ranges of the sampling fields (vLLM's SamplingParams._verify_args)."""
    if body.keys().isdisjoint(_SAMPLING_KEYS):
        return  # every check below passes an absent field; most requests set none
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    _number(body, "min_p", 0.0, 1.0)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _number(body, "repetition_penalty", 0.0, math.inf, low_open=True)
    _integer(body, "top_k", -1)
    _integer(body, "seed", _LONG_MIN, _LONG_MAX)
    _boolean(body, "ignore_eos")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)
    for name in ("logit_bias", "response_format"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise _type_error(name, "an object", value)
    fmt = body.get("response_format")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(
            400,
            f"response_format {fmt.get('type')!r} is not supported by the simulated engine "
            "(it answers plain text)",
            code="unsupported_parameter",
            param="response_format",
        )


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    name = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    max_tokens = _integer(body, name, 1)
    min_tokens = _integer(body, "min_tokens", 0)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise _value_error(
            "min_tokens", f"must be at most max_tokens={max_tokens}, got {min_tokens}"
        )
    return max_tokens


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or a list of strings", stop)
    if any(not s for s in items):
        raise _value_error("stop", "cannot contain an empty string")
    return tuple(items)


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if options and not stream:
        raise _value_error("stream_options", "can only be defined when `stream=True`")
    include = options.get("include_usage", True)  # vLLM's default once options are given
    continuous = options.get("continuous_usage_stats", False)
    for name, value in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if value is not None and not isinstance(value, bool):
            raise _type_error(f"stream_options.{name}", "a boolean", value)
    return bool(include), bool(include) and bool(continuous)


def _text_content(content: object, where: str) -> str:
    """A message's content: a string, null, or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(f"{where}.content", "a string, null or a list of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _type_error(f"{where}.content[{j}]", "an object", part)
        kind = part.get("type")
        if kind not in ("text", "input_text"):
            raise ApiError(
                400,
                f"{where}.content[{j}]: content part type {kind!r} is not supported by the "
                "simulated text-only model; use {'type': 'text', 'text': ...}",
                code="unsupported_parameter",
                param="messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{where}.content[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: object, where: str) -> None:
    if not isinstance(calls, list):
        raise _type_error(f"{where}.tool_calls", "a list", calls)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _type_error(f"{where}.tool_calls[{j}].function", "an object", function)
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise _type_error(
                    f"{where}.tool_calls[{j}].function.{key}", "a string", function.get(key)
                )


def _messages(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(
            400, "'messages' is required", code="missing_required_parameter", param="messages"
        )
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of messages", messages)
    parts: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(where, "an object", message)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _type_error(f"{where}.role", "a non-empty string", role)
        if "tool_calls" in message and message["tool_calls"] is not None:
            _tool_calls(message["tool_calls"], where)
        for key in ("name", "tool_call_id"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise _type_error(f"{where}.{key}", "a string", value)
        parts.append(_text_content(message.get("content"), where))
    return "\n".join(parts)


def _example_value(schema: object, depth: int = 0) -> object:
    """A value that fits a JSON schema's declared type (what guided decoding would force)."""
    if not isinstance(schema, dict) or depth > 8:
        return {}
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        if not isinstance(properties, dict):
            return {}
        return {k: _example_value(v, depth + 1) for k, v in properties.items() if k in required}
    return {
        "string": "the model serves tokens",
        "integer": 1,
        "number": 1.5,
        "boolean": True,
        "array": [],
        "null": None,
    }.get(kind if isinstance(kind, str) else "", "")


def _tools(body: dict[str, Any]) -> ToolCallPlan | None:
    """Check `tools` and `tool_choice` as vLLM does; the call a forced choice makes."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None and choice is None:
        return None
    functions: dict[str, dict[str, Any]] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "a list", tools)
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _type_error(
                    f"tools[{i}].function", "an object with a string 'name'", function
                )
            if tool.get("type", "function") != "function":
                raise _value_error(
                    f"tools[{i}].type", f"must be 'function', got {tool.get('type')!r}"
                )
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise _type_error(f"tools[{i}].function.parameters", "an object", parameters)
            functions[function["name"]] = function
    if choice is None or choice in ("none", "auto"):
        # "auto": the simulated model chooses to answer in text (a served model with
        # --enable-auto-tool-choice may call a tool or not)
        if choice is not None and tools is None and choice != "none":
            raise _value_error("tool_choice", "needs `tools` to be set")
        return None
    if tools is None:
        raise _value_error("tool_choice", "needs `tools` to be set")
    if choice == "required":
        if not functions:
            return None  # vLLM: "required" with no tools behaves as "none"
        name = next(iter(functions))
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise _type_error(
                "tool_choice", '{"type": "function", "function": {"name": "my_function"}}', choice
            )
        if name not in functions:
            raise _value_error("tool_choice", f"names {name!r}, which is not one of the `tools`")
    else:
        raise _value_error(
            "tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}"
        )
    arguments = json.dumps(_example_value(functions[name].get("parameters") or {}))
    return ToolCallPlan(name=name, arguments=arguments)


def _prompts(body: dict[str, Any]) -> tuple[str, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(
            400, "'prompt' is required", code="missing_required_parameter", param="prompt"
        )
    expected = "a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        raise _type_error("prompt", expected, prompt)
    if all(_is_int(t) for t in prompt):
        return (" ".join("t" for _ in prompt),)  # token ids: that many tokens
    if len(prompt) > MAX_PROMPTS:
        raise _value_error("prompt", f"holds at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            prompts.append(" ".join("t" for _ in item))
        else:
            raise _type_error("prompt", expected, prompt)
    return tuple(prompts)


def parse_generation_request(raw: bytes, models: Collection[str], chat: bool) -> GenerationRequest:
    """Validate a POST /v1/chat/completions (`chat`) or /v1/completions body.

    A missing `model` means the first served one, as in vLLM. Raises ApiError 400 (see the
    module docstring for the codes), 404 `model_not_found` for a model that is not served.
    """
    body = _load_json(raw)
    model = body.get("model")
    if model is None:
        model = next(iter(models))
    elif not isinstance(model, str):
        raise _type_error("model", "a string", model)
    stream = _boolean(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    prompts = (_messages(body),) if chat else _prompts(body)
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of < n:
        raise _value_error("best_of", f"must be at least n={n}, got {best_of}")
    temperature = body.get("temperature")
    _check_sampling(body)
    if n > 1 and temperature == 0:
        raise _value_error("n", f"must be 1 when using greedy sampling (temperature 0), got {n}")
    logprobs = body.get("logprobs")
    if chat:
        _boolean(body, "logprobs")
        _integer(body, "top_logprobs", 0)
    elif logprobs is not None and not _is_int(logprobs):
        raise _type_error("logprobs", "an integer", logprobs)
    if logprobs or body.get("top_logprobs") or body.get("prompt_logprobs") is not None:
        raise ApiError(
            400,
            "logprobs are not supported by the simulated engine (it has no model)",
            code="unsupported_parameter",
            param="logprobs",
        )
    if not chat and body.get("suffix") is not None:
        raise ApiError(
            400, "suffix is not currently supported", code="unsupported_parameter", param="suffix"
        )
    tool_call = _tools(body) if chat else None
    echo = _boolean(body, "echo")
    result = GenerationRequest(
        chat=chat,
        model=model,
        prompts=prompts,
        max_tokens=_max_tokens(body, chat),
        n=n,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        tool_call=tool_call,
        echo=echo,
    )
    if model not in models:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; available: {', '.join(sorted(models))}",
            code="model_not_found",
            param="model",
        )
    return result
