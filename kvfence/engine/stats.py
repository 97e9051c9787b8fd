"""What an engine counts (`EngineStats`) and what it reports between steps (`EngineSnapshot`, for /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.kv.pool import PoolStats
from kvfence.kv.prefix_cache import PrefixCacheStats


@dataclass
class EngineStats:
    steps: int = 0
    # steps abandoned between layers for a tenant that had no work (engine/llm_engine.py)
    steps_interrupted: int = 0
    tokens_computed: int = 0
    integrity_checks: int = 0  # request-checks performed (one per scheduled request, twice per step)
    pages_checked: int = 0
    integrity_failures: int = 0
    preemptions: int = 0
    check_seconds: float = 0.0  # wall time inside the I1 checks, to measure their cost
    stamp_seconds: float = 0.0  # wall time spent stamping tags on the write path
    outcomes: dict[str, int] = field(
        default_factory=dict
    )  # finished / failed:<code> / aborted / rejected:<code>

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


@dataclass(frozen=True, slots=True)
class TenantSnapshot:
    """One tenant in the scheduler, between steps (engine/fairness.py)."""

    pages: int  # held by its running requests (PD: and its prefilled pages awaiting a transfer, its reservations)
    running: int
    waiting: int
    virtual_tokens: float  # its virtual token counter: weighted service received


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    pool: PoolStats
    integrity_checks: int
    integrity_failures: int
    pages_checked: int
    outcomes: dict[str, int] = field(default_factory=dict)
    prefix_cache: PrefixCacheStats | None = None  # None when the engine runs without a prefix cache
    tenants: dict[str, TenantSnapshot] = field(default_factory=dict)
    steps_interrupted: int | None = None  # long steps stopped for a newcomer tenant (None: not this engine's)
