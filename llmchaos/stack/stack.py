"""Start and stop the embedded reference serving stack.

    start_stack(StackConfig()) -> Topology      # Redis, token DB, nodes, agents, workers,
                                                #  gateways, HAProxy; each waited for
    stop_stack(topology)                        # all of it, and only it

`start_stack` removes whatever it had started when a step fails or it is interrupted, so a
failed `up` leaves nothing behind. Processes are found again by their `LLMCHAOS_STACK` marker
and namespaces and veth links by the stack's short id in their names, never from a list kept
in memory (a signal can come between creating a thing and noting it), so the teardown and
`stop_stack` also catch restarted workers and stray children. Every stack has an owner
(`owner.json`, written before anything starts): the chaos run it belongs to, or the user for
`llmchaos stack up`; `llmchaos cleanup` judges by it.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from llmchaos.errors import InvalidInput, StackError
from llmchaos.processes import Owner, allow_open_files, pid_alive
from llmchaos.signals import deferred, held
from llmchaos.stack import etcd, netns
from llmchaos.stack.agent import AgentSettings, AgentWorker
from llmchaos.stack.autoscaler import AutoscalerSettings, ScaledWorker
from llmchaos.stack.cleanup import leftovers, remove_leftovers
from llmchaos.stack.config import StackConfig, get_variant
from llmchaos.stack.procs import (
    free_port,
    http_get_status,
    port_in_use,
    spawn,
    stop_pids,
    stop_stack_processes,
    wait_until,
)
from llmchaos.stack.registrar import RegistrarSettings
from llmchaos.stack.registry import MEMBERS, find_etcd, plan_members, start_member, wait_ready
from llmchaos.stack.services import (
    STACK_OPEN_FILES,
    HaproxyServer,
    haproxy_config,
    require_binary,
    start_haproxy,
    start_redis,
)
from llmchaos.stack.settings import (
    CPU_PROFILE,
    GPU_PROFILE,
    REDIS_PASSWORD_ENV,
    DegradationSettings,
    DiscoverySettings,
    GatewaySettings,
    UpstreamWorker,
    WorkerSettings,
    load_settings,
    write_settings,
)
from llmchaos.stack.tokendb import seed_token_db
from llmchaos.stack.topology import (
    CURRENT_FILE,
    GatewayInfo,
    NodeInfo,
    RegistryInfo,
    StackSecrets,
    Topology,
    WorkerInfo,
    read_agent_state,
    read_owner,
    read_secrets,
    write_owner,
    write_replicas,
    write_secrets,
)

__all__ = [
    "WORKER_PORT",
    "gateway_layout",
    "live_status",
    "node_layout",
    "node_name",
    "restart_gateway",
    "start_gateway",
    "start_stack",
    "stop_stack",
    "use_netns",
]

WORKER_PORT = 8000
"""Port of every worker inside its own namespace (loopback mode picks free ports instead)."""


def use_netns(config: StackConfig) -> bool:
    """Whether nodes will be namespaces; raises InvalidInput for `on` where it cannot work."""
    reason = netns.check_netns_support()
    if config.netns == "on" and reason is not None:
        raise InvalidInput(f"--netns on: {reason}")
    return config.netns != "off" and reason is None


def _preflight(config: StackConfig) -> bool:
    get_variant(config.variant)
    require_binary("redis-server")
    require_binary("haproxy")
    if config.discovery == "etcd":
        find_etcd()
    with_netns = use_netns(config)
    if config.port and port_in_use(config.port):
        raise InvalidInput(
            f"--port {config.port}: already in use on 127.0.0.1 (another stack? see "
            "`llmchaos stack status`); choose another port or --port 0"
        )
    return with_netns


def _new_stack_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def start_stack(
    config: StackConfig, *, progress: bool = False, owner: Owner | None = None
) -> Topology:
    """Start the whole stack and wait until HAProxy serves through a gateway.

    `owner`: whom the stack belongs to (default: the user, as after `llmchaos stack up`).
    Raises InvalidInput before starting anything when the config cannot work here, and
    ComponentNotReady/StackError (after tearing down what was started) when a part fails.
    A KeyboardInterrupt (SIGINT, SIGTERM) tears down too, and further signals wait for that.
    """
    with_netns = _preflight(config)
    allow_open_files(STACK_OPEN_FILES)
    owner = owner or Owner.this_process("user")
    stack_id = _new_stack_id()
    state_dir = (Path(config.state_root) / stack_id).resolve()
    (state_dir / "logs").mkdir(parents=True)
    write_owner(state_dir, owner)
    say = _progress(progress)
    try:
        topology = _start(config, stack_id, owner, state_dir, with_netns, say)
        topology.save()
    except BaseException:
        with held("removing what was started", say):
            say("start failed: removing what was started")
            _teardown(stack_id)
        raise
    (Path(config.state_root) / CURRENT_FILE).write_text(stack_id + "\n")
    return topology


def _progress(enabled: bool) -> Callable[[str], None]:
    started = time.monotonic()

    def say(message: str) -> None:
        if enabled:
            print(f"[{time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def _start(
    config: StackConfig,
    stack_id: str,
    owner: Owner,
    state_dir: Path,
    with_netns: bool,
    say: Callable[[str], None],
) -> Topology:
    variant = get_variant(config.variant)
    logs = state_dir / "logs"

    redis_port = free_port()
    password = secrets.token_urlsafe(18)
    write_secrets(state_dir, StackSecrets(redis_password=password))
    redis = start_redis(state_dir, redis_port, stack_id, owner, password)
    wait_until(
        "redis-server",
        lambda: _redis_ping(redis_port, password),
        config.ready_timeout_s,
        process=redis,
        log_path=logs / "redis.log",
    )
    say(f"redis-server ready on 127.0.0.1:{redis_port}")

    token_db, tokens_file = state_dir / "tokens.sqlite", state_dir / "tokens.json"
    records = seed_token_db(
        token_db,
        tokens_file,
        tenants=config.tenants,
        tokens_per_tenant=config.tokens_per_tenant,
        revoked=config.revoked_tokens,
    )
    say(f"token table seeded: {len(records)} tokens, {config.tenants} tenants -> {tokens_file}")

    replicas_path = (
        write_replicas(state_dir, {"gpu": config.autoscale_min_replicas})
        if config.autoscale
        else None
    )
    subnet = netns.pick_subnet() if with_netns else None
    registry = None
    if config.discovery == "etcd":
        registry = _start_registry(config, stack_id, owner, state_dir, subnet)
        say("registry ready: " + ", ".join(f"{m.name} {m.client_url}" for m in registry.members))
    nodes = _start_nodes(config, stack_id, owner, state_dir, subnet, replicas_path)
    for node in nodes:
        for worker in node.workers:
            if replicas_path is not None and _ordinal(worker) >= config.autoscale_min_replicas:
                continue  # a replica slot the autoscaler has not asked for (yet)
            wait_until(
                f"worker {worker.name} on {node.name}",
                lambda w=worker: http_get_status(f"{w.url}/healthz", 0.5) == 200,
                config.ready_timeout_s,
                log_path=Path(worker.log_path),
            )
    say("workers ready: " + ", ".join(f"{w.name}@{n.name}" for n in nodes for w in n.workers))

    upstreams = tuple(
        UpstreamWorker(w.name, w.url, w.mode, node=n.name) for n in nodes for w in n.workers
    )
    discovery = DiscoverySettings()
    if registry is not None:
        registry = _start_registrar(config, registry, upstreams, state_dir, stack_id, owner)
        expected = sum(
            1
            for n in nodes
            for w in n.workers
            if replicas_path is None or _ordinal(w) < config.autoscale_min_replicas
        )
        _wait_registered(registry, expected, config.ready_timeout_s)
        say(f"registrar ready: {expected} worker(s) under {registry.prefix}")
        discovery = DiscoverySettings(
            endpoints=tuple(m.client_url for m in registry.members), prefix=registry.prefix
        )
    base = GatewaySettings(
        models=(config.model,),
        workers=() if registry is not None else upstreams,
        discovery=discovery,
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        token_db_path=str(token_db),
        token_db_latency_ms=config.token_db_latency_ms,
        token_db_pool_size=config.token_db_pool_size,
        queue_shed_threshold=config.queue_shed_threshold,
        first_byte_timeout_s=config.gateway_first_byte_timeout_s,
        stream_idle_timeout_s=config.gateway_read_timeout_s,
        hedge_after_s=config.gateway_hedge_after_s,
        degradation=DegradationSettings(
            queue_depth_threshold=config.degradation_queue_threshold,
            latency_for_s=config.degradation_latency_for_s,
        ),
    )
    gateways, waits, ports = [], [], set()
    for name, role in gateway_layout(config):
        # the ports are picked before any gateway binds one: never the same twice
        port = free_port()
        while port in ports:
            port = free_port()
        ports.add(port)
        settings = replace(variant.gateway_settings(base), name=name, port=port)
        gateway, wait = start_gateway(
            settings, role, state_dir, stack_id, owner, config.ready_timeout_s
        )
        gateways.append(gateway)
        waits.append(wait)
    for wait in waits:
        wait()
    say("gateways ready: " + ", ".join(f"{g.name} {g.url}" for g in gateways))

    port = config.port or free_port()
    stats_port = free_port()
    config_path = state_dir / "haproxy.cfg"
    servers = [
        HaproxyServer(g.name, g.url.removeprefix("http://"), g.role == "backup") for g in gateways
    ]
    config_path.write_text(haproxy_config(port, servers, stats_port))
    haproxy = start_haproxy(config_path, state_dir, stack_id, owner)
    gateway_url = f"http://127.0.0.1:{port}"
    wait_until(
        "haproxy",
        lambda: http_get_status(f"{gateway_url}/healthz", 0.5) == 200,
        config.ready_timeout_s,
        process=haproxy,
        log_path=logs / "haproxy.log",
    )
    say(f"haproxy ready: {gateway_url}")

    autoscaler_pid = None
    if replicas_path is not None and variant.autoscaler:
        autoscaler_pid = _start_autoscaler(config, nodes, replicas_path, stack_id, owner).pid
        say(
            f"autoscaler: gpu {config.autoscale_min_replicas}..{config.gpu_workers} replicas, "
            f"target {config.autoscale_target_utilization:.0%}, every {config.autoscale_sync_s:g} s"
        )

    return Topology(
        stack_id=stack_id,
        state_dir=str(state_dir),
        created_at=time.time(),
        variant=variant.name,
        status="running",
        gateway_url=gateway_url,
        model=config.model,
        tokens_file=str(tokens_file),
        token_db=str(token_db),
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        redis_pid=redis.pid,
        haproxy_pid=haproxy.pid,
        haproxy_config=str(config_path),
        haproxy_stats_port=stats_port,
        nodes=tuple(nodes),
        gateways=tuple(gateways),
        replicas_path=None if replicas_path is None else str(replicas_path),
        autoscaler_pid=autoscaler_pid,
        registry=registry,
    )


def _start_registry(
    config: StackConfig,
    stack_id: str,
    owner: Owner,
    state_dir: Path,
    subnet: ipaddress.IPv4Network | None,
) -> RegistryInfo:
    """A 3-member etcd cluster, each member in a namespace of its own when nodes are."""
    binary = find_etcd()
    network = None
    if subnet is not None:
        with deferred():  # whole or not at all: the teardown finds it by name
            network = netns.create_registry_network(stack_id[-4:], MEMBERS, subnet)
    members = plan_members(state_dir, network)
    token = f"llmchaos-{stack_id}"
    started = []
    for member in members:
        pid = start_member(
            member, members, binary=binary, token=token, stack_id=stack_id, owner=owner
        )
        started.append(replace(member, pid=pid))
    wait_ready(tuple(started), config.ready_timeout_s)
    return RegistryInfo(
        members=tuple(started),
        prefix=f"/llmchaos/{stack_id}/workers/",
        cluster_token=token,
        binary=binary,
    )


def _start_registrar(
    config: StackConfig,
    registry: RegistryInfo,
    upstreams: tuple[UpstreamWorker, ...],
    state_dir: Path,
    stack_id: str,
    owner: Owner,
) -> RegistryInfo:
    settings = RegistrarSettings(
        endpoints=tuple(m.client_url for m in registry.members),
        prefix=registry.prefix,
        workers=upstreams,
    )
    path = write_settings(settings, state_dir / "registrar.json")
    argv = [sys.executable, "-m", "llmchaos.stack.registrar", "--settings", str(path)]
    log_path = state_dir / "logs" / "registrar.log"
    process = spawn(argv, stack_id=stack_id, owner=owner, log_path=log_path)
    return replace(registry, registrar_pid=process.pid)


def _wait_registered(registry: RegistryInfo, expected: int, timeout_s: float) -> None:
    """Until the registry lists `expected` workers (the registrar's first rounds)."""
    body = etcd.prefix_range(registry.prefix)

    def listed() -> bool:
        for member in registry.members:
            try:
                answer = etcd.call(member.client_url, "/v3/kv/range", body, 0.5)
            except StackError:
                continue
            return len(etcd.endpoints_of(answer)) >= expected
        return False

    wait_until(f"{expected} worker(s) in the registry", listed, timeout_s)


def _ordinal(worker: WorkerInfo) -> int:
    """A GPU worker's index in its pool (gpu-3 -> 3)."""
    return int(worker.name.rsplit("-", 1)[1])


def _start_autoscaler(
    config: StackConfig,
    nodes: list[NodeInfo],
    replicas_path: Path,
    stack_id: str,
    owner: Owner,
) -> subprocess.Popen[bytes]:
    state_dir = replicas_path.parent
    gpus = sorted((w for n in nodes for w in n.workers if w.mode == "gpu"), key=_ordinal)
    settings = AutoscalerSettings(
        replicas_path=str(replicas_path),
        state_path=str(state_dir / "autoscaler-state.json"),
        workers=tuple(ScaledWorker(w.name, f"{w.url}/healthz") for w in gpus),
        min_replicas=config.autoscale_min_replicas,
        max_replicas=config.gpu_workers,
        target_utilization=config.autoscale_target_utilization,
        sync_period_s=config.autoscale_sync_s,
        scale_down_window_s=config.autoscale_scale_down_window_s,
        policy_period_s=config.autoscale_policy_period_s,
    )
    path = write_settings(settings, state_dir / "autoscaler.json")
    argv = [sys.executable, "-m", "llmchaos.stack.autoscaler", "--settings", str(path)]
    log_path = state_dir / "logs" / "autoscaler.log"
    return spawn(argv, stack_id=stack_id, owner=owner, log_path=log_path)


def node_name(index: int) -> str:
    """node-a .. node-z, then node-aa, node-ab, ... (32 GPUs one per node make 33 nodes)."""
    letters = ""
    index += 1
    while index:
        index, digit = divmod(index - 1, 26)
        letters = chr(ord("a") + digit) + letters
    return f"node-{letters}"


def node_layout(config: StackConfig) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(node, [(worker, mode), ...]), ...]: `gpus_per_node` GPU workers per node, numbered
    across nodes (node-a: gpu-0, gpu-1; node-b: gpu-2, ...), then the CPU node.

    Known before anything starts, so experiments can be checked against it first."""
    k = config.gpus_per_node
    gpus = [f"gpu-{i}" for i in range(config.gpu_workers)]
    layout = [
        (node_name(n), [(name, "gpu") for name in gpus[n * k : (n + 1) * k]])
        for n in range(math.ceil(len(gpus) / k))
    ]
    if config.cpu_workers:
        cpu_node = node_name(len(layout))
        layout.append((cpu_node, [(f"cpu-{i}", "cpu") for i in range(config.cpu_workers)]))
    return layout


def gateway_layout(config: StackConfig) -> list[tuple[str, str]]:
    """[(gateway, role), ...]: the active ones (role primary: gateway-primary,
    gateway-primary-2, ...), then the variant's backup."""
    active = [
        ("gateway-primary" if i == 1 else f"gateway-primary-{i}", "primary")
        for i in range(1, config.active_gateways + 1)
    ]
    backup = [("gateway-backup", "backup")] if get_variant(config.variant).backup_gateway else []
    return active + backup


