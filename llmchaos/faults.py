"""Faults of a chaos run: what the actions do. Each is written to the ledger before it acts,
and checked after it: the evidence that it took effect (or did not) is kept in the ledger,
and a fault not in effect fails the run (`ChaosRun.fault`).

Selectors are checked against the target's names before anything is touched (InvalidInput
names the argument and the known values). A fault with an undo gets one ledger entry per
thing it hits, so a half-done action is undone exactly as far as it went.
"""

from __future__ import annotations

import time
from typing import Any

from llmchaos.configuration import convert
from llmchaos.errors import InvalidInput
from llmchaos.ledger import FaultDetails, Undo, Verification
from llmchaos.run import ChaosRun
from llmchaos.settings import argument_ranges

__all__ = [
    "DIRECTIONS",
    "clear_gpu_fault",
    "crash_gateway",
    "degrade_network",
    "drain_node",
    "expire_token_cache",
    "gpu_errors",
    "hang_gpu_process",
    "heal_partition",
    "inject_burst",
    "kill_gpu_process",
    "kill_registry_member",
    "long_prompt_surge",
    "oom_kill_worker",
    "partition_node",
    "partition_registry_member",
    "registry_members",
    "restore_gateway",
    "restore_network",
    "restore_registry",
    "resume_gpu_process",
    "set_qps",
    "slow_gpu",
    "throttle_cpu",
    "unthrottle_cpu",
]

DIRECTIONS = ("both", "ingress", "egress")
"""Which traffic of a node a network fault hits: into it, out of it, or both (Chaos Mesh's
NetworkChaos `direction`: to, from, both)."""


def _check_supported(run: ChaosRun, fault: str) -> None:
    reason = run.target.info().unsupported.get(fault)
    if reason is not None:
        raise InvalidInput(f"{fault}: the {run.settings.target} target cannot do it: {reason}")


def _lift(run: ChaosRun, op: str, args: dict[str, Any]) -> None:
    """Run undo operation `op` now and close the ledger's faults it undoes (idempotent)."""
    run.target.undo(op, args)
    run.ledger.close_matching(Undo(op, args), by=op)


def _check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise InvalidInput(f"direction: expected one of {', '.join(DIRECTIONS)}, got {direction!r}")
    return direction


def kill_gpu_process(run: ChaosRun, worker: str = "", node: str = "") -> list[dict[str, Any]]:
    """SIGKILL the process holding the GPU of `worker` ("*" = every GPU worker) or of every
    GPU worker on `node`. Nothing to undo: the node agent (kubelet) restarts it. Returns
    [{"worker", "pid", ...}]."""
    names = run.target.info().gpu_workers(worker, node)
    killed = []
    with run.fault("kill_gpu_process", ",".join(names), None) as details:
        for name in names:
            killed.append(run.target.kill_gpu_process(name))
            details["killed"] = killed
    return killed


def partition_node(run: ChaosRun, node: str, direction: str = "both") -> str:
    """Drop the packets of `node` until heal_partition (or the run's end): both ways, or one
    way only (a partial partition: requests get in, answers never get out)."""
    info = run.target.info()
    real = info.node_name(node)
    _check_direction(direction)
    if not info.partitions_supported:
        raise InvalidInput(f"partition_node: needs {info.partitions_need}")
    undo = Undo("heal_partition", {"node": real})
    with run.fault("partition_node", real, undo) as details:
        run.target.partition_node(real, direction)
        details.update({"node": real, "direction": direction})
    return real


def heal_partition(run: ChaosRun, node: str) -> str:
    """Let `node`'s traffic through again (idempotent)."""
    real = run.target.info().node_name(node)
    _lift(run, "heal_partition", {"node": real})
    return real


def drain_node(run: ChaosRun, node: str) -> dict[str, Any]:
    """Cordon `node` and evict the stack's pods from it (a node taken for maintenance); it
    is uncordoned at the run's end, unless it was cordoned before the fault."""
    info = run.target.info()
    real = info.node_name(node)
    if not info.drains_supported:
        raise InvalidInput(f"drain_node: the {run.settings.target} target has no nodes to drain")
    undo = Undo("uncordon_node", {"node": real})
    with run.fault("drain_node", real, undo) as details:
        details.update(run.target.drain_node(real))
    if details.get("was_unschedulable"):
        run.ledger.close_matching(undo, by="nobody: it was cordoned before the fault")
    return dict(details)


