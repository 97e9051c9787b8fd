"""The PD data path in one process: prefill engine -> transfer protocol -> decode engine, on the tiny model."""

from __future__ import annotations

import random

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