def _start_nodes(
    config: StackConfig,
    stack_id: str,
    owner: Owner,
    state_dir: Path,
    subnet: ipaddress.IPv4Network | None,
    replicas_path: Path | None = None,
) -> list[NodeInfo]:
    variant = get_variant(config.variant)
    short_id = stack_id[-4:]
    nodes = []
    for index, (node, workers) in enumerate(node_layout(config)):
        net = None
        if subnet is not None:
            with deferred():  # whole or not at all: the teardown finds it by name
                net = netns.create_node_network(short_id, index, node, subnet)
        address = net.address if net else "127.0.0.1"
        infos = []
        for worker_index, (name, mode) in enumerate(workers):
            port = WORKER_PORT + worker_index if net else free_port()
            base = variant.gpu_profile(GPU_PROFILE) if mode == "gpu" else CPU_PROFILE
            if mode == "gpu" and config.gpu_max_num_seqs is not None:
                base = replace(base, max_num_seqs=config.gpu_max_num_seqs)
            load_s = config.gpu_load_s if mode == "gpu" else config.cpu_load_s
            settings = WorkerSettings(
                name=name,
                node=node,
                host=address,
                port=port,
                model=config.model,
                gpu_index=worker_index if mode == "gpu" else 0,
                profile=replace(
                    base,
                    load_s=load_s,
                    first_load_s=None
                    if config.first_load_s is None
                    else min(config.first_load_s, load_s),
                ),
            )
            settings_path = write_settings(settings, state_dir / f"worker-{name}.json")
            infos.append(
                WorkerInfo(
                    name=name,
                    mode=settings.profile.mode,
                    node=node,
                    url=f"http://{address}:{port}",
                    settings_path=str(settings_path),
                    log_path=str(state_dir / "logs" / f"worker-{name}.log"),
                )
            )
        agent_settings = AgentSettings(
            node=node,
            state_path=str(state_dir / f"agent-{node}.state.json"),
            restart_delay_s=config.restart_delay_s,
            workers=tuple(
                AgentWorker(
                    w.name,
                    w.settings_path,
                    w.log_path,
                    f"{w.url}/healthz",
                    pool="gpu" if replicas_path is not None and w.mode == "gpu" else "",
                    ordinal=_ordinal(w) if w.mode == "gpu" else 0,
                )
                for w in infos
            ),
            replicas_path="" if replicas_path is None else str(replicas_path),
        )
        agent_path = write_settings(agent_settings, state_dir / f"agent-{node}.json")
        argv = [sys.executable, "-m", "llmchaos.stack.agent", "--settings", str(agent_path)]
        if net is not None:
            argv = ["ip", "netns", "exec", net.netns, *argv]
        agent = spawn(
            argv, stack_id=stack_id, owner=owner, log_path=state_dir / "logs" / f"agent-{node}.log"
        )
        nodes.append(
            NodeInfo(
                name=node,
                address=address,
                netns=net.netns if net else None,
                veth_host=net.veth_host if net else None,
                agent_pid=agent.pid,
                agent_state_path=agent_settings.state_path,
                workers=tuple(infos),
            )
        )
    return nodes


