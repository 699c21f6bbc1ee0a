"""RunSettings from configuration and environment; the fault ledger on disk."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from llmchaos.errors import InvalidInput, StackError
from llmchaos.ledger import FaultLedger, Undo
from llmchaos.load.config import INFLIGHT_CAP
from llmchaos.load.traffic import TrafficSpec
from llmchaos.settings import SETTING_RANGES, RunSettings
from llmchaos.targets.embedded import REFERENCE_QPS, EmbeddedSettings


def test_configuration_wins_over_environment_over_default() -> None:
    settings = RunSettings.from_configuration(
        {"qps": 5000, "sla_s": "30"}, {"LLMCHAOS_SLA_S": "99", "LLMCHAOS_VARIANT": "naive-cache"}
    )
    assert settings.qps == 5000.0 and settings.sla_s == 30.0
    assert settings.variant == "naive-cache"
    assert settings.p99_slo_ms == RunSettings().p99_slo_ms


def test_embedded_qps_is_capped_and_cluster_qps_is_not() -> None:
    # no calibration cached (tests/conftest.py): the reference layout's rate
    assert RunSettings(qps=5000).effective_qps == REFERENCE_QPS
    capped = RunSettings.from_configuration({"qps": 5000, "embedded_max_qps": 300}, {})
    assert capped.effective_qps == 300
    assert RunSettings(qps=40).effective_qps == 40
    # a burst to twice the rate must fit under the cap too
    burst = RunSettings.from_configuration(
        {"qps": 5000, "embedded_max_qps": 300, "peak_factor": 2}, {}
    )
    assert burst.effective_qps == 150
    # a run beside another on one machine takes its share of the cap, or of the machine's rate
    half = RunSettings.from_configuration(
        {"qps": 5000, "embedded_max_qps": 300}, {"LLMCHAOS_MACHINE_SHARE": "0.5"}
    )
    assert half.effective_qps == 150
    assert (
        RunSettings.from_configuration({"qps": 5000, "machine_share": 0.5}, {}).effective_qps
        == REFERENCE_QPS / 2
    )
    k8s = RunSettings.from_configuration(
        {"target": "k8s", "qps": 5000, "k8s_allowed_namespaces": "llm", "k8s_namespace": "llm"}, {}
    )
    assert k8s.effective_qps == 5000


def test_the_load_holds_no_send_back_before_the_request_timeout_at_the_runs_peak() -> None:
    # the embedded cap is the peak (set_qps stops there): 1,200 QPS x 8 s x 1.1 on one process
    fleet = RunSettings.from_configuration({"qps": 200, "embedded_max_qps": 1200}, {})
    assert fleet.load_processes == 1
    assert fleet.load_inflight_cap == 10560
    # no cap: the rate times peak_factor, shared by the processes (3 at 6,000 QPS)
    k8s = RunSettings.from_configuration(
        {
            "target": "k8s",
            "qps": 6000,
            "peak_factor": 2,
            "request_timeout_s": 5,
            "k8s_allowed_namespaces": "llm",
            "k8s_namespace": "llm",
        },
        {},
    )
    assert k8s.load_processes == 3
    assert k8s.load_inflight_cap == 22000
    # the uncalibrated embedded cap (50 QPS, tests/conftest.py) keeps the load's own default
    assert RunSettings(qps=40).load_inflight_cap == INFLIGHT_CAP


@pytest.mark.parametrize(
    ("configuration", "environ", "message"),
    [
        ({"qps": 0}, {}, "qps: expected a number > 0 and <= 1,000,000, got 0"),
        ({"qps": 1e9}, {}, "qps: expected a number > 0 and <= 1,000,000, got 1,000,000,000"),
        ({"qps": 1e300 * 1e300}, {}, "configuration.qps: expected a number, got inf"),
        (
            {},
            {"LLMCHAOS_EMBEDDED_MAX_QPS": "1e9"},
            "LLMCHAOS_EMBEDDED_MAX_QPS: expected a number > 0 and <= 20,000, got 1,000,000,000",
        ),
        ({"warmup_s": 1e12}, {}, "warmup_s: expected a number within 0..3,600"),
        ({"warmup_s": 600, "max_duration_s": 300}, {}, "warmup_s: expected less than"),
        (
            {
                "target": "k8s",
                "qps": 500_000,
                "k8s_allowed_namespaces": "llm",
                "k8s_namespace": "llm",
            },
            {},
            "qps: 500,000 needs 200 load processes on this machine",
        ),
        ({"tenants": 0}, {}, "tenants: expected a number within 1..100,000, got 0"),
        ({"duration": 60}, {}, "configuration.duration: not a setting; did you mean"),
        ({"k8s": {"namespace": "x"}}, {}, "configuration.k8s: not a setting"),
        ({"qps": "lots"}, {}, "configuration.qps: expected a number, got 'lots'"),
        ({}, {"LLMCHAOS_QPS": "-5"}, "LLMCHAOS_QPS: expected a number > 0"),
        ({"variant": "shiny"}, {}, "unknown variant 'shiny'"),
        ({"sla": 45}, {}, "configuration.sla: not a setting; did you mean 'sla_s'?"),
        ({"target": "mars"}, {}, "target: expected one of embedded, k8s"),
        ({"error_rate_slo": 2}, {}, "error_rate_slo: expected a number within 0..1"),
        ({"error_classes": "5xx,teapot"}, {}, "error_classes: unknown class(es) teapot"),
        ({"gpu_workers": 1.5}, {}, "configuration.gpu_workers: expected a whole number"),
    ],
)
def test_bad_settings_name_the_key(
    configuration: dict[str, object], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidInput) as raised:
        RunSettings.from_configuration(configuration, environ)
    assert message in str(raised.value)


def test_configuration_keys_the_experiment_uses_itself_are_allowed() -> None:
    configuration = {"my_team": "sre", "dashboard_url": "http://x"}
    with pytest.raises(InvalidInput, match=r"configuration\.my_team: not a setting"):
        RunSettings.from_configuration(configuration, {})
    RunSettings.from_configuration(configuration, {}, other_keys={"my_team", "dashboard_url"})


@pytest.mark.parametrize(
    ("cls", "ranges"),
    [
        (RunSettings, SETTING_RANGES),
        (TrafficSpec, TrafficSpec.RANGES),
        (EmbeddedSettings, EmbeddedSettings.RANGES),
    ],
    ids=["run", "traffic", "embedded"],
)
def test_every_number_of_the_settings_has_a_range(cls: type, ranges: dict[str, object]) -> None:
    hints = typing.get_type_hints(cls)
    numbers = [f.name for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]
    assert sorted(numbers) == sorted(ranges)


def test_the_ledger_holds_the_fault_before_the_action_runs(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        on_disk = [json.loads(line) for line in ledger.path.read_text().splitlines()]
        assert on_disk[0]["event"] == "inject" and on_disk[0]["undo"]["op"] == "heal_partition"
    (entry,) = ledger.entries()
    assert entry.state == "injected" and entry.open


def test_a_failed_action_stays_open_and_everything_is_undone_newest_first(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        pass
    with ledger.inject("kill_gpu_process", "gpu-0", None):
        pass
    with (
        pytest.raises(StackError),
        ledger.inject("crash_gateway", "gw", Undo("restore_gateway", {"gateway": "gw"})),
    ):
        raise StackError("half done")
    assert [e.state for e in ledger.entries()] == ["injected", "injected", "failed"]
    undone: list[Undo] = []
    lines = ledger.undo_all(undone.append, by="test")
    assert [u.op for u in undone] == ["restore_gateway", "heal_partition"]
    assert len(lines) == 2 and not ledger.open_faults()
    assert ledger.undo_all(undone.append, by="again") == []


def test_a_failing_undo_is_reported_and_stays_open(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        pass

    def broken(_undo: Undo) -> None:
        raise StackError("iptables is gone")

    (line,) = ledger.undo_all(broken, by="test")
    assert "undo FAILED: iptables is gone" in line
    assert len(ledger.open_faults()) == 1


def test_a_fault_that_acts_for_a_while_keeps_how_long(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    assert ledger.active_until() is None
    with ledger.inject("long_prompt_surge", "4 long prompts/s for 15 s", None, lasts_s=15.0):
        pass
    with ledger.inject("kill_gpu_process", "gpu-0", None):
        pass
    surge, kill = ledger.entries()
    assert surge.active_until == surge.at + 15.0 and kill.active_until == kill.at
    # the surge outlasts the later kill: recovery is judged until it stops
    assert ledger.active_until() == surge.at + 15.0
    assert "lasts_s" not in ledger.path.read_text().splitlines()[-2]  # the kill's inject
    # the surge's last answer came 12 s after it stopped sending; an earlier one changes nothing
    ledger.record_acted_until(surge.id, surge.at + 27.0)
    ledger.record_acted_until(surge.id, surge.at + 3.0)
    assert ledger.entries()[0].lasts_s == 27.0


def test_a_line_cut_off_by_a_kill_is_skipped(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        pass
    with ledger.path.open("a") as f:
        f.write('{"event": "undone", "id": 1, "a')
    assert len(ledger.open_faults()) == 1


def test_faults_injected_from_several_threads_all_keep_their_own_entry(tmp_path: Path) -> None:
    import threading

    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    barrier = threading.Barrier(8)

    def inject(i: int) -> None:
        barrier.wait()
        with ledger.inject("partition_node", f"node-{i}", Undo("heal_partition", {"node": i})):
            pass

    threads = [threading.Thread(target=inject, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = ledger.entries()
    assert sorted(e.id for e in entries) == list(range(1, 9))
    assert len(ledger.open_faults()) == 8


def test_a_record_after_a_cut_off_line_is_not_lost(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with ledger.inject("partition_node", "node-a", Undo("heal_partition", {"node": "node-a"})):
        pass
    with ledger.path.open("a") as f:
        f.write('{"event": "undone", "id": 1, "a')  # killed mid-write
    ledger.mark_undone(1, by="cleanup")
    assert not ledger.open_faults()


def test_an_unexpected_error_in_one_undo_does_not_stop_the_others(tmp_path: Path) -> None:
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    for node in ("node-a", "node-b"):
        with ledger.inject("partition_node", node, Undo("heal_partition", {"node": node})):
            pass

    def undo(u: Undo) -> None:
        if u.args["node"] == "node-b":
            raise TypeError("bad arguments")

    lines = ledger.undo_all(undo, by="test")
    assert "undo FAILED: bad arguments" in lines[0] and "undone by test" in lines[1]
    assert [e.target for e in ledger.open_faults()] == ["node-b"]
