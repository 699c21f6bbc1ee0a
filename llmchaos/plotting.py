"""matplotlib for llmchaos' charts (run reports, comparisons, game-day trends)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

__all__ = ["CACHE_DIR", "keep_cache_in_llmchaos", "pyplot"]

CACHE_DIR = Path.home() / ".cache" / "llmchaos" / "matplotlib"
"""matplotlib's font cache, unless MPLCONFIGDIR names another: llmchaos keeps what it caches
under ~/.cache/llmchaos (matplotlib's own default is ~/.cache/matplotlib)."""


def keep_cache_in_llmchaos() -> None:
    """Point matplotlib at CACHE_DIR unless MPLCONFIGDIR is set. Call it before a thread
    imports matplotlib: a write to os.environ while another thread copies it breaks the copy."""
    os.environ.setdefault("MPLCONFIGDIR", str(CACHE_DIR))


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend: files only, no display needed."""
    keep_cache_in_llmchaos()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