def crash_gateway(run: ChaosRun, gateway: str = "primary") -> list[str]:
    """Kill gateway processes at once (SIGKILL): "primary", "all" or a gateway name. They stay
    down until restore_gateway (or the run's end). Returns the names."""
    names = run.target.info().gateway_names(gateway)
    for name in names:
        with run.fault("crash_gateway", name, Undo("restore_gateway", {"gateway": name})) as d:
            d.update(run.target.crash_gateway(name))
    return names


def restore_gateway(run: ChaosRun, gateway: str = "all") -> list[str]:
    """Start crashed gateways again and wait for them (idempotent)."""
    names = run.target.info().gateway_names(gateway)
    for name in names:
        undo = Undo("restore_gateway", {"gateway": name})
        run.target.restore_gateway(name)
        run.ledger.close_matching(undo, by="restore_gateway")
    return names


def expire_token_cache(run: ChaosRun, ttl_s: float = 0.0) -> int:
    """Delete every cached token (ttl_s = 0), or make them all expire in `ttl_s` seconds (the
    synchronized expiry of a fixed TTL after a mass token refresh). Nothing to undo: the
    cache refills. Returns the number of keys touched."""
    ttl_s = argument_ranges(run.settings)["ttl_s"].check("ttl_s", ttl_s)
    with run.fault("expire_token_cache", "token:*", None) as details:
        details["ttl_s"] = ttl_s
        details["keys"] = run.target.expire_token_cache(ttl_s)
    return int(details["keys"])


def set_qps(run: ChaosRun, qps: float) -> float:
    """Change the load's total rate from now on; undone (back to the previous rate) at the
    run's end. Returns the previous rate."""
    qps = argument_ranges(run.settings)["qps"].check("qps", qps)
    cap = run.max_qps()
    if cap is not None and qps > cap:
        run.notes.append(f"set_qps: {qps:g} asked, {cap:g} sent (the target's cap)")
        qps = cap
    previous = run.current_qps
    with run.fault(
        "set_qps",
        f"load {previous:g}->{qps:g} QPS",
        Undo("set_qps", {"qps": previous}),
        verify=lambda d: _rate_verification(run, d, previous, qps),
    ) as details:
        details["since_ts"] = time.time()
        run.traffic.set_qps(qps)
        run.current_qps = qps
    return previous


def inject_burst(run: ChaosRun, duration_s: float = 10.0, factor: float = 1.0) -> float:
    """One burst starting now: `factor` x the base rate on top for `duration_s` (ends by
    itself). Returns the extra QPS at the start."""
    ranges = argument_ranges(run.settings)
    duration_s = ranges["duration_s"].check("duration_s", duration_s)
    factor = ranges["factor"].check("factor", factor)
    base = run.current_qps
    with run.fault(
        "inject_burst",
        f"load x{1 + factor:g} for {duration_s:g} s",
        None,
        verify=lambda d: _rate_verification(run, d, base, base * (1 + factor)),
        lasts_s=duration_s,
    ) as details:
        details["since_ts"] = time.time()
        run.traffic.inject_burst(duration_s=duration_s, factor=factor)
    return base * factor


def registry_members(run: ChaosRun, member: str) -> list[str]:
    """The registry members `member` names: "leader" (the one leading now, asked of the
    registry), "all", or a member's name. Raises InvalidInput without a registry."""
    info = run.target.info()
    if member == "leader":
        info.registry_member_names("all")  # there is a registry at all
        return [run.target.registry_leader()]
    return info.registry_member_names(member)


def kill_registry_member(run: ChaosRun, member: str = "leader") -> list[dict[str, Any]]:
    """SIGKILL registry members ("leader", "all" or a name); each is started again from its
    data at the run's end (or by restore_registry). Returns [{"member", "pid"}]."""
    killed = []
    for name in registry_members(run, member):
        undo = Undo("restart_registry_member", {"member": name})
        with run.fault("kill_registry_member", name, undo) as details:
            details.update(run.target.kill_registry_member(name))
        killed.append(dict(details))
    return killed


def partition_registry_member(run: ChaosRun, member: str = "all") -> list[str]:
    """Drop every packet in and out of registry members ("leader", "all" or a name), peers
    and clients alike, until restore_registry (or the run's end). Returns the names."""
    names = registry_members(run, member)
    for name in names:
        undo = Undo("heal_registry_member", {"member": name})
        with run.fault("partition_registry_member", name, undo) as details:
            details["member"] = name
            run.target.partition_registry_member(name)
    return names


