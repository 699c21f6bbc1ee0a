"""Files written so that a kill at any moment leaves either the old or the new content."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["create_private", "read_json_object", "write_json_atomic", "write_text_atomic"]


def create_private(path: Path) -> Path:
    """Create `path` empty (or truncate it) readable by its owner only (mode 600), before any
    secret is written to it: a file of tokens or passwords is never world-readable, not even
    for a moment."""
    path = Path(path)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT
    return path


def write_text_atomic(path: Path, text: str, *, private: bool = False) -> Path:
    """Write `text` to a temporary file beside `path`, then rename it over `path`; `private`:
    mode 600 (see create_private)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if private:
        create_private(tmp)
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """JSON (indented) through write_text_atomic: a reader never sees half a file."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str))


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when the file is missing, unreadable or not an object
    (a state file cut off by a kill, or never written)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
