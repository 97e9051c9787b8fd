"""Tenant fairness (engine/fairness.py, engine/scheduler.py) and limits (server/tenants.py), asserted on
scheduling decisions and counters, never on wall-clock time.

- Two backlogged tenants: under vtc their virtual token counters stay within a bound (one request's prefill plus
  one step's work, doubled); under fcfs the tenant that came first takes everything (the control).
- A tenant's guaranteed pages stay free for it while it has work, whatever another tenant floods; a capped tenant
  never holds more than its cap; preemption never takes a tenant below its guarantee.
- Limits from the keys file give 429 with Retry-After and x-ratelimit-* headers before anything is queued or
  allocated.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from kvfence.engine.fairness import DECODE_COST, PREFILL_COST, Fairness, PrefillGate, TenantShare
from kvfence.engine.request import SamplingParams
from kvfence.server.tenants import TenantGate, TenantLimits, load_keys_file
from tests.conftest import make_engine
from tests.server_harness import MODEL, SCRAPE_KEY, running_server

PROMPT_A, PROMPT_B = 48, 16  # tokens: A sends long prompts, B short ones
BUDGET = 64  # max_num_batched_tokens


def flood(tiny_model, policy: str, shares: dict[str, TenantShare] | None = None, **overrides: Any):
    """Tenant A queues 24 requests first, then tenant B 24: both stay backlogged for a while."""
    engine = make_engine(tiny_model, policy=policy, max_num_batched_tokens=BUDGET, max_num_seqs=8,
                         prefill_batch_tokens=0, **overrides)  # fmt: skip
    engine.scheduler.fairness.shares.update(shares or {})
    vocab = tiny_model.config.vocab_size
    for i in range(24):
        ids = [(i * 7 + j) % (vocab - 3) + 3 for j in range(PROMPT_A)]
        engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), f"a{i}", tenant="A")
    for i in range(24):
        ids = [(i * 11 + j) % (vocab - 3) + 3 for j in range(PROMPT_B)]
        engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), f"b{i}", tenant="B")
    return engine


def steps(engine, limit: int = 400):
    """Step the engine, yielding after each step (integrity checked); fails if work is left after `limit` steps
    (a scheduler that stops scheduling must fail a test that drains, not pass it)."""
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
        engine.check_integrity()
        yield engine
    assert not engine.has_unfinished(), f"work left after {limit} steps"


def record_steps(scheduler: Any) -> list[dict[Any, int]]:
    """From now on, each step's schedule as {request id: tokens}, appended to the returned list."""
    seen: list[dict[Any, int]] = []
    real = scheduler.schedule

    def recording():
        out = real()
        seen.append({s.request.request_id: s.num_new_tokens for s in out})
        return out

    scheduler.schedule = recording
    return seen


