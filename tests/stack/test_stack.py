"""The embedded stack end to end: real HAProxy, Redis, SQLite, agents, workers, gateways."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from openai import OpenAI

from llmchaos.processes import pid_alive
from llmchaos.stack import netns
from llmchaos.stack.cleanup import cleanup, leftovers
from llmchaos.stack.procs import find_stack_processes, http_get_status
from llmchaos.stack.stack import restart_gateway
from llmchaos.stack.tokens import make_text
from llmchaos.stack.topology import Topology, read_agent_state, read_secrets
from llmchaos.targets.embedded import EmbeddedTarget
from tests.stack.stack_client import Reply, Traffic, chat, valid_token

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(module_stack_factory) -> Topology:  # type: ignore[no-untyped-def]
    return module_stack_factory()


def gpu_pid(topology: Topology, worker: str) -> int:
    with urllib.request.urlopen(f"{topology.worker(worker).url}/gpu/processes", timeout=2) as r:
        processes = json.load(r)
    assert len(processes) == 1, processes
    return int(processes[0]["pid"])


def restarts(topology: Topology, worker: str) -> int:
    node = topology.node(topology.worker(worker).node)
    state = read_agent_state(Path(node.agent_state_path))
    assert state is not None
    return state.workers[worker].restarts


def wait_healthy(topology: Topology, worker: str, timeout_s: float) -> float:
    started = time.monotonic()
    url = f"{topology.worker(worker).url}/healthz"
    while time.monotonic() - started < timeout_s:
        if http_get_status(url, 0.5) == 200:
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"{worker} not healthy again after {timeout_s} s")


def wait_for_mode(url: str, token: str, mode: str, timeout_s: float) -> float:
    """Seconds until a request through `url` is served in `mode`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if chat(url, token, timeout_s=3).mode == mode:
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"no request served in {mode} mode within {timeout_s} s")


def test_openai_client_plain_and_streaming_through_haproxy(stack: Topology) -> None:
    client = OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key=valid_token(stack), max_retries=0, timeout=8
    )
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=[{"role": "user", "content": "one two three"}], max_tokens=5
    )
    reply = raw.parse()
    assert raw.headers["x-serving-mode"] == "gpu"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens >= 3
    assert reply.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    assert len(text.split()) == 6
    assert usage and usage[-1].completion_tokens == 6


def test_openai_client_completions_n_stop_and_a_tool_call_round_trip(stack: Topology) -> None:
    client = OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key=valid_token(stack), max_retries=0, timeout=8
    )
    plain = client.completions.create(model=stack.model, prompt="one two three", max_tokens=4)
    assert plain.choices[0].finish_reason == "length" and len(plain.choices[0].text.split()) == 4
    assert plain.usage is not None and plain.usage.prompt_tokens == 3
    chunks = list(
        client.completions.create(
            model=stack.model,
            prompt="one two three",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).split() == make_text(5).split()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    several = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=3
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    stopped = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        stop=["serves"],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == "the model "

    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "look it up"}]
    called = client.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=20,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )
    call = called.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "lookup" and "query" in json.loads(call.function.arguments)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "found it"},
    ]
    answer = client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=4, tools=tools
    )
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content


def test_bad_input_gets_openai_errors(stack: Topology) -> None:
    token = valid_token(stack)
    assert chat(stack.gateway_url, None).status == 401
    assert chat(stack.gateway_url, "sk-not-a-token").status == 401
    assert chat(stack.gateway_url, token, model="no-such-model").status == 404
    bad_json = chat(stack.gateway_url, token, body=b"{not json")
    assert bad_json.status == 400
    assert json.loads(bad_json.body)["error"]["message"]
    too_long = chat(stack.gateway_url, token, max_tokens=100_000)
    assert too_long.status == 400
    assert json.loads(too_long.body)["error"]["code"] == "context_length_exceeded"


