"""A fleet sized from the asked rate: the layout rule, its StackConfig, and a real one up."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import pytest

from llmchaos.cli import main
from llmchaos.errors import InvalidInput
from llmchaos.load.traffic import TrafficModel, TrafficSpec
from llmchaos.settings import RunSettings
from llmchaos.stack import netns
from llmchaos.stack.config import MAX_GPU_WORKERS, StackConfig
from llmchaos.stack.fleet import (
    DEFAULT_TRAFFIC,
    FleetLayout,
    FleetSettings,
    TrafficShape,
    check_fits_here,
    engine_capacity_qps,
    most_qps_here,
    plan_fleet,
)
from llmchaos.stack.procs import http_get_status
from llmchaos.stack.settings import GPU_PROFILE
from llmchaos.stack.stack import gateway_layout, node_layout
from llmchaos.stack.topology import Topology
from llmchaos.targets import target_kind
from llmchaos.targets.embedded import EmbeddedSettings
from llmchaos.targets.embedded.target import planned_info
from tests.stack.stack_client import chat, valid_token

RATES = (50, 1000, 5000, 20000)
SEED = DEFAULT_TRAFFIC

VLLM_H100_LLAMA3_8B_1000_100_RPS = 20.72
"""vLLM PR #4600: benchmark_throughput --input-len 1000 --output-len 100, Llama 3 8B, 1x H100,
vLLM 0.4.1."""
VLLM_H100_LLAMA3_8B_LIGHT_LOAD_TPOT_MS = 13.0
"""vLLM blog 2024-09-05: "Llama3 8B can generate 1 token every 13 ms under light load"."""


def test_traffic_means_are_what_the_load_sampler_draws() -> None:
    model = TrafficModel(TrafficSpec(), seed=3)
    n = 200_000
    prompt = sum(model.prompt_tokens() for _ in range(n)) / n + TrafficSpec().context_tokens
    output = sum(model.output_tokens() for _ in range(n)) / n
    shape = TrafficShape.of_laws(TrafficSpec())
    assert shape.prompt_tokens == pytest.approx(prompt, rel=0.01)
    assert shape.output_tokens == pytest.approx(output, rel=0.01)
    # the stack's copy of the load's defaults
    assert DEFAULT_TRAFFIC.prompt_tokens == pytest.approx(shape.prompt_tokens, abs=0.05)
    assert DEFAULT_TRAFFIC.output_tokens == pytest.approx(shape.output_tokens, abs=0.005)


def test_one_simulated_gpu_is_calibrated_to_published_vllm_figures() -> None:
    """The cost model on vLLM's benchmark_throughput shape (1000 in, 100 out) against the
    published H100 figure: at least it, at most the 2.7x that vLLM 0.6.0 gained on Llama 8B
    (the profile models a recent engine); and the light-load decode step against 13 ms."""
    rps = engine_capacity_qps(GPU_PROFILE, TrafficShape(1000, 100))
    assert 1.0 <= rps / VLLM_H100_LLAMA3_8B_1000_100_RPS <= 2.7, rps
    light_load_ms = GPU_PROFILE.decode_base_ms + GPU_PROFILE.decode_ms_per_seq
    assert light_load_ms == pytest.approx(VLLM_H100_LLAMA3_8B_LIGHT_LOAD_TPOT_MS, rel=0.2)


def test_capacity_is_the_engine_steady_state_by_hand() -> None:
    """Default traffic: the prefill budget binds (8192 / 554 prompts a step), not the batch."""
    admitted = GPU_PROFILE.max_num_batched_tokens / SEED.prompt_tokens
    step_ms = (
        GPU_PROFILE.prefill_base_ms
        + GPU_PROFILE.prefill_ms_per_token * SEED.prompt_tokens * admitted
        + GPU_PROFILE.decode_ms_per_seq * admitted * SEED.output_tokens
    )
    assert engine_capacity_qps(GPU_PROFILE, SEED) == pytest.approx(1000 * admitted / step_ms)
    # long answers: the KV cache caps the batch at 200,000 / (1000 + 100 / 2) sequences
    running = GPU_PROFILE.kv_cache_tokens / 1050
    step_ms = (
        GPU_PROFILE.prefill_base_ms
        + GPU_PROFILE.prefill_ms_per_token * 1000 * running / 100
        + GPU_PROFILE.decode_ms_per_seq * running
    )
    assert engine_capacity_qps(GPU_PROFILE, TrafficShape(1000, 100)) == pytest.approx(
        1000 * running / 100 / step_ms
    )


@pytest.mark.parametrize("qps", RATES)
def test_layout_is_n_plus_one_by_node(qps: float) -> None:
    layout = plan_fleet(qps, SEED)
    k = layout.gpus_per_node
    assert layout.gpu_workers == layout.gpu_nodes * k
    assert layout.qps_after_node_loss() >= qps, "losing any one node must leave enough GPUs"
    if layout.gpu_nodes > 2:  # and not a node more than that
        assert (layout.gpu_nodes - 2) * k * layout.gpu_rated_qps < qps
    assert layout.gpu_rated_qps == pytest.approx(
        engine_capacity_qps(GPU_PROFILE, SEED) * FleetSettings().target_utilization
    )


@pytest.mark.parametrize("qps", RATES)
def test_layout_has_active_gateways_a_backup_and_a_cpu_pool(qps: float) -> None:
    layout = plan_fleet(qps, SEED)
    assert layout.backup_gateways == 1
    assert layout.active_gateways >= 2
    assert (layout.active_gateways - 1) * FleetSettings().gateway_qps >= qps
    assert layout.cpu_workers >= 1
    assert layout.cpu_workers * layout.cpu_rated_qps >= 0.02 * qps


def test_more_load_means_more_gpus_never_faster_ones() -> None:
    layouts = [plan_fleet(qps, SEED) for qps in (10, *RATES, 100_000)]
    for smaller, larger in itertools.pairwise(layouts):
        assert larger.gpu_workers >= smaller.gpu_workers
        assert larger.gpu_workers > smaller.gpu_workers or larger.qps <= 2 * larger.gpu_rated_qps
        assert larger.cpu_workers >= smaller.cpu_workers
        assert larger.active_gateways >= smaller.active_gateways
        assert larger.gpu_rated_qps == smaller.gpu_rated_qps


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_bigger_nodes_need_a_bigger_spare(k: int) -> None:
    layout = plan_fleet(1000, SEED, FleetSettings(gpus_per_node=k))
    assert layout.gpus_per_node == k
    assert layout.qps_after_node_loss() >= 1000
    assert layout.gpu_workers - math.ceil(1000 / layout.gpu_rated_qps) < 2 * k


@pytest.mark.parametrize("qps", [0, -5, math.nan, math.inf, 2e6])
def test_a_rate_out_of_range_names_qps(qps: float) -> None:
    with pytest.raises(InvalidInput, match=r"--qps: expected a rate in \(0, 1000000\]"):
        plan_fleet(qps, SEED)


def test_a_fleet_past_this_machine_is_refused_naming_qps_and_the_limit() -> None:
    check_fits_here(plan_fleet(50, SEED))
    most = math.floor(most_qps_here(plan_fleet(50, SEED)))
    check_fits_here(plan_fleet(most, SEED))
    with pytest.raises(InvalidInput) as refused:
        check_fits_here(plan_fleet(most + 50, SEED))
    message = str(refused.value)
    assert f"--qps {most + 50}" in message and "GPU workers" in message
    assert f"at most {MAX_GPU_WORKERS}" in message and f"--qps at most {most}" in message
    assert "with 2 GPUs per node" in message
    # a part given explicitly is the user's call
    check_fits_here(plan_fleet(5000, SEED), overridden=frozenset({"gpu_workers", "cpu_workers"}))


def test_stack_config_from_a_layout() -> None:
    layout = FleetLayout(
        qps=100,
        gpu_rated_qps=50,
        cpu_rated_qps=2,
        gpus_per_node=2,
        gpu_nodes=3,
        cpu_workers=2,
        active_gateways=3,
    )
    config = layout.stack_config(StackConfig(port=0))
    assert config.port == 0
    assert node_layout(config) == [
        ("node-a", [("gpu-0", "gpu"), ("gpu-1", "gpu")]),
        ("node-b", [("gpu-2", "gpu"), ("gpu-3", "gpu")]),
        ("node-c", [("gpu-4", "gpu"), ("gpu-5", "gpu")]),
        ("node-d", [("cpu-0", "cpu"), ("cpu-1", "cpu")]),
    ]
    assert gateway_layout(config) == [
        ("gateway-primary", "primary"),
        ("gateway-primary-2", "primary"),
        ("gateway-primary-3", "primary"),
        ("gateway-backup", "backup"),
    ]
    assert layout.stack_config(StackConfig(), gpu_workers=5).gpu_workers == 5


def test_the_default_topology_is_unchanged() -> None:
    config = StackConfig()
    assert node_layout(config) == [
        ("node-a", [("gpu-0", "gpu")]),
        ("node-b", [("gpu-1", "gpu")]),
        ("node-c", [("cpu-0", "cpu")]),
    ]
    assert gateway_layout(config) == [("gateway-primary", "primary"), ("gateway-backup", "backup")]
    assert gateway_layout(StackConfig(variant="no-backup-gateway")) == [
        ("gateway-primary", "primary")
    ]


def test_an_experiment_sets_its_gateways_upstream_timeouts_and_hedging() -> None:
    settings = EmbeddedSettings(
        gateway_first_byte_timeout_s=60, gateway_read_timeout_s=60, gateway_hedge_after_s=0
    )
    config = settings.stack_config()
    assert (config.gateway_first_byte_timeout_s, config.gateway_read_timeout_s) == (60, 60)
    assert config.gateway_hedge_after_s == 0
    with pytest.raises(InvalidInput, match=r"gateway_read_timeout_s: expected > 0, got 0"):
        StackConfig(gateway_read_timeout_s=0)
    with pytest.raises(InvalidInput, match=r"gateway_hedge_after_s: expected >= 0, got -1"):
        StackConfig(gateway_hedge_after_s=-1)


def test_a_chaos_run_knows_the_fleet_names_before_it_starts() -> None:
    settings = EmbeddedSettings(gpu_workers=4, gpus_per_node=2, active_gateways=2)
    info = planned_info(settings.stack_config())
    assert info.gpu_workers(node="node-a") == ["gpu-0", "gpu-1"]
    assert info.gpu_workers(node="node-b") == ["gpu-2", "gpu-3"]
    assert info.gateways == ("gateway-primary", "gateway-primary-2", "gateway-backup")
    assert info.gateway_names("primary") == ["gateway-primary"]


@pytest.mark.parametrize("qps", [50, 300, 800])
def test_a_chaos_run_lays_out_the_fleet_for_its_rate_when_asked(qps: float) -> None:
    """fleet_for_qps: the control's stack is plan_fleet's for the rate the run sends (qps
    capped at embedded_max_qps) and its traffic; false: the catalogue's reference layout."""
    configuration = {"qps": 5000, "embedded_max_qps": qps}
    fixed = RunSettings.from_configuration({**configuration, "fleet_for_qps": False}, {})
    assert isinstance(fixed.target_settings, EmbeddedSettings)
    assert _layout_of(fixed.target_settings) == (2, 1, 1)
    sized = RunSettings.from_configuration({**configuration, "fleet_for_qps": True}, {})
    layout = plan_fleet(qps, TrafficShape.of_laws(TrafficSpec()))
    assert isinstance(sized.target_settings, EmbeddedSettings)
    assert {k: getattr(sized.target_settings, k) for k in layout.sizes()} == layout.sizes()
    # smaller batches mean less per GPU: more of them
    small = RunSettings.from_configuration(
        {**configuration, "fleet_for_qps": True, "gpu_max_num_seqs": 128}, {}
    ).target_settings
    assert isinstance(small, EmbeddedSettings)
    assert small.gpu_workers >= layout.gpu_workers
    with pytest.raises(InvalidInput, match="fleet_for_qps: cannot be used with autoscale"):
        RunSettings.from_configuration(
            {**configuration, "fleet_for_qps": True, "autoscale": True}, {}
        )


