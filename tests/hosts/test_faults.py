"""The hosts target's faults on real processes (simulated engine workers, Debian's nginx,
iptables as root): each checked to have taken effect, each undone by its undo, by the ledger,
at close, and by the cleanup after a kill -9 of the run that owned them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import FaultLedger, Undo
from llmchaos.processes import Owner, pid_alive
from llmchaos.stack import cgroups
from llmchaos.stack.cleanup import find_stacks
from llmchaos.stack.procs import free_port
from llmchaos.targets.hosts import KIND, HostsSettings, HostsTarget, firewall
from llmchaos.targets.hosts import state as state_module
from llmchaos.targets.hosts.procs import group_members, listeners
from llmchaos.targets.hosts.state import STATE_FILE, TargetState, cleanup_dead, new_target_id
from tests.hosts.conftest import GPU_LOAD_S, write_hosts_file

Opener = Callable[..., HostsTarget]


def _wait(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def _rules_of(target_id: str) -> list[firewall.Rule]:
    return [r for r in firewall.tagged_rules() if r.target_id == target_id]


def _live_processes(state_dir: Path) -> list[int]:
    data = json.loads((state_dir / STATE_FILE).read_text())
    return [
        pid
        for record in data["processes"].values()
        for pid in group_members(record["pgid"], record["start_ticks"])
    ]


def assert_nothing_left(state_dir: Path) -> None:
    state = TargetState.load(state_dir)
    assert state is not None and state.data["status"] == "stopped"
    assert _live_processes(state_dir) == []
    assert _rules_of(state.target_id) == []
    assert cgroups.list_ours(f"hosts-{state.target_id}-") == []


@pytest.fixture
def open_target(tmp_path: Path) -> Iterator[Opener]:
    opened: list[HostsTarget] = []

    def open_(nginx: bool = False) -> HostsTarget:
        path = write_hosts_file(tmp_path / f"file{len(opened)}", nginx=nginx)
        settings = HostsSettings(file=str(path), state_root=str(tmp_path / "hosts"))
        target = KIND.open(settings, Owner.this_process("run", str(tmp_path)))
        assert isinstance(target, HostsTarget)
        opened.append(target)
        return target

    yield open_
    for target in opened:
        target.close()
        assert_nothing_left(target.state.state_dir)


def test_a_killed_server_is_restarted_like_a_kubelet_would(open_target: Opener) -> None:
    target = open_target()
    assert target.supervisor is not None
    before = target.supervisor.pid("gpu-0")
    assert target.healthy_workers("gpu") == 2
    reading = target.engine_readings()["gpu-0"]  # the worker speaks vLLM's names
    assert reading.queue == 0 and reading.running == 0 and reading.kv_cache == 0
    t0 = time.time()
    killed = target.kill_gpu_process("gpu-0")
    assert killed["pid"] == before and not pid_alive(before)
    assert killed["via"].startswith("server pid")  # no nvidia-smi on this machine
    verified = target.verify("kill_gpu_process", {"killed": [killed]})  # as the run keeps it
    assert verified.in_effect is True and "new pid" in verified.evidence, verified
    assert _wait(lambda: target.healthy_workers("gpu") == 2, 15 + GPU_LOAD_S)
    after = target.supervisor.pid("gpu-0")
    assert after is not None and after != before
    # the supervisor sees it ready on its next tick, maybe after this test's own look
    assert _wait(lambda: target.recovery_facts(t0)["recovered"], 5)  # type: ignore[index]
    (fact,) = target.recovery_facts(t0)["recovered"]  # type: ignore[index]
    assert fact["name"] == "gpu-0" and fact["node"] == "node-a" and fact["restarts"] == 1
    assert 0.3 <= fact["rescheduling_time_s"] < 3.0  # restart_delay_s 0.3 + the watch tick
    assert GPU_LOAD_S * 0.9 <= fact["readiness_time_s"] < GPU_LOAD_S + 10
    with pytest.raises(InvalidInput, match="no server named 'cpu-9'"):
        target.kill_gpu_process("cpu-9")


def test_a_hung_server_stops_answering_and_resumes(open_target: Opener) -> None:
    target = open_target()
    hung = target.hang_gpu_process("gpu-1")
    verified = target.verify("hang_gpu_process", hung)
    assert verified.in_effect is True and "state T" in verified.evidence, verified
    assert target.healthy_workers("gpu") == 1  # its port accepts, nothing answers
    target.resume_gpu_process("gpu-1")
    target.resume_gpu_process("gpu-1")  # idempotent
    assert _wait(lambda: target.healthy_workers("gpu") == 2, 5)
    # the same check once it runs again (a hang that did nothing) says so
    again = target.verify("hang_gpu_process", hung)
    assert again.in_effect is False and "state T" not in again.evidence, again


def test_a_partition_drops_both_ways_and_heals(open_target: Opener, needs_root: None) -> None:
    target = open_target()
    gpu0 = target.topology.server("gpu-0")
    target.partition_node("node-a")
    target.partition_node("node-a")  # idempotent: still one rule per direction
    rules = _rules_of(target.state.target_id)
    assert sorted(r.chain for r in rules) == ["INPUT", "OUTPUT"]
    assert all(r.node == "node-a" and r.owner and r.owner.alive() for r in rules)
    assert {r.owner.pid for r in rules if r.owner} == {os.getpid()}
    with pytest.raises(TimeoutError), socket.create_connection((gpu0.host, gpu0.port), 0.5):
        pass
    assert target.healthy_workers("gpu") == 1
    assert target.verify("partition_node", {"node": "node-a"}).in_effect is True
    # the check of a node without rules (a partition aimed at the wrong node) says so
    wrong = target.verify("partition_node", {"node": "node-b"})
    assert wrong.in_effect is False and "0 rules" in wrong.evidence, wrong
    target.heal_partition("node-a")
    target.heal_partition("node-a")
    assert _rules_of(target.state.target_id) == []
    assert target.healthy_workers("gpu") == 2
    # one way only: requests in are dropped, nothing on the way out
    target.partition_node("node-a", "ingress")
    assert [r.chain for r in _rules_of(target.state.target_id)] == ["INPUT"]
    assert target.verify("partition_node", {"node": "node-a"}).in_effect is True
    target.heal_partition("node-a")
    assert _rules_of(target.state.target_id) == []


def test_a_gateway_crash_kills_master_and_workers(open_target: Opener, needs_nginx: None) -> None:
    target = open_target(nginx=True)
    gateway = target.topology.gateway("gateway-primary")
    serving = listeners(gateway.port)
    assert len(serving) == 3  # nginx master + worker_processes 2 hold the socket
    crashed = target.crash_gateway("gateway-primary")
    # and any worker the master forked when it saw one die before its own SIGKILL landed
    assert set(serving) <= set(crashed["pids"])
    assert target.verify("crash_gateway", crashed).in_effect is True
    assert listeners(gateway.port) == [] and not any(pid_alive(p) for p in crashed["pids"])
    with pytest.raises(StackError, match="not running"):
        target.crash_gateway("gateway-primary")
    target.restore_gateway("gateway-primary")
    again = listeners(gateway.port)
    assert len(again) == 3 and not set(again) & set(serving)
    target.restore_gateway("gateway-primary")  # idempotent: it answers, nothing restarted
    assert listeners(gateway.port) == again


def _busy(url: str, seconds: float) -> int:
    """Completions sent to `url` one after the other for `seconds`: CPU for the server to
    want. Returns how many were answered."""
    body = json.dumps({"model": "llmchaos-7b", "prompt": "x " * 200, "max_tokens": 4}).encode()
    answered, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{url}/v1/completions", body, method="POST")
        request.add_header("Content-Type", "application/json")
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=10) as answer:
            answered += answer.status == 200
    return answered


def test_a_throttled_server_is_throttled_by_the_kernel_and_let_go(open_target: Opener) -> None:
    target = open_target()
    server = target.topology.server("gpu-0")
    pid = target.supervisor.pid("gpu-0") if target.supervisor else None
    assert pid is not None
    home = Path(f"/proc/{pid}/cgroup").read_text()
    # a whole CPU for an idle server: the kernel never throttles it (a fault that did nothing)
    idle = target.throttle_cpu("gpu-0", 100)
    assert idle["pids"][0] == pid and Path(idle["cgroup"]).name.startswith("llmc-hosts-")
    verified = target.verify("throttle_cpu", idle)
    assert verified.in_effect is False and "nr_throttled +0" in verified.evidence, verified
    # 1% of a CPU while it serves: throttled, slower, still serving. (At 5% it once went
    # unthrottled for 5 s while a 1,000 QPS chaos run held both cores: a server that gets
    # less than its quota from a saturated box is never throttled. At 2% a faster CPU served
    # these 8 clients within the quota: nr_throttled +0 over 49 periods, in CI.)
    throttled = target.throttle_cpu("gpu-0", 1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sent = [pool.submit(_busy, server.url, 8.0) for _ in range(8)]
        verified = target.verify("throttle_cpu", throttled)
        assert verified.in_effect is True, verified
        answered = sum(s.result() for s in sent)
    taken = target.requests_taken()  # from vLLM's own counter (the worker speaks its names)
    assert answered > 0 and taken is not None and taken["gpu-0"] >= answered, (answered, taken)
    assert taken["gpu-1"] == 0
    target.unthrottle_cpu("gpu-0")
    target.unthrottle_cpu("gpu-0")  # idempotent
    assert Path(f"/proc/{pid}/cgroup").read_text() == home  # back where it was
    assert cgroups.list_ours(f"hosts-{target.state.target_id}-") == []
    # under 1% the period grows (the kernel's quota floor is 1 ms), so 0.5% is not 1%
    half = target.throttle_cpu("gpu-1", 0.5)  # left in: close() lets it go (the fixture checks)
    assert (half["quota_us"], half["period_us"]) == (1000, 200_000), half
    group = Path(half["cgroup"])
    period = (
        (group / "cpu.max").read_text().split()[1]
        if half["cgroup_version"] == 2
        else (group / "cpu.cfs_period_us").read_text().strip()
    )
    assert period == "200000", period
    with pytest.raises(InvalidInput, match=r"oom_kill_worker: .* cannot do it: an OOM kill"):
        target.oom_kill_worker("gpu-1", 64, 64)


def _health_ms(url: str) -> float:
    """Median milliseconds of 5 fresh connections' GET of `url`."""
    took = []
    for _ in range(5):
        started = time.monotonic()
        with urllib.request.urlopen(url, timeout=5) as answer:
            answer.read()
        took.append(1000 * (time.monotonic() - started))
    return statistics.median(took)


