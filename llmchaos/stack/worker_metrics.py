"""An engine worker's /metrics: vLLM's names in Prometheus' text format 0.0.4, written here.

Why not prometheus_client: every gateway reads every worker's /metrics twice a second (the
degradation trigger), about 200 scrapes a second in the 1,000-QPS fleet, and
`generate_latest` alone took 259 us in-process on 2026-12-06 (its collectors build a Metric
object per family and a Sample per line); this takes 18. A whole HTTP scrape cost the worker
313 CPU-us before and 50 after (`bench/worker_throughput.py --against e5e1528`, which
measures both); `tests/stack/test_worker_metrics.py` holds the two texts to the same
bytes. Values are formatted by prometheus_client's own `floatToGoString`, so a counter past
a million reads `1.2e+06` as there.

    metrics = WorkerMetrics(engine, "llmchaos-7b")
    metrics.observe(result)             # a finished sequence: TTFT and e2e histograms
    metrics.count_error(api_error)      # llmchaos:worker_request_errors_total{code}
    metrics.exposition()                # the whole text, as bytes
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.utils import floatToGoString

from llmchaos.stack.engine import Engine, EngineStats, SequenceResult
from llmchaos.stack.openai_api import ApiError

__all__ = ["CONTENT_TYPE", "E2E_BUCKETS_S", "TTFT_BUCKETS_S", "WorkerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets of vllm:time_to_first_token_seconds."""

E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets of vllm:e2e_request_latency_seconds."""

_ENGINE_FAMILIES: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("vllm:num_requests_running", "gauge", "Requests in the running batch.", lambda s: s.running),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        lambda s: s.waiting,
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage, 1 means full.",
        lambda s: s.kv_cache_usage,
    ),
    ("vllm:num_preemptions_total", "counter", "Preemptions.", lambda s: s.preemptions_total),
    (
        "vllm:prompt_tokens_total",
        "counter",
        "Prefilled prompt tokens.",
        lambda s: s.prompt_tokens_total,
    ),
    (
        "vllm:generation_tokens_total",
        "counter",
        "Generated tokens.",
        lambda s: s.generation_tokens_total,
    ),
)
"""The engine's live figures, read at scrape time: (name, type, help, figure)."""


def _label_value(value: str) -> str:
    """Escaped as the text format wants a label value."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _head(name: str, kind: str, doc: str) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class _Histogram:
    """One labelled histogram: counts per bucket (not cumulative until written), sum."""

    __slots__ = ("_bounds", "_counts", "_lines", "_sum", "_tail")

    def __init__(self, name: str, doc: str, bounds_s: tuple[float, ...], labels: str) -> None:
        self._bounds = bounds_s
        self._counts = [0] * (len(bounds_s) + 1)  # the last one is +Inf's
        self._sum = 0.0
        head = _head(name, "histogram", doc)
        les = [*(floatToGoString(b) for b in bounds_s), "+Inf"]
        self._lines = [
            f'{head if i == 0 else ""}{name}_bucket{{le="{le}",{labels}}} '
            for i, le in enumerate(les)
        ]
        self._tail = (f"{name}_count{{{labels}}} ", f"{name}_sum{{{labels}}} ")

    def observe(self, value_s: float) -> None:
        self._counts[bisect_left(self._bounds, value_s)] += 1  # le: the bound holds its own
        self._sum += value_s

    def write(self, out: list[str]) -> None:
        total = 0
        for line, count in zip(self._lines, self._counts, strict=True):
            total += count
            out.append(f"{line}{floatToGoString(total)}\n")
        out.append(f"{self._tail[0]}{floatToGoString(total)}\n")
        out.append(f"{self._tail[1]}{floatToGoString(self._sum)}\n")


class WorkerMetrics:
    """See the module docstring. Families come in prometheus_client's order for this worker
    (the engine's, then the histograms, then the error counter), labels sorted by name."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model_label = f'model_name="{_label_value(model)}"'
        model_labels = "{" + self._model_label + "}"
        self._engine_lines = [
            (f"{_head(name, kind, doc)}{name}{model_labels} ", figure)
            for name, kind, doc, figure in _ENGINE_FAMILIES
        ]
        success = "vllm:request_success_total"
        self._success_lines = (
            _head(success, "counter", "Finished requests by finish reason.")
            + f'{success}{{finished_reason="length",{self._model_label}}} ',
            f'{success}{{finished_reason="abort",{self._model_label}}} ',
        )
        self.ttft_s = _Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            TTFT_BUCKETS_S,
            self._model_label,
        )
        self.e2e_s = _Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            E2E_BUCKETS_S,
            self._model_label,
        )
        errors = "llmchaos:worker_request_errors_total"
        self._errors_head = _head(
            errors, "counter", "Requests answered with an error, by OpenAI error code (or type)."
        )
        self._errors_line = (f'{errors}{{code="', f'",{self._model_label}}} ')
        self._errors: dict[str, int] = {}
        """OpenAI error code (or type) -> requests answered with it."""

    def observe(self, result: SequenceResult) -> None:
        """A finished sequence's TTFT and e2e; aborted ones are not observed (as vLLM)."""
        if result.finish_reason != "length" or result.ttft_s is None:
            return
        self.ttft_s.observe(result.ttft_s)
        self.e2e_s.observe(result.e2e_s)

    def count_error(self, exc: ApiError) -> None:
        code = exc.code or exc.type
        self._errors[code] = self._errors.get(code, 0) + 1

    def exposition(self) -> bytes:
        stats = self._engine.stats()
        out = [f"{line}{floatToGoString(figure(stats))}\n" for line, figure in self._engine_lines]
        length, abort = self._success_lines
        out.append(f"{length}{floatToGoString(stats.finished_total)}\n")
        out.append(f"{abort}{floatToGoString(stats.aborted_total)}\n")
        self.ttft_s.write(out)
        self.e2e_s.write(out)
        out.append(self._errors_head)
        for code, count in self._errors.items():
            before, after = self._errors_line
            out.append(f"{before}{_label_value(code)}{after}{floatToGoString(count)}\n")
        return "".join(out).encode()
