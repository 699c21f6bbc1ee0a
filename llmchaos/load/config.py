"""The load run's settings: one frozen dataclass, every field with a default and its reason.

`LoadConfig` travels as JSON to the Locust processes (`to_json`/`from_json`); `validate` checks
it before anything starts and raises InvalidInput naming the CLI flag and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.load.goodput import GoodputSlo
from llmchaos.load.traffic import TrafficSpec

__all__ = [
    "INFLIGHT_CAP",
    "PROFILE_NAMES",
    "QPS_PER_PROCESS",
    "LoadConfig",
    "default_run_dir",
    "inflight_cap_for",
    "validate",
]

PROFILE_NAMES = ("constant", "poisson", "bursty", "stepped")
INFLIGHT_CAP = 2000
"""Default of LoadConfig.inflight_cap: 5000 QPS over 2 processes at ~0.8 s latency."""
QPS_PER_PROCESS = 2500.0
"""What one Locust process sends open loop here (llmchaos/load/README.md): a run needs one
per this many QPS."""


def inflight_cap_for(peak_qps: float, processes: int, timeout_s: float) -> int:
    """The in-flight cap per process at which an open-loop load holds no send back before
    the request timeout would end it: the peak rate's share times the timeout, 10% more for
    the Poisson arrivals' bunching, and at least INFLIGHT_CAP. A fixed 2,000 dropped sends
    at 1,200 QPS once the mean latency passed 1.7 s: overloaded engines' queues stopped at
    the client instead of growing."""
    per_process = peak_qps / max(1, processes) * timeout_s * 1.1
    return max(INFLIGHT_CAP, math.ceil(per_process))


DEFAULT_DURATION_S = 60.0


@dataclass(frozen=True)
class LoadConfig:
    """Settings of one open-loop load run (CLI flags in brackets)."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of the target [--url]; requests go to `<url>/v1/chat/completions`."""
    qps: float = 10.0
    """Total arrival rate over all workers, requests/s [--qps]. Ignored by `stepped` and files."""
    duration_s: float | None = None
    """Schedule length [--duration]. None: 60 s, or the whole profile for stepped/files (which it
    cuts short when given)."""
    workers: int = 1
    """Locust processes sending load on this machine [--workers]. 1 (and no remote workers): a
    local runner; N > 1: a master and N worker processes (Locust's --processes). Every worker,
    local or remote, follows 1/(workers + remote_workers) of the rate. 0 only with remote
    workers: the master sends nothing itself."""
    remote_workers: int = 0
    """Workers expected from elsewhere (`llmchaos load-worker --master HOST:PORT` on other
    hosts) besides the local ones [--remote-workers]. The master waits for all of them up to
    `join_timeout_s`; the share of one that has not joined by then, or is lost mid-run, is
    counted as `lost_worker` (see process.py)."""
    master_bind_host: str = "127.0.0.1"
    """Address the master listens on for its workers [--master-bind-host]; remote workers need
    one they can reach (an interface address, or 0.0.0.0)."""
    master_port: int = 0
    """Port of the master for its workers [--master-port]; 0 picks a free one (printed, and in
    the run's config.json and /status)."""
    join_timeout_s: float = 30.0
    """How long the master waits for every expected worker before time zero [--join-timeout-s];
    then it starts with those that joined."""
    profile: str = "poisson"
    """constant | poisson | bursty | stepped, or the path of a JSON profile file [--profile]:
    {"stages": [{"duration_s": 30, "qps": 100, "arrival": "poisson"}, ...], "bursts": {...}}."""
    step_s: float = 900.0
    """Length of one step of the stepped profile (the field used 15 min) [--step-s]."""
    step_start_qps: float = 1000.0
    """First step of the stepped profile (field: 1000 QPS)."""
    step_increment_qps: float = 500.0
    """QPS added per step (field: +500)."""
    step_max_qps: float = 6200.0
    """Last step, QPS (field: 6200)."""
    burst_windows_per_min: float = 0.5
    """Rate of burst windows of the bursty profile (field: 0.5 per minute)."""
    burst_duration_s: float = 10.0
    """Length of one burst window."""
    burst_factor: float = 1.0
    """Extra rate inside a burst as a multiple of the base rate (1.0 doubles it)."""
    tokens_file: str | None = None
    """Tokens file [--tokens]: {"tokens": [{"token", "tenant", "revoked"}]}. None: no
    Authorization header."""
    api_key_env: str | None = None
    """Name of an environment variable holding the one bearer token to send (a provider's API
    key) [--api-key-env]; used when there is no tokens file. The key itself is never written
    to a file or a command line: the load's processes inherit the variable."""
    traffic: TrafficSpec = field(default_factory=TrafficSpec)
    """The request mix: models, prompt and output lengths, streaming, bad tokens (one
    definition, llmchaos.load.traffic.TrafficSpec, shared with the chaos run's settings)."""
    goodput_ttft_ms: float | None = None
    """Goodput SLO on TTFT, ms [--goodput ttft:MS]; None: not part of it (goodput.py)."""
    goodput_tpot_ms: float | None = None
    """Goodput SLO on TPOT, ms [--goodput tpot:MS]."""
    goodput_e2e_ms: float | None = None
    """Goodput SLO on end-to-end latency, ms [--goodput e2el:MS]. With no goodput SLO set,
    goodput is not measured (None in windows and the summary)."""
    timeout_s: float = 8.0
    """Whole-request deadline from the actual send (field: 8 s); beyond it: class `timeout`."""
    inflight_cap: int = INFLIGHT_CAP
    """Most requests in flight per worker; a send over it is counted as dropped, not queued
    [--inflight-cap]. A chaos run sizes it to its peak rate (RunSettings.load_inflight_cap)."""
    send_tick_ms: float = 1.0
    """Shortest sleep of the send loop: sends due within one tick go out together, at most
    this late (counted as schedule lag). Batching them lets one wake-up serve several, which
    is what keeps 5000 QPS within two cores; 0 sleeps to each send time exactly."""
    drain_s: float = 9.0
    """After the schedule ends, how long in-flight requests may finish (a little over
    timeout_s, so normally nothing is left in flight)."""
    seed: int = 0
    """Seed of schedules and traffic [--seed]: the same seed gives the same run plan."""
    summary_json: str | None = None
    """Where to write the summary [--summary-json]; None: `<run_dir>/summary.json`."""
    timeline: str | None = None
    """Where to write the JSON-lines timeline [--timeline]; None: `<run_dir>/timeline.jsonl`."""
    run_dir: str | None = None
    """Folder for the run's files (config, live address, logs); None: reports/load/<time>-<pid>/."""
    live_port: int = 0
    """Port of the live HTTP endpoint on 127.0.0.1 [--live-port]; 0 picks a free one."""
    live_host: str = "127.0.0.1"
    """Address the live endpoint binds to ("0.0.0.0" for Prometheus in a cluster)."""
    web_ui_port: int | None = None
    """Locust web UI port [--web-ui-port]; None: headless."""
    report_interval_s: float = 1.0
    """How often workers send their records to the master (Locust's own stats wait 3 s)."""
    locust_stats: bool = False
    """Also feed Locust's request stats (web UI tables); costs ~20% CPU per request."""
    check_target: bool = True
    """Before starting, require the URL to answer (any HTTP status); else InvalidInput."""
    owner_pid: int | None = None
    """Pid of the process this load belongs to; None (default): none. The load stops itself,
    as if /control/stop was called (drain, summary), about a second after that process is
    gone, so a `chaos run` killed with SIGKILL (no cleanup runs) does not leave load running
    against the target. The process is identified by pid and start time: a reused pid is gone."""

    @property
    def total_workers(self) -> int:
        """Workers that share the schedule: the local processes and the remote ones."""
        return self.workers + self.remote_workers

    @property
    def distributed(self) -> bool:
        """Whether a master sends the load through workers (else one local runner)."""
        return self.total_workers > 1 or self.remote_workers > 0

    def resolved_duration_s(self, profile_duration_s: float | None) -> float:
        """The schedule length given the profile's own length (None for rate-only profiles)."""
        if profile_duration_s is None:
            return self.duration_s if self.duration_s is not None else DEFAULT_DURATION_S
        if self.duration_s is None:
            return profile_duration_s
        return min(self.duration_s, profile_duration_s)

    @property
    def goodput_slo(self) -> GoodputSlo:
        return GoodputSlo(self.goodput_ttft_ms, self.goodput_tpot_ms, self.goodput_e2e_ms)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoadConfig:
        """Raises InvalidInput on unknown fields or invalid JSON."""
        try:
            data: dict[str, Any] = json.loads(text)
            return cls(**{**data, "traffic": TrafficSpec(**data.get("traffic", {}))})
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"load config: {exc}") from None