def _verify_with_traffic(target: HostsTarget, details: dict[str, Any], url: str) -> Any:
    """The fault's check while requests go to `url` (its counters need packets)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_health_ms, url)
        return target.verify("degrade_network", details)


def test_loss_and_delay_on_a_nodes_ports(open_target: Opener, needs_root: None) -> None:
    target = open_target()
    slowed, other = (target.topology.server(n).url + "/health" for n in ("gpu-0", "gpu-1"))
    before_ms = _health_ms(slowed)
    delayed = target.degrade_network("node-a", 100, 20, 0, 0, "egress")
    # what node-a's server sends waits 80-120 ms: its SYN-ACK and its answer
    assert _health_ms(slowed) >= before_ms + 150
    assert _health_ms(other) < before_ms + 50  # node-b's port is not touched
    verified = _verify_with_traffic(target, delayed, slowed)
    assert verified.in_effect is True and "delayer pid" in verified.evidence, verified
    target.restore_network("node-a")
    target.restore_network("node-a")  # idempotent
    (pid,) = delayed["delayers"].values()
    assert not pid_alive(pid) and _rules_of(target.state.target_id) == []
    assert _health_ms(slowed) < before_ms + 50
    again = target.verify("degrade_network", delayed)  # a delay that is gone: not in effect
    assert again.in_effect is False and "no delay rule" in again.evidence, again
    lossy = target.degrade_network("node-b", 0, 0, 50, 0, "egress")  # half of it lost
    verified = _verify_with_traffic(target, lossy, other)
    assert verified.in_effect is True and "loss rules" in verified.evidence, verified
    with pytest.raises(InvalidInput, match=r"rate_kbit: .*loopback"):
        target.degrade_network("node-b", 0, 0, 0, 64, "egress")
    # left in: close() removes the rules (checked by the fixture)


def test_the_ledger_undoes_a_partition_and_a_crash(
    open_target: Opener, tmp_path: Path, needs_root: None, needs_nginx: None
) -> None:
    target = open_target(nginx=True)
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        target.partition_node("node-a")
    undo = Undo("restore_gateway", {"gateway": "gateway-primary"})
    with ledger.inject("crash_gateway", "gateway-primary", undo):
        target.crash_gateway("gateway-primary")
    lines = ledger.undo_all(lambda u: target.undo(u.op, u.args), by="rollback")
    assert len(lines) == 2 and all("undone by rollback" in line for line in lines), lines
    assert _rules_of(target.state.target_id) == []
    assert target.healthy_workers("gpu") == 2
    assert listeners(target.topology.gateway("gateway-primary").port)


_OWNER = """
import sys, time
from llmchaos.processes import Owner
from llmchaos.targets.hosts import KIND, HostsSettings
settings = HostsSettings(file=sys.argv[1], state_root=sys.argv[2])
target = KIND.open(settings, Owner.this_process("run"))
target.partition_node("node-a")
target.throttle_cpu("gpu-0", 50)
print(target.state.state_dir, flush=True)
time.sleep(300)
"""


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_cleanup_removes_what_a_killed_owner_left(tmp_path: Path, needs_root: None) -> None:
    path = write_hosts_file(tmp_path / "file", nginx=False)
    root = tmp_path / "hosts"
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(path), str(root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        state_dir = Path(owner.stdout.readline().strip())  # type: ignore[union-attr]
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        state = TargetState.load(state_dir)
        assert state is not None
        left = _live_processes(state_dir)
        assert len(left) == 2 and len(_rules_of(state.target_id)) == 2  # what kill -9 leaves
        (throttled,) = cgroups.list_ours(f"hosts-{state.target_id}-")
        # the embedded stacks' cleanup leaves it to the hosts target's
        stacks = find_stacks(tmp_path / "no-stacks").values()
        assert not any(str(throttled.path) in stack.cgroups for stack in stacks)
        lines = cleanup_dead(root)
        assert any("stopped processes" in line for line in lines), lines
        assert any("removed cgroup" in line for line in lines), lines
        assert sum("removed rule" in line for line in lines) == 2, lines
        assert_nothing_left(state_dir)
        assert cleanup_dead(root) == []
    finally:
        owner.kill()
        owner.wait()
        cleanup_dead(root)  # after a failure above: nothing of it left on the machine


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_cleanup_removes_an_empty_cgroup_whose_target_is_known_nowhere(
    tmp_path: Path, needs_root: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed mid-throttle, its state folder deleted since (a test's tmp_path), leaves
    an empty throttle cgroup that no state folder leads to: cleanup removes it once it is
    past its grace (a dry run only names it), and leaves alone a young one and one that
    holds a process (a live run's under another state root)."""
    if (reason := cgroups.support("cpu")) is not None:
        pytest.skip(f"no cpu cgroups here: {reason}")
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    target_ids = [new_target_id() for _ in sleepers]
    names = [f"{cgroups.CGROUP_PREFIX}hosts-{t}-gpu-0" for t in target_ids]
    try:
        stray = cgroups.create("cpu", names[0], sleepers[0].pid)
        live = cgroups.create("cpu", names[1], sleepers[1].pid)
        (stray.parent / "cgroup.procs").write_text(str(sleepers[0].pid))  # its server gone
        assert stray.exists and not stray.pids()
        assert cleanup_dead(tmp_path / "no-targets") == []  # young: maybe a run starting
        monkeypatch.setattr(state_module, "STRAY_CGROUP_GRACE_S", 0.0)
        would = cleanup_dead(tmp_path / "no-targets", dry_run=True)
        assert would == [
            f"hosts target {target_ids[0]}: would remove empty cgroup {stray.describe()}"
        ]
        assert stray.exists
        lines = cleanup_dead(tmp_path / "no-targets")
        assert lines == [f"hosts target {target_ids[0]}: removed empty cgroup {stray.describe()}"]
        assert not stray.exists and live.exists and live.pids() == [sleepers[1].pid]
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        for name in names:
            if (group := cgroups.find("cpu", name)) is not None:
                cgroups.remove(group)


