"""The parallel part's grouping and order (tests/conftest.py) name real modules."""

from __future__ import annotations

from conftest import REPO
from tests.conftest import SCOPE_SECONDS, SHARED_WORKERS, SPLIT_MODULES


def test_every_grouped_or_timed_scope_is_a_module_or_a_group() -> None:
    groups = set(SHARED_WORKERS.values()) | {
        scope for prefixes in SPLIT_MODULES.values() for scope in prefixes.values()
    }
    grouped = set(SHARED_WORKERS) | set(SPLIT_MODULES)
    modules = grouped | (set(SCOPE_SECONDS) - groups)
    missing = sorted(m for m in modules if not (REPO / m).is_file())
    assert not missing, f"renamed or removed: {missing}"
    # a module that runs in a group is timed as its group, never by its own name
    assert not set(SCOPE_SECONDS) & grouped, set(SCOPE_SECONDS) & grouped
