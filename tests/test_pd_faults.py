"""Fault knobs across real processes, with two tenants (issue 4): tenant A's requests carry unique secret token
sequences; after A's requests ran (their K/V stays in the never-wiped pages), a knob is armed on the prefill and
tenant B's next request is the victim.

With the integrity checks on, the victim fails with `kv_integrity_error` and no tokens, every other request
equals colocated output, no B output contains an A secret, and afterwards every worker's pool passes its
integrity audit with every page free. With the checks off (--no-integrity-checks on every worker), the same
scenario visibly corrupts the victim's output and nobody notices: what the checks are for.
"""

from __future__ import annotations

import random

import pytest

from kvfence.engine.request import SamplingParams
from tests.pd_cluster import audit_clean, collect, colocated_reference, start_cluster

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tenant_jobs(model, seed: int) -> tuple[dict[str, list[int]], list[tuple[int, ...]], dict[str, list[int]]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    secrets = [tuple(rng.randrange(3, vocab) for _ in range(6)) for _ in range(4)]
    a = {f"a{i}": [*(rng.randrange(3, vocab) for _ in range(10)), *s, *s] for i, s in enumerate(secrets)}
    b = {f"b{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(9, 30))] for i in range(7)}
    return a, secrets, b


def contains(tokens: tuple[int, ...], secret: tuple[int, ...]) -> bool:
    return any(tokens[i : i + len(secret)] == secret for i in range(len(tokens) - len(secret) + 1))


@pytest.fixture(scope="module", params=[True, False], ids=["checks", "no-checks"])
def cluster(request, tiny_dir):
    with start_cluster(tiny_dir, checks=request.param, prefill_pages=64, decode_pages=64) as router:
        yield router, request.param


@pytest.mark.parametrize("knob", ["placeholder_prefill", "stale_frame", "corrupt_frame"])
def test_prefill_fault_fails_tenant_b_victim_only(cluster, tiny_model, knob):
    router, checks = cluster
    a, secrets, b = tenant_jobs(tiny_model, seed=41)
    expected = colocated_reference(tiny_model, {**a, **b}, PARAMS)
    victim, rest = "b0", {k: v for k, v in b.items() if k != "b0"}
    got = collect(router, a, PARAMS, tenant="tenant-a")
    (prefill,) = [w for w in router.workers.values() if w.role == "prefill"]
    router.arm(prefill.identity, f"{knob}=1")
    got |= collect(router, {victim: b[victim]}, PARAMS, tenant="tenant-b")
    got |= collect(router, rest, PARAMS, tenant="tenant-b")
    if checks:
        audit_clean(router)
    outputs_b = [got[k].token_ids for k in b]
    assert not any(contains(out, s) for out in outputs_b for s in secrets)
    assert all(got[k].token_ids == expected[k] and got[k].error_code is None for k in [*a, *rest])
    if checks:
        assert got[victim].error_code == "kv_integrity_error"
        assert got[victim].token_ids == () and got[victim].text == ""
    else:  # the historical behaviour: HTTP 200 with output decoded from K/V that is not the victim's
        assert got[victim].error_code is None and got[victim].finish_reason == "length"
        assert got[victim].token_ids != expected[victim]


def test_a_prefill_that_dies_mid_transfer_fails_its_request_and_the_cluster_keeps_serving(
    tiny_dir, tiny_model
):
    """The die_mid_transfer knob is kill -9 of a prefill worker after its first page frame: the client gets an
    error within the dead-worker timeout (never a hang or stale output), the other prefill keeps serving, and
    the decode side revoked the half-done reservation (its pool is whole again)."""
    jobs = {k: v * 2 for k, v in colocated_jobs(tiny_model).items()}
    expected = colocated_reference(tiny_model, jobs, PARAMS)
    with start_cluster(tiny_dir, num_prefill=2, dead_after_s=1.5) as router:
        doomed = next(w for w in router.workers.values() if w.role == "prefill")
        router.arm(doomed.identity, "die_mid_transfer=1")
        got = collect(router, jobs, PARAMS)
        lost = sorted(k for k, v in got.items() if v.error_code)
        assert lost and all(
            got[k].error_code == "worker_unavailable" and got[k].token_ids == () for k in lost
        )
        assert all(got[k].token_ids == expected[k] for k in got if k not in lost)
        again = collect(router, {"after": jobs["r0"]}, PARAMS)
        assert again["after"].error_code is None and again["after"].token_ids == expected["r0"]
        assert doomed.identity not in router.workers
        audit_clean(router)


def colocated_jobs(model) -> dict[str, list[int]]:
    rng = random.Random(43)
    return {f"r{i}": [rng.randrange(3, model.config.vocab_size) for _ in range(12)] for i in range(4)}
