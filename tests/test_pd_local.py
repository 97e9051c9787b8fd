"""The PD data path in one process: prefill engine -> transfer protocol -> decode engine, on the tiny model."""

from __future__ import annotations

import random

import pytest

from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.pd.local import LocalPDPair
from tests.conftest import make_engine, run_all


def run_pair(pair: LocalPDPair) -> dict:
    final = {}
    while pair.has_unfinished():
        for out in pair.step():
            if out.finished:
                final[out.request_id] = out
        pair.check_integrity()
    for engine in (pair.prefill, pair.decode):
        assert engine.pool.num_free == engine.pool.num_pages
    return final


def prompts(model, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_pd_output_equals_colocated(tiny_model):
    ps = prompts(tiny_model, 8, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    colocated = make_engine(tiny_model)
    for i, p in enumerate(ps):
        colocated.add_request(p, params, request_id=f"r{i}")
    expected = run_all(colocated)
    pair = LocalPDPair(make_engine(tiny_model, kv_pages=40), make_engine(tiny_model, kv_pages=64), window=2)
    for i, p in enumerate(ps):
        pair.add_request(p, params, f"r{i}")
    got = run_pair(pair)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}
    assert pair.receiver.stats.completed == 8 and not pair.receiver.stats.dropped


def test_placeholder_prefill_fails_the_victim_and_nobody_else(tiny_model):
    """The 2026 incident through the real engines: the victim gets an error, never a decode from stale pages."""
    ps = prompts(tiny_model, 4, seed=12)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = LocalPDPair(make_engine(tiny_model), make_engine(tiny_model))
    for i, p in enumerate(ps):
        reference.add_request(p, params, f"r{i}")
    expected = run_pair(reference)
    pair = LocalPDPair(make_engine(tiny_model, faults=Faults(placeholder_prefill=1)), make_engine(tiny_model))
    for i, p in enumerate(ps):
        pair.add_request(p, params, f"r{i}")
    got = run_pair(pair)
    failed = [k for k, v in got.items() if v.error_code]
    assert (
        [got[k].error_code for k in failed] == ["kv_integrity_error"]
        and got[failed[0]].text == ""
        and got[failed[0]].token_ids == ()
    )
    assert all(got[k].token_ids == expected[k].token_ids for k in got if k not in failed)


@pytest.mark.parametrize("knob", ["placeholder_prefill", "stale_frame"])
@pytest.mark.parametrize("checks", [True, False])
def test_prefill_side_faults_fail_the_victim_or_visibly_corrupt_without_checks(tiny_model, knob, checks):
    """A prefill that ships fewer pages than it claims (the 2026 incident), or a page it does not hold (finding 3
    of docs/verification.md: caught by the I1 check on the prefill's frame reads). With the checks on, exactly
    one request fails with `kv_integrity_error` and the rest match the clean run; with every check off
    (--no-integrity-checks on both sides), the victim decodes from stale pages and nobody notices."""
    ps = prompts(tiny_model, 4, seed=15)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = LocalPDPair(make_engine(tiny_model), make_engine(tiny_model))
    for i, p in enumerate(ps):
        reference.add_request([*p, *p, *p][:40], params, f"r{i}")
    expected = run_pair(reference)
    prefill = make_engine(tiny_model, faults=Faults(**{knob: 1}), integrity_checks=checks)
    pair = LocalPDPair(prefill, make_engine(tiny_model, integrity_checks=checks))
    for i, p in enumerate(ps):
        pair.add_request([*p, *p, *p][:40], params, f"r{i}")
    got = run_pair(pair)
    errors = {k: v.error_code for k, v in got.items() if v.error_code}
    same = [k for k in got if got[k].token_ids == expected[k].token_ids]
    if checks:
        assert list(errors.values()) == ["kv_integrity_error"] and len(same) == 3
    else:
        assert not errors and len(same) == 3  # one request decoded from pages that were not its own


def late_write_scenario(model, rx_checks: bool, engine_checks: bool):
    """Bug 2 of the design brief, with the `free_on_timeout` knob: decode times out tenant A's transfer and frees
    its pages while A's frames are still in flight; tenant B's transfer gets the same pages; A's frames land."""
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import RequestId
    from kvfence.pd.local import layout_fingerprint
    from kvfence.pd.messages import FrameAck, TransferId
    from kvfence.pd.receiver import Ready, TransferReceiver
    from kvfence.pd.sender import SendFinal, SendFrames, TransferSender

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a, b = prompts(model, 2, seed=13)
    a, b = a[:12], (b * 3)[:12]  # three pages each: B reuses exactly A's pages
    prefill = make_engine(model)
    prefill.add_request(a, params, request_id="A", prefill_only=True)
    prefill.add_request(b, params, request_id="B", prefill_only=True)
    handed = {}
    while len(handed) < 2:
        prefill.step()
        handed.update({r.request_id: r for r in prefill.take_handoffs()})
    decode = make_engine(model, kv_pages=5, integrity_checks=engine_checks)
    layout = layout_fingerprint(decode)
    rx = TransferReceiver(
        decode.pool,
        layout,
        decode.runner.cache.page_bytes(),
        decode.runner.cache.write_page,
        checks=rx_checks,
        faults=Faults(free_on_timeout=1),
    )

    def frames_and_final(rid: str, tid: int):
        req = handed[rid]
        ticket = rx.reserve(TransferId(tid), RequestId(rid), len(req.pages))
        tx = TransferSender(ticket, len(req.pages), layout, window=8, first_token=req.token_ids[-1])
        (send,) = tx.start()
        assert isinstance(send, SendFrames)
        frames = [tx.frame(i, prefill.runner.cache.read_page(req.pages[i])) for i in send.indices]
        finals = [a for f in frames for a in tx.on_ack(rx_ack(f)) if isinstance(a, SendFinal)]
        return frames, finals

    def rx_ack(frame):
        return FrameAck(frame.transfer_id, frame.index)

    def deliver(frames):
        for f in frames:
            rx.on_frame(f)  # validates, writes and stamps (or drops)

    decode.expect_transfer(a, params, "A")
    late_frames, _ = frames_and_final("A", 1)  # A's frames are in flight...
    rx.revoke(TransferId(1), "timeout")  # ...when decode gives up on A
    decode.fail_transfer("A", "transfer_timeout")
    decode.expect_transfer(b, params, "B")
    # waiting on frames only: unfinished, but nothing a step could run (the worker waits on its sockets)
    assert decode.has_unfinished() and not decode.has_steppable()
    frames, finals = frames_and_final("B", 2)
    deliver(frames)
    ready = rx.on_final(finals[0].final)
    assert isinstance(ready, Ready)
    decode.complete_transfer("B", ready.leases, ready.first_token)
    assert decode.has_steppable()
    deliver(late_frames)  # A's late frames arrive
    final = {}
    while decode.has_unfinished():
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out
    reference = make_engine(model)
    reference.add_request(b, params, request_id="B")
    return final["B"], run_all(reference)["B"]


def test_late_frames_after_timeout_are_dropped(tiny_model):
    got, expected = late_write_scenario(tiny_model, rx_checks=True, engine_checks=True)
    assert got.error_code is None and got.token_ids == expected.token_ids


def test_late_frames_that_land_are_caught_by_the_tag_check(tiny_model):
    """Receiver checks off (the historical receiver): the late write lands, but it stamps A's lease on B's page,
    and I1 fails B before it decodes from it."""
    got, _ = late_write_scenario(tiny_model, rx_checks=False, engine_checks=True)
    assert got.error_code == "kv_integrity_error" and got.text == ""


def test_late_frames_with_every_check_off_leak_into_the_next_request(tiny_model):
    got, expected = late_write_scenario(tiny_model, rx_checks=False, engine_checks=False)
    assert got.error_code is None and got.token_ids != expected.token_ids


def test_pd_logprobs_include_the_token_sampled_by_prefill(tiny_model):
    """The first token is sampled on the prefill side; its logprobs travel in the final frame, so PD returns
    one logprob entry per token, equal to colocated mode's."""
    from kvfence.engine.request import SamplingParams

    p = prompts(tiny_model, 1, seed=14)[0]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    colocated = make_engine(tiny_model)
    colocated.add_request(p, params, request_id="r")
    expected = []
    while colocated.has_unfinished():
        expected += [lp for out in colocated.step() for lp in out.logprobs]
    pair = LocalPDPair(make_engine(tiny_model), make_engine(tiny_model))
    pair.add_request(p, params, "r")
    got = []
    while pair.has_unfinished():
        got += [lp for out in pair.step() for lp in out.logprobs]
    assert len(got) == len(expected) == 5
    for (c1, top1), (c2, top2) in zip(got, expected, strict=True):
        assert abs(c1 - c2) < 1e-4 and [t for t, _ in top1] == [t for t, _ in top2]


def test_a_stale_abort_leaves_an_idle_engine_idle(tiny_model):
    """Aborts of requests that already ended (a client that left after its answer) reach PD workers often; they
    must not make an engine with nothing to do look steppable, or its worker loops without waiting and keeps
    the other worker on half the cores."""
    engine = make_engine(tiny_model)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), request_id="done")
    run_all(engine)
    engine.abort("done")
    engine.abort("never-seen")
    assert not engine.has_unfinished() and not engine.has_steppable()