@pytest.mark.parametrize(
    ("configuration", "fleet"),
    [
        ({"embedded_max_qps": 50}, False),  # the reference layout carries 50
        ({"embedded_max_qps": 51}, True),
        ({"embedded_max_qps": 1000}, True),
        ({"embedded_max_qps": 1000, "gpu_workers": 4}, False),  # laid out by hand
        ({"embedded_max_qps": 1000, "active_gateways": 2}, False),
        ({"embedded_max_qps": 1000, "fleet_for_qps": False}, False),
        ({"embedded_max_qps": 40, "fleet_for_qps": True}, True),
    ],
)
def test_auto_lays_out_a_fleet_past_the_reference_rate(
    configuration: dict[str, object], fleet: bool
) -> None:
    """fleet_for_qps unset (auto): a fleet when the run sends more than the reference layout
    carries (50 QPS) and the experiment does not lay the stack out itself."""
    settings = RunSettings.from_configuration({"qps": 5000, **configuration}, {})
    assert isinstance(settings.target_settings, EmbeddedSettings)
    layout = plan_fleet(settings.effective_qps, TrafficShape.of_laws(TrafficSpec()))
    sized = _layout_of(settings.target_settings) == (
        layout.gpu_workers,
        layout.gpus_per_node,
        layout.active_gateways,
    )
    assert sized == fleet


