"""The integrity check must catch the historical bugs that the fault knobs reintroduce, and must be necessary.

For each knob: with checks on, exactly the victim fails with `kv_integrity_error`, returns no text, and every
other request's output equals what it produces alone. With checks off, the same scenario corrupts output; this
proves the test is not vacuous.
"""

from __future__ import annotations

import json
import logging

import pytest

from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import LeaseId
from tests.conftest import make_engine, run_all
from tests.test_engine import solo_outputs

P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def victim_and_others(model):
    vocab = model.config.vocab_size
    victim = [(7 * i) % (vocab - 3) + 3 for i in range(10)]
    others = [[(11 * i + j) % (vocab - 3) + 3 for i in range(9 + j)] for j in range(3)]
    return victim, others


def run_double_lease(model, checks: bool):
    """The victim is prefilled, then the allocator hands the victim's last page to the next request."""
    victim, others = victim_and_others(model)
    faults = Faults()
    engine = make_engine(model, faults=faults, integrity_checks=checks)
    vid = engine.add_request(victim, P, request_id="victim").request_id
    first = engine.step()  # the victim's prefill allocates (and writes) its pages
    assert not first or not first[0].finished
    faults.double_lease = 1
    oids = [engine.add_request(o, P).request_id for o in others]
    final = run_all(engine, pool_only=not checks)
    return final, vid, oids, [victim, *others]


@pytest.fixture(scope="module")
def references(tiny_model):
    victim, others = victim_and_others(tiny_model)
    return solo_outputs(tiny_model, [victim, *others], [P] * 4)


def test_double_lease_fails_the_victim_only(tiny_model, references, caplog):
    with caplog.at_level(logging.ERROR, logger="kvfence.integrity"):
        final, vid, oids, _ = run_double_lease(tiny_model, checks=True)
    v = final[vid]
    assert (v.finish_reason, v.error_code, v.text) == ("error", "kv_integrity_error", "")
    assert [final[o].token_ids for o in oids] == references[1:]
    (record,) = [json.loads(r.getMessage()) for r in caplog.records]
    assert record["request_id"] == vid and record["kind"] == "owner"
    assert record["expected_tag"] != record["found_tag"]


def test_double_lease_without_checks_corrupts(tiny_model, references):
    final, vid, oids, _ = run_double_lease(tiny_model, checks=False)
    got = [final[vid].token_ids] + [final[o].token_ids for o in oids]
    assert got != references, "with the check off, sharing a page must visibly corrupt someone's output"


def run_previous_tenant_then(model, knob: str, checks: bool):
    """Tenant A fills the whole pool and leaves; tenant B gets A's pages back and its prefill hits the fault."""
    a = [(5 * i) % (model.config.vocab_size - 3) + 3 for i in range(22)]
    b = [(13 * i + 1) % (model.config.vocab_size - 3) + 3 for i in range(22)]
    engine = make_engine(model, kv_pages=9, page_size=4, faults=Faults(), integrity_checks=checks)
    engine.add_request(a, P, request_id="a")
    run_all(engine)
    setattr(engine.faults, knob, 1)
    engine.add_request(b, P, request_id="b")
    return run_all(engine)["b"], b


@pytest.mark.parametrize("knob", ["drop_write", "skip_stamp"])
def test_unwritten_or_unstamped_page_fails_the_reader(tiny_model, knob):
    out, _ = run_previous_tenant_then(tiny_model, knob, checks=True)
    assert (out.error_code, out.text, out.token_ids) == ("kv_integrity_error", "", ())


def test_dropped_write_without_checks_reads_stale_pages(tiny_model):
    out, b = run_previous_tenant_then(tiny_model, "drop_write", checks=False)
    (expected,) = solo_outputs(tiny_model, [b], [P])
    assert out.error_code is None and out.token_ids != expected


def test_skip_stamp_mid_batch_fails_one_request(tiny_model, references):
    victim, others = victim_and_others(tiny_model)
    faults = Faults()
    engine = make_engine(tiny_model, faults=faults)
    ids = [engine.add_request(p, P).request_id for p in [victim, *others]]
    engine.step()
    engine.step()
    faults.skip_stamp = 1
    final = run_all(engine)
    failed = [i for i in ids if final[i].error_code == "kv_integrity_error"]
    assert len(failed) == 1
    for i, ref in zip(ids, references, strict=True):
        if i not in failed:
            assert final[i].token_ids == ref


def test_late_foreign_write_fails_the_owner_only(tiny_model, references):
    """A write by someone else (say a late network write for a previous owner) lands on a live request's page
    between two steps: the owner fails before it reads the page again; everyone else is untouched."""
    victim, others = victim_and_others(tiny_model)
    engine = make_engine(tiny_model)
    ids = [engine.add_request(p, P).request_id for p in [victim, *others]]
    engine.step()
    engine.step()
    target = engine._requests[ids[0]]
    page = target.pages[0]
    engine.runner.cache.kv[:, :, page] = 0.0
    engine.pool.stamp([page], [LeaseId(0xDEAD)])  # the late writer's stale lease
    final = run_all(engine)
    assert final[ids[0]].error_code == "kv_integrity_error"
    assert [final[i].token_ids for i in ids[1:]] == references[1:]
