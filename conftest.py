"""Fixtures shared by tests/ and suites/: the embedded stack, started and always stopped."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from llmchaos.stack.config import StackConfig
from llmchaos.stack.netns import check_netns_support
from llmchaos.stack.stack import start_stack, stop_stack
from llmchaos.stack.topology import Topology

REPO = Path(__file__).resolve().parent
TEST_STACK_CONFIG = StackConfig(port=0, gpu_load_s=1.5, cpu_load_s=0.5, ready_timeout_s=60)
"""Stacks in tests: any free port, short model loads (the restart gap still shows)."""

StackFactory = Callable[..., Topology]
TMP_ROOT = REPO / "reports" / "pytest"


def pytest_configure(config: pytest.Config) -> None:
    """Temporary files go to reports/pytest/run-<pid>/ instead of /tmp: nothing of a test run
    may stay outside the repo and reports/. One folder per run, so runs side by side do not
    clear each other's files; folders of finished runs are removed at the next start."""
    if config.option.basetemp or hasattr(config, "workerinput"):
        return
    TMP_ROOT.mkdir(parents=True, exist_ok=True)
    for old in TMP_ROOT.glob("run-*"):
        pid = old.name.removeprefix("run-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = str(TMP_ROOT / f"run-{os.getpid()}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Keep a failed run's files for a look; remove a passed run's."""
    basetemp = Path(session.config.option.basetemp or "")
    if exitstatus == 0 and basetemp.parent == TMP_ROOT:
        shutil.rmtree(basetemp, ignore_errors=True)


@pytest.fixture(scope="session")
def stack_state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stacks")


def _factory(state_root: Path) -> Iterator[StackFactory]:
    started: list[Topology] = []

    def start(**overrides: object) -> Topology:
        config = replace(TEST_STACK_CONFIG, state_root=state_root, **overrides)  # type: ignore[arg-type]
        topology = start_stack(config)
        started.append(topology)
        return topology

    try:
        yield start
    finally:
        for topology in started:
            stop_stack(topology)


@pytest.fixture(scope="module")
def module_stack_factory(stack_state_root: Path) -> Iterator[StackFactory]:
    """Start stacks shared by a module's tests; all are stopped when the module ends."""
    yield from _factory(stack_state_root)


@pytest.fixture
def stack_factory(stack_state_root: Path) -> Iterator[StackFactory]:
    """Start stacks for one test; all are stopped when it ends, pass or fail."""
    yield from _factory(stack_state_root)


@pytest.fixture(scope="session")
def netns_available() -> bool:
    return check_netns_support() is None


@pytest.fixture
def needs_netns(netns_available: bool) -> None:
    if not netns_available:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root and must test namespaces: {check_netns_support()}")
        pytest.skip(str(check_netns_support()))
