"""Stock closed-loop Locust: what a typical test would run (the comparison for outage honesty
and for the CPU benchmark)."""

from locust import FastHttpUser, constant_throughput, task

BODY = {"model": "llmchaos-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class ClosedLoopUser(FastHttpUser):
    wait_time = constant_throughput(10)

    @task
    def chat(self) -> None:
        self.client.post("/v1/chat/completions", json=BODY)
