"""Reading an experiment file the way Chaos Toolkit does (JSON, or YAML for .yaml/.yml), with
one clear line for everything that is not an experiment: an empty file, a list, a number,
broken JSON or YAML, another extension.

`llmchaos validate` uses it, and so does `chaos run` through the llmchaos plugin of Chaos
Toolkit's command line (llmchaos.chaostoolkit_plugin), where Chaos Toolkit itself would print
a 30-line traceback for most of these. Kept light (no chaoslib, no llmchaos.run): it is
imported every time `chaos` starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from llmchaos.errors import InvalidInput

__all__ = ["EXTENSIONS", "read_experiment"]

EXTENSIONS = (".json", ".yaml", ".yml")
"""What Chaos Toolkit reads: JSON, or YAML by the file's extension."""

_EXPECTED = "expected a Chaos Toolkit experiment: an object with title, description and method"


def read_experiment(path: Path) -> dict[str, Any]:
    """The experiment in the file at `path`; raises InvalidInput with one line naming the
    file and what is wrong."""
    path = Path(path)
    if path.suffix not in EXTENSIONS:
        raise InvalidInput(
            f"{path}: Chaos Toolkit reads .json, .yaml and .yml experiments, not {path.suffix!r}"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read the file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{path}: not UTF-8 text; {_EXPECTED}") from None
    if not text.strip():
        raise InvalidInput(f"{path}: empty file; {_EXPECTED}")
    try:
        data = yaml.safe_load(text) if path.suffix != ".json" else json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{path}: not JSON: {exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or "cannot parse"
        raise InvalidInput(f"{path}: not YAML{line}: {problem}") from None
    except RecursionError:
        raise InvalidInput(f"{path}: nested too deeply; {_EXPECTED}") from None
    if not isinstance(data, dict):
        kind = _KINDS.get(type(data).__name__, type(data).__name__)
        raise InvalidInput(f"{path}: {kind}, not an object; {_EXPECTED}")
    return data


_KINDS = {
    "list": "a list",
    "str": "a string",
    "int": "a number",
    "float": "a number",
    "bool": "true/false",
    "NoneType": "null",
}
