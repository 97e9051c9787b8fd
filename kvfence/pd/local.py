"""An in-process prefill/decode pair: two engines, two pools, the real transfer state machines between them.

This is the reference wiring of the PD data path without sockets: the prefill engine runs prompts to their first
token and hands the pages over; a `TransferSender` streams them as frames; the decode side's
`TransferReceiver` validates and applies each frame into the decode engine's own pool; on `Ready` the decode
engine adopts the pages and decodes. The ZeroMQ workers run the same calls, one process per role. Everything
here runs on one thread, which gives the receiver's atomicity contract (validate + write + revoke) for free.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfence.config import PDOptions
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request, SamplingParams
from kvfence.ids import RequestId
from kvfence.kv.integrity import Violation
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, FrameAck, PageFrame, TransferId
from kvfence.pd.receiver import Failed, Ready, TransferReceiver, failure_code
from kvfence.pd.sender import ReleaseLocal, SendAbort, SendFinal, SendFrames, TransferSender


def layout_fingerprint(engine: LLMEngine) -> str:
    """What both ends of a transfer must agree on to read each other's pages: the model, the KV shape, dtype, page
    size, and the rotation the keys were stored with (RoPE base and scaling: keys are kept rotated, so a worker
    scaling differently would attend over another worker's keys at the wrong positions)."""
    c = engine.model_config
    rope = f"rope{c.rope_theta:g}"
    if c.rope_freq_factors is not None:
        rope += "s" + hashlib.sha256(repr(c.rope_freq_factors).encode()).hexdigest()[:12]
    return (
        f"{c.name}/{c.architecture}/L{c.num_layers}/kv{c.num_kv_heads}x{c.head_dim}/{rope}/"
        f"{engine.config.model.dtype}/ps{engine.config.cache.page_size}"
    )


@dataclass
class _Transfer:
    request: Request  # the prefill engine's request (holds the pages being sent)
    sender: TransferSender


@dataclass
class LocalPDPair:
    prefill: LLMEngine
    decode: LLMEngine
    window: int = field(default_factory=lambda: PDOptions().transfer_window)  # the default is config.py's

    def __post_init__(self) -> None:
        layout = layout_fingerprint(self.decode)
        assert layout == layout_fingerprint(self.prefill), "prefill and decode must share the KV layout"
        cache = self.decode.runner.cache
        self.receiver = TransferReceiver(
            self.decode.pool,
            layout,
            cache.page_bytes(),
            cache.write_page,
            checks=self.decode.integrity_checks,  # as DecodeWorker: the debug flag turns both layers off
            faults=self.decode.faults,
        )
        self._transfers: dict[TransferId, _Transfer] = {}
        self._ids = itertools.count(1)
        self._first_logprobs: dict[RequestId, tuple[float, tuple[tuple[int, float], ...]]] = {}
        self.failed: list[RequestOutput] = []

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, tenant: str = "anonymous"
    ) -> None:
        """Admission on both sides first (I5), then the prefill starts. `tenant` scopes the prefill's prefix
        cache (I7)."""
        self.decode.expect_transfer(prompt_ids, params, request_id, tenant)
        self.prefill.add_request(prompt_ids, params, request_id=request_id, tenant=tenant, prefill_only=True)

    def step(self) -> list[RequestOutput]:
        if self.prefill.has_unfinished():
            for out in self.prefill.step():
                if out.logprobs and not out.finished:
                    self._first_logprobs[out.request_id] = out.logprobs[-1]
            for request in self.prefill.take_handoffs():
                self._start_transfer(request)
        outputs = self.failed + self.decode.step()
        self.failed = []
        return outputs

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    def _start_transfer(self, request: Request) -> None:
        tid = TransferId(next(self._ids))
        ticket = self.receiver.reserve(tid, request.request_id, len(request.pages))
        num_local = 1 if self.prefill.faults.fire("placeholder_prefill") else len(request.pages)
        layout = layout_fingerprint(self.prefill)
        lp = self._first_logprobs.pop(request.request_id, None)
        checks = self.prefill.integrity_checks
        sender = TransferSender(
            ticket, num_local, layout, self.window, request.token_ids[-1], lp, checks=checks
        )
        self._transfers[tid] = _Transfer(request, sender)
        self._run(tid, sender.start())

    def _run(self, tid: TransferId, actions: list) -> None:  # type: ignore[type-arg]
        """Deliver sender actions to the receiver at once (an in-memory, in-order, lossless transport)."""
        transfer = self._transfers[tid]
        for action in actions:
            if isinstance(action, SendFrames):
                payloads = self.prefill.read_for_transfer(transfer.request.request_id, action.indices)
                if isinstance(payloads, Violation):
                    self._run(tid, transfer.sender.fail(f"kv_integrity_error: page {payloads.page}"))
                    return
                for i, payload in zip(action.indices, payloads, strict=True):
                    self._deliver_frame(tid, transfer.sender.frame(i, payload))
            elif isinstance(action, SendFinal):
                self._deliver_final(tid, action.final)
            elif isinstance(action, SendAbort) and not isinstance(action.abort, AbortAck):
                reason = action.abort.reason
                self._fail(tid, self.receiver.revoke(tid, reason), failure_code(reason))
            elif isinstance(action, ReleaseLocal):
                self.prefill.finish_transfer(transfer.request.request_id)

    def _deliver_frame(self, tid: TransferId, frame: PageFrame) -> None:
        verdict = self.receiver.on_frame(frame)
        if isinstance(verdict, Failed):
            self._fail(tid, verdict, failure_code(verdict.reason))
        elif verdict.ack is not None:
            self._run(tid, self._transfers[tid].sender.on_ack(FrameAck(tid, verdict.ack.index)))

    def _deliver_final(self, tid: TransferId, final: FinalFrame) -> None:
        result = self.receiver.on_final(final)
        self._transfers.pop(tid)
        if isinstance(result, Ready):
            self.decode.complete_transfer(
                result.request_id, result.leases, result.first_token, result.first_logprobs
            )
        elif isinstance(result, Failed):
            self._fail(tid, result, failure_code(result.reason))

    def _fail(self, tid: TransferId, result: Failed | None, code: str) -> None:
        if result is not None:
            out = self.decode.fail_transfer(RequestId(result.request_id), code)
            if out is not None:
                self.failed.append(out)
        transfer = self._transfers.get(tid)
        if transfer is not None:
            actions = transfer.sender.on_abort(Abort(tid, code))
            self._run(tid, [a for a in actions if isinstance(a, ReleaseLocal)])
            self._transfers.pop(tid, None)

    def check_integrity(self) -> None:
        self.prefill.check_integrity()
        self.decode.check_integrity(other_holders=self.receiver.reserved_leases())
        self.receiver.check_integrity()
