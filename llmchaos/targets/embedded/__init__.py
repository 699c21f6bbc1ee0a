"""The embedded reference stack as a target kind: started by the run, stopped at its end.

Settings are configuration keys without a prefix (`variant`, `gpu_workers`, `gpu_load_s`,
...) or `LLMCHAOS_<FIELD>`; the stack itself is llmchaos.stack, which only this package (and
`llmchaos stack ...`) reaches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from llmchaos.configuration import Range, check_ranges
from llmchaos.errors import InvalidInput
from llmchaos.ledger import FaultLedger
from llmchaos.load.traffic import TrafficSpec, parse_length
from llmchaos.processes import Owner
from llmchaos.stack.cleanup import cleanup
from llmchaos.stack.config import (
    MAX_ACTIVE_GATEWAYS,
    MAX_CPU_WORKERS,
    MAX_GPU_WORKERS,
    MAX_GPUS_PER_NODE,
    VARIANTS,
    StackConfig,
)
from llmchaos.stack.fleet import (
    FleetLayout,
    FleetSettings,
    TrafficShape,
    check_fits_here,
    plan_fleet,
)
from llmchaos.stack.settings import GPU_PROFILE, DegradationSettings, GatewaySettings
from llmchaos.stack.stack import start_stack
from llmchaos.stack.topology import Topology
from llmchaos.targets import CleanupRequest, Target, TargetInfo, TargetKind, TargetSettings
from llmchaos.targets.embedded.calibration import (
    REFERENCE_QPS,
    Calibration,
    cached_calibration,
    calibrate,
)
from llmchaos.targets.embedded.target import EmbeddedTarget, planned_info

__all__ = [
    "KIND",
    "REFERENCE_QPS",
    "EmbeddedKind",
    "EmbeddedSettings",
    "EmbeddedTarget",
    "machine_calibration",
]


LAYOUT_FIELDS = ("gpu_workers", "gpus_per_node", "cpu_workers", "active_gateways")
"""The settings that lay the stack out by hand (fleet_for_qps replaces them)."""


@dataclass(frozen=True)
class EmbeddedSettings(TargetSettings):
    """The embedded stack a run starts (keys without prefix; LLMCHAOS_<FIELD>)."""

    netns: Literal["auto", "on", "off"] = "auto"
    """Nodes as network namespaces: auto = when root (partitions need it)."""
    gpu_workers: int = 2
    """GPU workers (node-a, node-b, ...)."""
    gpus_per_node: int = 1
    """GPU workers per node: a partition or a node's crash takes all of them (node-a: gpu-0,
    gpu-1 with 2). 1 keeps the catalogue's names: node-a is gpu-0 alone."""
    cpu_workers: int = 1
    """CPU fallback workers (on the node after the GPU nodes)."""
    active_gateways: int = 1
    """Gateways HAProxy spreads requests over (gateway-primary, gateway-primary-2, ...),
    besides the backup. 1: a gateway crash is the seed's failover to the backup."""
    fleet_for_qps: bool | None = None
    """Lay the stack out for the rate the run starts with (`qps` capped at
    `embedded_max_qps`) times its `peak_factor` (not a later `set_qps` or stepped peak the
    factor does not cover) and its traffic, as
    `llmchaos stack up --qps` does (llmchaos.stack.fleet: GPU nodes of 2 with batches of
    `gpu_max_num_seqs`, N+1; gateways N+1 plus the backup; a CPU pool). It replaces
    `gpu_workers`, `gpus_per_node`, `cpu_workers` and `active_gateways`; not with
    `autoscale`. None (auto): a fleet when the rate is past `REFERENCE_QPS` (what the
    reference layout, two GPU nodes of one, carries with one lost) and those fields and
    `autoscale` are at their defaults; false: the reference layout at any rate."""
    fleet_target_utilization: float = FleetSettings.target_utilization
    """Share of a GPU's saturation a fleet laid out for the rate plans it to carry with a node
    lost (llmchaos.stack.fleet): lower for an experiment whose fault needs the engines'
    headroom, as kv_cache_surge's long prompts do. Only read when a fleet is laid out
    (`fleet_for_qps`)."""
    gpu_load_s: float = 10.0
    """Model-load time of a GPU worker after a restart: the not-ready gap a GPU kill opens. A
    7B model on Kubernetes takes ~45 s (seed); 10 s keeps runs short and still longer than
    the recovery window, so a target that does not route around it shows."""
    first_load_s: float = 2.0
    """Model-load time at the first start only, so the stack is up in seconds."""
    restart_delay_s: float = 0.5
    """Node agents' wait before restarting a dead worker (kubelet back-off)."""
    token_db_latency_ms: float = 5.0
    """Token table round trip per lookup (a networked DB)."""
    token_db_pool_size: int = 4
    """SQLite connections per gateway: what a cache stampede queues on."""
    tenants: int = 8
    """Tenants seeded in the token table."""
    embedded_max_qps: float | None = None
    """Highest rate a run sends to the embedded stack, whatever its `qps` says: load, stack
    and faults share this machine's cores. None: the rate this machine sustains during a GPU
    kill, measured by the first chaos run (or `llmchaos calibrate`) and cached in
    `calibration_file` (llmchaos.targets.embedded.calibration); `REFERENCE_QPS` until then
    (`llmchaos validate` does not measure)."""
    machine_share: float = 1.0
    """Share of the rate this machine sends the embedded stack (`embedded_max_qps`, else the
    calibrated rate) that a run takes: runs side by side on one machine each take theirs (CI's
    resilience suite runs most experiments two or three at a time, at 0.5 or 0.33,
    conftest.CI_EXPERIMENT_ENV)."""
    calibration_file: str = "~/.cache/llmchaos/calibration.json"
    """Where this machine's calibrated rate is cached (measured again on another machine)."""
    degradation_queue_threshold: int = DegradationSettings.queue_depth_threshold
    """The gateways degrade at once when the engines' queue passes this (the seed's 500)."""
    degradation_latency_for_s: float = DegradationSettings.latency_for_s
    """How long the engines' P99 must stay over 800 ms before the gateways degrade (the
    seed's 2 minutes)."""
    queue_shed_threshold: int = GatewaySettings.queue_shed_threshold
    """The gateways' last line: 429 above this estimated queue, degraded or not (twice the
    degradation threshold by default)."""
    gateway_first_byte_timeout_s: float = GatewaySettings.first_byte_timeout_s
    """How long a gateway waits for a worker's response headers before it takes the worker
    for hung (ejects it) and retries elsewhere: 6 s, below the clients' 8 s, so a hung GPU
    shows. A plain (not streamed) answer sends its headers with its last token, so a
    workload of long plain answers needs more (nginx's proxy_read_timeout is 60 s)."""
    gateway_read_timeout_s: float = GatewaySettings.stream_idle_timeout_s
    """How long a gateway waits on any one read from a worker (headers included, so it bounds
    the first-byte timeout too) before it takes the worker for hung."""
    gateway_hedge_after_s: float = GatewaySettings.hedge_after_s
    """A request its worker has answered nothing for this long gets a twin on another worker
    (GatewaySettings.hedge_after_s; the variants without hedging never do). 0: off, so an
    experiment can test what the other defences do alone."""
    discovery: Literal["static", "etcd"] = "static"
    """Where the gateways find their workers: their settings, or a 3-member etcd registry a
    registrar keeps filled (the registry experiments; needs an etcd binary)."""
    gpu_max_num_seqs: int = 256
    """Running-batch size of the GPU workers (vLLM --max-num-seqs); a small batch (a large
    model per GPU) saturates at a rate this machine can send (the autoscaling experiment)."""
    autoscale: bool = False
    """Scale the GPU pool with the embedded autoscaler (HPA semantics): `gpu_workers` is then
    the most replicas, `autoscale_min_replicas` run at first; each new one loads its model
    for `gpu_load_s`. The variant `no-autoscaler` keeps the minimum."""
    autoscale_min_replicas: int = 1
    autoscale_target_utilization: float = 0.7
    """Average (running + waiting) / max_num_seqs per replica aimed at (the seed's 70%)."""
    autoscale_sync_s: float = 15.0
    """How often the autoscaler decides (the HPA's sync period)."""
    autoscale_scale_down_window_s: float = 300.0
    """The HPA's scale-down stabilisation window."""
    autoscale_policy_period_s: float = 15.0
    """Period of the HPA's rate limits (4 pods or 100% up, 100% down)."""
    stacks_root: str = "reports/stacks"
    """Folder of the stacks' state folders."""

    RANGES: ClassVar[dict[str, Range]] = {
        "gpu_workers": Range(0, MAX_GPU_WORKERS),
        "gpus_per_node": Range(1, MAX_GPUS_PER_NODE),
        "cpu_workers": Range(0, MAX_CPU_WORKERS),
        "active_gateways": Range(1, MAX_ACTIVE_GATEWAYS),
        "gpu_load_s": Range(0, 3600),
        "first_load_s": Range(0, 3600),
        "restart_delay_s": Range(0, 600),
        "token_db_latency_ms": Range(0, 10_000),
        "token_db_pool_size": Range(1, 1000),
        "tenants": Range(1, 100_000),
        "degradation_queue_threshold": Range(1, 1_000_000),
        "degradation_latency_for_s": Range(0, 86_400),
        "queue_shed_threshold": Range(1, 1_000_000),
        "gateway_first_byte_timeout_s": Range(0, 3600, low_open=True),
        "gateway_read_timeout_s": Range(0, 3600, low_open=True),
        "gateway_hedge_after_s": Range(0, 3600),
        "gpu_max_num_seqs": Range(1, 4096),
        "fleet_target_utilization": FleetSettings.RANGES["target_utilization"],
        "machine_share": Range(0, 1, low_open=True),
        "autoscale_min_replicas": Range(1, 64),
        "autoscale_target_utilization": Range(0, 100, low_open=True),
        "autoscale_sync_s": Range(0, 3600, low_open=True),
        "autoscale_scale_down_window_s": Range(0, 86_400),
        "autoscale_policy_period_s": Range(0, 3600, low_open=True),
    }
    MAX_QPS_RANGE: ClassVar[Range] = Range(0, 20_000, low_open=True)
    """embedded_max_qps: the embedded stack runs on one machine, four times what the load
    sends from 2 cores."""

    def __post_init__(self) -> None:
        check_ranges(self, self.RANGES)
        if self.embedded_max_qps is not None:
            self.MAX_QPS_RANGE.check("embedded_max_qps", self.embedded_max_qps)
        self.stack_config()  # the stack's own checks (worker counts, ...)

    def stack_config(self) -> StackConfig:
        """The embedded stack these settings ask for: every field the two share, any free
        port, the state folders under `stacks_root`."""
        shared = {f.name for f in dataclasses.fields(StackConfig)} & {
            f.name for f in dataclasses.fields(self)
        }
        values = {name: getattr(self, name) for name in shared}
        return StackConfig(**values, port=0, state_root=Path(self.stacks_root))


