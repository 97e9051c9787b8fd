"""I5, admission before allocation: the one place that decides whether a request may enter the engine.

Called with token counts only, before a `Request` is queued and before any page is leased. A request that fails
here never holds a page and is never seen by the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.errors import (
    ContextLengthExceeded,
    EmptyPromptError,
    PoolCapacityExceeded,
    TenantCapExceeded,
)
from kvfence.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class Limits:
    context_length: int  # advertised: prompt + max_tokens must fit
    pool_pages: int  # the smallest pool any stage that must hold this request has
    page_size: int


def admit(
    num_prompt_tokens: int,
    params: SamplingParams,
    limits: Limits,
    prefill_only: bool = False,
    max_pages: int | None = None,
) -> None:
    """Raise an `AdmissionError` subclass if the request can never run; return None if it can.
    `prefill_only`: this pool holds only the prompt and the first token (a PD prefill worker). `max_pages`: the
    most its tenant may hold (max_pages in the keys file, engine/fairness.py), None for no cap."""
    if num_prompt_tokens < 1:
        raise EmptyPromptError()
    total = num_prompt_tokens + params.max_tokens
    if total > limits.context_length:
        raise ContextLengthExceeded(num_prompt_tokens, params.max_tokens, limits.context_length)
    # A request whose whole sequence cannot fit the pool would preempt itself forever: refuse it now.
    if prefill_only:
        total = num_prompt_tokens + 1
    num_pages = -(-total // limits.page_size)
    if num_pages > limits.pool_pages:
        raise PoolCapacityExceeded(total, num_pages, limits.pool_pages, limits.page_size)
    # the same for its tenant's cap: it would wait for pages its tenant may never hold
    if max_pages is not None and num_pages > max_pages:
        raise TenantCapExceeded(total, num_pages, max_pages, limits.page_size)
