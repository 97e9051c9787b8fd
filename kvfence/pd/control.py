"""Control-plane messages between router and workers: one frozen dataclass per message, one JSON object per
ZeroMQ frame (`{"op": ..., field: value, ...}`), decoded and type-checked field by field before anyone acts on it.

    op          class          direction              fields
    register    Register       worker -> router       role, fingerprint (I6), data_addr, pid, config
    registered  Registered     router -> worker       tenants (weights and page shares from the keys file: the
                                                      worker's scheduler applies them, engine/fairness.py)
    refused     Refused        router -> worker       reason, retry (the key is in use: try again later)
    reregister  Reregister     router -> worker       -  (a heartbeat from a worker the router does not know)
    heartbeat   Heartbeat      worker -> router       worker (its control identity), pool_free, pool,
                                                      integrity_failures, refused, num_waiting, num_running,
                                                      tenants (per tenant: pages, running, waiting, virtual_tokens)
    ping        Ping           router -> worker       -  (a worker exits when its router goes silent)
    shutdown    Shutdown       router -> worker       -
    prefill     Prefill        router -> prefill      request_id, transfer_id, prompt_ids, params, tenant,
                                                      decode_principal (who may take the pages: I10)
    expect      Expect         router -> decode       the same, prefill_addr (where to send the ticket) and
                                                      prefill_principal (the key that address must prove)
    abort       AbortRequest   router -> worker       request_id
    output      Output         worker -> router       output (a RequestOutput; prefill sends the first token only)
    error       RequestError   worker -> router       request_id, code, message, status (admission, prefill failure)
    debug_kv    DebugKv        router -> worker       nonce; the answer, worker -> router, adds snapshot (page map)
    check       Check          router -> worker       nonce (an integrity audit between two engine steps)
    checked     Checked        worker -> router       nonce, ok, error, num_pages, num_free
    arm         Arm            router -> worker       spec (fault knobs; obeyed only with KVFENCE_FAULT_ARMING=1)

`decode` refuses a frame (ControlError) that is not JSON, has no op, lacks a required field, has a field its
message does not know, or a value of the wrong type; an op no message has raises UnknownOp (a ControlError), so a
receiver can count it apart. Each receiver (router, prefill worker, decode worker) dispatches through one
`Dispatch`: a table message class -> handler; whatever it cannot use is counted, logged and dropped, never raised.

`params` stays a JSON object on the wire: the receiving role builds SamplingParams, so invalid sampling
parameters reach the client as that request's 400 instead of a dropped frame.

Why stdlib dataclasses, not msgspec or pydantic: the data-plane messages (messages.py) are already frozen,
slotted dataclasses, and these should read the same; msgspec would be a new dependency on every worker; pydantic is
here only for the HTTP layer, coerces by default ("1" -> 1), and would tie the sans-IO protocol core to it. The
checker below is small and does exactly three conversions: JSON arrays to tuples, ints to float fields, and
objects to nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, NewType, TypeVar, Union, get_args, get_origin, get_type_hints

from kvfence.engine.fairness import TenantShare
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.ids import RequestId
from kvfence.pd.messages import TransferId

log = logging.getLogger("kvfence.pd.control")


class ControlError(ValueError):
    """A frame that is not a valid control message; nothing in it was acted on."""


class UnknownOp(ControlError):
    """A well-formed frame whose op no message has (a newer peer, or a stray sender)."""

    def __init__(self, op: str) -> None:
        super().__init__(f"unknown control op {op!r}")
        self.op = op


class ControlMessage:
    """Base of every control message; `op` names it on the wire."""

    __slots__ = ()
    op: ClassVar[str]


M = TypeVar("M", bound=ControlMessage)
T = TypeVar("T")
MESSAGES: dict[str, type[ControlMessage]] = {}  # op -> class: every message, for decode and the tests


def _message(cls: type[M]) -> type[M]:
    assert cls.op not in MESSAGES, f"two control messages share op {cls.op!r}"
    MESSAGES[cls.op] = cls
    return cls


@_message
@dataclass(frozen=True, slots=True)
class Register(ControlMessage):
    op: ClassVar[str] = "register"
    role: str  # "prefill" | "decode"
    fingerprint: dict[str, Any]  # what the router compares across workers (I6): kvfence/pd/worker.py
    data_addr: str = ""  # a prefill's KV data socket
    pid: int | None = None  # for operators' logs (and tests that kill a worker)
    config: dict[str, Any] = field(default_factory=dict)  # the worker's public configuration tree


@_message
@dataclass(frozen=True, slots=True)
class Registered(ControlMessage):
    op: ClassVar[str] = "registered"
    # tenant -> its weight and page shares; each worker applies them to its own pool (TenantShare validates them)
    tenants: dict[str, TenantShare] = field(default_factory=dict)


@_message
@dataclass(frozen=True, slots=True)
class Refused(ControlMessage):
    op: ClassVar[str] = "refused"
    reason: str
    retry: bool = False  # the key is in use by a live worker: register again once the router has reaped it


@_message
@dataclass(frozen=True, slots=True)
class Reregister(ControlMessage):
    op: ClassVar[str] = "reregister"


@_message
@dataclass(frozen=True, slots=True)
class Heartbeat(ControlMessage):
    op: ClassVar[str] = "heartbeat"
    worker: str  # the worker's control identity, hex: heartbeats come from a socket of their own
    pool_free: int | None = None
    pool: dict[str, Any] | None = None  # the pool's page counts (PoolStats)
    integrity_failures: int | None = None
    refused: dict[str, int] | None = None  # what the worker refused (I10), by reason
    num_waiting: int | None = None  # requests in the worker's own queue (placement by load)
    num_running: int | None = None
    # tenant -> pages, running, waiting, virtual_tokens (the worker's part of the per-tenant metrics)
    tenants: dict[str, dict[str, float]] | None = None


@_message
@dataclass(frozen=True, slots=True)
class Ping(ControlMessage):
    op: ClassVar[str] = "ping"


@_message
@dataclass(frozen=True, slots=True)
class Shutdown(ControlMessage):
    op: ClassVar[str] = "shutdown"


@_message
@dataclass(frozen=True, slots=True)
class Prefill(ControlMessage):
    op: ClassVar[str] = "prefill"
    request_id: RequestId
    transfer_id: TransferId
    prompt_ids: tuple[int, ...]
    params: dict[str, Any]  # SamplingParams as JSON (params_to_json); the role builds and checks them
    tenant: str = "anonymous"
    decode_principal: str = (
        ""  # I10: the only peer this transfer's pages may go to ("" in a cluster without keys)
    )


@_message
@dataclass(frozen=True, slots=True)
class Expect(ControlMessage):
    op: ClassVar[str] = "expect"
    request_id: RequestId
    transfer_id: TransferId
    prompt_ids: tuple[int, ...]
    params: dict[str, Any]
    prefill_addr: str  # the prefill worker's data address: where the ticket goes
    tenant: str = "anonymous"
    prefill_principal: str = ""  # I10: the prefill's public key, which its data socket must prove it holds


@_message
@dataclass(frozen=True, slots=True)
class AbortRequest(ControlMessage):
    op: ClassVar[str] = "abort"
    request_id: RequestId


@_message
@dataclass(frozen=True, slots=True)
class Output(ControlMessage):
    op: ClassVar[str] = "output"
    output: RequestOutput


@_message
@dataclass(frozen=True, slots=True)
class RequestError(ControlMessage):
    op: ClassVar[str] = "error"
    request_id: RequestId
    code: str
    message: str
    status: int  # the HTTP status the client gets


@_message
@dataclass(frozen=True, slots=True)
class DebugKv(ControlMessage):
    op: ClassVar[str] = "debug_kv"
    nonce: int
    snapshot: dict[str, Any] | None = None  # the answer's page map (kvfence/dashboard); None in the question


@_message
@dataclass(frozen=True, slots=True)
class Check(ControlMessage):
    op: ClassVar[str] = "check"
    nonce: int


@_message
@dataclass(frozen=True, slots=True)
class Checked(ControlMessage):
    op: ClassVar[str] = "checked"
    nonce: int
    ok: bool
    error: str | None
    num_pages: int
    num_free: int


@_message
@dataclass(frozen=True, slots=True)
class Arm(ControlMessage):
    op: ClassVar[str] = "arm"
    spec: str  # "knob=count,..." (kvfence/faults.py)


# ---- the codec ---------------------------------------------------------------------------------------------


def encode(message: ControlMessage) -> bytes:
    body = asdict(message)  # type: ignore[call-overload]  # every ControlMessage is a dataclass
    return json.dumps({"op": message.op, **body}, separators=(",", ":")).encode()


def decode(frame: bytes) -> ControlMessage:
    """The message in `frame`, every field checked against its type; raises UnknownOp or ControlError."""
    try:
        raw = json.loads(frame)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ControlError(f"control frame is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise ControlError("control message without an op")
    op = raw.pop("op")
    cls = MESSAGES.get(op)
    if cls is None:
        raise UnknownOp(op)
    return _build(cls, raw, op)


@dataclass(frozen=True, slots=True)
class _Schema:
    types: dict[str, Any]  # field name -> its type, resolved
    required: tuple[str, ...]  # the fields without a default


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: Any) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = get_type_hints(cls)
        types_ = {f.name: hints[f.name] for f in fields(cls)}
        required = tuple(
            f.name
            for f in fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        schema = _SCHEMAS[cls] = _Schema(types_, required)
    return schema


def _build(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, dict):
        raise ControlError(f"{where}: expected an object, got {type(raw).__name__}")
    schema = _schema(cls)
    unknown = raw.keys() - schema.types.keys()
    if unknown:
        raise ControlError(f"{where}: unknown fields {sorted(unknown)}")
    missing = [name for name in schema.required if name not in raw]
    if missing:
        raise ControlError(f"{where}: missing fields {missing}")
    values = {name: _check(value, schema.types[name], f"{where}.{name}") for name, value in raw.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a nested dataclass's own validation
        raise ControlError(f"{where}: {exc}") from exc


def _check(value: Any, tp: Any, where: str) -> Any:
    """`value` (decoded JSON) as type `tp`, or ControlError. Arrays become tuples, ints become floats where a
    float is expected, objects become nested dataclasses; nothing else is converted."""
    if tp is Any:
        return value
    if isinstance(tp, NewType):
        return _check(value, tp.__supertype__, where)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union or origin is types.UnionType:
        for arm in args:
            try:
                return _check(value, arm, where)
            except ControlError:
                continue
        raise ControlError(f"{where}: {value!r:.60} is not {tp}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ControlError(f"{where}: expected an array, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ControlError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_check(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ControlError(f"{where}: expected an object, got {type(value).__name__}")
        return {k: _check(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)  # type: ignore[arg-type]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (str, int, float, bool, type(None)):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ControlError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    raise TypeError(f"{where}: control messages cannot carry {tp}")  # a programming error, not a bad frame


# ---- dispatch ----------------------------------------------------------------------------------------------

Handler = Callable[..., None]


class Dispatch:
    """One receiver's control messages: a table message class -> handler, called with the message and whatever
    the receiver passes along (the router: the sender's identity). A frame that does not decode, an op no message
    has, or a message this receiver has no handler for is counted, logged and dropped; nothing here raises."""

    def __init__(self, owner: str, handlers: Mapping[type[ControlMessage], Handler]) -> None:
        self.owner = owner
        self.handlers = dict(handlers)
        self.num_malformed = 0  # frames `decode` refused
        self.num_unknown_op = 0  # well-formed frames with an op no message has
        self.num_unexpected = 0  # known messages this receiver does not take

    def decode(self, frame: bytes) -> ControlMessage | None:
        try:
            return decode(frame)
        except UnknownOp as exc:
            self.num_unknown_op += 1
            log.warning("%s: dropped a control message: %s", self.owner, exc)
        except ControlError as exc:
            self.num_malformed += 1
            log.warning("%s: dropped a malformed control message: %s", self.owner, exc)
        return None

    def __call__(self, message: ControlMessage, *context: Any) -> bool:
        """Hand `message` to its handler; False (counted, logged) when this receiver has none."""
        handler = self.handlers.get(type(message))
        if handler is None:
            self.num_unexpected += 1
            log.warning("%s: dropped an unexpected %r message", self.owner, message.op)
            return False
        handler(message, *context)
        return True

    def counts(self) -> dict[str, int]:
        """Dropped control messages by reason (for /metrics)."""
        return {
            "malformed": self.num_malformed,
            "unknown_op": self.num_unknown_op,
            "unexpected": self.num_unexpected,
        }


def ignore(message: ControlMessage, *context: Any) -> None:
    """A handler for messages a receiver takes and has nothing to do for (a router's ping)."""


# ---- sampling parameters ------------------------------------------------------------------------------------


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# what each SamplingParams field may be on the wire (checked before the dataclass sees it: its own checks
# compare numbers, and a string there would be a TypeError, not a refusal)
_PARAM_CHECKS: dict[str, Callable[[Any], bool]] = {
    "max_tokens": _is_int,
    "min_tokens": _is_int,
    "top_k": lambda v: v is None or _is_int(v),
    "seed": lambda v: v is None or _is_int(v),
    "logprobs": lambda v: v is None or _is_int(v),
    "prompt_logprobs": lambda v: v is None or _is_int(v),
    **dict.fromkeys(
        ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"],
        _is_number,
    ),
    "ignore_eos": lambda v: isinstance(v, bool),
    "cache_salt": lambda v: isinstance(v, str),
    "grammar": lambda v: isinstance(v, str),
    "stop": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "stop_token_ids": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "logit_bias": lambda v: (
        isinstance(v, list)
        and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_number(p[1]) for p in v)
    ),
}


def params_from_json(raw: Mapping[str, Any]) -> SamplingParams:
    """A peer's sampling parameters: every key a SamplingParams field, every value of its type (ControlError
    otherwise, naming it); then the dataclass's own range checks (InvalidSamplingParams)."""
    if not isinstance(raw, Mapping):
        raise ControlError("params must be an object")
    unknown = set(raw) - set(_PARAM_CHECKS)
    if unknown:
        raise ControlError(f"params: unknown fields {sorted(unknown)}")
    for name, value in raw.items():
        if not _PARAM_CHECKS[name](value):
            raise ControlError(f"params: {name} has the wrong type ({type(value).__name__})")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    if "logit_bias" in values:  # pairs arrive as JSON lists
        values["logit_bias"] = tuple(tuple(pair) for pair in values["logit_bias"])
    return SamplingParams(**values)
