"""The hosts file: the user's own serving processes on this machine, as the user writes them.

YAML (or JSON) with these sections; `examples: experiments/targets/*.yaml`:

    front_door:                       # what the load sends to
      url: http://127.0.0.1:18700
      token: generate                 # or {env: MY_TOKEN}; absent: no Authorization header
    servers:                          # inference servers, by name
      gpu-0:
        mode: gpu                     # gpu | cpu
        node: node-a                  # what partition_node(node) cuts off
        engine: vllm                  # vllm | sglang | tgi | llamacpp | openai
        url: http://127.0.0.1:18701
        pid: 1234                     # a process the user runs, or pid_file: /run/vllm.pid,
        command: "{python} -m ..."    # or one llmchaos starts and restarts when it dies
        restart_command: "..."        # (default: command) how it is started again
        restart_delay_s: 0.5          # kubelet back-off before the restart
        netns: ns-a                   # optional network namespace it runs in
    gateways:                         # gateway-primary / gateway-backup are the catalogue's roles
      gateway-primary: {url: ..., health: /healthz, command: ..., restart_command: ...}
    redis: {url: redis://127.0.0.1:18709/0, password_env: NAME, key_pattern: "token:*"}
    max_qps: 8                        # the most this machine's gateways take
    variants:                         # known-bad variants: overrides merged into the file
      no-failover: {gateways: {gateway-primary: {command: ...}}}

Commands are a string (split as a shell would, no shell runs) or a list. They and `env`
values may use {python} (the Python running llmchaos), {dir} (the file's folder), {state}
(a folder of the process's own, for pid files and logs), {port} and {name}; `env` values also
{token} (the front door's token: never on a command line, where `ps` shows it). A variant's
null removes what it names (`gateways: {gateway-backup: null}`).

Reading the file checks its shape only; `llmchaos.targets.hosts.preflight` checks it against
the machine (pids, ports, executables). Every problem is one line: the file, the field, the
value and what would be right.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import string
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmchaos.configuration import Range
from llmchaos.errors import InvalidInput
from llmchaos.targets import DEFAULT_VARIANT
from llmchaos.targets.hosts.engines import ENGINES

__all__ = [
    "CATALOGUE_VARIANTS",
    "Gateway",
    "HostsTopology",
    "Part",
    "RedisSpec",
    "Server",
    "load_topology",
]

CATALOGUE_VARIANTS = ("no-failover", "no-cpu-fallback", "no-backup-gateway", "naive-cache")
"""The catalogue's negative controls: the names a hosts file's variants are expected to use."""
MODES = ("gpu", "cpu")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_PLACEHOLDERS = frozenset({"python", "dir", "state", "port", "name"})
_ENV_PLACEHOLDERS = _PLACEHOLDERS | {"token"}
_RANGES = {
    "restart_delay_s": Range(0, 600),
    "ready_timeout_s": Range(0, 3600, low_open=True),
    "warmup_requests": Range(0, 100),
    "max_qps": Range(0, 1_000_000, low_open=True),
}


@dataclass(frozen=True)
class Part:
    """One process of the target: how to find it, start it, and tell that it is ready."""

    name: str
    role: str
    """server, gateway or redis."""
    url: str
    health: str
    """Path answered 200 when the process serves."""
    pid: int | None = None
    pid_file: str | None = None
    command: tuple[str, ...] = ()
    """Empty: the user runs it (pid or pid_file)."""
    restart_command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 60.0
    netns: str | None = None

    @property
    def started_by_us(self) -> bool:
        """llmchaos starts it (and stops it at the run's end)."""
        return bool(self.command)

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urllib.parse.urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class Server(Part):
    """An inference server."""

    mode: str = "gpu"
    node: str = ""
    engine: str = "vllm"
    restart_delay_s: float = 0.5


@dataclass(frozen=True)
class Gateway(Part):
    """A gateway (LiteLLM, nginx, ...): crashed by crash_gateway, restarted by
    restore_gateway."""

    warmup_requests: int = 0
    """Requests sent through it once it is ready, before the run measures (LiteLLM's first
    requests take 1-3 s)."""


@dataclass(frozen=True)
class RedisSpec:
    """The Redis holding the token cache (or router state)."""

    url: str
    password_env: str | None = None
    key_pattern: str | None = None
    """Keys of the token cache (SCAN pattern); None: expire_token_cache does not apply."""
    part: Part | None = None
    """Its process, when llmchaos starts it."""


@dataclass(frozen=True)
class HostsTopology:
    """A hosts file read with its variant applied."""

    path: Path
    variant: str
    front_url: str
    token: str | None
    """"generate", "env", or None (no auth)."""
    token_env: str | None
    model: str
    """Model name of the warm-up requests."""
    servers: tuple[Server, ...]
    gateways: tuple[Gateway, ...]
    redis: RedisSpec | None
    max_qps: float
    variants: tuple[str, ...]
    """Every variant the file defines (the default first)."""

    @property
    def parts(self) -> tuple[Part, ...]:
        """Every process, in start order: Redis, servers, gateways."""
        first = (self.redis.part,) if self.redis and self.redis.part else ()
        return (*first, *self.servers, *self.gateways)

    def part(self, name: str) -> Part:
        for part in self.parts:
            if part.name == name:
                return part
        raise InvalidInput(f"{self.path}: no server or gateway named {name!r}")

    def server(self, name: str) -> Server:
        for server in self.servers:
            if server.name == name:
                return server
        known = ", ".join(s.name for s in self.servers)
        raise InvalidInput(f"{self.path}: no server named {name!r}; servers: {known}")

    def gateway(self, name: str) -> Gateway:
        part = self.part(name)
        if not isinstance(part, Gateway):
            known = ", ".join(g.name for g in self.gateways)
            raise InvalidInput(f"gateway: unknown gateway {name!r}; gateways: {known}")
        return part

    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.node for s in self.servers))


