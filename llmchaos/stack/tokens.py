"""The toy tokenizer shared by the engine simulator and the load generator.

One token is one whitespace-separated word. It is not a real tokenizer; what matters is that
the load, the gateway and the engine count the same way, so prompt lengths chosen by the load
are the prompt lengths the engine charges for.
"""

from __future__ import annotations

__all__ = ["count_tokens", "make_text"]

_WORDS = [
    "the",
    "model",
    "serves",
    "tokens",
    "under",
    "load",
    "while",
    "the",
    "gateway",
    "routes",
    "each",
    "request",
    "to",
    "a",
    "worker",
    "that",
    "batches",
    "sequences",
    "and",
    "streams",
    "the",
    "answer",
    "back",
]


def count_tokens(text: str) -> int:
    """Number of tokens in `text` (whitespace-separated words)."""
    return len(text.split())


def make_text(n_tokens: int, offset: int = 0) -> str:
    """A text of exactly `n_tokens` tokens; `offset` varies the words so texts differ."""
    if n_tokens <= 0:
        return ""
    n = len(_WORDS)
    return " ".join(_WORDS[(offset + i) % n] for i in range(n_tokens))