def a_mid_prompt(
    tiny_model,
    budget: int,
    chunk: int,
    max_num_seqs: int = 8,
    b_weight: float | None = None,
    prompt_len: int = 200,
    max_tokens: int = 4,
):
    """A vtc engine (B's weight `b_weight`, if given) after one step of tenant A alone on a long prompt ("a"):
    A is in the middle of its prompt, ahead of any tenant that comes now. Returns the engine and its vocabulary
    size."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         prefill_batch_tokens=chunk)  # fmt: skip
    if b_weight is not None:
        engine.set_tenants({"B": TenantShare(weight=b_weight)})
    vocab = tiny_model.config.vocab_size
    ids = [(j * 5) % (vocab - 3) + 3 for j in range(prompt_len)]
    engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), "a", tenant="A")
    engine.step()  # A alone: its first chunk
    return engine, vocab


# ---- virtual token counters ----------------------------------------------------------------------------


def test_two_backlogged_tenants_stay_within_the_vtc_bound(tiny_model):
    bound = 2 * max(PREFILL_COST * max(PROMPT_A, BUDGET), DECODE_COST * 8 * 8)
    widest, both = 0.0, 0
    for engine in steps(flood(tiny_model, "vtc")):
        backlogged = engine.scheduler.backlogged()
        if {"A", "B"} <= backlogged:
            both += 1
            c = engine.scheduler.fairness.counters
            widest = max(widest, abs(c["A"] - c["B"]))
    assert both > 10 and widest <= bound, (both, widest, bound)


def test_under_fcfs_the_first_tenant_takes_the_service_the_control(tiny_model):
    bound = 2 * max(PREFILL_COST * max(PROMPT_A, BUDGET), DECODE_COST * 8 * 8)
    widest = 0.0
    for engine in steps(flood(tiny_model, "fcfs")):
        if {"A", "B"} <= engine.scheduler.backlogged():
            c = engine.scheduler.fairness.counters
            widest = max(widest, abs(c.get("A", 0) - c.get("B", 0)))
    assert widest > bound


@pytest.mark.parametrize("kv_pages", [256, 40])  # 40: A's running requests fill the pool
def test_b_starts_before_a_finishes_under_vtc_and_after_under_fcfs(tiny_model, kv_pages):
    """vtc: B's first request starts before any of A's finishes; with the pool full of A's requests, by
    preempting A's newest (A is above its share, B below). fcfs: B waits behind A's queue."""

    def a_done_when_b_starts(policy: str) -> int:
        for engine in steps(flood(tiny_model, policy, kv_pages=kv_pages)):
            s = engine.scheduler
            if "B" in {r.tenant for r in s.running}:
                return 24 - sum(1 for r in [*s.waiting, *s.running] if r.tenant == "A")
        raise AssertionError("B never ran")

    a_done_vtc = a_done_when_b_starts("vtc")
    a_done_fcfs = a_done_when_b_starts("fcfs")
    assert a_done_vtc == 0 and a_done_fcfs >= 16  # fcfs: B waits behind A's queue


def test_a_tenant_that_comes_back_cannot_bank_idle_service():
    f = Fairness({}, pool_pages=100)
    f.charge("A", 1000, 0)
    f.charge("B", 10, 0)
    f.activate("C", {"A", "B"})  # C arrives while A and B are backlogged: starts at the smallest, B's
    assert f.counters["C"] == f.counters["B"]
    f.charge("C", 5000, 0)
    f.activate("B", {"A", "C"})  # B comes back after idling: lifted to A's (the smaller of A, C)
    assert f.counters["B"] == f.counters["A"]
    assert f.next_tenant({"A", "B", "C"}) == "A"  # equal weights, nothing running: ties by name
    f.charge("D", 90_000, 0)  # D was served alone a while ago...
    f.activate("D", {"A", "B"})  # ...and carries no debt into a contended period: down to the largest, B's
    assert f.counters["D"] == f.counters["B"]


def test_a_tenant_that_comes_back_gets_at_most_one_credit():
    """The scheduler lifts a returning tenant to the smallest counter less a credit of one chunk: no further
    (it cannot bank more idle service), and a tenant that is already within the credit keeps its counter (going
    idle and back again does not add up). The credit counts from the largest counter, so tenants that come back
    together share it (counted from the smallest, the ninth of nine landed nine credits below the busy tenant:
    found by a review)."""
    f = Fairness({}, pool_pages=100)
    f.charge("A", 10_000, 0)
    f.activate("B", {"A"}, credit=256)
    assert f.counters["B"] == 10_000 - 256
    f.charge("B", 100, 0)
    f.activate("B", {"A"}, credit=256)  # back again at once: no second credit
    assert f.counters["B"] == 10_000 - 156
    f.activate("C", {"A", "B"}, credit=256)  # from the largest counter: C does not land a credit below B
    assert f.counters["C"] == 10_000 - 256
    f.charge("D", 0, 0)
    f.activate("D", {"A", "B", "C"}, credit=256)  # nor does D below C, who came back just before it
    assert f.counters["D"] == 10_000 - 256


def test_a_returning_tenants_burst_goes_before_the_busy_tenants_next_chunk(tiny_model):
    """B (weight 8) comes back while A is in the middle of a long prompt, with a burst of 20 short prompts (4
    units each after the weight, more with the burst's decodes: about 100 in all). Lifted to A's counter less a
    credit of one chunk (64), B finishes its whole burst before A's next chunk (A's finish: its counter + 64).
    Lifted to A's counter exactly, A's chunk cut into the burst, and B's last requests waited for it (on 2
    cores, a chunk of a long prompt is 100-250 ms: B's TTFT p99 under a flood is its burst's last request)."""
    engine, vocab = a_mid_prompt(
        tiny_model, budget=128, chunk=64, max_num_seqs=32, b_weight=8.0, prompt_len=240
    )
    for i in range(20):
        ids = [(i * 11 + j) % (vocab - 3) + 3 for j in range(32)]
        engine.add_request(ids, SamplingParams(max_tokens=64, ignore_eos=True), f"b{i}", tenant="B")
    seen = record_steps(engine.scheduler)
    for _ in range(50):
        if any("a" in step for step in seen):
            break
        engine.step()
        engine.check_integrity()
    before_a = [rid for step in seen[:-1] for rid in step]
    assert all(before_a.count(f"b{i}") >= 1 for i in range(20))  # every prompt of the burst (one chunk each)
    prompt_steps = [step for step in seen[:-1] if any(n > 1 for n in step.values())]
    assert all(sum(n for n in step.values() if n > 1) <= 64 for step in prompt_steps)
    for _ in steps(engine):
        pass


def test_ties_go_to_the_larger_weight_then_to_fewer_running_requests():
    """A tenant that just got work is lifted to exactly the smallest counter: the tie goes to it when its weight
    is larger or it has fewer requests running, not to whoever sorts first by name."""
    f = Fairness({"b": TenantShare(weight=8.0)}, pool_pages=10)
    f.charge("a", 100, 0)
    f.activate("b", {"a"})
    assert f.counters["a"] == f.counters["b"] and f.next_tenant({"a", "b"}, {"a": 2}) == "b"
    f = Fairness({}, pool_pages=10)
    f.charge("a", 100, 0)
    f.activate("b", {"a"})
    assert f.next_tenant({"a", "b"}, {"a": 2}) == "b"
    assert f.next_tenant({"a", "b"}, {"a": 1, "b": 1}) == "a"  # then by name


def test_a_newcomers_prompt_goes_before_the_next_chunk_of_a_tenant_at_its_counter(tiny_model):
    """Prompt work goes in counter order, whether a running prompt's next chunk or a new request. A's long prompt
    is being prefilled; B's request arrives, lifted to A's counter: the next step prefills B's prompt, and A's
    chunk, which would not fit beside it within --prefill-batch-tokens, waits (its pages stay) until B, which
    came back with a chunk's credit, has caught up or ended. Before, running chunks always went first, and B's
    first token waited for A's chunk (200-600 ms on 2 cores)."""
    engine, vocab = a_mid_prompt(tiny_model, budget=64, chunk=32)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = engine.scheduler.running[0]
    done_before = a.num_computed_tokens
    assert 0 < done_before < 200
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(24)], params, "b", tenant="B")
    seen = record_steps(engine.scheduler)
    engine.step()
    engine.check_integrity()
    b_id = next(r.request_id for r in engine.scheduler.running if r.tenant == "B")
    assert seen[0] == {b_id: 24}, seen[0]  # B's whole prompt, A's chunk not beside it
    assert a.num_computed_tokens == done_before and len(a.pages) > 0  # A waited, holding its pages
    for _ in range(4):  # B decodes its 3 other tokens; A's chunk comes back once B has caught up (or ended)
        engine.step()
    assert any(step.get(a.request_id, 0) > 1 for step in seen[1:]), seen


def test_prompt_work_goes_by_the_counter_after_it_a_short_prompt_before_a_long_chunk(tiny_model):
    """Prompt work goes by the counter each tenant would have after it (weighted fair queueing's finish time),
    not by the counter before it. B (weight 4) has just prefilled one request, so its counter is a little above
    A's; its second request's prompt (24 tokens, 6 after the weight) still finishes before A's next chunk (32):
    it goes first, and A's chunk waits a step. Ordered by the counters before the work, A's chunk went first and
    B's first token waited for it (on 2 cores: 200-600 ms per chunk of a long prompt)."""
    engine, vocab = a_mid_prompt(tiny_model, budget=64, chunk=32, b_weight=4.0, max_tokens=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(24)], params, "b1", tenant="B")
    engine.step()  # B's first request (lifted to A's counter; its prompt finishes before A's chunk)
    a = next(r for r in engine.scheduler.running if r.tenant == "A")
    counters = engine.scheduler.fairness.counters
    counters["B"] = counters["A"] + 2  # B is the more served now (past the credit it came back with) ...
    engine.add_request([(j * 7) % (vocab - 3) + 3 for j in range(24)], params, "b2", tenant="B")
    done_before = a.num_computed_tokens
    engine.step()  # ... but its 24-token prompt finishes first
    engine.check_integrity()
    b2 = next(r for r in engine.scheduler.running if r.request_id == "b2")
    # b2's whole prompt; beside it, A at most what the step's prompt tokens (--prefill-batch-tokens) leave
    assert b2.num_computed_tokens == 24 and a.num_computed_tokens - done_before <= 32 - 24
    done_before = a.num_computed_tokens
    engine.step()  # then A's chunk
    assert a.num_computed_tokens > done_before
    for _ in steps(engine):
        pass


def arrive_during_step(engine, arrive) -> None:
    """The next forward step calls `arrive()` while it runs, as the server's thread does when a request comes in
    mid-step: between its first and second layer if the step may be interrupted (the runner got a `stop`), else
    before its first."""
    real = engine.runner.run
    pending = [arrive]

    def run(plan, stop=None):
        if not pending:
            return real(plan, stop)
        if stop is None:
            pending.pop()()
            return real(plan, stop)
        asked = []

        def asking() -> bool:
            asked.append(1)
            if len(asked) == 2 and pending:
                pending.pop()()
            return stop()

        return real(plan, asking)

    engine.runner.run = run


