"""Requests: sampling parameters, the lifecycle state machine, and per-request KV bookkeeping.

Lifecycle (legal transitions in `TRANSITIONS`; anything else is a bug and raises):

    NEW --admit--> WAITING --schedule--> RUNNING --> FINISHED
     |               ^  |                  |  |
     |               |  +--> AWAITING_KV --+  +--> TRANSFERRING --> FINISHED      (PD: decode / prefill side)
     |               +---- preempt --------+
     +--> REJECTED  (terminal; never holds a page)
    any live state --> FAILED (integrity or internal error) | ABORTED (client, timeout)

Pages are held as parallel lists `pages` / `leases`; index i covers token positions [i*P, (i+1)*P). Pages taken
from the prefix cache sit in the same lists under their shared (seal) lease (kv/prefix_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvfence.engine.errors import InvalidSamplingParams
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.kv.pool import Lease


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled token)
    # logprob of every prompt token after the first, with this many alternatives (completions' echo); such a
    # request reads nothing from the prefix cache: every prompt position has to run for its logits
    prompt_logprobs: int | None = None
    # logit processors (kvfence/model/sampler.py), applied to greedy and sampled rows alike, as OpenAI/vLLM do:
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = (
        1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    )
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (sampled rows)
    min_tokens: int = 0  # no EOS or stop token id before this many output tokens
    # not sampling, but per request and carried with it to PD workers: a sub-scope of the tenant's prefix
    # cache (vLLM's cache_salt); requests share cached pages only with the same tenant and the same salt
    cache_salt: str = ""
    grammar: str = ""  # structured output: an llguidance grammar (kvfence/engine/grammar.py); "" for none

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def needs_history(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParams("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidSamplingParams(
                "temperature", f"temperature must be in [0, 2], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidSamplingParams("top_k", f"top_k must be at least 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidSamplingParams("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidSamplingParams(
                "logprobs", f"prompt logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidSamplingParams(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidSamplingParams(
                "repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}",
            )
        if self.grammar and self.ignore_eos:
            raise InvalidSamplingParams(
                "ignore_eos", "ignore_eos cannot be combined with a structured output"
            )
        if self.grammar and self.min_tokens:  # a grammar that ends sooner would leave no token allowed
            raise InvalidSamplingParams(
                "min_tokens",
                "min_tokens cannot be combined with a structured output (the grammar says where it ends)",
            )
        if len(self.logit_bias) > 300 or any(not -100.0 <= b <= 100.0 or t < 0 for t, b in self.logit_bias):
            raise InvalidSamplingParams(
                "logit_bias", "logit_bias maps at most 300 token ids to biases in [-100, 100]"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class RequestState(Enum):
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_KV = "awaiting_kv"  # PD decode side: pages reserved, KV transfer in progress
    TRANSFERRING = "transferring"  # PD prefill side: KV computed, frames being sent
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {RequestState.FINISHED, RequestState.FAILED, RequestState.ABORTED, RequestState.REJECTED}
_ENDS = {RequestState.FAILED, RequestState.ABORTED}
S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.NEW: frozenset({S.WAITING, S.REJECTED}),
    S.WAITING: frozenset({S.RUNNING, S.AWAITING_KV} | _ENDS),
    S.RUNNING: frozenset({S.WAITING, S.TRANSFERRING, S.FINISHED} | _ENDS),
    S.AWAITING_KV: frozenset({S.RUNNING} | _ENDS),
    S.TRANSFERRING: frozenset({S.FINISHED} | _ENDS),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
    S.ABORTED: frozenset(),
    S.REJECTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(eq=False, slots=True)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "anonymous"
    arrival: int = 0  # admission order
    state: RequestState = RequestState.NEW
    token_ids: list[int] = field(default_factory=list)  # prompt + output, the sequence the KV cache covers
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's pages
    pages: list[PageId] = field(default_factory=list)
    leases: list[LeaseId] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error_code: str | None = None
    num_preemptions: int = 0
    num_pages_checked: int = 0  # pages verified by I1 checks over the request's life
    prefill_only: bool = False  # PD prefill side: stop after the first token and hand the pages to a transfer
    # PD decode side: logprobs of the first token (sampled by prefill), emitted with the first output
    pending_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    # prefix cache (kv/prefix_cache.py): off for PD decode requests, whose prompt K/V arrives by transfer
    cacheable: bool = True
    cache_scope: str | None = None  # the tenant, fixed at the first lookup
    page_keys: list[bytes] = field(default_factory=list)  # hash chain over the full pages of token_ids
    num_sealed_pages: int = 0  # pages [0, n) of the block table are sealed (shared or own), or passed over
    num_cached_tokens: int = 0  # tokens whose K/V came from the cache when the prefill last started
    grammar: Any = None  # its GrammarState (kvfence/engine/grammar.py) when params.grammar is set
    # params.prompt_logprobs: entry i is prompt token i + 1's (the first token has none), filled as the
    # prefill's chunks run; a recompute after preemption does not add them again
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.cacheable = False  # a cached prefix has no logits

    def transition(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"request {self.request_id}: {self.state.name} -> {new.name} is not legal"
            )
        self.state = new

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def holds_pages(self) -> bool:
        return bool(self.pages)

    def add_leases(self, leases: list[Lease]) -> None:
        assert self.state in (RequestState.WAITING, RequestState.RUNNING, RequestState.AWAITING_KV), (
            self.state
        )
        self.pages.extend(lease.page for lease in leases)
        self.leases.extend(lease.lease for lease in leases)

    def take_leases(self) -> list[Lease]:
        """Hand all page leases back to the caller (who releases them) and forget them."""
        leases = [Lease(p, x) for p, x in zip(self.pages, self.leases, strict=True)]
        self.pages, self.leases = [], []
        return leases
