"""Check an experiment before anything starts, and say exactly what is wrong and where.

Chaos Toolkit validates the experiment's shape; this checks what it cannot know: that every
probe and action of ours exists and gets arguments its function accepts, with values of the
right type; that the workers, nodes and gateways named exist on the target; that rates and
durations make sense; that every steady-state probe has a tolerance. Each problem names its
place (`method[0] 'kill-gpu-0'.arguments.worker`), the value and what would be right.

Activities are found by the module they name, as Chaos Toolkit does, so this module imports
no probe or action itself.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaoslib import substitute
from chaoslib.configuration import load_configuration
from chaoslib.exceptions import ChaosException
from chaoslib.experiment import ensure_experiment_is_valid

from llmchaos.errors import InvalidInput
from llmchaos.experiment_file import read_experiment
from llmchaos.faults import DIRECTIONS
from llmchaos.report.score import SEVERITY_POINTS
from llmchaos.run import planned_target
from llmchaos.settings import ERROR_CLASSES, RunSettings, argument_ranges, as_number
from llmchaos.targets import TargetInfo, target_kind

__all__ = [
    "OUR_MODULES",
    "SEVERITIES",
    "ExperimentMeta",
    "check_experiment",
    "experiment_meta",
    "other_configuration_keys",
    "validate_experiment_file",
]

SEVERITIES = ("blocker", "critical", "normal", "minor", "trivial")
_REGISTRY_FAULTS = ("kill_registry_member", "partition_registry_member", "restore_registry")
_SHAPED_ARGUMENTS = ("delay_ms", "jitter_ms", "loss_percent", "rate_kbit")
"""degrade_network's arguments a target may refuse one by one (TargetInfo.refused_argument)."""
"""Allure's severity levels, which the suites report experiments under."""


@dataclass(frozen=True)
class ExperimentMeta:
    """The experiment's `extensions` entry named "llmchaos": how the suites treat it.

    "extensions": [{"name": "llmchaos", "fault_type": "gpu", "severity": "critical",
                    "negative_controls": ["no-failover"]}]
    """

    fault_type: str = "other"
    """What kind of thing breaks (gpu, network, gateway, auth-cache): the report's feature."""
    severity: str = "normal"
    """One of SEVERITIES: how bad it is when this experiment fails."""
    negative_controls: tuple[str, ...] = ()
    """Known-bad variants the experiment must FAIL against (its probes can fail)."""
    foreign_configuration: tuple[str, ...] = ()
    """Configuration keys read by other Chaos Toolkit extensions (not llmchaos settings and
    not used as `${key}`), which would otherwise be refused as unknown settings."""


def experiment_meta(experiment: dict[str, Any]) -> ExperimentMeta:
    """The llmchaos extension of `experiment`; raises InvalidInput naming the field."""
    entries = [
        e
        for e in experiment.get("extensions") or []
        if isinstance(e, dict) and e.get("name") == "llmchaos"
    ]
    if not entries:
        return ExperimentMeta()
    entry = entries[0]
    fault_type = entry.get("fault_type", "other")
    severity = entry.get("severity", "normal")
    negatives = entry.get("negative_controls", [])
    foreign = entry.get("foreign_configuration", [])
    if not isinstance(foreign, list) or not all(isinstance(v, str) for v in foreign):
        raise InvalidInput(
            "extensions.llmchaos.foreign_configuration: expected a list of configuration keys, "
            f"got {foreign!r}"
        )
    if not isinstance(fault_type, str) or not fault_type:
        raise InvalidInput(f"extensions.llmchaos.fault_type: expected a name, got {fault_type!r}")
    if severity not in SEVERITIES:
        raise InvalidInput(
            f"extensions.llmchaos.severity: expected one of {', '.join(SEVERITIES)}, "
            f"got {severity!r}"
        )
    slo_severity = entry.get("slo_severity", {})
    if not isinstance(slo_severity, dict) or not all(
        v in SEVERITY_POINTS for v in slo_severity.values()
    ):
        raise InvalidInput(
            "extensions.llmchaos.slo_severity: expected {probe name: critical or warning} "
            f"(the resilience score's weights), got {slo_severity!r}"
        )
    if not isinstance(negatives, list) or not all(isinstance(v, str) for v in negatives):
        raise InvalidInput(
            f"extensions.llmchaos.negative_controls: expected a list of variants, got {negatives!r}"
        )
    return ExperimentMeta(fault_type, severity, tuple(negatives), tuple(foreign))


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def other_configuration_keys(experiment: dict[str, Any]) -> set[str]:
    """Configuration keys the experiment uses for itself: `${key}` anywhere outside its
    configuration, and the llmchaos extension's `foreign_configuration`. InvalidInput when
    that extension is malformed."""
    body = {k: v for k, v in experiment.items() if k != "configuration"}
    used = set(_REFERENCE.findall(json.dumps(body, default=str)))
    return used | set(experiment_meta(experiment).foreign_configuration)


