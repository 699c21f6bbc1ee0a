"""A Kubernetes cluster as a target kind, through the official client.

Settings are `k8s_<field>` configuration keys or `LLMCHAOS_K8S_<FIELD>` variables (the fields
of KubernetesSettings); `k8s_allowed_namespaces` is required. The run connects to the cluster
and leaves it as it found it, but for the faults it undoes.

    settings.py     KubernetesSettings and their checks (the allowlist, selectors)
    selectors.py    label selectors, parsed and applied here too
    cluster.py      the API plumbing (client, errors, pods by role, exec)
    target.py       KubernetesTarget: faults, readings, names (with the mixins below)
    nodes.py        cordon, uncordon, drain        load_workers.py   Locust workers in the cluster
    recovery.py     Krkn-style pod recovery times
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmchaos.errors import InvalidInput
from llmchaos.processes import Owner
from llmchaos.targets import Target, TargetInfo, TargetKind, TargetSettings
from llmchaos.targets.kubernetes.selectors import parse_selector, selector_matches
from llmchaos.targets.kubernetes.settings import (
    PROTECTED_NAMESPACES,
    KubernetesSettings,
    check_settings,
)

if TYPE_CHECKING:
    from llmchaos.targets.kubernetes.load_workers import (
        LOAD_WORKER_QPS,
        load_workers_for,
        worker_deployment,
    )
    from llmchaos.targets.kubernetes.target import KubernetesTarget

_CLIENT_SIDE = {
    "KubernetesTarget": "llmchaos.targets.kubernetes.target",
    "LOAD_WORKER_QPS": "llmchaos.targets.kubernetes.load_workers",
    "load_workers_for": "llmchaos.targets.kubernetes.load_workers",
    "worker_deployment": "llmchaos.targets.kubernetes.load_workers",
}
"""Names imported on first use: every run reads every kind's settings keys, and the official
client's import (0.2 s of CPU) is then paid by the runs that reach a cluster only."""


def __getattr__(name: str) -> Any:
    module = _CLIENT_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "KIND",
    "LOAD_WORKER_QPS",
    "PROTECTED_NAMESPACES",
    "KubernetesKind",
    "KubernetesSettings",
    "KubernetesTarget",
    "check_settings",
    "load_workers_for",
    "parse_selector",
    "selector_matches",
    "worker_deployment",
]


class KubernetesKind(TargetKind):
    """See the module docstring."""

    name = "k8s"
    settings_type = KubernetesSettings
    prefix = "k8s_"

    def settings(self, configuration: Any, environ: Any) -> TargetSettings:
        try:
            return super().settings(configuration, environ)
        except InvalidInput as exc:
            if str(exc).startswith("allowed_namespaces: required"):
                raise InvalidInput(
                    "k8s_allowed_namespaces (LLMCHAOS_K8S_ALLOWED_NAMESPACES): required with "
                    "target k8s, the namespaces the run may touch, e.g. llm-serving"
                ) from None
            raise

    def plan(self, settings: TargetSettings) -> TargetInfo:
        """What the cluster runs now (read-only API calls)."""
        target = self.open(settings, Owner.this_process("run"))
        try:
            return target.info()
        finally:
            target.close()

    def open(self, settings: TargetSettings, owner: Owner) -> Target:
        assert isinstance(settings, KubernetesSettings), settings
        from llmchaos.targets.kubernetes.target import KubernetesTarget

        return KubernetesTarget(settings)

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        return self.open(settings, Owner.this_process("run"))


KIND = KubernetesKind()
