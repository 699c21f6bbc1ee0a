"""From a profile name or file (plus the config) to the `Profile` the schedules follow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.load.config import PROFILE_NAMES, LoadConfig
from llmchaos.load.schedule import BurstSpec, Profile, Stage

__all__ = ["build_profile", "stepped_stages"]

ARRIVALS = ("poisson", "constant")


def stepped_stages(
    start_qps: float, increment_qps: float, max_qps: float, step_s: float
) -> tuple[Stage, ...]:
    """start, start+inc, ... while below max, then max itself (1000, 1500 .. 6000, 6200)."""
    stages, qps = [], start_qps
    while qps < max_qps and increment_qps > 0:
        stages.append(Stage(step_s, qps))
        qps += increment_qps
    stages.append(Stage(step_s, max_qps))
    return tuple(stages)


def build_profile(config: LoadConfig) -> Profile:
    """The profile `config.profile` names, cut to the config's duration.

    Raises InvalidInput naming --profile for an unknown name or a bad/unreadable file.
    """
    name = config.profile
    bursts = None
    if name in ("constant", "poisson", "bursty"):
        arrival = "constant" if name == "constant" else "poisson"
        stages: tuple[Stage, ...] = (Stage(config.resolved_duration_s(None), config.qps, arrival),)
        if name == "bursty":
            bursts = BurstSpec(
                windows_per_min=config.burst_windows_per_min,
                duration_s=config.burst_duration_s,
                factor=config.burst_factor,
            )
    elif name == "stepped":
        stages = stepped_stages(
            config.step_start_qps, config.step_increment_qps, config.step_max_qps, config.step_s
        )
    elif name.endswith(".json") or Path(name).exists():
        stages, bursts = _read_file(name)
    else:
        raise InvalidInput(
            f"--profile: unknown profile {name!r}; expected one of "
            f"{', '.join(PROFILE_NAMES)} or the path of a JSON profile file"
        )
    return Profile(
        name=name, stages=_cut(stages, config.resolved_duration_s(_total(stages))), bursts=bursts
    )


def _total(stages: tuple[Stage, ...]) -> float:
    return sum(stage.duration_s for stage in stages)


def _cut(stages: tuple[Stage, ...], duration_s: float) -> tuple[Stage, ...]:
    out, start = [], 0.0
    for stage in stages:
        if start >= duration_s:
            break
        out.append(Stage(min(stage.duration_s, duration_s - start), stage.qps, stage.arrival))
        start += stage.duration_s
    return tuple(out)


def _read_file(path: str) -> tuple[tuple[Stage, ...], BurstSpec | None]:
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidInput(f"--profile: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidInput(f"--profile: {path} is not JSON: {exc}") from None
    expected = '{"stages": [{"duration_s": >0, "qps": >=0, "arrival": "poisson"|"constant"}]}'
    raw = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(raw, list) or not raw:
        raise InvalidInput(f"--profile: {path}: expected {expected}")
    stages = []
    for i, item in enumerate(raw):
        try:
            stage = Stage(
                float(item["duration_s"]), float(item["qps"]), item.get("arrival", "poisson")
            )
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"--profile: {path}: stages[{i}]: expected {expected}") from None
        if stage.duration_s <= 0 or stage.qps < 0 or stage.arrival not in ARRIVALS:
            raise InvalidInput(f"--profile: {path}: stages[{i}] = {item!r}: expected {expected}")
        stages.append(stage)
    bursts = None
    if data.get("bursts"):
        try:
            bursts = BurstSpec(**data["bursts"])
        except TypeError as exc:
            raise InvalidInput(f"--profile: {path}: bursts: {exc}") from None
    return tuple(stages), bursts
