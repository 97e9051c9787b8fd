"""Wire format of the transfer protocol's messages: ZeroMQ multipart frames, strictly validated on arrival.

    PageFrame:      [b"F", header (struct: version, transfer id, index, page id, lease id), payload]
    anything else:  [kind byte, JSON object]

The payload of a page frame travels as its own ZeroMQ frame, so the transport can send it without copying it
into a header. Decoding never trusts the sender: wrong kinds, versions, field types or sizes raise `WireError`
and the receiver drops the message and counts it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from typing import Any

from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.pd.messages import (
    SCHEMA_VERSION,
    Abort,
    AbortAck,
    FinalFrame,
    FrameAck,
    Message,
    PageFrame,
    Ticket,
    TransferId,
)

_FRAME_HEADER = struct.Struct("<HQIIQ")  # version, transfer id, index, page id, lease id
_KINDS: dict[bytes, type] = {b"T": Ticket, b"A": FrameAck, b"Z": FinalFrame, b"X": Abort, b"K": AbortAck}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


class WireError(ValueError):
    pass


def encode(message: Message) -> list[bytes]:
    if isinstance(message, PageFrame):
        header = _FRAME_HEADER.pack(
            message.version, message.transfer_id, message.index, message.page_id, message.lease_id
        )
        return [b"F", header, message.payload]
    fields = asdict(message)
    if isinstance(message, FinalFrame):
        fields["digest"] = message.digest.hex()
    return [_KIND_OF[type(message)], json.dumps(fields, separators=(",", ":")).encode()]


def decode(frames: list[bytes]) -> Message:
    if not frames:
        raise WireError("empty message")
    kind = bytes(frames[0])
    if kind == b"F":
        if len(frames) != 3 or len(frames[1]) != _FRAME_HEADER.size:
            raise WireError("malformed page frame")
        version, tid, index, page, lease = _FRAME_HEADER.unpack(frames[1])
        _check_version(version)
        return PageFrame(TransferId(tid), index, PageId(page), LeaseId(lease), bytes(frames[2]))
    cls = _KINDS.get(kind)
    if cls is None or len(frames) != 2:
        raise WireError(f"unknown message kind {kind!r}")
    try:
        fields = json.loads(frames[1])
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"bad JSON in {cls.__name__}") from exc
    if not isinstance(fields, dict):
        raise WireError(f"{cls.__name__} is not an object")
    _check_version(fields.get("version"))
    return _build(cls, fields)


def _check_version(version: object) -> None:
    if version != SCHEMA_VERSION:
        raise WireError(f"schema version {version!r}, expected {SCHEMA_VERSION}")


def _build(cls: type, f: dict[str, Any]) -> Message:
    try:
        if cls is Ticket:
            ticket = Ticket(
                TransferId(_int(f["transfer_id"])),
                RequestId(_str(f["request_id"])),
                tuple(PageId(_int(p, 32)) for p in f["page_ids"]),  # page frames carry them in 32 bits
                tuple(LeaseId(_int(x)) for x in f["lease_ids"]),
                _str(f["layout"]),
            )
            if len(ticket.page_ids) != len(ticket.lease_ids):
                raise WireError("a ticket needs one lease per page")
            return ticket
        if cls is FrameAck:
            return FrameAck(TransferId(_int(f["transfer_id"])), _int(f["index"], 32))
        if cls is FinalFrame:
            return FinalFrame(
                TransferId(_int(f["transfer_id"])),
                _int(f["num_pages"], 32),
                bytes.fromhex(_str(f["digest"])),
                _int(f["first_token"], 32),
                _logprobs(f.get("first_logprobs")),
            )
        if cls is Abort:
            return Abort(TransferId(_int(f["transfer_id"])), _str(f["reason"]))
        return AbortAck(TransferId(_int(f["transfer_id"])))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from exc


def _logprobs(v: object) -> tuple[float, tuple[tuple[int, float], ...]] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[1], list):
        raise WireError("malformed first_logprobs")
    return _float(v[0]), tuple(
        (_int(p[0]), _float(p[1])) for p in v[1] if isinstance(p, list) and len(p) == 2
    )


def _float(v: object) -> float:
    """A finite number (json takes NaN, Infinity and 400-digit integers; a logprob is none of them)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise WireError(f"expected a number, got {v!r}")
    try:
        x = float(v)
    except OverflowError as exc:
        raise WireError("a number beyond a float's range") from exc
    if not math.isfinite(x):
        raise WireError(f"expected a finite number, got {x}")
    return x


def _int(v: object, bits: int = 64) -> int:
    """A non-negative integer that fits the `bits` the frames carry it in."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << bits:
        raise WireError(f"expected a non-negative {bits}-bit integer, got {str(v)[:40]}")
    return v


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise WireError(f"expected a string, got {v!r}")
    return v