def test_a_long_step_stops_between_layers_when_a_tenant_with_no_work_arrives(tiny_model):
    """A alone takes the whole step (200 prompt tokens). B's request arrives while it runs: the step stops at the
    next layer and counts as interrupted; nothing of it is computed, charged or emitted, and A keeps its pages.
    The next step starts B's prompt, with at most what is left of --prefill-batch-tokens of A's beside it. Run to
    its end, the step makes B's first token wait for all of A's 200 tokens (on 2 cores a lone tenant's
    2,048-token step: 0.7-1.1 s, B's whole TTFT tail in bench/fairness.py)."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=256, max_num_seqs=8,
                         prefill_batch_tokens=32)  # fmt: skip
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([(j * 5) % (vocab - 3) + 3 for j in range(200)], params, "a", tenant="A")
    b_ids = [(j * 3) % (vocab - 3) + 3 for j in range(24)]
    arrive_during_step(engine, lambda: engine.add_request(b_ids, params, "b", tenant="B"))
    seen = record_steps(engine.scheduler)
    assert engine.step() == []
    engine.check_integrity()
    a = engine.scheduler.running[0]
    assert seen[0] == {"a": 200} and engine.stats.steps_interrupted == 1 and engine.stats.steps == 0
    assert a.num_computed_tokens == 0 and len(a.pages) == 50 and a.num_output_tokens == 0
    assert engine.scheduler.fairness.counters.get("A", 0.0) == 0.0
    engine.step()
    engine.check_integrity()
    assert seen[1]["b"] == 24 and seen[1].get("a", 0) <= 32 - 24, seen[1]
    for _ in steps(engine):
        pass
    assert engine.stats.steps_interrupted == 1 and engine.snapshot().steps_interrupted == 1  # /metrics


def test_a_tenant_whose_interrupt_came_to_nothing_does_not_interrupt_again(tiny_model):
    """B's request stops A's long step and is aborted before the next (a client that hangs up): B had no work
    for it. B's next request during A's step lets the step end: else B could stop A's steps for free, again and
    again (found by a review: 50 of 50 steps stopped, A computed nothing). Once B has work in a step, it may
    interrupt again."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=256, max_num_seqs=8,
                         prefill_batch_tokens=32)  # fmt: skip
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([(j * 5) % (vocab - 3) + 3 for j in range(200)], params, "a", tenant="A")
    b_ids = [(j * 3) % (vocab - 3) + 3 for j in range(24)]

    def arrive_and_hang_up(rid: str) -> None:
        engine.add_request(b_ids, params, rid, tenant="B")
        engine.abort(rid)

    arrive_during_step(engine, lambda: arrive_and_hang_up("b0"))
    engine.step()
    assert engine.stats.steps_interrupted == 1
    arrive_during_step(engine, lambda: arrive_and_hang_up("b1"))
    engine.step()
    a = next(r for r in engine.scheduler.running if r.request_id == "a")
    assert engine.stats.steps_interrupted == 1 and a.num_computed_tokens == 200  # ran to its end
    engine.add_request(b_ids, params, "b2", tenant="B")  # B gets work in a step ...
    engine.add_request([(j * 7) % (vocab - 3) + 3 for j in range(200)], params, "a2", tenant="A")
    for _ in steps(engine):
        pass
    engine.add_request([(j * 9) % (vocab - 3) + 3 for j in range(200)], params, "a3", tenant="A")
    arrive_during_step(engine, lambda: engine.add_request(b_ids, params, "b3", tenant="B"))
    engine.step()
    assert engine.stats.steps_interrupted == 2  # ... and may interrupt again


@pytest.mark.parametrize(
    "case", ["same tenant", "--no-interrupt-steps", "fcfs", "step within --prefill-batch-tokens"]
)
def test_a_step_runs_to_its_end_when_it_may_not_be_interrupted(tiny_model, case):
    """The controls: a request of a tenant with work here already, a step that may not be interrupted
    (--no-interrupt-steps, fcfs) and a step no longer than a contended one do not stop: the step computes its
    prompt tokens and the newcomer waits for the next."""
    long_prompt = case != "step within --prefill-batch-tokens"
    engine = make_engine(tiny_model, policy="fcfs" if case == "fcfs" else "vtc", max_num_batched_tokens=256,
                         max_num_seqs=8, prefill_batch_tokens=32,
                         interrupt_steps=case != "--no-interrupt-steps")  # fmt: skip
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a_len = 200 if long_prompt else 32
    engine.add_request([(j * 5) % (vocab - 3) + 3 for j in range(a_len)], params, "a", tenant="A")
    tenant = "A" if case == "same tenant" else "B"
    b_ids = [(j * 3) % (vocab - 3) + 3 for j in range(24)]
    arrive_during_step(engine, lambda: engine.add_request(b_ids, params, "b", tenant=tenant))
    seen = record_steps(engine.scheduler)
    engine.step()
    engine.check_integrity()
    assert seen == [{"a": a_len}] and engine.stats.steps_interrupted == 0 and engine.stats.steps == 1
    a = next(r for r in engine.scheduler.running if r.request_id == "a")
    assert a.num_computed_tokens == a_len and a.num_output_tokens == 1


def test_while_tenants_compete_a_step_holds_one_piece_of_prompt_work(tiny_model):
    """While several tenants have work, a step holds its decodes and at most --prefill-batch-tokens of prompt
    tokens, whoever's they are: a request of one tenant waits for the whole step another's prompt makes. Before,
    each tenant's running prompt took its own chunk (the gate's), and two tenants' long prompts made a step of
    two chunks (here B, weighing 4, stays within the gate's chunk of A while both prefill). A lone tenant keeps
    the whole budget (the first step)."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=128, max_num_seqs=8,
                         prefill_batch_tokens=32)  # fmt: skip
    engine.set_tenants(
        {"B": TenantShare(weight=4.0)}
    )  # B's chunks cost it a quarter: both stay within the gate
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, tenant in enumerate("ABB"):
        ids = [(j * (i + 3)) % (vocab - 3) + 3 for j in range(240 if i == 0 else 120)]
        engine.add_request(ids, params, f"{tenant.lower()}{i}", tenant=tenant)
        if i == 0:
            seen = record_steps(engine.scheduler)
            engine.step()  # A alone: the whole budget
    assert seen[0] == {"a0": 128}
    both = []
    for _ in steps(engine):
        if {r.tenant for r in engine.scheduler.running} | {r.tenant for r in engine.scheduler.waiting} == {
            "A",
            "B",
        }:
            both.append(seen[-1])
    assert len(both) > 5
    for step in both:
        assert sum(n for n in step.values() if n > 1) <= 32, step


def decoding_tenant(tiny_model, n: int, **overrides: Any):
    """A vtc engine (32 prompt tokens a contended step) whose tenant A has `n` requests decoding (60 tokens)."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=256, prefill_batch_tokens=32,
                         **{"max_num_seqs": 16, **overrides})  # fmt: skip
    vocab = tiny_model.config.vocab_size
    for i in range(n):
        ids = [(j * (i + 2)) % (vocab - 3) + 3 for j in range(20)]
        engine.add_request(ids, SamplingParams(max_tokens=60, ignore_eos=True), f"a{i}", tenant="A")
    while len(engine.scheduler.running) < n or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    return engine, vocab


