"""One worker's KV page map: its pool page by page, with owners, tenants, transfers and integrity failures.

Boundary: reads an `LLMEngine` (and a PD decode worker's `TransferReceiver`) and changes nothing. It must run on
the engine thread between two steps (`AsyncEngine.run_between_steps`, or a PD worker's own loop): the only
moment when the pool, the requests and the receiver agree with each other. Per-page data is built with numpy in
O(pages) and shipped as base64 little-endian arrays; the Python work is per request, never per page.

Page states (`STATES`; the position is the code in `pages.state`):

    free         on the free list
    leased       leased to one live request
    quarantined  released, waiting until no step or transfer can still touch it (I4)
    sealed       full and read-only (I9); held by any number of one tenant's requests (the prefix cache, I7),
                 or by none: idle in the cache, evictable, counted as free capacity by the pool
    receiving    reserved by a PD transfer whose frames are still arriving (decode side)

State age: the pool keeps no clock (it is on the hot path), so `PageAges` notes when a snapshot first saw each
page in its current state and lease. Ages are exact to one poll interval, and start from the first snapshot.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvfence.engine.request import Request, RequestState
from kvfence.ids import RequestId
from kvfence.kv.pool import PageState

if TYPE_CHECKING:
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.preflight import PreflightReport
    from kvfence.pd.receiver import TransferReceiver

SCHEMA_VERSION = 1
STATES = ("free", "leased", "quarantined", "sealed", "receiving")
FREE, LEASED, QUARANTINED, SEALED, RECEIVING = range(len(STATES))
PREVIEW_TOKENS = 24  # how much of a prompt the map shows (admin only, like everything in it)
PREVIEW_CHARS = 80


def _from_pool() -> npt.NDArray[np.uint8]:
    """Pool state code -> map state. A state the pool does not name here shows as leased."""
    by_name = {"FREE": FREE, "LEASED": LEASED, "QUARANTINED": QUARANTINED, "SEALED": SEALED}
    table = np.full(max(PageState) + 1, LEASED, dtype=np.uint8)
    for state in PageState:
        table[state] = by_name.get(state.name, LEASED)
    return table


_FROM_POOL = _from_pool()
_PHASES = {
    RequestState.WAITING: "waiting",
    RequestState.AWAITING_KV: "receiving KV",
    RequestState.TRANSFERRING: "sending KV",
}


def phase(request: Request) -> str:
    if request.state is RequestState.RUNNING:
        return "prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decode"
    return _PHASES.get(request.state) or str(request.state.value)


class PageAges:
    """When each page entered its current (state, lease): updated by diffing against the last snapshot."""

    def __init__(self, num_pages: int) -> None:
        self.since: npt.NDArray[np.float64] = np.zeros(num_pages)
        self.state: npt.NDArray[np.uint8] | None = None
        self.owner: npt.NDArray[np.uint64] | None = None
        self.watching_since: float | None = None

    def ages_ms(
        self, state: npt.NDArray[np.uint8], owner: npt.NDArray[np.uint64], now: float
    ) -> npt.NDArray[np.uint32]:
        if self.state is None or self.owner is None:
            self.since[:] = now
            self.watching_since = now
        else:
            self.since[(state != self.state) | (owner != self.owner)] = now
        self.state, self.owner = state.copy(), owner.copy()
        return np.minimum((now - self.since) * 1000.0, np.iinfo(np.uint32).max).astype(np.uint32)


class KvMapper:
    """Builds one worker's snapshot. Keeps only what must outlive a snapshot: page ages and prompt previews."""

    def __init__(
        self,
        engine: LLMEngine,
        name: str,
        role: str,
        preflight: PreflightReport | None = None,
        receiver: TransferReceiver | None = None,
    ) -> None:
        self.engine, self.name, self.role = engine, name, role
        self.preflight, self.receiver = preflight, receiver
        self.ages = PageAges(engine.pool.num_pages)
        self._previews: dict[RequestId, str] = {}

    def snapshot(self) -> dict[str, Any]:
        """The worker's map as JSON-ready data. Engine thread only, between steps."""
        t0 = time.perf_counter()
        pool, requests = self.engine.pool, self.engine.live_requests()
        index = {r.request_id: i for i, r in enumerate(requests)}
        state = _FROM_POOL[pool.state]
        request_of, holders = _holders(requests, pool.num_pages)
        transfers = self._transfers(index, state, request_of)
        owner, tag = pool.owner.copy(), pool.tag.copy()
        ages = self.ages.ages_ms(state, owner, time.time())
        return {
            "name": self.name,
            "role": self.role,
            "num_pages": pool.num_pages,
            "page_size": pool.page_size,
            "counts": dict(zip(STATES, np.bincount(state, minlength=len(STATES)).tolist(), strict=True)),
            "num_idle": int(np.count_nonzero((state == SEALED) & (holders == 0))),  # sealed, evictable
            "pages": {
                "state": _b64(state, "u1"),
                "request": _b64(request_of, "<i4"),
                "owner": _b64(owner, "<u8"),
                "tag": _b64(tag, "<u8"),
                "age_ms": _b64(ages, "<u4"),
                "holders": _b64(holders, "<u2"),
            },
            "watching_since": self.ages.watching_since,
            "requests": self._requests(requests),
            "transfers": transfers,
            "receiver": self._receiver_stats(),
            "integrity_failures": list(self.engine.recent_integrity_failures),
            "preflight": None if self.preflight is None else preflight_json(self.preflight),
            "stats": self._stats(),
            "snapshot_ms": round((time.perf_counter() - t0) * 1000, 3),
        }

    def _requests(self, requests: list[Request]) -> list[dict[str, Any]]:
        previews = {r.request_id: self._previews.get(r.request_id) or self._preview(r) for r in requests}
        self._previews = previews  # forget the ended ones
        return [
            {
                "id": r.request_id,
                "tenant": r.tenant,
                "phase": phase(r),
                "num_pages": len(r.pages),
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "preview": previews[r.request_id],
            }
            for r in requests
        ]

    def _preview(self, request: Request) -> str:
        text = self.engine.tokenizer.decode(request.prompt_token_ids[:PREVIEW_TOKENS])
        cut = len(request.prompt_token_ids) > PREVIEW_TOKENS or len(text) > PREVIEW_CHARS
        return text[:PREVIEW_CHARS] + ("…" if cut else "")

    def _transfers(
        self,
        index: dict[RequestId, int],
        state: npt.NDArray[np.uint8],
        request_of: npt.NDArray[np.int32],
    ) -> list[dict[str, Any]]:
        """Marks the pages of transfers in flight as receiving (in place) and lists the transfers."""
        if self.receiver is None:
            return []
        listed = []
        for t in self.receiver.in_flight():
            pages = np.fromiter((x.page for x in t.leases), dtype=np.int64, count=len(t.leases))
            state[pages[state[pages] == LEASED]] = RECEIVING
            request_of[pages] = index.get(t.request_id, -1)
            listed.append(
                {
                    "transfer_id": f"{t.transfer_id:#x}",
                    "request_id": t.request_id,
                    "received": t.num_written,
                    "expected": len(t.leases),
                }
            )
        return listed

    def _receiver_stats(self) -> dict[str, Any] | None:
        if self.receiver is None:
            return None
        s = self.receiver.stats
        return {"applied": s.applied, "completed": s.completed, "dropped": s.dropped, "failed": s.failed}

    def _stats(self) -> dict[str, int]:
        s = self.engine.stats
        return {
            "steps": s.steps,
            "integrity_checks": s.integrity_checks,
            "pages_checked": s.pages_checked,
            "integrity_failures": s.integrity_failures,
        }


