"""A model runner for the simulator: no model, but K/V that says whose it is.

Every token slot of the KV pool holds a 16-byte record: (key of the request that wrote it, position + 1, token).
A request's key is a hash of its request id, so a request's K/V is the same bytes whether prefill or decode
wrote it, and a page frame carries those records across a transfer unchanged. On every step the runner reads
the slots a real attention kernel would read (positions [0, start_pos) of the row's block table) and checks
each record against the reader: the *provenance oracle*. A foreign or stale record is recorded as a
`ForeignRead`, independently of the engine's own I1 check, and the sampled token is poisoned so that the
damage also shows in the output. Tokens are a pure function of (request, position): the simulator knows the
exact output every request must produce.

Everything the engine and the PD code call on a runner is here: `run(plan, stop)`, `cache.read_page/write_page/
page_bytes/page_digest`, `page_digests`, and the `drop_write` fault knob.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvfence.engine.plan import Plan, StepInterrupted, StepResult, Stop
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId

WORDS = 4  # uint32 per slot: key low, key high, position + 1, token
POISON = 1  # the token a runner emits after a foreign read (never produced otherwise)


def request_key(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") or 1


def expected_token(request_id: str, position: int, vocab_size: int) -> int:
    """The token a clean run samples after `position` tokens of context: 3.. vocab-1 (0-2 are special)."""
    h = hashlib.blake2b(f"{request_id}/{position}".encode(), digest_size=4).digest()
    return 3 + int.from_bytes(h, "little") % (vocab_size - 3)


@dataclass(frozen=True, slots=True)
class ForeignRead:
    request_id: RequestId
    page: PageId
    position: int
    found_key: int
    found_position: int  # 0: the slot was never written

    def __str__(self) -> str:
        what = (
            "an unwritten slot"
            if self.found_position == 0
            else f"key {self.found_key:#x} pos {self.found_position - 1}"
        )
        return f"request {self.request_id} read {what} at position {self.position} (page {self.page})"


class ProvenanceKV:
    """The KV pool: [pages + 1 scratch, page_size, WORDS] uint32."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.data: npt.NDArray[np.uint32] = np.zeros((num_pages + 1, page_size, WORDS), dtype=np.uint32)

    def page_bytes(self) -> int:
        return self.page_size * WORDS * 4

    def read_page(self, page: int) -> bytes:
        return bytes(self.data[page].tobytes())

    def write_page(self, page: int, payload: bytes) -> None:
        self.data[page] = np.frombuffer(payload, dtype=np.uint32).reshape(self.page_size, WORDS)

    def page_digest(self, page: int) -> int:
        return xxhash.xxh3_64_intdigest(self.data[page].tobytes())


class ProvenanceRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int, faults: Faults | None = None) -> None:
        self.cache = ProvenanceKV(num_pages, page_size)
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.faults = faults or Faults()
        self._sink = num_pages  # the scratch page: where a dropped write goes
        self.foreign_reads: list[ForeignRead] = []

    def page_digests(self, pages: Sequence[PageId]) -> list[int]:
        return [self.cache.page_digest(p) for p in pages]

    def run(self, plan: Plan, stop: Stop | None = None) -> StepResult:
        """`stop`: asked after each row's writes (a real step stops between layers, its writes so far landed);
        yes raises StepInterrupted, the rows written so far left in their pages, unreported."""
        S, kv = self.page_size, self.cache.data
        sampled: dict[RequestId, int] = {}
        written: list[tuple[int, ...]] = []
        dropped = False
        for row in plan.rows:
            key = request_key(row.request_id)
            poisoned = self._check_reads(row.request_id, key, row.pages, row.start_pos)
            first, last = row.start_pos // S, (row.context_len - 1) // S
            indices = tuple(range(first, last + 1))
            full_page = row.start_pos % S == 0 and row.num_new_tokens > S
            drop = not dropped and full_page and self.faults.fire("drop_write")
            dropped |= drop
            for offset, token in enumerate(row.token_ids):
                pos = row.start_pos + offset
                page = self._sink if drop and pos // S == first else int(row.pages[pos // S])
                kv[page, pos % S] = (key & 0xFFFFFFFF, key >> 32, pos + 1, token)
            written.append(indices[1:] if drop else indices)
            if row.sample:
                token = expected_token(row.request_id, row.context_len, self.vocab_size)
                sampled[row.request_id] = POISON if poisoned else token
            if stop is not None and stop():
                raise StepInterrupted
        return StepResult(sampled=sampled, written=tuple(written))

    def _check_reads(self, rid: RequestId, key: int, pages: Sequence[PageId], num_cached: int) -> bool:
        """The oracle: every slot a kernel reads for this row holds this request's record for that position."""
        if num_cached == 0:
            return False
        S = self.page_size
        num_pages = (num_cached + S - 1) // S
        block = self.cache.data[np.asarray(pages[:num_pages], dtype=np.int64)].reshape(-1, WORDS)[:num_cached]
        positions = np.arange(1, num_cached + 1, dtype=np.uint32)
        good = (block[:, 0] == (key & 0xFFFFFFFF)) & (block[:, 1] == (key >> 32)) & (block[:, 2] == positions)
        if good.all():
            return False
        pos = int(np.flatnonzero(~good)[0])
        rec = block[pos]
        found_key = int(rec[0]) | (int(rec[1]) << 32)
        self.foreign_reads.append(ForeignRead(rid, pages[pos // S], pos, found_key, int(rec[2])))
        return True