def read_document(path: Path) -> dict[str, Any]:
    """The file's top-level mapping; InvalidInput naming the file when it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidInput(
            f"{path}: cannot read the hosts file ({exc.strerror}); give its path in "
            "hosts_file / LLMCHAOS_HOSTS_FILE"
        ) from None
    try:
        data = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInput(f"{path}: not valid YAML or JSON: {first}") from None
    if not isinstance(data, dict):
        raise InvalidInput(
            f"{path}: expected a mapping with front_door, servers, gateways, max_qps; "
            f"got {type(data).__name__}"
        )
    return data


def merge(base: Any, override: Any) -> Any:
    """`override` merged into `base`: mappings key by key, a null removes the key, anything
    else replaces."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return override
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge(base.get(key), value)
    return merged


def load_topology(path: Path, variant: str = DEFAULT_VARIANT) -> HostsTopology:
    """Read and check the hosts file with `variant` applied. Raises InvalidInput with one line
    per problem (file, field, value, what would be right)."""
    path = Path(path)
    data = read_document(path)
    reader = _Reader(path)
    variants_data = data.get("variants") or {}
    if not isinstance(variants_data, dict):
        reader.bad("variants", "expected a mapping of variant name -> overrides")
        variants_data = {}
    names = (DEFAULT_VARIANT, *(str(v) for v in variants_data))
    if variant != DEFAULT_VARIANT:
        if variant not in variants_data:
            raise InvalidInput(
                f"{path}: variants: unknown variant {variant!r}; the file defines: "
                f"{', '.join(names)}"
            )
        override = variants_data[variant]
        if not isinstance(override, dict):
            raise InvalidInput(f"{path}: variants.{variant}: expected a mapping of overrides")
        data = merge(data, override)
    for name in variants_data:
        if not _NAME.fullmatch(str(name)) or str(name) == DEFAULT_VARIANT:
            reader.bad(
                f"variants.{name}", "expected a name other than the default, e.g. no-failover"
            )
    topology = reader.topology(data, variant, names)
    reader.raise_problems()
    assert topology is not None
    return topology


