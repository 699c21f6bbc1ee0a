"""The main job until the Chaos Toolkit experiments land: bring the embedded stack up, send a
plain and a streaming chat completion through HAProxy with the real `openai` client, kill
gpu-0's GPU process and show the service keeps answering, then bring the stack down.

    .venv/bin/python scripts/demo.py          (what `make demo` runs)
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
import urllib.request

from openai import OpenAI

from llmchaos.stack.config import StackConfig
from llmchaos.stack.stack import start_stack, stop_stack
from llmchaos.stack.tokendb import read_tokens_file


def main() -> int:
    topology = start_stack(StackConfig(port=0), progress=True)
    try:
        token = next(t.token for t in read_tokens_file(topology.tokens_file) if not t.revoked)
        client = OpenAI(base_url=f"{topology.gateway_url}/v1", api_key=token, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=topology.model,
            messages=[{"role": "user", "content": "What does a chaos experiment prove?"}],
            max_tokens=16,
        )
        reply = raw.parse()
        print(
            f"plain:  {raw.headers.get('x-serving-mode')} via {raw.headers.get('x-gateway')}: "
            f"{reply.usage.prompt_tokens}+{reply.usage.completion_tokens} tokens"
        )
        stream = client.chat.completions.create(
            model=topology.model,
            messages=[{"role": "user", "content": "Stream it."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        usage = next(c.usage for c in reversed(chunks) if c.usage)
        print(f"stream: {len(chunks)} chunks, usage {usage.completion_tokens} completion tokens")

        gpu0 = topology.worker("gpu-0")
        with urllib.request.urlopen(f"{gpu0.url}/gpu/processes", timeout=2) as response:
            pid = json.load(response)[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        print(f"killed gpu-0's GPU process (pid {pid}); sending 20 requests")
        modes = []
        for _ in range(20):
            raw = client.chat.completions.with_raw_response.create(
                model=topology.model, messages=[{"role": "user", "content": "still there?"}]
            )
            modes.append(f"{raw.headers.get('x-worker')}/{raw.headers.get('x-serving-mode')}")
            time.sleep(0.05)
        runs = [(key, len(list(group))) for key, group in itertools.groupby(modes)]
        print("served by, in order: " + ", ".join(f"{key} x{n}" for key, n in runs))
        print("(gpu-0 comes back once its node agent restarted it and the model loaded)")
    finally:
        stop_stack(topology)
        print(f"stack {topology.stack_id} down; state in {topology.state_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
