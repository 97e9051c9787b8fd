"""The prefix cache over HTTP with two API keys (I7): the tenant comes from the key, the same prompt from another
tenant never hits, and a time-to-first-token probe in the style of a prompt-leak attack sees no difference between
"cached for another tenant" and "never seen". The timing test is a statistical check with a conservative alpha;
the guarantee itself is asserted on the hit counters."""

from __future__ import annotations

import random
import statistics
import time

import httpx

from kvfence.faults import Faults
from kvfence.probe.stats import mann_whitney_two_sided
from tests.server_harness import MODEL, SCRAPE_KEY, Handle, running_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALPHA = 0.001  # a false alarm once in a thousand runs, and only when timing alone misbehaves


def complete(
    http: httpx.Client, srv: Handle, key: str, prompt: list[int], **extra: object
) -> tuple[float, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    t0 = time.perf_counter()
    r = http.post(f"{srv.base_url}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return elapsed, r.json()


def hit_tokens(srv: Handle, tenant: str) -> float:
    httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).raise_for_status()
    return srv.metric("kvfence_prefix_cache_hit_tokens_total", tenant=tenant)


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_same_prompt_from_another_key_never_hits(tiny_model):
    rng = random.Random(1)
    prompt = random_prompt(rng, tiny_model.config.vocab_size, 41)
    with running_server(tiny_model, api_keys=KEYS) as srv, httpx.Client(timeout=60) as http:
        _, first = complete(http, srv, "key-alice", prompt, max_tokens=6)
        # bob names alice in every request field he controls: the tenant still comes from his key
        _, probe = complete(http, srv, "key-bob", prompt, max_tokens=6, user="alice")
        assert probe["choices"][0]["text"] == first["choices"][0]["text"]
        assert hit_tokens(srv, "bob") == 0 and hit_tokens(srv, "alice") == 0
        _, again = complete(http, srv, "key-alice", prompt, max_tokens=6)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert hit_tokens(srv, "alice") == 40 and hit_tokens(srv, "bob") == 0
        assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # bob's own hits only: none
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # alice's own, in her usage
        assert srv.metric("kvfence_prefix_cache_hit_rate", tenant="alice") > 0.3
        assert srv.metric("kvfence_kv_pages", state="cached") > 0
        srv.assert_pool_clean()


def test_cache_salt_narrows_a_tenants_cache_and_never_widens_it(tiny_model):
    """cache_salt (vLLM's): the key is tenant + salt. The same tenant with another salt, or none, misses; the
    same salt from another tenant misses; the same tenant and salt hits."""
    rng = random.Random(2)
    prompt = random_prompt(rng, tiny_model.config.vocab_size, 41)
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    with running_server(tiny_model, api_keys=KEYS) as srv, httpx.Client(timeout=60) as http:
        _, first = complete(http, srv, "key-alice", prompt, max_tokens=2, cache_salt="s1")
        assert cached(first) == 0
        assert cached(complete(http, srv, "key-alice", prompt, cache_salt="s2")[1]) == 0
        assert cached(complete(http, srv, "key-alice", prompt)[1]) == 0
        assert cached(complete(http, srv, "key-bob", prompt, cache_salt="s1")[1]) == 0
        assert cached(complete(http, srv, "key-alice", prompt, cache_salt="s1")[1]) == 40
        assert hit_tokens(srv, "bob") == 0
        bad = http.post(f"{srv.base_url}/completions", headers={"Authorization": "Bearer key-alice"},
                        json={"model": MODEL, "prompt": prompt, "cache_salt": "a\x00b"})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        srv.assert_pool_clean()


def ttft_probe(
    srv: Handle, vocab: int, trials: int, length: int, seed: int
) -> tuple[list[float], list[float]]:
    """Per trial: alice sends a fresh prompt X; bob then sends X ("cached for another tenant") and a fresh Y
    ("never seen"), in random order. Returns bob's latencies for the two kinds (max_tokens=1: the latency is
    the time to first token)."""
    rng = random.Random(seed)
    cached_other: list[float] = []
    never_seen: list[float] = []
    with httpx.Client(timeout=60) as http:
        for _ in range(3):  # warm up the connection and the kernels
            complete(http, srv, "key-bob", random_prompt(rng, vocab, length))
        for _ in range(trials):
            x, y = random_prompt(rng, vocab, length), random_prompt(rng, vocab, length)
            complete(http, srv, "key-alice", x)
            probes = [(x, cached_other), (y, never_seen)]
            rng.shuffle(probes)
            for prompt, sink in probes:
                sink.append(complete(http, srv, "key-bob", prompt)[0])
    return cached_other, never_seen


# Prefill in chunks of 32 tokens: a 240-token prompt takes 8 steps cold and 1 on a hit, so a leak would show as
# a fivefold TTFT difference, far above the noise of a busy machine (see the power test below).
PROBE_ENGINE = dict(kv_pages=2048, page_size=16, max_num_batched_tokens=32)


def test_ttft_probe_sees_no_other_tenants_prefix(tiny_model):
    vocab = tiny_model.config.vocab_size
    with running_server(tiny_model, api_keys=KEYS, **PROBE_ENGINE) as srv:
        cached_other, never_seen = ttft_probe(srv, vocab, trials=40, length=240, seed=7)
        assert hit_tokens(srv, "bob") == 0, "bob reused pages computed for alice"
        assert hit_tokens(srv, "alice") == 0
        srv.assert_pool_clean()
    p = mann_whitney_two_sided(cached_other, never_seen)
    assert p > ALPHA, (
        f"TTFT differs between prompts cached for another tenant and unseen ones (p={p:.2g}); "
        f"medians {statistics.median(cached_other) * 1e3:.1f} vs {statistics.median(never_seen) * 1e3:.1f} ms"
    )


def test_the_probe_has_power_the_shared_prefix_cache_knob_is_caught(tiny_model):
    """With the historical bug armed (tenant left out of cache keys), the same probe sees bob hit alice's
    pages: on the counters always, and, as a check that the timing test can see a leak at all, in TTFT."""
    vocab = tiny_model.config.vocab_size
    faults = Faults(shared_prefix_cache=10**6)
    with running_server(tiny_model, api_keys=KEYS, faults=faults, **PROBE_ENGINE) as srv:
        cached_other, never_seen = ttft_probe(srv, vocab, trials=20, length=240, seed=8)
        assert hit_tokens(srv, "bob") >= 20 * 224
    assert mann_whitney_two_sided(cached_other, never_seen) < ALPHA
