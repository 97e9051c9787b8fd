"""Messages of the KV transfer protocol (../../docs/protocol.md). Frozen plain data with a schema version.

decode  --Ticket-->      prefill     pages reserved for a transfer: (transfer id, page ids, lease ids)
prefill --PageFrame-->   decode      one page of K/V for (transfer id, index, page id, lease id)
decode  --FrameAck-->    prefill     frame `index` was applied (or was a duplicate of an applied one)
prefill --FinalFrame-->  decode      page count + digest over all pages in logical order, first token
either  --Abort-->       the other   stop: the sender of Abort no longer needs the transfer
prefill --AbortAck-->    decode      nothing more for this transfer is in flight from prefill
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from kvfence.ids import LeaseId, PageId, RequestId

SCHEMA_VERSION = 1

TransferId = NewType("TransferId", int)


@dataclass(frozen=True, slots=True)
class Ticket:
    transfer_id: TransferId
    request_id: RequestId
    page_ids: tuple[PageId, ...]
    lease_ids: tuple[LeaseId, ...]
    layout: str  # fingerprint of the KV layout (model, dtype, page size, heads); both sides must agree
    version: int = SCHEMA_VERSION

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


@dataclass(frozen=True, slots=True)
class PageFrame:
    transfer_id: TransferId
    index: int  # logical position of the page in the request's block table
    page_id: PageId  # the receiver's page, from the ticket
    lease_id: LeaseId  # the receiver's lease on that page, from the ticket
    payload: bytes
    version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class FrameAck:
    transfer_id: TransferId
    index: int
    version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class FinalFrame:
    transfer_id: TransferId
    num_pages: int
    digest: bytes
    first_token: int  # the token prefill sampled after the prompt; decode continues from it
    # its logprob and top-k alternatives, when the request asked for logprobs
    first_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None
    version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Abort:
    transfer_id: TransferId
    reason: str
    version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class AbortAck:
    transfer_id: TransferId
    version: int = SCHEMA_VERSION


Message = Ticket | PageFrame | FrameAck | FinalFrame | Abort | AbortAck
