"""I6 on the router side (docs/invariants.md): registration refuses a worker whose fingerprint does not match
the registered ones, and the router admits against the smallest context and the largest pool of each role,
placing a request only on a worker whose own pool holds it (I5 per worker); placement by load and draining.
Pure `RouterCore`, no sockets, no model."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.pd import control
from kvfence.pd.router import RouterCore


def fingerprint(**changes: Any) -> dict[str, Any]:
    return {
        "layout": "l",
        "vocab_size": 10,
        "context_length": 256,
        "pool_pages": 64,
        "page_size": 16,
        "scheduling_policy": "vtc",
        **changes,
    }


def core_with_outbox() -> tuple[RouterCore, list[tuple[bytes, str]]]:
    core = RouterCore()
    sent: list[tuple[bytes, str]] = []
    core._send = lambda identity, message: sent.append((identity, message.op))  # type: ignore[method-assign]
    return core, sent


def register(core: RouterCore, identity: bytes, role: str, fp: dict[str, Any]) -> None:
    addr = "tcp://127.0.0.1:9" if role == "prefill" else ""  # a prefill's data socket
    core.on_message(identity, control.Register(role=role, fingerprint=fp, data_addr=addr))


def test_a_worker_with_another_kv_layout_is_refused():
    core, sent = core_with_outbox()
    register(core, b"P", "prefill", fingerprint())
    register(core, b"D", "decode", fingerprint(layout="other"))
    assert set(core.workers) == {b"P"}
    assert sent == [(b"P", "registered"), (b"D", "refused")]


def test_a_prefill_whose_data_address_is_not_tcp_host_port_is_refused():
    """Decode workers connect to what a prefill registers: "garbage" (or nothing) made zmq raise in the decode
    worker's loop. Refused at registration, counted, nothing registered."""
    core, sent = core_with_outbox()
    bad = ("garbage", "", "tcp://h", "ipc:///tmp/x", "tcp://a b:1", "tcp://h:1\n", "tcp://0.0.0.0:7100",
           "tcp://[::]:7100", "tcp://*:7100")  # fmt: skip  # the last three: where it listens, not reachable
    for addr in bad:
        core.on_message(b"P", control.Register("prefill", fingerprint(), addr))
    assert core.workers == {} and core.refused["malformed_data_addr"] == len(bad)
    core.on_message(b"P", control.Register("prefill", fingerprint(), "tcp://[::1]:7001"))
    assert set(core.workers) == {b"P"} and sent[-1] == (b"P", "registered")


def test_the_router_admits_against_the_smallest_context_and_places_only_on_pools_that_hold_it():
    """I5 per worker: admission passes a request that some worker of each role can hold (the largest pool),
    and placement never puts it on a worker whose own pool cannot hold it."""
    from kvfence.engine.errors import PoolCapacityExceeded
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core, _ = core_with_outbox()
    register(core, b"P", "prefill", fingerprint(context_length=512, pool_pages=40))
    register(core, b"D1", "decode", fingerprint(context_length=256, pool_pages=96))
    register(core, b"D2", "decode", fingerprint(context_length=384, pool_pages=8))
    prefill, decode = core.limits()
    assert (prefill.context_length, decode.context_length) == (256, 256)  # the smallest any path holds
    assert (prefill.pool_pages, decode.pool_pages) == (40, 96)  # the largest pool of each role
    params = SamplingParams(max_tokens=100)
    core.admit(100, params)  # 13 pages: only D1 holds it
    for n in range(6):  # whatever the turn, never D2
        core.route([1] * 100, params, RequestId(f"r{n}"), "t", lambda out: None)
        assert core._routed[RequestId(f"r{n}")].decode == b"D1"
    small = SamplingParams(max_tokens=10)
    placed = []
    for n in range(5):
        core.route([1] * 20, small, RequestId(f"s{n}"), "t", lambda out: None)
        placed.append(core._routed[RequestId(f"s{n}")].decode)
    # D1 has 78 of its 96 pages committed to the big ones: the small ones (2 pages) go to D2 (8 pages) until
    # D2 is the fuller of the two
    assert placed == [b"D2", b"D2", b"D2", b"D2", b"D1"]
    core.drain(b"D1")
    with pytest.raises(PoolCapacityExceeded):
        core.admit(100, params)  # the one pool that held it is draining


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


