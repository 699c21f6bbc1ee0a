"""A Kubernetes cluster as a target kind, through the official client.

Settings are `k8s_<field>` configuration keys or `LLMCHAOS_K8S_<FIELD>` variables (the fields
of KubernetesSettings); `k8s_allowed_namespaces` is required. The run connects to the cluster
and leaves it as it found it, but for the faults it undoes.
"""

from __future__ import annotations

from typing import Any

from llmchaos.backends.kubernetes import KubernetesBackend, KubernetesSettings
from llmchaos.errors import InvalidInput
from llmchaos.processes import Owner
from llmchaos.targets import Target, TargetInfo, TargetKind, TargetSettings

__all__ = ["KIND", "KubernetesKind", "KubernetesSettings"]


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
        return KubernetesBackend(settings)

    def reattach(self, settings: TargetSettings, record: dict[str, Any]) -> Target:
        return self.open(settings, Owner.this_process("run"))


KIND = KubernetesKind()
