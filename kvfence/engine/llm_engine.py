"""The engine: admission, scheduling, integrity checks, one forward step, and outputs, in that order.

    step():  drain inbox (adds, aborts) -> schedule -> check reads (I1) -> run -> stamp writes -> check again
             -> postprocess (append tokens, stops) -> detokenize, stop strings -> outputs

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvfence.engine.admission import Limits, admit
from kvfence.engine.config import EngineConfig
from kvfence.engine.errors import InvalidSamplingParams
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import OutputProcessor, RequestOutput
from kvfence.engine.plan import Plan, StepResult
from kvfence.engine.request import Request, RequestState, SamplingParams
from kvfence.engine.scheduler import Scheduled, Scheduler, SchedulerConfig
from kvfence.faults import Faults
from kvfence.ids import RequestId
from kvfence.kv.integrity import ReadSet, Violation, check_reads
from kvfence.kv.pool import PagePool
from kvfence.model.llama import LlamaForCausalLM
from kvfence.model.loader import LoadedModel, load_model

log = logging.getLogger("kvfence.engine")
integrity_log = logging.getLogger("kvfence.integrity")


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    integrity_checks: int = 0  # request-checks performed (one per scheduled request, twice per step)
    pages_checked: int = 0
    integrity_failures: int = 0
    preemptions: int = 0
    integrity_seconds: float = 0.0  # wall time inside checks and stamping, to measure their cost
    outcomes: dict[str, int] = field(
        default_factory=dict
    )  # finished / failed:<code> / aborted / rejected:<code>

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
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
        model = LlamaForCausalLM.from_weights(
            loaded.config, loaded.weights, config.torch_dtype, config.device
        )
        self.runner = ModelRunner(
            model, num_pages, config.page_size, config.torch_dtype, config.device, self.faults, config.seed
        )
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.context_length)
        self.scheduler = Scheduler(
            sched_cfg, self.pool, loaded.config.eos_token_ids or self.tokenizer.eos_token_ids
        )
        self.limits = Limits(self.context_length, num_pages, config.page_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        # I1 checks and tag stamping. On by default; benchmarks toggle it on one warm engine to measure its cost.
        self.integrity_checks = config.integrity_checks
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: set[RequestId] = set()
        self._requests: dict[RequestId, Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._step_no = 0

    # ---- entry points (any thread) ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "anonymous",
    ) -> Request:
        """Admit a request (I5: raises an AdmissionError before anything is allocated) and queue it."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            admit(len(token_ids), params, self.limits)
            if any(not 0 <= t < self.model_config.vocab_size for t in token_ids):
                raise InvalidSamplingParams("prompt", "prompt contains token ids outside the vocabulary")
        except Exception as exc:
            with self._lock:
                self.stats.count(f"rejected:{getattr(exc, 'code', 'invalid')}")
            raise
        rid = RequestId(request_id or f"req-{next(self._ids)}")
        request = Request(rid, token_ids, params, tenant=tenant, arrival=next(self._arrivals))
        with self._lock:
            if rid in self._requests or any(r.request_id == rid for r in self._inbox):
                raise ValueError(f"duplicate request id {rid!r}")
            self._inbox.append(request)
        return request

    def abort(self, request_id: str) -> None:
        """Abort a request at any time; takes effect between steps. Unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.add(RequestId(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.num_unfinished > 0

    # ---- the engine loop (one thread) -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        scheduled, failed = self._verify(scheduled, after_step=False)
        outputs += failed
        if not scheduled:
            return outputs
        self._step_no += 1
        plan = Scheduler.build_plan(scheduled, self._step_no)
        held = plan.all_pages
        self.pool.hold(held)
        try:
            result = self.runner.run(plan)
            self._stamp(plan, result)
            scheduled, failed = self._verify(scheduled, after_step=True)
            outputs += failed
        finally:
            self.pool.unhold(held)
        self.stats.steps += 1
        self.stats.tokens_computed += plan.num_tokens
        self.scheduler.postprocess(scheduled, result.sampled)
        for out in self.outputs.process(scheduled, result, self.scheduler):
            outputs.append(out)
            if out.finished:
                self._end(self._requests[out.request_id])
        self.stats.preemptions = self.scheduler.num_preemptions
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
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
        """Tag every page the runner reports it wrote with the writer's lease (from the write path, I1)."""
        if not self.integrity_checks:
            return
        t0 = time.perf_counter()
        for row in plan.rows:
            pages = result.written_pages[row.request_id]
            first = row.start_pos // self.config.page_size
            self.pool.stamp(pages, row.leases[first : first + len(pages)])
        self.stats.integrity_seconds += time.perf_counter() - t0

    def _verify(
        self, scheduled: list[Scheduled], after_step: bool
    ) -> tuple[list[Scheduled], list[RequestOutput]]:
        """I1: fail every scheduled request whose block table does not match its leases and writes."""
        if not self.integrity_checks:
            return scheduled, []
        t0 = time.perf_counter()
        read_sets = [
            ReadSet(
                s.request.request_id,
                s.request.pages,
                s.request.leases,
                s.request.num_computed_tokens + (s.num_new_tokens if after_step else 0),
            )
            for s in scheduled
        ]
        violations = check_reads(self.pool, read_sets)
        self.stats.integrity_checks += len(read_sets)
        num_pages = sum(len(rs.pages) for rs in read_sets)
        self.stats.pages_checked += num_pages
        for s in scheduled:
            s.request.num_pages_checked += len(s.request.pages)
        self.stats.integrity_seconds += time.perf_counter() - t0
        if not violations:
            return scheduled, []
        return self._fail_integrity(scheduled, violations)

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
            self.stats.integrity_failures += 1
            self.scheduler.finish(s.request, RequestState.FAILED, "error", "kv_integrity_error")
            failed.append(self.outputs.final(s.request))
            self._end(s.request)
        return [s for s in scheduled if s.request.request_id not in bad], failed

    def _end(self, request: Request) -> None:
        outcome = request.state.value if request.error_code is None else f"failed:{request.error_code}"
        self.stats.count(outcome)
        self._requests.pop(request.request_id, None)
        self.outputs.remove(request)

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
