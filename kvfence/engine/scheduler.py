"""Continuous batching: which requests run in the next step, with how many tokens, on which pages.

Boundary: plain Python over `Request`s and the `PagePool`; never imports torch, never sees tensors.

Each step (`schedule`):
  1. Running requests first, oldest first: a decode needs one token, an unfinished chunked prefill the next
     chunk. If the pool cannot cover them, preempt the request at the back of the running queue (release its
     pages, recompute later) until it can.
  2. Then waiting requests, in order, while the token budget, `max_num_seqs` and free pages allow. Long prompts
     are cut into chunks that fit the budget (chunked prefill). New requests never preempt running ones.
`postprocess` appends sampled tokens, and finishes requests on EOS, stop ids, max_tokens or context length.
`finish` is the only way a request leaves: its pages go back to the pool (quarantine first, see kv/pool.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvfence.engine.plan import Plan, PlanRow
from kvfence.engine.request import Request, RequestState
from kvfence.ids import RequestId
from kvfence.kv.pool import PagePool


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    context_length: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: Request
    num_new_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.pool = pool
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.handed_off: list[Request] = []  # PD prefill: requests whose pages await a transfer

    def add(self, request: Request) -> None:
        request.transition(RequestState.WAITING)
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling -------------------------------------------------------------------------------------

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted = False
        queue = list(self.running)
        while queue and budget > 0:
            request = queue.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, num_new):
                victim = queue.pop() if queue else request
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(Scheduled(request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new):
                break
            self.waiting.popleft()
            request.transition(RequestState.RUNNING)
            self.running.append(request)
            scheduled.append(Scheduled(request, num_new))
            budget -= num_new
        return scheduled

    def _grow(self, request: Request, num_new: int) -> bool:
        """Lease the pages `request` needs to hold `num_new` more tokens; False if the pool is short."""
        need = self.pool.pages_for(request.num_computed_tokens + num_new) - len(request.pages)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        request.add_leases(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the request's K/V and pages, keep its tokens, put it at the head of the queue."""
        self.pool.release(request.take_leases())
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        request.transition(RequestState.WAITING)
        self.waiting.appendleft(request)

    @staticmethod
    def build_plan(scheduled: list[Scheduled], step: int) -> Plan:
        rows = []
        for item in scheduled:
            r, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            rows.append(
                PlanRow(
                    request_id=r.request_id,
                    token_ids=tuple(r.token_ids[start:end]),
                    start_pos=start,
                    pages=tuple(r.pages),
                    leases=tuple(r.leases),
                    sample=end == r.num_tokens,
                    params=r.params,
                    num_generated=r.num_output_tokens,
                )
            )
        return Plan(rows=tuple(rows), step=step)

    # ---- after the step ---------------------------------------------------------------------------------

    def postprocess(self, scheduled: list[Scheduled], sampled: dict[RequestId, int]) -> list[Request]:
        """Advance each scheduled request by what the step computed; return the requests that finished."""
        finished = []
        for item in scheduled:
            request = item.request
            if request.state is not RequestState.RUNNING:
                continue  # failed or aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.token_ids.append(token)
            if request.prefill_only:
                self._hand_off(request)
                continue
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, RequestState.FINISHED, reason)
                finished.append(request)
        return finished

    def _hand_off(self, request: Request) -> None:
        """PD prefill: the prompt's K/V and first token are done; keep the pages for the transfer."""
        self.running.remove(request)
        request.transition(RequestState.TRANSFERRING)
        self.handed_off.append(request)

    def adopt(self, request: Request) -> None:
        """PD decode: a request whose prompt K/V arrived by transfer joins the running batch."""
        request.transition(RequestState.RUNNING)
        self.running.append(request)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.context_length:
            return "length"
        return None

    def finish(
        self, request: Request, state: RequestState, reason: str, error_code: str | None = None
    ) -> None:
        """End a live request in `state`; its pages are released to the pool (quarantined, then freed)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            self.running.remove(request)
        request.transition(state)
        request.finish_reason, request.error_code = reason, error_code
        self.pool.release(request.take_leases())