class EmbeddedKind(TargetKind):
    """See the module docstring."""

    name = "embedded"
    settings_type = EmbeddedSettings

    def variants(self, settings: TargetSettings) -> tuple[str, ...]:
        return tuple(VARIANTS)

    def max_qps(self, settings: TargetSettings) -> float | None:
        embedded = _embedded(settings)
        machine_qps = embedded.embedded_max_qps
        if machine_qps is None:
            calibration = machine_calibration(embedded)
            machine_qps = REFERENCE_QPS if calibration is None else calibration.qps
        return machine_qps * embedded.machine_share

    def prepare(self, settings: TargetSettings, progress: Callable[[str], None]) -> bool:
        embedded = _embedded(settings)
        if embedded.embedded_max_qps is not None:
            return False
        if machine_calibration(embedded) is not None:
            return False
        _measure(embedded, progress)
        return True

    def calibration(
        self,
        settings: TargetSettings,
        *,
        measure: Literal["if-missing", "again", "never"],
        progress: Callable[[str], None],
    ) -> str | None:
        embedded = _embedded(settings)
        calibration = None if measure == "again" else machine_calibration(embedded)
        if calibration is None and measure != "never":
            calibration = _measure(embedded, progress)
        if calibration is None:
            return None
        return f"{calibration.describe()}\ncached in {embedded.calibration_file}"

    def sized_for(
        self, settings: TargetSettings, qps: float, traffic: TrafficSpec
    ) -> TargetSettings:
        embedded = _embedded(settings)
        if embedded.fleet_for_qps is None:
            laid_out = bool(_fields_set_by_hand(embedded))
            if qps <= REFERENCE_QPS or laid_out or embedded.autoscale:
                return settings
        elif not embedded.fleet_for_qps:
            return settings
        if embedded.autoscale:
            raise InvalidInput(
                "fleet_for_qps: cannot be used with autoscale (the autoscaler sizes the GPU "
                "pool itself); set one of them false"
            )
        layout = _plan_fleet(embedded, qps, traffic)
        try:
            check_fits_here(layout, rate="qps")
        except InvalidInput as exc:
            raise InvalidInput(
                f"fleet_for_qps: {exc}; qps as capped at embedded_max_qps, or set "
                "fleet_for_qps false"
            ) from None
        return dataclasses.replace(embedded, **layout.sizes(embedded.variant))

    def layout_notes(self, settings: TargetSettings, qps: float, traffic: TrafficSpec) -> list[str]:
        """Setting some layout fields keeps the reference layout's values for the others (no
        fleet): name those of the serving path (GPU workers, gateways) left below what the
        fleet rule lays out for the rate, as one gateway at 1,000 QPS would be. What the
        experiment sets itself, a deliberate overload included, is its own business."""
        embedded = _embedded(settings)
        if embedded.autoscale or embedded.fleet_for_qps or qps <= REFERENCE_QPS:
            return []
        set_fields = _fields_set_by_hand(embedded)
        if not set_fields:
            return []
        try:
            planned = _plan_fleet(embedded, qps, traffic)
        except InvalidInput:
            return []  # a rate past any fleet: nothing to compare with
        planned_sizes = planned.sizes(embedded.variant)
        short = [
            f"{name} at {getattr(embedded, name)} (the fleet rule's: {planned_sizes[name]})"
            for name in ("gpu_workers", "active_gateways")  # the CPU pool serves only without GPUs
            if name not in set_fields and getattr(embedded, name) < planned_sizes[name]
        ]
        if not short:
            return []
        return [
            f"layout: the experiment sets {', '.join(set_fields)} and leaves "
            f"{', '.join(short)} for the {qps:g} QPS this run sends (`llmchaos stack up --qps "
            f"{qps:g}` shows the fleet); set those too, or leave every layout field unset"
        ]

    def max_qps_source(self, settings: TargetSettings) -> str:
        embedded = _embedded(settings)
        share = embedded.machine_share
        shared = "" if share == 1 else f" (times machine_share {share:g})"
        if embedded.embedded_max_qps is not None:
            return (
                f"embedded_max_qps{shared}: load, stack and faults share this machine's cores; "
                "set LLMCHAOS_EMBEDDED_MAX_QPS to change it"
            )
        if machine_calibration(embedded) is None:
            return (
                f"this machine is not calibrated yet ({embedded.calibration_file}): the "
                f"reference layout's rate{shared} until a run or `llmchaos calibrate` measures it"
            )
        return (
            f"this machine's calibrated rate{shared}, cached in {embedded.calibration_file} "
            "(`llmchaos calibrate`); set LLMCHAOS_EMBEDDED_MAX_QPS to change it"
        )

    def plan(self, settings: TargetSettings) -> TargetInfo:
        return planned_info(_embedded(settings).stack_config())

    def open(self, settings: TargetSettings, owner: Owner) -> Target:
        config = _embedded(settings).stack_config()
        return EmbeddedTarget(start_stack(config, owner=owner, progress=True))

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        return EmbeddedTarget(Topology.load(Path(record["stack_state_dir"])))

    def finish_dead_run(
        self, settings: TargetSettings, record: dict[str, Any], ledger: FaultLedger
    ) -> list[str]:
        """Every fault of the embedded stack lives in its processes and namespaces, which the
        stack cleanup that follows removes."""
        for fault in ledger.open_faults():
            ledger.mark_undone(fault.id, by="cleanup (removed with the embedded stack)")
        return []

    def remove_run_target(self, settings: TargetSettings, record: dict[str, Any]) -> list[str]:
        state_dir = Path(record["stack_state_dir"]) if record.get("stack_state_dir") else None
        if state_dir is None:
            return []
        return cleanup(state_dir.parent, [state_dir.name]).lines()

    def cleanup(self, request: CleanupRequest) -> list[str]:
        report = cleanup(
            request.state_root or Path(EmbeddedSettings().stacks_root),
            request.names,
            everything=request.everything,
            dry_run=request.dry_run,
        )
        return report.lines(dry_run=request.dry_run)