def start_gateway(
    settings: GatewaySettings,
    role: str,
    state_dir: Path,
    stack_id: str,
    owner: Owner,
    timeout_s: float,
) -> tuple[GatewayInfo, Callable[[], None]]:
    """Start one gateway process from `settings`; returns it and the wait for its /healthz,
    to call before using it (a fleet's gateways start side by side: each takes a third of a
    second to come up)."""
    settings_path = write_settings(settings, state_dir / f"{settings.name}.json")
    log_path = state_dir / "logs" / f"{settings.name}.log"
    argv = [sys.executable, "-m", "llmchaos.stack.gateway", "--settings", str(settings_path)]
    # the Redis password travels in the environment, never in the settings file
    env = {REDIS_PASSWORD_ENV: read_secrets(state_dir).redis_password}
    proc = spawn(argv, stack_id=stack_id, owner=owner, log_path=log_path, env=env)
    url = f"http://{settings.host}:{settings.port}"

    def wait() -> None:
        wait_until(
            settings.name,
            lambda: http_get_status(f"{url}/healthz", 0.5) == 200,
            timeout_s,
            process=proc,
            log_path=log_path,
        )

    gateway = GatewayInfo(settings.name, role, url, proc.pid, str(settings_path), str(log_path))
    return gateway, wait


