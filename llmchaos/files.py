"""Files written so that a kill at any moment leaves either the old or the new content."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic", "write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """JSON (indented) through write_text_atomic: a reader never sees half a file."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str))