@pytest.mark.parametrize(("calibrated_qps", "gpu_workers"), [(1400, 32), (400, 14)])
def test_a_fleet_can_be_planned_with_more_headroom(calibrated_qps: float, gpu_workers: int) -> None:
    """kv_cache_surge's layout: 1,000 QPS asked, at most the machine's rate (embedded_max_qps
    stands in for a calibration), on GPUs planned at 45% of their saturation with a node lost:
    the 32 GPUs it laid out by hand at 1,000 QPS, and 28.6 QPS a GPU, about its 31.25, on a
    machine calibrated at 400. The default 60% lays out fewer."""
    configuration = {"qps": 1000, "embedded_max_qps": calibrated_qps, "fleet_for_qps": True}
    planned = RunSettings.from_configuration(
        {**configuration, "fleet_target_utilization": 0.45}, {}
    ).target_settings
    default = RunSettings.from_configuration(configuration, {}).target_settings
    assert isinstance(planned, EmbeddedSettings) and isinstance(default, EmbeddedSettings)
    assert (planned.gpu_workers, planned.gpus_per_node, planned.active_gateways) == (
        gpu_workers,
        2,
        2,
    )
    assert default.gpu_workers < planned.gpu_workers
    with pytest.raises(InvalidInput, match="fleet_target_utilization"):
        RunSettings.from_configuration({**configuration, "fleet_target_utilization": 0}, {})


