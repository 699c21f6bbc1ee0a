"""The Prometheus probes against a real Prometheus scraping the embedded stack and the load.

One module-scoped setup: an embedded stack (loopback nodes, so every scrape goes to
127.0.0.1), an open-loop load through its HAProxy with its own tokens, and Debian's
`prometheus` (scrape interval 1 s) scraping the engine workers, the gateways and the load's
/metrics, with deploy/prometheus's alert rules loaded. All three are stopped at the end,
pass or fail; Prometheus also gets SIGTERM if pytest itself is killed.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.traffic import TrafficSpec
from llmchaos.prometheus import (
    Prometheus,
    PrometheusNoData,
    PrometheusQueryError,
    error_rate,
    p99_latency_ms,
    query_scalar,
    queue_depth,
)
from llmchaos.stack.topology import Topology
from probes import prometheus as prometheus_probes
from tests.prometheus.conftest import PrometheusBinaries
from tests.prometheus.promql_names import EXTERNAL, dashboard_exprs, metric_names, rule_exprs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "llmchaos-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "llmchaos.json"

QPS = 8.0
"""A few requests per second: enough for a P99 over WINDOW_S (160 requests), little CPU."""
WINDOW_S = 20
"""PromQL rate() window and the load window compared with it: 20 scrapes at 1 s."""
LOAD_DURATION_S = 180.0
"""Upper bound of the load; the fixture stops it as soon as the module's tests are done."""
READY_TIMEOUT_S = 30.0
P99_RATIO_TOLERANCE = 2.0
"""The PromQL P99 must be within a factor 2 of the load's own P99. histogram_quantile only
knows which bucket holds the 99th percentile and interpolates linearly inside it; vLLM's
buckets near 1 s are 0.8-1.0-1.5-2.0-2.5-5.0, so the estimate can be off by up to the bucket
width (x1.5 for 1.0-1.5, x2 for 2.5-5.0). The load's latency also includes HAProxy, the
gateway and its token check (a few ms). A factor 2 catches a wrong unit (x1000), a wrong
metric or a wrong quantile, which is what this comparison is for."""

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Setup:
    stack: Topology
    load: LoadRun
    prom: Prometheus
    url: str
    """Prometheus' base URL."""
    targets: list[dict[str, Any]]
    """/api/v1/targets' activeTargets once all were up."""
    started_at: float
    """Epoch when Prometheus started (no data before it)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def host_port(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def get_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.load(response)


def scrape_config(stack: Topology, load: LoadRun) -> dict[str, Any]:
    workers = [w for node in stack.nodes for w in node.workers]
    return {
        # 1 s: the windows of the tests are tens of seconds, not the 15 s default's minutes.
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "vllm",
                "static_configs": [
                    {
                        "targets": [host_port(w.url)],
                        "labels": {"worker": w.name, "mode": w.mode, "node": w.node},
                    }
                    for w in workers
                ],
            },
            {
                "job_name": "gateway",
                "static_configs": [
                    {"targets": [host_port(g.url)], "labels": {"gateway": g.name, "role": g.role}}
                    for g in stack.gateways
                ],
            },
            {"job_name": "load", "static_configs": [{"targets": [host_port(load.live_url)]}]},
        ],
    }


def _die_with_parent() -> None:
    # A pytest killed with SIGKILL runs no teardown: the kernel then stops Prometheus.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_prometheus(
    binary: str, config: dict[str, Any], folder: Path, port: int
) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "prometheus.yml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    with (folder / "prometheus.log").open("wb") as log:
        return subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={folder / 'data'}",
                "--storage.tsdb.retention.time=1h",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def wait_for_targets(url: str, expected: int, process: subprocess.Popen[bytes], log: Path) -> Any:
    """activeTargets once `expected` targets are all up; fails with their errors otherwise."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    targets: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
        try:
            targets = get_json(f"{url}/api/v1/targets")["data"]["activeTargets"]
        except OSError:
            targets = []  # not listening yet
        if len(targets) == expected and all(t["health"] == "up" for t in targets):
            return targets
        time.sleep(0.2)
    states = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
    pytest.fail(f"targets not all up within {READY_TIMEOUT_S} s: {states}")


