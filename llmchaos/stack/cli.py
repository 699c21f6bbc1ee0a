"""`llmchaos stack up|status|down` (`llmchaos cleanup` is in llmchaos.run_cli)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from llmchaos.signals import held
from llmchaos.stack.config import DEFAULT_VARIANT, VARIANTS, StackConfig
from llmchaos.stack.fleet import DEFAULT_TRAFFIC, FleetSettings, check_fits_here, plan_fleet
from llmchaos.stack.stack import (
    gateway_layout,
    live_status,
    node_layout,
    start_stack,
    stop_stack,
)
from llmchaos.stack.topology import Topology, find_state_dir

__all__ = ["register"]

_DEFAULTS = StackConfig()
_FLEET = FleetSettings()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `stack` command to the llmchaos command line."""
    stack = subparsers.add_parser("stack", help="the embedded reference serving stack")
    actions = stack.add_subparsers(dest="stack_command", required=True, metavar="ACTION")

    up = actions.add_parser("up", help="start the stack and print its topology file")
    variants = "; ".join(f"{v.name}: {v.description}" for v in VARIANTS.values())
    up.add_argument(
        "--variant", default=DEFAULT_VARIANT, help=f"target variant ({variants})", metavar="V"
    )
    up.add_argument(
        "--netns",
        default=_DEFAULTS.netns,
        choices=["auto", "on", "off"],
        help="nodes as network namespaces (on needs root; auto = on when root)",
    )
    up.add_argument(
        "--qps",
        type=float,
        metavar="N",
        help="lay out a fleet for N requests/s of the load's default traffic: nodes of "
        "--gpus-per-node GPU workers (N+1 by node), a CPU fallback pool, active-active "
        "gateways plus the backup (README: A fleet sized from the rate); the flags below "
        "override its parts",
    )
    up.add_argument(
        "--gpu-workers",
        type=int,
        metavar="N",
        help=f"GPU workers (default {_DEFAULTS.gpu_workers}, or the fleet's)",
    )
    up.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="K",
        help=f"GPU workers per node (default {_DEFAULTS.gpus_per_node}; with --qps "
        f"{_FLEET.gpus_per_node})",
    )
    up.add_argument(
        "--cpu-workers",
        type=int,
        metavar="N",
        help=f"CPU fallback workers (default {_DEFAULTS.cpu_workers}, or the fleet's)",
    )
    up.add_argument(
        "--active-gateways",
        type=int,
        metavar="N",
        help=f"gateways HAProxy spreads requests over, besides the backup (default "
        f"{_DEFAULTS.active_gateways}, or the fleet's)",
    )
    up.add_argument(
        "--port", type=int, default=_DEFAULTS.port, help="HAProxy port on 127.0.0.1 (0: any free)"
    )
    up.add_argument(
        "--gpu-load-s",
        type=float,
        default=_DEFAULTS.gpu_load_s,
        help="model-load seconds of a GPU worker at each (re)start",
    )
    up.add_argument(
        "--gpu-max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="running-batch size of the GPU workers (default: 256, vLLM's)",
    )
    up.add_argument(
        "--degradation-queue-threshold",
        type=int,
        default=_DEFAULTS.degradation_queue_threshold,
        metavar="N",
        help="gateways degrade when the engines' queue passes this (default "
        f"{_DEFAULTS.degradation_queue_threshold})",
    )
    up.add_argument(
        "--queue-shed-threshold",
        type=int,
        default=_DEFAULTS.queue_shed_threshold,
        metavar="N",
        help=f"gateways shed with 429 above this queue (default {_DEFAULTS.queue_shed_threshold})",
    )
    up.add_argument(
        "--discovery",
        default=_DEFAULTS.discovery,
        choices=["static", "etcd"],
        help="gateways' workers from their settings, or from a 3-member etcd registry",
    )
    _add_state_root(up)
    up.set_defaults(func=_up)

    status = actions.add_parser("status", help="topology with live health")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    _add_state_options(status)
    status.set_defaults(func=_status)

    down = actions.add_parser("down", help="stop all that `stack up` started")
    _add_state_options(down)
    down.set_defaults(func=_down)


def _add_state_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-root",
        type=Path,
        default=_DEFAULTS.state_root,
        help=f"folder of the stacks' state folders (default {_DEFAULTS.state_root})",
    )


def _add_state_options(parser: argparse.ArgumentParser) -> None:
    _add_state_root(parser)
    parser.add_argument("--state", type=Path, help="a stack's state folder (default: current)")


def _up(args: argparse.Namespace) -> int:
    config = _config(args)
    topology = start_stack(config, progress=True)
    print(f"stack {topology.stack_id} ({topology.variant}) up: {topology.gateway_url}")
    print(f"tokens: {topology.tokens_file}")
    print(topology.path)
    return 0


_SIZES = ("gpu_workers", "gpus_per_node", "cpu_workers", "active_gateways")
"""The StackConfig fields a fleet sets, and flags of the same names override."""


def _config(args: argparse.Namespace) -> StackConfig:
    """The StackConfig of `stack up`: the fleet for --qps (printed) with the sizes given
    explicitly on top. Raises InvalidInput for a bad rate or a fleet this machine cannot run."""
    given = {name: getattr(args, name) for name in _SIZES if getattr(args, name) is not None}
    base = StackConfig(
        variant=args.variant,
        netns=args.netns,
        port=args.port,
        gpu_load_s=args.gpu_load_s,
        gpu_max_num_seqs=args.gpu_max_num_seqs,
        degradation_queue_threshold=args.degradation_queue_threshold,
        queue_shed_threshold=args.queue_shed_threshold,
        discovery=args.discovery,
        state_root=args.state_root,
    )
    if args.qps is None:
        return replace(base, **given)
    settings = FleetSettings(gpus_per_node=given.get("gpus_per_node", _FLEET.gpus_per_node))
    layout = plan_fleet(args.qps, DEFAULT_TRAFFIC, settings)
    check_fits_here(layout, overridden=frozenset(given))
    config = layout.stack_config(base, **given)
    print(layout.describe())
    for node, workers in node_layout(config):
        print(f"  {node}: {', '.join(name for name, _ in workers)}")
    print(f"  gateways: {', '.join(name for name, _ in gateway_layout(config))}")
    return config


def _status(args: argparse.Namespace) -> int:
    topology = Topology.load(find_state_dir(args.state_root, args.state))
    status = live_status(topology)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"stack {topology.stack_id} ({topology.variant}, {topology.status})")
    print(f"  haproxy {topology.gateway_url} alive={status['haproxy_alive']}")
    for g in status["gateways"]:  # type: ignore[attr-defined]
        print(
            f"  {g['name']:<16} {g['url']:<24} healthz={g['healthz']} haproxy={g['haproxy_state']}"
        )
    for n in status["nodes"]:  # type: ignore[attr-defined]
        where = n["netns"] or "loopback"
        print(
            f"  {n['name']:<8} {where:<24} agent={n['agent_alive']} partitioned={n['partitioned']}"
        )
        for w in n["workers"]:
            print(
                f"    {w['name']:<6} {w['mode']} {w['url']:<26} pid={w['pid']} "
                f"restarts={w['restarts']} healthz={w['healthz']}"
            )
    return 0


def _down(args: argparse.Namespace) -> int:
    topology = Topology.load(find_state_dir(args.state_root, args.state))
    with held("stopping the stack"):
        stopped = stop_stack(topology)
    print(f"stack {topology.stack_id} down ({len(stopped)} processes stopped)")
    return 0
