"""What the simulated model says, and how a worker answers it in vLLM's shapes.

The engine only counts tokens; this module decides the text. Each choice's text is
`make_text(max_tokens)` (one word per token, so the load, the gateway and the engine count
alike). A stop string cuts it as vLLM does: generation ends at the token that completes the
first match, the text stops before the match (`include_stop_str_in_output` false), the finish
reason is "stop" and `stop_reason` the string; otherwise it runs to max_tokens, "length"
(the simulator has no EOS, so every answer is `ignore_eos`-like). A forced tool call
(`tool_choice` named or "required") answers that call, its arguments a JSON object that fits
the function's schema.

Chunks follow vLLM's serving_chat / serving_completion: a chat stream starts with one role
chunk per choice `{"role": "assistant", "content": ""}` when the engine produced its first
token (vLLM sends it in the first iteration of the result generator, after prefill), then
content deltas, the finish reason on the chunk with each choice's last delta, a usage chunk
(`choices: []`) only with `stream_options.include_usage`, usage on every chunk with
`continuous_usage_stats`, and `data: [DONE]`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import orjson

from llmchaos.stack.openai_api import GenerationRequest
from llmchaos.stack.tokens import make_text

__all__ = ["ChoicePlan", "StreamChunks", "completion_body", "plan_choices"]


@dataclass(frozen=True)
class ChoicePlan:
    """One choice: what the engine generates and what the client is shown."""

    index: int
    prompt_index: int
    tokens: int
    """Tokens the engine generates (up to the one completing a stop string)."""
    text: str
    """Text shown (content, a completion's text, or a tool call's arguments)."""
    ends: tuple[int, ...]
    """Char offset in `text` where each generated token's text ends."""
    finish_reason: str
    stop_reason: str | None
    tool_name: str | None = None

    def delta(self, start_token: int, end_token: int) -> str:
        """The text of tokens [start_token, end_token)."""
        begin = self.ends[start_token - 1] if start_token > 0 else 0
        return self.text[begin : self.ends[end_token - 1]] if end_token > 0 else ""


def _token_ends(text: str) -> list[int]:
    """End offsets of the words of `text` (a word's leading space belongs to it)."""
    ends: list[int] = []
    position = 0
    for k, word in enumerate(text.split(" ")):
        position += len(word) + (1 if k else 0)
        if word:
            ends.append(position)
    return ends


@functools.lru_cache(maxsize=256)
def _answer_text(max_tokens: int, offset: int) -> tuple[str, tuple[int, ...]]:
    """The answer of `max_tokens` tokens and its word ends: the same for every request that
    asks as many, and a tenth of a worker's CPU per request when built each time."""
    full = make_text(max_tokens, offset)
    return full, tuple(_token_ends(full))


def _plan_text(index: int, prompt_index: int, max_tokens: int, stop: tuple[str, ...]) -> ChoicePlan:
    full, ends = _answer_text(max_tokens, 3 * index)
    cut, matched = len(full), None
    for s in stop:
        at = full.find(s)
        if 0 <= at < cut:
            cut, matched = at, s
    if matched is None:
        return ChoicePlan(index, prompt_index, max_tokens, full, ends, "length", None)
    # the token whose text completes the match ends the generation
    last = next(k for k, end in enumerate(ends) if end >= cut + len(matched))
    shown = tuple(min(end, cut) for end in ends[: last + 1])
    return ChoicePlan(index, prompt_index, last + 1, full[:cut], shown, "stop", matched)


def _plan_tool_call(index: int, max_tokens: int, name: str, arguments: str) -> ChoicePlan:
    ends = _token_ends(arguments) or [len(arguments)]
    if len(ends) <= max_tokens:
        return ChoicePlan(index, 0, len(ends), arguments, tuple(ends), "stop", None, name)
    cut = ends[max_tokens - 1]  # cut short: the arguments are unfinished JSON, as from vLLM
    return ChoicePlan(
        index, 0, max_tokens, arguments[:cut], tuple(ends[:max_tokens]), "length", None, name
    )