_POSITIVE = {
    "qps": "--qps",
    "step_s": "--step-s",
    "step_start_qps": "step_start_qps",
    "step_max_qps": "step_max_qps",
    "timeout_s": "--timeout-s",
    "report_interval_s": "report_interval_s",
    "burst_duration_s": "burst_duration_s",
    "burst_windows_per_min": "burst_windows_per_min",
    "join_timeout_s": "--join-timeout-s",
}


def validate(config: LoadConfig) -> None:
    """Check every field. Raises InvalidInput naming the flag, the value and what is expected."""
    for name, flag in _POSITIVE.items():
        value = getattr(config, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise InvalidInput(f"{flag}: expected a number > 0, got {value!r}")
    if config.duration_s is not None and not config.duration_s > 0:
        raise InvalidInput(f"--duration: expected seconds > 0, got {config.duration_s!r}")
    if not 0 <= config.workers <= 64:
        raise InvalidInput(f"--workers: expected 0..64 processes, got {config.workers!r}")
    if not 0 <= config.remote_workers <= 64:
        raise InvalidInput(
            f"--remote-workers: expected 0..64 workers, got {config.remote_workers!r}"
        )
    if config.workers + config.remote_workers < 1:
        raise InvalidInput(
            "--workers: expected >= 1 local process, or --remote-workers >= 1, got "
            f"{config.workers!r} local and {config.remote_workers!r} remote"
        )
    if not 0 <= config.master_port <= 65535:
        raise InvalidInput(f"--master-port: expected 0..65535, got {config.master_port!r}")
    if not config.master_bind_host:
        raise InvalidInput("--master-bind-host: expected an address (or 0.0.0.0), got ''")
    if config.inflight_cap < 1:
        raise InvalidInput(f"--inflight-cap: expected >= 1, got {config.inflight_cap!r}")
    if config.step_increment_qps < 0 or config.step_max_qps < config.step_start_qps:
        raise InvalidInput(
            "stepped profile: expected step_increment_qps >= 0 and "
            f"step_max_qps >= step_start_qps, got {config.step_increment_qps!r}, "
            f"{config.step_start_qps!r}..{config.step_max_qps!r}"
        )
    if not config.url.startswith(("http://", "https://")):
        raise InvalidInput(f"--url: expected http://host:port, got {config.url!r}")
    if config.burst_factor < 0:
        raise InvalidInput(f"burst_factor: expected >= 0, got {config.burst_factor!r}")
    for name, key in (
        ("goodput_ttft_ms", "ttft"),
        ("goodput_tpot_ms", "tpot"),
        ("goodput_e2e_ms", "e2el"),
    ):
        value = getattr(config, name)
        if value is not None and not (
            isinstance(value, int | float) and math.isfinite(value) and value > 0
        ):
            raise InvalidInput(f"--goodput {key}: expected milliseconds > 0, got {value!r}")
    owner = config.owner_pid
    if owner is not None and (isinstance(owner, bool) or not isinstance(owner, int) or owner < 1):
        raise InvalidInput(f"owner_pid: expected a process id >= 1 or None, got {owner!r}")


def default_run_dir() -> Path:
    """reports/load/<time>-<pid>/: a run's files stay under reports/, never outside the repo."""
    return Path("reports") / "load" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
