"""The engine simulator on its own: cost model, batching, KV budget, preemption, queueing.

Simulated time is wall time, so these tests measure real latencies; the tolerances leave room
for a loaded machine but not for a wrong cost model.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from llmchaos.errors import InvalidInput
from llmchaos.stack.engine import Engine, EngineStopped, SequenceResult, check_profile
from llmchaos.stack.settings import CPU_PROFILE, GPU_PROFILE, EngineProfile

pytestmark = pytest.mark.asyncio

QUICK = dataclasses.replace(
    GPU_PROFILE,
    api_overhead_ms=0.0,
    prefill_base_ms=1.0,
    prefill_ms_per_token=0.0,
    decode_base_ms=1.0,
    decode_ms_per_seq=0.0,
)
"""Steps of about a millisecond, for tests about scheduling rather than timing."""


def per_token_s(result: SequenceResult) -> float:
    assert result.ttft_s is not None
    return (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)


@pytest.mark.parametrize("prompt_tokens", [16, 2000], ids=["short", "long"])
async def test_gpu_profile_ttft_and_per_token_latency_at_low_load(prompt_tokens: int) -> None:
    async with Engine(GPU_PROFILE) as engine:
        result = await engine.submit(prompt_tokens, 20)

    assert result.finish_reason == "length"
    assert result.completion_tokens == 20
    assert result.ttft_s is not None
    # a lone request's wait past the API overhead is the machine's, not the cost model's: on
    # 4 busy xdist workers one waited 21 ms for the engine's loop (TTFT 127 ms)
    assert result.queue_s is not None
    waited_s = max(0.0, result.queue_s - GPU_PROFILE.api_overhead_ms / 1000)
    assert 0.060 <= result.ttft_s - waited_s <= 0.120
    assert 0.010 <= per_token_s(result) <= 0.015
    assert result.preemptions == 0


async def test_cpu_profile_is_about_ten_times_slower() -> None:
    async with Engine(GPU_PROFILE) as gpu, Engine(CPU_PROFILE) as cpu:
        gpu_result, cpu_result = await asyncio.gather(gpu.submit(16, 4), cpu.submit(16, 4))

    assert gpu_result.ttft_s is not None and cpu_result.ttft_s is not None
    assert 7 <= cpu_result.ttft_s / gpu_result.ttft_s <= 14
    assert 7 <= per_token_s(cpu_result) / per_token_s(gpu_result) <= 14


async def test_ttft_grows_with_prompt_length_as_the_profile_says() -> None:
    profile = dataclasses.replace(QUICK, prefill_base_ms=5.0, prefill_ms_per_token=0.05)
    ttfts_s: dict[int, float] = {}
    async with Engine(profile) as engine:
        for prompt_tokens in (10, 1000, 4000):
            result = await engine.submit(prompt_tokens, 2)
            assert result.ttft_s is not None
            ttfts_s[prompt_tokens] = result.ttft_s

    for prompt_tokens, ttft_s in ttfts_s.items():
        expected_s = (5.0 + 0.05 * prompt_tokens) / 1000
        # Absolute slack: a busy machine delays a timer by some milliseconds now and then
        # (beside the other tests on 4 workers of a box whose hypervisor took up to a core,
        # 14 ms: 19.8 ms for 5.5).
        assert expected_s * 0.98 <= ttft_s <= expected_s * 1.1 + 0.020, (prompt_tokens, ttft_s)
    assert ttfts_s[10] < ttfts_s[1000] < ttfts_s[4000]


async def test_decode_step_grows_with_batch_size() -> None:
    profile = dataclasses.replace(QUICK, decode_base_ms=4.0, decode_ms_per_seq=0.5)
    async with Engine(profile) as engine:
        alone = await engine.submit(8, 20)
        batch = await asyncio.gather(*(engine.submit(8, 20) for _ in range(32)))

    # A late first-token timer shortens (e2e - ttft) as the later steps keep their times:
    # allow 20 ms over the 19 decode steps (beside 6 xdist workers on 2 cores one came 14 ms
    # late; the per-token time of a batch of 32 below is 4.4x this one's).
    assert 0.0045 - 0.020 / 19 <= per_token_s(alone) <= 0.0045 * 1.3 + 0.001
    # All 32 are admitted in one prefill step, then decode together: 4 + 0.5 * 32 ms a step.
    for result in batch:
        assert 0.020 * 0.95 <= per_token_s(result) <= 0.020 * 1.2
    assert all(result.preemptions == 0 for result in batch)


async def test_kv_exhaustion_preempts_the_newest_sequence_and_counts_it() -> None:
    # Four sequences of 200 + 200 tokens need 1600 KV tokens; the budget holds 1000.
    profile = dataclasses.replace(QUICK, kv_cache_tokens=1000, max_model_len=1000)
    usages: list[float] = []
    async with Engine(profile) as engine:
        seqs = [engine.submit(200, 200) for _ in range(4)]

        async def sample() -> None:
            while not all(seq.done for seq in seqs):
                usages.append(engine.stats().kv_cache_usage)
                await asyncio.sleep(0.001)

        sampler = asyncio.create_task(sample())
        results = await asyncio.gather(*seqs)
        await sampler
        stats = engine.stats()

    assert [r.completion_tokens for r in results] == [200, 200, 200, 200]
    assert all(r.finish_reason == "length" for r in results)
    assert results[0].preemptions == 0  # the oldest is never the victim
    assert results[3].preemptions >= 1
    assert stats.preemptions_total == sum(r.preemptions for r in results) >= 1
    assert max(usages) <= 1.0
    assert max(usages) >= 0.95
    assert stats.kv_cache_usage == 0.0
    assert stats.running == 0
    assert stats.generation_tokens_total >= 800
    assert stats.prompt_tokens_total == 800


async def test_a_preempted_sequence_resumes_before_the_ones_that_were_waiting() -> None:
    profile = dataclasses.replace(QUICK, kv_cache_tokens=1000, max_model_len=1000)
    loop = asyncio.get_running_loop()
    async with Engine(profile) as engine:
        started_at = loop.time()
        first = engine.submit(300, 300)
        preempted = engine.submit(300, 300)
        await asyncio.sleep(0.005)
        waiting_since = loop.time()
        waiting = engine.submit(500, 10)  # 602 + 501 tokens do not fit: it waits
        first_result, preempted_result, waiting_result = await asyncio.gather(
            first, preempted, waiting
        )

    assert (first_result.preemptions, preempted_result.preemptions) == (0, 1)
    assert waiting_result.preemptions == 0
    # Back at the head of the queue, the preempted sequence runs to its end before the
    # waiting one gets its first token (the two never fit together).
    assert waiting_result.ttft_s is not None
    assert waiting_since + waiting_result.ttft_s > started_at + preempted_result.e2e_s


async def test_queue_depth_shows_in_waiting() -> None:
    profile = dataclasses.replace(QUICK, max_num_seqs=2, decode_base_ms=5.0)
    async with Engine(profile) as engine:
        seqs = [engine.submit(10, 50) for _ in range(10)]
        await asyncio.sleep(0.03)
        stats = engine.stats()
        for seq in seqs:
            seq.abort()
        after = engine.stats()

    assert stats.running == 2
    assert stats.waiting == 8
    assert 0 < stats.kv_cache_usage < 1
    assert (after.running, after.waiting, after.kv_cache_used_tokens) == (0, 0, 0)
    assert after.aborted_total == 10


async def test_requests_inside_the_api_overhead_count_as_waiting() -> None:
    async with Engine(dataclasses.replace(QUICK, api_overhead_ms=50.0)) as engine:
        seqs = [engine.submit(10, 2) for _ in range(3)]
        assert engine.stats().waiting == 3
        results = await asyncio.gather(*seqs)

    assert all(r.queue_s is not None and r.queue_s >= 0.050 for r in results)


async def test_waiting_sequences_are_served_first_come_first_served() -> None:
    async with Engine(dataclasses.replace(QUICK, max_num_seqs=1)) as engine:
        seqs = [engine.submit(10, 3) for _ in range(5)]
        results = await asyncio.gather(*seqs)

    ttfts_s = [r.ttft_s for r in results]
    assert ttfts_s == sorted(ttfts_s)  # type: ignore[type-var]


async def test_stream_yields_each_steps_tokens() -> None:
    async with Engine(QUICK) as engine:
        seq = engine.submit(10, 12, stream=True)
        counts = [n async for n in seq.tokens()]
        result = await seq

    assert sum(counts) == 12
    assert len(counts) >= 6  # a fast consumer sees (nearly) every step, not one lump
    assert result.completion_tokens == 12


async def test_tokens_of_a_non_streaming_sequence_is_refused() -> None:
    async with Engine(QUICK) as engine:
        seq = engine.submit(10, 2)
        with pytest.raises(ValueError, match="stream=False"):
            _ = [n async for n in seq.tokens()]
        await seq


async def test_abort_mid_stream_frees_kv_and_ends_the_stream() -> None:
    async with Engine(dataclasses.replace(QUICK, decode_base_ms=2.0)) as engine:
        seq = engine.submit(100, 500, stream=True)
        received = 0
        async for n in seq.tokens():
            received += n
            if received >= 3:
                seq.abort()
        result = await seq
        stats = engine.stats()

    assert result.finish_reason == "abort"
    assert 3 <= result.completion_tokens < 500
    assert (stats.running, stats.kv_cache_used_tokens, stats.aborted_total) == (0, 0, 1)


async def test_submit_rejects_what_cannot_fit_and_close_aborts_the_rest() -> None:
    engine = Engine(dataclasses.replace(QUICK, max_model_len=100, kv_cache_tokens=100))
    with pytest.raises(EngineStopped):
        engine.submit(10, 10)  # not started
    engine.start()
    with pytest.raises(ValueError, match="max_model_len 100"):
        engine.submit(60, 41)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        engine.submit(10, 0)
    in_flight = engine.submit(10, 90)
    await asyncio.sleep(0.01)
    await engine.close()

    assert (await in_flight).finish_reason == "abort"
    with pytest.raises(EngineStopped):
        engine.submit(10, 10)


async def test_profile_whose_context_does_not_fit_the_kv_cache_is_refused() -> None:
    profile = EngineProfile(kv_cache_tokens=4096, max_model_len=8192)
    with pytest.raises(InvalidInput, match="max_model_len 8192 is over kv_cache_tokens 4096"):
        Engine(profile)
    with pytest.raises(InvalidInput, match="max_num_seqs must be >= 1, got 0"):
        check_profile(EngineProfile(max_num_seqs=0))
    check_profile(GPU_PROFILE)
    check_profile(CPU_PROFILE)