@pytest.mark.parametrize("policy", ["load", "round-robin"])
def test_placement_by_load_spreads_a_skewed_workload_where_round_robin_piles_it_up(policy):
    """Long and short prompts alternating over two prefill and two decode workers: round-robin sends every
    long one to the same pair, placement by load spreads them (asserted on the router's decisions)."""
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core = RouterCore(placement=policy)
    core._send = lambda identity, message: None  # type: ignore[method-assign]
    for identity, role in ((b"P0", "prefill"), (b"P1", "prefill"), (b"D0", "decode"), (b"D1", "decode")):
        register(core, identity, role, fingerprint(context_length=2048, pool_pages=256))
    for n in range(8):
        length = 1500 if n % 2 == 0 else 20
        core.route([1] * length, SamplingParams(max_tokens=16), RequestId(f"r{n}"), "t", lambda out: None)
    longs = [core.decisions[n] for n in range(0, 8, 2)]
    prefills = sorted(p.decode() for _, p, _ in longs)
    decodes = sorted(d.decode() for _, _, d in longs)
    if policy == "round-robin":
        assert len(set(prefills)) == 1 and len(set(decodes)) == 1  # all four long prompts on one pair
    else:
        assert prefills == ["P0", "P0", "P1", "P1"] and decodes == ["D0", "D0", "D1", "D1"]
    committed = {w.identity.decode(): w.committed_pages for w in core.workers.values()}
    assert sum(v for k, v in committed.items() if k.startswith("P")) == sum(
        -(-(n + 1) // 16) for n in (1500, 20) * 4
    )


def test_a_drained_worker_takes_no_new_requests_and_leaves_when_its_last_one_ends():
    from kvfence.engine.output import RequestOutput
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core, sent = core_with_outbox()
    for identity, role in ((b"P", "prefill"), (b"D0", "decode"), (b"D1", "decode")):
        register(core, identity, role, fingerprint())
    seen: list[RequestOutput] = []
    core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId("r"), "t", seen.append)
    busy = core._routed[RequestId("r")].decode
    idle = ({b"D0", b"D1"} - {busy}).pop()
    assert core.drain(busy) and busy in core.workers  # still serving "r"
    for n in range(4):
        core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId(f"n{n}"), "t", seen.append)
        assert core._routed[RequestId(f"n{n}")].decode == idle
    sent.clear()
    done = RequestOutput(RequestId("r"), (7,), "x", True, "length", None, 3, 1, "x", (7,))
    core.on_message(busy, control.Output(done))
    assert seen[-1].finished and seen[-1].error_code is None  # its request finished normally
    assert busy not in core.workers and (busy, "shutdown") in sent
    assert core.workers[idle].placed == 4


def test_a_tenant_stays_on_its_prefill_worker_until_that_worker_is_clearly_busier():
    """Prefix affinity by tenant (the prefix cache is per tenant and per prefill worker): a tenant's requests
    follow its last prefill worker while that one is at most AFFINITY_SLACK of a pool busier than the least
    loaded; another tenant goes where the load says."""
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId
    from kvfence.pd.router_core import AFFINITY_SLACK

    core, _ = core_with_outbox()
    for identity, role in ((b"P0", "prefill"), (b"P1", "prefill"), (b"D", "decode")):
        register(core, identity, role, fingerprint(context_length=4096, pool_pages=100))
    small = SamplingParams(max_tokens=4)
    for n in range(4):
        core.route([1] * 16, small, RequestId(f"a{n}"), "alice", lambda out: None)
    alice = {core._routed[RequestId(f"a{n}")].prefill for n in range(4)}
    assert len(alice) == 1  # 4 small prompts, all where alice's prefix cache is
    core.route([1] * 16, small, RequestId("b0"), "bob", lambda out: None)
    assert core._routed[RequestId("b0")].prefill not in alice  # bob goes to the idle one
    home = alice.pop()
    big = int(AFFINITY_SLACK * 100 + 8) * 16  # enough pages to make alice's worker clearly the busier one
    core.route([1] * big, small, RequestId("a-big"), "alice", lambda out: None)
    core.route([1] * 16, small, RequestId("a-next"), "alice", lambda out: None)
    assert core._routed[RequestId("a-big")].prefill == home
    assert core._routed[RequestId("a-next")].prefill != home  # now the load wins over the affinity


@pytest.mark.parametrize(
    "broken",
    [
        {"pool_pages": None},
        {"page_size": 0},
        {"context_length": "256"},
        {"layout": ""},
        {"vocab_size": True},
        {"scheduling_policy": "lottery"},
        {"scheduling_policy": None},
    ],
)
def test_a_registration_with_a_malformed_fingerprint_is_refused_and_changes_nothing(broken):
    """A peer's bad input: the fingerprint feeds admission and placement, so a missing or ill-typed field is
    refused at registration (counted), never a KeyError later."""
    core, sent = core_with_outbox()
    register(core, b"P", "prefill", fingerprint())
    fp = {k: v for k, v in fingerprint(**broken).items() if v is not None}
    register(core, b"X", "decode", fp)
    assert set(core.workers) == {b"P"} and sent[-1] == (b"X", "refused")
    assert core.refused["malformed_fingerprint"] == 1


