"""Stock closed-loop Locust FastHttpUsers for bench/load_open_loop.py, sending the same request
body as the open-loop user (one typical chat request): StockChatUser without waits (its best
case, saturated), PacedChatUser at 10 requests/s each (500 of them = the open loop's 5000/s)."""

from locust import FastHttpUser, constant, constant_throughput, task

from llmchaos.load.traffic import TrafficModel, TrafficSpec

_REQUEST = TrafficModel(TrafficSpec(stream_share=0.0), seed=0).next_request()


class StockChatUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def chat(self) -> None:
        self.client.post("/v1/chat/completions", data=_REQUEST.body, headers=_REQUEST.headers)


class PacedChatUser(FastHttpUser):
    wait_time = constant_throughput(10)

    @task
    def chat(self) -> None:
        self.client.post("/v1/chat/completions", data=_REQUEST.body, headers=_REQUEST.headers)
