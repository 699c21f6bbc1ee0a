"""Typed settings from an experiment's configuration and the environment, for any frozen
settings dataclass (the run's, each target's).

    settings = build_settings(EmbeddedSettings, configuration, environ)            # variant, ...
    k8s = build_settings(KubernetesSettings, configuration, environ, prefix="k8s_") # k8s_namespace

Where each value comes from, first match wins:

1. the experiment's `configuration` (after Chaos Toolkit resolved its `env` entries and
   `--var` overrides), under `<prefix><field>`: `"qps": 5000`, `"k8s_namespace": "llm"`;
2. the environment variable `LLMCHAOS_<PREFIX><FIELD>` (`LLMCHAOS_VARIANT`,
   `LLMCHAOS_K8S_NAMESPACE`), for fields the experiment does not set;
3. the field's default.

A field whose type is itself a dataclass (the run's `traffic`) reads its own fields under the
same prefix, flat (`stream_share`, not `traffic_stream_share`). Values from the environment
are strings; each is converted to its field's type, and anything that does not convert, or a
number outside its field's `Range`, is an InvalidInput naming where the value came from
(`configuration.qps` or `LLMCHAOS_QPS`), the value and what would be right.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from llmchaos.errors import InvalidInput

__all__ = [
    "ENV_PREFIX",
    "Range",
    "as_number",
    "build_settings",
    "check_known_keys",
    "check_ranges",
    "convert",
    "plain",
    "settings_from_record",
    "settings_keys",
]

ENV_PREFIX = "LLMCHAOS_"

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """The values a number may take: low..high, the low end itself excluded when open."""

    low: float
    high: float
    low_open: bool = False

    def __str__(self) -> str:
        if self.low_open:
            return f"> {plain(self.low)} and <= {plain(self.high)}"
        return f"within {plain(self.low)}..{plain(self.high)}"

    def check(self, where: str, value: object) -> float:
        """`value` as a number inside the range; raises InvalidInput naming `where`."""
        number = as_number(where, value)
        low_ok = number > self.low if self.low_open else number >= self.low
        if not (low_ok and number <= self.high):
            shown = plain(value) if isinstance(value, int | float) else repr(value)
            raise InvalidInput(f"{where}: expected a number {self}, got {shown}")
        return number


def check_ranges(settings: object, ranges: Mapping[str, Range]) -> None:
    """Every field named in `ranges` inside its range; InvalidInput names the first that is
    not (build_settings then says where its value came from)."""
    for name, allowed in ranges.items():
        allowed.check(name, getattr(settings, name))


def plain(number: float) -> str:
    """1000000 as 1,000,000 and 0.5 as 0.5, never 1e+06."""
    if float(number).is_integer() and abs(number) < 1e15:
        return f"{int(number):,}"
    return f"{number:g}"


def as_number(name: str, value: object) -> float:
    """`value` as a finite float. Chaos Toolkit hands `${...}` from an env entry or `--var`
    to probes and actions as a string ("45"), so strings of numbers are numbers here.
    Raises InvalidInput naming the argument."""
    if not isinstance(value, bool):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(number):
                return number
    raise InvalidInput(f"{name}: expected a number, got {value!r}")


def convert(hint: Any, value: Any, where: str) -> Any:
    """`value` (from JSON, or a string from the environment) as type `hint`; raises
    InvalidInput naming `where`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        return convert(options[0], value, where)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise InvalidInput(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise InvalidInput(f"{where}: expected a list or a comma-separated string")
        return tuple(str(item).strip() for item in items if str(item).strip())
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise InvalidInput(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise InvalidInput(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise InvalidInput(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise InvalidInput(f"{where}: expected a number, got {value!r}")
        if hint is int:
            if not number.is_integer():
                raise InvalidInput(f"{where}: expected a whole number, got {value!r}")
            return int(number)
        return number
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise InvalidInput(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> type hint of settings dataclass `cls` (init fields only)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def settings_keys(cls: type, prefix: str = "") -> set[str]:
    """Every configuration key `build_settings(cls, prefix=prefix)` reads."""
    keys: set[str] = set()
    for name, hint in _fields(cls).items():
        if dataclasses.is_dataclass(hint):
            keys |= settings_keys(hint, prefix)
        else:
            keys.add(prefix + name)
    return keys


def build_settings(
    cls: type[T],
    configuration: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    prefix: str = "",
    extra: Mapping[str, Any] | None = None,
) -> T:
    """`cls` from the sources in the module docstring; `extra`: values that are not read from
    the sources (the run's target settings). Raises InvalidInput naming the origin."""
    values: dict[str, Any] = dict(extra or {})
    origins: dict[str, str] = {}
    for name, hint in _fields(cls).items():
        if name in values:
            continue
        if dataclasses.is_dataclass(hint):
            values[name] = build_settings(hint, configuration, environ, prefix=prefix)
            continue
        key = prefix + name
        env_key = ENV_PREFIX + key.upper()
        if key in configuration:
            origins[name] = f"configuration.{key}"
            values[name] = convert(hint, configuration[key], origins[name])
        elif env_key in environ:
            origins[name] = env_key
            values[name] = convert(hint, environ[env_key], env_key)
    try:
        return cls(**values)
    except InvalidInput as exc:  # say where the bad value came from
        name, sep, rest = str(exc).partition(":")
        if sep and name in origins:
            raise InvalidInput(f"{origins[name]}:{rest}") from None
        raise


def check_known_keys(
    configuration: Mapping[str, Any], known: Collection[str], other_keys: Collection[str]
) -> None:
    """Every configuration key must be `known` (a setting) or one of `other_keys` (what the
    experiment uses for itself); raises InvalidInput with the nearest setting as a hint."""
    for key in configuration:
        if key in known or key in other_keys:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise InvalidInput(
            f"configuration.{key}: not a setting; {hint}(a value the experiment uses itself "
            f"must appear as ${{{key}}}, or be listed in the llmchaos extension's "
            '"foreign_configuration")'
        )


def settings_from_record(
    cls: type[T],
    data: Mapping[str, Any],
    where: str = "settings",
    *,
    extra: Mapping[str, Any] | None = None,
) -> T:
    """`cls` from `dataclasses.asdict` of one (run.json); `extra`: values given as they are.
    Raises InvalidInput like build_settings."""
    values: dict[str, Any] = dict(extra or {})
    for name, hint in _fields(cls).items():
        if name not in data or name in values:
            continue
        if dataclasses.is_dataclass(hint) and isinstance(data[name], Mapping):
            values[name] = settings_from_record(hint, data[name], f"{where}.{name}")
        else:
            values[name] = convert(hint, data[name], f"{where}.{name}")
    return cls(**values)
