"""SIGINT and SIGTERM: every command stops on them, and its cleanup is never cut short.

    raise_on_interrupt()          # SIGINT and SIGTERM raise KeyboardInterrupt("SIGINT")
    with deferred():              # a short step that must not be left half done
        proc = spawn(...)         #   (a signal meanwhile is delivered when the step ends)
    with held("stopping the stack"):
        teardown()                # further signals are noted and ignored until it ends

Why SIGINT is installed explicitly, not left to Python: a process started in the background
by a non-interactive shell (CI runners, `cmd &` in scripts) inherits SIGINT as *ignored*, and
Python keeps it ignored, so Ctrl-C or `kill -INT` would be lost and whatever the command had
started would stay behind. SIGTERM takes the same path as Ctrl-C, so half-started stacks and
runs are undone either way.

Signal handlers can only be set from the main thread; elsewhere these are no-ops.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["INTERRUPTS", "deferred", "held", "install", "raise_on_interrupt", "restore"]

INTERRUPTS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""The signals that mean "stop now, cleanly"."""

Handler = Callable[[int, FrameType | None], Any] | int | None


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(handler: Handler, signals: tuple[int, ...] = INTERRUPTS) -> dict[int, Handler]:
    """Set `handler` for `signals`; returns the handlers found, for `restore`."""
    if not _main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals}


def restore(previous: dict[int, Handler]) -> None:
    """Put back the handlers `install` returned."""
    if not _main_thread():
        return
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def raise_on_interrupt() -> dict[int, Handler]:
    """SIGINT and SIGTERM raise KeyboardInterrupt(<signal name>) from now on, whatever the
    process inherited (see the module docstring). Returns the handlers found."""
    return install(_raise_interrupt)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM during a short step (start a process and record its pid; create
    a namespace and note it); a signal that came meanwhile is delivered when the step ends,
    to the handler that was there before."""
    received: list[int] = []
    previous = install(lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        restore(previous)
        if received and previous:
            signal.raise_signal(received[0])


@contextlib.contextmanager
def held(what: str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Note and ignore SIGINT/SIGTERM while `what` runs (the cleanup after an interrupt: a
    second Ctrl-C must not leave half a stack behind)."""

    def note(signum: int, _frame: FrameType | None) -> None:
        (say or _stderr)(
            f"{signal.Signals(signum).name} received while {what}; finishing that first "
            "(kill -9 and `llmchaos cleanup` if it hangs)"
        )

    previous = install(note)
    try:
        yield
    finally:
        restore(previous)


def _stderr(message: str) -> None:
    print(f"llmchaos: {message}", file=sys.stderr, flush=True)