@dataclass(frozen=True)
class GpuKill:
    """What clients saw when gpu-0's GPU process was killed under steady traffic."""

    pid: int
    """The pid killed."""
    killed_at: float
    ready_at: float
    """When gpu-0's own /healthz answered 200 again (restart delay + model load later)."""
    replies: list[Reply]
    """Replies to every request sent from 1 s before the kill until gpu-0 served again."""
    returned: bool
    """Whether gpu-0 served a request after it was ready again."""

    def sent_between(self, start_s: float, end_s: float) -> list[Reply]:
        """Replies to requests sent `start_s` to `end_s` seconds after the kill."""
        return [r for r in self.replies if start_s <= r.sent_at - self.killed_at < end_s]


def kill_gpu0_under_traffic(topology: Topology) -> GpuKill:
    """SIGKILL gpu-0's GPU process (pid from /gpu/processes) under 25 requests/s, and wait
    until its agent restarted it, it loaded its model and served a request again."""
    pid = gpu_pid(topology, "gpu-0")
    with Traffic(topology.gateway_url, valid_token(topology), rate_per_s=25, max_s=40) as traffic:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_healthy(topology, "gpu-0", timeout_s=20)
        ready_at = time.monotonic()
        returned = traffic.wait_for(lambda r: r.worker == "gpu-0", 10, after=ready_at)
    # after the block: the requests still in flight at its end have their replies too
    replies = traffic.since(killed_at - 1.0)
    return GpuKill(pid, killed_at, ready_at, replies, returned is not None)


def test_gpu_kill_moves_traffic_and_agent_brings_it_back(stack: Topology) -> None:
    before = restarts(stack, "gpu-0")
    kill = kill_gpu0_under_traffic(stack)
    failed = [r for r in kill.replies if r.status != 200]
    assert len(failed) <= 2, f"client-visible errors beyond in-flight ones: {failed}"
    # gpu-0 is back at the earliest 2 s after the kill (see below)
    after_kill = kill.sent_between(0.5, 1.5)
    assert after_kill and {r.worker for r in after_kill} == {"gpu-1"}
    assert {r.mode for r in after_kill} == {"gpu"}
    assert restarts(stack, "gpu-0") == before + 1
    assert gpu_pid(stack, "gpu-0") != kill.pid
    # restart_delay_s 0.5 + gpu_load_s 1.5 of the test stack
    back_s = kill.ready_at - kill.killed_at
    assert back_s >= 2.0, f"ready {back_s:.2f} s after the kill: model load must take 1.5 s"
    assert kill.returned, "gpu-0 got no traffic after it was ready again"
    # the target's own account (its node agent's), against this test's independent watch
    target = EmbeddedTarget(stack)
    facts = target.recovery_facts(kill.killed_at - 0.1)
    assert facts is not None
    (gpu0,) = facts["recovered"]
    assert gpu0["name"] == "gpu-0" and facts["unrecovered"] == []
    assert 0.4 <= gpu0["rescheduling_time_s"] <= 1.5, gpu0  # restart_delay_s 0.5
    assert 1.4 <= gpu0["readiness_time_s"] <= 3.0, gpu0  # gpu_load_s 1.5
    assert abs(gpu0["total_recovery_time_s"] - back_s) < 0.5, (gpu0, back_s)
    usage = target.kv_cache_usage()
    assert usage is not None and 0.0 <= usage <= 1.0