OUR_MODULES = ("probes", "actions", "llmchaos")
"""Top-level packages whose activities are checked here."""

_INJECTED = {"configuration", "secrets", "value"}
"""Parameters Chaos Toolkit fills in itself (value: a tolerance probe's input)."""


def _activities(experiment: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(place, activity) for every activity, tolerance probes included."""
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    for i, probe in enumerate(hypothesis.get("probes") or []):
        place = f"steady-state-hypothesis.probes[{i}] {probe.get('name')!r}"
        yield place, probe
        tolerance = probe.get("tolerance")
        if isinstance(tolerance, dict) and tolerance.get("type") == "probe":
            yield place + ".tolerance", tolerance
    for section in ("method", "rollbacks"):
        for i, activity in enumerate(experiment.get(section) or []):
            if isinstance(activity, dict):
                yield f"{section}[{i}] {activity.get('name')!r}", activity


def _argument_checks(info: TargetInfo, settings: RunSettings) -> dict[str, Callable[[Any], None]]:
    """Checks by argument name, shared by every probe and action; each raises InvalidInput."""
    ranges = argument_ranges(settings)

    def in_range(name: str) -> Callable[[Any], None]:
        def check(value: Any) -> None:
            ranges[name].check("", value)

        return check

    def classes(value: Any) -> None:
        if not (isinstance(value, list) and set(value) <= set(ERROR_CLASSES)):
            raise InvalidInput(f"expected a list of some of {list(ERROR_CLASSES)}")

    def mode(value: Any) -> None:
        if value not in ("", "gpu", "cpu"):
            raise InvalidInput("expected gpu, cpu or empty")

    def direction(value: Any) -> None:
        if value not in DIRECTIONS:
            raise InvalidInput(f"expected one of {', '.join(DIRECTIONS)}")

    return {
        **{name: in_range(name) for name in ranges},
        "node": info.check_node,
        "gateway": info.gateway_names,
        "part": info.part_name,
        "mode": mode,
        "classes": classes,
        "direction": direction,
    }


def _type_problem(hint: Any, value: Any) -> str | None:
    """A complaint when `value` does not fit annotation `hint` (JSON-level types only)."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) else (hint,)
    for kind in allowed:
        if kind in (float, int) and isinstance(value, int | float) and not isinstance(value, bool):
            return None if math.isfinite(value) else "expected a finite number"
        if kind in (float, int) and isinstance(value, str):
            # `${sla_s}` from an env entry or --var arrives as "45"; the probes convert it
            try:
                as_number("", value)
            except InvalidInput:
                continue
            return None
        if kind is type(None) and value is None:
            return None
        if kind in (str, bool) and isinstance(value, kind):
            return None
        if (typing.get_origin(kind) is list or kind is list) and isinstance(value, list):
            return None
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    return f"expected {names}, got {value!r}"


def _check_activity(
    place: str,
    activity: dict[str, Any],
    configuration: dict[str, Any],
    checks: dict[str, Callable[[Any], None]],
    info: TargetInfo,
) -> list[str]:
    provider = activity.get("provider") or {}
    module_name = str(provider.get("module", ""))
    if provider.get("type") != "python" or module_name.split(".")[0] not in OUR_MODULES:
        return []
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return [f"{place}.provider.module: cannot import {module_name!r}: {exc}"]
    func_name = str(provider.get("func", ""))
    func = getattr(module, func_name, None)
    if not callable(func):
        public = [n for n in getattr(module, "__all__", []) if callable(getattr(module, n, None))]
        return [
            f"{place}.provider.func: {module_name} has no function {func_name!r}; "
            f"it has: {', '.join(public)}"
        ]
    arguments = substitute(dict(provider.get("arguments") or {}), configuration, None) or {}
    signature = inspect.signature(func)
    given = {k: v for k, v in arguments.items() if k not in _INJECTED}
    try:
        signature.bind_partial(**given)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p not in _INJECTED]
        return [f"{place}.arguments: {exc}; {func_name} accepts: {', '.join(accepted)}"]
    hints = typing.get_type_hints(func)
    problems = []
    for name, value in given.items():
        where = f"{place}.arguments.{name}"
        type_problem = _type_problem(hints[name], value) if name in hints else None
        if type_problem:
            problems.append(f"{where}: {type_problem}")
            continue
        check = checks.get(name)
        try:
            if check is not None:
                check(value)
        except InvalidInput as exc:
            problem = str(exc).removeprefix(": ")
            shown = "" if "got " in problem else f" (got {value!r})"
            problems.append(f"{where}: {problem}{shown}")
    if "worker" in given or ("node" in given and func_name == "kill_gpu_process"):
        try:
            info.gpu_workers(str(given.get("worker", "")), str(given.get("node", "")))
        except InvalidInput as exc:
            problems.append(f"{place}.arguments: {exc}")
    if func_name in _REGISTRY_FAULTS:
        member = str(
            given.get("member", "all" if func_name != "kill_registry_member" else "leader")
        )
        try:
            info.registry_member_names("all" if member == "leader" else member)
        except InvalidInput as exc:
            problems.append(f"{place}.arguments: {exc}")
        if func_name == "partition_registry_member" and not info.partitions_supported:
            problems.append(
                f"{place}: partition_registry_member needs the registry in network namespaces "
                "(run as root with netns auto or on)"
            )
    if func_name in info.unsupported:
        problems.append(
            f"{place}: {func_name} cannot run on this target: {info.unsupported[func_name]}"
        )
    numbers = {k: as_number("", given.get(k, 0) or 0) for k in _SHAPED_ARGUMENTS}
    if refused := info.refused_argument(func_name, numbers):
        problems.append(f"{place}.arguments.{refused}")
    if func_name == "drain_node" and not info.drains_supported:
        problems.append(f"{place}: drain_node needs a target with nodes to drain (a cluster)")
    if func_name == "partition_node" and not info.partitions_supported:
        problems.append(f"{place}: partition_node needs {info.partitions_need}")
    return problems