def restart_gateway(topology: Topology, name: str, timeout_s: float = 30.0) -> Topology:
    """Start gateway `name` again from its settings (same port) if it is not running, wait for
    it, and save and return the updated topology. Raises InvalidInput for an unknown name."""

    names = [g.name for g in topology.gateways]
    if name not in names:
        raise InvalidInput(f"unknown gateway {name!r}; gateways: {', '.join(names)}")
    index = names.index(name)
    gateway = topology.gateways[index]
    if pid_alive(gateway.pid):
        return topology
    settings = load_settings(GatewaySettings, Path(gateway.settings_path))
    state_dir = Path(topology.state_dir)
    owner = read_owner(state_dir) or Owner.this_process("user")
    restarted, wait = start_gateway(
        settings, gateway.role, state_dir, topology.stack_id, owner, timeout_s
    )
    wait()
    gateways = list(topology.gateways)
    gateways[index] = restarted
    updated = replace(topology, gateways=tuple(gateways))
    updated.save()
    return updated


def _redis_ping(port: int, password: str) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _teardown(stack_id: str) -> None:
    """Everything of `stack_id` there is now, found by its marks and names."""
    remove_leftovers(leftovers(stack_id))


def stop_stack(topology: Topology, grace_s: float = 3.0) -> list[int]:
    """Stop everything of `topology`: front first, so no new requests arrive at half a stack.

    Returns the pids that were still running. Safe to call twice.
    """
    pids = [topology.haproxy_pid, *(g.pid for g in topology.gateways)]
    stopped = stop_pids(pids, grace_s)
    stopped += stop_pids([n.agent_pid for n in topology.nodes], grace_s)
    stopped += stop_pids([topology.redis_pid], grace_s)
    stopped += stop_stack_processes(topology.stack_id, grace_s)
    _teardown(topology.stack_id)  # namespaces and links, and anything started meanwhile
    if Path(topology.state_dir).exists():
        topology.with_status("stopped").save()
        current = Path(topology.state_dir).parent / CURRENT_FILE
        if current.exists() and current.read_text().strip() == topology.stack_id:
            current.unlink()
    return stopped


