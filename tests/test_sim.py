"""The deterministic simulator (kvfence/sim): the real router, roles and engines on a seeded network and clock.

CI runs 2,000 seeds; a failing seed names the one-line command that replays it. The mutation check proves the
simulator can fail: each historical bug, armed with the integrity checks off, must produce a violation."""

from __future__ import annotations

import logging

import pytest

from kvfence.sim.cluster import Violation, replay_command, run_seed
from kvfence.sim.mutation import MUTANTS, find_violation

SEEDS = 2000
CHUNK = 250


@pytest.fixture(autouse=True)
def quiet_logs():
    logging.disable(logging.WARNING)  # thousands of expected timeouts and failed victims
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("start", range(0, SEEDS, CHUNK))
def test_seeds_hold_every_invariant(start):
    for seed in range(start, start + CHUNK):
        try:
            run_seed(seed)
        except Violation as exc:
            pytest.fail(f"seed {seed}: {exc}\nreplay: {replay_command(seed)}")


@pytest.mark.parametrize("knob", sorted(MUTANTS))
def test_every_historical_bug_is_caught_with_the_checks_off(knob):
    found = find_violation(knob, range(300))
    assert found is not None, f"the simulator never noticed {knob} in 300 seeds"


def test_a_seed_replays_exactly():
    first: list[dict] = []
    second: list[dict] = []
    run_seed(11, first.append)
    run_seed(11, second.append)
    assert first == second and len(first) > 100


def test_interrupted_prefill_steps_hold_every_invariant():
    """Prefill workers' long steps stopped at random between rows (SimConfig.interrupts: as for a newcomer
    tenant's request), the rows written so far left in their pages unstamped: every invariant holds after every
    event, the provenance oracle sees no foreign read, and every request ends as it would have."""
    interrupted = 0
    for seed in range(60):
        # checks off for half: the oracle alone then sees what an interrupted step left; checks on, no request
        # may fail an integrity check either
        set_ = dict(interrupts=True, policy="vtc", checks=seed % 2 == 0, faults="", crashes=0)
        try:
            summary = run_seed(seed, **set_)
        except Violation as exc:
            pytest.fail(f"seed {seed}: {exc}\nreplay: {replay_command(seed, **set_)}")
        interrupted += summary["interrupted"]
        assert "kv_integrity_error" not in summary["outcomes"], (
            seed,
            summary,
        )  # nothing left for I1 to catch
    assert interrupted > 30, interrupted


def test_the_knobs_fail_victims_not_invariants_with_the_checks_on():
    """Every PD knob armed many times, checks on: requests fail with errors, every invariant holds."""
    outcomes: dict[str, int] = {}
    for seed, knob in enumerate(sorted(MUTANTS)):
        summary = run_seed(seed, faults=f"{knob}=3", p_abort=0.0, crashes=0)
        for key, n in summary["outcomes"].items():
            outcomes[key] = outcomes.get(key, 0) + n
    assert outcomes.get("kv_integrity_error", 0) > 0 and outcomes.get("length", 0) > 0


ROGUE = dict(rogue=True, num_decode=2, crashes=0)  # a compromised decode member among two (I10)


def test_a_compromised_member_neither_answers_for_another_worker_nor_takes_its_pages():
    """With the binding (the default) a decode member that forges another worker's outputs and tickets for its
    transfers changes nothing a client sees and receives no page (200 seeds)."""
    for seed in range(200):
        try:
            run_seed(seed, **ROGUE)
        except Violation as exc:
            pytest.fail(f"seed {seed}: {exc}\nreplay: {replay_command(seed, **ROGUE)}")


@pytest.mark.parametrize(("knob", "symptom"), [("unbound_outputs", "OUT:"), ("unbound_tickets", "I10:")])
def test_without_the_binding_the_compromised_member_is_caught(knob, symptom):
    """Mutation proof: each half of the binding switched off (its fault knob), the simulator finds the forged
    output reaching a client, or a page shipped to the member the router did not name."""
    for seed in range(30):
        try:
            run_seed(seed, **ROGUE, faults=f"{knob}=100000")
        except Violation as exc:
            assert symptom in str(exc), exc
            return
    pytest.fail(f"no violation with {knob} armed in 30 seeds")


# ---- fairness across tenants, on the real PD roles (engine/fairness.py, pd/decode_role.py) ----------------------


def flooded(policy: str, **overrides):
    """tenant-a submits 12 requests, then tenant-b 6, on one prefill and one decode worker whose pools hold a
    few requests at a time: both queues form. Returns the simulation after it ran (every invariant checked)."""
    from kvfence.sim.cluster import Simulation
    from kvfence.sim.scenario import SimConfig

    cfg = SimConfig(seed=7, num_prefill=1, num_decode=1, prefill_pages=16, decode_pages=12, num_requests=18,
                    max_prompt=20, max_tokens=4, p_abort=0.0, flood=True, policy=policy, **overrides)  # fmt: skip
    sim = Simulation(cfg)
    sim.run()
    return sim


def starts(sim, kind: str) -> list[str]:
    """The tenants of the requests in the order a worker of `kind` first computed for them."""
    return [sim.clients[rid].tenant for node, rid in sim.started if node.startswith(kind)]


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_on_both_pd_roles_vtc_starts_the_second_tenant_before_the_flooder_drains(kind):
    """Asserted on decisions: under vtc tenant-b's first request starts on the worker while tenant-a still has
    requests to start there; under fcfs (the control) only after all of tenant-a's."""
    vtc, fcfs = starts(flooded("vtc"), kind), starts(flooded("fcfs"), kind)
    assert len(vtc) == len(fcfs) == 18
    last_a = lambda order: max(i for i, t in enumerate(order) if t == "tenant-a")  # noqa: E731
    assert fcfs.index("tenant-b") > last_a(fcfs), fcfs
    assert vtc.index("tenant-b") < last_a(vtc) - 3, vtc


def test_pd_workers_apply_the_routers_tenant_shares_and_a_cap_holds_on_every_worker():
    """The router sends the keys file's shares at registration; each worker's scheduler applies them: tenant-a's
    cap of 6 pages holds on both workers after every event (the simulator checks it), and its requests still end.
    The control: without the cap tenant-a holds more on both."""
    sim = flooded("vtc", shares={"tenant-a": {"max_pages": 6}, "tenant-b": {"weight": 2.0, "min_pages": 4}})
    for worker in sim.live_workers():
        fairness = worker.engine.scheduler.fairness
        assert fairness.share("tenant-a").max_pages == 6 and fairness.share("tenant-b").min_pages == 4
    assert all(c.ended and not c.rejected for c in sim.clients.values())
    assert max(sim.peak_held[(kind, "tenant-a")] for kind in ("prefill", "decode")) <= 6
    uncapped = flooded("vtc")
    assert min(uncapped.peak_held[(kind, "tenant-a")] for kind in ("prefill", "decode")) > 6, (
        uncapped.peak_held
    )


def test_a_request_larger_than_its_tenants_cap_is_refused_by_the_router_before_anything_is_sent():
    """Admission (I5) knows the tenant's cap: a request that could never fit it would wait for pages forever."""
    sim = flooded("vtc", shares={"tenant-a": {"max_pages": 5}})
    refused = {rid for rid, c in sim.clients.items() if c.rejected}
    assert refused and all(sim.clients[rid].rejected == "TenantCapExceeded" for rid in refused)
    assert all(len(sim.clients[rid].prompt) + sim.clients[rid].max_tokens > 20 for rid in refused)
    assert not {rid for _, rid in sim.started} & refused
