"""One simulated GPU's capacity: the running engine beside the cost model's figure.

    .venv/bin/python bench/gpu_capacity.py [--step-s 20] [--shares 0.4,0.6,0.8,1.0,1.2]
                                           [--batch 300]

Runs one engine (llmchaos.stack.engine, the GPU profile) in this process, no HTTP. Part 1:
Poisson arrivals of the load's default traffic (TrafficModel's own length laws) at shares of
the saturation rate that llmchaos.stack.fleet.engine_capacity_qps computes, --step-s seconds
each; prints the completed rate over the step's second half and the P50/P99 of the requests'
latency. Part 2: vLLM's benchmark_throughput shape (1000 prompt / 100 output tokens, every
request submitted at once), against the model's figure and the published vLLM one (20.72
requests/s, Llama 3 8B, 1x H100, vLLM 0.4.1). Simulated time is wall time, so a busy machine
lowers the measured rates. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from llmchaos.load.traffic import TrafficModel, TrafficSpec
from llmchaos.stack.engine import Engine, SequenceResult
from llmchaos.stack.fleet import TrafficShape, engine_capacity_qps
from llmchaos.stack.settings import GPU_PROFILE

VLLM_H100_1000_100_RPS = 20.72
"""vLLM PR #4600: benchmark_throughput --input-len 1000 --output-len 100, Llama 3 8B, H100."""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _step(rate: float, step_s: float, model: TrafficModel) -> tuple[float, float, float]:
    """(completed per second over the second half, P50 s, P99 s of requests sent then)."""
    rng = random.Random(1)
    context = model.spec.context_tokens
    async with Engine(GPU_PROFILE) as engine:
        started = time.monotonic()
        half = started + step_s / 2
        sent: list[tuple[float, asyncio.Future[SequenceResult]]] = []
        next_at = started
        while (now := time.monotonic()) < started + step_s:
            while next_at <= now:
                seq = engine.submit(context + model.prompt_tokens(), model.output_tokens())
                sent.append((time.monotonic(), asyncio.ensure_future(seq)))
                next_at += rng.expovariate(rate)
            await asyncio.sleep(min(0.005, max(0.0, next_at - time.monotonic())))
        end = time.monotonic()
        finished = [(at, f.result().e2e_s) for at, f in sent if f.done()]
        completed = sum(1 for at, e2e in finished if at + e2e >= half)
        # requests of the second half still unanswered count at their age so far
        latencies = [e2e for at, e2e in finished if at >= half]
        latencies += [end - at for at, f in sent if at >= half and not f.done()]
    return completed / (end - half), _quantile(latencies, 0.5), _quantile(latencies, 0.99)


async def _batch(n: int) -> float:
    """Requests per second for `n` requests of 1000/100 tokens submitted at once."""
    async with Engine(GPU_PROFILE) as engine:
        started = time.monotonic()
        await asyncio.gather(*(asyncio.ensure_future(engine.submit(1000, 100)) for _ in range(n)))
        return n / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=20.0)
    parser.add_argument("--shares", default="0.4,0.6,0.8,1.0,1.2")
    parser.add_argument("--batch", type=int, default=300)
    args = parser.parse_args()

    spec = TrafficSpec()
    shape = TrafficShape.of_laws(spec)
    saturation = engine_capacity_qps(GPU_PROFILE, shape)
    print(
        f"default traffic: mean {shape.prompt_tokens:.0f} prompt / {shape.output_tokens:.1f} "
        f"output tokens; cost model: saturation {saturation:.1f} QPS per simulated GPU"
    )
    print(f"{'share':>6} {'offered':>8} {'completed':>10} {'p50 s':>7} {'p99 s':>7}")
    for share in (float(s) for s in args.shares.split(",")):
        model = TrafficModel(spec, seed=7)
        rate = share * saturation
        completed, p50, p99 = asyncio.run(_step(rate, args.step_s, model))
        print(f"{share:>6.2f} {rate:>8.1f} {completed:>10.1f} {p50:>7.2f} {p99:>7.2f}")

    modelled = engine_capacity_qps(GPU_PROFILE, TrafficShape(1000, 100))
    measured = asyncio.run(_batch(args.batch))
    print(
        f"1000/100 tokens, {args.batch} at once: measured {measured:.1f} req/s, cost model "
        f"{modelled:.1f}, vLLM 0.4.1 on an H100 {VLLM_H100_1000_100_RPS} "
        f"(measured / vLLM = {measured / VLLM_H100_1000_100_RPS:.2f})"
    )


if __name__ == "__main__":
    main()
