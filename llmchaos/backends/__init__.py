"""The Kubernetes target's implementation (kubernetes.py), reached through
llmchaos.targets.kubernetes."""