def _holders(requests: list[Request], num_pages: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint16]]:
    """Per page: the index (into `requests`) of a request holding it (-1 for none), and how many hold it (more
    than one only for a sealed page; a leased page in two block tables is what I1's owner check catches)."""
    counts = np.fromiter((len(r.pages) for r in requests), dtype=np.int64, count=len(requests))
    pages = np.fromiter((p for r in requests for p in r.pages), dtype=np.int64, count=int(counts.sum()))
    holder = np.repeat(np.arange(len(requests), dtype=np.int32), counts)
    request_of = np.full(num_pages, -1, dtype=np.int32)
    request_of[pages] = holder
    refs = np.bincount(pages, minlength=num_pages)
    return request_of, np.minimum(refs, np.iinfo(np.uint16).max).astype(np.uint16)


def preflight_json(report: PreflightReport) -> dict[str, Any]:
    return {
        "verdict": report.verdict.value,
        "can_start": report.can_start,
        "reason": report.reason,
        "model": report.model_name,
        "dtype": report.dtype,
        "num_pages": report.num_pages,
        "page_size": report.page_size,
        "context_length": report.context_length,
        "model_context_length": report.model_context_length,
        "num_full_context_requests": report.num_full_context_requests,
    }


def _b64(values: npt.NDArray[Any], dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


_DTYPES = {"state": "u1", "request": "<i4", "owner": "<u8", "tag": "<u8", "age_ms": "<u4", "holders": "<u2"}


def decode_pages(worker: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
    """The per-page arrays of one worker's snapshot, back from base64 (for `kvfence top` and tests)."""
    return {k: np.frombuffer(base64.b64decode(worker["pages"][k]), dtype=d) for k, d in _DTYPES.items()}
