"""Bad experiments fail before anything starts, with a message naming the field."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, chaos_run
from llmchaos.validation import validate_experiment_file

EXPERIMENTS = sorted((REPO / "experiments").glob("*.json"))
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


CASES: list[tuple[str, Mutation, str]] = [
    ("unknown worker", _set_worker, "unknown GPU worker 'gpu-9'; GPU workers: gpu-0, gpu-1"),
    ("unknown node", _set_node, "unknown node 'node-z'; nodes: node-a, node-b, node-c"),
    ("qps <= 0", _set_qps, "qps: expected a number > 0, got 0"),
    ("unknown variant", _set_variant, "unknown variant 'shiny'; expected one of: hardened"),
    (
        "missing tolerance",
        _drop_tolerance,
        "steady-state-hypothesis.probes[1] 'p99-latency-within-slo': missing tolerance",
    ),
    ("unknown argument", _bad_argument, "'kill-gpu-0-process'.arguments: got an unexpected"),
    ("wrong type", _bad_type, "arguments.window_s: expected float, got 'five'"),
    ("unknown function", _bad_func, "actions.gpu has no function 'kill_gpu'; it has: kill_gpu"),
    ("no control", _no_control, "controls: the llmchaos probes and actions need the control"),
    ("typo in a setting", _typo_setting, "configuration.sla: not a setting; did you mean 'sla_s'"),
]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_the_catalogue_is_valid(path: Path) -> None:
    assert validate_experiment_file(path) == []


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_experiment_names_the_field(tmp_path: Path, mutate: Mutation, message: str) -> None:
    experiment = json.loads(GPU_KILL.read_text())
    mutate(experiment)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(experiment))
    problems = validate_experiment_file(path)
    assert any(message in p for p in problems), problems


def test_unreadable_and_non_json_files_are_one_line(tmp_path: Path) -> None:
    assert validate_experiment_file(tmp_path / "missing.json") == [
        "cannot read the file: No such file or directory"
    ]
    broken = tmp_path / "broken.json"
    broken.write_text('{"title": ')
    (problem,) = validate_experiment_file(broken)
    assert problem.startswith("not JSON: ")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_worker, "unknown GPU worker 'gpu-9'"),
        (_set_variant, "unknown variant 'shiny'"),
        (_set_qps, "qps: expected a number > 0"),
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
