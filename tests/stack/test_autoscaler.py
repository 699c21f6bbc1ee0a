"""The embedded autoscaler: Kubernetes' HPA algorithm step by step, then a real stack that
scales out under load (each new worker loading its model) and back in."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmchaos.errors import InvalidInput
from llmchaos.stack.autoscaler import AutoscalerSettings, Hpa, ReplicaReading
from llmchaos.stack.topology import Topology, read_agent_state, read_replicas
from tests.stack.stack_client import chat, valid_token

SETTINGS = AutoscalerSettings(
    min_replicas=1,
    max_replicas=10,
    target_utilization=0.7,
    scale_down_window_s=30.0,
    policy_period_s=15.0,
)


def ready(*utilizations: float) -> list[ReplicaReading]:
    return [ReplicaReading(f"gpu-{i}", True, u) for i, u in enumerate(utilizations)]


def test_ratio_of_the_average_to_the_target_times_the_ready_replicas() -> None:
    hpa = Hpa(SETTINGS, current=2)
    decision = hpa.decide(0.0, ready(1.4, 1.4))  # ratio 2 over 2 replicas
    assert (decision.recommendation, decision.desired) == (4, 4)
    assert hpa.current == 4


def test_within_the_tolerance_nothing_changes() -> None:
    hpa = Hpa(SETTINGS, current=3)
    assert hpa.decide(0.0, ready(0.76, 0.76, 0.76)).desired == 3  # ratio 1.086 <= 1.1
    assert hpa.decide(1.0, ready(0.78, 0.78, 0.78)).desired == 4  # ratio 1.114


def test_loading_replicas_count_as_idle_when_scaling_up() -> None:
    # one ready at 140% (ratio 2) and two loading: with them at 0% the ratio is 0.67, the
    # other way: Kubernetes keeps the count rather than flap
    hpa = Hpa(SETTINGS, current=3)
    loading = [ReplicaReading("gpu-1", False, 0.0), ReplicaReading("gpu-2", False, 0.0)]
    decision = hpa.decide(0.0, ready(1.4) + loading)
    assert decision.desired == 3 and "kept" in decision.reason
    # at 420% the ratio with them at 0% is still 2: scale up to ceil(2 * 3)
    assert hpa.decide(1.0, ready(4.2) + loading).recommendation == 6


def test_replicas_that_do_not_answer_count_as_at_target_when_scaling_down() -> None:
    hpa = Hpa(SETTINGS, current=2)
    gone = [ReplicaReading("gpu-1", False, None)]
    # ready at 35% (ratio 0.5); the silent one at 70%: ratio 0.75 -> ceil(1.5) = 2, kept
    assert hpa.decide(0.0, ready(0.35) + gone).desired == 2
    assert hpa.decide(1.0, ready(0.07) + gone).recommendation == 2  # ratio 0.55 -> 1.1


def test_scale_down_waits_for_the_highest_recommendation_of_its_window() -> None:
    hpa = Hpa(SETTINGS, current=4)
    assert hpa.decide(0.0, ready(0.7, 0.7, 0.7, 0.7)).desired == 4
    assert hpa.decide(10.0, ready(0.07, 0.07, 0.07, 0.07)).desired == 4  # 4 still in window
    assert hpa.decide(29.0, ready(0.07, 0.07, 0.07, 0.07)).desired == 4
    assert hpa.decide(31.0, ready(0.07, 0.07, 0.07, 0.07)).desired == 1  # window passed


def test_scale_up_is_limited_to_four_pods_or_double_per_period() -> None:
    hpa = Hpa(SETTINGS, current=1)
    assert hpa.decide(0.0, ready(7.0)).desired == 5  # wants 10: max(1 + 4, 2 * 1)
    assert hpa.decide(5.0, ready(7.0, 7.0, 7.0, 7.0, 7.0)).desired == 5  # same period
    assert hpa.decide(16.0, ready(7.0, 7.0, 7.0, 7.0, 7.0)).desired == 10  # max(9, 10)


def test_the_count_stays_within_min_and_max() -> None:
    hpa = Hpa(AutoscalerSettings(min_replicas=2, max_replicas=3, scale_down_window_s=0), 2)
    assert hpa.decide(0.0, ready(7.0, 7.0)).desired == 3
    assert hpa.decide(100.0, ready(0.0, 0.0, 0.0)).desired == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidInput, match="min_replicas <= max_replicas"):
        AutoscalerSettings(min_replicas=3, max_replicas=2)


def test_a_stack_scales_out_under_load_and_back_in(stack_factory: Callable[..., Topology]) -> None:
    """Batches of 4, target 70%: 12 long requests at once ask for 3 replicas and more; each
    new replica loads its model for 2 s before it serves; idle again, the pool returns to 1
    after the 4 s window."""
    topology = stack_factory(
        gpu_workers=3,
        cpu_workers=0,
        netns="off",
        gpu_max_num_seqs=4,
        gpu_load_s=2.0,
        first_load_s=0.5,
        autoscale=True,
        autoscale_sync_s=0.5,
        autoscale_scale_down_window_s=4.0,
        autoscale_policy_period_s=0.5,
    )
    assert topology.replicas_path and topology.autoscaler_pid
    replicas = Path(topology.replicas_path)
    assert read_replicas(replicas) == {"gpu": 1}
    token = valid_token(topology)
    body = json.dumps(
        {"model": "llmchaos-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150}
    ).encode()
    started = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        replies = [
            pool.submit(chat, topology.gateway_url, token, body=body, timeout_s=30)
            for _ in range(12)
        ]
        while read_replicas(replicas)["gpu"] < 3 and time.monotonic() - started < 10:
            time.sleep(0.1)
        decided_s = time.monotonic() - started
        assert read_replicas(replicas)["gpu"] == 3, "no scale-out within 10 s"
        states = {}
        while time.monotonic() - started < 20:
            states = {
                name: worker
                for node in topology.nodes
                for name, worker in (read_agent_state(Path(node.agent_state_path)).workers.items())
            }
            if all(states.get(f"gpu-{i}") and states[f"gpu-{i}"].ready_at for i in range(3)):
                break
            time.sleep(0.1)
        for i in (1, 2):  # new pods: a full model load each (2 s), no restart counted
            state = states[f"gpu-{i}"]
            assert state.ready_at is not None and state.ready_at - state.started_at >= 2.0
            assert state.restarts == 0
        assert all(r.result().status == 200 for r in replies)
    assert decided_s < 5.0
    # idle: back to the minimum after the scale-down window, the stopped workers not restarted
    deadline = time.monotonic() + 20
    while read_replicas(replicas)["gpu"] > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert read_replicas(replicas)["gpu"] == 1

    def running() -> set[str]:
        return {
            name
            for node in topology.nodes
            for name, worker in read_agent_state(Path(node.agent_state_path)).workers.items()
            if worker.running
        }

    # a stopped worker drains first (shutdown_drain_s), so give it a few seconds to go
    deadline = time.monotonic() + 10
    while running() != {"gpu-0"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running() == {"gpu-0"}
    time.sleep(1.5)
    assert running() == {"gpu-0"}, "a stopped worker was started again"
    history = json.loads((replicas.parent / "autoscaler-state.json").read_text())["decisions"]
    assert [d["desired"] for d in history if d["desired"] != d["current"]][-1] == 1
