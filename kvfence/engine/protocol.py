"""`Engine`: what the HTTP layer (kvfence/server) drives, satisfied by the local `LLMEngine` and by the PD
router's `RemoteEngine` (kvfence/pd/remote.py), checked by mypy strict: no stand-ins, no `getattr`.

Threads: `add_request`, `abort`, `has_unfinished` from any thread; `step` and `snapshot` on the one thread that
steps the engine (`AsyncEngine`'s engine loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvfence.engine.admission import Limits
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.engine.stats import EngineSnapshot
from kvfence.model.tokenizer import Tokenizer


class Admitted(Protocol):
    """A request the engine accepted: what the server keeps of it."""

    @property
    def request_id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def num_pages_checked(self) -> int: ...  # pages the I1 checks covered for it (its log line)


class Engine(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def limits(self) -> Limits: ...  # what admission (I5) checks against: context, pool, page size

    @property
    def vocab_size(self) -> int: ...

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str, tenant: str
    ) -> Admitted: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def unready(self) -> str | None: ...  # why it cannot take a request now (readiness), None when it can

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> EngineSnapshot: ...  # engine thread, between steps

    @property
    def num_waiting(self) -> int: ...  # requests admitted but not yet running (engine thread)