@pytest.mark.parametrize("qps", [100, 1000])
def test_a_variant_without_the_backup_gateway_gets_one_gateway_in_a_fleet(qps: float) -> None:
    """no-backup-gateway's known fault is that nothing stands in for a crashed gateway: in a
    fleet, active-active gateways would, so it has one in all (and the rest of the fleet)."""
    configuration = {"qps": 5000, "embedded_max_qps": qps}
    hardened = RunSettings.from_configuration(configuration, {}).target_settings
    bad = RunSettings.from_configuration({**configuration, "variant": "no-backup-gateway"}, {})
    assert isinstance(hardened, EmbeddedSettings)
    assert isinstance(bad.target_settings, EmbeddedSettings)
    assert hardened.active_gateways >= 2 and bad.target_settings.active_gateways == 1
    assert bad.target_settings.gpu_workers == hardened.gpu_workers
    info = planned_info(bad.target_settings.stack_config())
    assert info.gateways == ("gateway-primary",)


def test_the_fleet_for_short_requests_is_sized_on_their_lengths() -> None:
    """Fixed prompt and answer lengths (`prompt_tokens: "10"`) size the fleet, not the default
    laws they replace: 1,500 QPS of 10-token prompts and 4-token answers fit on 4 GPUs, where
    the default traffic needs 36 (past this machine's 32: refused, naming the setting)."""
    short = {"prompt_tokens": "10", "context_tokens": 0, "output_tokens": "uniform:2:6"}
    base = {"qps": 1500, "embedded_max_qps": 1500, "fleet_for_qps": True}
    sized = RunSettings.from_configuration({**base, **short}, {}).target_settings
    assert isinstance(sized, EmbeddedSettings)
    assert sized.gpu_workers == plan_fleet(1500, TrafficShape(10, 4)).gpu_workers == 4
    with pytest.raises(InvalidInput, match=r"^fleet_for_qps: qps 1500: the fleet needs 36 GPU"):
        RunSettings.from_configuration(base, {})


