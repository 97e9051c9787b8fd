"""The prefix cache in the engine, on the tiny model (and SmolLM2 where fetched): a hit gives the same greedy
output as a cold run; tenants never share; corrupt cached pages are caught before anyone decodes from them;
sealed pages are never written; eviction, preemption, abort and PD prefill keep every page accounted for."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.kv.pool import PageState
from kvfence.pd.local import LocalPDPair
from tests.conftest import make_engine, run_all
from tests.test_pd_local import run_pair

G = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PS = 4  # page size of make_engine


def tokens(model, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, model.config.vocab_size) for _ in range(n)]


def run_one(
    engine: LLMEngine, prompt: list[int], tenant: str = "a", params: SamplingParams = G
) -> RequestOutput:
    request = engine.add_request(prompt, params, tenant=tenant)
    return run_all(engine)[request.request_id]


def cold(model, prompts: list[list[int]], params: SamplingParams = G) -> list[tuple[int, ...]]:
    """Each prompt alone on a fresh engine without a prefix cache: the reference."""
    outs = []
    for prompt in prompts:
        outs.append(run_one(make_engine(model, enable_prefix_cache=False), prompt, params=params).token_ids)
    return outs


def hit_tokens(engine: LLMEngine, tenant: str) -> int:
    assert engine.prefix_cache is not None
    stats = engine.prefix_cache.stats().tenants.get(tenant)
    return 0 if stats is None else stats.hit_tokens


@pytest.fixture(scope="module")
def system(tiny_model) -> list[int]:
    return tokens(tiny_model, 22, seed=3)  # 5 full pages and a partial one


def test_same_tenant_reuse_gives_the_cold_output(tiny_model, system):
    prompts = [
        system + tokens(tiny_model, 5, seed=4),  # hit: 5 pages, then its own tokens
        system,  # the partial page is never shared: 5 pages hit, 2 tokens recomputed
        system[:20],  # the whole prompt is cached: the last page is recomputed, never written in place
        system[:13] + tokens(tiny_model, 9, seed=5),  # diverges inside page 3: 3 pages hit
    ]
    expected = cold(tiny_model, [system, *prompts])
    engine = make_engine(tiny_model)
    assert run_one(engine, system).token_ids == expected[0]
    hits = []
    for prompt, want in zip(prompts, expected[1:], strict=True):
        before = hit_tokens(engine, "a")
        assert run_one(engine, prompt).token_ids == want
        hits.append(hit_tokens(engine, "a") - before)
    assert hits == [20, 20, 16, 12]


def test_a_batch_sharing_a_system_prompt_with_chunked_prefill(tiny_model, system):
    prompts = [system + tokens(tiny_model, n, seed=10 + n) for n in range(1, 7)]
    expected = cold(tiny_model, prompts)
    engine = make_engine(tiny_model, max_num_batched_tokens=12)
    run_one(engine, system)
    ids = [engine.add_request(p, G, tenant="a").request_id for p in prompts]
    final = run_all(engine)
    assert [final[i].token_ids for i in ids] == expected
    assert hit_tokens(engine, "a") >= 6 * 20


def assert_no_cross_tenant_hits(engine: LLMEngine, prompt: list[int]) -> None:
    """Tenant a caches `prompt`; tenant b sends the same prompt: b must not hit, and must compute every page."""
    run_one(engine, prompt, tenant="a")
    out = run_one(engine, prompt, tenant="b")
    assert hit_tokens(engine, "b") == 0, "tenant b reused pages that tenant a's request computed"
    assert out.error_code is None


def test_cross_tenant_never_hits(tiny_model, system):
    engine = make_engine(tiny_model)
    assert_no_cross_tenant_hits(engine, system)
    assert run_one(engine, system, tenant="b").token_ids == cold(tiny_model, [system])[0]
    assert hit_tokens(engine, "b") == 20, "b's own pages, from its own first request"


def test_the_cross_tenant_check_catches_the_shared_prefix_cache_knob(tiny_model, system):
    engine = make_engine(tiny_model, faults=Faults(shared_prefix_cache=2))
    with pytest.raises(AssertionError, match="reused pages that tenant a"):
        assert_no_cross_tenant_hits(engine, system)


def flip_bit(engine: LLMEngine, page: int) -> None:
    """One bit of one K value of layer 0, flipped in place in the KV tensors."""
    raw = engine.runner.cache.kv[0, 0, page].view(torch.uint8).view(-1)  # [S * Hkv * Dh * itemsize]
    raw[123] ^= 0x10


def cached_page(engine: LLMEngine, prompt: list[int], index: int) -> int:
    """The page that holds page `index` of tenant a's cached `prompt`."""
    assert engine.prefix_cache is not None
    return int(engine.prefix_cache.match("a", prompt, [], index + 1)[index].page)


