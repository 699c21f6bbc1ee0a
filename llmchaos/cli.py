"""The `llmchaos` command line: one subcommand group per concern, registered by its module.

Every subcommand returns an exit code; InvalidInput becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmchaos.errors import InvalidInput, LLMChaosError
from llmchaos.signals import raise_on_interrupt

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    from llmchaos import run_cli
    from llmchaos.load import cli as load_cli
    from llmchaos.stack import cli as stack_cli

    parser = argparse.ArgumentParser(
        prog="llmchaos", description="Chaos and resilience testing for LLM inference serving."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stack_cli.register(subparsers)
    load_cli.register(subparsers)
    run_cli.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGINT and SIGTERM both raise KeyboardInterrupt, so half-started stacks and runs are
    # undone (see llmchaos.signals for why SIGINT is installed too).
    raise_on_interrupt()
    try:
        return int(args.func(args))
    except InvalidInput as exc:
        print(f"llmchaos {args.command}: {exc}", file=sys.stderr)
        return 2
    except LLMChaosError as exc:
        print(f"llmchaos {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"llmchaos {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
