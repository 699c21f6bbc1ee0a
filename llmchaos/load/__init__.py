"""Open-loop load for LLM serving, on Locust.

The public surface imports neither Locust nor gevent: Locust runs in a child process (see
api.py), so importing this package from an asyncio program monkey-patches nothing.
"""

from llmchaos.load.api import LoadError, LoadRun
from llmchaos.load.config import LoadConfig
from llmchaos.load.summary import Summary
from llmchaos.load.traffic import TrafficSpec

__all__ = ["LoadConfig", "LoadError", "LoadRun", "Summary", "TrafficSpec"]