def test_no_failover_variant_fails_a_share_of_requests_when_a_gpu_is_killed(stack_factory) -> None:  # type: ignore[no-untyped-def]
    # the negative control of the test above: the same kill, without failover in the gateways
    kill = kill_gpu0_under_traffic(stack_factory(variant="no-failover"))
    # up to the requests in flight at the kill, all went well
    before = kill.sent_between(-1.0, -0.5)
    assert before and all(r.status == 200 for r in before), [r.status for r in before]
    # gpu-0 cannot serve for restart_delay_s 0.5 + gpu_load_s 1.5 after the kill (ready_at is
    # only when the poll saw it ready): round-robin over gpu-0 and gpu-1 fails about every
    # other request, while dead (502) and while loading (its own 503 model_loading); never
    # served from CPU, never retried. Those sent in the last 0.5 s of it may reach gpu-0 once
    # it serves on a busy box (one sent under 2 s after the kill did), so they are left out.
    down = kill.sent_between(0.0, 1.5)
    failed = [r for r in down if r.status != 200]
    assert 0.3 <= len(failed) / len(down) <= 0.7, sorted(Counter(r.status for r in down).items())
    assert {r.status for r in failed} <= {502, 503}, [r.status for r in failed]
    assert {r.worker for r in down if r.status == 200} == {"gpu-1"}
    assert kill.returned
    # once gpu-0 is loaded it serves again: every request sent after that succeeds
    after = kill.sent_between(kill.ready_at - kill.killed_at, math.inf)
    assert after and all(r.status == 200 for r in after), [r.status for r in after]


def test_killing_every_gpu_degrades_to_cpu(stack: Topology) -> None:
    token = valid_token(stack)
    for worker in ("gpu-0", "gpu-1"):
        os.kill(gpu_pid(stack, worker), signal.SIGKILL)
    cpu_after_s = wait_for_mode(stack.gateway_url, token, "cpu", timeout_s=5)
    reply = chat(stack.gateway_url, token)
    assert reply.status == 200 and reply.mode == "cpu" and reply.worker == "cpu-0"
    assert cpu_after_s < 3.0
    for worker in ("gpu-0", "gpu-1"):
        wait_healthy(stack, worker, timeout_s=20)
    wait_for_mode(stack.gateway_url, token, "gpu", timeout_s=10)


def test_no_cpu_fallback_variant_fails_when_every_gpu_is_killed(stack_factory) -> None:  # type: ignore[no-untyped-def]
    topology = stack_factory(variant="no-cpu-fallback", gpu_load_s=5.0)
    token = valid_token(topology)
    assert chat(topology.gateway_url, token).status == 200
    for worker in ("gpu-0", "gpu-1"):
        os.kill(gpu_pid(topology, worker), signal.SIGKILL)
    time.sleep(1.0)
    replies = [chat(topology.gateway_url, token, timeout_s=3) for _ in range(10)]
    assert all(r.status == 503 for r in replies), [r.status for r in replies]
    assert not any(r.mode == "cpu" for r in replies)


def test_primary_gateway_crash_fails_over_to_backup_and_back(stack: Topology) -> None:
    primary = next(g for g in stack.gateways if g.role == "primary")
    token = valid_token(stack)
    assert chat(stack.gateway_url, token).gateway == primary.name
    with Traffic(stack.gateway_url, token, rate_per_s=20, max_s=40) as traffic:
        time.sleep(0.5)
        crashed_at = time.monotonic()
        os.kill(primary.pid, signal.SIGKILL)
        failover_s = traffic.wait_for(
            lambda r: r.gateway == "gateway-backup" and r.status == 200, 10, after=crashed_at
        )
        time.sleep(1.0)
        restored = restart_gateway(stack, primary.name)
        restored_at = time.monotonic()
        back_s = traffic.wait_for(lambda r: r.gateway == primary.name, 10, after=restored_at)
        time.sleep(0.5)
    assert failover_s is not None and failover_s < 5.0, f"backup took over after {failover_s} s"
    steady = [r for r in traffic.since(crashed_at + failover_s + 0.5) if r.sent_at < restored_at]
    assert steady and all(r.status == 200 and r.gateway == "gateway-backup" for r in steady)
    assert back_s is not None and back_s < 5.0
    assert pid_alive(restored.gateways[0].pid)


def _gateway_counter(topology: Topology, name: str) -> float:
    """Sum of counter `name` over both gateways' /metrics."""
    total = 0.0
    for gateway in topology.gateways:
        with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=2) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + "_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


_LOOKUPS = "llmchaos_gateway_token_db_lookups"
_MISSES = "llmchaos_gateway_token_cache_misses"