@pytest.mark.parametrize("b_weight", [8.0, 1.0])
def test_a_returning_tenants_burst_goes_before_the_others_decodes_within_its_credit(tiny_model, b_weight):
    """A's four requests are decoding when B comes back with three prompts (72 tokens). While B is the least
    served and has prompt work, its steps (32 prompt tokens each, --prefill-batch-tokens) hold no decode of A's (a
    flooder's decodes at long context made each step of B's burst a third longer on 2 cores). The credit bounds
    it: weighing 8, B's prompts (9 weighted tokens) stay within the chunk (32) it came back with, and A's decodes
    wait for all of them; weighing 1, B's first step spends the credit, and from then on every decode runs in
    every step, even when B is behind again with prompt work left."""
    engine, vocab = decoding_tenant(tiny_model, 4)
    engine.set_tenants({"B": TenantShare(weight=b_weight)})
    for i in range(3):
        ids = [(j * (i + 7)) % (vocab - 3) + 3 for j in range(24)]
        engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), f"b{i}", tenant="B")
    seen = record_steps(engine.scheduler)
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    prompt_tokens = [sum(n for n in step.values() if n > 1) for step in seen]
    a_decodes = [sum(1 for rid in step if rid.startswith("a")) for step in seen]
    assert all(n <= 32 for n in prompt_tokens), seen  # B's prompts, at most --prefill-batch-tokens a step
    if b_weight == 8.0:  # 72 prompt tokens, 9 weighted: within the credit, A's decodes held for all of them
        assert a_decodes == [0, 0, 0] and sum(prompt_tokens) == 72, seen
        engine.step()
        assert sum(1 for rid in seen[-1] if rid.startswith("a")) == 4, seen[-1]  # B's prompts done
    else:  # B's first 32 tokens spend its credit (32): even with A, A's decodes run again
        assert a_decodes == [0, 4, 4], seen
        for _ in range(6):  # and no decode is held again, whoever is behind
            decoding = {
                r.request_id for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1
            }
            engine.step()
            assert decoding <= set(seen[-1]) and sum(1 for rid in seen[-1] if rid.startswith("a")) == 4, seen
    for _ in steps(engine):
        pass


def test_held_decodes_run_when_the_returning_prompt_cannot(tiny_model):
    """B comes back with two prompts while A's three requests decode, and --max-num-seqs 4 lets only b0 start. Once
    b0's prompt is in, b1 cannot start, so nothing goes before A's decodes: they run (found by a review: held
    until b0 ended, 101 steps without a token of A's)."""
    engine, vocab = decoding_tenant(tiny_model, 3, max_num_seqs=4)
    engine.set_tenants({"B": TenantShare(weight=8.0)})
    for i in range(2):
        ids = [(j * (i + 7)) % (vocab - 3) + 3 for j in range(24)]
        engine.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True), f"b{i}", tenant="B")
    seen = record_steps(engine.scheduler)
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert seen[0] == {"b0": 24}, seen  # the burst first
    assert all(sum(1 for rid in step if rid.startswith("a")) == 3 for step in seen[1:]), seen


def test_held_decodes_do_not_make_room_for_more_prompt_tokens(tiny_model):
    """B and C (weighing 4) come back together while A's eight requests decode: A's decodes are held, and the
    steps still hold at most --prefill-batch-tokens prompt tokens (found by a review: the held decodes were
    counted in the step's budget, and prompt chunks took their room: 40 of 32)."""
    engine, vocab = decoding_tenant(tiny_model, 8)
    engine.set_tenants({"B": TenantShare(weight=4.0), "C": TenantShare(weight=4.0)})
    for i, tenant in enumerate("BC"):
        ids = [(j * (i + 5)) % (vocab - 3) + 3 for j in range(100)]
        engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), tenant.lower(), tenant=tenant)
    seen = record_steps(engine.scheduler)
    for _ in range(6):
        engine.step()
        engine.check_integrity()
    assert any(not any(rid.startswith("a") for rid in step) for step in seen), seen  # some held
    assert all(sum(n for n in step.values() if n > 1) <= 32 for step in seen), seen


def test_an_interrupted_steps_partial_writes_are_never_read():
    """With the simulator's runner (kvfence/sim/runner.py: every K/V slot says which request wrote it for which
    position, every read is checked) a step of A's is interrupted after its rows' writes landed, unstamped and
    uncounted; A's prompts then run again beside B's. No read sees a record that is not the reader's own,
    and every request's tokens are the ones a clean run gives."""
    from typing import cast

    from kvfence.config import Config
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.model_runner import ModelRunner
    from kvfence.sim.nodes import VOCAB, sim_model
    from kvfence.sim.runner import ProvenanceRunner, expected_token

    runner = ProvenanceRunner(64, 4, VOCAB)
    config = Config.of(model="sim", dtype="float32", page_size=4, kv_pages=64, context_length=128,
                       max_num_seqs=8, max_num_batched_tokens=64, prefill_batch_tokens=8,
                       enable_prefix_cache=False)  # fmt: skip
    engine = LLMEngine(config, sim_model(), runner=cast(ModelRunner, runner))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = {"a1": [5 + j % 40 for j in range(30)], "a2": [7 + j % 30 for j in range(27)],
               "a3": [4 + j % 50 for j in range(21)]}  # fmt: skip
    for rid in ("a1", "a2", "a3"):
        engine.add_request(prompts[rid], params, rid, tenant="A")
    prompts["b"] = [9 + j % 20 for j in range(10)]
    arrive_during_step(engine, lambda: engine.add_request(prompts["b"], params, "b", tenant="B"))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    assert engine.stats.steps_interrupted == 1 and not runner.foreign_reads
    for rid, prompt in prompts.items():
        want = [expected_token(rid, len(prompt) + i, VOCAB) for i in range(6)]
        assert list(final[rid].token_ids) == want, rid


