"""The engine: admission, scheduling, integrity checks, one forward step, and outputs, in that order.

    step():  drain inbox (adds, aborts) -> schedule -> check reads (I1) and writes (I9) -> run -> stamp writes
             -> check again -> postprocess (append tokens, stops, seal full pages) -> detokenize, stop strings
             -> outputs -> every `kv_canary_interval` steps, re-verify a few cached pages (I9)

Thread safety: `add_request` and `abort` may be called from any thread; they only validate and enqueue under a
lock. Everything else (`step` and what it calls) runs on one thread, the engine loop. Pages used by a running
step are held (kv/pool.py) so that nothing released meanwhile can be reused before the step ends (I4).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from kvfence import trace
from kvfence.config import Config
from kvfence.engine.admission import Limits, admit
from kvfence.engine.config import torch_dtype
from kvfence.engine.errors import DuplicateRequestId, InvalidSamplingParams
from kvfence.engine.fairness import Fairness, TenantShare
from kvfence.engine.grammar import Grammars
from kvfence.engine.handover import PDHandover
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import OutputProcessor, RequestOutput
from kvfence.engine.plan import Plan, StepInterrupted, StepResult, Stop
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.engine.scheduler import Scheduled, Scheduler
from kvfence.engine.stats import EngineSnapshot, EngineStats, TenantSnapshot
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId
from kvfence.kv.integrity import ReadSet, StepReads, Violation, WriteSet, check_writes
from kvfence.kv.pool import Lease, PagePool, PageState
from kvfence.kv.prefix_cache import PrefixCache
from kvfence.model.llama import LlamaForCausalLM
from kvfence.model.loader import LoadedModel, load_model

log = logging.getLogger("kvfence.engine")
integrity_log = logging.getLogger("kvfence.integrity")
RECENT_FAILURES = 32  # integrity failures kept for the KV page map (kvfence/dashboard)
CANARY_PAGES = 4  # cached pages whose digests one canary check re-verifies


class LLMEngine(PDHandover):
    def __init__(
        self,
        config: Config,
        loaded: LoadedModel | None = None,
        runner: ModelRunner | None = None,
        faults: Faults | None = None,
        tenants: Mapping[str, TenantShare] | None = None,
    ) -> None:
        """`config`: resolved (`kvfence.config.resolve`). `runner`: a stand-in for the model runner (the
        simulator's, kvfence/sim); `loaded` then only needs the model config and tokenizer. `faults`: knobs a
        test holds on to; by default they come from `config.engine.faults`. `tenants`: weights and page shares
        from the keys file (engine/fairness.py); ValueError if their guarantees exceed the pool."""
        threads = config.engine.threads
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        dtype = torch_dtype(config)
        loaded = loaded or load_model(config.model.model, dtype=dtype, kernels=config.kernels)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        limit = config.model.context_length
        self.context_length = min(limit or loaded.config.context_length, loaded.config.context_length)
        page_size = config.cache.page_size
        num_pages = config.cache.num_pages(loaded.config.kv_bytes_per_token(dtype.itemsize))
        self.faults = faults if faults is not None else Faults.parse(config.engine.faults)
        self.pool = PagePool(
            num_pages, page_size, faults=self.faults, lease_prefix=config.engine.lease_prefix
        )
        if runner is None:
            model = LlamaForCausalLM.from_weights(  # the tree's compute path, chosen once here
                loaded.config, loaded.weights, dtype, config.model.device, loaded.quantized, config.kernels
            )
            decode_threads = config.engine.decode_threads
            runner = ModelRunner(
                model,
                num_pages,
                page_size,
                dtype,
                config.model.device,
                self.faults,
                config.engine.seed,
                threads=None
                if decode_threads is None
                else (threads or torch.get_num_threads(), decode_threads),
            )
        self.runner = runner
        self.prefix_cache = (
            PrefixCache(self.pool, self.runner.page_digests, self.faults)
            if config.cache.enable_prefix_cache
            else None
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.context_length,
            self.pool,
            loaded.config.eos_token_ids or self.tokenizer.eos_token_ids,
            self.prefix_cache,
            Fairness(tenants or {}, num_pages, enabled=config.scheduler.policy == "vtc"),
        )
        self.limits = Limits(self.context_length, num_pages, page_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.stats = EngineStats()
        # I1 checks and tag stamping. On by default; benchmarks toggle it on one warm engine to measure its cost.
        self.integrity_checks = config.cache.integrity_checks
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._reads: tuple[list[Scheduled], StepReads] | None = None  # this step's I1 arrays (engine thread)
        self._blocked = False  # the last step had requests but could schedule none (engine thread)
        self._aborts: set[RequestId] = set()
        # a long step's tenants (under _lock, None when no step may be interrupted): a request of another tenant
        # sets _interrupt, and the step stops at its next layer (`_interruptible`)
        self._step_tenants: frozenset[str] | None = None
        self._interrupt = threading.Event()
        self._interrupted_by: set[str] = set()  # under _lock: the tenants that stopped the last step
        self._no_interrupts: set[str] = set()  # under _lock: tenants whose last interrupt came to nothing
        # a PD worker's look at its sockets between layers of such a step (one thread: nothing else would see a
        # request arrive): the tenants of the requests that wait there (kvfence/pd/worker.py)
        self.arrivals: Callable[[], list[str]] | None = None
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
            self._maybe_interrupt(tenant)
        return request

    def _maybe_interrupt(self, tenant: str) -> None:
        """Under _lock: stop the running step if it may be interrupted and `tenant` had no work when it began, unless
        the tenant's last interrupt came to nothing (its request was gone by the next step: an abort, a client that
        hung up) and it has had no work scheduled since: else a tenant could stop another's long steps for free,
        again and again (found by a review: 50 of 50 steps stopped, A computed nothing)."""
        if self._step_tenants is None or tenant in self._step_tenants or tenant in self._no_interrupts:
            return
        self._interrupt.set()
        self._interrupted_by.add(tenant)

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
            admit(len(token_ids), params, self.limits, prefill_only, self.scheduler.fairness.cap(tenant))
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
        if params.grammar:
            try:
                request.grammar = self.grammars.start(params.grammar)
            except InvalidSamplingParams:
                with self._lock:
                    self._live_ids.discard(rid)
                    self.stats.count("rejected:invalid")
                raise
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

    def set_tenants(self, tenants: Mapping[str, TenantShare]) -> None:
        """Tenants' weights and page shares from now on (a PD worker gets them from its router at registration);
        the counters carry over. ValueError if their guarantees exceed the pool. Engine thread only."""
        self.scheduler.fairness = self.scheduler.fairness.with_shares(tenants)

    def set_step_threads(self, threads: int) -> None:
        """Torch threads for the next steps, of every kind (a PD worker sharing its host's cores). Engine thread
        only: OpenMP's thread count is per thread."""
        self.runner.threads = (threads, threads)

    # ---- the engine loop (one thread) -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        scheduled = self.scheduler.schedule()
        self._blocked = not scheduled
        self._settle_interrupts(scheduled)
        if not scheduled:
            return outputs
        scheduled, failed = self._verify(scheduled, after_step=False)
        outputs += failed
        scheduled, failed = self._check_writes(scheduled)
        outputs += failed
        if not scheduled:
            return outputs
        self._step_no += 1
        plan = self.scheduler.build_plan(scheduled, self._step_no)
        held = plan.all_pages
        self.pool.hold(held)
        if trace.enabled:  # what each row reads: its block table, the first pages its own writes
            for row in plan.rows:
                trace.emit("read", request_id=row.request_id, pages=[int(p) for p in row.pages],
                           leases=[int(x) for x in row.leases], written=self.pool.pages_for(row.start_pos))  # fmt: skip
        stop: Stop | None = None
        try:
            stop = self._interruptible(plan)
            result = self.runner.run(plan, stop)
            self._stamp(plan, result)
            scheduled, failed = self._verify(scheduled, after_step=True)
            outputs += failed
            if result.nonfinite:  # a NaN or an infinity in a row's logits: no token of it is an answer
                scheduled, failed = self._fail_nonfinite(scheduled, result.nonfinite)
                outputs += failed
        except StepInterrupted:
            self.stats.steps_interrupted += 1
            log.debug("step %d interrupted: a tenant with no work here sent a request", plan.step)
            return outputs
        except Exception:
            # A step that blows up must not wedge the engine: fail the requests it carried (their pages are
            # released under the step's hold, so they stay quarantined until it is dropped below) and go on.
            log.exception("forward step %d failed; failing its %d requests", plan.step, len(scheduled))
            return outputs + [
                self._fail(s.request, "internal_error") for s in scheduled if not s.request.state.terminal
            ]
        finally:
            if stop is not None:
                with self._lock:
                    self._step_tenants = None
            self.pool.unhold(held)
            self._reads = None
        self.stats.steps += 1
        self.stats.tokens_computed += plan.num_tokens
        if result.prompt_logprobs:  # completions' echo, chunk by chunk (no work on an ordinary step)
            for item in scheduled:
                item.request.prompt_logprobs.extend(result.prompt_logprobs.get(item.request.request_id, ()))
        self.scheduler.postprocess(scheduled, result.sampled)
        for out in self.outputs.process(scheduled, result, self.scheduler):
            outputs.append(out)
            if out.finished:
                self._end(self._requests[out.request_id])
        self.stats.preemptions = self.scheduler.num_preemptions
        return outputs + self._canary()

    def _settle_interrupts(self, scheduled: list[Scheduled]) -> None:
        """After the inbox is drained: a tenant that interrupted the last step and has no work now may not
        interrupt again until it has work in a step (`_maybe_interrupt`)."""
        with self._lock:
            if not (self._interrupted_by or self._no_interrupts):
                return
            self._no_interrupts |= self._interrupted_by - self.scheduler.backlogged()
            self._no_interrupts -= {s.request.tenant for s in scheduled}
            self._interrupted_by.clear()

    def _interruptible(self, plan: Plan) -> Stop | None:
        """Whether this step may stop between layers (vtc, `--interrupt-steps`): when it holds more prompt tokens
        than a step holds while several tenants have work (`--prefill-batch-tokens`, the scheduler's contended
        budget): a lone tenant's step, or one the scheduler ran ungated so as not to stand idle. A request of a
        tenant with no work here then stops it (`_maybe_interrupt`), and the next step starts that tenant's
        first piece instead of making it wait for the rest of this one (on 2 cores a 2,048-token step takes
        about a second; docs/fairness.md). Abandoned, the step leaves the scheduler's state as schedule() left
        it: no token is computed or charged, its requests keep their pages and place and run the same tokens
        again (the partial K/V written beyond what they have computed is overwritten before it is read, I1). It
        costs the interrupted tenant at most the time the newcomer's tenant was idle: a tenant that keeps
        arriving after going idle leaves the others the steps they would have had with it busy.
        Returns the runner's `stop` (None: this step runs to its end)."""
        cap = self.config.scheduler.prefill_batch_tokens
        if not (self.config.scheduler.interrupt_steps and self.scheduler.fairness.enabled and cap):
            return None
        if sum(row.num_new_tokens for row in plan.rows if row.num_new_tokens > 1) <= cap:
            return None
        tenants = frozenset(self.scheduler.backlogged())
        with self._lock:
            self._interrupt.clear()
            self._step_tenants = tenants
            for request in self._inbox:  # arrived since the inbox was drained
                self._maybe_interrupt(request.tenant)
        interrupt, arrivals = self._interrupt, self.arrivals
        if arrivals is None:
            return interrupt.is_set

        def stop() -> bool:
            for tenant in arrivals():
                with self._lock:
                    self._maybe_interrupt(tenant)
            return interrupt.is_set()

        return stop

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
        interval = self.config.cache.kv_canary_interval
        if self.prefix_cache is None or interval < 1 or self._step_no % interval:
            return []
        failures = self.prefix_cache.canary(CANARY_PAGES)
        for failure in failures:
            self._remember_failure(failure.as_log(), failure.entry.tenant)
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

    def _fail_nonfinite(
        self, scheduled: list[Scheduled], broken: frozenset[RequestId]
    ) -> tuple[list[Scheduled], list[RequestOutput]]:
        """Fail the requests whose logits were not finite (500 non_finite_logits): the sampler's pick among NaNs
        is an index, not a token the model chose. The step's other requests go on."""
        failed = []
        for s in scheduled:
            if s.request.request_id in broken:
                log.error("request %s: its logits hold a NaN or an infinity at step %d; failing it",
                          s.request.request_id, self._step_no)  # fmt: skip
                failed.append(self._fail(s.request, "non_finite_logits"))
        return [s for s in scheduled if s.request.request_id not in broken], failed

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

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def unready(self) -> str | None:
        """A local engine takes requests whenever its loop runs (AsyncEngine.healthy says that)."""
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def snapshot(self) -> EngineSnapshot:
        """Engine state for metrics; engine thread, between steps."""
        cache = self.prefix_cache
        return EngineSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            pool=self.pool.stats(),
            integrity_checks=self.stats.integrity_checks,
            integrity_failures=self.stats.integrity_failures,
            pages_checked=self.stats.pages_checked,
            outcomes=dict(self.stats.outcomes),
            prefix_cache=cache.stats() if cache is not None else None,
            tenants=self.tenant_snapshots(),
            steps_interrupted=self.stats.steps_interrupted,
        )

    def tenant_snapshots(self) -> dict[str, TenantSnapshot]:
        """Each tenant with a counter or work: pages held, requests running and waiting, its counter."""
        s = self.scheduler
        held = s.held_pages()
        tenants = set(s.fairness.counters) | s.holders()
        return {
            t: TenantSnapshot(
                pages=held.get(t, 0),
                running=sum(1 for r in s.running if r.tenant == t),
                waiting=sum(1 for r in s.waiting if r.tenant == t),
                virtual_tokens=s.fairness.counters.get(t, 0.0),
            )
            for t in sorted(tenants)
        }

    def _page_bytes(self, page: PageId) -> bytes:
        return self.runner.cache.read_page(page)

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
