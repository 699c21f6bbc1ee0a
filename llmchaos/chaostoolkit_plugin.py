"""llmchaos in Chaos Toolkit's command line (a `chaostoolkit.cli_plugins` entry point).

- `chaos llmchaos ARGS...` is `llmchaos ARGS...` (validate, cleanup, gameday, ...).
- `chaos run` and `chaos validate` read an experiment *file* through
  `llmchaos.experiment_file.read_experiment` first, so an empty file, a list, a number or
  broken JSON or YAML is one line naming the file and what is wrong (the line `llmchaos
  validate` prints) instead of Chaos Toolkit's traceback. Chaos Toolkit 1.19 reads the file
  before any control of the experiment can run, so this is the only place to do it: its
  commands look their loader up by the module-level name `load_experiment`, which is wrapped
  here once, when Chaos Toolkit loads its plugins. URLs and valid files go to its own loader
  unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from chaoslib.exceptions import InvalidSource
from chaostoolkit.commands import run as run_command
from chaostoolkit.commands import validate as validate_command

from llmchaos.errors import InvalidInput
from llmchaos.experiment_file import read_experiment

__all__ = ["llmchaos"]


@click.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def llmchaos(args: tuple[str, ...]) -> None:
    """llmchaos's own commands: chaos llmchaos validate|cleanup|gameday|stack|load ..."""
    from llmchaos.cli import main

    sys.exit(main(list(args)))


def _checked(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_experiment(source: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(source, str) and "://" not in source and Path(source).is_file():
            try:
                read_experiment(Path(source))
            except InvalidInput as exc:
                raise InvalidSource(str(exc)) from None
        return load(source, *args, **kwargs)

    load_experiment.__wrapped__ = load  # type: ignore[attr-defined]
    return load_experiment


for _command in (run_command, validate_command):
    if not hasattr(_command.load_experiment, "__wrapped__"):
        _command.load_experiment = _checked(_command.load_experiment)