def test_a_flipped_bit_in_a_cached_page_is_caught_on_reuse(tiny_model, system, caplog):
    engine = make_engine(tiny_model)
    run_one(engine, system)
    assert engine.prefix_cache is not None
    victim = cached_page(engine, system, 2)
    flip_bit(engine, victim)
    with caplog.at_level(logging.ERROR, logger="kvfence.integrity"):
        out = run_one(engine, [*system, 5])
    assert out.token_ids == cold(tiny_model, [[*system, 5]])[0], "recomputed, never decoded from the flip"
    assert hit_tokens(engine, "a") == 8, "the hit stops before the corrupt page"
    assert engine.prefix_cache.digest_failures == 1
    (record,) = [json.loads(r.getMessage()) for r in caplog.records]
    assert (record["event"], record["page"], record["where"]) == ("kv_digest_mismatch", victim, "reuse")


def test_without_the_digest_check_the_flip_would_poison_the_output(tiny_model, system, monkeypatch):
    """The scenario above is not vacuous: skip the digest check and the corrupt page is decoded from."""
    engine = make_engine(tiny_model)
    run_one(engine, system)
    assert engine.prefix_cache is not None
    engine.runner.cache.kv[:, :, cached_page(engine, system, 2)] *= 8  # a corruption large enough to show
    monkeypatch.setattr(engine.prefix_cache, "verify", lambda hit: hit)
    out = run_one(engine, [*system, 5])
    assert out.token_ids != cold(tiny_model, [[*system, 5]])[0]


def test_canary_finds_a_flip_in_an_idle_page(tiny_model, system):
    engine = make_engine(tiny_model, kv_canary_interval=1)
    run_one(engine, system)
    assert engine.prefix_cache is not None
    victim = engine.pool.idle_pages()[0]
    flip_bit(engine, victim)
    out = run_one(engine, tokens(tiny_model, 6, seed=8))  # unrelated work; a canary check each step
    assert out.error_code is None
    assert engine.prefix_cache.digest_failures == 1
    assert engine.pool.state[victim] == PageState.FREE, "evicted through quarantine"