def restore_registry(run: ChaosRun, member: str = "all") -> list[str]:
    """Heal and restart registry members (idempotent); closes their faults."""
    names = run.target.info().registry_member_names(member)
    for name in names:
        run.target.heal_registry_member(name)
        run.ledger.close_matching(
            Undo("heal_registry_member", {"member": name}), by="restore_registry"
        )
    for name in names:
        run.target.restart_registry_member(name)
        run.ledger.close_matching(
            Undo("restart_registry_member", {"member": name}), by="restore_registry"
        )
    run.target.wait_registry_ready()
    return names


_RATE_CHECK_S = 2.0
"""Seconds of schedule a load fault is judged on (plus the load's report interval)."""
_REPORT_LAG_S = 1.5


def _rate_verification(
    run: ChaosRun, details: FaultDetails, before_qps: float, asked_qps: float
) -> Verification:
    """The load's own count of requests scheduled since the change: nearer the asked rate
    than the one before means it took effect."""
    since = float(details["since_ts"])
    time.sleep(max(0.0, since + _RATE_CHECK_S + _REPORT_LAG_S - time.time()))
    window = run.traffic.window(since_ts=since, until_ts=since + _RATE_CHECK_S)
    rate = window["scheduled"] / _RATE_CHECK_S
    evidence = (
        f"{window['scheduled']} requests scheduled in the {_RATE_CHECK_S:g} s after it: "
        f"{rate:.1f}/s (asked {asked_qps:g}/s, {before_qps:g}/s before)"
    )
    if asked_qps == before_qps:
        return Verification(True, evidence + "; the rate did not change")
    return Verification(abs(rate - asked_qps) < abs(rate - before_qps), evidence)


def hang_gpu_process(
    run: ChaosRun, worker: str = "", node: str = "", hold_s: float = 0.0
) -> list[dict[str, Any]]:
    """SIGSTOP the process holding the GPU of `worker` (or of each GPU worker on `node`): a
    hung GPU process whose port still accepts connections and never answers, as NVIDIA
    Dynamo's fault-tolerance tests stall processes. Resumed (SIGCONT) by resume_gpu_process
    or at the run's end. `hold_s`: a recovery counts only once its stable run outlasts this
    much of the hang (the fault's `lasts_s`): a gateway that ejects the hung worker for a
    while and then gives it its turn again relapses only when the ejection ends, which can
    be after a short stable run. Returns [{"worker", "pid", ...}]."""
    _check_supported(run, "hang_gpu_process")
    hold_s = argument_ranges(run.settings)["hold_s"].check("hold_s", hold_s)
    hung = []
    for name in run.target.info().gpu_workers(worker, node):
        undo = Undo("resume_gpu_process", {"worker": name})
        with run.fault("hang_gpu_process", name, undo, lasts_s=hold_s) as d:
            d.update(run.target.hang_gpu_process(name))
        hung.append(dict(d))
    return hung


def resume_gpu_process(run: ChaosRun, worker: str = "", node: str = "") -> list[str]:
    """SIGCONT what hang_gpu_process stopped (idempotent)."""
    names = run.target.info().gpu_workers(worker, node)
    for name in names:
        _lift(run, "resume_gpu_process", {"worker": name})
    return names


def gpu_errors(run: ChaosRun, worker: str, xid: int = 79) -> dict[str, Any]:
    """Make `worker`'s GPU fail while its process stays healthy, as after an Xid error (79:
    fallen off the bus, 48: double-bit ECC, 94/95: contained/uncontained ECC): health checks
    still answer 200, plain requests get 500, streams break after their first token. Until
    clear_gpu_fault or the run's end."""
    _check_supported(run, "gpu_errors")
    xid = int(argument_ranges(run.settings)["xid"].check("xid", xid))
    (name,) = run.target.info().gpu_workers(worker, "")
    with run.fault("gpu_errors", name, Undo("clear_gpu_fault", {"worker": name})) as details:
        details.update(run.target.gpu_errors(name, xid))
    return dict(details)


