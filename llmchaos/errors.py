"""Exceptions of llmchaos.

    LLMChaosError                 base of everything raised on purpose
    ├── InvalidInput              bad input found before anything runs (file, field, expected)
    └── StackError                the embedded stack failed while starting, running or stopping
        └── ComponentNotReady     a component did not become ready before its deadline

Messages name the thing that is wrong and what would be right, so the CLI can print them as
they are (one line, exit 2 for InvalidInput).
"""

from __future__ import annotations

__all__ = ["ComponentNotReady", "InvalidInput", "LLMChaosError", "StackError"]


class LLMChaosError(Exception):
    """Base of all errors llmchaos raises on purpose."""


class InvalidInput(LLMChaosError):
    """Input rejected before anything was started or changed."""


class StackError(LLMChaosError):
    """The embedded reference stack failed while starting, running or stopping."""


class ComponentNotReady(StackError):
    """A component of the stack did not report ready before its deadline."""
