"""The PD control plane's typed messages: every message round-trips through the codec, bad frames are refused,
and an unknown op is counted and dropped by the router and by each worker role without changing anything."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, NewType, Union, get_args, get_origin, get_type_hints

import pytest

from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import RequestId
from kvfence.pd import control
from kvfence.pd.control import ControlError, ControlMessage, UnknownOp
from kvfence.pd.decode_role import DecodeRole
from kvfence.pd.messages import Message
from kvfence.pd.prefill_role import PrefillRole
from kvfence.pd.router_core import RouterCore
from kvfence.sim.nodes import make_engine
from kvfence.sim.scenario import SimConfig

FP = {
    "layout": "l",
    "vocab_size": 64,
    "context_length": 64,
    "pool_pages": 24,
    "page_size": 4,
    "scheduling_policy": "vtc",
}


def sample(tp: Any) -> Any:
    """A value of type `tp` that survives JSON (non-default, so a dropped field would show)."""
    if tp is Any:
        return [1, "a"]
    if isinstance(tp, NewType):
        return sample(tp.__supertype__)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union or origin is types.UnionType:
        return sample(next(a for a in args if a is not type(None)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (sample(args[0]), sample(args[0]))
        return tuple(sample(a) for a in args)
    if origin is dict:
        return {"k": sample(args[1])}
    if dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        return tp(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(tp)})  # type: ignore[operator]
    return {str: "x", int: 7, float: 0.5, bool: True}[tp]


def test_the_registry_names_every_message_once():
    assert len(control.MESSAGES) == 16
    assert all(cls.op == op for op, cls in control.MESSAGES.items())
    assert set(control.MESSAGES) <= set((control.__doc__ or "").split())  # the docstring lists every op


@pytest.mark.parametrize("op", sorted(control.MESSAGES))
def test_every_message_round_trips(op: str):
    message = sample(control.MESSAGES[op])
    frame = control.encode(message)
    assert control.decode(frame) == message
    assert control.decode(control.encode(control.MESSAGES[op](**_required_only(message)))).op == op


def _required_only(message: ControlMessage) -> dict[str, Any]:
    return {
        f.name: getattr(message, f.name)
        for f in dataclasses.fields(message)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


@pytest.mark.parametrize(
    "frame",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"request_id": "r"}',  # no op
        b'{"op": 3}',
        b'{"op": "abort"}',  # a required field missing
        b'{"op": "abort", "request_id": "r", "extra": 1}',  # a field the message does not know
        b'{"op": "abort", "request_id": 5}',  # wrong type
        b'{"op": "error", "request_id": "r", "code": "c", "message": "m", "status": true}',  # a bool is no int
        b'{"op": "prefill", "request_id": "r", "transfer_id": 1, "prompt_ids": [1, "2"], "params": {}}',
        b'{"op": "checked", "nonce": 1, "ok": 1, "error": null, "num_pages": 2, "num_free": 2}',
        b'{"op": "output", "output": {"request_id": "r"}}',  # the nested output lacks its fields
    ],
)
def test_malformed_frames_are_refused(frame: bytes):
    with pytest.raises(ControlError) as err:
        control.decode(frame)
    assert not isinstance(err.value, UnknownOp)


def test_an_unknown_op_is_its_own_error():
    with pytest.raises(UnknownOp) as err:
        control.decode(b'{"op": "frobnicate", "x": 1}')
    assert err.value.op == "frobnicate"


def test_ints_are_taken_as_floats_and_arrays_as_tuples():
    msg = control.decode(
        b'{"op": "prefill", "request_id": "r", "transfer_id": 1, "prompt_ids": [1, 2], "params": {}}'
    )
    assert isinstance(msg, control.Prefill) and msg.prompt_ids == (1, 2)


# ---- receivers: unknown ops counted and dropped -------------------------------------------------------------


def routed_core() -> tuple[RouterCore, list[tuple[bytes, ControlMessage]]]:
    core = RouterCore(tid_prefix=1)
    sent: list[tuple[bytes, ControlMessage]] = []
    core._send = lambda identity, message: sent.append((identity, message))  # type: ignore[method-assign]
    core.on_frame(
        b"P", control.encode(control.Register("prefill", FP, "tcp://p:1", 11, {"pd": {"window": 2}}))
    )
    core.on_frame(b"D", control.encode(control.Register("decode", FP, pid=12)))
    core.route([1, 2, 3], SamplingParams(max_tokens=2), RequestId("r"), "t", lambda out: None)
    return core, sent


def router_state(core: RouterCore) -> Any:
    return (
        {i: dataclasses.asdict(w) for i, w in core.workers.items()},
        {rid: dataclasses.asdict(r) for rid, r in core._routed.items()},
    )


def test_the_router_counts_and_drops_what_it_cannot_use():
    core, sent = routed_core()
    before, num_sent = router_state(core), len(sent)
    core.on_frame(b"P", b'{"op": "frobnicate", "request_id": "r"}')
    core.on_frame(b"P", b'{"op": "output"}')
    core.on_frame(b"D", control.encode(control.Expect(RequestId("r"), 1, (1,), {}, "tcp://x")))  # type: ignore[arg-type]
    assert core.control.counts() == {"malformed": 1, "unknown_op": 1, "unexpected": 1}
    assert len(sent) == num_sent
    after = router_state(core)
    for state in (before, after):  # a known sender's last_seen moves with any message it sends
        for w in state[0].values():
            w.pop("last_seen")
    assert after == before


def test_the_router_keeps_each_workers_config():
    core, _ = routed_core()
    configs = sorted(core.worker_configs(), key=lambda c: c["role"])
    assert [(c["role"], c["pid"], c["config"]) for c in configs] == [
        ("decode", 12, {}),
        ("prefill", 11, {"pd": {"window": 2}}),
    ]


class FakeTransport:
    def __init__(self) -> None:
        self.control_sent: list[ControlMessage] = []
        self.data_sent: list[tuple[Any, Message]] = []

    def send_control(self, message: ControlMessage) -> None:
        self.control_sent.append(message)

    def send_data(self, peer: Any, message: Message) -> None:
        self.data_sent.append((peer, message))

    def connect(self, data_addr: str, principal: str = "") -> Any:
        return data_addr

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        return {control.Ping: control.ignore}


@pytest.mark.parametrize("role_class", [PrefillRole, DecodeRole])
def test_a_worker_role_counts_and_drops_what_it_cannot_use(role_class: type[PrefillRole | DecodeRole]):
    cfg = SimConfig(seed=0)
    engine, _ = make_engine(cfg, 24, Faults(), 1)
    transport = FakeTransport()
    role = role_class(engine, transport, cfg.pd_options(), clock=lambda: 0.0)
    other = control.Expect if role_class is PrefillRole else control.Prefill
    role.on_control_frame(b'{"op": "frobnicate", "request_id": "r"}')
    role.on_control_frame(b'{"op": "abort", "request_id": 3}')
    body = {"request_id": "r", "transfer_id": 5, "prompt_ids": [3, 4, 5], "params": {"max_tokens": 2}}
    if other is control.Expect:
        body["prefill_addr"] = "tcp://p"
    role.on_control_frame(control.encode(other(**body)))  # type: ignore[arg-type]
    role.on_control_frame(control.encode(control.Ping()))  # the transport's own: taken, nothing to do
    assert role.control.counts() == {"malformed": 1, "unknown_op": 1, "unexpected": 1}
    assert not engine.has_unfinished() and not role.pending()
    assert transport.control_sent == [] and transport.data_sent == []
    own = control.Prefill if role_class is PrefillRole else control.Expect
    if own is control.Expect:
        body["prefill_addr"] = "tcp://p"
    else:
        body.pop("prefill_addr", None)
    role.on_control_frame(control.encode(own(**body)))  # type: ignore[arg-type]
    assert engine.has_unfinished()  # its own message goes through the same table


def test_a_decode_worker_takes_page_frames_only_from_the_prefill_it_sent_the_ticket_to():
    """I10 on the data plane: another prefill this decode worker is connected to cannot write or stamp the pages
    of a transfer it was not named for (transfer, page and lease ids are sequential, so guessable); its frames
    are dropped and counted, and the named prefill's frames still land."""
    from kvfence.pd.messages import PageFrame, Ticket

    cfg = SimConfig(seed=0)
    engine, _ = make_engine(cfg, 24, Faults(), 1)
    transport = FakeTransport()
    role = DecodeRole(engine, transport, cfg.pd_options(), clock=lambda: 0.0)
    body = {"request_id": "r", "transfer_id": 5, "prompt_ids": [3, 4, 5], "params": {"max_tokens": 2},
            "prefill_addr": "tcp://p:1"}  # fmt: skip
    role.on_control_frame(control.encode(control.Expect(**body)))  # type: ignore[arg-type]
    role.on_tick()  # reserves the pages and sends the ticket to the named prefill
    ((named, ticket),) = transport.data_sent
    assert isinstance(ticket, Ticket) and named == "tcp://p:1"
    payload = bytes(engine.runner.cache.page_bytes())
    frame = PageFrame(ticket.transfer_id, 0, ticket.page_ids[0], ticket.lease_ids[0], payload)
    role.on_message("tcp://q:1", frame)  # another prefill, with every id right
    assert role.refused["frame_from_another_prefill"] == 1 and len(transport.data_sent) == 1
    assert [f.num_written for f in role.rx.in_flight()] == [0]
    role.on_message(named, frame)
    assert [f.num_written for f in role.rx.in_flight()] == [1]  # and acknowledged to the named prefill
    assert transport.data_sent[-1][0] == named


def test_a_prefill_holds_a_bounded_number_of_tickets_for_requests_it_has_not_seen(monkeypatch):
    """A ticket may come before the router's message for its request and waits, unverified; a peer that sends
    tickets for made-up requests fills no more than MAX_EARLY_TICKETS (the rest are refused and counted)."""
    from kvfence.ids import LeaseId, PageId
    from kvfence.pd import prefill_role
    from kvfence.pd.messages import Ticket, TransferId

    monkeypatch.setattr(prefill_role, "MAX_EARLY_TICKETS", 3)
    cfg = SimConfig(seed=0)
    engine, _ = make_engine(cfg, 24, Faults(), 1)
    role = PrefillRole(engine, FakeTransport(), cfg.pd_options(), clock=lambda: 0.0)
    for i in range(5):
        ticket = Ticket(TransferId(100 + i), RequestId(f"made-up-{i}"), (PageId(1),), (LeaseId(1),), "l")
        role.on_message("tcp://d:1", ticket)
    assert role.refused["too_many_early_tickets"] == 2
    assert sum(len(s.unverified) for s in role.requests.values()) == 3
