"""`llmchaos load` and `llmchaos capacity`: argparse front-ends over LoadRun and capacity."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from llmchaos.load.api import LoadRun
from llmchaos.load.capacity import run_capacity, write_chart
from llmchaos.load.config import LoadConfig
from llmchaos.load.goodput import parse_goodput
from llmchaos.signals import held

__all__ = ["register"]

# (flag, LoadConfig field, type, help) shared by both subcommands.
_COMMON: list[tuple[str, str, Any, str]] = [
    ("--workers", "workers", int, "Locust processes (1: local runner; N: master + N workers)"),
    ("--tokens", "tokens_file", str, 'tokens file {"tokens": [{"token", "tenant", "revoked"}]}'),
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
        "max_tokens: N | uniform:LO:HI | normal:MEAN:SD (default: log-normal, median 64)",
    ),
]
_LOAD: list[tuple[str, str, Any, str]] = [
    ("--qps", "qps", float, "total arrival rate, requests/s"),
    ("--duration", "duration_s", float, "schedule length, seconds"),
    ("--profile", "profile", str, "constant | poisson | bursty | stepped | PATH.json"),
    ("--summary-json", "summary_json", str, "write the summary here"),
    ("--timeline", "timeline", str, "write the per-second JSON-lines timeline here"),
]
_CAPACITY: list[tuple[str, str, Any, str]] = [
    ("--start-qps", "step_start_qps", float, "first step, QPS"),
    ("--step-qps", "step_increment_qps", float, "QPS added per step"),
    ("--max-qps", "step_max_qps", float, "last step, QPS"),
]
_DEFAULTS = {f.name: f.default for f in fields(LoadConfig)}


def _add(
    parser: argparse.ArgumentParser, specs: list[tuple[str, str, Any, str]], **defaults: Any
) -> None:
    for flag, name, kind, text in specs:
        default = defaults.get(name, _DEFAULTS[name])
        parser.add_argument(
            flag, dest=name, type=kind, default=default, help=f"{text} (default: {default})"
        )


def _config(args: argparse.Namespace, specs: list[tuple[str, str, Any, str]]) -> LoadConfig:
    values = {name: getattr(args, name) for _, name, _, _ in specs}
    slo = parse_goodput(args.goodput)
    # Owned by this command: a SIGKILLed `llmchaos load` (no cleanup) stops its load too.
    return LoadConfig(
        url=args.url,
        owner_pid=os.getpid(),
        ignore_eos=args.ignore_eos,
        goodput_ttft_ms=slo.ttft_ms,
        goodput_tpot_ms=slo.tpot_ms,
        goodput_e2e_ms=slo.e2e_ms,
        **values,
    )


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
    run = LoadRun.start(_config(args, _COMMON + _LOAD))
    print(
        f"llmchaos load: live endpoint {run.live_url} (run folder {run.run_dir})", file=sys.stderr
    )
    try:
        summary = run.wait()
    except KeyboardInterrupt:
        with held("stopping the load"):
            summary = run.stop()
    print(json.dumps(summary.to_dict(), indent=2))
    return 0


def _capacity(args: argparse.Namespace) -> int:
    config = _config(args, _COMMON + _CAPACITY)
    result = run_capacity(config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result.to_dict(), indent=2))
    chart = write_chart(result, out / "capacity.svg")
    print(json.dumps(result.to_dict(), indent=2))
    print(f"llmchaos capacity: chart {chart}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the `load` and `capacity` subcommands."""
    load = subparsers.add_parser("load", help="open-loop LLM load against a URL")
    load.add_argument("--url", required=True, help="base URL of the target, http://host:port")
    _add(load, _LOAD + _COMMON)
    _add_shaping(load)
    load.set_defaults(func=_load)

    capacity = subparsers.add_parser(
        "capacity", help="stepped load until the knee; sustainable QPS"
    )
    capacity.add_argument("--url", required=True, help="base URL of the target, http://host:port")
    capacity.add_argument(
        "--out", default="reports/capacity", help="folder for capacity.json and .svg"
    )
    _add(capacity, _CAPACITY + _COMMON, step_s=30.0)
    _add_shaping(capacity)
    capacity.set_defaults(func=_capacity)
