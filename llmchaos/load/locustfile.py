"""Locust entry point of the open-loop load; the same file on a laptop and on Kubernetes.

    locust -f llmchaos/load/locustfile.py --headless -u 1 -r 1 --llmchaos-config '{"url": ...}'
    locust -f ... --master --expect-workers N -u N -r N --llmchaos-config '...'   # master
    locust -f ... --worker --master-host HOST                                    # each worker

`-u` must equal the number of worker processes: each process runs one schedule.
`llmchaos load` and `LoadRun.start` build this command line for you.
"""

from llmchaos.load import process  # noqa: F401  registers the master and worker hooks
from llmchaos.load.user import OpenLoopLLMUser

__all__ = ["OpenLoopLLMUser"]