@pytest.mark.parametrize(
    ("configuration", "short"),
    [
        ({"gpu_workers": 32}, ["active_gateways at 1"]),  # the fleet's GPUs, one gateway
        ({"active_gateways": 2}, ["gpu_workers at 2"]),
        ({"gpu_workers": 4, "active_gateways": 2, "cpu_workers": 1}, []),  # an overload, set
        ({"gpu_workers": 32, "gpus_per_node": 2, "active_gateways": 2}, []),  # laid out in full
        ({"gpu_workers": 32, "variant": "no-backup-gateway"}, []),  # one gateway is its fault
        ({}, []),  # the fleet
        ({"embedded_max_qps": 50, "gpu_workers": 1}, []),  # the reference rate
        ({"gpu_workers": 1, "autoscale": True}, []),  # the autoscaler sizes the pool
    ],
)
def test_a_layout_set_by_hand_short_of_the_rate_is_named(
    configuration: dict[str, object], short: list[str]
) -> None:
    """Setting one layout field keeps the reference layout's others (auto: no fleet), so
    1,000 QPS would go through one gateway without a word: the run notes what is short."""
    settings = RunSettings.from_configuration(
        {"qps": 5000, "embedded_max_qps": 1000, **configuration}, {}
    )
    assert settings.target_settings is not None
    qps = settings.effective_qps * settings.peak_factor
    notes = target_kind("embedded").layout_notes(settings.target_settings, qps, settings.traffic)
    assert len(notes) == (1 if short else 0)
    for field in short:
        assert field in notes[0]
    if notes:
        assert f"the {qps:g} QPS this run sends" in notes[0]


def _layout_of(settings: EmbeddedSettings) -> tuple[int, int, int]:
    return (settings.gpu_workers, settings.gpus_per_node, settings.active_gateways)


def test_an_uneven_last_node_holds_the_rest() -> None:
    layout = node_layout(StackConfig(gpu_workers=5, gpus_per_node=2, cpu_workers=0))
    assert [len(workers) for _, workers in layout] == [2, 2, 1]


