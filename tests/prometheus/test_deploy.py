"""deploy/prometheus alert rules and the deploy/grafana dashboard: valid, and naming only
metrics the code exports (so a renamed metric fails here instead of blanking a panel)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus.conftest import PrometheusBinaries
from tests.prometheus.promql_names import (
    EXTERNAL,
    dashboard_exprs,
    exported_names,
    metric_names,
    rule_exprs,
)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "llmchaos-alerts.yml"
RULE_TESTS = Path(__file__).with_name("alerts_test.yml")
DASHBOARD = REPO / "deploy" / "grafana" / "llmchaos.json"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def unknown_names(exprs: list[tuple[str, str]]) -> list[tuple[str, str, set[str]]]:
    known = exported_names() | EXTERNAL
    return [(name, expr, metric_names(expr) - known) for name, expr in exprs]


@pytest.mark.parametrize(
    ("promql", "names"),
    [
        (
            "histogram_quantile(0.99, sum by (le) "
            "(rate(vllm:e2e_request_latency_seconds_bucket[$__rate_interval]))) * 1e3",
            {"vllm:e2e_request_latency_seconds_bucket"},
        ),
        (
            '(sum(rate(llmchaos_gateway_requests_total{code=~"5..|429"}[5m])) or vector(0))'
            " / ignoring(code) group_left sum(rate(llmchaos_gateway_requests_total[5m] "
            "offset 1h))",
            {"llmchaos_gateway_requests_total"},
        ),
        (
            'max by (quantile) (llmchaos_load_latency_ms{quantile="0.99"}) > bool 2',
            {"llmchaos_load_latency_ms"},
        ),
        ("sum(up) and on (job) DCGM_FI_DEV_GPU_UTIL", {"up", "DCGM_FI_DEV_GPU_UTIL"}),
    ],
    ids=["histogram", "ratio", "quantile-label", "on"],
)
def test_metric_names_are_read_from_promql(promql: str, names: set[str]) -> None:
    assert metric_names(promql) == names


def test_the_name_check_catches_a_renamed_metric() -> None:
    renamed = [("queue", "sum(vllm:num_requests_queued)"), ("ok", "vllm:num_requests_waiting")]
    assert [(n, bad) for n, _, bad in unknown_names(renamed) if bad] == [
        ("queue", {"vllm:num_requests_queued"})
    ]


def test_dashboard_names_only_metrics_the_code_exports() -> None:
    exprs = list(dashboard_exprs(dashboard()))
    assert len(exprs) >= 15
    assert all(metric_names(expr) for _, expr in exprs), "a query without a metric"
    assert [(title, bad) for title, _, bad in unknown_names(exprs) if bad] == []


def test_dashboard_has_the_load_and_target_panels() -> None:
    used = set().union(*(metric_names(expr) for _, expr in dashboard_exprs(dashboard())))
    wanted = {
        # the load: achieved QPS, latency quantiles, error rate by class, serving mode share
        "llmchaos_load_achieved_qps",
        "llmchaos_load_latency_ms",
        "llmchaos_load_error_rate",
        "llmchaos_load_serving_mode_share",
        # the target: queue, running, KV cache, P99 from the histogram, gateway by mode
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:e2e_request_latency_seconds_bucket",
        "llmchaos_gateway_requests_total",
    }
    assert wanted - used == set()


def test_dashboard_is_importable_grafana_json() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] < 24
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]


def test_alert_rules_name_only_known_metrics() -> None:
    rules = yaml.safe_load(RULES.read_text())
    exprs = list(rule_exprs(rules))
    alerts = {name for name, _ in exprs}
    assert {"LLMEngineQueueBuilding", "LLMP99LatencyHigh", "GPUUtilisationHigh"} <= alerts
    assert {"LLMErrorRateHigh"} <= alerts
    assert [(name, bad) for name, _, bad in unknown_names(exprs) if bad] == []
    gpu = next(
        r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "GPUUtilisationHigh"
    )
    assert (gpu["expr"], gpu["for"]) == ("DCGM_FI_DEV_GPU_UTIL > 90", "5m")
    assert "70%" in gpu["annotations"]["description"]  # the HPA target it is read against


def test_promtool_checks_the_rules(prometheus_binaries: PrometheusBinaries) -> None:
    done = subprocess.run(
        [prometheus_binaries.promtool, "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


def test_promtool_unit_tests_of_the_alerts(prometheus_binaries: PrometheusBinaries) -> None:
    """Each alert fires on the series it is for (labels, rendered annotations) and not below."""
    done = subprocess.run(
        [prometheus_binaries.promtool, "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