@pytest.mark.parametrize("newcomer", [True, False], ids=["another-tenant", "same-tenant"])
def test_a_pd_prefill_worker_reads_its_socket_between_layers_and_stops_for_a_newcomer(tiny_model, newcomer):
    """A PD worker is one thread: only it can see a request arrive. Between layers of a long step it reads the
    router's frames (kept, in order, for after the step) and stops the step for a request of a tenant with no
    work here; the newcomer's prompt then runs first. A request of the tenant already here lets the step end,
    and is handled after it, in order."""
    import zmq

    from kvfence.pd import control
    from kvfence.pd.worker import PrefillWorker

    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=256, max_num_seqs=8,
                         prefill_batch_tokens=32)  # fmt: skip
    vocab = tiny_model.config.vocab_size
    params = control.params_to_json(SamplingParams(max_tokens=4, ignore_eos=True))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = PrefillWorker(engine, f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0", ctx=ctx)
    try:
        worker.control.send(b"hello")  # the router learns the worker's identity
        identity, _ = router.recv_multipart()

        def send(rid: str, tenant: str, n: int, k: int) -> None:
            ids = tuple((j * k) % (vocab - 3) + 3 for j in range(n))
            msg = control.Prefill(rid, n, ids, params, tenant=tenant)  # type: ignore[arg-type]
            router.send_multipart([identity, control.encode(msg)])
            assert worker.control.poll(10_000), "the frame did not arrive"

        send("a", "A", 200, 5)
        worker._drain(worker.control)
        send("b", "B" if newcomer else "A", 24, 3)  # waits on the socket when the step starts
        seen = record_steps(engine.scheduler)
        worker.role.step()
        engine.check_integrity()
        assert seen[0] == {"a": 200}
        assert engine.stats.steps_interrupted == (1 if newcomer else 0)
        assert engine.stats.steps == (
            0 if newcomer else 1
        )  # interrupted, A computed nothing; else A's prompt done
        assert len(worker._early) == 1 and not engine.scheduler.waiting  # read, not yet handled
        worker._drain(worker.control)
        worker.role.step()
        engine.check_integrity()
        assert seen[1]["b"] == 24 and seen[1].get("a", 0) <= 32 - 24 if newcomer else seen[1]["b"] == 24
    finally:
        worker.close()
        router.close(0)
        ctx.term()


def test_a_step_is_never_empty_while_a_tenant_could_run_ungated(tiny_model):
    """Work conserving (found by a review): B comes back a chunk behind A and cannot start (max_num_seqs 1,
    A's request runs); A's next piece is gated (its counter after it would be more than a chunk past B's).
    Gated only, the step stood empty and the engine waited for a new request that might never come; the step
    then runs ungated: A's chunk."""
    engine, vocab = a_mid_prompt(tiny_model, budget=64, chunk=32, max_num_seqs=1)  # A alone: 64 tokens
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(24)], params, "b", tenant="B")
    seen = record_steps(engine.scheduler)
    engine.step()
    assert seen[0].get("a", 0) > 1, seen[0]
    for _ in steps(engine):
        pass
    assert any("b" in step for step in seen)


def test_the_prefill_gate_counts_the_piece_of_work_a_tenant_ahead_would_add():
    """A tenant ahead of the least served may prefill only a piece that keeps its counter within one chunk of
    the least served's; the least served itself always gets its chunk, whatever its weight."""
    gate = PrefillGate({"A": 10.0, "B": 0.0}, low=0.0, chunk=32, weights={"A": 1.0, "B": 0.25})
    assert gate.allowance("B", 100) == 32  # the least served: its chunk, though 32 / 0.25 is past the chunk
    assert gate.allowance("A", 32) == 0  # 10 + 32 > 0 + 32
    assert gate.allowance("A", 20) == 20  # 10 + 20 <= 32
    gate.take("A", 20)
    assert gate.allowance("A", 32) == 12  # what is left of its chunk this step (10 + 12 <= 32)


def test_a_tenant_ahead_does_not_add_its_chunk_to_a_step_finishing_anothers_prompt(tiny_model):
    """B (weight 8) comes back while A's long prompt is being prefilled, with one 40-token prompt: its step
    computes that prompt alone. A's next chunk would take A's counter more than a chunk past B's (B came back a
    chunk behind A, and its prompt costs 5 after the weight), so it waits until B has caught up, instead of
    filling the rest of B's step. Gated by the counter before the work, A's chunk joined (A was within a chunk
    of B), and B's first token waited for it: at long context a chunk is 150-250 ms on 2 cores, the TTFT p99 of
    B's burst in bench/noisy_engine.py."""
    engine, vocab = a_mid_prompt(tiny_model, budget=64, chunk=64, b_weight=8.0, prompt_len=240)
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(40)], SamplingParams(max_tokens=8), "b",
                       tenant="B")  # fmt: skip
    seen = record_steps(engine.scheduler)
    engine.step()
    engine.check_integrity()
    assert seen[0] == {"b": 40}, seen[0]
    for _ in steps(engine):
        pass
    assert any(step.get("a", 0) > 1 for step in seen[1:])  # A's chunks came back


def test_running_prompts_go_by_the_counter_after_their_chunk_a_short_remainder_first(tiny_model):
    """Running prompts' chunks are ordered among themselves as waiting requests are: by the counter after the
    chunk. B (weight 4) got a 32-token chunk of its 40-token prompt and is set a little ahead of A; its last 8
    tokens (2 after the weight) still finish before A's next chunk (32) and go first, and A's chunk takes what
    is left of the step. Ordered by the counters before the work, A's chunk took the whole step and B's first
    token waited for it (found in bench/noisy_engine.py's step log: B's last request of its first wave waited
    450 ms on 2 cores)."""
    engine, vocab = a_mid_prompt(tiny_model, budget=32, chunk=32, b_weight=4.0)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(40)], params, "b", tenant="B")
    engine.step()  # B's first chunk (A's next one is gated: B came back a chunk behind A)
    scheduler = engine.scheduler
    a, b = (next(r for r in scheduler.running if r.request_id == rid) for rid in ("a", "b"))
    assert b.num_computed_tokens == 32 and a.num_computed_tokens == 32
    counters = scheduler.fairness.counters
    counters["B"] = counters["A"] + 2  # B is the more served now (past the credit it came back with) ...
    seen = record_steps(scheduler)
    engine.step()  # ... but its last 8 tokens finish first
    engine.check_integrity()
    assert seen[0] == {"b": 8, "a": 24}, seen[0]
    assert b.num_computed_tokens == 40 and len(b.output_token_ids) == 1
    for _ in steps(engine):
        pass


def test_prompt_work_is_ranked_only_among_tenants_the_gate_lets_prefill(tiny_model):
    """The finish-time order ranks only tenants the prefill gate lets prefill. T is more than a chunk ahead of
    X, the least served, but its 16-token prompt finishes before X's chunk (X's weight is 0.25). Ranked anyway
    (found by a review; this test failed before the fix), X's chunk yielded to T, the gate refused T, and X's
    chunk, deferred behind U's, no longer fit --prefill-batch-tokens: the least served tenant got nothing, and
    with a step's prompt work cut to one chunk while tenants compete it would get nothing in any later step
    either. X's chunk comes after U's while U's finishes first (weighted fair queueing: X weighs a quarter),
    and T, gated, gets nothing before it."""
    engine = make_engine(tiny_model, policy="vtc", max_num_batched_tokens=64, max_num_seqs=8,
                         prefill_batch_tokens=32)  # fmt: skip
    engine.set_tenants({"X": TenantShare(weight=0.25)})
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([(j * 5) % (vocab - 3) + 3 for j in range(200)], params, "x", tenant="X")
    engine.add_request([(j * 7) % (vocab - 3) + 3 for j in range(200)], params, "u", tenant="U")
    scheduler = engine.scheduler
    while len(scheduler.running) < 2:
        engine.step()  # both prompts started, neither done
    assert all(r.num_computed_tokens < 100 for r in scheduler.running)
    scheduler.fairness.activate = lambda *args: None  # keep the counters set below
    engine.add_request([(j * 3) % (vocab - 3) + 3 for j in range(16)], params, "t", tenant="T")
    scheduler.fairness.counters.update({"X": 0.0, "U": 0.0, "T": 40.0})  # T: gated (40 + 16 > 0 + 32)
    seen = record_steps(scheduler)
    for _ in range(6):
        engine.step()
        engine.check_integrity()
    first_x = next(i for i, step in enumerate(seen) if step.get("x", 0) > 1)
    assert first_x <= 4 and all(step == {"u": 32} for step in seen[:first_x]), seen