def live_status(topology: Topology) -> dict[str, object]:
    """Topology plus what is alive and healthy right now, as plain JSON data."""
    from llmchaos.stack.services import haproxy_server_states
    from llmchaos.stack.settings import settings_to_dict

    data = settings_to_dict(topology)
    data["haproxy_alive"] = pid_alive(topology.haproxy_pid)
    data["redis_alive"] = pid_alive(topology.redis_pid)
    backend = haproxy_server_states(topology.haproxy_stats_port)
    for gateway in data["gateways"]:
        gateway["alive"] = pid_alive(gateway["pid"])
        gateway["healthz"] = http_get_status(f"{gateway['url']}/healthz", 0.5)
        gateway["haproxy_state"] = backend.get(gateway["name"])
    for node, node_data in zip(topology.nodes, data["nodes"], strict=True):
        state = read_agent_state(Path(node.agent_state_path))
        node_data["agent_alive"] = pid_alive(node.agent_pid)
        node_data["partitioned"] = bool(node.netns) and netns.is_partitioned(node.netns)
        for worker_data in node_data["workers"]:
            ws = state.workers.get(worker_data["name"]) if state else None
            worker_data["pid"] = ws.pid if ws else None
            worker_data["restarts"] = ws.restarts if ws else None
            worker_data["running"] = ws.running if ws else False
            worker_data["healthz"] = http_get_status(f"{worker_data['url']}/healthz", 0.5)
    return data