def plan_choices(request: GenerationRequest, max_tokens: int) -> list[ChoicePlan]:
    """Every choice of the request: n per prompt, indexed prompt by prompt (vLLM's order)."""
    plans = []
    for p in range(len(request.prompts)):
        for i in range(request.n):
            index = p * request.n + i
            call = request.tool_call
            if call is not None:
                plans.append(_plan_tool_call(index, max_tokens, call.name, call.arguments))
            else:
                plans.append(_plan_text(index, p, max_tokens, request.stop))
    return plans


def _tool_call(plan: ChoicePlan, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": plan.tool_name, "arguments": plan.text},
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request: GenerationRequest,
    request_id: str,
    plans: list[ChoicePlan],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The non-streamed answer (`chat.completion` or `text_completion`)."""
    choices: list[dict[str, Any]] = []
    for plan in plans:
        choice: dict[str, Any] = {"index": plan.index}
        if request.chat:
            message: dict[str, Any] = {"role": "assistant", "content": plan.text}
            if plan.tool_name is not None:  # vLLM: content "" next to a forced call
                message = {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_tool_call(plan, f"chatcmpl-tool-{request_id}-{plan.index}")],
                }
            choice["message"] = message
        else:
            echo = request.prompts[plan.prompt_index] if request.echo else ""
            choice["text"] = echo + plan.text
        choice |= {
            "logprobs": None,
            "finish_reason": plan.finish_reason,
            "stop_reason": plan.stop_reason,
        }
        choices.append(choice)
    return {
        "id": request_id,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


class StreamChunks:
    """The SSE events of one streamed answer, in vLLM's shapes (see the module docstring)."""

    def __init__(self, request: GenerationRequest, request_id: str, prompt_tokens: int) -> None:
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()),
            "model": request.model,
        }
        self._tool_named: set[int] = set()

    def _event(self, choices: list[dict[str, Any]], completion_tokens: int | None) -> bytes:
        body = {**self.head, "choices": choices}
        if completion_tokens is not None and self.request.continuous_usage:
            body["usage"] = usage(self.prompt_tokens, completion_tokens)
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def first(self, plans: list[ChoicePlan]) -> bytes:
        """What goes out when the engine produced its first token: the chat role chunks (none
        for completions, except echo's prompt text)."""
        events = []
        for plan in plans:
            if self.request.chat:
                delta = {"role": "assistant", "content": ""}
                choice = {
                    "index": plan.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": None,
                }
                events.append(self._event([choice], 0))
            elif self.request.echo:
                text = self.request.prompts[plan.prompt_index]
                events.append(self._event([self._text_choice(plan.index, text, None, None)], 0))
        return b"".join(events)

    def _text_choice(
        self, index: int, text: str, finish: str | None, stop: str | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def tokens(self, plan: ChoicePlan, sent: int, now_sent: int, request_id: str) -> bytes:
        """The chunk for tokens [sent, now_sent) of `plan`; it carries the finish reason when
        they are its last. Empty when there is nothing to show yet."""
        text = plan.delta(sent, now_sent)
        done = now_sent >= plan.tokens
        finish = plan.finish_reason if done else None
        stop = plan.stop_reason if done else None
        if not text and not done:
            return b""
        if not self.request.chat:
            return self._event([self._text_choice(plan.index, text, finish, stop)], now_sent)
        if plan.tool_name is None:
            delta: dict[str, Any] = {"content": text}
        else:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if plan.index not in self._tool_named:  # the first delta names the call
                self._tool_named.add(plan.index)
                call = {
                    "index": 0,
                    "id": f"chatcmpl-tool-{request_id}-{plan.index}",
                    "type": "function",
                    "function": {"name": plan.tool_name, "arguments": text},
                }
            delta = {"tool_calls": [call]}
            if done:
                finish = "tool_calls"  # vLLM, once a tool call was streamed
        choice = {"index": plan.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if done:
            choice["stop_reason"] = stop
        return self._event([choice], now_sent)

    def usage(self, completion_tokens: int) -> bytes:
        """The final usage chunk (only with include_usage)."""
        body = {**self.head, "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)}
        return b"data: " + orjson.dumps(body) + b"\n\n"