def test_a_yielded_chunk_preempted_in_the_same_step_is_not_scheduled(tiny_model):
    """Z's chunk (92 tokens) yields to newcomers with shorter first chunks; making room for C preempts Z's
    request (back to waiting, its pages released), and D then fills the step (max_num_seqs), leaving budget.
    The yielded chunk must not run: scheduled anyway, it leased pages to a waiting request and computed a row
    the engine then ignored (found by a review of the change; this test failed before the fix). The page check
    that normally stops C before `_make_room` (the waiting loop's `_may_take`) is waved through here: with the
    prefix cache a start can still fall short after it, and that is the path under test."""
    engine = make_engine(tiny_model, policy="vtc", kv_pages=56, page_size=4, max_num_batched_tokens=128,
                         max_num_seqs=3, prefill_batch_tokens=0)  # fmt: skip
    vocab = tiny_model.config.vocab_size
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request([(j * 5) % (vocab - 3) + 3 for j in range(220)], params, "z", tenant="Z")
    engine.step()  # Z alone: 128 tokens, 32 of the 56 pages
    engine.set_tenants({"D": TenantShare(weight=0.08)})  # after C in the counters' order: 8 / 0.08 > 90
    for tenant, n in (("B", 8), ("C", 90), ("D", 8)):  # B and C before Z's next chunk (92 tokens)
        engine.add_request(
            [(j * 3 + n) % (vocab - 3) + 3 for j in range(n)], params, tenant.lower(), tenant=tenant
        )
    scheduler, real = engine.scheduler, engine.scheduler.schedule
    seen = []

    def checked():
        out = real()
        seen.append(out)
        ids = [s.request.request_id for s in out]
        assert len(ids) == len(set(ids)), ids
        assert all(s.request.state.name == "RUNNING" for s in out), [
            (s.request.tenant, s.request.state) for s in out
        ]
        assert all(not r.pages for r in scheduler.waiting), [
            (r.tenant, len(r.pages)) for r in scheduler.waiting
        ]
        return out

    scheduler.schedule = checked
    scheduler._may_take = lambda request, pages: True
    engine.step()
    del scheduler._may_take
    assert scheduler.num_preemptions == 1 and {s.request.tenant for s in seen[0]} == {"B", "C", "D"}
    for _ in steps(engine):
        pass


def test_weights_divide_the_charge():
    f = Fairness({"gold": TenantShare(weight=4.0)}, pool_pages=10)
    f.charge("gold", 400, 0)
    f.charge("bronze", 100, 0)
    assert f.counters["gold"] == f.counters["bronze"] == 100.0


# ---- pages: guarantees, caps, preemption ---------------------------------------------------------------


def test_a_guarantee_stays_free_for_its_tenant_while_another_floods(tiny_model):
    """B is guaranteed 24 pages of a pool of 48; A floods it with long requests. While B has work, A never holds
    more than the other 24 (vtc); under fcfs A takes far more (the control)."""

    def most_a_holds(policy: str) -> int:
        top = 0
        for engine in steps(flood(tiny_model, policy, {"B": TenantShare(min_pages=24)}, kv_pages=48)):
            if "B" in engine.scheduler.backlogged():
                top = max(top, engine.scheduler.held_pages().get("A", 0))
        return top

    assert 0 < most_a_holds("vtc") <= 24 < most_a_holds("fcfs")


def test_pages_held_outside_the_scheduler_count_for_shares_but_never_stall_the_gate(tiny_model):
    """PD: a tenant whose only pages await a transfer (prefill) or a reservation (decode) has nothing to run: the
    prefill gate must not hold back a tenant far ahead of it (an empty step), while its guarantee still keeps
    pages from the other tenant."""
    engine = make_engine(
        tiny_model, policy="vtc", kv_pages=32, max_num_batched_tokens=64, prefill_batch_tokens=16
    )
    engine.set_tenants({"X": TenantShare(min_pages=16)})
    engine.scheduler.reserved_pages = lambda: {"X": 0}  # queued for a reservation, or its pages in flight
    ids = list(range(3, 3 + 40))  # 44 tokens with the output: 11 pages of 4; X's guarantee leaves A 16 of 32
    engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), "a0", tenant="A")
    engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), "a1", tenant="A")
    engine.scheduler.fairness.counters.update({"X": 0.0, "A": 10_000.0})  # A far ahead of X
    top = 0
    for _ in steps(engine):
        top = max(top, engine.scheduler.held_pages().get("A", 0))
    assert engine.scheduler.fairness.counters["A"] > 10_000.0  # A ran, far ahead of X's counter
    assert 0 < top <= 16  # never into the pages X is guaranteed


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_tenant_below_its_share_starts_at_once_when_the_flooder_fills_the_pool(tiny_model, policy):
    """A's running requests fill the pool, every one of them in every step: vtc preempts A's newest before the
    step and starts B's request at once (else B would wait for one of A's to end); fcfs makes B wait (control)."""
    engine = make_engine(
        tiny_model, policy=policy, kv_pages=24, max_num_batched_tokens=64, prefill_batch_tokens=0
    )
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for i in range(2):  # 40 + 48 tokens each: 22 pages at the end; together they outgrow the pool of 24
        engine.add_request(list(range(3 + i, 43 + i)), params, f"a{i}", tenant="A")
    gen = steps(engine)
    while engine.pool.num_free > 2:  # A's two requests grow until the pool is nearly full
        next(gen)
    engine.add_request(list(range(3, 19)), SamplingParams(max_tokens=4, ignore_eos=True), "b0", tenant="B")
    waited = 0
    while not any(r.request_id == "b0" and r.num_computed_tokens > 0 for r in engine.scheduler.running):
        next(gen)
        waited += 1
    if policy == "vtc":
        assert waited == 1 and engine.scheduler.num_preemptions >= 1  # the next step, A preempted for it
    else:
        assert waited > 1  # behind A's requests


def test_a_capped_tenant_never_holds_more_than_its_cap(tiny_model):
    shares = {"A": TenantShare(max_pages=20)}
    top = 0
    for engine in steps(flood(tiny_model, "vtc", shares, kv_pages=96)):
        top = max(top, engine.scheduler.held_pages().get("A", 0))
    assert 0 < top <= 20


def test_preemption_takes_from_the_tenant_furthest_above_its_share():
    f = Fairness({"B": TenantShare(min_pages=10)}, pool_pages=40)
    held = {"A": 28, "B": 12}
    # A is 8 above its half of the pool, B is 8 below: A goes
    assert f.victim(held, {"A": 4, "B": 4}, {"A", "B"}) == "A"
    # preempting B's request would take it below its guarantee: never, even if it were the only candidate
    assert f.victim(held, {"B": 4}, {"A", "B"}) is None
    assert f.victim({"A": 8, "B": 32}, {"A": 4, "B": 4}, {"A", "B"}) == "B"


def test_guarantees_beyond_the_pool_are_refused():
    with pytest.raises(ValueError, match="more than the pool"):
        Fairness({"A": TenantShare(min_pages=30), "B": TenantShare(min_pages=30)}, pool_pages=50)