class _Reader:
    """Collects every problem of one file, so the user sees them all at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[str] = []

    def bad(self, where: str, message: str) -> None:
        self.problems.append(f"{self.path}: {where}: {message}")

    def raise_problems(self) -> None:
        if self.problems:
            raise InvalidInput("\n".join(self.problems))

    # -- fields --------------------------------------------------------------------------
    def keys(self, data: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                self.bad(f"{where}{key}", f"not a field; {hint}expected some of {', '.join(known)}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.bad(where, f"expected a mapping, got {value!r}")
            return {}
        return value

    def text(self, data: dict[str, Any], key: str, where: str, default: str | None = None) -> Any:
        value = data.get(key, default)
        if value is None:
            if default is None and key in data:
                self.bad(f"{where}.{key}", "expected a string, got null")
            return None
        if not isinstance(value, str) or not value.strip():
            self.bad(f"{where}.{key}", f"expected a non-empty string, got {value!r}")
            return None
        return value

    def number(self, data: dict[str, Any], key: str, where: str, default: float) -> float:
        value = data.get(key, default)
        try:
            return _RANGES[key].check(f"{where}.{key}", value)
        except InvalidInput as exc:
            self.problems.append(f"{self.path}: {exc}")
            return default

    def url(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            self.bad(where, f"expected an http:// URL such as http://127.0.0.1:8000, got {value!r}")
            return "http://127.0.0.1"
        parts = urllib.parse.urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = None
            self.bad(where, f"bad port in {value!r}; expected 1..65535")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self.bad(where, f"expected an http:// URL such as http://127.0.0.1:8000, got {value!r}")
        elif port is None and parts.scheme == "http" and ":" not in parts.netloc:
            self.bad(where, f"expected a port in {value!r}, e.g. http://127.0.0.1:8000")
        return value.rstrip("/")

    def command(self, value: Any, where: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            try:
                argv = tuple(shlex.split(value))
            except ValueError as exc:
                self.bad(where, f"cannot split {value!r} into arguments: {exc}")
                return ()
        elif isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
            argv = tuple(str(v) for v in value)
        else:
            self.bad(where, f"expected a command string or a list of arguments, got {value!r}")
            return ()
        if not argv:
            self.bad(where, "expected a command, got an empty one")
        for arg in argv:
            self.placeholders(arg, where, _PLACEHOLDERS)
        return argv

    def placeholders(self, text: str, where: str, allowed: frozenset[str]) -> None:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        except ValueError as exc:
            self.bad(where, f"bad placeholder in {text!r}: {exc} (write {{{{ for a brace)")
            return
        for name in sorted(names - allowed):
            why = " (a token on a command line is visible to every user: pass it in env)"
            self.bad(
                where,
                f"unknown placeholder {{{name}}} in {text!r}; expected some of "
                + ", ".join(f"{{{p}}}" for p in sorted(allowed))
                + (why if name == "token" else ""),
            )

    def env(self, value: Any, where: str) -> dict[str, str]:
        result: dict[str, str] = {}
        for key, item in self.mapping(value, where).items():
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                self.bad(f"{where}.{key}", f"expected a string, got {item!r}")
                continue
            result[str(key)] = str(item)
            self.placeholders(str(item), f"{where}.{key}", _ENV_PLACEHOLDERS)
        return result

    # -- sections ------------------------------------------------------------------------
    def part_fields(self, data: dict[str, Any], where: str, default_health: str) -> dict[str, Any]:
        """The fields every process has."""
        pid = data.get("pid")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0):
            self.bad(f"{where}.pid", f"expected a process id (a whole number > 0), got {pid!r}")
            pid = None
        pid_file = self.text(data, "pid_file", where)
        command = self.command(data.get("command"), f"{where}.command")
        restart = self.command(data.get("restart_command"), f"{where}.restart_command")
        given = [k for k in ("pid", "pid_file", "command") if data.get(k) is not None]
        if len(given) != 1:
            self.bad(
                where,
                "expected exactly one of pid (a process you run), pid_file, or command (a "
                f"process llmchaos starts); got {', '.join(given) or 'none'}",
            )
        health = self.text(data, "health", where, default_health) or default_health
        if not health.startswith("/"):
            self.bad(f"{where}.health", f"expected a path such as /health, got {health!r}")
        netns = self.text(data, "netns", where)
        if netns is not None and not _NAME.fullmatch(netns):
            self.bad(f"{where}.netns", f"expected a network namespace name, got {netns!r}")
        return {
            "url": self.url(data.get("url"), f"{where}.url"),
            "health": health,
            "pid": pid,
            "pid_file": pid_file,
            "command": command,
            "restart_command": restart or command,
            "env": self.env(data.get("env"), f"{where}.env"),
            "ready_timeout_s": self.number(data, "ready_timeout_s", where, 60.0),
            "netns": netns,
        }

    def named(self, data: Any, where: str) -> dict[str, dict[str, Any]]:
        result = {}
        for name, spec in self.mapping(data, where).items():
            if not _NAME.fullmatch(str(name)):
                self.bad(f"{where}.{name}", "expected a name of letters, digits, '-', '_', '.'")
            result[str(name)] = self.mapping(spec, f"{where}.{name}")
        return result

    def server(self, name: str, data: dict[str, Any]) -> Server:
        where = f"servers.{name}"
        self.keys(
            data,
            where + ".",
            (
                *_PART_KEYS,
                "mode",
                "node",
                "engine",
                "restart_delay_s",
            ),
        )
        mode = data.get("mode", "gpu")
        if mode not in MODES:
            self.bad(f"{where}.mode", f"expected gpu or cpu, got {mode!r}")
        engine = data.get("engine", "vllm")
        if engine not in ENGINES:
            self.bad(
                f"{where}.engine",
                f"unknown engine kind {engine!r}; expected one of {', '.join(ENGINES)}",
            )
            engine = "openai"
        node = self.text(data, "node", where) or name
        if not _NAME.fullmatch(node):
            self.bad(f"{where}.node", f"expected a node name such as node-a, got {node!r}")
        return Server(
            name=name,
            role="server",
            mode=str(mode),
            node=node,
            engine=str(engine),
            restart_delay_s=self.number(data, "restart_delay_s", where, 0.5),
            **self.part_fields(data, where, ENGINES[str(engine)].health),
        )

    def gateway(self, name: str, data: dict[str, Any]) -> Gateway:
        where = f"gateways.{name}"
        self.keys(data, where + ".", (*_PART_KEYS, "warmup_requests"))
        fields = self.part_fields(data, where, "/health")
        if fields["netns"]:
            self.bad(f"{where}.netns", "gateways run on the host; only servers may have netns")
        if not fields["command"] and not data.get("restart_command"):
            self.bad(
                f"{where}.restart_command",
                "required for a gateway you run (pid or pid_file): how restore_gateway starts "
                "it again, e.g. systemctl restart nginx",
            )
        return Gateway(
            name=name,
            role="gateway",
            warmup_requests=int(self.number(data, "warmup_requests", where, 0)),
            **fields,
        )

    def redis(self, data: dict[str, Any]) -> RedisSpec | None:
        if not data:
            return None
        self.keys(
            data, "redis.", ("url", "password_env", "key_pattern", "command", "ready_timeout_s")
        )
        url = data.get("url")
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("redis", "rediss"):
            self.bad(
                "redis.url",
                f"expected a redis:// URL such as redis://127.0.0.1:6379/0, got {url!r}",
            )
            url = "redis://127.0.0.1:6379/0"
        elif urllib.parse.urlsplit(url).password:
            self.bad("redis.url", "a password is never written in the file: set password_env")
        part = None
        if data.get("command") is not None:
            parsed = urllib.parse.urlsplit(url)
            part = Part(
                name="redis",
                role="redis",
                url=f"http://{parsed.hostname or '127.0.0.1'}:{parsed.port or 6379}",
                health="",
                command=self.command(data.get("command"), "redis.command"),
                restart_command=self.command(data.get("command"), "redis.command"),
                ready_timeout_s=self.number(data, "ready_timeout_s", "redis", 30.0),
            )
        return RedisSpec(
            url=url,
            password_env=self.text(data, "password_env", "redis"),
            key_pattern=self.text(data, "key_pattern", "redis"),
            part=part,
        )

    def topology(
        self, data: dict[str, Any], variant: str, variants: tuple[str, ...]
    ) -> HostsTopology | None:
        self.keys(data, "", ("front_door", "servers", "gateways", "redis", "max_qps", "variants"))
        front = self.mapping(data.get("front_door"), "front_door")
        self.keys(front, "front_door.", ("url", "token", "model"))
        token, token_env = self.token(front.get("token"))
        servers = tuple(
            self.server(n, s) for n, s in self.named(data.get("servers"), "servers").items()
        )
        gateways = tuple(
            self.gateway(n, g) for n, g in self.named(data.get("gateways"), "gateways").items()
        )
        if not servers:
            self.bad("servers", "expected at least one inference server")
        if "max_qps" not in data:
            self.bad(
                "max_qps",
                "required: the most requests/s this machine's gateways take (e.g. 8 for one "
                "LiteLLM process on 2 cores); the catalogue asks 5000",
            )
        topology = HostsTopology(
            path=self.path,
            variant=variant,
            front_url=self.url(front.get("url"), "front_door.url"),
            token=token,
            token_env=token_env,
            model=self.text(front, "model", "front_door", "llmchaos-7b") or "llmchaos-7b",
            servers=servers,
            gateways=gateways,
            redis=self.redis(self.mapping(data.get("redis"), "redis")),
            max_qps=self.number(data, "max_qps", "", 1.0) if "max_qps" in data else 1.0,
            variants=variants,
        )
        self.clashes(topology)
        return topology

    def token(self, value: Any) -> tuple[str | None, str | None]:
        if value is None:
            return None, None
        if value == "generate":
            return "generate", None
        if isinstance(value, dict) and set(value) == {"env"} and isinstance(value["env"], str):
            return "env", value["env"]
        shown = "a string" if isinstance(value, str) else repr(value)
        self.bad(
            "front_door.token",
            f"expected generate or {{env: VARIABLE}}, got {shown} (a token is never written in "
            "the file)",
        )
        return None, None

    def clashes(self, topology: HostsTopology) -> None:
        """Two processes of ours on one port; a name used twice."""
        seen: dict[tuple[str | None, str, int], str] = {}
        for part in topology.parts:
            if not part.started_by_us:
                continue
            key = (part.netns, part.host, part.port)
            if key in seen:
                self.bad(
                    f"{part.role}s.{part.name}.url",
                    f"port {part.port} is also {seen[key]}'s; give each process a port of its own",
                )
            seen[key] = part.name
        names = [p.name for p in topology.parts]
        for name in sorted({n for n in names if names.count(n) > 1}):
            self.bad(name, "the same name is used by a server and a gateway; names must differ")


_PART_KEYS = (
    "url",
    "health",
    "pid",
    "pid_file",
    "command",
    "restart_command",
    "env",
    "ready_timeout_s",
    "netns",
)
