"""The OpenAI-compatible API, driven with the official `openai` client against the real app on port 0.

Every answer is checked against the offline engine on the same tiny model (greedy decoding does not depend on
batching), so these tests prove the server adds and loses nothing: same tokens, same text, exact usage.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvfence.engine.request import SamplingParams
from kvfence.server.protocol import capacity
from tests.conftest import make_engine
from tests.server_harness import MODEL, SCRAPE_KEY, running_server

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, how are you?"},
]


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model) as handle:
        yield handle
        handle.assert_pool_clean()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline(tiny_model):
    engine = make_engine(tiny_model)

    def run(prompt_ids: list[int], max_tokens: int, **kw: object):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]
        (out,) = engine.generate([prompt_ids], params)
        return out

    return run


def chat_ids(tiny_model, messages) -> list[int]:
    tok = tiny_model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def test_completion_matches_offline_engine(client, offline, tiny_model):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12, **GREEDY)
    ids = tiny_model.tokenizer.encode("Hello world", add_special_tokens=True)
    ref = offline(ids, 12)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, ref.text, "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )


def test_chat_counts_prompt_tokens_after_the_template(client, offline, tiny_model):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    ids = chat_ids(tiny_model, MESSAGES)
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == offline(ids, 10).text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)


def test_streamed_completion_reassembles_to_the_non_streamed_text(client):
    full = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=20, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # the same counts; only cached_tokens may differ (the second request hits what the first cached)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    assert counts(chunks[-1].usage) == counts(full.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_reassembles_to_the_non_streamed_text(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    assert chunks[-1].usage is not None and counts(chunks[-1].usage) == counts(
        full.usage
    )  # cached_tokens may differ


def test_raw_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)


def test_n_choices_differ_and_are_reproducible_with_a_seed(client, tiny_model):
    kw = dict(
        model=MODEL,
        prompt="Hello world",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    r1, r2 = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in r1.choices] == [0, 1, 2]
    texts = [c.text for c in r1.choices]
    assert texts == [c.text for c in r2.choices]
    assert len(set(texts)) > 1
    assert r1.usage.completion_tokens == 24
    # the prompt is counted once, not once per choice
    assert r1.usage.prompt_tokens == len(tiny_model.tokenizer.encode("Hello world"))


def test_n_choices_stream(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, n=2, stream=True, **GREEDY
        )
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        (choice,) = c.choices
        by_index[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert by_index[0] == by_index[1] and finishes == {0: "length", 1: "length"}  # greedy: identical


def test_stop_string_cuts_the_text(client):
    full = (
        client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24, **GREEDY).choices[0].text
    )
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full.find(full[i : i + 2]) == i)
    cut = full[: full.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=24, stop=[stop, "@@never@@"], **GREEDY
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=24, stop=stop, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_lists_and_token_ids(client, offline, tiny_model):
    tok = tiny_model.tokenizer
    ids_a, ids_b = tok.encode("Hello world"), tok.encode("The lazy dog")
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "The lazy dog"], max_tokens=5, n=2, **GREEDY
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [offline(ids_a, 5).text] * 2 + [offline(ids_b, 5).text] * 2
    assert [c.text for c in r.choices] == want
    assert r.usage.prompt_tokens == len(ids_a) + len(ids_b) and r.usage.completion_tokens == 20
    r = client.completions.create(model=MODEL, prompt=ids_a, max_tokens=5, **GREEDY)
    assert r.choices[0].text == want[0]
    r = client.completions.create(model=MODEL, prompt=[ids_b, ids_a], max_tokens=5, **GREEDY)
    assert [c.text for c in r.choices] == [want[2], want[0]]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(
            item.logprob, abs=1e-5
        )  # greedy picks the top one


def test_default_max_tokens(client, tiny_model, server):
    ids = chat_ids(tiny_model, MESSAGES)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert r.usage.completion_tokens == capacity(server.engine.engine.limits) - len(ids)  # vLLM: the rest
    r = client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert r.usage.completion_tokens == 16  # OpenAI legacy default


NULLABLE = {
    "/completions": {"prompt": "Hello", "echo": None, "logprobs": None},
    "/chat/completions": {"messages": MESSAGES, "logprobs": None, "top_logprobs": None},
}


@pytest.mark.parametrize("path", sorted(NULLABLE))
def test_null_optional_parameters_mean_their_defaults(server, path):
    """OpenAI allows null for every optional parameter; the official client sends `temperature=None` so."""
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "stream", "frequency_penalty", "presence_penalty", "stop", "user"]
    )
    nulls |= {"ignore_eos": None, "stream_options": {"include_usage": None}, "max_completion_tokens": None}
    body = {"model": MODEL, "max_tokens": 6, "seed": 3, **NULLABLE[path]}
    r = httpx.post(f"{server.base_url}{path}", json={**body, **nulls}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # stream: null is not streaming
    (choice,) = r.json()["choices"]  # n: null is one choice
    default = httpx.post(f"{server.base_url}{path}", json=body, timeout=60).json()["choices"][0]
    assert choice == default  # same seed, same defaults (temperature 1, top_p 1): the same sample


def test_openai_client_none_is_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=None, top_p=None, n=None, stream=None
    )
    assert len(r.choices) == 1 and r.usage.completion_tokens <= 3


def test_models_health_and_metrics(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "kvfence"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
    for name in (
        "kvfence_requests_total",
        "kvfence_time_to_first_token_seconds_bucket",
        "kvfence_inter_token_latency_seconds_bucket",
        "kvfence_requests_running",
        "kvfence_requests_waiting",
        'kvfence_kv_pages{state="free"}',
        'kvfence_kv_pages{state="quarantined"}',
        "kvfence_integrity_checks_total",
        "kvfence_integrity_failures_total",
    ):
        assert name in text, name
    assert (
        server.metric("kvfence_requests_total", outcome="finished", reason="length", tenant="anonymous") >= 1
    )
    assert server.metric("kvfence_integrity_checks_total") > 0