def test_shares_under_fcfs_are_refused_not_ignored(tiny_model):
    """Colocated as in PD (the router refuses such a worker): fcfs applies no weight, guarantee or cap, so a keys
    file that sets them is refused when the engine starts (`kvfence serve` exits 2); plain tenants are fine."""
    with pytest.raises(ValueError, match="fcfs would not apply"):
        Fairness({"A": TenantShare(max_pages=8), "B": TenantShare()}, pool_pages=50, enabled=False)
    engine = make_engine(tiny_model, policy="fcfs")
    with pytest.raises(ValueError, match="tenants A have weights"):
        engine.set_tenants({"A": TenantShare(weight=2.0)})
    assert Fairness({"A": TenantShare()}, pool_pages=50, enabled=False).shares == {"A": TenantShare()}


# ---- the keys file --------------------------------------------------------------------------------------


def test_the_keys_file_takes_tables_with_limits_and_refuses_unknown_fields(tmp_path):
    good = tmp_path / "keys.toml"
    good.write_text(
        '[tenants.alice]\nkeys = ["ka1", "ka2"]\nweight = 2\nmin_pages = 8\nmax_pages = 64\nmax_in_flight = 4\n'
        'requests_per_minute = 60\ntokens_per_minute = 1000\n[tenants.bob]\nkeys = ["kb"]\n'
    )
    f = load_keys_file(good)
    assert f.keys == {"ka1": "alice", "ka2": "alice", "kb": "bob"}
    assert f.shares["alice"] == TenantShare(2.0, 8, 64) and f.shares["bob"] == TenantShare()
    assert f.limits["alice"] == TenantLimits(4, 60, 1000) and not f.limits["bob"].any
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"k1": "t1"}))
    assert load_keys_file(flat).keys == {"k1": "t1"}
    for bad, why in [
        ('[tenants.a]\nkeys = ["k"]\nburst = 5\n', "unknown fields"),
        ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]\n', "listed twice"),
        ('[tenants.a]\nkeys = ["k"]\nmax_in_flight = 0\n', "max_in_flight"),
        ('[tenants.a]\nkeys = ["k"]\nweight = -1\n', "weight"),
        ("[tenants.a]\nkeys = []\n", "keys"),
        ('[tenants.a]\nkeys = ["k"]\nmin_pages = 9\nmax_pages = 4\n', "max_pages"),
        ("[tenants]\n", "names no tenant"),  # every tenant commented out: not an open server
    ]:
        path = tmp_path / "bad.toml"
        path.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_keys_file(path)
    for bad, why in [('{"tenants": {}}', "names no tenant"), ('{"k1": "alice", "k1": "bob"}', "given twice")]:
        path = tmp_path / "bad.json"
        path.write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_keys_file(path)


# ---- 429s at the front door -----------------------------------------------------------------------------


def test_the_gate_limits_rates_and_says_when_to_retry():
    now = [0.0]
    in_flight = {"a": 0}
    gate = TenantGate({"a": TenantLimits(max_in_flight=2, requests_per_minute=3, tokens_per_minute=600)},
                      in_flight.__getitem__, clock=lambda: now[0])  # fmt: skip
    headers = gate.admit("a", 1, 100)
    assert (
        headers["x-ratelimit-remaining-requests"] == "2" and headers["x-ratelimit-remaining-tokens"] == "500"
    )
    in_flight["a"] = 2
    with pytest.raises(Exception) as e:
        gate.admit("a", 1, 100)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"  # type: ignore[attr-defined]
    in_flight["a"] = 0
    gate.admit("a", 1, 100)
    gate.admit("a", 1, 100)
    with pytest.raises(Exception) as e:  # 3 requests in the last minute
        gate.admit("a", 1, 100)
    assert e.value.code == "rate_limit_exceeded" and int(e.value.headers["Retry-After"]) == 60  # type: ignore[attr-defined]
    now[0] = 61.0
    gate.admit("a", 1, 590)  # the bucket refilled to 600
    with pytest.raises(Exception) as e:
        gate.admit("a", 1, 100)  # 10 left; 90 more take 9 s at 10 tokens/s
    assert e.value.headers["Retry-After"] == "9"  # type: ignore[attr-defined]
    with pytest.raises(Exception) as e:
        gate.admit("a", 1, 601)  # more than a minute's worth: never, so no Retry-After
    assert e.value.status == 429 and "Retry-After" not in e.value.headers  # type: ignore[attr-defined]
    assert gate.admit("unlimited", 5, 10**9) == {}


def test_a_limited_tenant_gets_429_before_anything_is_allocated(tiny_model):
    limits = {"tenant-a": TenantLimits(requests_per_minute=2, tokens_per_minute=400)}
    with running_server(
        tiny_model, api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}, tenant_limits=limits
    ) as srv:

        def post(key: str, **extra: Any) -> httpx.Response:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True, **extra}
            return httpx.post(f"{srv.base_url}/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"})  # fmt: skip

        ok = post("key-a")
        assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "2"
        assert post("key-a").status_code == 200
        before = srv.pool_stats()
        refused = post("key-a")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["Retry-After"]) >= 1 and "x-ratelimit-reset-requests" in refused.headers
        assert srv.pool_stats() == before
        too_big = post("key-b", max_tokens=4)  # another tenant is not limited by A's use
        assert too_big.status_code == 200 and "x-ratelimit-limit-requests" not in too_big.headers
        assert srv.metric("kvfence_requests_total", outcome="rejected", reason="rate_limit_exceeded",
                          tenant="tenant-a") == 1  # fmt: skip
        # per-tenant metrics: tokens served, time to first token, the scheduler's counters
        assert srv.metric("kvfence_tenant_tokens_total", tenant="tenant-a", kind="completion") == 8
        assert srv.metric("kvfence_tenant_time_to_first_token_seconds_count", tenant="tenant-b") == 1
        scraped = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
        lines = dict(
            line.rsplit(" ", 1) for line in scraped.splitlines() if line.startswith("kvfence_tenant_")
        )
        assert float(lines['kvfence_tenant_virtual_tokens_total{tenant="tenant-a"}']) > 0
        assert float(lines['kvfence_tenant_kv_pages{tenant="tenant-a"}']) == 0  # nothing running now


def test_a_tenant_ahead_gets_at_most_a_chunk_of_prefill_per_step_and_decodes_never_wait(tiny_model):
    """While B has work, A's prompt tokens per step stay within one chunk (prefill_batch_tokens) and only while A
    is within a chunk of B's counter; B's running requests run every step. fcfs: A's prefill fills the budget."""

    def widest_a_prefill(policy: str) -> int:
        engine = flood(tiny_model, policy)
        engine.scheduler.config = type(engine.scheduler.config)(
            max_num_seqs=8, max_num_batched_tokens=BUDGET, prefill_batch_tokens=16, policy=policy
        )
        seen, real = [], engine.scheduler.schedule

        def recording():
            out = real()
            seen.append((engine.scheduler.backlogged(), out))
            return out

        engine.scheduler.schedule = recording
        widest = 0
        for _ in steps(engine):
            backlogged, out = seen[-1]
            a_prefill = sum(s.num_new_tokens for s in out if s.request.tenant == "A" and s.num_new_tokens > 1)
            if {"A", "B"} <= backlogged:
                widest = max(widest, a_prefill)
                b_running = [r for r in engine.scheduler.running if r.tenant == "B"]
                if policy == "vtc":
                    assert {s.request.request_id for s in out} >= {
                        r.request_id for r in b_running if r.num_computed_tokens >= r.num_prompt_tokens
                    } or not b_running
        return widest

    assert widest_a_prefill("vtc") <= 16 < widest_a_prefill("fcfs")


