"""What a prefill or decode worker does, without sockets: routed requests, transfers and engine steps in,
control and data messages out through a `Transport`. The ZeroMQ processes (kvfence/pd/worker.py) and the
deterministic simulator (kvfence/sim) drive the same role classes: `PrefillRole` (kvfence/pd/prefill_role.py)
and `DecodeRole` (kvfence/pd/decode_role.py), on this base.

Each role runs on one thread (its worker's loop, or the simulator's event loop). That is what makes the
receiver's frame validation, KV write and revocation atomic with respect to each other (I4), and keeps the
engine on one thread as it requires.

Prefill: admit (I5) -> prefill to the first token -> hand-off -> a ticket from decode -> TransferSender streams
         I1-checked page reads -> ReleaseLocal. Aborts and timeouts end it at any point; an abort that comes
         before the sender exists is remembered (a tombstone of its transfer id, which the router sends
         with the request), so a late ticket is refused.
Decode:  admit (I5) -> reserve leases, send the ticket -> TransferReceiver validates every frame (I2), count and
         digest (I3) -> the request adopts the pages and decodes. Timeouts and aborts revoke (I4).

Control messages reach a role through one dispatch table (`control`): the transport's own messages
(registration, liveness, operator questions) and the role's (requests, aborts). Anything else is counted on
`control` and dropped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from kvfence.engine.errors import AdmissionError
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import Request, SamplingParams
from kvfence.engine.stats import TenantSnapshot
from kvfence.ids import RequestId
from kvfence.pd import control
from kvfence.pd.control import ControlMessage
from kvfence.pd.messages import Message
from kvfence.pd.receiver import TransferReceiver

log = logging.getLogger("kvfence.pd.worker")
Clock = Callable[[], float]
Routed = control.Prefill | control.Expect  # a request the router placed on this worker


class Transport(Protocol):
    """How a role's messages leave it. `peer` values are opaque handles the transport gave out."""

    def send_control(self, message: ControlMessage) -> None: ...
    def send_data(self, peer: Any, message: Message) -> None: ...
    def connect(self, data_addr: str, principal: str = "") -> Any: ...  # decode: a prefill's data address
    def principal(self, peer: Any) -> str: ...  # who the transport authenticated behind `peer` ("" if nobody)

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        """The control messages the transport answers itself (registration, liveness, operator questions)."""
        ...


class Role:
    name = "worker"

    def __init__(self, engine: LLMEngine, transport: Transport, clock: Clock = time.monotonic) -> None:
        self.engine = engine
        self.transport = transport
        self.clock = clock
        handlers = {**transport.control_handlers(), **self.control_handlers()}
        self.control = control.Dispatch(f"{self.name} worker", handlers)
        self.refused: Counter[str] = Counter()  # what the I10 binding refused, by reason (heartbeats)

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        """The role's own control messages: routed requests (per role) and aborts."""
        return {control.AbortRequest: lambda msg: self.on_abort(msg.request_id)}

    def on_control_frame(self, frame: bytes) -> None:
        """A frame from the router: decoded, then dispatched; a bad or unknown one is counted and dropped."""
        message = self.control.decode(frame)
        if message is not None:
            self.control(message)

    def tenant_snapshots(self) -> dict[str, TenantSnapshot]:
        """Each tenant here (heartbeats: the router's per-tenant metrics); a role adds what waits outside the
        engine."""
        return self.engine.tenant_snapshots()

    def step(self) -> bool:
        """One engine step, if there is work, and what follows from it. Returns whether another step could run
        a forward now (the worker polls its sockets without waiting while it could)."""
        if self.engine.has_unfinished():
            self.on_outputs(self.engine.step())
            self.after_step()
        return self.engine.has_steppable()

    def send_error(self, request_id: RequestId, code: str, message: str, status: int) -> None:
        self.transport.send_control(control.RequestError(request_id, code, message, status))

    def admit(self, msg: Routed) -> Request | None:
        """Run the engine's admission (I5) for a routed request; report a refusal to the router."""
        try:
            return self.admit_request(msg, control.params_from_json(msg.params))
        except AdmissionError as exc:
            self.send_error(msg.request_id, exc.code, str(exc), 400)
        except ValueError as exc:
            self.send_error(msg.request_id, "invalid_request_error", str(exc), 400)
        return None

    def receiver(self) -> TransferReceiver | None:
        return None

    def check_integrity(self) -> None:
        """Pool, engine and transfer invariants (AssertionError). Between steps only."""
        rx = self.receiver()
        self.engine.check_integrity(other_holders=rx.reserved_leases() if rx is not None else ())
        if rx is not None:
            rx.check_integrity()

    def pending(self) -> list[Any]:
        """What the role still tracks beyond the engine's requests (transfers, queues): empty when idle."""
        return []

    # hooks
    def admit_request(self, msg: Routed, params: SamplingParams) -> Request:
        raise NotImplementedError

    def on_abort(self, request_id: RequestId) -> None: ...
    def on_message(self, peer: Any, message: Message) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...
    def after_step(self) -> None: ...
    def on_tick(self) -> None: ...
