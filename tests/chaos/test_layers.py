"""One direction of dependency: probes/ and actions/ -> the run layer of llmchaos -> the
targets' door (llmchaos.targets) -> each target kind (embedded -> llmchaos.stack, kubernetes,
hosts) / llmchaos.load. The run layer reaches a target only through its
door. Checked on the source, like an import-linter contract."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

RUN_LAYER = (
    "llmchaos.control",
    "llmchaos.run",
    "llmchaos.run_cli",
    "llmchaos.measure",
    "llmchaos.faults",
    "llmchaos.report",
    "llmchaos.validation",
    "llmchaos.runner",
    "llmchaos.gameday",
    "llmchaos.settings",
    "llmchaos.analysis",
)
"""The run layer of llmchaos: what the targets, the stack and the load must not know."""
TARGET_INSIDES = (
    "llmchaos.targets.embedded",
    "llmchaos.targets.kubernetes",
    "llmchaos.targets.hosts",
    "llmchaos.stack",
)
"""What only a target kind may import: the run layer goes through llmchaos.targets."""

CONTRACTS = [
    ("llmchaos", ("probes", "actions")),
    *((module.replace(".", "/"), TARGET_INSIDES) for module in RUN_LAYER),
    ("llmchaos/targets", RUN_LAYER),
    ("llmchaos/stack", (*RUN_LAYER, "llmchaos.targets", "llmchaos.load")),
    ("llmchaos/load", (*RUN_LAYER, "llmchaos.targets", "llmchaos.stack")),
]
ALLOWED = {"llmchaos.stack.tokens"}
"""Shared on purpose: the load counts tokens exactly as the engine does."""


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(("package", "forbidden"), CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_imports_point_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    broken = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in _sources(REPO / package)
        for name in sorted(_imports(path))
        if name not in ALLOWED and any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not broken, "\n".join(broken)


def _sources(where: Path) -> list[Path]:
    """The Python files of a package folder, or the module file itself."""
    if where.with_suffix(".py").is_file():
        return [where.with_suffix(".py")]
    return sorted(where.rglob("*.py"))


def test_every_contract_names_existing_code() -> None:
    missing = [package for package, _ in CONTRACTS if not _sources(REPO / package)]
    assert not missing, missing


def test_the_contract_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from probes.slo import error_rate\nimport llmchaos.run\n")
    assert _imports(bad) == {"probes.slo", "llmchaos.run"}
