"""matplotlib for llmchaos' charts (run reports, comparisons, game-day trends)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

__all__ = ["CACHE_DIR", "pyplot"]

CACHE_DIR = Path.home() / ".cache" / "llmchaos" / "matplotlib"
"""matplotlib's font cache, unless MPLCONFIGDIR names another: llmchaos keeps what it caches
under ~/.cache/llmchaos (matplotlib's own default is ~/.cache/matplotlib)."""


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend: files only, no display needed."""
    os.environ.setdefault("MPLCONFIGDIR", str(CACHE_DIR))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
