"""A fleet sized from the asked rate: gateways, GPU nodes, CPU fallback pool.

    layout = plan_fleet(1000, DEFAULT_TRAFFIC)           # FleetLayout: pure arithmetic
    TrafficShape.of_laws(TrafficSpec(...))               # another traffic's mean request
    config = layout.stack_config(StackConfig())          # the StackConfig fields it sets
    check_fits_here(layout)                              # InvalidInput past this machine's limits

More load means more simulated GPUs, never faster ones: one GPU's capacity comes from the GPU
profile's cost model (`engine_capacity_qps`) and does not depend on the rate.

The sizing rule (`plan_fleet`):

- GPUs, N+1 by node. A node (a namespace, its agent and its k GPU workers) is the failure
  domain: a partition or a node crash takes all k at once. The fleet has enough nodes that
  with any one of them lost the others still carry the rate at `target_utilization` of their
  capacity: gpu_nodes = ceil(qps / (k * rated)) + 1, rated = capacity * target_utilization.
  At least 2 nodes, so a node loss never leaves the GPU pool empty.
- Target utilisation 0.6 by default: one simulated GPU on the default traffic answers with
  P99 1.4 s at 60% of its saturation, 2.7 s at 80% and 5.3 s at 100% (bench/gpu_capacity.py),
  against the catalogue's 3 s SLO; 60% leaves the bursts of the traffic model room.
- Gateways, active-active N+1 behind HAProxy, plus one backup: ceil(qps / gateway_qps) + 1
  active ones (any one can crash and the rest carry the rate), and HAProxy's backup server
  for when every active one is down. `gateway_qps` 1000: two thirds of the 1,507 QPS one
  gateway process sustained on this machine (README, "Capacity on this machine"); with the
  default traffic's 554-token prompts a gateway costs 0.45 CPU-s per 1000 requests
  (bench/gateway_throughput.py --prompt-tokens 554), so 1000 QPS is ~45% of a core.
- CPU fallback pool: carries `cpu_fallback_share` (2%) of the rate at the CPU profile's rated
  capacity, at least one worker. It is there to keep answering (degraded, shorter answers)
  while no GPU can serve, not to replace them: at ~4 QPS per CPU worker on the default traffic,
  carrying the whole rate would take ~20 CPU workers per GPU.

Calibration of one simulated GPU (GPU_PROFILE) against published vLLM figures, Llama 3 8B on
one H100 (checked in tests/stack/test_fleet.py, measured against the running engine by
bench/gpu_capacity.py):

- `vllm benchmark_throughput.py --input-len 1000 --output-len 100`, Meta-Llama-3-8B-Instruct,
  1x H100, vLLM 0.4.1: 20.72 requests/s (vLLM PR #4600, "bump version to v0.4.2",
  https://github.com/vllm-project/vllm/pull/4600). The cost model gives 29.0 requests/s for the
  same shape: 1.4x, between that release and vLLM 0.6.0, which the vLLM blog reports at up to
  2.7x the throughput of 0.5.3 on Llama 8B / H100 (https://blog.vllm.ai/2024/09/05/perf-update.html).
- The same blog post: "Llama3 8B can generate 1 token every 13 ms under light load" (H100).
  The profile's decode step with one sequence: 11.04 ms.
- The default traffic (a 512-token context plus Zipf prompts, mean ~560 prompt tokens; median
  8 output tokens, mean ~10) is prefill-heavy, like that post's "prefill-heavy" dataset (462
  input, 16 output tokens). One simulated GPU saturates at 78 QPS on it (the running engine:
  78.9 completed at 94 offered) and is rated at 46.8 QPS (60%): 50 QPS, the reference
  layout's rate (two GPU nodes of one), is what one of its GPUs carries when the other is
  killed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

from llmchaos.configuration import Range, check_ranges
from llmchaos.errors import InvalidInput
from llmchaos.stack.config import (
    MAX_ACTIVE_GATEWAYS,
    MAX_CPU_WORKERS,
    MAX_GPU_WORKERS,
    MAX_GPUS_PER_NODE,
    StackConfig,
    get_variant,
)
from llmchaos.stack.settings import CPU_PROFILE, GPU_PROFILE, EngineProfile

__all__ = [
    "DEFAULT_TRAFFIC",
    "MAX_FLEET_QPS",
    "FleetLayout",
    "FleetSettings",
    "LengthLaws",
    "TrafficShape",
    "check_fits_here",
    "engine_capacity_qps",
    "most_qps_here",
    "plan_fleet",
]

MAX_FLEET_QPS = 1_000_000.0
"""Highest rate a fleet is planned for (the load's own ceiling: a million QPS)."""
_QUADRATURE_POINTS = 20_000
"""Points of the midpoint rule over the quantile function (means to well under 0.1%)."""


class LengthLaws(Protocol):
    """The length laws of a traffic (llmchaos.load.traffic.TrafficSpec has them)."""

    @property
    def prompt_alpha(self) -> float: ...
    @property
    def prompt_min_tokens(self) -> int: ...
    @property
    def prompt_max_tokens(self) -> int: ...
    @property
    def context_tokens(self) -> int: ...
    @property
    def output_median_tokens(self) -> int: ...
    @property
    def output_sigma(self) -> float: ...
    @property
    def output_max_tokens(self) -> int: ...


@dataclass(frozen=True)
class TrafficShape:
    """The mean request of a traffic: what one engine's capacity depends on."""

    prompt_tokens: float
    """Mean tokens the engine prefills per request (context template + user prompt)."""
    output_tokens: float
    """Mean tokens it generates per request (max_tokens: the simulator has no EOS)."""

    def __post_init__(self) -> None:
        if not self.prompt_tokens >= 0 or not self.output_tokens >= 1:
            raise InvalidInput(
                "traffic: expected prompt_tokens >= 0 and output_tokens >= 1, got "
                f"{self.prompt_tokens!r} and {self.output_tokens!r}"
            )

    @classmethod
    def of_laws(cls, laws: LengthLaws) -> TrafficShape:
        """The means of the load's Zipf-like prompt law and log-normal output law, as its
        sampler draws them (whole tokens, floored, within their bounds): a midpoint rule
        over each law's quantile function."""
        a, low, high = laws.prompt_alpha, laws.prompt_min_tokens, laws.prompt_max_tokens
        ratio = (low / high) ** a
        n = _QUADRATURE_POINTS
        quantiles = [(i + 0.5) / n for i in range(n)]
        prompt = sum(min(int(low * (1 - u * (1 - ratio)) ** (-1 / a)), high) for u in quantiles)
        if laws.output_sigma > 0:
            law = statistics.NormalDist(math.log(laws.output_median_tokens), laws.output_sigma)
            drawn = (int(math.exp(law.inv_cdf(u))) for u in quantiles)
        else:
            drawn = (laws.output_median_tokens for _ in quantiles)
        output = sum(max(1, min(d, laws.output_max_tokens)) for d in drawn)
        return cls(laws.context_tokens + prompt / n, output / n)


DEFAULT_TRAFFIC = TrafficShape(prompt_tokens=553.5, output_tokens=9.72)
"""The load's default traffic (llmchaos.load.traffic.TrafficSpec(): the seed's 512-token
context and Zipf prompts, median 8 output tokens) as its mean request. Written out because
the stack does not import the load; tests/stack/test_fleet.py checks it against
`TrafficShape.of_laws(TrafficSpec())`."""


def engine_capacity_qps(profile: EngineProfile, traffic: TrafficShape) -> float:
    """Requests per second one simulated engine completes at saturation on `traffic`.

    The steady state of llmchaos.stack.engine's step loop when requests always wait: every
    step admits `a` new sequences (their prefill) and decodes the R running ones, and as many
    finish as start, so R = a * output. R is capped by max_num_seqs and by the KV cache (each
    sequence holds its prompt and on average half its output), a by the step's prefill budget
    (max_num_batched_tokens). A step costs prefill_base + prefill_per_token * a * prompt +
    decode_per_seq * R and completes `a` requests.
    """
    prompt, output = traffic.prompt_tokens, traffic.output_tokens
    running = min(profile.max_num_seqs, profile.kv_cache_tokens / (prompt + output / 2))
    admitted = running / output
    if prompt > 0:
        admitted = min(admitted, max(1.0, profile.max_num_batched_tokens / prompt))
    running = admitted * output
    step_ms = (
        profile.prefill_base_ms
        + profile.prefill_ms_per_token * prompt * admitted
        + profile.decode_ms_per_seq * running
    )
    return 1000.0 * admitted / step_ms


@dataclass(frozen=True)
class FleetSettings:
    """How a fleet is sized (module docstring: the rule and why these defaults)."""

    gpus_per_node: int = 2
    """GPU workers per node (the failure domain). 2 keeps the spare node small; a DGX-like
    node has 8, and then the spare is 8 GPUs."""
    target_utilization: float = 0.6
    """Share of a GPU's saturation it is planned to carry (the headroom is the rest)."""
    gateway_qps: float = 1000.0
    """Rate one gateway process is planned to carry."""
    cpu_fallback_share: float = 0.02
    """Share of the rate the CPU fallback pool is sized to answer while no GPU can."""
    gpu_profile: EngineProfile = GPU_PROFILE
    """Cost model of one simulated GPU (its capacity is the same whatever the rate)."""
    cpu_profile: EngineProfile = CPU_PROFILE
    """Cost model of one CPU fallback worker."""

    RANGES: ClassVar[dict[str, Range]] = {
        "gpus_per_node": Range(1, MAX_GPUS_PER_NODE),
        "target_utilization": Range(0, 1, low_open=True),
        "gateway_qps": Range(0, MAX_FLEET_QPS, low_open=True),
        "cpu_fallback_share": Range(0, 1),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self.RANGES)


@dataclass(frozen=True)
class FleetLayout:
    """What `plan_fleet` lays out for a rate; `stack_config` turns it into StackConfig fields."""

    qps: float
    """The rate it is sized for."""
    gpu_rated_qps: float
    """Rate one GPU is planned to carry (its capacity x target utilisation)."""
    cpu_rated_qps: float
    """Rate one CPU worker is planned to carry."""
    gpus_per_node: int
    gpu_nodes: int
    cpu_workers: int
    """CPU fallback workers, all on one CPU node after the GPU nodes."""
    active_gateways: int
    """Gateways HAProxy spreads requests over."""
    backup_gateways: int = 1
    """Gateways HAProxy sends to only when every active one is down."""
    settings: FleetSettings = field(default_factory=FleetSettings)

    @property
    def gpu_workers(self) -> int:
        return self.gpu_nodes * self.gpus_per_node

    @property
    def nodes(self) -> int:
        """GPU nodes and the CPU node."""
        return self.gpu_nodes + (1 if self.cpu_workers else 0)

    def qps_after_node_loss(self) -> float:
        """Rate the GPUs carry at the target utilisation with any one node lost."""
        return (self.gpu_nodes - 1) * self.gpus_per_node * self.gpu_rated_qps

    def sizes(self, variant: str = "hardened") -> dict[str, int]:
        """The StackConfig fields this fleet sets for `variant`. A variant without the backup
        gateway gets one gateway in all: its known fault is that nothing stands in for a
        crashed gateway, which active-active ones would."""
        return {
            "gpu_workers": self.gpu_workers,
            "gpus_per_node": self.gpus_per_node,
            "cpu_workers": self.cpu_workers,
            "active_gateways": self.active_gateways if get_variant(variant).backup_gateway else 1,
        }

    def stack_config(self, base: StackConfig, **overrides: int) -> StackConfig:
        """`base` with this fleet's workers, nodes and gateways for its variant (the rest
        kept), and `overrides` of those (explicit flags) on top. Raises InvalidInput as
        StackConfig does for a fleet past its limits (check_fits_here says it in terms of
        --qps)."""
        return replace(base, **{**self.sizes(base.variant), **overrides})

    def describe(self) -> str:
        """One paragraph for `llmchaos stack up --qps`."""
        return (
            f"fleet for {self.qps:g} QPS: {self.gpu_nodes} GPU nodes x {self.gpus_per_node} "
            f"GPU workers ({self.gpu_workers} GPUs, {self.gpu_rated_qps:.1f} QPS each at "
            f"{self.settings.target_utilization:.0%}; {self.qps_after_node_loss():.0f} QPS "
            f"with one node lost), {self.cpu_workers} CPU fallback worker(s) on one node, "
            f"{self.active_gateways} active gateway(s) + {self.backup_gateways} backup behind "
            "HAProxy"
        )


def plan_fleet(
    qps: float, traffic: TrafficShape, settings: FleetSettings | None = None
) -> FleetLayout:
    """The fleet that carries `qps` of `traffic` by the module docstring's rule.

    Pure arithmetic, no limit of this machine (see check_fits_here). Raises InvalidInput
    naming --qps when the rate is not in (0, MAX_FLEET_QPS].
    """
    if not 0 < qps <= MAX_FLEET_QPS:
        raise InvalidInput(f"--qps: expected a rate in (0, {MAX_FLEET_QPS:.0f}] QPS, got {qps:g}")
    settings = settings or FleetSettings()
    k = settings.gpus_per_node
    gpu_rated = engine_capacity_qps(settings.gpu_profile, traffic) * settings.target_utilization
    cpu_rated = engine_capacity_qps(settings.cpu_profile, traffic) * settings.target_utilization
    return FleetLayout(
        qps=qps,
        gpu_rated_qps=gpu_rated,
        cpu_rated_qps=cpu_rated,
        gpus_per_node=k,
        gpu_nodes=max(2, math.ceil(qps / (k * gpu_rated)) + 1),
        cpu_workers=max(1, math.ceil(settings.cpu_fallback_share * qps / cpu_rated)),
        active_gateways=math.ceil(qps / settings.gateway_qps) + 1,
        settings=settings,
    )


def most_qps_here(layout: FleetLayout) -> float:
    """The highest rate whose fleet (same settings and traffic) fits this machine."""
    settings = layout.settings
    k = layout.gpus_per_node
    by_gpus = (MAX_GPU_WORKERS // k - 1) * k * layout.gpu_rated_qps
    by_gateways = (MAX_ACTIVE_GATEWAYS - 1) * settings.gateway_qps
    by_cpus = (
        MAX_CPU_WORKERS * layout.cpu_rated_qps / settings.cpu_fallback_share
        if settings.cpu_fallback_share
        else math.inf
    )
    return max(0.0, min(by_gpus, by_gateways, by_cpus))


def check_fits_here(
    layout: FleetLayout, overridden: frozenset[str] = frozenset(), rate: str = "--qps"
) -> None:
    """Raises InvalidInput naming `rate` (how the user gave it), what the fleet needs and
    this machine's limit (the embedded stack's process and namespace budget: StackConfig's
    limits). A part whose StackConfig field is in `overridden` (given explicitly) is not
    checked here."""
    needs = (
        ("gpu_workers", f"{layout.gpu_workers} GPU workers", layout.gpu_workers, MAX_GPU_WORKERS),
        ("cpu_workers", f"{layout.cpu_workers} CPU workers", layout.cpu_workers, MAX_CPU_WORKERS),
        (
            "active_gateways",
            f"{layout.active_gateways} active gateways",
            layout.active_gateways,
            MAX_ACTIVE_GATEWAYS,
        ),
    )
    for name, what, needed, limit in needs:
        if needed > limit and name not in overridden:
            raise InvalidInput(
                f"{rate} {layout.qps:g}: the fleet needs {what}; this machine runs at most "
                f"{limit}, so {rate} at most {math.floor(most_qps_here(layout))} here with "
                f"{layout.gpus_per_node} GPUs per node (a larger fleet needs a cluster: "
                "target k8s)"
            )