def wait_for_window(prom: Prometheus, window_s: float) -> None:
    """Until every worker has a full window of scrapes (no fixed sleep: the data decides)."""
    promql = f"min(count_over_time(vllm:num_requests_running[{window_s}s]))"
    deadline = time.monotonic() + window_s + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if query_scalar(prom, promql) >= window_s - 1:
                return
        except PrometheusNoData:
            pass
        time.sleep(0.5)
    pytest.fail(f"less than {window_s} s of scrapes after {window_s + READY_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def setup(
    module_stack_factory: Any, prometheus_binaries: PrometheusBinaries, tmp_path_factory: Any
) -> Iterator[Setup]:
    folder: Path = tmp_path_factory.mktemp("prometheus")
    with ExitStack() as cleanup:
        stack: Topology = module_stack_factory(netns="off")  # stopped by the factory
        load = LoadRun.start(
            LoadConfig(
                url=stack.gateway_url,
                qps=QPS,
                duration_s=LOAD_DURATION_S,
                profile="constant",
                tokens_file=stack.tokens_file,
                # ~1 s answers (32 tokens median, capped at 96): P99 near the 1.0-1.5 s bucket
                drain_s=4.0,
                run_dir=str(folder / "load"),
                owner_pid=os.getpid(),
                traffic=TrafficSpec(
                    model=stack.model,
                    stream_share=0.3,
                    output_median_tokens=32,
                    output_max_tokens=96,
                ),
            )
        )
        cleanup.callback(load.close)
        cleanup.callback(load.stop, 20.0)  # runs first: drain and summary, close() if it hangs
        load.wait_started()
        port = free_port()
        started_at = time.time()
        process = start_prometheus(
            prometheus_binaries.prometheus, scrape_config(stack, load), folder, port
        )
        cleanup.callback(stop_process, process)
        url = f"http://127.0.0.1:{port}"
        n_workers = sum(len(node.workers) for node in stack.nodes)
        expected = n_workers + len(stack.gateways) + 1
        targets = wait_for_targets(url, expected, process, folder / "prometheus.log")
        prom = Prometheus.at(url, timeout_s=5.0)
        wait_for_window(prom, WINDOW_S)
        yield Setup(stack, load, prom, url, targets, started_at)


def test_all_targets_are_scraped(setup: Setup) -> None:
    jobs = sorted(t["labels"]["job"] for t in setup.targets)
    assert jobs == ["gateway", "gateway", "load", "vllm", "vllm", "vllm"], jobs
    assert all(host_port(t["scrapeUrl"]).startswith("127.0.0.1:") for t in setup.targets)
    # the load's own gauge, through Prometheus: its rate is what we asked for
    achieved = query_scalar(setup.prom, "llmchaos_load_achieved_qps")
    assert QPS * 0.7 <= achieved <= QPS * 1.3, achieved


def test_p99_from_the_histogram_matches_the_loads_p99(setup: Setup) -> None:
    # A window that ended a few seconds ago: its requests have been answered (load) and
    # scraped (Prometheus). The load bins requests by scheduled time, Prometheus by when the
    # engine finished them; with ~1 s answers in a 20 s window the two nearly coincide.
    end = time.time() - 4.0
    promql_ms = p99_latency_ms(setup.prom, WINDOW_S, at=end)
    window = setup.load.window(since_ts=end - WINDOW_S, until_ts=end)
    load_ms = window["latency_ms"]["p99"]
    print(
        f"\nP99 over {WINDOW_S} s: PromQL {promql_ms:.0f} ms, load {load_ms:.0f} ms "
        f"({window['ok']} requests, ratio {promql_ms / load_ms:.2f})"
    )
    assert window["ok"] >= QPS * WINDOW_S * 0.8, window
    assert load_ms / P99_RATIO_TOLERANCE <= promql_ms <= load_ms * P99_RATIO_TOLERANCE
    # and the probe entry point gives the same figure (no llmchaos run needed)
    probe_ms = prometheus_probes.p99_latency_ms(setup.url, window_s=WINDOW_S)
    assert load_ms / P99_RATIO_TOLERANCE <= probe_ms <= load_ms * P99_RATIO_TOLERANCE


def test_queue_depth_is_a_count(setup: Setup) -> None:
    depth = queue_depth(setup.prom)
    assert isinstance(depth, float) and depth >= 0 and depth == int(depth)
    assert prometheus_probes.queue_depth(setup.url) >= 0
    # the range API: one series, a point per second, every one a count >= 0
    end = time.time()
    series = setup.prom.query_range("sum(vllm:num_requests_waiting)", end - 10, end, step_s=1)
    assert len(series) == 1 and len(series[0].points) >= 10, series
    assert all(value >= 0 for _, value in series[0].points)


def test_error_rate_is_zero_with_valid_tokens_and_no_data_is_not_zero(setup: Setup) -> None:
    rate = error_rate(setup.prom, WINDOW_S)
    print(f"\nerror rate over {WINDOW_S} s: {rate}")
    assert rate == 0.0
    assert prometheus_probes.error_rate(setup.url, window_s=WINDOW_S) == 0.0
    # the same query over a window before Prometheus existed has no data: an error, not 0
    with pytest.raises(PrometheusNoData, match="no data"):
        error_rate(setup.prom, WINDOW_S, at=setup.started_at - 3600)


def test_bad_promql_gives_prometheus_own_error(setup: Setup) -> None:
    promql = "sum(rate(vllm:e2e_request_latency_seconds_bucket[5m])"
    with pytest.raises(PrometheusQueryError) as caught:
        prometheus_probes.query(setup.url, promql)
    message = str(caught.value)
    assert setup.url in message and promql in message
    assert "bad_data" in message and "parse error" in message, message