def slow_gpu(run: ChaosRun, worker: str, slowdown: float = 10.0) -> dict[str, Any]:
    """Make every engine step of `worker` `slowdown` times slower, without any error (a GPU
    clocked down by a thermal or power brake). Until clear_gpu_fault or the run's end."""
    _check_supported(run, "slow_gpu")
    slowdown = argument_ranges(run.settings)["slowdown"].check("slowdown", slowdown)
    (name,) = run.target.info().gpu_workers(worker, "")
    with run.fault("slow_gpu", name, Undo("clear_gpu_fault", {"worker": name})) as details:
        details.update(run.target.slow_gpu(name, slowdown))
    return dict(details)


def clear_gpu_fault(run: ChaosRun, worker: str) -> str:
    """End gpu_errors or slow_gpu on `worker` (idempotent)."""
    (name,) = run.target.info().gpu_workers(worker, "")
    _lift(run, "clear_gpu_fault", {"worker": name})
    return name


def throttle_cpu(
    run: ChaosRun, part: str, cpu_percent: float = 5.0, hold_s: float = 0.0
) -> dict[str, Any]:
    """Cap `part` (a worker or a gateway) at `cpu_percent` of one CPU with the kernel's CFS
    bandwidth control: a noisy neighbour or a tight CPU limit, which shows as jitter. The
    throttling counters (nr_throttled, throttled_usec) are its evidence. Until
    unthrottle_cpu or the run's end. `hold_s`: a recovery counts only once its stable run
    outlasts this much of the throttle (the fault's `lasts_s`): a throttled worker's backlog
    can take longer than the stable run to show (a fleet of 33 GPUs, 2026-12-06: the SLO
    held 13 s after the throttle, then missed for 11)."""
    _check_supported(run, "throttle_cpu")
    ranges = argument_ranges(run.settings)
    percent = ranges["cpu_percent"].check("cpu_percent", cpu_percent)
    hold_s = ranges["hold_s"].check("hold_s", hold_s)
    name = run.target.info().part_name(part)
    undo = Undo("unthrottle_cpu", {"part": name})
    with run.fault("throttle_cpu", name, undo, lasts_s=hold_s) as details:
        details.update(run.target.throttle_cpu(name, percent))
    return dict(details)


def unthrottle_cpu(run: ChaosRun, part: str) -> str:
    """Lift throttle_cpu (idempotent)."""
    name = run.target.info().part_name(part)
    _lift(run, "unthrottle_cpu", {"part": name})
    return name


def oom_kill_worker(
    run: ChaosRun, worker: str, limit_mib: float = 64.0, grow_mib_s: float = 64.0
) -> dict[str, Any]:
    """Give `worker`'s process a memory limit of `limit_mib` while it grows by `grow_mib_s`
    a second (a leak, or host memory that grows with load), until the kernel's OOM killer
    kills it: no signal comes from llmchaos. Its node agent (kubelet) restarts it. The limit
    is removed at the run's end."""
    _check_supported(run, "oom_kill_worker")
    ranges = argument_ranges(run.settings)
    limit = ranges["limit_mib"].check("limit_mib", limit_mib)
    grow = ranges["grow_mib_s"].check("grow_mib_s", grow_mib_s)
    (name,) = run.target.info().gpu_workers(worker, "")
    with run.fault("oom_kill_worker", name, Undo("unlimit_memory", {"worker": name})) as d:
        d.update(run.target.oom_kill_worker(name, limit, grow))
    return dict(d)


def degrade_network(
    run: ChaosRun,
    node: str,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss_percent: float = 0.0,
    rate_kbit: float = 0.0,
    direction: str = "egress",
) -> dict[str, Any]:
    """Latency (`delay_ms` +- `jitter_ms`, tc netem), random loss of `loss_percent` of the
    packets and a bandwidth cap of `rate_kbit` (tc tbf) on `node`'s link, in `direction`
    (egress: what leaves the node, Chaos Mesh's default). Until restore_network or the run's
    end."""
    _check_supported(run, "degrade_network")
    ranges = argument_ranges(run.settings)
    numbers = {
        name: ranges[name].check(name, value)
        for name, value in (
            ("delay_ms", delay_ms),
            ("jitter_ms", jitter_ms),
            ("loss_percent", loss_percent),
            ("rate_kbit", rate_kbit),
        )
    }
    if not any(numbers.values()):
        raise InvalidInput(
            "degrade_network: give at least one of delay_ms, loss_percent, rate_kbit above 0"
        )
    if numbers["jitter_ms"] and not numbers["delay_ms"]:
        raise InvalidInput("jitter_ms: needs delay_ms above 0 (jitter is around the delay)")
    _check_direction(direction)
    info = run.target.info()
    real = info.node_name(node)
    if refused := info.refused_argument("degrade_network", numbers):
        raise InvalidInput(refused)
    with run.fault("degrade_network", real, Undo("restore_network", {"node": real})) as details:
        details.update(
            run.target.degrade_network(
                real,
                numbers["delay_ms"],
                numbers["jitter_ms"],
                numbers["loss_percent"],
                numbers["rate_kbit"],
                direction,
            )
        )
    return dict(details)


