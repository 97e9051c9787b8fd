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
