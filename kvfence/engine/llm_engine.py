"""The engine: admission, scheduling, integrity checks, one forward step, and outputs, in that order.

    step():  drain inbox (adds, aborts) -> schedule -> check reads (I1) and writes (I9) -> run -> stamp writes
             -> check again -> postprocess (append tokens, stops, seal full pages) -> detokenize, stop strings
             -> outputs -> every `kv_canary_interval` steps, re-verify a few cached pages (I9)

Thread safety: `add_request` and `abort` may be called from any thread; they only validate and enqueue under a
lock. Everything else (`step` and what it calls) runs on one thread, the engine loop. Pages used by a running
step are held (kv/pool.py) so that nothing released meanwhile can be reused before the step ends (I4).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from kvfence import trace
from kvfence.engine.admission import Limits, admit
from kvfence.engine.config import EngineConfig
from kvfence.engine.errors import DuplicateRequestId, InvalidSamplingParams
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import OutputProcessor, RequestOutput
from kvfence.engine.plan import Plan, StepResult
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.engine.scheduler import Scheduled, Scheduler, SchedulerConfig
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId
from kvfence.kv.integrity import ReadSet, StepReads, Violation, WriteSet, check_reads, check_writes
from kvfence.kv.pool import Lease, PagePool, PageState
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.model.llama import LlamaForCausalLM
from kvfence.model.loader import LoadedModel, load_model

T = TypeVar("T")
log = logging.getLogger("kvfence.engine")
integrity_log = logging.getLogger("kvfence.integrity")
RECENT_FAILURES = 32  # integrity failures kept for the KV page map (kvfence/dashboard)
CANARY_PAGES = 4  # cached pages whose digests one canary check re-verifies


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    integrity_checks: int = 0  # request-checks performed (one per scheduled request, twice per step)
    pages_checked: int = 0
    integrity_failures: int = 0
    preemptions: int = 0
    check_seconds: float = 0.0  # wall time inside the I1 checks, to measure their cost
    stamp_seconds: float = 0.0  # wall time spent stamping tags on the write path
    outcomes: dict[str, int] = field(
        default_factory=dict
    )  # finished / failed:<code> / aborted / rejected:<code>

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class LLMEngine:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, runner: ModelRunner | None = None
    ) -> None:
        """`runner`: a stand-in for the model runner (the simulator's, kvfence/sim); `loaded` then only needs
        the model config and tokenizer."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        loaded = loaded or load_model(config.model, dtype=config.torch_dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_length = min(
            config.context_length or loaded.config.context_length, loaded.config.context_length
        )
        num_pages = config.resolve_num_pages(loaded.config)
        self.faults = config.faults or Faults()
        self.pool = PagePool(
            num_pages, config.page_size, faults=self.faults, lease_prefix=config.lease_prefix
        )
        if runner is None:
            model = LlamaForCausalLM.from_weights(
                loaded.config, loaded.weights, config.torch_dtype, config.device, loaded.quantized
            )
            runner = ModelRunner(
                model,
                num_pages,
                config.page_size,
                config.torch_dtype,
                config.device,
                self.faults,
                config.seed,
                threads=_step_threads(config),
            )
        self.runner = runner
        self.prefix_cache = (
            PrefixCache(self.pool, self.runner.page_digests, self.faults)
            if config.enable_prefix_cache
            else None
        )
        sched_cfg = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.context_length,
            config.prefill_batch_tokens,
        )
        self.scheduler = Scheduler(
            sched_cfg,
            self.pool,
            loaded.config.eos_token_ids or self.tokenizer.eos_token_ids,
            self.prefix_cache,
        )
        self.limits = Limits(self.context_length, num_pages, config.page_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        # I1 checks and tag stamping. On by default; benchmarks toggle it on one warm engine to measure its cost.
        self.integrity_checks = config.integrity_checks
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._reads: tuple[list[Scheduled], StepReads] | None = None  # this step's I1 arrays (engine thread)
        self._blocked = False  # the last step had requests but could schedule none (engine thread)
        self._aborts: set[RequestId] = set()
        self._requests: dict[RequestId, Request] = {}  # engine thread only
        self._live_ids: set[RequestId] = set()  # under _lock: every id from admission until the request ends
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._step_no = 0
        # the last integrity failures (page, expected and found tag), newest last: read by the KV page map
        self.recent_integrity_failures: deque[dict[str, object]] = deque(maxlen=RECENT_FAILURES)

    # ---- entry points (any thread) ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "anonymous",
        prefill_only: bool = False,
    ) -> Request:
        """Admit a request (I5: raises an AdmissionError before anything is allocated) and queue it.
        `prefill_only` (PD prefill worker): stop after the first token; the pages wait for `take_handoffs`."""
        request = self._admit(prompt, params, request_id, tenant, prefill_only)
        with self._lock:
            self._inbox.append(request)
        return request

    def _admit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        tenant: str,
        prefill_only: bool = False,
    ) -> Request:
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            admit(len(token_ids), params, self.limits, prefill_only)
            if any(not 0 <= t < self.model_config.vocab_size for t in token_ids):
                raise InvalidSamplingParams("prompt", "prompt contains token ids outside the vocabulary")
        except Exception as exc:
            with self._lock:
                self.stats.count(f"rejected:{getattr(exc, 'code', 'invalid')}")
            raise
        with self._lock:
            rid = RequestId(request_id) if request_id else self._fresh_id()
            if rid in self._live_ids:
                raise DuplicateRequestId(f"request id {rid!r} is already in use")
            self._live_ids.add(rid)
        request = Request(rid, token_ids, params, tenant=tenant, arrival=next(self._arrivals))
        request.prefill_only = prefill_only
        return request

    def _fresh_id(self) -> RequestId:
        while (rid := RequestId(f"req-{next(self._ids)}")) in self._live_ids:
            pass
        return rid

    def abort(self, request_id: str) -> None:
        """Abort a request at any time; takes effect between steps. Unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self._live_ids:  # a stale abort must not make an idle engine look steppable
                self._aborts.add(RequestId(request_id))

    def has_unfinished(self) -> bool:
        """True while any admitted request has not ended (queued, running, or in a PD transfer)."""
        with self._lock:
            return bool(self._live_ids)

    def has_steppable(self) -> bool:
        """True while a step could run a forward: requests queued or in the scheduler, and the last step did
        not find them all blocked (no pages free). Requests that only wait on a PD transfer (frames, an ack)
        are not steppable; a PD worker waits on its sockets for them, and for pages to come free, instead of
        stepping in a loop. A request that arrives clears the blocked state."""
        with self._lock:
            return bool(self._inbox) or (self.scheduler.num_unfinished > 0 and not self._blocked)

    def set_step_threads(self, threads: int) -> None:
        """Torch threads for the next steps, of every kind (a PD worker sharing its host's cores). Engine thread
        only: OpenMP's thread count is per thread."""
        self.runner.threads = (threads, threads)

    # ---- PD hand-over (engine thread only; the worker runs transfers on the engine thread, see kvfence/pd) ----

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
        return [self.runner.cache.read_page(p) for p in pages]

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

    # ---- the engine loop (one thread) -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        scheduled = self.scheduler.schedule()
        self._blocked = not scheduled
        if not scheduled:
            return outputs
        scheduled, failed = self._verify(scheduled, after_step=False)
        outputs += failed
        scheduled, failed = self._check_writes(scheduled)
        outputs += failed
        if not scheduled:
            return outputs
        self._step_no += 1
        plan = Scheduler.build_plan(scheduled, self._step_no)
        held = plan.all_pages
        self.pool.hold(held)
        if trace.enabled:  # what each row reads: its block table, the first pages its own writes
            for row in plan.rows:
                trace.emit("read", request_id=row.request_id, pages=[int(p) for p in row.pages],
                           leases=[int(x) for x in row.leases], written=self.pool.pages_for(row.start_pos))  # fmt: skip
        try:
            result = self.runner.run(plan)
            self._stamp(plan, result)
            scheduled, failed = self._verify(scheduled, after_step=True)
            outputs += failed
        except Exception:
            # A step that blows up must not wedge the engine: fail the requests it carried (their pages are
            # released under the step's hold, so they stay quarantined until it is dropped below) and go on.
            log.exception("forward step %d failed; failing its %d requests", plan.step, len(scheduled))
            return outputs + [
                self._fail(s.request, "internal_error") for s in scheduled if not s.request.state.terminal
            ]
        finally:
            self.pool.unhold(held)
            self._reads = None
        self.stats.steps += 1
        self.stats.tokens_computed += plan.num_tokens
        self.scheduler.postprocess(scheduled, result.sampled)
        for out in self.outputs.process(scheduled, result, self.scheduler):
            outputs.append(out)
            if out.finished:
                self._end(self._requests[out.request_id])
        self.stats.preemptions = self.scheduler.num_preemptions
        return outputs + self._canary()

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:  # adds move to the scheduler under the lock so has_unfinished() never misses them
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
            for request in inbox:
                self._requests[request.request_id] = request
                self.scheduler.add(request)
                self.outputs.add(request)
        outputs = []
        for rid in aborts:
            target = self._requests.get(rid)
            if target is None or target.state.terminal:
                continue
            self.scheduler.finish(target, RequestState.ABORTED, "abort")
            outputs.append(self.outputs.final(target))
            self._end(target)
        return outputs

    def _stamp(self, plan: Plan, result: StepResult) -> None:
        """Tag every page the runner reports it wrote with the writer's lease (from the write path, I1).
        Stamping is part of writing and always happens; only the checks can be switched off."""
        t0 = time.perf_counter()
        for row, indices in zip(plan.rows, result.written, strict=True):
            self.pool.stamp([row.pages[i] for i in indices], [row.leases[i] for i in indices])
        self.stats.stamp_seconds += time.perf_counter() - t0

    def _verify(
        self, scheduled: list[Scheduled], after_step: bool
    ) -> tuple[list[Scheduled], list[RequestOutput]]:
        """I1: fail every scheduled request whose block table does not match its leases and writes. The check
        after the step reuses the arrays of the check before it when the batch is the same list."""
        if not self.integrity_checks:
            return scheduled, []
        t0 = time.perf_counter()
        reads = self._reads
        if not after_step or reads is None or reads[0] is not scheduled:
            before, after = [], []
            for s in scheduled:
                r = s.request
                before.append(ReadSet(r.request_id, r.pages, r.leases, r.num_computed_tokens))
                after.append(
                    ReadSet(r.request_id, r.pages, r.leases, r.num_computed_tokens + s.num_new_tokens)
                )
            reads = self._reads = (scheduled, StepReads(self.pool, before, after))
        violations = reads[1].check(self.pool, after_step)
        if after_step:
            self._reads = None
        num_pages = len(reads[1].pages)
        self.stats.integrity_checks += len(scheduled)
        self.stats.pages_checked += num_pages
        for s in scheduled:
            s.request.num_pages_checked += len(s.request.pages)
        self.stats.check_seconds += time.perf_counter() - t0
        if not violations:
            return scheduled, []
        return self._fail_integrity(scheduled, violations)

    def _check_writes(self, scheduled: list[Scheduled]) -> tuple[list[Scheduled], list[RequestOutput]]:
        """I9: fail every scheduled request whose step would write a sealed (shared, read-only) page. Runs
        whenever sealed pages can exist, integrity checks on or off: such a write would change K/V that other
        requests reuse."""
        if self.prefix_cache is None:
            return scheduled, []
        page_size = self.pool.page_size
        write_sets = [
            WriteSet(r.request_id, r.pages, r.leases, r.num_computed_tokens // page_size)
            for r in (s.request for s in scheduled)
        ]
        violations = check_writes(self.pool, write_sets)
        return self._fail_integrity(scheduled, violations) if violations else (scheduled, [])

    def _canary(self) -> list[RequestOutput]:
        """Every `kv_canary_interval` steps, re-verify the digests of a few cached pages (I9). A corrupt idle
        page leaves the cache; the running requests that hold a corrupt page fail (PD transfers already
        reading one are left to finish)."""
        interval = self.config.kv_canary_interval
        if self.prefix_cache is None or interval < 1 or self._step_no % interval:
            return []
        failures = self.prefix_cache.canary(CANARY_PAGES)
        for failure in failures:
            self._remember_failure(failure.as_log(), failure.entry.scope)
        bad = {f.entry.page for f in failures if f.in_use}
        victims = [
            r
            for r in self._requests.values()
            if r.state is RequestState.RUNNING and bad.intersection(r.pages)
        ]
        self.stats.integrity_failures += len(victims)
        return [self._fail(r, "kv_integrity_error") for r in victims]

    def _fail_integrity(
        self, scheduled: list[Scheduled], violations: list[Violation]
    ) -> tuple[list[Scheduled], list[RequestOutput]]:
        bad = {v.request_id: v for v in violations}
        failed = []
        for s in scheduled:
            violation = bad.get(s.request.request_id)
            if violation is None:
                continue
            integrity_log.error(json.dumps({**violation.as_log(), "tenant": s.request.tenant}))
            self._remember_failure(violation.as_log(), s.request.tenant)
            self.stats.integrity_failures += 1
            failed.append(self._fail(s.request, "kv_integrity_error"))
        return [s for s in scheduled if s.request.request_id not in bad], failed

    def _fail(self, request: Request, code: str) -> RequestOutput:
        self.scheduler.finish(request, RequestState.FAILED, "error", code)
        out = self.outputs.final(request)
        self._end(request)
        return out

    def _end(self, request: Request) -> None:
        outcome = request.state.value if request.error_code is None else f"failed:{request.error_code}"
        self.stats.count(outcome)
        self._requests.pop(request.request_id, None)
        self.outputs.remove(request)
        with self._lock:
            self._live_ids.discard(request.request_id)

    def _remember_failure(self, record: Mapping[str, object], tenant: str) -> None:
        self.recent_integrity_failures.append({**record, "tenant": tenant, "time": time.time()})

    def live_requests(self) -> list[Request]:
        """Every request the engine thread knows that has not ended (waiting, running, in a PD transfer), in
        admission order. Engine thread only; the KV page map reads it between steps."""
        return list(self._requests.values())

    def check_integrity(self, other_holders: Sequence[Lease] = ()) -> None:
        """Pool (and prefix cache) invariants, plus: the LEASED pages are exactly the pages live requests (and
        `other_holders`, e.g. a PD receiver's reservations) hold, each in one block table under the lease it
        holds; a sealed page's reference count is the number of block tables that list it, under its shared
        lease. Engine thread only (or with the loop stopped). Raises AssertionError."""
        self.pool.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        held: dict[int, int] = {}
        refs: Counter[int] = Counter()
        holders = [
            Lease(p, x) for r in self._requests.values() for p, x in zip(r.pages, r.leases, strict=True)
        ]
        for item in [*holders, *other_holders]:
            assert held.setdefault(item.page, item.lease) == item.lease, f"two leases on page {item.page}"
            refs[item.page] += 1
        leased = {int(p) for p in np.flatnonzero(self.pool.state == PageState.LEASED)}
        sealed = {int(p) for p in np.flatnonzero(self.pool.state == PageState.SEALED)}
        assert set(held) <= leased | sealed, (
            "a live request holds a page the pool lists as neither leased nor sealed"
        )
        stray = leased - set(held)
        assert not stray, f"pages leased by no live request: {sorted(stray)[:8]}"
        assert all(int(self.pool.owner[p]) == x for p, x in held.items()), "lease/owner mismatch"
        assert all(refs[p] == 1 for p in leased), "a leased (unsealed) page in two block tables"
        assert all(int(self.pool.refs[p]) == refs[p] for p in sealed), "sealed page reference count"

    # ---- offline convenience ----------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns one final output per prompt, in order, with full text and ids."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[RequestId, RequestOutput] = {}
        while len(final) < len(requests):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in requests]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one prompt, yielding its outputs as they come (drives the engine loop itself)."""
        request = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == request.request_id:
                    yield out
                    if out.finished:
                        return


def _step_threads(config: EngineConfig) -> tuple[int, int] | None:
    """Torch threads per kind of step, or None to leave torch's own setting."""
    if config.decode_threads is None:
        return None
    return (config.num_threads or torch.get_num_threads(), config.decode_threads)


def on_passing_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a thread that ends when it returns, and return its result (or raise its exception).

    For torch work done before an engine is stepped on another thread (model loading, engine construction):
    a thread that runs an OpenMP parallel region keeps a pool of OpenMP workers for as long as it lives, and
    libgomp stops letting workers spin between regions once it manages more threads than there are CPUs. With
    the main thread's pool alive, every parallel region of the engine thread then puts its worker to sleep and
    wakes it again: on 2 cores, 230 context switches and twice the time per decode step with 2 threads
    (docs/performance.md, session 7). A pool dies with its thread, so loading here leaves the engine thread's
    pool the only one."""
    box: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="kvfence-load", daemon=True)  # Ctrl-C does not wait for it
    thread.start()
    thread.join()
    if failure:
        raise failure.pop()  # not failure[0]: the traceback would keep this frame, and `fn`'s, alive in a cycle
    return box.pop()


def return_freed_memory() -> None:
    """Give the heap pages that loading freed (dequantized tensors, unfused and unpacked copies: about 550 MB for
    SmolLM2 in bfloat16) back to the OS; glibc keeps them otherwise. Call once the `LoadedModel` is dropped."""
    import gc

    gc.collect()
    trim_heap()


# glibc's mallopt parameters (malloc.h) and the values trim_heap leaves set
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # what glibc's own threshold grows to (its maximum) once steps free big activations
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # and the trim threshold with it: steps never pay for trimming
IDLE_TRIM_THRESHOLD = 1 << 20
IDLE_TRIM_S = 2.0  # a server (colocated or PD worker) trims once it has had no work for this long


def trim_heap() -> None:
    """Return free heap pages to the OS (a step's activations leave about 100 MB of them behind after a burst,
    docs/performance.md). No-op outside glibc.

    `malloc_trim` releases the free pages inside every arena, but not the top chunk of the arenas of threads other
    than the main one: about 35 MiB stayed resident after W1 (docs/performance.md, session 10). glibc trims a
    thread arena's top only when a free of 64 KiB or more lands in that arena and the top exceeds the trim
    threshold. So the threshold is lowered for one such free on the calling thread (the engine thread, when it
    trims at idle), and set back to the value glibc's dynamic threshold reaches under load, where it stays fixed
    (setting it turns the dynamic adjustment off, so the mmap threshold is fixed at its maximum, too)."""
    if sys.platform != "linux":
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        # thresholds the operator set (MALLOC_*_ variables, glibc tunables) are left alone; and where glibc
        # refuses ours (a heap size capped by huge-page tunables), only malloc_trim runs
        if not _malloc_tuned_by_operator() and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
            if libc.mallopt(M_TRIM_THRESHOLD, IDLE_TRIM_THRESHOLD) == 1:
                block = libc.malloc(256 << 10)  # from this thread's arena; its free trims that arena's top
                libc.free(block)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.malloc_trim(0)


def _malloc_tuned_by_operator() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in os.environ
    )