def test_placement_counts_the_pages_a_worker_reports_held_beyond_what_the_router_committed():
    """A worker's heartbeat says how many of its pages are held (quarantined after a revoked transfer, leased by
    requests the router no longer tracks): placement sees the fuller of the two figures, not only its own."""
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core, _ = core_with_outbox()
    for identity, role in ((b"P", "prefill"), (b"D0", "decode"), (b"D1", "decode")):
        register(core, identity, role, fingerprint(pool_pages=64))
    pool = {"num_pages": 64, "num_free": 24, "num_cached": 10, "num_leased": 30, "num_quarantined": 10,
            "num_held": 0, "num_sealed": 0, "num_evictions": 0}  # fmt: skip
    core.on_message(b"D0", control.Heartbeat(worker=b"D0".hex(), pool_free=24, pool=pool))
    for n in range(2):
        core.route([1] * 16, SamplingParams(max_tokens=4), RequestId(f"r{n}"), "t", lambda out: None)
    assert {core._routed[RequestId(f"r{n}")].decode for n in range(2)} == {b"D1"}


def test_a_draining_prefill_worker_stays_until_its_requests_end_not_only_until_their_first_token():
    """A prefill worker sends the first token before it ships the pages: retiring it then would cut the
    transfer. It leaves when the request ends."""
    from kvfence.engine.output import RequestOutput
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    core, sent = core_with_outbox()
    for identity, role in ((b"P0", "prefill"), (b"P1", "prefill"), (b"D", "decode")):
        register(core, identity, role, fingerprint())
    core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId("r"), "t", lambda out: None)
    prefill = core._routed[RequestId("r")].prefill
    first = RequestOutput(RequestId("r"), (7,), "x", False, None, None, 3, 1, "x", (7,))
    core.on_message(prefill, control.Output(first))
    assert core.workers[prefill].placed == 0  # no longer loads it...
    core.drain(prefill)
    assert prefill in core.workers and (prefill, "shutdown") not in sent  # ...but its pages are still to go
    done = RequestOutput(RequestId("r"), (7, 8), "xy", True, "length", None, 3, 2, "y", (8,))
    core.on_message(b"D", control.Output(done))
    assert prefill not in core.workers and (prefill, "shutdown") in sent


def test_a_worker_scaled_in_before_it_registered_is_drained_when_it_does():
    core, sent = core_with_outbox()
    core.drain_matching(pid=77, name="decode-1")  # no keys here: matched by pid
    core.on_message(b"D", control.Register("decode", fingerprint(), pid=77))
    assert b"D" not in core.workers and (b"D", "shutdown") in sent


def test_a_dead_worker_sweep_survives_a_drained_worker_retired_during_it():
    """Dropping a dead prefill worker fails a request it shared with a draining decode worker, which retires it;
    the sweep then reaches the decode worker, gone already: no KeyError on the router's I/O thread."""
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId

    now = [0.0]
    core = RouterCore(clock=lambda: now[0])
    core._send = lambda identity, message: None  # type: ignore[method-assign]
    for identity, role in ((b"P", "prefill"), (b"D", "decode")):
        register(core, identity, role, fingerprint())
    core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId("r"), "t", lambda out: None)
    core.drain(b"D")
    now[0] = 100.0
    core.reap_dead_workers()
    assert core.workers == {}


def test_a_heartbeat_with_malformed_counts_is_refused():
    core, _ = core_with_outbox()
    register(core, b"D", "decode", fingerprint())
    for pool in ({"num_pages": "64", "num_free": 1}, {"num_free": 3}, {"num_pages": 4, "num_free": -1}):
        core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), pool=pool))
    core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), num_waiting=True))
    good = {"pages": 4, "running": 1, "waiting": 0, "virtual_tokens": 10.0}
    for numbers in (
        {**good, "pages": -1},
        {**good, "virtual_tokens": float("inf")},
        {"pages": 4},
        {**good, "x": 1},
    ):
        core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), tenants={"a": numbers}))
    assert core.refused["malformed_heartbeat"] == 8 and core.workers[b"D"].health == {}
    core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), tenants={"a": good}))
    assert core.workers[b"D"].health["tenants"] == {"a": good}
    # numbers placement divides and /metrics exports: beyond the pool, beyond a float, or missing fields (each
    # made every route raise OverflowError, or every scrape a KeyError)
    pages = core.workers[b"D"].pool_pages
    stats = {
        f: 0
        for f in ("num_leased", "num_quarantined", "num_held", "num_sealed", "num_cached", "num_evictions")
    }
    full = {"num_pages": pages, "num_free": pages, **stats}
    for bad in (
        {"pool": {**full, "num_pages": 10**400}},
        {"pool": {**full, "num_pages": pages + 1, "num_free": pages + 1}},
        {"pool": {**full, "num_leased": pages + 1}},
        {"pool": {"num_pages": pages, "num_free": pages}},
        {"num_waiting": 10**400},
        {"refused": {f"r{i}": 1 for i in range(65)}},
        {"tenants": {"a": {**good, "pages": 10**400}}},
    ):
        core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), **bad))
    assert core.refused["malformed_heartbeat"] == 15
    core.on_message(b"D", control.Heartbeat(worker=b"D".hex(), pool=full, num_waiting=3))
    assert core.workers[b"D"].health["pool"] == full and core.workers[b"D"].load() == 3 / 64
