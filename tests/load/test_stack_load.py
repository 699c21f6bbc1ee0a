"""The load against the real embedded stack: HAProxy -> gateways -> GPU workers, real tokens.

Each test starts its own stack (`stack_factory` stops it, pass or fail) and runs a bounded
~100 QPS open-loop load through the stack's front URL with the stack's own tokens file.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from llmchaos.load import LoadConfig, LoadRun
from llmchaos.load.timeline import FAILURE_CLASSES
from llmchaos.load.traffic import TrafficSpec
from llmchaos.stack.topology import Topology

pytestmark = pytest.mark.slow

QPS = 100.0
DURATION_S = 5.0


def stack_load(topology: Topology, run_dir: Path) -> LoadConfig:
    return LoadConfig(
        url=topology.gateway_url,
        qps=QPS,
        duration_s=DURATION_S,
        profile="constant",
        tokens_file=topology.tokens_file,
        # Bounded: a request the dead stack holds gives up after 3 s, and the drain waits it out.
        timeout_s=3.0,
        drain_s=4.0,
        run_dir=str(run_dir),
        traffic=TrafficSpec(
            model=topology.model, stream_share=0.3, output_median_tokens=8, output_max_tokens=32
        ),  # short answers: the simulated GPU is not what is measured
    )


def test_load_through_the_stack_is_served_by_gpu(stack_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topology = stack_factory()
    with LoadRun.start(stack_load(topology, tmp_path / "run")) as run:
        summary = run.wait()
    assert summary.accounting_closed
    assert summary.scheduled == QPS * DURATION_S
    assert summary.ok == summary.scheduled, summary.to_dict()
    assert summary.serving_modes.get("gpu", 0) == summary.ok, summary.serving_modes
    assert summary.ttft_ms["p50"] is not None  # the streaming share went through the gateway


def test_gateways_killed_mid_run_are_counted_not_hidden(stack_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topology = stack_factory()
    with LoadRun.start(stack_load(topology, tmp_path / "run")) as run:
        start = run.wait_started()
        time.sleep(max(0.0, start + 2.0 - time.time()))
        for gateway in topology.gateways:
            os.kill(gateway.pid, signal.SIGKILL)
        killed_s = time.time() - start
        summary = run.wait()
    failed = sum(summary.failed.values())
    # The schedule went on to its end: every planned request was sent or counted.
    assert summary.scheduled == QPS * DURATION_S
    assert summary.accounting_closed and summary.in_flight == 0
    assert summary.scheduled == summary.ok + failed + summary.dropped
    # Answers only before the kill (some of those requests were still in the gateways); what
    # came after failed in a named class: HAProxy's 503 without a backend, requests it held
    # until our timeout, broken connections, streams cut off mid-answer (bad body).
    assert 0 < summary.ok < QPS * (killed_s + 1.0), summary.to_dict()
    assert failed > QPS * (DURATION_S - killed_s - 1.0), summary.failed
    assert summary.failed["429"] == summary.failed["4xx"] == 0, summary.failed
    assert set(summary.failed) == set(FAILURE_CLASSES)
    written = json.loads(run.summary_path.read_text())
    assert written["scheduled"] == summary.scheduled and written["failed"] == summary.failed