def test_query_with_no_data_is_not_zero(setup: Setup) -> None:
    with pytest.raises(PrometheusNoData, match="no data: the result is empty") as caught:
        query_scalar(setup.prom, "sum(llmchaos_no_such_metric)")
    assert "sum(llmchaos_no_such_metric)" in str(caught.value)
    with pytest.raises(PrometheusNoData, match="NaN"):
        query_scalar(setup.prom, "0 / 0")
    # empty list, not an error, from the raw instant query
    assert setup.prom.query("llmchaos_no_such_metric") == []


def test_results_that_are_not_one_number_are_errors(setup: Setup) -> None:
    with pytest.raises(PrometheusQueryError, match=r"expected one number, got 3 series"):
        query_scalar(setup.prom, 'up{job="vllm"}')
    with pytest.raises(PrometheusQueryError, match="range vector"):
        setup.prom.query("up[5s]")
    # a URL that is not Prometheus (an engine worker): named as such
    worker_url = setup.stack.worker("gpu-0").url
    with pytest.raises(PrometheusQueryError, match="not the Prometheus API's JSON"):
        query_scalar(Prometheus.at(worker_url), "up")


def test_alert_rules_evaluate_on_the_real_metrics(setup: Setup) -> None:
    groups = get_json(f"{setup.url}/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 8
    deadline = time.monotonic() + 10
    while any(r["lastEvaluation"].startswith("0001") for r in rules):  # not evaluated yet
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
        groups = get_json(f"{setup.url}/api/v1/rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    # a healthy stack under light load: nothing fires
    assert [r["name"] for r in rules if r["state"] != "inactive"] == []


def test_every_dashboard_query_returns_data(setup: Setup) -> None:
    """Each PromQL of the Grafana dashboard runs on the real Prometheus and shows something,
    except the GPU panel (dcgm-exporter's metrics do not exist without a GPU)."""
    empty = []
    for title, expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        if "DCGM_" in expr:
            continue
        promql = expr.replace("$__rate_interval", f"{WINDOW_S}s")
        if not setup.prom.query(promql):
            empty.append((title, promql))
    assert empty == []


def test_dashboard_and_rule_metrics_exist_in_prometheus(setup: Setup) -> None:
    """The exact check behind the grep of test_deploy: every metric the dashboard and the
    alert rules read is a series Prometheus scraped from the stack or the load."""
    scraped = set(get_json(f"{setup.url}/api/v1/label/__name__/values")["data"])
    exprs = list(dashboard_exprs(json.loads(DASHBOARD.read_text())))
    exprs += list(rule_exprs(yaml.safe_load(RULES.read_text())))
    missing = {(name, m) for name, e in exprs for m in metric_names(e) - scraped - EXTERNAL}
    assert missing == set()


def test_probes_in_a_plain_chaos_toolkit_experiment(setup: Setup, tmp_path: Path) -> None:
    """No llmchaos control in the experiment: the probes only need Prometheus' URL."""

    def probe(name: str, func: str, low: float, high: float, **arguments: object) -> Any:
        return {
            "type": "probe",
            "name": name,
            "tolerance": {"type": "range", "range": [low, high]},
            "provider": {
                "type": "python",
                "module": "probes.prometheus",
                "func": func,
                "arguments": {"url": setup.url, **arguments},
            },
        }

    experiment = {
        "title": "LLM serving stays within its SLO, read from Prometheus",
        "description": "Prometheus probes without the llmchaos control",
        "steady-state-hypothesis": {
            "title": "SLO from Prometheus",
            "probes": [
                probe("p99-ms", "p99_latency_ms", 0, 5000, window_s=WINDOW_S),
                probe("error-rate", "error_rate", 0, 0.01, window_s=WINDOW_S),
                probe("queue-depth", "queue_depth", 0, 100),
                probe("gpu-workers-up", "query", 2, 2, promql='sum(up{job="vllm",mode="gpu"})'),
            ],
        },
        "method": [probe("scraped-targets", "query", 6, 6, promql="count(up == 1)")],
    }
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    chaos = str(Path(sys.executable).with_name("chaos"))
    result = subprocess.run(
        [
            chaos,
            "--no-version-check",
            "--log-file",
            str(tmp_path / "chaostoolkit.log"),
            "--settings",
            str(tmp_path / "settings.yaml"),
            "run",
            str(path),
            "--journal-path",
            str(tmp_path / "journal.json"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    journal = json.loads((tmp_path / "journal.json").read_text())
    assert (
        journal["status"] == "completed" and journal["steady_states"]["before"]["steady_state_met"]
    )
    outputs = {
        p["activity"]["name"]: p["output"] for p in journal["steady_states"]["before"]["probes"]
    }
    print(f"\nchaos run outputs: {outputs}")
    assert all(isinstance(v, float) and math.isfinite(v) for v in outputs.values()), outputs