def _fields_set_by_hand(embedded: EmbeddedSettings) -> list[str]:
    """The layout fields the experiment (or environment) moved off their defaults."""
    defaults = EmbeddedSettings()
    return [name for name in LAYOUT_FIELDS if getattr(embedded, name) != getattr(defaults, name)]


def _plan_fleet(embedded: EmbeddedSettings, qps: float, traffic: TrafficSpec) -> FleetLayout:
    """plan_fleet for `qps` of `traffic` on GPUs with this stack's batch size and planned
    utilisation."""
    gpu = dataclasses.replace(GPU_PROFILE, max_num_seqs=embedded.gpu_max_num_seqs)
    fleet = FleetSettings(target_utilization=embedded.fleet_target_utilization, gpu_profile=gpu)
    return plan_fleet(qps, _traffic_shape(traffic), fleet)


def _traffic_shape(traffic: TrafficSpec) -> TrafficShape:
    """The mean request of the load's traffic, what the fleet is sized on: the length laws'
    means, or those of fixed, uniform or normal lengths given instead."""
    shape = TrafficShape.of_laws(traffic)
    prompt, output = shape.prompt_tokens, shape.output_tokens
    if traffic.prompt_tokens is not None:
        prompt = traffic.context_tokens + parse_length(traffic.prompt_tokens, "prompt_tokens").mean
    if traffic.output_tokens is not None:
        output = parse_length(traffic.output_tokens, "output_tokens").mean
    return TrafficShape(prompt, output)


def _calibration_path(embedded: EmbeddedSettings) -> Path:
    return Path(embedded.calibration_file).expanduser()


def machine_calibration(embedded: EmbeddedSettings) -> Calibration | None:
    """This machine's calibration cached in `embedded.calibration_file`; None when there is
    none yet, or it was measured on another machine or version (calibration.py)."""
    return cached_calibration(_calibration_path(embedded))


def _measure(embedded: EmbeddedSettings, progress: Callable[[str], None]) -> Calibration:
    return calibrate(_calibration_path(embedded), Path(embedded.stacks_root), progress)


def _embedded(settings: TargetSettings) -> EmbeddedSettings:
    assert isinstance(settings, EmbeddedSettings), settings
    return settings


KIND = EmbeddedKind()
