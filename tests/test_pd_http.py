"""`kvfence serve --mode pd` end to end: router + prefill + decode processes, driven with the openai client.

The prefill pool is deliberately smaller than the context (the 2026 incident's configuration, allowed only with
--allow-undersized-pool): prompts that fit the context but not the prefill pool must get 400 before anything is
allocated anywhere, while normal prompts get the same greedy output as colocated mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI

from kvfence.engine.request import SamplingParams
from tests.conftest import make_engine, run_all
from tests.pd_cluster import pd_serve, undersized_prefill
from tests.server_harness import SCRAPE_KEY

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


@pytest.fixture(scope="module")
def pd_server(tiny_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    flags = undersized_prefill(96)
    with pd_serve(tiny_dir, keys, *flags) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="key-a", max_retries=0, timeout=120)


def test_pd_http_matches_colocated(pd_server, tiny_model, tiny_dir):
    rng = random.Random(31)
    prompts = [
        [rng.randrange(3, tiny_model.config.vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(4)
    ]
    engine = make_engine(tiny_model)
    for i, p in enumerate(prompts):
        engine.add_request(
            p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id=f"r{i}"
        )
    expected = run_all(engine)
    model = tiny_dir.name
    for i, p in enumerate(prompts):
        got = pd_server.completions.create(
            model=model, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == expected[f"r{i}"].text
        assert got.usage.prompt_tokens == len(p) and got.usage.completion_tokens == 8
    stream = pd_server.completions.create(model=model, prompt=prompts[0], max_tokens=8, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected["r0"].text


def test_over_pool_prompt_is_refused_by_the_router(pd_server, tiny_dir):
    with pytest.raises(BadRequestError) as exc:
        pd_server.completions.create(model=tiny_dir.name, prompt=[5] * 200, max_tokens=4)
    assert exc.value.code == "context_length_exceeded"
    assert "32 pages" in exc.value.message
    ok = pd_server.completions.create(model=tiny_dir.name, prompt=[5] * 20, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_pd_http_n_greater_than_one_and_two_tenants_at_once(pd_server, tiny_model, tiny_dir):
    """n=3 choices in PD mode (each its own transfer), and both tenants' requests concurrently, streaming and
    not: every answer equals colocated greedy output, and each tenant sees only its own requests' text."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(33)
    prompts = [
        [rng.randrange(3, tiny_model.config.vocab_size) for _ in range(rng.randint(5, 40))] for _ in range(8)
    ]
    engine = make_engine(tiny_model)
    for i, p in enumerate(prompts):
        engine.add_request(
            p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), request_id=f"r{i}"
        )
    expected = run_all(engine)
    model = tiny_dir.name
    clients = {k: pd_server.with_options(api_key=k) for k in KEYS}

    def ask(i: int) -> str:
        client = clients["key-a" if i % 2 == 0 else "key-b"]
        if i % 4 == 3:
            stream = client.completions.create(model=model, prompt=prompts[i], max_tokens=6, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            return "".join(c.choices[0].text for c in stream if c.choices)
        out = client.completions.create(model=model, prompt=prompts[i], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(len(prompts))))
    assert texts == [expected[f"r{i}"].text for i in range(len(prompts))]
    multi = clients["key-b"].completions.create(model=model, prompt=prompts[0], max_tokens=6, temperature=0, n=3,
                                                extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert all(c.text == expected["r0"].text for c in multi.choices)
    assert multi.usage.completion_tokens == 18


def test_pd_http_refuses_unknown_keys(pd_server, tiny_dir):
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        pd_server.with_options(api_key="nope").completions.create(
            model=tiny_dir.name, prompt=[5, 6], max_tokens=2
        )


def test_pd_router_gives_a_tenant_its_own_usage_and_keeps_the_operator_routes_shut(pd_server, tiny_dir):
    """The router's front is colocated's (build_app): a tenant reads its usage, not /metrics or /debug/*."""
    base = str(pd_server.base_url).rstrip("/").removesuffix("/v1")
    tenant_a = {"Authorization": "Bearer key-a"}

    def usage() -> dict:
        r = httpx.get(f"{base}/v1/usage", headers=tenant_a, timeout=10)
        assert r.status_code == 200, r.text
        assert "tenant-b" not in r.text
        return r.json()

    before = usage()["requests"]
    pd_server.completions.create(model=tiny_dir.name, prompt=[5, 6, 7], max_tokens=2)
    deadline = time.monotonic() + 30
    while (after := usage())["requests"] == before:  # counted when the router sees the end, after the reply
        assert time.monotonic() < deadline, after
        time.sleep(0.05)  # poll interval
    assert after["tenant"] == "tenant-a" and after["requests"] == before + 1
    assert after["prefix_cache"] is None  # the router holds no cache: its prefill workers do
    for route in ("/metrics", "/debug/kv", "/debug/config"):
        assert httpx.get(f"{base}{route}", headers=tenant_a, timeout=10).status_code == 403, route
    scrape = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}, timeout=10)
    assert scrape.status_code == 200 and 'tenant="tenant-a"' in scrape.text


