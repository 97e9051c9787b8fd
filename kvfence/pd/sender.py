"""Prefill side of the KV transfer: a bounded window of page frames, then the final frame with count and digest.
Sans-IO: the caller turns `SendFrames` into `frame(index, payload)` calls and moves the resulting messages.

    start -> SENDING --ack of the last frame--> DONE (SendFinal, ReleaseLocal)
                |--abort (either side) or a ticket that does not match our pages--> ABORTED (AbortAck, ReleaseLocal)

The prefill keeps its own pages until `ReleaseLocal`: with a copying transport every frame handed to it is
complete when `frame()` returns; a zero-copy transport must delay `ReleaseLocal` until its buffers are released.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfence.pd.digest import page_digest, transfer_digest
from kvfence.pd.messages import Abort, AbortAck, FinalFrame, FrameAck, PageFrame, Ticket


@dataclass(frozen=True, slots=True)
class SendFrames:
    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendFinal:
    final: FinalFrame


@dataclass(frozen=True, slots=True)
class SendAbort:
    abort: Abort | AbortAck


@dataclass(frozen=True, slots=True)
class ReleaseLocal:
    """Nothing will read the prefill's pages for this transfer again: release them."""


Action = SendFrames | SendFinal | SendAbort | ReleaseLocal


class SenderState(Enum):
    SENDING = "sending"
    DONE = "done"
    ABORTED = "aborted"


class TransferSender:
    def __init__(
        self,
        ticket: Ticket,
        num_local_pages: int,
        layout: str,
        window: int,
        first_token: int = 0,
        first_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None,
        checks: bool = True,
    ) -> None:
        assert window >= 1
        self.ticket = ticket
        self.first_token = first_token  # sampled by prefill after the prompt; travels in the final frame
        self.first_logprobs = first_logprobs
        self.window = window
        self.state = SenderState.SENDING
        self._local_pages = num_local_pages
        self._layout = layout
        # Debug/test only (--no-integrity-checks): no page-count check; send the pages we have and say "done",
        # which is the 2026 incident's sender when the prefill computed fewer pages than decode reserved.
        self.checks = checks
        self._num_pages = ticket.num_pages if checks else min(ticket.num_pages, num_local_pages)
        self._next = 0  # next index to send
        self._acked = [False] * self._num_pages
        self._digests: list[bytes | None] = [None] * self._num_pages

    def start(self) -> list[Action]:
        # I3 starts here: the ticket must reserve exactly the pages we computed, in a layout we both share.
        if self.ticket.layout != self._layout:
            return self._abort("layout_mismatch", notify=True)
        if self.checks and self.ticket.num_pages != self._local_pages:
            return self._abort(f"page_count_mismatch: ticket {self.ticket.num_pages}, computed {self._local_pages}",
                               notify=True)  # fmt: skip
        return self._fill_window()

    def frame(self, index: int, payload: bytes) -> PageFrame:
        """Build the frame for `index` (as asked by SendFrames) and record its digest."""
        assert self.state is SenderState.SENDING and index < self._next
        self._digests[index] = page_digest(payload)
        t = self.ticket
        return PageFrame(t.transfer_id, index, t.page_ids[index], t.lease_ids[index], payload)

    def on_ack(self, ack: FrameAck) -> list[Action]:
        if (
            ack.transfer_id != self.ticket.transfer_id
            or self.state is not SenderState.SENDING
            or not 0 <= ack.index < self._next
            or self._acked[ack.index]
        ):
            return []  # another transfer's, late, bogus or repeated: nothing changes
        self._acked[ack.index] = True
        if all(self._acked):
            self.state = SenderState.DONE
            digest = transfer_digest(d for d in self._digests if d is not None)
            return [
                SendFinal(
                    FinalFrame(
                        self.ticket.transfer_id,
                        self._num_pages,
                        digest,
                        self.first_token,
                        self.first_logprobs,
                    )
                ),
                ReleaseLocal(),
            ]
        return self._fill_window()

    def on_abort(self, abort: Abort) -> list[Action]:
        """The receiver (or router) gave up: stop, confirm nothing more is in flight, release our pages."""
        if abort.transfer_id != self.ticket.transfer_id:
            return []
        if self.state is not SenderState.SENDING:
            return [SendAbort(AbortAck(self.ticket.transfer_id))]
        return self._abort(abort.reason, notify=False)

    def fail(self, reason: str) -> list[Action]:
        """A local failure (prefill error, shutdown): tell the receiver and release."""
        if self.state is not SenderState.SENDING:
            return []
        return self._abort(reason, notify=True)

    def _fill_window(self) -> list[Action]:
        in_flight = self._next - sum(self._acked[: self._next])
        room = min(self.window - in_flight, self._num_pages - self._next)
        if room <= 0:
            return []
        indices = tuple(range(self._next, self._next + room))
        self._next += room
        return [SendFrames(indices)]

    def _abort(self, reason: str, notify: bool) -> list[Action]:
        self.state = SenderState.ABORTED
        tid = self.ticket.transfer_id
        message: Abort | AbortAck = Abort(tid, reason) if notify else AbortAck(tid)
        return [SendAbort(message), ReleaseLocal()]