def test_canary_fails_the_holder_of_a_corrupt_page_in_use(tiny_model, system):
    engine = make_engine(tiny_model, kv_canary_interval=1)
    request = engine.add_request(system, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    page = request.pages[1]
    assert engine.pool.state[page] == PageState.SEALED
    flip_bit(engine, page)
    out = run_all(engine)[request.request_id]
    assert (out.error_code, out.finish_reason) == ("kv_integrity_error", "error")
    assert engine.stats.integrity_failures == 1 and engine.pool.state[page] == PageState.FREE


def test_a_step_never_writes_a_sealed_page(tiny_model, system):
    """A scheduler bug that would recompute (write) shared pages: the write check fails the request before the
    step, even with the I1 checks off; the sealed pages keep their content for the other holder."""
    engine = make_engine(tiny_model, integrity_checks=False)
    run_one(engine, system)
    a = engine.add_request([*system, 7], G, tenant="a")
    b = engine.add_request([*system, 9], G, tenant="a")
    engine.step()
    assert engine.pool.state[a.pages[0]] == PageState.SEALED and a.pages[:5] == b.pages[:5]
    a.num_computed_tokens = 0  # the bug: a believes nothing is computed and would rewrite its table
    final = run_all(engine)
    assert final[a.request_id].error_code == "kv_integrity_error"
    assert final[b.request_id].token_ids == cold(tiny_model, [[*system, 9]])[0]
    assert engine.prefix_cache is not None and engine.prefix_cache.canary(100) == []


def test_eviction_under_memory_pressure(tiny_model, system):
    prompts = [system[: 4 * (i % 5) + 2] + tokens(tiny_model, 6, seed=20 + i) for i in range(12)]
    expected = cold(tiny_model, prompts)
    engine = make_engine(tiny_model, kv_pages=16)
    got = [run_one(engine, p).token_ids for p in prompts]
    assert got == expected
    assert engine.pool.num_evictions > 0 and hit_tokens(engine, "a") > 0


def test_preemption_and_abort_with_shared_pages(tiny_model, system):
    prompts = [system + tokens(tiny_model, 3, seed=30 + i) for i in range(6)]
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = cold(tiny_model, prompts, long)
    engine = make_engine(tiny_model, kv_pages=28, max_num_batched_tokens=64)
    run_one(engine, system)
    ids = [engine.add_request(p, long, tenant="a").request_id for p in prompts]
    doomed = engine.add_request([*system, 3, 4], long, tenant="a")
    final: dict[str, RequestOutput] = {}
    for _ in range(3):
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    engine.abort(doomed.request_id)
    final.update(run_all(engine))
    assert final[doomed.request_id].finish_reason == "abort"
    assert [final[i].token_ids for i in ids] == expected
    assert engine.scheduler.num_preemptions > 0


def test_idle_cached_pages_count_as_free_capacity(tiny_model):
    engine = make_engine(tiny_model, kv_pages=12)
    for seed in range(3):
        run_one(
            engine, tokens(tiny_model, 14, seed=40 + seed), params=SamplingParams(max_tokens=2, temperature=0)
        )
    assert engine.pool.num_cached >= 9 and engine.pool.num_free == 12
    big = tokens(tiny_model, 40, seed=50)  # 40 + 8 tokens: the whole pool
    assert (
        run_one(engine, big, params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).error_code
        is None
    )


def test_pd_prefill_reuses_cached_pages_and_still_sends_the_whole_prompt(tiny_model, system):
    prompts = [system + tokens(tiny_model, 3, seed=60 + i) for i in range(3)]
    expected = cold(tiny_model, prompts)
    pair = LocalPDPair(make_engine(tiny_model, kv_pages=40), make_engine(tiny_model, kv_pages=64), window=2)
    got = []
    for i, prompt in enumerate(prompts):
        pair.add_request(prompt, G, f"r{i}")
        got.append(run_pair(pair)[f"r{i}"].token_ids)
    assert got == expected
    assert hit_tokens(pair.prefill, "anonymous") == 2 * 20
    assert pair.decode.prefix_cache is not None and len(pair.decode.prefix_cache) == 0, "decode seals nothing"


@pytest.mark.slow
def test_smollm2_reuse_gives_the_cold_output(smollm2):
    chat = smollm2.tokenizer.apply_chat_template
    system = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    prompts = [chat([{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in
               ("What is a KV cache?", "Why is the sky blue?")]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = [smollm2.tokenizer.encode(p) for p in prompts]
    expected = [run_one(make_engine(smollm2, page_size=16, enable_prefix_cache=False), p, params=params).token_ids
                for p in ids]  # fmt: skip
    engine = make_engine(smollm2, page_size=16)
    got = [run_one(engine, p, params=params).token_ids for p in ids]
    assert got == expected
    assert hit_tokens(engine, "a") >= 48


def test_prefix_cache_flags():
    from kvfence.cli import build_parser
    from kvfence.flags import config_from_args

    parser = build_parser()
    for argv, on in (([], True), (["--no-enable-prefix-cache"], False), (["--disable-prefix-cache"], False)):
        config = config_from_args(parser.parse_args(["generate", "--prompt", "x", *argv])).cache
        assert config.enable_prefix_cache is on and config.kv_canary_interval == 64
    args = parser.parse_args(["generate", "--prompt", "x", "--kv-canary-interval", "0"])
    assert config_from_args(args).cache.kv_canary_interval == 0