def test_a_stop_string_inside_the_first_token_ends_the_request_as_colocated(tiny_model):
    """The first token is sampled on the prefill side, which has handed the request to its transfer: it must
    leave the stop string to decode (it used to end the handed-off request there, and the transfer then never
    came: a hang here, a transfer timeout over ZeroMQ)."""
    ps = prompts(tiny_model, 6, seed=3)
    base = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    colocated = make_engine(tiny_model)
    for i, p in enumerate(ps):
        colocated.add_request(p, base, request_id=f"r{i}")
    first_chars = {k: v.text[:1] for k, v in run_all(colocated).items() if v.text[:1].strip()}
    assert len(first_chars) >= 3
    reference = make_engine(tiny_model)
    pair = LocalPDPair(make_engine(tiny_model, kv_pages=40), make_engine(tiny_model, kv_pages=64), window=2)
    for i, p in enumerate(ps):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=(first_chars[rid],)) \
            if rid in first_chars else base  # fmt: skip
        reference.add_request(p, params, request_id=rid)
        pair.add_request(p, params, rid)
    expected = {k: (v.text, v.finish_reason) for k, v in run_all(reference).items()}
    got = {}
    for _ in range(500):  # bounded: the old behaviour never finishes
        if not pair.has_unfinished():
            break
        got.update({out.request_id: (out.text, out.finish_reason) for out in pair.step() if out.finished})
    assert got == expected
    assert sum(reason == "stop" for _, reason in got.values()) == len(first_chars)
