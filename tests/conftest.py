"""What the framework's own tests share besides the root conftest: they run at the reference
rate, never at this machine's calibrated one.

Experiments run by these tests (chaos runs in subprocesses included) send at most 50 QPS to
the embedded stack unless a test sets the cap itself: the tests check the framework's
mechanics, the resilience suite (suites/) the catalogue at the calibrated rate. A test that
builds settings from an explicit environment without a cap would calibrate this machine (a
minute of load): `calibrate` is replaced for every test by one that fails saying so, and the
machine's cached calibration is not read (tests/stack/test_calibration.py tests both).

They run side by side: `make test` runs them on 6 pytest-xdist workers, 4 on a slow machine
(scripts/test-workers.py; most of them wait on servers rather than use a core), then the `solo`
ones alone (the collection hook below says which)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

import llmchaos.targets.embedded as embedded
from llmchaos.targets.embedded.calibration import Calibration

os.environ.setdefault("LLMCHAOS_EMBEDDED_MAX_QPS", "50")

K8S = "tests/k8s (one control plane)"
HOSTS_LITELLM = "tests/hosts (the LiteLLM example's ports)"
HOSTS_NGINX = "tests/hosts (the nginx example's ports)"
SHARED_WORKERS = {
    "tests/k8s/test_target_k8s.py": K8S,
    "tests/k8s/test_cluster_load.py": K8S,
    "tests/k8s/test_deploy.py": K8S,
    "tests/hosts/test_topology.py": HOSTS_LITELLM,
}
"""Modules that run on one xdist worker with others of the same name. The k8s ones share its
control plane (etcd, kube-apiserver, controllers, kwok: a session fixture, started once per
worker that needs it); tests/k8s/test_backend_real.py, the other user, goes to a worker of
its own and starts a second: on one worker the k8s tests took 290 s of the parallel part's
360-470 s on a slow box, and a control plane starts in about 20 s. test_topology validates an
experiment against the LiteLLM example, whose pre-flight checks that its fixed ports are free.
Every other module runs on one worker, its module-scoped stacks started once."""
SPLIT_MODULES = {
    "tests/hosts/test_catalogue.py": {"litellm-": HOSTS_LITELLM, "nginx-": HOSTS_NGINX},
}
"""Modules whose tests go to workers by the prefix of their parameter id instead. The hosts
catalogue's LiteLLM and nginx cases start the example hosts files' servers on their fixed ports
(experiments/targets/*.yaml), which the two files do not share: LiteLLM's pair alone took 163 s
of CI's parallel part, on the worker that then ran the nginx pair too (77 s)."""


SCOPE_SECONDS = {
    K8S: 150,
    "tests/k8s/test_backend_real.py": 130,
    HOSTS_LITELLM: 90,
    "tests/chaos/test_gameday.py": 90,
    "tests/load/test_compare.py": 85,
    HOSTS_NGINX: 60,
    "tests/load/test_live.py": 60,
    "tests/chaos/test_run_layer.py": 55,
    "tests/stack/test_stack.py": 50,
    "tests/stack/test_calibration.py": 50,
    "tests/stack/test_registry.py": 50,
    "tests/chaos/test_interrupts.py": 45,
    "tests/hosts/test_faults.py": 45,
    "tests/load/test_distributed.py": 45,
}
"""Worker-seconds of the slowest scopes (`scripts/test-times.py`, a 4-worker run on a slow
box; 1,370 in all), for their order only: the longest start first, a scope not listed
counting 0.3 s a test. In xdist's order (most tests first) the LiteLLM pair and the
game day started last, and one worker ran on for a minute with the other three done: 404 s
for a part whose 4 workers had 342 s of work each."""


class GroupScheduling(LoadFileScheduling):
    """xdist's `loadfile` scheduling with the modules of SHARED_WORKERS and SPLIT_MODULES
    grouped by their names, the longest first (SCOPE_SECONDS). (xdist_group marks would
    group them, but `--dist loadgroup` does not group under pytest 9.2.)"""

    _ordered: bool = False

    def _assign_work_unit(self, node: WorkerController) -> None:
        # xdist 3.8's schedule() calls it first once the whole queue is built, before it
        # sends anything (a unit requeued after a worker died later goes to the end)
        if not self._ordered:
            self._ordered = True
            longest_first = sorted(
                self.workqueue.items(),
                key=lambda unit: -SCOPE_SECONDS.get(unit[0], 0.3 * len(unit[1])),
            )
            self.workqueue = OrderedDict(longest_first)
        super()._assign_work_unit(node)

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        for prefix, scope in SPLIT_MODULES.get(module, {}).items():
            if f"[{prefix}" in nodeid:
                return scope
        return SHARED_WORKERS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> GroupScheduling:
    """GroupScheduling whatever `--dist` says: spread test by test, the hosts tests collide
    on their ports."""
    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Before `-m` selects: a test that keeps every core busy on purpose (busy_cores) is
    `solo`. Beside other tests it would load their machine too, and it checks its own
    signal handling under exactly that load. (Tests marked `solo` by hand: those that run
    a machine-wide `llmchaos cleanup`, or kill an owner with -9 for one to find: a cleanup on
    another worker removes what a killed owner of a third test left before that test looks.)"""
    for item in items:
        if "busy_cores" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.solo)


def _no_calibration(path: Path, *_args: object, **_kwargs: object) -> Calibration:
    raise AssertionError(
        "this test would calibrate the machine: give embedded_max_qps (or "
        "LLMCHAOS_EMBEDDED_MAX_QPS in the environment it passes)"
    )


@pytest.fixture(autouse=True)
def _tests_do_not_calibrate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(embedded, "calibrate", _no_calibration)
    monkeypatch.setattr(embedded, "cached_calibration", lambda _path: None)
    yield
