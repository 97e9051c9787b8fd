"""The PD hand-over: what a prefill worker and a decode worker call on their engine (kvfence/pd/roles.py).

Prefill side: `take_handoffs` (prompts whose K/V and first token are ready), `read_for_transfer` (page bytes for
frames, after I1), `finish_transfer`. Decode side: `expect_transfer` (admission, NEW -> AWAITING_KV),
`complete_transfer` (the verified pages are adopted, I3), `fail_transfer`. Engine thread only: a worker runs its
transfers on the thread that steps the engine.

A mixin of `LLMEngine` (kvfence/engine/llm_engine.py), kept apart so the step loop reads on its own; the
attributes it declares are the engine's.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kvfence import trace
from kvfence.engine.output import OutputProcessor, RequestOutput
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.engine.scheduler import Scheduler
from kvfence.engine.stats import EngineStats
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId
from kvfence.kv.integrity import ReadSet, Violation, check_reads
from kvfence.kv.pool import Lease, PagePool

integrity_log = logging.getLogger("kvfence.integrity")


class PDHandover:
    # the engine's own members (kvfence/engine/llm_engine.py)
    pool: PagePool
    scheduler: Scheduler
    outputs: OutputProcessor
    faults: Faults
    integrity_checks: bool
    stats: EngineStats
    recent_integrity_failures: deque[dict[str, object]]
    _requests: dict[RequestId, Request]

    _admit: Callable[..., Request]
    _end: Callable[[Request], None]
    _fail: Callable[[Request, str], RequestOutput]
    _remember_failure: Callable[[Mapping[str, object], str], None]
    _page_bytes: Callable[[PageId], bytes]

    def take_handoffs(self) -> list[Request]:
        """Prefill side: requests whose prompt K/V and first token are ready; their pages wait for a transfer."""
        handed, self.scheduler.handed_off = self.scheduler.handed_off, []
        return handed

    def finish_transfer(self, request_id: str) -> None:
        """Prefill side: the transfer no longer needs the pages (sent and acknowledged, or aborted)."""
        request = self._requests[RequestId(request_id)]
        self.scheduler.finish(request, RequestState.FINISHED, "transferred")
        self._end(request)

    def read_for_transfer(self, request_id: str, indices: Sequence[int]) -> list[bytes] | Violation:
        """Prefill side: the K/V bytes of pages `indices` of a handed-off request, for page frames. I1 first: a
        transfer ships only pages the request still leases and has written (its whole prompt), so a placeholder,
        a page freed while in use, or a stale page never leaves as if it were the request's (a Violation is
        logged and returned instead). Engine thread only."""
        request = self._requests[RequestId(request_id)]
        assert all(i < self.pool.pages_for(request.num_prompt_tokens) for i in indices)
        pages = [request.pages[i] for i in indices]
        if pages and self.faults.fire("stale_frame"):  # pages the request does not hold go out as its own
            pages = [PageId((p + len(request.pages)) % self.pool.num_pages) for p in pages]
        if self.integrity_checks:  # every page read here must be leased to the request and written by it
            leases = [request.leases[i] for i in indices]
            rs = ReadSet(request.request_id, pages, leases, len(pages) * self.pool.page_size)
            violations = check_reads(self.pool, [rs])
            self.stats.integrity_checks += 1
            if violations:
                integrity_log.error(json.dumps({**violations[0].as_log(), "tenant": request.tenant}))
                self._remember_failure(violations[0].as_log(), request.tenant)
                self.stats.integrity_failures += 1
                return violations[0]
        if trace.enabled:
            lease_ids = [int(request.leases[i]) for i in indices]
            trace.emit("read", request_id=request.request_id, pages=[int(p) for p in pages], leases=lease_ids,
                       written=len(pages))  # fmt: skip
        return [self._page_bytes(p) for p in pages]

    def expect_transfer(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, tenant: str = "anonymous"
    ) -> Request:
        """Decode side: admit a request whose prompt K/V will arrive by transfer (NEW -> AWAITING_KV)."""
        request = self._admit(prompt_ids, params, request_id, tenant)
        request.cacheable = False  # its K/V arrives by transfer: nothing to look up, nothing to seal
        request.transition(RequestState.WAITING)
        request.transition(RequestState.AWAITING_KV)
        self._requests[request.request_id] = request
        self.outputs.add(request)
        return request

    def complete_transfer(
        self,
        request_id: str,
        leases: Sequence[Lease],
        first_token: int,
        first_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None,
    ) -> None:
        """Decode side: every page arrived and verified (I3); the request adopts them and starts decoding."""
        request = self._requests[RequestId(request_id)]
        request.pending_logprobs = (first_logprobs,) if first_logprobs is not None else ()
        request.add_leases(list(leases))
        request.num_computed_tokens = request.num_prompt_tokens
        request.token_ids.append(first_token)
        if request.grammar is not None:  # the prefill's state is rebuilt here from the grammar and its token
            request.grammar.consume(first_token)
        self.scheduler.adopt(request)

    def fail_transfer(self, request_id: str, code: str, reason: str | None = None) -> RequestOutput | None:
        """Decode side: the transfer failed or was revoked; the request ends with an error, never decodes.
        `reason` (the receiver's, e.g. `digest_mismatch`) is kept with an integrity failure for the page map."""
        request = self._requests.get(RequestId(request_id))
        if request is None or request.state.terminal:
            return None
        if code == "kv_integrity_error":
            record = {"event": code, "request_id": request.request_id, "kind": "transfer", "reason": reason}
            self._remember_failure(record, request.tenant)
        return self._fail(request, code)
