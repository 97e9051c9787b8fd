"""The frozen hand-off from scheduler to model runner: which tokens to run for which request, and where their
K/V lives. Plain data; the runner turns it into tensors and returns sampled token ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfence.engine.request import SamplingParams
from kvfence.ids import LeaseId, PageId, RequestId


@dataclass(frozen=True, slots=True)
class PlanRow:
    request_id: RequestId
    token_ids: tuple[int, ...]  # the new tokens to run this step (one for decode, a chunk for prefill)
    start_pos: int  # position of token_ids[0]; K/V of positions [0, start_pos) are already cached
    pages: tuple[PageId, ...]  # block table covering positions [0, start_pos + len(token_ids))
    leases: tuple[LeaseId, ...]  # the request's lease on each page, for stamping what the step writes
    sample: bool  # the chunk ends at the last known token, so the step produces the next one
    params: SamplingParams
    num_generated: int  # output tokens so far; with a seed, makes sampling independent of batching
    history: tuple[int, ...] = ()  # prompt + output so far, only for rows whose penalties read it
    banned: tuple[int, ...] = ()  # token ids it may not sample now (EOS and stop ids before min_tokens)
    allowed: Any = (
        None  # structured output: the tokens its grammar allows next, packed (GrammarState.bitmask)
    )
    # prompt logprobs: the prompt tokens that follow chunk positions prompt_offset, prompt_offset + 1, ...
    prompt_targets: tuple[int, ...] = ()
    prompt_offset: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Plan:
    rows: tuple[PlanRow, ...]
    step: int

    @property
    def num_tokens(self) -> int:
        return sum(row.num_new_tokens for row in self.rows)

    @property
    def all_pages(self) -> list[PageId]:
        return [p for row in self.rows for p in row.pages]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the runner did: the token sampled for each sampling row, and which pages each row actually wrote."""

    sampled: dict[RequestId, int]
    written: tuple[tuple[int, ...], ...]  # per plan row: block-table indices of the pages it actually wrote
    logprobs: dict[RequestId, tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # per row with prompt_targets: one (logprob, top-k) entry per target, in order
    prompt_logprobs: dict[RequestId, tuple[tuple[float, tuple[tuple[int, float], ...]], ...]] | None = None
    # sampling rows whose logits held a NaN or +inf: their requests fail (non_finite_logits), nothing is emitted
    nonfinite: frozenset[RequestId] = frozenset()


class StepInterrupted(Exception):
    """Raised by a runner whose `stop` said yes between two layers: the step is abandoned, nothing of it is
    stamped or emitted, and its requests run the same tokens again in a later step. What it wrote before
    stopping lies in pages its requests own, beyond what they have computed, and is written over before anything
    reads it (engine/llm_engine.py, `_interruptible`)."""


Stop = Callable[[], bool]  # asked between layers of a step that may be interrupted