def test_pd_routers_send_tenant_shares_and_refuse_workers_that_would_not_apply_them():
    """PD: the router sends the keys file's weights and page shares at registration (each worker's scheduler
    applies them to its own queue and pool). Never accepted and ignored: a worker running fcfs while tenants have
    shares, or whose pool cannot hold the guarantees, is refused (counted), and nothing is registered."""
    from kvfence.pd import control
    from kvfence.pd.router_core import RouterCore

    shares = {"a": TenantShare(weight=2.0, min_pages=10), "b": TenantShare(max_pages=30)}
    core = RouterCore(tenants=shares)
    sent: list[tuple[bytes, control.ControlMessage]] = []
    core._send = lambda identity, message: sent.append((identity, message))  # type: ignore[method-assign]

    def register(identity: bytes, role: str, **fp: Any) -> control.ControlMessage:
        base = {"layout": "l", "vocab_size": 10, "context_length": 64, "pool_pages": 64, "page_size": 4,
                "scheduling_policy": "vtc"}  # fmt: skip
        addr = "tcp://127.0.0.1:9" if role == "prefill" else ""
        core.on_message(identity, control.Register(role, {**base, **fp}, addr))
        return sent[-1][1]

    answer = register(b"P", "prefill")
    assert isinstance(answer, control.Registered) and answer.tenants == shares
    # the message survives the wire, and a malformed share is a malformed frame
    assert control.decode(control.encode(answer)) == answer
    frame = control.encode(answer).replace(b'"weight":2.0', b'"weight":-1')
    with pytest.raises(control.ControlError):
        control.decode(frame)
    refused = register(b"D", "decode", scheduling_policy="fcfs")
    assert isinstance(refused, control.Refused) and "fcfs would not apply" in refused.reason
    small = register(b"D2", "decode", pool_pages=8)
    assert isinstance(small, control.Refused) and "min_pages add up to 10" in small.reason
    assert set(core.workers) == {b"P"} and core.refused["tenant_shares"] == 2
    # without shares an fcfs worker is welcome (nothing to ignore)
    plain = RouterCore()
    plain._send = lambda identity, message: sent.append((identity, message))  # type: ignore[method-assign]
    fcfs = {"layout": "l", "vocab_size": 10, "context_length": 64, "pool_pages": 8, "page_size": 4,
            "scheduling_policy": "fcfs"}  # fmt: skip
    plain.on_message(b"F", control.Register("decode", fcfs))
    assert isinstance(sent[-1][1], control.Registered) and sent[-1][1].tenants == {}


def test_a_request_larger_than_its_tenants_cap_is_refused_at_admission(tiny_model):
    """I5 with shares: a request whose whole sequence needs more pages than its tenant may hold would wait for
    pages forever; the engine refuses it (400) before anything is allocated, other tenants' alike requests pass."""
    from kvfence.engine.errors import TenantCapExceeded

    engine = make_engine(tiny_model, policy="vtc")
    engine.set_tenants({"capped": TenantShare(max_pages=2)})
    page = engine.pool.page_size
    before = engine.pool.stats()
    with pytest.raises(TenantCapExceeded, match="at most 2 pages"):
        engine.add_request([5] * (2 * page), SamplingParams(max_tokens=1), "r1", tenant="capped")
    assert engine.pool.stats() == before and not engine.has_unfinished()
    engine.add_request([5] * (2 * page), SamplingParams(max_tokens=1), "r2", tenant="other")
    engine.add_request([5] * (page + 1), SamplingParams(max_tokens=1), "r3", tenant="capped")


def test_pd_serve_applies_the_keys_files_shares_and_refuses_a_pool_below_the_guarantees(tiny_dir, tmp_path):
    """End to end over HTTP, router + prefill + decode processes: a capped tenant's request that needs more pages
    than its cap gets 400 (another tenant's alike request is served), and guarantees no worker's pool can hold
    stop `serve --mode pd` with the reason (exit 1: the workers are refused, not restarted)."""
    import subprocess
    import sys

    from openai import BadRequestError, OpenAI

    from tests.pd_cluster import free_port, pd_serve, undersized_prefill

    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[tenants.a]\nkeys = ["ka"]\nweight = 2\nmax_pages = 16\n[tenants.b]\nkeys = ["kb"]\nmin_pages = 4\n'
    )
    flags = undersized_prefill(96)
    prompt = list(range(3, 80))  # 77 tokens + 8: 22 pages, above a's cap of 16
    with pd_serve(tiny_dir, keys, *flags) as base:
        a, b = (OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=120) for k in ("ka", "kb"))
        got = b.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=8, temperature=0)
        assert got.usage.completion_tokens >= 1
        with pytest.raises(BadRequestError) as refused:
            a.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=8, temperature=0)
        assert refused.value.code == "context_length_exceeded"
        assert "your tenant may hold at most 16 pages" in refused.value.message
        small = a.completions.create(model=tiny_dir.name, prompt=prompt[:20], max_tokens=8, temperature=0)
        assert small.usage.completion_tokens >= 1
        # each worker's per-tenant numbers reach the router's /metrics with its heartbeats
        deadline = time.monotonic() + 30
        roles = lambda tenant: {role for role, _ in _worker_counters(base, tenant)}  # noqa: E731
        while roles("a") != {"prefill", "decode"} or roles("b") != {"prefill", "decode"}:
            assert time.monotonic() < deadline, f"per-tenant worker metrics: a {roles('a')}, b {roles('b')}"
            time.sleep(0.2)  # poll interval: heartbeats come every second
    keys.write_text('[tenants.a]\nkeys = ["ka"]\nmin_pages = 40\n')  # more than the prefill pool's 32 pages
    cmd = [sys.executable, "-m", "kvfence", "serve", "--mode", "pd", "--model", str(tiny_dir), "--port",
           str(free_port()), "--api-keys", str(keys), "--threads", "2", "--dtype", "float32", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "min_pages add up to 40, more than this prefill worker's pool of 32 pages" in done.stderr
    assert "a configuration error, not restarted" in done.stderr


def _worker_counters(base: str, tenant: str) -> list[tuple[str, float]]:
    """(role, counter) of `tenant` on each worker that has served it, from the router's /metrics."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
    found = re.findall(
        rf'kvfence_worker_tenant_virtual_tokens_total{{role="(\w+)",tenant="{tenant}",worker="[^"]+"}} (\S+)',
        text,
    )
    return [(role, float(v)) for role, v in found if float(v) > 0]