def restore_network(run: ChaosRun, node: str) -> str:
    """Lift degrade_network (idempotent)."""
    real = run.target.info().node_name(node)
    _lift(run, "restore_network", {"node": real})
    return real


def long_prompt_surge(
    run: ChaosRun,
    qps: float | None = None,
    duration_s: float = 15.0,
    prompt_tokens: float = 6000,
    max_tokens: float = 200,
    qps_per_gpu: float | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """A surge of long prompts from one tenant beside the load (`qps` requests a second of
    `prompt_tokens` prompt tokens and `max_tokens` output for `duration_s`), which fills
    the engines' KV cache: preemptions and queue growth. `qps_per_gpu` instead of `qps`:
    that many per GPU worker of the target, so the pressure per engine is the same on a
    fleet of any size; neither: 4 a second. `stream`: streamed answers (llmchaos.surge says
    why a long answer wants it). The load's SLO is judged as usual; the surge's
    own answers are not part of it. Stops by itself, or at the run's end."""
    if qps is not None and qps_per_gpu is not None:
        raise InvalidInput(
            f"long_prompt_surge: give qps ({qps!r}) or qps_per_gpu ({qps_per_gpu!r}), not both"
        )
    ranges = argument_ranges(run.settings)
    if qps_per_gpu is not None:
        per_gpu = ranges["qps"].check("qps_per_gpu", qps_per_gpu)
        qps = per_gpu * run.target.info().gpu_count
    qps = ranges["qps"].check("qps", 4.0 if qps is None else qps)
    duration_s = ranges["duration_s"].check("duration_s", duration_s)
    prompt = int(ranges["prompt_tokens"].check("prompt_tokens", prompt_tokens))
    output = int(ranges["max_tokens"].check("max_tokens", max_tokens))
    streamed = convert(bool, stream, "stream")
    before = run.target.engine_stats()
    with run.fault(
        "long_prompt_surge",
        f"{qps:g} long prompts/s for {duration_s:g} s",
        Undo("stop_surge", {}),
        verify=lambda d: _kv_pressure_verification(run, before, duration_s),
        lasts_s=duration_s,
    ) as details:
        started = run.start_surge(details.fault_id, qps, duration_s, prompt, output, streamed)
        details.update(started)
    return dict(details)


_KV_RISE = 0.2
"""KV-cache usage rise (of the fullest engine) that counts as pressure."""


def _kv_pressure_verification(
    run: ChaosRun, before: dict[str, float] | None, duration_s: float
) -> Verification:
    """The engines' own metrics: KV-cache usage up by _KV_RISE or preemptions since, at any
    time during the surge. Its long answers hold their KV cache 10-15 s, so an engine's usage
    is still rising 10 s in; the watch costs no time, since the recovery probe waits for the
    surge's end anyway."""
    if before is None:
        return Verification(None, "the target cannot read its engines' KV-cache metrics")
    deadline = time.time() + duration_s
    peak = before["kv_cache_usage_max"]
    while True:
        now = run.target.engine_stats() or before
        peak = max(peak, now["kv_cache_usage_max"])
        preempted = now["preemptions_total"] - before["preemptions_total"]
        evidence = (
            f"KV cache {before['kv_cache_usage_max']:.0%} -> peak {peak:.0%} (fullest engine), "
            f"{preempted:g} preemptions, {now['waiting']:g} waiting"
        )
        if peak - before["kv_cache_usage_max"] >= _KV_RISE or preempted > 0:
            return Verification(True, evidence)
        if time.time() >= deadline:
            return Verification(False, evidence + f" after {duration_s:g} s")
        time.sleep(0.5)
