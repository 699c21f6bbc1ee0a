"""Metric names: those a PromQL expression reads, and those the code exports (by grep).

The dashboard and the alert rules name metrics as strings in JSON and YAML; nothing fails
when a metric is renamed in the code. The tests compare the two sets instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

EXPORTERS = {
    "llmchaos/stack/worker_metrics.py": "",
    "llmchaos/stack/gateway/metrics.py": "",
    "llmchaos/load/live.py": "llmchaos_load_",
}
"""Files that export metrics, and the prefix their code puts before the names it lists."""

EXTERNAL = frozenset({"DCGM_FI_DEV_GPU_UTIL"})
"""Metrics of other exporters (dcgm-exporter): not in this code base, named on purpose."""

_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")
"""What client libraries add to a family name (counters, histograms)."""

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"}
    | {"unless", "offset", "inf", "nan", "atan2"}
)


def metric_names(promql: str) -> set[str]:
    """The metric names `promql` selects (functions, keywords, labels and durations left out)."""
    text = re.sub(r"\$\{?\w+\}?", " ", promql)  # Grafana variables ($__rate_interval)
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', text)  # label values
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in _KEYWORDS:
            continue  # a function or an aggregation
        names.add(match.group())
    return names


def exported_names() -> set[str]:
    """Every metric name the exporters' source spells out, with the client's suffixes."""
    families = set()
    for path, prefix in EXPORTERS.items():
        source = (REPO / path).read_text()
        if prefix:
            # live.py: metric("achieved_qps", "gauge", ...) and ("latency_ms", "help") tuples
            families |= {prefix + n for n in re.findall(r'\(\s*"([a-z_]+)",\s*"', source)}
        else:
            families |= set(re.findall(r'"((?:vllm:|llmchaos_|llmchaos:)[a-z0-9_:]+)"', source))
    return {family + suffix for family in families for suffix in _SUFFIXES}


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, rows' nested panels included."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield panel.get("title", "?"), target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard.get("panels", []))


def rule_exprs(rules: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(alert or record name, expr) of every rule of a Prometheus rules file."""
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule.get("record"), rule["expr"]
