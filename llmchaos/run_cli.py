"""`llmchaos validate`, `llmchaos cleanup`, `llmchaos gameday` and `llmchaos calibrate`: the
commands around Chaos Toolkit runs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmchaos.gameday import SUITES, run_gameday
from llmchaos.run import RUN_FILE, finish_dead_runs
from llmchaos.settings import RunSettings
from llmchaos.signals import held
from llmchaos.targets import KINDS, CleanupRequest, target_kind
from llmchaos.validation import validate_experiment_file

__all__ = ["register"]

_DEFAULTS = RunSettings()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate`, `cleanup`, `gameday` and `calibrate` commands to the llmchaos
    command line."""
    validate = subparsers.add_parser(
        "validate",
        help="check experiments as Chaos Toolkit does, and against the target's names",
    )
    validate.add_argument("experiments", nargs="+", type=Path, metavar="EXPERIMENT.json")
    validate.set_defaults(func=_validate)

    clean = subparsers.add_parser(
        "cleanup",
        help="finish killed runs (stop their load, close their faults, rebuild their report) "
        "and remove what dead stacks left; what a live owner holds is left alone",
    )
    clean.add_argument(
        "--stack",
        metavar="ID",
        action="append",
        default=[],
        help="remove this stack whatever its owner (repeatable)",
    )
    clean.add_argument(
        "--run",
        metavar="ID",
        action="append",
        default=[],
        help="finish this run (its folder name) and remove its stack, even if its owner lives",
    )
    clean.add_argument(
        "--all",
        action="store_true",
        dest="everything",
        help="every run and stack, live ones included (asks first; --yes to skip)",
    )
    clean.add_argument("--yes", action="store_true", help="do not ask before --all")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    clean.add_argument(
        "--state-root",
        type=Path,
        default=None,
        help="folder of the embedded stacks' state folders (default reports/stacks)",
    )
    clean.add_argument(
        "--runs-root",
        type=Path,
        default=Path(_DEFAULTS.runs_root),
        help=f"folder of the run folders (default {_DEFAULTS.runs_root})",
    )
    clean.set_defaults(func=_cleanup)

    gameday = subparsers.add_parser(
        "gameday",
        help="run the resilience suite, build the Allure report with trends; non-zero on any "
        "SLA breach",
    )
    gameday.add_argument(
        "--suite",
        default="nightly",
        choices=sorted(SUITES),
        help="which tests: nightly (the catalogue and its known-bad variants), smoke (the "
        "catalogue on the default stack), soak (hours of stepped load; LLMCHAOS_SOAK_STEP_S "
        "compresses it) (default nightly)",
    )
    gameday.add_argument(
        "--target",
        default="embedded",
        choices=sorted(KINDS),
        help="the target every experiment runs against (default embedded)",
    )
    gameday.add_argument("--select", metavar="EXPR", help="only tests matching this pytest -k")
    gameday.add_argument(
        "--root",
        type=Path,
        default=Path("reports/gameday"),
        help="folder of the game days and their history (default reports/gameday)",
    )
    gameday.set_defaults(func=_gameday)

    calibrate = subparsers.add_parser(
        "calibrate",
        help="measure the rate this machine sustains during a GPU kill: what chaos runs send "
        "the embedded stack by default (cached; LLMCHAOS_CALIBRATION_FILE)",
    )
    calibrate.add_argument(
        "--force", action="store_true", help="measure again even when this machine's is cached"
    )
    calibrate.add_argument(
        "--show", action="store_true", help="only print the cached calibration (exit 1: none)"
    )
    calibrate.set_defaults(func=_calibrate)


def _validate(args: argparse.Namespace) -> int:
    invalid = 0
    for path in args.experiments:
        problems = validate_experiment_file(path)
        if problems:
            invalid += 1
            print(f"{path}: INVALID")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{path}: ok")
    return 2 if invalid else 0


def _calibrate(args: argparse.Namespace) -> int:
    settings = RunSettings.from_configuration({}, os.environ)  # never measures
    assert settings.target_settings is not None
    measure = "never" if args.show else "again" if args.force else "if-missing"
    described = target_kind(settings.target).calibration(
        settings.target_settings, measure=measure, progress=print
    )
    if described is None:
        print("no calibration of this machine cached", file=sys.stderr)
        return 1
    print(described)
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    if args.everything and not args.dry_run and not _confirmed(args):
        print("llmchaos cleanup: --all not confirmed; nothing done", file=sys.stderr)
        return 1
    every_run = [p.name for p in sorted(args.runs_root.glob(f"*/{RUN_FILE}"))]
    only_named = bool(args.stack or args.run) and not args.everything
    lines: list[str] = []
    with held("cleaning up"):
        run_ids = every_run if args.everything else args.run
        for line in finish_dead_runs(args.runs_root, run_ids, dry_run=args.dry_run):
            print(("would finish " if args.dry_run else "finished ") + line)
        if not only_named or args.stack:
            request = CleanupRequest(
                state_root=args.state_root,
                names=tuple(args.stack),
                everything=args.everything,
                dry_run=args.dry_run,
            )
            for name in KINDS:
                lines += target_kind(name).cleanup(request)
    print("cleanup:" if lines else "cleanup: nothing left behind")
    for line in lines:
        print(f"  {line}")
    return 0


def _confirmed(args: argparse.Namespace) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print("llmchaos cleanup: --all stops live runs and stacks too; add --yes", file=sys.stderr)
        return False
    answer = input("Stop every llmchaos run and stack on this machine, live ones too? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _gameday(args: argparse.Namespace) -> int:
    return run_gameday(args.suite, target=args.target, select=args.select, root=args.root).exit_code
