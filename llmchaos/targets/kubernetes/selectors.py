"""Kubernetes label selectors (equality- and set-based), parsed and applied here too: a server
(or an emulator) that ignores them must not widen a fault to pods it was not aimed at."""

from __future__ import annotations

import re
from collections.abc import Mapping

from llmchaos.errors import InvalidInput

__all__ = ["Requirement", "parse_selector", "selector_matches", "valid_label_key"]

Requirement = tuple[str, str, frozenset[str]]
"""(key, operator, values): operator is one of =, !=, in, notin, exists, !exists."""

_SET_REQ = re.compile(r"([^\s!=(),]+)\s+(in|notin)\s*\(([^()]*)\)")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def valid_label_key(key: str) -> bool:
    """A label key as the API server accepts it: [prefix/]name, name at most 63 characters,
    prefix a DNS subdomain of at most 253."""
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_KEY.fullmatch(key)) and len(name) <= 63 and len(prefix) <= 253


def valid_label_value(value: str) -> bool:
    return bool(_LABEL_VALUE.fullmatch(value)) and len(value) <= 63


def parse_selector(selector: str, field: str = "selector") -> list[Requirement]:
    """Parse a Kubernetes label selector (equality- and set-based). InvalidInput names `field`."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    requirements: list[Requirement] = []
    for raw in parts:
        part = raw.strip()
        if not part:
            continue
        set_match = _SET_REQ.fullmatch(part)
        if set_match:
            key, op, values = set_match.groups()
            items = frozenset(v.strip() for v in values.split(",") if v.strip())
            requirements.append((key, op, items))
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            requirements.append((key, "!=", frozenset({value})))
        elif "=" in part:
            key, value = (s.strip() for s in part.replace("==", "=").split("=", 1))
            requirements.append((key, "=", frozenset({value})))
        elif part.startswith("!"):
            requirements.append((part[1:].strip(), "!exists", frozenset()))
        else:
            requirements.append((part, "exists", frozenset()))
        key, _, values = requirements[-1]
        if not valid_label_key(key) or not all(valid_label_value(v) for v in values):
            raise InvalidInput(
                f"{field}: cannot parse {part!r} in label selector {selector!r} (expected "
                f"key=value, key!=value, key in (a,b), key notin (a,b), key or !key)"
            )
    if not requirements:
        raise InvalidInput(f"{field}: empty label selector {selector!r}")
    return requirements


def selector_matches(requirements: list[Requirement], labels: Mapping[str, str]) -> bool:
    """Whether `labels` satisfy every requirement (Kubernetes semantics)."""
    for key, op, values in requirements:
        present = key in labels
        value = labels.get(key)
        ok = {
            "=": present and value in values,
            "!=": not present or value not in values,
            "in": present and value in values,
            "notin": not present or value not in values,
            "exists": present,
            "!exists": not present,
        }[op]
        if not ok:
            return False
    return True


# -- helpers -------------------------------------------------------------------------------
