"""`llmchaos load` and `llmchaos capacity`: argparse front-ends over LoadRun and capacity."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from llmchaos.errors import InvalidInput
from llmchaos.load.api import LoadRun, master_address, run_worker
from llmchaos.load.capacity import render_table as render_capacity_table
from llmchaos.load.capacity import run_capacity, write_chart
from llmchaos.load.compare import parse_endpoint, render_table, run_comparison, write_outputs
from llmchaos.load.config import LoadConfig
from llmchaos.load.goodput import parse_goodput
from llmchaos.load.traffic import TrafficSpec
from llmchaos.signals import held

__all__ = ["register"]

# (flag, LoadConfig field, type, help) shared by both subcommands.
_COMMON: list[tuple[str, str, Any, str]] = [
    ("--workers", "workers", int, "Locust processes (1: local runner; N: master + N workers)"),
    ("--tokens", "tokens_file", str, 'tokens file {"tokens": [{"token", "tenant", "revoked"}]}'),
    (
        "--api-key-env",
        "api_key_env",
        str,
        "environment variable holding the one API key to send (when there is no tokens file)",
    ),
    ("--timeout-s", "timeout_s", float, "whole-request timeout, seconds"),
    (
        "--inflight-cap",
        "inflight_cap",
        int,
        "most requests in flight per worker (over it: dropped)",
    ),
    ("--seed", "seed", int, "seed of schedules and traffic"),
    ("--live-port", "live_port", int, "port of the live JSON/Prometheus endpoint (0: any)"),
    ("--web-ui-port", "web_ui_port", int, "serve the Locust web UI on this port"),
    ("--run-dir", "run_dir", str, "folder for the run's files (default: a temp folder)"),
    ("--step-s", "step_s", float, "length of one step of the stepped profile, seconds"),
]
# (flag, TrafficSpec field, type, help): the request mix, as a chaos run's settings name it.
_TRAFFIC: list[tuple[str, str, Any, str]] = [
    (
        "--bad-token-share",
        "bad_token_share",
        float,
        "share of requests with revoked/unknown tokens",
    ),
    (
        "--bad-tokens",
        "bad_tokens",
        str,
        "which bad tokens: mixed (revoked + unknown) | revoked (stale, from --tokens) | unknown",
    ),
    ("--model", "model", str, "model name sent in every request"),
    ("--stream-share", "stream_share", float, "share of streaming (SSE) requests"),
    (
        "--prompt-tokens",
        "prompt_tokens",
        str,
        "user-prompt length: N | uniform:LO:HI | normal:MEAN:SD (default: Zipf-like 10..4096)",
    ),
    ("--context-tokens", "context_tokens", int, "system-message context template, tokens"),
    (
        "--output-tokens",
        "output_tokens",
        str,
        "max_tokens: N | uniform:LO:HI | normal:MEAN:SD (default: log-normal around "
        "--output-median-tokens)",
    ),
    ("--output-median-tokens", "output_median_tokens", int, "median max_tokens (log-normal)"),
]
_LOAD: list[tuple[str, str, Any, str]] = [
    ("--qps", "qps", float, "total arrival rate, requests/s"),
    ("--duration", "duration_s", float, "schedule length, seconds"),
    ("--profile", "profile", str, "constant | poisson | bursty | stepped | PATH.json"),
    ("--summary-json", "summary_json", str, "write the summary here"),
    ("--timeline", "timeline", str, "write the per-second JSON-lines timeline here"),
    (
        "--remote-workers",
        "remote_workers",
        int,
        "workers expected from other hosts (llmchaos load-worker --master HOST:PORT)",
    ),
    (
        "--master-bind-host",
        "master_bind_host",
        str,
        "address the master listens on for workers (one remote hosts reach, or 0.0.0.0)",
    ),
    ("--master-port", "master_port", int, "port of the master for workers (0: a free one)"),
    (
        "--join-timeout-s",
        "join_timeout_s",
        float,
        "wait this long for every worker before time zero; a missing one's share is lost_worker",
    ),
]
_CAPACITY: list[tuple[str, str, Any, str]] = [
    ("--start-qps", "step_start_qps", float, "first step, QPS"),
    ("--step-qps", "step_increment_qps", float, "QPS added per step"),
    ("--max-qps", "step_max_qps", float, "last step, QPS"),
]
# compare: the profile and the common flags, but each endpoint has its own key, folder and
# live port
_PER_ENDPOINT = ("tokens_file", "api_key_env", "run_dir", "live_port", "web_ui_port")
_COMPARE: list[tuple[str, str, Any, str]] = [
    ("--profile", "profile", str, "stepped | PATH.json (the steps of the comparison)"),
    ("--duration", "duration_s", float, "cut the profile short, seconds"),
    *_CAPACITY,
    *(s for s in _COMMON if s[1] not in _PER_ENDPOINT),
]
_DEFAULTS = {f.name: f.default for f in (*fields(LoadConfig), *fields(TrafficSpec))}


def _add(
    parser: argparse.ArgumentParser, specs: list[tuple[str, str, Any, str]], **defaults: Any
) -> None:
    for flag, name, kind, text in specs:
        default = defaults.get(name, _DEFAULTS[name])
        parser.add_argument(
            flag, dest=name, type=kind, default=default, help=f"{text} (default: {default})"
        )


def _config(
    args: argparse.Namespace, specs: list[tuple[str, str, Any, str]], url: str
) -> LoadConfig:
    values = {name: getattr(args, name) for _, name, _, _ in specs}
    slo = parse_goodput(args.goodput)
    # Owned by this command: a SIGKILLed `llmchaos load` (no cleanup) stops its load too.
    return LoadConfig(
        url=url,
        owner_pid=os.getpid(),
        traffic=_traffic(args),
        goodput_ttft_ms=slo.ttft_ms,
        goodput_tpot_ms=slo.tpot_ms,
        goodput_e2e_ms=slo.e2e_ms,
        **values,
    )


def _traffic(args: argparse.Namespace) -> TrafficSpec:
    """The request mix of the flags; InvalidInput names the flag, as the user wrote it."""
    flags = {name: flag for flag, name, _, _ in _TRAFFIC}
    try:
        return TrafficSpec(
            **{name: getattr(args, name) for name in flags}, ignore_eos=args.ignore_eos
        )
    except InvalidInput as exc:
        name, sep, rest = str(exc).partition(":")
        if sep and name in flags:
            raise InvalidInput(f"{flags[name]}:{rest}") from None
        raise


def _add_shaping(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true, so a vLLM target answers exactly max_tokens",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="goodput SLOs as vLLM bench serve takes them: ttft:MS tpot:MS e2el:MS "
        "(a request is good when it meets every one given)",
    )


def _load(args: argparse.Namespace) -> int:
    run = LoadRun.start(_config(args, _COMMON + _LOAD, args.url))
    print(
        f"llmchaos load: live endpoint {run.live_url} (run folder {run.run_dir})", file=sys.stderr
    )
    if run.config.remote_workers:
        print(
            f"llmchaos load: waiting up to {run.config.join_timeout_s:.0f} s for "
            f"{run.config.remote_workers} remote workers: llmchaos load-worker --master "
            f"{master_address(run.config)}",
            file=sys.stderr,
        )
    try:
        summary = run.wait()
    except KeyboardInterrupt:
        with held("stopping the load"):
            summary = run.stop()
    print(json.dumps(summary.to_dict(), indent=2))
    return 0


def _capacity(args: argparse.Namespace) -> int:
    config = _config(args, _COMMON + _CAPACITY, args.url)
    result = run_capacity(config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result.to_dict(), indent=2))
    chart = write_chart(result, out / "capacity.svg")
    print(json.dumps(result.to_dict(), indent=2))
    print(render_capacity_table(result), file=sys.stderr)
    print(f"llmchaos capacity: chart {chart}", file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    endpoints = [parse_endpoint(text) for text in args.endpoint]
    # each endpoint's URL and key replace these (llmchaos.load.compare)
    config = _config(args, _COMPARE, endpoints[0].url)
    out = Path(args.out or f"reports/compare/{time.strftime('%Y%m%d-%H%M%S')}")
    result = run_comparison(endpoints, config, parallel=args.mode == "parallel", out=out)
    print(render_table(result))
    for path in write_outputs(result, out):
        print(f"llmchaos compare: wrote {path}", file=sys.stderr)
    return 0


def _load_worker(args: argparse.Namespace) -> int:
    return run_worker(args.master, connect_timeout_s=args.connect_timeout_s)


def register(subparsers: Any) -> None:
    """Add the `load`, `load-worker`, `capacity` and `compare` subcommands."""
    load = subparsers.add_parser("load", help="open-loop LLM load against a URL")
    load.add_argument("--url", required=True, help="base URL of the target, http://host:port")
    _add(load, _LOAD + _COMMON + _TRAFFIC)
    _add_shaping(load)
    load.set_defaults(func=_load)

    worker = subparsers.add_parser(
        "load-worker",
        help="a Locust worker of a `llmchaos load --remote-workers N` run on another host",
    )
    worker.add_argument(
        "--master",
        required=True,
        metavar="HOST:PORT",
        help="the run's master (`llmchaos load` prints it; its --master-bind-host/--master-port)",
    )
    worker.add_argument(
        "--connect-timeout-s",
        type=float,
        default=60.0,
        help="give up when the master does not listen within this long, or when Locust's "
        "connection to it is not made within this long, rounded up to Locust's 5-s tries "
        "(default: 60)",
    )
    worker.set_defaults(func=_load_worker)

    capacity = subparsers.add_parser(
        "capacity", help="stepped load until the knee; sustainable QPS"
    )
    capacity.add_argument("--url", required=True, help="base URL of the target, http://host:port")
    capacity.add_argument(
        "--out", default="reports/capacity", help="folder for capacity.json and .svg"
    )
    _add(capacity, _CAPACITY + _COMMON + _TRAFFIC, step_s=30.0)
    _add_shaping(capacity)
    capacity.set_defaults(func=_capacity)

    compare = subparsers.add_parser(
        "compare",
        help="the same stepped load against two or more endpoints; P99, errors by class, "
        "frame drops and tokens/s side by side",
    )
    compare.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="NAME=URL[,key-env=VAR][,tokens=FILE][,model=M]",
        help="an OpenAI-compatible endpoint and its own key (repeat: at least two); the key "
        "is read from the environment variable VAR, never from the command line",
    )
    compare.add_argument(
        "--mode",
        choices=("sequential", "parallel"),
        default="sequential",
        help="one endpoint after the other (default), or all at once",
    )
    compare.add_argument(
        "--out", default=None, help="folder for the results (default reports/compare/<time>)"
    )
    _add(compare, _COMPARE + _TRAFFIC, step_s=30.0, profile="stepped")
    _add_shaping(compare)
    compare.set_defaults(func=_compare)
