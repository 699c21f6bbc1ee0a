"""The marker a cleanup finds stray load processes by (in /proc/<pid>/environ)."""

from __future__ import annotations

__all__ = ["LOAD_ENV"]

LOAD_ENV = "LLMCHAOS_LOAD"
"""Environment marker of every load process (the Locust master and the workers it forks); its
value is the run folder, absolute. A cleanup finds stray loads by it in /proc/<pid>/environ."""
