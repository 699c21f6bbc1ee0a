"""The library call: run the load in the background, read live windows, steer it, stop it.

    run = LoadRun.start(LoadConfig(url="http://127.0.0.1:8000", qps=200, duration_s=120))
    t0 = run.wait_started()           # epoch of the schedule's time zero
    w = run.window(last_s=5)          # dict: achieved_qps, latency_ms{p50..p999}, ...
    run.set_qps(400)
    run.inject_burst(duration_s=5, factor=2.0)
    for second in run.seconds(since_ts=t0):   # per-second records, final or not
        ...
    summary = run.stop()              # or run.wait() for the natural end

`LoadConfig.owner_pid` makes the load stop itself when that process is gone; every load
process carries `LLMCHAOS_LOAD=<run dir>` in its environment, and `find_load_processes()` finds
them (for a cleanup after a crash).

Locust (and so gevent monkey-patching) lives in a child process: this module imports neither,
so an asyncio program (the gateway, the Chaos Toolkit control) can use it. Calls block on
small local HTTP requests; from asyncio, wrap them in `asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.load.config import LoadConfig, default_run_dir, validate
from llmchaos.load.procs import LOAD_ENV
from llmchaos.load.profiles import build_profile
from llmchaos.load.summary import Summary
from llmchaos.load.traffic import check_bad_tokens, load_tenants
from llmchaos.load.wire import CONFIG_ARGUMENT, CONNECT_TIMEOUT_ENV, LIVE_FILE, split_url
from llmchaos.processes import find_marked, start_ticks, stop_group
from llmchaos.signals import deferred, held

__all__ = [
    "LoadError",
    "LoadRun",
    "check_config",
    "find_load_processes",
    "locust_command",
    "master_address",
    "resolve_master_port",
    "run_worker",
    "worker_command",
]

LOCUSTFILE = str(Path(__file__).with_name("locustfile.py"))
_POLL_S = 0.1


class LoadError(LLMChaosError):
    """The load process failed to start, answer or finish."""


def check_config(config: LoadConfig) -> None:
    """Everything checkable before a start. Raises InvalidInput naming the flag."""
    validate(config)
    build_profile(config)
    split_url(config.url)
    tenants = load_tenants(config.tokens_file) if config.tokens_file else []
    if config.api_key_env is not None and not os.environ.get(config.api_key_env):
        raise InvalidInput(
            f"--api-key-env: the environment variable {config.api_key_env!r} is not set or "
            "empty; export it with the API key before starting the load"
        )
    check_bad_tokens(config.traffic.bad_tokens, config.traffic.bad_token_share, tenants)
    if config.owner_pid is not None and start_ticks(config.owner_pid) is None:
        raise InvalidInput(f"owner_pid: no process {config.owner_pid} is running")
    if config.check_target:
        _check_target(config.url, timeout_s=min(config.timeout_s, 3.0))


def _check_target(url: str, timeout_s: float) -> None:
    """Any HTTP answer (even 404/405) means the target is there."""
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidInput(f"--url: {url} does not answer ({reason})") from None


def find_load_processes() -> dict[int, str]:
    """Running load processes (Locust masters and their workers) of any run, found by their
    `LLMCHAOS_LOAD` environment marker: pid -> absolute run folder. This process is left out;
    processes of other users cannot be read and are not listed."""
    return find_marked(LOAD_ENV)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def master_address(config: LoadConfig) -> str:
    """HOST:PORT a worker connects to (`llmchaos load-worker --master`); the port must be
    resolved (LoadRun.start picks a free one when it is 0)."""
    host = config.master_bind_host
    return f"{'127.0.0.1' if host in ('0.0.0.0', '*') else host}:{config.master_port}"


def resolve_master_port(config: LoadConfig) -> LoadConfig:
    """The config with a free master port picked on its bind address when it is 0 and the run
    has a master; a fixed one lets workers on other hosts be started before the run."""
    if not config.distributed or config.master_port:
        return config
    host = "0.0.0.0" if config.master_bind_host == "*" else config.master_bind_host
    try:
        return replace(config, master_port=_free_port(host))
    except OSError as exc:
        raise InvalidInput(
            f"--master-bind-host: cannot listen on {config.master_bind_host!r} ({exc}); give "
            "an address of this machine, or 0.0.0.0"
        ) from None


def locust_command(config: LoadConfig) -> list[str]:
    """The Locust command line of a run (also what to adapt for Kubernetes masters).

    Distributed (`config.distributed`): with local processes, Locust's `--processes N` (the
    parent is the master; the Controller raises its expected workers to the local plus the
    remote ones); with remote workers only, `--master --expect-workers N`. Each worker runs
    `locust -f <this locustfile> --worker --master-host HOST --master-port PORT`, which is what
    `llmchaos load-worker --master HOST:PORT` starts."""
    users = str(config.total_workers)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        LOCUSTFILE,
        CONFIG_ARGUMENT,
        config.to_json(),
        "--host",
        config.url,
        "-u",
        users,
        "-r",
        users,
        "--loglevel",
        "WARNING",
        "--exit-code-on-error",
        "0",
        "--only-summary",
    ]
    if config.distributed:
        # a port of our own (resolve_master_port): Locust's default 5557 makes two loads on
        # one machine (two runs, a run and a benchmark) collide, and the second master dies
        config = resolve_master_port(config)
        host, port = master_address(config).rsplit(":", 1)
        if config.workers:
            cmd += ["--processes", str(config.workers), "--master-host", host]
            cmd += ["--master-port", port]
        else:
            cmd += ["--master", "--expect-workers", str(config.remote_workers)]
        cmd += ["--master-bind-host", config.master_bind_host, "--master-bind-port", port]
    if config.web_ui_port is None:
        cmd += ["--headless"]
    else:
        cmd += ["--autostart", "--web-host", "127.0.0.1", "--web-port", str(config.web_ui_port)]
    return cmd


def worker_command(master: str) -> list[str]:
    """Locust's own command line of a worker of the master at HOST:PORT (`llmchaos
    load-worker` runs it); it gets the config, its share and time zero from the master."""
    host, port = _split_master(master)
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        LOCUSTFILE,
        "--worker",
        "--master-host",
        host,
        "--master-port",
        str(port),
        "--loglevel",
        "WARNING",
    ]


def _split_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"--master: expected HOST:PORT, got {master!r}")
    return host, int(port)


def run_worker(master: str, *, connect_timeout_s: float = 60.0) -> int:
    """Become a Locust worker of the master at HOST:PORT (this process is replaced by Locust,
    so a signal to it reaches the worker itself). Waits until the master listens, at most
    `connect_timeout_s`; raises InvalidInput for a malformed address, LoadError when nothing
    listens. The worker ends when its master quits, or ~10 s after its master is gone
    (process.MASTER_GONE_S), or when Locust's connection to the master is not made within
    `connect_timeout_s` (rounded up to Locust's 5-s tries: a master that quit just after it
    was seen listening); one that joins after time zero gets no share and waits idle for the
    master's end."""
    host, port = _split_master(master)
    if not math.isfinite(connect_timeout_s) or connect_timeout_s < 0:
        raise InvalidInput(
            f"--connect-timeout-s: expected a number of seconds >= 0, got {connect_timeout_s}"
        )
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LoadError(
                    f"--master: nothing listens on {master} after {connect_timeout_s:.0f} s "
                    f"({exc}); start `llmchaos load --remote-workers N` first"
                ) from None
            time.sleep(0.5)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, CONNECT_TIMEOUT_ENV: str(connect_timeout_s)}
    os.execve(sys.executable, worker_command(master), env)
    return 0  # not reached: execve replaces the process


def _wait_live(process: subprocess.Popen[bytes], run_dir: Path, timeout_s: float) -> str:
    """The live endpoint's URL once the load process has written it; raises LoadError."""
    deadline = time.monotonic() + timeout_s
    live = run_dir / LIVE_FILE
    while not live.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = (run_dir / "locust.log").read_text(errors="replace")[-2000:]
            raise LoadError(f"the load process did not start (see {run_dir}/locust.log):\n{tail}")
        time.sleep(_POLL_S)
    return str(json.loads(live.read_text())["url"])


class LoadRun:
    """A load running in a Locust child process; see the module docstring."""

    def __init__(self, config: LoadConfig, process: subprocess.Popen[bytes], live_url: str):
        self.config = config
        self.process = process
        self.live_url = live_url
        self.run_dir = Path(config.run_dir or ".")

    @classmethod
    def start(cls, config: LoadConfig, *, ready_timeout_s: float = 30.0) -> LoadRun:
        """Validate, start Locust, wait for its live endpoint.

        Raises InvalidInput for bad config (before anything starts), LoadError when the
        process does not come up within `ready_timeout_s`.
        """
        check_config(config)
        run_dir = Path(config.run_dir or default_run_dir())
        run_dir.mkdir(parents=True, exist_ok=True)
        config = replace(resolve_master_port(config), run_dir=str(run_dir))
        (run_dir / "config.json").write_text(config.to_json())
        (run_dir / LIVE_FILE).unlink(missing_ok=True)
        # The marker lets a cleanup find this load again after its owner died.
        env = {**os.environ, LOAD_ENV: str(run_dir.resolve())}
        process: subprocess.Popen[bytes] | None = None
        try:
            with (run_dir / "locust.log").open("wb") as log, deferred():
                process = subprocess.Popen(
                    locust_command(config),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            live_url = _wait_live(process, run_dir, ready_timeout_s)
        except BaseException:
            # an interrupt included, also one held during Popen and raised as the `with`
            # ends: the caller never gets the process, so nobody else would stop it
            if process is not None:
                with held("stopping the load process"):
                    _terminate(process)
            raise
        return cls(config, process, live_url)

    def _call(self, method: str, path: str, timeout_s: float = 5.0) -> Any:
        request = urllib.request.Request(self.live_url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise LoadError(
                f"{method} {path}: {exc.code} {exc.read().decode(errors='replace')}"
            ) from None
        except OSError as exc:
            raise LoadError(f"{method} {path}: the load process does not answer ({exc})") from None
        return body.decode() if path == "/metrics" else json.loads(body)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def status(self) -> dict[str, Any]:
        """{"state": waiting|running|draining|done, "start_ts", "now_s", ...}."""
        return self._call("GET", "/status")

    def window(
        self, last_s: float = 10.0, *, since_ts: float | None = None, until_ts: float | None = None
    ) -> dict[str, Any]:
        """Stats of requests scheduled in the last `last_s` seconds, or since `since_ts`
        (epoch seconds, up to `until_ts` or now). Raises LoadError before the start."""
        if since_ts is not None:
            query = f"since_ts={since_ts}" + (
                f"&until_ts={until_ts}" if until_ts is not None else ""
            )
        else:
            query = f"last_s={last_s}"
        return self._call("GET", f"/window?{query}")

    def seconds(self, since_ts: float, until_ts: float | None = None) -> list[dict[str, Any]]:
        """Records of the scheduled seconds starting in [since_ts, until_ts or now) (epoch s),
        final or not, by time: each the shape of a timeline line ("t", "ts", counts, "failed",
        "modes", "tenants", "hist", quantiles, "unanswered") plus "final" and
        "scheduled_in_full". Raises LoadError before the start."""
        query = f"since_ts={since_ts}" + (f"&until_ts={until_ts}" if until_ts is not None else "")
        return self._call("GET", f"/seconds?{query}")["seconds"]

    def metrics_text(self) -> str:
        return self._call("GET", "/metrics")

    def wait_started(self, timeout_s: float | None = None) -> float:
        """Block until time zero is set; returns its epoch. Raises LoadError on timeout
        (default: the join timeout for the workers + 30 s)."""
        if timeout_s is None:
            timeout_s = self.config.join_timeout_s + 30.0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            start = self.status().get("start_ts")
            if start is not None:
                return float(start)
            time.sleep(_POLL_S)
        raise LoadError(f"the load did not start within {timeout_s} s")

    def set_qps(self, qps: float) -> None:
        """Send `qps` in total from now on. Raises InvalidInput for qps < 0."""
        if qps < 0:
            raise InvalidInput(f"qps: expected >= 0, got {qps}")
        self._call("POST", f"/control/qps?qps={qps}")

    def inject_burst(self, duration_s: float = 10.0, factor: float = 1.0) -> None:
        """One burst window starting now: `factor` x the base rate on top, for `duration_s`."""
        self._call("POST", f"/control/burst?duration_s={duration_s}&factor={factor}")

    def stop(self, timeout_s: float | None = None) -> Summary:
        """Stop scheduling, let in-flight requests drain, and return the summary."""
        if self.running:
            # Failing to reach it means it is already finishing; wait() tells.
            with contextlib.suppress(LoadError):
                self._call("POST", "/control/stop")
        return self.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> Summary:
        """Wait for the end of the run and return its summary. Raises LoadError on timeout."""
        if timeout_s is None:
            start = self._start_or_none()
            remaining_s = (
                self.config.join_timeout_s + self._duration_s()
                if start is None
                else start + self._duration_s() - time.time()
            )
            timeout_s = (
                max(0.0, remaining_s)
                + self.config.drain_s
                + 3 * self.config.report_interval_s
                + 15.0
            )
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _terminate(self.process)
            raise LoadError(f"the load process did not finish within {timeout_s:.0f} s") from None
        _terminate(self.process)  # a forked worker may still be on its way out
        return Summary.read(self.summary_path)

    @property
    def summary_path(self) -> Path:
        return Path(self.config.summary_json or self.run_dir / "summary.json")

    @property
    def timeline_path(self) -> Path:
        return Path(self.config.timeline or self.run_dir / "timeline.jsonl")

    def _start_or_none(self) -> float | None:
        try:
            return self.status().get("start_ts")
        except LoadError:
            return None

    def _duration_s(self) -> float:
        return build_profile(self.config).duration_s

    def close(self) -> None:
        """Kill the load process if it still runs (use stop() for a summary)."""
        _terminate(self.process)

    def __enter__(self) -> LoadRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running:
            with contextlib.suppress(LLMChaosError):
                self.stop()
        self.close()


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """End the load: its master and every worker the master forked (one process group)."""
    stop_group(process, grace_s=5.0)