@pytest.mark.solo  # a machine-wide cleanup: see tests/conftest.py
def test_llmchaos_cleanup_finishes_a_chaos_run_killed_during_a_partition(
    tmp_path: Path, needs_root: None
) -> None:
    path = write_hosts_file(tmp_path / "file", nginx=False)
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "LLMCHAOS_TARGET": "hosts",
        "LLMCHAOS_HOSTS_FILE": str(path),
        "LLMCHAOS_HOSTS_STATE_ROOT": str(tmp_path / "hosts"),
        "LLMCHAOS_RUNS_ROOT": str(runs),
        "LLMCHAOS_WARMUP_S": "3",
    }
    bin_dir = Path(sys.executable).parent
    chaos = subprocess.Popen(
        [
            str(bin_dir / "chaos"),
            "--log-file",
            str(tmp_path / "chaos.log"),
            "run",
            "--journal-path",
            str(tmp_path / "journal.json"),
            "experiments/node_partition.json",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait(
            lambda: any(
                r.node == "node-a"
                for r in firewall.tagged_rules()
                if r.owner and r.owner.pid == chaos.pid
            ),
            90,
        ), "no partition"
        chaos.send_signal(signal.SIGKILL)
        chaos.wait(timeout=10)
    finally:
        chaos.kill()
        chaos.wait()
    (run_dir,) = runs.glob("*/run.json")
    state_dir = Path(json.loads(run_dir.read_text())["target_record"]["hosts_state_dir"])
    assert _live_processes(state_dir) and _rules_of(TargetState.load(state_dir).target_id)  # type: ignore[union-attr]
    result = subprocess.run(
        [
            str(bin_dir / "llmchaos"),
            "cleanup",
            "--run",
            run_dir.parent.name,
            "--runs-root",
            str(runs),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "partition_node(node-a): undone by cleanup" in result.stdout, result.stdout
    assert_nothing_left(state_dir)
    assert json.loads(run_dir.read_text())["status"] == "abandoned"


def test_token_cache_keys_expire(tmp_path: Path) -> None:
    import redis

    port = free_port()
    extra = (
        f"redis:\n  url: redis://127.0.0.1:{port}/0\n  key_pattern: 'token:*'\n"
        f"  command: \"redis-server --port {port} --bind 127.0.0.1 --save '' --dir {{state}}\"\n"
    )
    path = write_hosts_file(tmp_path / "file", nginx=False, extra=extra)
    settings = HostsSettings(file=str(path), state_root=str(tmp_path / "hosts"))
    target = KIND.open(settings, Owner.this_process("run", str(tmp_path)))
    client = redis.Redis(port=port)
    try:
        client.mset({f"token:{i}": "tenant" for i in range(5)} | {"other": "x"})
        assert target.expire_token_cache(30) == 5
        assert 0 < client.pttl("token:0") <= 30_000 and client.ttl("other") == -1
        assert target.verify("expire_token_cache", {}).in_effect is True
        # the same check after keys left alone (an expiry that did nothing) says so
        client.mset({f"token:{i}": "tenant" for i in range(5)})
        client.expire("token:0", 600)
        target._token_snapshot = (30, {k: client.pttl(k) for k in client.keys("token:*")})
        untouched = target.verify("expire_token_cache", {})
        assert untouched.in_effect is False and "5 untouched" in untouched.evidence, untouched
        assert target.expire_token_cache(0) == 5
        assert client.keys("token:*") == [] and client.get("other") == b"x"
    finally:
        client.close()
        target.close()
    assert_nothing_left(target.state.state_dir)  # type: ignore[attr-defined]
