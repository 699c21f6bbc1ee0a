"""Goodput: the requests per second that met every SLO of the run (DistServe, OSDI'24; vLLM
`bench serve --goodput ttft:MS tpot:MS e2el:MS`, whose key names this module takes).

A request is good when it succeeded and each SLO that is set holds for it: TTFT, TPOT and
end-to-end latency, all from the scheduled send time. A plain (non-streamed) answer brings its
first token with the whole answer, so its TTFT is its end-to-end latency (GuideLLM times it the
same way); it has no TPOT of its own, so the TPOT SLO does not apply to it.

Plain Python: the Locust users, the config checks and the tests use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmchaos.errors import InvalidInput

__all__ = ["GOODPUT_KEYS", "GoodputSlo", "parse_goodput"]

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
"""vLLM's names: time to first token, time per output token, end-to-end latency (ms)."""


@dataclass(frozen=True)
class GoodputSlo:
    """Per-request limits in ms; None: that SLO is not part of the definition."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def defined(self) -> bool:
        """False when no SLO is set: goodput is then not measured (None, not a guess)."""
        return not (self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None)

    def met(self, e2e_ms: float, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        """Did a successful request with these timings meet every SLO that is set?"""
        if self.e2e_ms is not None and e2e_ms > self.e2e_ms:
            return False
        if self.ttft_ms is not None and (e2e_ms if ttft_ms is None else ttft_ms) > self.ttft_ms:
            return False
        return self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms


def parse_goodput(items: list[str]) -> GoodputSlo:
    """`["ttft:2000", "tpot:100"]` (vLLM's --goodput syntax) as a GoodputSlo.

    Raises InvalidInput naming --goodput, the item and what is expected.
    """
    values: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise InvalidInput(
                f"--goodput: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, "
                f"got {item!r}"
            )
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise InvalidInput(f"--goodput: {key} expects milliseconds > 0, got {raw!r}")
        values[key] = value
    return GoodputSlo(values.get("ttft"), values.get("tpot"), values.get("e2el"))
