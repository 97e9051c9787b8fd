"""I6 on the router side (docs/invariants.md): registration refuses a worker whose fingerprint does not match
the registered ones, and the limits the router admits against are the smallest any worker holds. Pure
`RouterCore`, no sockets, no model."""

from __future__ import annotations

from typing import Any

from kvfence.pd import control
from kvfence.pd.router import RouterCore


def fingerprint(**changes: Any) -> dict[str, Any]:
    return {
        "layout": "l",
        "vocab_size": 10,
        "context_length": 256,
        "pool_pages": 64,
        "page_size": 16,
        **changes,
    }


def core_with_outbox() -> tuple[RouterCore, list[tuple[bytes, str]]]:
    core = RouterCore()
    sent: list[tuple[bytes, str]] = []
    core._send = lambda identity, message: sent.append((identity, message.op))  # type: ignore[method-assign]
    return core, sent


def register(core: RouterCore, identity: bytes, role: str, fp: dict[str, Any]) -> None:
    core.on_message(identity, control.Register(role=role, fingerprint=fp))


def test_a_worker_with_another_kv_layout_is_refused():
    core, sent = core_with_outbox()
    register(core, b"P", "prefill", fingerprint())
    register(core, b"D", "decode", fingerprint(layout="other"))
    assert set(core.workers) == {b"P"}
    assert sent == [(b"P", "registered"), (b"D", "refused")]


def test_the_router_admits_against_the_smallest_context_and_pool():
    core, _ = core_with_outbox()
    register(core, b"P", "prefill", fingerprint(context_length=512, pool_pages=40))
    register(core, b"D1", "decode", fingerprint(context_length=256, pool_pages=96))
    register(core, b"D2", "decode", fingerprint(context_length=384, pool_pages=80))
    prefill, decode = core.limits()
    assert (prefill.context_length, decode.context_length) == (256, 256)  # the smallest any path holds
    assert (prefill.pool_pages, decode.pool_pages) == (40, 80)


def test_the_router_takes_output_only_from_the_workers_it_placed_the_request_on():
    from kvfence.engine.output import RequestOutput
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core, _ = core_with_outbox()
    for identity, role in ((b"P", "prefill"), (b"D", "decode"), (b"X", "decode")):
        register(core, identity, role, fingerprint())
    seen: list[RequestOutput] = []
    core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId("r"), "t", seen.append)
    placed_on = core._routed[RequestId("r")].decode
    # the other decode worker: registered, but not the one this request was placed on
    stranger = ({b"D", b"X"} - {placed_on}).pop()
    forged = RequestOutput(RequestId("r"), (7,), "forged", True, "stop", None, 3, 1, "forged", (7,))
    core.on_message(stranger, control.Output(forged))
    assert seen == [] and core.refused["not_placed_here"] == 1
