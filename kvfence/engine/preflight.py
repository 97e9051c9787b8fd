"""I6 at startup: does this node's KV pool hold one full-context request? Decide before anything is allocated.

Boundary: a pure function over numbers (model shape, pool size, page size, dtype). It never allocates the pool;
`CacheOptions.num_pages` (kvfence/config.py) does the sizing math. The caller prints `report.summary()` and either
starts the engine with `report.context_length` or exits when `report.verdict is Verdict.REFUSED`.

Outcomes when the pool is smaller than one full-context request:
  - default: REFUSED, with an explanation and the flags that would change it;
  - `clamp`: CLAMPED, the advertised context drops to what the pool holds, and the summary says so;
  - `allow_undersized` (test/debug): UNDERSIZED_ALLOWED, start anyway; admission (I5) rejects what cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfence.config import Config
from kvfence.model.config import ModelConfig
from kvfence.options import DTYPE_BYTES


class Verdict(Enum):
    OK = "ok"
    CLAMPED = "clamped"
    UNDERSIZED_ALLOWED = "undersized (allowed)"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class PreflightReport:
    model_name: str
    dtype: str
    num_pages: int
    page_size: int
    pool_bytes: int
    model_context_length: int
    requested_context_length: int  # the model's, or lower if the operator asked for less
    context_length: int  # what the server will advertise (lower than requested only when clamped)
    num_full_context_requests: int  # how many requests of `context_length` tokens the pool holds at once
    verdict: Verdict
    reason: str

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_gib(self) -> float:
        return self.pool_bytes / (1 << 30)

    @property
    def can_start(self) -> bool:
        return self.verdict is not Verdict.REFUSED

    def summary(self) -> str:
        return "\n".join(
            [
                "kvfence preflight",
                f"  model           {self.model_name}",
                f"  dtype           {self.dtype}",
                f"  KV pool         {self.num_pages} pages x {self.page_size} tokens = {self.pool_tokens} tokens "
                f"({self.pool_gib:.3f} GiB)",
                f"  context length  {self.context_length} (model {self.model_context_length}, "
                f"requested {self.requested_context_length})",
                f"  full-context requests that fit at once: {self.num_full_context_requests}",
                f"  verdict         {self.verdict.value}: {self.reason}",
            ]
        )


def preflight(
    model: ModelConfig,
    *,
    dtype: str,
    num_pages: int,
    page_size: int,
    context_length: int | None = None,
    clamp: bool = False,
    allow_undersized: bool = False,
) -> PreflightReport:
    """Size check of a pool of `num_pages` x `page_size` tokens against the advertised context length.
    Raises ValueError for sizes that describe no context or no pool."""
    if context_length is not None and context_length < 1:
        raise ValueError(f"context length must be at least 1, got {context_length}")
    if num_pages < 1 or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"need at least one page of a power-of-two size, got {num_pages} x {page_size}")
    requested = model.context_length if context_length is None else min(context_length, model.context_length)
    pool_tokens = num_pages * page_size
    pool_bytes = pool_tokens * model.kv_bytes_per_token(DTYPE_BYTES[dtype])
    fits = num_pages // _pages_for(requested, page_size)
    ctx, verdict = requested, Verdict.OK
    reason = f"the pool holds {fits} full-context request(s) of {requested} tokens"
    if fits < 1:
        ctx, verdict, reason = _undersized(requested, num_pages, page_size, clamp, allow_undersized)
        fits = 1 if verdict is Verdict.CLAMPED else 0
    return PreflightReport(
        model_name=model.name,
        dtype=dtype,
        num_pages=num_pages,
        page_size=page_size,
        pool_bytes=pool_bytes,
        model_context_length=model.context_length,
        requested_context_length=requested,
        context_length=ctx,
        num_full_context_requests=fits,
        verdict=verdict,
        reason=reason,
    )


def preflight_config(model: ModelConfig, config: Config) -> PreflightReport:
    """`preflight` with the numbers a resolved `Config` (a concrete dtype) comes to (no allocation; may raise
    ValueError). `--clamp-context-length` and `--allow-undersized-pool` are its cache options."""
    cache = config.cache
    return preflight(
        model,
        dtype=config.model.dtype,
        num_pages=cache.num_pages(model.kv_bytes_per_token(config.dtype_bytes)),
        page_size=cache.page_size,
        context_length=config.model.context_length,
        clamp=cache.clamp_context_length,
        allow_undersized=cache.allow_undersized_pool,
    )


def _undersized(
    requested: int, num_pages: int, page_size: int, clamp: bool, allow_undersized: bool
) -> tuple[int, Verdict, str]:
    """(advertised context, verdict, reason) for a pool smaller than one full-context request."""
    pool_tokens = num_pages * page_size
    short = (
        f"the KV pool holds {pool_tokens} tokens, less than one full-context request of {requested} tokens "
        f"({_pages_for(requested, page_size)} pages)"
    )
    if clamp:
        return (
            pool_tokens,
            Verdict.CLAMPED,
            f"{short}; context length lowered to {pool_tokens} tokens (--clamp-context-length)",
        )
    if allow_undersized:
        reason = f"{short}; starting anyway (--allow-undersized-pool): longer requests will be rejected"
        return requested, Verdict.UNDERSIZED_ALLOWED, reason
    reason = (
        f"{short}. Refusing to start: give the pool more memory (--kv-pages / --kv-cache-memory), lower "
        f"--context-length, or pass --clamp-context-length to advertise only what the pool holds"
    )
    return requested, Verdict.REFUSED, reason


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
