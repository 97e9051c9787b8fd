"""AsyncEngine: the bridge between asyncio HTTP handlers and the one thread that steps the engine.

Boundary: owns an `LLMEngine` and ONE background thread, the engine loop; knows nothing about HTTP or JSON.

Threads:
  - The engine thread runs `LLMEngine.step` and everything it touches (pool, scheduler). When there is nothing
    to do it blocks on a condition variable (no busy-wait, no polling); `submit`, `abort` and
    `run_between_steps` wake it.
  - Handlers (the event loop) call `submit`: admission (I5) runs synchronously there, for all of a request's
    prompts and choices before any of them is queued, so a rejected request raises an `AdmissionError` to the
    handler and never reaches the scheduler. Outputs go back to the loop with `call_soon_threadsafe`, one
    batch per submission per step.
  - `run_between_steps(fn)` runs `fn` on the engine thread between two steps, the only safe moment to read
    the pool (`check_integrity`, stats) while the server is live.

Lock order: `self._cond` before the engine's own lock, never the reverse (the engine never calls back in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvfence.engine.admission import admit
from kvfence.engine.errors import EngineUnavailable, TooManyChoices
from kvfence.engine.loop import IdleTrim
from kvfence.engine.output import RequestOutput
from kvfence.engine.protocol import Admitted, Engine
from kvfence.engine.request import SamplingParams
from kvfence.engine.stats import EngineSnapshot
from kvfence.ids import RequestId

log = logging.getLogger("kvfence.server")
T = TypeVar("T")
# after this long without a step, the engine thread hands the heap's freed pages back to the OS
Item = tuple[int, RequestOutput]


class QueueFull(Exception):
    """More requests are waiting than `max_queue` allows; the client should retry later."""


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """What an observer learns when one engine request ends (called on the engine thread, or on the thread
    that calls `stop` for requests still live at shutdown)."""

    request_id: str
    tenant: str
    output: RequestOutput
    num_pages_checked: int
    ttft_s: float | None
    duration_s: float
    user: str | None = None  # the client's `user` field: logged, never trusted (the tenant is from the key)


class Observer(Protocol):
    def on_first_token(self, seconds: float, tenant: str) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_request_end(self, end: RequestEnd) -> None: ...


class Submission:
    """The engine requests of one HTTP request (prompts x n choices). Ids are `<id>-<index>`; iterate
    `stream()` for `(index, output)` pairs until every one of them has finished."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop, request_ids: list[str]) -> None:
        self._owner, self._loop = owner, loop
        self.request_ids = tuple(request_ids)
        self._queue: asyncio.Queue[list[Item] | BaseException] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def stream(self) -> AsyncIterator[Item]:
        while self._unfinished:
            batch = await self._queue.get()
            if isinstance(batch, BaseException):
                raise batch
            for index, out in batch:
                if out.finished:
                    self._unfinished.discard(index)
                yield index, out

    def abort(self) -> None:
        """Abort every request of this submission that has not finished yet (pages go back to the pool)."""
        for index in sorted(self._unfinished):
            self._owner.abort(self.request_ids[index])

    def _deliver(self, item: list[Item] | BaseException) -> None:
        """Engine thread: hand a batch (or a fatal error) to the submitting event loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


@dataclass(slots=True)
class _Tracked:
    submission: Submission
    index: int
    request: Admitted
    submitted: float
    user: str | None
    num_prompt_tokens: int
    num_output_tokens: int = 0  # as of its last output: what a request killed by `_fail_all` had made
    first: float | None = None
    last: float | None = None


class AsyncEngine:
    def __init__(
        self, engine: Engine, *, max_queue: int | None = None, observer: Observer | None = None
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.observer = observer
        self._cond = threading.Condition()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._num_new = 0  # requests submitted since the engine loop last took its inbox
        self._num_waiting = 0  # the scheduler's waiting queue after the last step
        self._trim = IdleTrim()  # hands freed heap pages back after a while without steps (engine thread)
        self._busy = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "AsyncEngine.start called twice"
        self._thread = threading.Thread(target=self._run, name="kvfence-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineUnavailable("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        """Liveness: the engine loop runs (GET /health/live)."""
        return self._failure is None and not self._stopping and self._thread is not None

    def unready(self) -> str | None:
        """Readiness (GET /health): None when a request could be served now, else why not."""
        if not self.healthy:
            return "the engine is not running"
        return self.engine.unready()

    def in_flight(self, tenant: str) -> int:
        """Engine requests of `tenant` queued or running (its max_in_flight limit, server/tenants.py)."""
        with self._cond:
            return sum(1 for t in self._tracked.values() if t.request.tenant == tenant)

    @property
    def num_queued(self) -> int:
        """Requests not yet running: submitted since the last step plus the scheduler's waiting queue."""
        return self._num_new + self._num_waiting

    # ---- entry points (event loop) --------------------------------------------------------------------

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        request_id: str,
        tenant: str,
        user: str | None = None,
    ) -> Submission:
        """Admit and queue one engine request per prompt; raises `AdmissionError` (nothing queued or
        allocated), `QueueFull` or `EngineUnavailable`. Must be called from a running event loop."""
        loop = asyncio.get_running_loop()
        assert len(prompts) == len(params) and prompts
        for prompt, p in zip(prompts, params, strict=True):
            admit(len(prompt), p, self.engine.limits)  # I5, pure: all of them before any is queued
        if self.max_queue is not None and len(prompts) > self.max_queue:
            raise TooManyChoices(len(prompts), self.max_queue)  # would wait for room forever: not retryable
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        submission = Submission(self, loop, ids)
        with self._cond:  # held while adding, so the engine thread cannot deliver an output we do not track
            self._check_capacity(len(prompts))
            now = time.perf_counter()
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                try:
                    request = self.engine.add_request(prompt, p, request_id=ids[i], tenant=tenant)
                except BaseException:
                    self._untrack(ids[:i])
                    raise
                self._tracked[ids[i]] = _Tracked(submission, i, request, now, user, len(prompt))
            self._num_new += len(prompts)
            self._cond.notify_all()
        return submission

    def abort(self, request_id: str) -> None:
        """Abort one engine request (takes effect between steps; unknown or finished ids are ignored)."""
        self.engine.abort(request_id)
        with self._cond:
            self._cond.notify_all()

    async def run_between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and return its result."""
        return await asyncio.wrap_future(self._post(fn))

    def call_between_steps(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """`run_between_steps` for callers outside the event loop (tests, benchmarks)."""
        result: T = self._post(fn).result(timeout)
        return result

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is live and the loop is between rounds; False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout)

    def snapshot(self) -> EngineSnapshot:
        """Engine state for metrics. Call it on the engine thread (`run_between_steps(engine.snapshot)`)."""
        return self.engine.snapshot()

    # ---- helpers (any thread, under self._cond) -------------------------------------------------------

    def _check_capacity(self, num_new: int) -> None:
        if self._failure is not None or self._stopping or self._thread is None:
            raise EngineUnavailable("the engine is not running")
        if self.max_queue is not None and self.num_queued + num_new > self.max_queue:
            raise QueueFull(
                f"the server is overloaded: {self.num_queued} requests are waiting (limit {self.max_queue})"
            )

    def _untrack(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._tracked.pop(rid, None)
            self.engine.abort(rid)

    def _idle(self) -> bool:
        if self._failure is not None:
            return True
        return not self._busy and not self._calls and not self.engine.has_unfinished()

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._failure is not None or self._stopping:
                fut.set_exception(EngineUnavailable("the engine is not running"))
            else:
                self._calls.append((fn, fut))
                self._cond.notify_all()
        return fut

    # ---- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._round():
                pass
        except BaseException as exc:  # a bug in step(): fail every live request loudly, serve nothing more
            log.exception("engine loop crashed; failing all requests")
            self._fail_all(EngineUnavailable(f"the engine loop crashed: {exc!r}"), exc)

    def _round(self) -> bool:
        # idle for a while after work: hand freed heap pages back to the OS, outside the lock, so that submit()
        # and abort() never wait for it
        if self._wait_while_idle():
            self._trim.trim_if_due(False, time.monotonic())
        with self._cond:
            self._cond.wait_for(self._has_work)
            if self._stopping:
                return False
            calls, self._calls = self._calls, []
            self._num_new, self._busy = 0, True
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
        if self.engine.has_unfinished():
            self._trim.worked(time.monotonic())
            outputs = self.engine.step()
            self._num_waiting = self.engine.num_waiting
            self._dispatch(outputs, time.perf_counter())
        with self._cond:
            self._busy = False
            self._cond.notify_all()  # wake `wait_idle` callers
        return True

    def _wait_while_idle(self) -> bool:
        """Wait while there is no work, until a heap trim is due (`IdleTrim`); True if it is due now. Calls
        between steps (`/metrics`, the page map) end the wait but not the idle period."""
        with self._cond:
            while (remaining := self._trim.wait_s(time.monotonic())) and not self._has_work():
                self._cond.wait(remaining)
            return remaining == 0.0 and not self._stopping and not self.engine.has_unfinished()

    def _has_work(self) -> bool:
        return self._stopping or bool(self._calls) or self.engine.has_unfinished()

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        batches: dict[Submission, list[Item]] = {}
        ended: list[tuple[_Tracked, RequestOutput]] = []
        timings: list[tuple[bool, float, str]] = []
        with self._cond:
            for out in outputs:
                t = self._tracked.get(out.request_id)
                if t is None:
                    continue  # its submission was withdrawn
                if out.new_token_ids:
                    timings.append((t.first is None, now - (t.last or t.submitted), t.request.tenant))
                    t.first, t.last = t.first or now, now
                t.num_output_tokens = out.num_output_tokens
                if out.finished:
                    del self._tracked[out.request_id]
                    ended.append((t, out))
                batches.setdefault(t.submission, []).append((t.index, out))
        for submission, batch in batches.items():
            submission._deliver(batch)
        self._observe(timings, ended, now)

    def _observe(
        self, timings: list[tuple[bool, float, str]], ended: list[tuple[_Tracked, RequestOutput]], now: float
    ) -> None:
        if self.observer is None:
            return
        try:
            for first, seconds, tenant in timings:
                if first:
                    self.observer.on_first_token(seconds, tenant)
                else:
                    self.observer.on_inter_token(seconds)
            for t, out in ended:
                ttft = None if t.first is None else t.first - t.submitted
                self.observer.on_request_end(
                    RequestEnd(
                        out.request_id,
                        t.request.tenant,
                        out,
                        t.request.num_pages_checked,
                        ttft,
                        now - t.submitted,
                        t.user,
                    )
                )
        except Exception:  # metrics must never take the engine down
            log.exception("request observer failed")

    def _fail_all(self, error: BaseException, cause: BaseException | None = None) -> None:
        with self._cond:
            if cause is not None or self._failure is None:
                self._failure = cause or error
            tracked, self._tracked = self._tracked, {}
            calls, self._calls = self._calls, []
            self._cond.notify_all()
        # observed before the handlers hear of it: each killed request is logged and counted as failed
        self._observe([], [(t, _unavailable(rid, t)) for rid, t in tracked.items()], time.perf_counter())
        for submission in {t.submission for t in tracked.values()}:
            submission._deliver(error)
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)


def _unavailable(request_id: str, t: _Tracked) -> RequestOutput:
    """The last output of a request the engine never finished because its loop stopped (crash, shutdown)."""
    return RequestOutput(
        request_id=RequestId(request_id),
        new_token_ids=(),
        new_text="",
        finished=True,
        finish_reason="error",
        error_code="engine_unavailable",
        num_prompt_tokens=t.num_prompt_tokens,
        num_output_tokens=t.num_output_tokens,
        text="",
        token_ids=(),
    )
