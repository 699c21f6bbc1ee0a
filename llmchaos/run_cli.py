"""`llmchaos validate`, `llmchaos cleanup` and `llmchaos gameday`: the commands around Chaos
Toolkit runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmchaos.gameday import SUITES, run_gameday
from llmchaos.run import abandon_dead_runs
from llmchaos.settings import RunSettings
from llmchaos.stack.cleanup import cleanup
from llmchaos.validation import validate_experiment_file

__all__ = ["register"]

_DEFAULTS = RunSettings()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate`, `cleanup` and `gameday` commands to the llmchaos command line."""
    validate = subparsers.add_parser(
        "validate",
        help="check experiments as Chaos Toolkit does, and against the target's names",
    )
    validate.add_argument("experiments", nargs="+", type=Path, metavar="EXPERIMENT.json")
    validate.set_defaults(func=_validate)

    clean = subparsers.add_parser(
        "cleanup",
        help="finish killed runs (stop their load) and remove processes, namespaces and links "
        "left by crashed or killed stacks",
    )
    clean.add_argument("--stack", metavar="ID", help="only this stack (default: all of them)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    clean.add_argument(
        "--state-root",
        type=Path,
        default=Path(_DEFAULTS.stacks_root),
        help=f"folder of the stacks' state folders (default {_DEFAULTS.stacks_root})",
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
        "--suite", default="nightly", choices=sorted(SUITES), help="which tests (default nightly)"
    )
    gameday.add_argument(
        "--target",
        default="embedded",
        choices=["embedded", "k8s"],
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


def _cleanup(args: argparse.Namespace) -> int:
    for line in abandon_dead_runs(args.runs_root, dry_run=args.dry_run):
        print(("would finish " if args.dry_run else "finished ") + line)
    report = cleanup(args.state_root, args.stack, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"cleanup {verb}:" if not report.empty else "cleanup: nothing left behind")
    for line in report.lines():
        print(f"  {line}")
    return 0


def _gameday(args: argparse.Namespace) -> int:
    return run_gameday(args.suite, target=args.target, select=args.select, root=args.root).exit_code