def test_router_metrics_show_every_workers_pool(pd_server):
    """The router holds no pages; its /metrics shows each worker's pool (from heartbeats) and failures."""
    base = str(pd_server.base_url).rstrip("/").removesuffix("/v1")
    deadline = time.monotonic() + 30
    while True:  # each worker's first heartbeat after start-up carries its pool; wait for both
        text = httpx.get(
            f"{base}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}, timeout=10
        ).text
        totals = [line for line in text.splitlines() if line.startswith("kvfence_worker_kv_pages_total")]
        if len(totals) == 2:
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.2)  # poll interval
    assert 'kvfence_workers{role="prefill"} 1.0' in text and 'kvfence_workers{role="decode"} 1.0' in text
    assert sorted(float(line.rsplit(" ", 1)[1]) for line in totals) == [32.0, 96.0]
    assert 'state="leased"' in text and "kvfence_worker_integrity_failures_total" in text
    assert (
        text.count("kvfence_worker_requests{") == 4 and 'state="running"' in text
    )  # each worker's heartbeat


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                found[int(entry.name)] = (
                    ppid,
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(),
                )
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's (prctl)")
def test_workers_exit_when_serve_is_killed_with_9(tiny_dir, tmp_path):
    """`serve --mode pd` killed with -9 runs no cleanup: its workers must still go, at once (PR_SET_PDEATHSIG),
    not after their 15 s router-silence timeout or never."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with pd_serve(tiny_dir, keys, "--page-size", "4", "--kv-pages", "64") as base:
        port = base.rsplit(":", 1)[1]
        procs = _processes()
        serve = [pid for pid, (_, cmd) in procs.items() if " serve " in cmd and f"--port {port} " in cmd]
        assert len(serve) == 1, serve
        workers = [pid for pid, (ppid, _) in procs.items() if ppid == serve[0]]
        assert len(workers) == 2
        os.kill(serve[0], signal.SIGKILL)
        deadline = time.monotonic() + 10  # well under ROUTER_SILENCE_S
        while any(pid in _processes() and "kvfence" in _processes()[pid][1] for pid in workers):
            assert time.monotonic() < deadline, "the workers outlived kill -9 of serve"
            time.sleep(0.1)  # poll interval


def test_pd_usage_reports_the_callers_own_cached_tokens(pd_server, tiny_model, tiny_dir):
    """The prefix cache lives on the prefill worker: its first token carries the hits to the client's usage."""
    rng = random.Random(77)
    prompt = [rng.randrange(3, tiny_model.config.vocab_size) for _ in range(41)]
    first = pd_server.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=2, temperature=0)
    again = pd_server.completions.create(model=tiny_dir.name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 40


def test_pd_structured_output_survives_the_hand_off(pd_server, tiny_dir):
    """The prefill samples the first token under the grammar; the decode worker rebuilds the grammar's state from
    it and goes on: the answer is one of the choices, never free text."""
    schema = {"type": "object", "properties": {"go": {"type": "boolean"}}, "required": ["go"],
              "additionalProperties": False}  # fmt: skip
    for seed in range(3):
        got = pd_server.chat.completions.create(
            model=tiny_dir.name, messages=[{"role": "user", "content": "go?"}], max_tokens=32, temperature=1.0,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}},
        )  # fmt: skip
        assert json.loads(got.choices[0].message.content) in ({"go": True}, {"go": False})
        assert got.choices[0].finish_reason == "stop"


def test_pd_echo_scores_the_prompt_on_the_prefill_worker(pd_server, tiny_model, tiny_dir):
    """Prompt logprobs are computed where the prompt runs (the prefill worker) and reach the client with the
    first token, through the control plane: the same scores as colocated."""
    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    got = pd_server.completions.create(
        model=tiny_dir.name, prompt=ids, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    engine = make_engine(tiny_model)
    engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2), "r")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    want = [None] + [e[0] for e in next(o for o in outs if o.prompt_logprobs).prompt_logprobs[1:]]
    want += [e[0] for o in outs for e in o.logprobs]
    lp = got.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(want)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:], want[1:], strict=True))
    final = next(o for o in outs if o.finished)
    assert got.choices[0].text == tiny_model.tokenizer.decode(ids, skip_special_tokens=False) + final.text