def _negative_control_problems(experiment: dict[str, Any], settings: RunSettings) -> list[str]:
    """Known-bad variants the experiment names must exist on targets that have any (one
    without known-bad variants, a cluster, runs only the default: the suite skips the rest)."""
    assert settings.target_settings is not None
    known = target_kind(settings.target).variants(settings.target_settings)
    if len(known) < 2:
        return []
    return [
        f"extensions.llmchaos.negative_controls: unknown variant {variant!r} of the "
        f"{settings.target} target; expected some of: {', '.join(known[1:])}"
        for variant in experiment_meta(experiment).negative_controls
        if variant not in known
    ]


SLO_OF_PROBE = {
    "recovery_time_s": "sla_s",
    "p99_latency_ms": "p99_slo_ms",
    "error_rate": "error_rate_slo",
    "queue_depth": "queue_depth_slo",
}
"""Probes whose tolerance is an SLO of the run's settings: the report judges and prints the
setting, so a tolerance with another limit would pass or fail a run the report calls the
opposite (one SLO, one source). A probe narrowed by `since_fault` or `classes` measures
something else, with a limit of its own."""
_NARROWING = ("since_fault", "classes", "whole_run")


def _tolerance_limit(tolerance: Any) -> Any:
    """The upper limit a tolerance sets: [lo, hi], {"type": "range", "range": [lo, hi]}, or a
    probe tolerance's `limit` argument; None for other forms."""
    if isinstance(tolerance, list) and len(tolerance) == 2:
        return tolerance[1]
    if isinstance(tolerance, dict):
        if tolerance.get("type") == "range" and isinstance(tolerance.get("range"), list):
            return tolerance["range"][-1]
        if tolerance.get("type") == "probe":
            return ((tolerance.get("provider") or {}).get("arguments") or {}).get("limit")
    return None


