"""Bad experiments fail before anything starts, with a message naming the field."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaoslib.configuration import load_configuration
from chaoslib.exceptions import InterruptExecution
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CI_EXPERIMENT_ENV, REPO, chaos_run
from llmchaos import control
from llmchaos.run import ChaosRun
from llmchaos.settings import RunSettings
from llmchaos.targets.embedded import EmbeddedSettings
from llmchaos.validation import validate_experiment_file

EXPERIMENTS = sorted((REPO / "experiments").glob("*.json")) + sorted(
    (REPO / "experiments" / "soak").glob("*.json")
)
GPU_KILL = REPO / "experiments" / "gpu_kill.json"

Mutation = Callable[[dict[str, Any]], None]


def _method_args(e: dict[str, Any]) -> dict[str, Any]:
    return e["method"][0]["provider"]["arguments"]


def _set_worker(e: dict[str, Any]) -> None:
    _method_args(e)["worker"] = "gpu-9"


def _set_node(e: dict[str, Any]) -> None:
    _method_args(e).pop("worker")
    _method_args(e)["node"] = "node-z"


def _set_qps(e: dict[str, Any]) -> None:
    e["configuration"]["qps"] = 0


def _set_variant(e: dict[str, Any]) -> None:
    e["configuration"]["variant"] = "shiny"


def _drop_tolerance(e: dict[str, Any]) -> None:
    del e["steady-state-hypothesis"]["probes"][1]["tolerance"]


def _bad_argument(e: dict[str, Any]) -> None:
    _method_args(e)["workers"] = "gpu-0"


def _bad_type(e: dict[str, Any]) -> None:
    e["steady-state-hypothesis"]["probes"][1]["provider"]["arguments"]["window_s"] = "five"


def _bad_func(e: dict[str, Any]) -> None:
    e["method"][0]["provider"]["func"] = "kill_gpu"


def _no_control(e: dict[str, Any]) -> None:
    e["controls"] = []


def _typo_setting(e: dict[str, Any]) -> None:
    e["configuration"]["sla"] = 45


def _sla_literal(e: dict[str, Any]) -> None:
    tolerance = e["steady-state-hypothesis"]["probes"][0]["tolerance"]
    tolerance["provider"]["arguments"]["limit"] = 30


def _drain_here(e: dict[str, Any]) -> None:
    provider = {"type": "python", "module": "actions.node", "func": "drain_node"}
    provider["arguments"] = {"node": "node-a"}
    e["method"].append({"type": "action", "name": "drain", "provider": provider})


def _huge_qps(e: dict[str, Any]) -> None:
    e["configuration"]["qps"] = 1e9


def _unknown_key(e: dict[str, Any]) -> None:
    e["configuration"]["duration"] = 60


def _burst(e: dict[str, Any], **arguments: float) -> None:
    provider = {"type": "python", "module": "actions.load", "func": "inject_burst"}
    e["method"].append({"type": "action", "name": "burst", "provider": provider})
    provider["arguments"] = arguments


def _endless_burst(e: dict[str, Any]) -> None:
    _burst(e, duration_s=1e12, factor=1.0)


def _huge_factor(e: dict[str, Any]) -> None:
    _burst(e, duration_s=10, factor=1e6)


def _bad_foreign(e: dict[str, Any]) -> None:
    e["extensions"][0]["foreign_configuration"] = "prometheus_base_url"


CASES: list[tuple[str, Mutation, str]] = [
    ("unknown worker", _set_worker, "unknown GPU worker 'gpu-9'; GPU workers: gpu-0, gpu-1"),
    ("unknown node", _set_node, "unknown node 'node-z'; nodes: node-a, node-b, node-c"),
    ("qps <= 0", _set_qps, "configuration.qps: expected a number > 0 and <= 1,000,000, got 0"),
    (
        "SLA twice",
        _sla_literal,
        "'recovered-within-sla'.tolerance: limit 30 disagrees with sla_s = 10",
    ),
    ("drain on embedded", _drain_here, "drain_node needs a target with nodes to drain"),
    ("qps too high", _huge_qps, "configuration.qps: expected a number > 0 and <= 1,000,000"),
    ("unknown key", _unknown_key, "configuration.duration: not a setting; did you mean"),
    ("endless burst", _endless_burst, "arguments.duration_s: expected a number > 0 and <= 900"),
    ("huge factor", _huge_factor, "arguments.factor: expected a number > 0 and <= 100, got"),
    ("bad foreign list", _bad_foreign, "extensions.llmchaos.foreign_configuration: expected"),
    ("unknown variant", _set_variant, "unknown variant 'shiny'; expected one of: hardened"),
    (
        "missing tolerance",
        _drop_tolerance,
        "steady-state-hypothesis.probes[1] 'p99-latency-within-slo': missing tolerance",
    ),
    ("unknown argument", _bad_argument, "'kill-gpu-0-process'.arguments: got an unexpected"),
    ("wrong type", _bad_type, "arguments.window_s: expected float, got 'five'"),
    (
        "unknown function",
        _bad_func,
        "actions.gpu has no function 'kill_gpu'; it has: clear_gpu_fault, gpu_errors, "
        "hang_gpu_process, kill_gpu_process",
    ),
    ("no control", _no_control, "controls: the llmchaos probes and actions need the control"),
    ("typo in a setting", _typo_setting, "configuration.sla: not a setting; did you mean 'sla_s'"),
]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_the_catalogue_is_valid(path: Path) -> None:
    assert validate_experiment_file(path) == []


def test_ci_shortens_experiments_by_settings_they_read() -> None:
    """A CI setting that its experiment does not read would shorten nothing, silently: each
    entry of CI_EXPERIMENT_ENV names a catalogue experiment and environment keys that its
    configuration reads, or that name a setting of the embedded target its configuration
    leaves to the environment (LLMCHAOS_MACHINE_SHARE)."""
    assert "machine_share" in {f.name for f in dataclasses.fields(EmbeddedSettings)}
    for name, env in CI_EXPERIMENT_ENV.items():
        path = REPO / "experiments" / f"{name}.json"
        assert path.exists(), f"CI_EXPERIMENT_ENV: no experiment {name}"
        configuration = json.loads(path.read_text())["configuration"]
        read = {v["key"] for v in configuration.values() if isinstance(v, dict) and "key" in v}
        if "machine_share" not in configuration:
            read.add("LLMCHAOS_MACHINE_SHARE")
        assert set(env) <= read, f"{name} does not read {sorted(set(env) - read)}"


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_experiment_names_the_field(tmp_path: Path, mutate: Mutation, message: str) -> None:
    experiment = json.loads(GPU_KILL.read_text())
    mutate(experiment)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(experiment))
    problems = validate_experiment_file(path)
    assert any(message in p for p in problems), problems


NOT_AN_EXPERIMENT = [
    ("empty.json", "", "empty file; expected a Chaos Toolkit experiment"),
    ("blank.yaml", "\n\n", "empty file; expected a Chaos Toolkit experiment"),
    ("list.json", "[1, 2]", "a list, not an object; expected a Chaos Toolkit experiment"),
    ("number.json", "42", "a number, not an object"),
    ("null.json", "null", "null, not an object"),
    ("list.yaml", "- a\n- b\n", "a list, not an object"),
    ("broken.json", '{"title": ', "not JSON: "),
    ("broken.yaml", "title: [unclosed\n", "not YAML (line 2): "),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("experiment.txt", "{}", "Chaos Toolkit reads .json, .yaml and .yml experiments, not '.txt'"),
]


def test_unreadable_and_non_json_files_are_one_line(tmp_path: Path) -> None:
    assert validate_experiment_file(tmp_path / "missing.json") == [
        "cannot read the file: No such file or directory"
    ]
    for name, text, message in NOT_AN_EXPERIMENT:
        path = tmp_path / name
        path.write_text(text)
        (problem,) = validate_experiment_file(path)
        assert problem.startswith(message), (name, problem)


@pytest.mark.parametrize(
    ("name", "text", "message"), NOT_AN_EXPERIMENT, ids=[c[0] for c in NOT_AN_EXPERIMENT]
)
def test_chaos_run_says_the_same_in_one_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    """Chaos Toolkit itself prints a traceback for most of these; the llmchaos plugin of its
    command line gives the line `llmchaos validate` gives."""
    path = tmp_path / name
    path.write_text(text)
    result = chaos_run(path, tmp_path / "journal.json", timeout_s=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{path}: {message}" in result.stderr


def test_a_yaml_experiment_is_checked_like_its_json_twin(tmp_path: Path) -> None:
    experiment = json.loads(GPU_KILL.read_text())
    path = tmp_path / "gpu_kill.yaml"
    path.write_text(yaml.safe_dump(experiment))
    assert validate_experiment_file(path) == []
    _set_worker(experiment)
    path.write_text(yaml.safe_dump(experiment))
    assert any("unknown GPU worker 'gpu-9'" in p for p in validate_experiment_file(path))


def test_keys_for_other_extensions_are_declared(tmp_path: Path) -> None:
    experiment = json.loads(GPU_KILL.read_text())
    experiment["configuration"]["prometheus_base_url"] = "http://prometheus:9090"
    path = tmp_path / "with_prometheus.json"
    path.write_text(json.dumps(experiment))
    (problem,) = validate_experiment_file(path)
    assert problem.startswith("configuration.prometheus_base_url: not a setting")
    experiment["extensions"][0]["foreign_configuration"] = ["prometheus_base_url"]
    path.write_text(json.dumps(experiment))
    assert validate_experiment_file(path) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_worker, "unknown GPU worker 'gpu-9'"),
        (_set_variant, "unknown variant 'shiny'"),
        (_set_qps, "qps: expected a number > 0 and <= 1,000,000"),
    ],
    ids=["worker", "variant", "qps"],
)
def test_chaos_run_stops_before_anything_starts(
    tmp_path: Path, mutate: Mutation, message: str
) -> None:
    experiment = copy.deepcopy(json.loads(GPU_KILL.read_text()))
    mutate(experiment)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(experiment))
    runs_before = set((REPO / "reports" / "runs").glob("*"))
    result = chaos_run(path, tmp_path / "journal.json", timeout_s=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert message in result.stderr
    journal = json.loads((tmp_path / "journal.json").read_text())
    assert journal["status"] == "interrupted"
    assert journal["run"] == []  # no action ran
    assert "llmchaos: starting" not in result.stderr
    assert set((REPO / "reports" / "runs").glob("*")) == runs_before  # no run was opened


def test_llmchaos_validate_command(tmp_path: Path) -> None:
    experiment = json.loads(GPU_KILL.read_text())
    _set_worker(experiment)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(experiment))
    llmchaos = str(Path(sys.executable).with_name("llmchaos"))
    good = subprocess.run(
        [llmchaos, "validate", str(GPU_KILL)], capture_output=True, text=True, timeout=60
    )
    assert (good.returncode, good.stdout.strip()) == (0, f"{GPU_KILL}: ok")
    result = subprocess.run(
        [llmchaos, "validate", str(GPU_KILL), str(bad)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert f"{bad}: INVALID" in result.stdout and "gpu-9" in result.stdout


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside the JSON document."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3)
    ),
    max_leaves=5,
)
BASE = json.loads(GPU_KILL.read_text())
PATHS = _paths(BASE)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(PATHS), value=json_values, delete=st.booleans())
def test_mutated_experiments_give_clear_errors_never_a_traceback(
    tmp_path: Path, path: tuple[Any, ...], value: Any, delete: bool
) -> None:
    experiment = copy.deepcopy(BASE)
    parent = experiment
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    target = tmp_path / "mutated.json"
    target.write_text(json.dumps(experiment))
    problems = validate_experiment_file(target)  # must not raise
    for problem in problems:
        assert isinstance(problem, str) and problem.strip()
        assert "Traceback" not in problem


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(worker=st.text(min_size=1).filter(lambda w: w not in ("gpu-0", "gpu-1", "*")))
def test_any_unknown_worker_is_named(tmp_path: Path, worker: str) -> None:
    experiment = copy.deepcopy(BASE)
    _method_args(experiment)["worker"] = worker
    target = tmp_path / "mutated.json"
    target.write_text(json.dumps(experiment))
    problems = validate_experiment_file(target)
    assert any("unknown GPU worker" in p and "method[0]" in p for p in problems), problems


def test_chaos_validate_accepts_the_catalogue() -> None:
    chaos = str(Path(sys.executable).with_name("chaos"))
    for path in EXPERIMENTS:
        done = subprocess.run(
            [chaos, "validate", str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{path.name}: {done.stderr[-2000:]}"
        assert "experiment syntax and semantic look valid" in done.stderr


def test_slos_and_slas_from_the_environment_are_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # env entries and --var give strings: "${sla_s}" reaches the tolerance as "45"
    monkeypatch.setenv("LLMCHAOS_SLA_S", "45")
    monkeypatch.setenv("LLMCHAOS_P99_SLO_MS", "2500")
    assert validate_experiment_file(GPU_KILL) == []
    monkeypatch.setenv("LLMCHAOS_SLA_S", "soon")
    problems = validate_experiment_file(GPU_KILL)
    assert any("sla_s: expected a number, got 'soon'" in p for p in problems), problems


class _Opened(Exception):
    """The control got past every check and opened the run."""


setting_values = (
    st.none()
    | st.booleans()
    | st.integers(-(10**15), 10**15)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["1e9", "-0", "nan", "inf", "5000", "hardened", "k8s", "0x10", "1_000"])
    | st.lists(st.integers(), max_size=2)
)
SETTING_KEYS = [*sorted(f.name for f in dataclasses.fields(RunSettings)), "duration", "sla", "x"]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.dictionaries(st.sampled_from(SETTING_KEYS), setting_values, max_size=3))
def test_fuzzed_configurations_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any]
) -> None:
    """Whatever the configuration, `llmchaos validate` gives lines, never a traceback; and
    the control, given the same experiment under `chaos run`, refuses with the same words
    before it opens a run (let alone starts a stack) whenever the file is invalid."""
    experiment = copy.deepcopy(BASE)
    experiment["configuration"].update(changes)
    path = tmp_path / "fuzzed.json"
    path.write_text(json.dumps(experiment))
    for name in [*changes, "target", "variant", "qps", "sla_s"]:
        monkeypatch.delenv(f"LLMCHAOS_{name.upper()}", raising=False)
    problems = validate_experiment_file(path)  # must not raise
    assert all(p.strip() and "Traceback" not in p for p in problems)

    def must_not_open(*args: Any, **kwargs: Any) -> None:
        raise _Opened

    monkeypatch.setattr(ChaosRun, "open", must_not_open)
    try:
        configuration = load_configuration(experiment["configuration"])
    except Exception:  # Chaos Toolkit itself stops there, before any control
        return
    with pytest.raises(InterruptExecution) as refused:
        control.before_experiment_control(experiment, configuration, name="fuzzed")
    message = str(refused.value)
    opened = "_Opened" in message
    ours = [p for p in problems if not p.startswith("Chaos Toolkit")]
    assert opened == (not ours), (message, problems)
    if not opened:
        assert any(p in message for p in ours), (message, ours)
