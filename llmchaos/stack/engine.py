"""A continuous-batching engine simulator: vLLM's scheduler shape without a GPU or a model.

One asyncio task runs the step loop. Every step it

1. makes room for one more token per running sequence; when the KV budget cannot hold them, it
   preempts the most recently admitted sequence (recompute, as vLLM V1 does: the sequence drops
   its KV and goes back to the front of the waiting queue, to be prefilled again with its prompt
   and the tokens it already produced);
2. unless it preempted, admits waiting sequences first come first served while the batch has a
   free slot (`max_num_seqs`), their KV fits and the step's prefill budget
   (`max_num_batched_tokens`) lasts;
3. sleeps the step's cost and gives every sequence of the step one token. A step that prefills
   costs `prefill_base_ms + prefill_ms_per_token * prefill tokens`; a pure decode step costs
   `decode_base_ms`; both add `decode_ms_per_seq` per sequence that decodes. Running sequences
   decode in the prefill steps too (vLLM V1 mixes them), else a steady arrival stream would
   starve decode.

Simulated time is wall time. Sequences finish at `max_tokens`. Per step the loop touches each
running sequence once and wakes only the stream consumers that wait, so its own CPU cost stays
small beside the HTTP server's.

    Engine.submit(prompt_tokens, max_tokens, stream) -> Sequence
    await sequence                  -> SequenceResult (also when aborted: finish_reason "abort")
    async for n in sequence.tokens(): new tokens of each step (stream=True only)
    sequence.abort()                   frees its KV at once (client gone)
    Engine.stats()                  -> EngineStats
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from typing import Any, Literal

from llmchaos.errors import InvalidInput, StackError
from llmchaos.stack.settings import EngineProfile

__all__ = [
    "Engine",
    "EngineStats",
    "EngineStopped",
    "Sequence",
    "SequenceResult",
    "check_profile",
]

log = logging.getLogger(__name__)

FinishReason = Literal["length", "abort"]

_MAX_LAG_S = 0.02
"""When the loop runs this far behind its schedule (CPU starved), it restarts the schedule from
now instead of running steps back to back to catch up: simulated time then runs slower than wall
time, as a saturated engine would."""


class EngineStopped(StackError):
    """The engine is closed (or its step loop failed) and takes no more sequences."""


class _State(enum.Enum):
    PENDING = "pending"  # inside the API overhead, not yet seen by the scheduler
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class SequenceResult:
    """How one sequence went; times are seconds from `Engine.submit`."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    queue_s: float | None
    """Until the sequence was first scheduled (API overhead + waiting); None if never."""
    ttft_s: float | None
    """Until its first token; None if aborted before it."""
    e2e_s: float
    """Until it finished or was aborted."""
    preemptions: int
    """Times it was preempted and had to be prefilled again."""


@dataclass(frozen=True)
class EngineStats:
    """Live figures of an engine, read at any time."""

    running: int
    waiting: int
    """Sequences not yet running, including those still inside the API overhead."""
    kv_cache_usage: float
    """Fraction 0..1 of `kv_cache_tokens` held by running sequences (vLLM V1 kv_cache_usage)."""
    kv_cache_used_tokens: int
    preemptions_total: int
    prompt_tokens_total: int
    """Prompt tokens prefilled, counted at a sequence's first prefill (not again after a
    preemption)."""
    generation_tokens_total: int
    """Tokens produced, by every sequence, counted when produced."""
    finished_total: int
    """Sequences that reached max_tokens."""
    aborted_total: int
    steps_total: int


class Sequence:
    """One request inside the engine; await it for its `SequenceResult`."""

    __slots__ = (
        "_done",
        "_engine",
        "_first_token_at",
        "_kv_tokens",
        "_scheduled_at",
        "_state",
        "_submitted_at",
        "_waiter",
        "generated_tokens",
        "max_tokens",
        "preemptions",
        "prompt_tokens",
        "seq_id",
        "stream",
    )

    def __init__(
        self,
        engine: Engine,
        seq_id: int,
        prompt_tokens: int,
        max_tokens: int,
        stream: bool,
        submitted_at: float,
    ) -> None:
        self._engine = engine
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.stream = stream
        self.generated_tokens = 0
        self.preemptions = 0
        self._state = _State.PENDING
        self._kv_tokens = 0
        self._submitted_at = submitted_at
        self._scheduled_at: float | None = None
        self._first_token_at: float | None = None
        self._done: asyncio.Future[SequenceResult] = engine._loop.create_future()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        """True once finished or aborted."""
        return self._done.done()

    def __await__(self) -> Generator[Any, None, SequenceResult]:
        return self._done.__await__()

    async def tokens(self) -> AsyncIterator[int]:
        """Yield the number of new tokens each time some were produced, until the end.

        Steps that passed while the consumer was busy are coalesced into one count. Ends
        early if the sequence is aborted. Raises ValueError unless submitted with stream=True.
        """
        if not self.stream:
            raise ValueError(f"sequence {self.seq_id} was submitted with stream=False")
        emitted = 0
        loop = self._engine._loop
        while True:
            produced = self.generated_tokens
            if produced > emitted:
                yield produced - emitted
                emitted = produced
            elif self._done.done():
                return
            else:
                self._waiter = loop.create_future()
                await self._waiter

    def abort(self) -> None:
        """Drop the sequence and free its KV now; no-op once it is done."""
        self._engine._abort(self)

    def _result(self, reason: FinishReason, now: float) -> SequenceResult:
        start = self._submitted_at
        return SequenceResult(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.generated_tokens,
            finish_reason=reason,
            queue_s=None if self._scheduled_at is None else self._scheduled_at - start,
            ttft_s=None if self._first_token_at is None else self._first_token_at - start,
            e2e_s=now - start,
            preemptions=self.preemptions,
        )