def _limits_that_disagree(
    experiment: dict[str, Any], configuration: dict[str, Any], settings: RunSettings
) -> list[str]:
    problems = []
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    for i, probe in enumerate(hypothesis.get("probes") or []):
        provider = probe.get("provider") or {}
        setting = SLO_OF_PROBE.get(str(provider.get("func", "")))
        narrowed = any(key in (provider.get("arguments") or {}) for key in _NARROWING)
        if setting is None or narrowed or str(provider.get("module", "")).split(".")[0] != "probes":
            continue
        limit = substitute(_tolerance_limit(probe.get("tolerance")), configuration, None)
        try:
            number = as_number("", limit)
        except InvalidInput:
            continue  # absent, or not resolved here: the tolerance's own check says so
        expected = float(getattr(settings, setting))
        if not math.isclose(number, expected, rel_tol=1e-9):
            problems.append(
                f"steady-state-hypothesis.probes[{i}] {probe.get('name')!r}.tolerance: limit "
                f"{number:g} disagrees with {setting} = {expected:g}, which the report judges "
                f'and prints; write "${{{setting}}}" as the limit, or set {setting}: {number:g}'
            )
    return problems


def check_experiment(
    experiment: dict[str, Any],
    configuration: dict[str, Any],
    info: TargetInfo,
    settings: RunSettings,
) -> list[str]:
    """Every problem found (empty when the experiment is fine); see the module docstring."""
    problems = []
    hypothesis = experiment.get("steady-state-hypothesis") or {}
    for i, probe in enumerate(hypothesis.get("probes") or []):
        if "tolerance" not in probe:
            problems.append(
                f"steady-state-hypothesis.probes[{i}] {probe.get('name')!r}: missing tolerance "
                '(e.g. "tolerance": [0, 45], or a probe tolerance such as probes.tolerances.'
                "at_most)"
            )
    problems += _negative_control_problems(experiment, settings)
    problems += _limits_that_disagree(experiment, configuration, settings)
    checks = _argument_checks(info, settings)
    ours = False
    for place, activity in _activities(experiment):
        module = str((activity.get("provider") or {}).get("module", ""))
        ours = ours or module.split(".")[0] in ("probes", "actions")
        problems += _check_activity(place, activity, configuration, checks, info)
    controls = experiment.get("controls") or []
    declared = any(
        isinstance(c, dict) and (c.get("provider") or {}).get("module") == "llmchaos.control"
        for c in controls
    )
    if ours and not declared:
        problems.append(
            'controls: the llmchaos probes and actions need the control: "controls": [{"name": '
            '"llmchaos", "provider": {"type": "python", "module": "llmchaos.control"}}]'
        )
    return problems


def validate_experiment_file(path: Path) -> list[str]:
    """Every problem of the experiment file at `path` (empty when it is fine): readable JSON or
    YAML object, Chaos Toolkit's own validation, the settings from its configuration, then
    check_experiment. Never raises for a bad file: each problem is one line naming what is
    wrong."""
    try:
        experiment = read_experiment(Path(path))
    except InvalidInput as exc:
        return [str(exc).removeprefix(f"{path}: ")]
    problems = []
    try:
        ensure_experiment_is_valid(experiment)
    except ChaosException as exc:
        problems.append(f"Chaos Toolkit: {exc}")
    except Exception as exc:  # chaoslib assumes the shape it validates; mutated files break it
        problems.append(f"Chaos Toolkit cannot read it: {type(exc).__name__}: {exc}")
    try:
        raw = experiment.get("configuration") or {}
        if not isinstance(raw, dict):
            return [*problems, "configuration: expected an object"]
        configuration = load_configuration(raw)
        settings = RunSettings.from_configuration(
            configuration, other_keys=other_configuration_keys(experiment)
        )
        problems += check_experiment(experiment, configuration, planned_target(settings), settings)
    except InvalidInput as exc:
        problems.append(str(exc))
    except Exception as exc:  # same as above: report, never a traceback
        problems.append(f"cannot check it: {type(exc).__name__}: {exc}")
    return problems
