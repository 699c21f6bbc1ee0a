"""What each engine kind calls its readings: an adapter table over the servers' own metrics.

    kind      queue (gauge)               running (gauge)              KV cache 0..1 (gauge)
    vllm      vllm:num_requests_waiting   vllm:num_requests_running    vllm:kv_cache_usage_perc
    sglang    sglang:num_queue_reqs       sglang:num_running_reqs      sglang:token_usage
    tgi       tgi_queue_size              tgi_batch_current_size       - (none exported)
    llamacpp  llamacpp:requests_deferred  llamacpp:requests_processing llamacpp:kv_cache_usage_ratio
    openai    -                           -                            -

Finished requests (each server's share of the load): vllm:request_success_total.
TTFT histograms: vllm:time_to_first_token_seconds, sglang:time_to_first_token_seconds; TGI and
llama.cpp export none (measure it on the client). SGLang exports metrics only with
--enable-metrics, llama.cpp only with --metrics; a generic OpenAI server exports none.

Sources: vLLM vllm/v1/metrics/loggers.py and docs.vllm.ai "Production Metrics"; SGLang
python/sglang/srt/metrics/collector.py and docs/references/production_metrics.md; TGI
docs/source/reference/metrics.md; llama.cpp tools/server/README.md ("GET /metrics"). Gauges are
summed over their series (vLLM has one per engine core; SGLang one per TP/PP rank); a KV-cache
share is the largest of its series. The simulated engine workers speak vLLM's names.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ENGINES", "EngineKind", "EngineReading", "read_engine"]


@dataclass(frozen=True)
class EngineKind:
    """The names one kind of inference server gives its readings (None: it has none)."""

    queue: str | None
    running: str | None
    kv_cache: str | None
    ttft: str | None
    health: str
    """Readiness path: 200 when it serves (vLLM, SGLang, TGI and llama.cpp: /health, which
    llama.cpp answers 503 while the model loads; a generic server: /v1/models)."""
    finished: str | None = None
    """Counter of the requests it finished (the share each server took of the load); only
    vLLM's is read so far (vllm:request_success, one series per finished_reason)."""


ENGINES: dict[str, EngineKind] = {
    "vllm": EngineKind(
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "/health",
        finished="vllm:request_success_total",
    ),
    "sglang": EngineKind(
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:time_to_first_token_seconds",
        "/health",
    ),
    "tgi": EngineKind("tgi_queue_size", "tgi_batch_current_size", None, None, "/health"),
    "llamacpp": EngineKind(
        "llamacpp:requests_deferred",
        "llamacpp:requests_processing",
        "llamacpp:kv_cache_usage_ratio",
        None,
        "/health",
    ),
    "openai": EngineKind(None, None, None, None, "/v1/models"),
}
"""Engine kind (the hosts file's `engine`) -> its names."""


@dataclass(frozen=True)
class EngineReading:
    """One scrape of a server's /metrics, in the engine's own terms (None: not exported, or
    the server did not answer)."""

    queue: float | None = None
    running: float | None = None
    kv_cache: float | None = None
    ttft_count: float | None = None
    """Requests counted by the TTFT histogram so far."""
    ttft_sum_s: float | None = None
    finished: float | None = None
    """Requests finished so far."""


def parse_reading(kind: EngineKind, text: str) -> EngineReading:
    """The readings of `kind` in Prometheus exposition `text`."""
    sums: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            peaks[sample.name] = max(peaks.get(sample.name, 0.0), sample.value)

    def total(name: str | None, suffix: str = "") -> float | None:
        return sums.get(name + suffix) if name else None

    return EngineReading(
        queue=total(kind.queue),
        running=total(kind.running),
        kv_cache=peaks.get(kind.kv_cache) if kind.kv_cache else None,
        ttft_count=total(kind.ttft, "_count"),
        ttft_sum_s=total(kind.ttft, "_sum"),
        finished=total(kind.finished),
    )


def read_engine(engine: str, base_url: str, timeout_s: float) -> EngineReading:
    """Scrape `<base_url>/metrics` of a server of kind `engine`; an empty reading when it
    exports nothing (a generic OpenAI server) or does not answer within `timeout_s` (dead,
    loading, partitioned: it holds no queue anyone is served from)."""
    kind = ENGINES[engine]
    if kind.queue is None:
        return EngineReading()
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as response:
            text = response.read().decode(errors="replace")
    except (OSError, urllib.error.URLError, ValueError):
        return EngineReading()
    return parse_reading(kind, text)