class Engine:
    """The simulated engine over one `EngineProfile`, bound to the running event loop.

    Use `async with Engine(profile) as engine:` or `start()` / `await close()`. Raises
    InvalidInput for a profile it cannot run, RuntimeError outside a running event loop.
    """

    def __init__(self, profile: EngineProfile) -> None:
        check_profile(profile)
        self.profile = profile
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._next_id = 0
        self._pending: set[Sequence] = set()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._kv_used = 0
        self._wakeup: asyncio.Future[None] | None = None
        self._preemptions_total = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_total = 0
        self._aborted_total = 0
        self._steps_total = 0
        self.step_factor = 1.0
        """Every step's cost is multiplied by this (a slowed-down GPU: llmchaos.stack.gpu_fault)."""

    async def __aenter__(self) -> Engine:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def start(self) -> None:
        """Start the step loop (once; later calls do nothing)."""
        if self._task is not None or self._stopped:
            return
        self._task = self._loop.create_task(self._run(), name="engine-step-loop")
        self._task.add_done_callback(self._on_loop_exit)

    async def close(self) -> None:
        """Stop the step loop; every sequence not done ends with finish_reason "abort"."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            # wait() rather than await: the task's cancellation must not look like ours.
            await asyncio.wait([task])
        self._abort_all()

    def submit(self, prompt_tokens: int, max_tokens: int, stream: bool = False) -> Sequence:
        """Queue a sequence; it reaches the scheduler after the profile's API overhead.

        Raises ValueError for a negative prompt, max_tokens below 1 or the two together over
        max_model_len; EngineStopped once the engine is closed (or before it is started).
        """
        if self._stopped or self._task is None:
            raise EngineStopped("the engine is not running")
        if prompt_tokens < 0 or max_tokens < 1:
            raise ValueError(
                f"need prompt_tokens >= 0 and max_tokens >= 1, got {prompt_tokens}, {max_tokens}"
            )
        limit = self.profile.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"prompt_tokens + max_tokens = {prompt_tokens + max_tokens} is over "
                f"max_model_len {limit}"
            )
        loop = self._loop
        self._next_id += 1
        seq = Sequence(self, self._next_id, prompt_tokens, max_tokens, stream, loop.time())
        self._pending.add(seq)
        loop.call_later(self.profile.api_overhead_ms / 1000.0, self._enqueue, seq)
        return seq

    def stats(self) -> EngineStats:
        """The live figures (cheap: no copies)."""
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting) + len(self._pending),
            kv_cache_usage=self._kv_used / self.profile.kv_cache_tokens,
            kv_cache_used_tokens=self._kv_used,
            preemptions_total=self._preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            finished_total=self._finished_total,
            aborted_total=self._aborted_total,
            steps_total=self._steps_total,
        )

    # -- scheduler ---------------------------------------------------------------------------

    def _enqueue(self, seq: Sequence) -> None:
        if seq._state is not _State.PENDING:
            return  # aborted during the API overhead
        self._pending.discard(seq)
        seq._state = _State.WAITING
        self._waiting.append(seq)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _run(self) -> None:
        loop = self._loop
        profile = self.profile
        step_end = loop.time()
        while True:
            if not self._running and not self._waiting:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
                step_end = loop.time()
            decoding, admitted, prefill_tokens = self._schedule(loop.time())
            if admitted:
                cost_ms = profile.prefill_base_ms + profile.prefill_ms_per_token * prefill_tokens
            else:
                cost_ms = profile.decode_base_ms
            cost_ms += profile.decode_ms_per_seq * len(decoding)
            cost_ms *= self.step_factor
            now = loop.time()
            start = step_end if now - step_end < _MAX_LAG_S else now
            step_end = start + cost_ms / 1000.0
            # Always yield, so a step of zero cost cannot starve the HTTP server.
            await asyncio.sleep(max(0.0, step_end - loop.time()))
            self._steps_total += 1
            self._produce(decoding, loop.time())
            self._produce(admitted, loop.time())

    def _schedule(self, now: float) -> tuple[list[Sequence], list[Sequence], int]:
        """Pick this step's decoding and newly prefilled sequences and reserve their KV."""
        profile = self.profile
        budget = profile.kv_cache_tokens
        running = self._running
        preempted = False
        while running and self._kv_used + len(running) > budget:
            self._preempt(running.pop())
            preempted = True
        decoding = running.copy()
        for seq in decoding:
            seq._kv_tokens += 1
        self._kv_used += len(decoding)

        admitted: list[Sequence] = []
        prefill_tokens = 0
        # Like vLLM V1: no admission in a step that had to preempt, the KV is already short.
        if preempted:
            return decoding, admitted, prefill_tokens
        waiting = self._waiting
        slots = profile.max_num_seqs - len(running)
        while waiting and slots > 0:
            seq = waiting[0]
            tokens = seq.prompt_tokens + seq.generated_tokens
            if self._kv_used + tokens + 1 > budget:
                break
            if admitted and prefill_tokens + tokens > profile.max_num_batched_tokens:
                break
            waiting.popleft()
            seq._state = _State.RUNNING
            seq._kv_tokens = tokens + 1
            if seq._scheduled_at is None:
                seq._scheduled_at = now
                self._prompt_tokens_total += seq.prompt_tokens
            self._kv_used += tokens + 1
            prefill_tokens += tokens
            admitted.append(seq)
            running.append(seq)
            slots -= 1
        return decoding, admitted, prefill_tokens

    def _produce(self, seqs: list[Sequence], now: float) -> None:
        """Give each still-running sequence of the finished step its token."""
        finished = False
        produced = 0
        for seq in seqs:
            if seq._state is not _State.RUNNING:
                continue  # aborted while the step ran
            seq.generated_tokens += 1
            produced += 1
            if seq._first_token_at is None:
                seq._first_token_at = now
            if seq.generated_tokens >= seq.max_tokens:
                self._finish(seq, now)
                finished = True
            else:
                waiter = seq._waiter
                if waiter is not None:
                    seq._waiter = None
                    if not waiter.done():
                        waiter.set_result(None)
        self._generation_tokens_total += produced
        if finished:
            self._running = [s for s in self._running if s._state is _State.RUNNING]

    def _finish(self, seq: Sequence, now: float) -> None:
        seq._state = _State.FINISHED
        self._kv_used -= seq._kv_tokens
        seq._kv_tokens = 0
        self._finished_total += 1
        self._settle(seq, "length", now)

    def _preempt(self, seq: Sequence) -> None:
        seq._state = _State.WAITING
        self._kv_used -= seq._kv_tokens
        seq._kv_tokens = 0
        seq.preemptions += 1
        self._preemptions_total += 1
        self._waiting.appendleft(seq)

    def _abort(self, seq: Sequence) -> None:
        state = seq._state
        if state is _State.FINISHED or state is _State.ABORTED:
            return
        if state is _State.PENDING:
            self._pending.discard(seq)
        elif state is _State.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._kv_used -= seq._kv_tokens
            seq._kv_tokens = 0
        seq._state = _State.ABORTED
        self._aborted_total += 1
        self._settle(seq, "abort", self._loop.time())

    def _abort_all(self) -> None:
        for seq in [*self._pending, *self._waiting, *self._running]:
            self._abort(seq)

    @staticmethod
    def _settle(seq: Sequence, reason: FinishReason, now: float) -> None:
        # The future may already be cancelled by an awaiting task that was cancelled.
        if not seq._done.done():
            seq._done.set_result(seq._result(reason, now))
        waiter = seq._waiter
        if waiter is not None:
            seq._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("engine step loop failed; aborting all sequences", exc_info=exc)
            self._stopped = True
            self._abort_all()


def check_profile(profile: EngineProfile) -> None:
    """Raises InvalidInput naming the first field the engine cannot run with."""
    for name in ("max_num_seqs", "kv_cache_tokens", "max_model_len", "max_num_batched_tokens"):
        value = getattr(profile, name)
        if value < 1:
            raise InvalidInput(f"engine profile: {name} must be >= 1, got {value}")
    for name in (
        "api_overhead_ms",
        "prefill_base_ms",
        "prefill_ms_per_token",
        "decode_base_ms",
        "decode_ms_per_seq",
    ):
        value = getattr(profile, name)
        if value < 0:
            raise InvalidInput(f"engine profile: {name} must be >= 0, got {value}")
    if profile.max_model_len > profile.kv_cache_tokens:
        raise InvalidInput(
            f"engine profile: max_model_len {profile.max_model_len} is over kv_cache_tokens "
            f"{profile.kv_cache_tokens}; a lone sequence could not fit, lower max_model_len"
        )