def _flush_and_burst(topology: Topology, tokens: list[str], requests: int) -> tuple[float, float]:
    """Delete every cached token, then send `requests` requests at once.

    Returns (Redis misses, SQLite lookups) that the burst caused.
    """
    password = read_secrets(Path(topology.state_dir)).redis_password
    client = redis.Redis.from_url(topology.redis_url, password=password)
    for key in client.scan_iter("token:*"):
        client.delete(key)
    before = _gateway_counter(topology, _MISSES), _gateway_counter(topology, _LOOKUPS)
    statuses = asyncio.run(_burst(topology, tokens, requests))
    assert statuses == [200] * requests, sorted(set(statuses))
    return (
        _gateway_counter(topology, _MISSES) - before[0],
        _gateway_counter(topology, _LOOKUPS) - before[1],
    )


async def _burst(topology: Topology, tokens: list[str], requests: int) -> list[int]:
    body = {
        "model": topology.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    connector = aiohttp.TCPConnector(limit=requests)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> int:
            headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}
            url = f"{topology.gateway_url}/v1/chat/completions"
            async with session.post(url, json=body, headers=headers) as response:
                await response.read()
                return response.status

        return list(await asyncio.gather(*(one(i) for i in range(requests))))


@pytest.mark.parametrize("variant", ["hardened", "naive-cache"])
def test_token_cache_flush_lookups(stack_factory, variant: str) -> None:  # type: ignore[no-untyped-def]
    # How many requests miss depends on how fast the burst reaches the gateway (a request
    # arriving after the first lookup of its token has filled the cache hits): on a loaded
    # machine the burst spreads out. So the property is checked per miss, not per request.
    topology = stack_factory(variant=variant, token_db_latency_ms=100.0)
    tokens = [valid_token(topology, i) for i in range(4)]
    requests = 100
    misses, lookups = _flush_and_burst(topology, tokens, requests)
    assert misses > 2 * len(tokens), f"only {misses} misses: the burst was not concurrent"
    if variant == "hardened":
        assert lookups <= 2 * len(tokens), f"{lookups} SQLite lookups for {misses} misses"
    else:
        assert lookups == misses, f"naive cache: {lookups} SQLite lookups for {misses} misses"


def test_partitioned_node_times_out_and_is_routed_around(stack: Topology, needs_netns) -> None:  # type: ignore[no-untyped-def]
    node = stack.node("node-a")
    assert node.netns
    token = valid_token(stack)
    netns.partition_namespace(node.netns)
    try:
        started = time.monotonic()
        assert http_get_status(f"{stack.worker('gpu-0').url}/healthz", timeout_s=1.5) is None
        assert time.monotonic() - started >= 1.4, "a partition must time out, not refuse"
        replies = [chat(stack.gateway_url, token) for _ in range(15)]
        assert all(r.status == 200 for r in replies), [r.status for r in replies]
        assert {r.worker for r in replies[-10:]} == {"gpu-1"}
    finally:
        netns.heal_partition(node.netns)
    wait_healthy(stack, "gpu-0", timeout_s=10)


def test_stack_down_leaves_nothing(stack_factory) -> None:  # type: ignore[no-untyped-def]
    from llmchaos.stack.stack import stop_stack

    topology = stack_factory()
    assert find_stack_processes(topology.stack_id)
    stop_stack(topology)
    left = leftovers(topology.stack_id)
    assert left.empty, left.summary()
    assert Topology.load(Path(topology.state_dir)).status == "stopped"


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_cleanup_after_kill_9_leaves_nothing(stack_factory) -> None:  # type: ignore[no-untyped-def]
    topology = stack_factory()
    for pid in find_stack_processes(topology.stack_id):
        os.kill(pid, signal.SIGKILL)
    report = cleanup(Path(topology.state_dir).parent, [topology.stack_id])
    assert topology.stack_id in report.stacks_marked_stopped
    left = leftovers(topology.stack_id)
    assert left.empty, left.summary()