def test_nodes_past_node_z_are_named_like_spreadsheet_columns() -> None:
    # the most GPU workers, one per node, plus the CPU node: 33 nodes (was an IndexError)
    layout = node_layout(StackConfig(gpu_workers=MAX_GPU_WORKERS, gpus_per_node=1, cpu_workers=1))
    names = [node for node, _ in layout]
    assert len(set(names)) == len(names) == MAX_GPU_WORKERS + 1
    assert names[24:] == ["node-y", "node-z", "node-aa", "node-ab", "node-ac", "node-ad",
                          "node-ae", "node-af", "node-ag"]  # fmt: skip
    assert layout[-1][1][0] == ("cpu-0", "cpu")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("gpus_per_node", 0, "gpus_per_node: expected an integer >= 1"),
        ("gpus_per_node", 9, "gpus_per_node: expected at most 8"),
        ("active_gateways", 0, "active_gateways: expected an integer >= 1"),
        ("active_gateways", 9, "active_gateways: expected at most 8"),
        ("cpu_workers", 21, "cpu_workers: expected at most 20"),
    ],
)
def test_stack_config_limits(field: str, value: int, expected: str) -> None:
    with pytest.raises(InvalidInput, match=expected):
        StackConfig(**{field: value})  # type: ignore[arg-type]


def test_stack_up_qps_past_this_machine_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["stack", "up", "--qps", "5000", "--state-root", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "--qps 5000" in captured.err and f"at most {MAX_GPU_WORKERS}" in captured.err
    assert not captured.out, "nothing is laid out for a fleet that is refused"
    assert not list(tmp_path.iterdir()), "nothing may be started or written for bad input"
    assert main(["stack", "up", "--qps", "0", "--state-root", str(tmp_path)]) == 2
    assert "--qps: expected a rate" in capsys.readouterr().err


@pytest.mark.slow
def test_the_fleet_for_60_qps_serves_and_a_partition_takes_exactly_one_node(  # type: ignore[no-untyped-def]
    stack_factory, needs_netns
) -> None:
    layout = plan_fleet(60, SEED)
    assert (layout.gpu_nodes, layout.gpus_per_node, layout.cpu_workers) == (2, 2, 1)
    assert layout.active_gateways == 2
    stack: Topology = stack_factory(**layout.sizes())
    assert [(n.name, [w.name for w in n.workers]) for n in stack.nodes] == [
        ("node-a", ["gpu-0", "gpu-1"]),
        ("node-b", ["gpu-2", "gpu-3"]),
        ("node-c", ["cpu-0"]),
    ]
    token = valid_token(stack)
    replies = [chat(stack.gateway_url, token) for _ in range(40)]
    assert all(r.status == 200 for r in replies), [r.status for r in replies]
    assert {r.gateway for r in replies} == {"gateway-primary", "gateway-primary-2"}
    assert {r.worker for r in replies} == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}

    node_a = stack.node("node-a")
    assert node_a.netns
    netns.partition_namespace(node_a.netns)
    try:
        cut = [w.name for w in stack.nodes[0].workers + stack.nodes[1].workers if _silent(w.url)]
        assert cut == ["gpu-0", "gpu-1"], "a node partition takes exactly its own workers"
        replies = [chat(stack.gateway_url, token) for _ in range(30)]
        assert all(r.status == 200 for r in replies), [r.status for r in replies]
        assert {r.worker for r in replies[-15:]} == {"gpu-2", "gpu-3"}
    finally:
        netns.heal_partition(node_a.netns)


def _silent(url: str) -> bool:
    """True when the worker's /healthz times out (a partition), not answers or refuses."""
    started = time.monotonic()
    return http_get_status(f"{url}/healthz", 1.0) is None and time.monotonic() - started >= 0.9


def test_a_burst_experiment_starts_under_the_cap_on_a_fleet_for_its_peak() -> None:
    """peak_factor 2 (burst_during_failover): half the cap, the fleet for the whole cap."""
    settings = RunSettings.from_configuration(
        {"qps": 5000, "embedded_max_qps": 600, "peak_factor": 2}, {}
    )
    assert settings.effective_qps == 300
    assert isinstance(settings.target_settings, EmbeddedSettings)
    peak = plan_fleet(600, TrafficShape.of_laws(TrafficSpec()))
    assert _layout_of(settings.target_settings) == (
        peak.gpu_workers,
        peak.gpus_per_node,
        peak.active_gateways,
    )
