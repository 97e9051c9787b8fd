"""Every error the server returns: status, OpenAI shape, parameter named; and that no error leaks a page.

Statuses: 401 (API keys), 404 (model, route), 400 (parameters, malformed bodies, context_length_exceeded for
the context and for the pool), 413 (bodies over the limit), 503 + Retry-After (queue full), 500
`kv_integrity_error` (fault knobs; streaming: an error event and no `[DONE]`).
"""

from __future__ import annotations

import json
import logging
import threading

import httpx
import openai
import pytest

from kvfence.faults import Faults
from tests.server_harness import MODEL, SCRAPE_KEY, running_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model) as handle:
        yield handle
        handle.assert_pool_clean()


def post(server, path: str, body: object = None, **kw: object) -> httpx.Response:
    content = kw.pop("content", None)
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, timeout=60, **kw)  # type: ignore[arg-type]


def error_of(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def long_prompt(tiny_model, num_tokens: int) -> list[int]:
    return [(7 * i) % (tiny_model.config.vocab_size - 3) + 3 for i in range(num_tokens)]


# ---- 401 / tenants ----------------------------------------------------------------------------------------


def test_api_keys_401_and_tenant_from_the_key(tiny_model, caplog):
    with running_server(tiny_model, api_keys=KEYS) as srv:
        for key in (None, "wrong"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            err = error_of(post(srv, "/completions", body, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
            assert httpx.get(f"{srv.base_url}/models", headers=headers).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        # metrics labels name tenants: an operator credential is needed to read them, never a tenant's key
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error_of(httpx.get(f"{srv.url}/metrics", headers=headers), 401)
        r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer key-bob"})
        assert r.status_code == 403 and error_of(r, 403)["code"] == "permission_denied"
        r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"})
        assert r.status_code == 200 and "kvfence_requests_total" in r.text
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
        with caplog.at_level(logging.INFO, logger="kvfence.requests"):
            # `user` names bob; the key is alice's: the tenant is alice (I7)
            srv.client(api_key="key-alice").completions.create(
                model=MODEL, prompt="hi", max_tokens=2, user="bob"
            )
            srv.wait_idle()
        assert srv.metric("kvfence_requests_total", outcome="finished", reason="length", tenant="alice") == 1
        assert srv.metric("kvfence_requests_total", outcome="finished", reason="length", tenant="bob") == 0
        (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvfence.requests"]
        assert line["tenant"] == "alice" and line["integrity"] == "ok" and line["pages_checked"] > 0
        assert line["user"] == "bob"  # logged as the client's label, apart from the tenant
        srv.assert_pool_clean()


# ---- 404 ----------------------------------------------------------------------------------------------------


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    error_of(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    r = httpx.get(f"{server.base_url}/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"


# ---- 400: parameters and malformed bodies ------------------------------------------------------------------

C, CHAT = "/completions", "/chat/completions"
BASE = {
    C: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def deep(levels: int) -> dict:
    """A JSON object nested `levels` deep (json.dumps raises RecursionError near 1,000)."""
    value: dict = {"type": "string"}
    for _ in range(levels):
        value = {"type": "object", "properties": {"a": value}}
    return value


BAD_PARAMS = [
    (C, {"temperature": "hot"}, "temperature"),
    (C, {"temperature": 3}, "temperature"),
    (C, {"top_p": 0}, "top_p"),
    (C, {"top_k": -5}, "top_k"),
    (C, {"n": 0}, "n"),
    (C, {"n": 10_000}, "n"),
    (C, {"max_tokens": -1}, "max_tokens"),
    (C, {"max_tokens": "5"}, "max_tokens"),
    (C, {"max_tokens": 1.5}, "max_tokens"),
    (C, {"stream": "yes"}, "stream"),
    (C, {"stop": [""]}, "stop"),
    (C, {"stop": ["x"] * 5000}, "stop"),
    (C, {"stop": 5}, "stop"),
    (C, {"prompt": {"a": 1}}, "prompt"),
    (C, {"prompt": [1, "a"]}, "prompt"),
    (C, {"prompt": [-1]}, "prompt"),
    (C, {"prompt": [10**9]}, "prompt"),
    (C, {"prompt": ["a"] * 1000}, "prompt"),
    (C, {"prompt": ["a"] * 64, "n": 3}, "n"),
    (C, {"logprobs": 50}, "logprobs"),
    (C, {"seed": 2**70}, "seed"),
    (C, {"max_tokens": 0}, "max_tokens"),
    (C, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (C, {"presence_penalty": -3}, "presence_penalty"),
    (C, {"repetition_penalty": 0}, "repetition_penalty"),
    (C, {"min_p": 1.5}, "min_p"),
    (C, {"min_tokens": 5}, "min_tokens"),  # more than max_tokens (2)
    (C, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (C, {"logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the vocabulary: it would do nothing
    (C, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"stop_token_ids": [999999]}, "stop_token_ids"),
    (C, {"model": None}, "model"),
    (C, {"prompt": None}, "prompt"),
    (CHAT, {"messages": None}, "messages"),
    (CHAT, {"messages": [{"role": None, "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (
        CHAT,
        {"stream_options": {"include_usage": False}},
        "stream_options",
    ),  # without stream: it would do nothing
    (C, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    (CHAT, {"max_tokens": 5, "max_completion_tokens": 7}, "max_tokens"),  # one would be dropped
    (CHAT, {"parallel_tool_calls": False}, "parallel_tool_calls"),  # without tools it would do nothing
    # nested past what json.dumps or json.loads recurse through: a RecursionError was a 500
    (C, {"structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}}, "structured_outputs"),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep(40)}}},
        "response_format",
    ),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep(40)}}]},
        "tools[0].function.parameters",
    ),
    (C, {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
    (C, {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # beyond int()'s digit limit
]


@pytest.mark.parametrize(("path", "change", "param"), BAD_PARAMS)
def test_invalid_parameter_is_400_naming_it(server, path, change, param):
    err = error_of(post(server, path, {**BASE[path], **change}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_missing_parameter_is_400(server):
    err = error_of(post(server, C, {"prompt": "hi"}), 400)
    assert (err["param"], err["code"]) == ("model", "missing_required_parameter")
    err = error_of(post(server, CHAT, {"model": MODEL}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b'{"model": "tiny", "prompt": "\xff\xfe"}',
        b"[" * 100_000,
    ],
    ids=["empty", "truncated", "text", "array", "string", "invalid-utf8", "deep"],
)
def test_malformed_body_is_400(server, content):
    err = error_of(post(server, C, content=content), 400)
    assert err["code"] == "invalid_json"


def test_empty_prompt_is_400(server):
    for path, change in ((C, {"prompt": ""}), (C, {"prompt": [[]]}), (C, {"prompt": []})):
        err = error_of(post(server, path, {**BASE[path], **change}), 400)
        assert err["param"] == "prompt"


# ---- 400 context_length_exceeded (I5), nothing allocated ----------------------------------------------------


def lease_state(server):
    pool = server.engine.engine.pool
    return server.between_steps(lambda: (pool.stats(), pool._next_lease, pool.owner.copy().tolist()))


def test_context_length_exceeded_touches_no_page(server, tiny_model):
    before = lease_state(server)
    body = {**BASE[C], "prompt": long_prompt(tiny_model, 200), "max_tokens": 100}
    err = error_of(post(server, C, body), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")  # completions: `prompt`
    assert "256" in str(err["message"]) and "300" in str(err["message"])  # the limit and what was asked
    assert "pool" not in str(err["message"])  # the pool (1024 tokens) is not the limit here
    err = error_of(post(server, C, {**BASE[C], "max_tokens": 10**18}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    text = "hello " * 400
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=5
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert lease_state(server) == before  # I5: no lease handed out, no page touched
    assert server.metric("kvfence_admission_rejections_total", reason="context_length_exceeded") >= 3


def test_pool_smaller_than_context_rejects_at_admission(tiny_model):
    # 16 pages x 4 tokens = 64 tokens of KV, context 256 (--allow-undersized-pool)
    with running_server(tiny_model, kv_pages=16, page_size=4) as srv:
        before = lease_state(srv)
        body = {**BASE[C], "prompt": long_prompt(tiny_model, 40), "max_tokens": 40}
        err = error_of(post(srv, C, body), 400)
        assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
        # over the pool, under the context: both limits
        assert "KV pool holds only 16 pages (64 tokens)" in str(err["message"])
        assert "context length of 256 tokens" in str(err["message"])
        # over the context too: still both, the pool being the smaller
        err = error_of(post(srv, C, {**body, "prompt": long_prompt(tiny_model, 200), "max_tokens": 100}), 400)
        assert "maximum context length is 256 tokens" in str(err["message"])
        assert "KV pool holds only 64 tokens" in str(err["message"]) and "300 tokens" in str(err["message"])
        chat = {**BASE[CHAT], "messages": [{"role": "user", "content": "hello " * 100}], "max_tokens": 5}
        err = error_of(post(srv, CHAT, chat), 400)
        assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
        assert "64" in str(err["message"]) and "256" in str(err["message"])
        assert lease_state(srv) == before
        ok = post(srv, C, {**body, "max_tokens": 20})  # 60 tokens: fits
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 20
        assert srv.client().models.list().data[0].model_extra["max_model_len"] == 64
        srv.assert_pool_clean()


# ---- 413 ----------------------------------------------------------------------------------------------------


def test_oversized_body_is_413(server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    err = error_of(post(server, C, content=big), 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(60):
            yield b"a" * (100 << 10)

    error_of(post(server, C, content=chunked()), 413)


# ---- 503 queue full -----------------------------------------------------------------------------------------


def test_queue_full_is_503_with_retry_after(tiny_model):
    with running_server(tiny_model, max_queue=2) as srv:
        # prompts x n over the whole queue can never be queued: a 400 naming n, not a 503 to retry forever
        err = error_of(post(srv, C, {**BASE[C], "n": 3}), 400)
        assert (err["param"], err["code"]) == ("n", "invalid_value") and "at most 2" in str(err["message"])
        err = error_of(post(srv, C, {**BASE[C], "prompt": ["a", "b", "c"]}), 400)
        assert err["param"] == "n"
        assert post(srv, C, {**BASE[C], "n": 2}).status_code == 200
        entered, gate = threading.Event(), threading.Event()
        blocker = threading.Thread(target=srv.between_steps, args=(lambda: (entered.set(), gate.wait(60)),))
        blocker.start()
        assert entered.wait(60)  # the engine thread is parked between steps: nothing leaves the queue
        body = {**BASE[C], "max_tokens": 3, "stream": True}
        with httpx.Client(timeout=60) as http:
            streams = [http.stream("POST", f"{srv.base_url}{C}", json=body) for _ in range(2)]
            responses = [s.__enter__() for s in streams]  # headers arrive once the request is queued
            assert [r.status_code for r in responses] == [200, 200]
            r = post(srv, C, BASE[C])
            err = error_of(r, 503)
            assert err["code"] == "queue_full" and r.headers["Retry-After"] == "1"
            with pytest.raises(openai.APIStatusError) as e:
                srv.client().completions.create(**BASE[C])
            assert e.value.status_code == 503
            gate.set()
            for resp, s in zip(responses, streams, strict=True):
                assert resp.read().decode().rstrip().endswith("data: [DONE]")
                s.__exit__(None, None, None)
        blocker.join(60)
        assert (
            srv.metric("kvfence_requests_total", outcome="rejected", reason="queue_full", tenant="anonymous")
            == 2
        )
        srv.assert_pool_clean()


# ---- 500 kv_integrity_error (I8) ----------------------------------------------------------------------------


def arm(srv, knob: str) -> None:
    faults = srv.engine.engine.faults
    srv.between_steps(lambda: setattr(faults, knob, 1))


@pytest.fixture()
def faulty(tiny_model):
    with running_server(tiny_model, kv_pages=9, page_size=4, faults=Faults()) as srv:
        yield srv
        srv.assert_pool_clean()


def test_integrity_failure_is_500(faulty, tiny_model):
    body = {**BASE[C], "prompt": long_prompt(tiny_model, 22), "max_tokens": 12, "temperature": 0}
    assert post(faulty, C, body).status_code == 200  # tenant A uses the whole pool, then leaves
    arm(faulty, "drop_write")
    other = long_prompt(tiny_model, 22)[::-1]  # another prompt: no prefix-cache hit, a full prefill
    with pytest.raises(openai.InternalServerError) as e:
        faulty.client().completions.create(**{**body, "prompt": other})
    assert e.value.code == "kv_integrity_error" and e.value.status_code == 500
    err = error_of(e.value.response, 500)
    assert err["type"] == "server_error"
    arm(faulty, "skip_stamp")
    err = error_of(post(faulty, CHAT, {**BASE[CHAT], "max_tokens": 4}), 500)
    assert err["code"] == "kv_integrity_error"
    faulty.wait_idle()
    assert (
        faulty.metric(
            "kvfence_requests_total", outcome="failed", reason="kv_integrity_error", tenant="anonymous"
        )
        == 2
    )
    assert (
        "kvfence_integrity_failures_total 2.0"
        in httpx.get(f"{faulty.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_KEY}"}).text
    )


@pytest.mark.parametrize("path", [C, CHAT])
def test_integrity_failure_in_a_stream_is_an_error_event_without_done(faulty, tiny_model, path):
    body = {**BASE[path], "max_tokens": 6, "stream": True}
    if path == C:
        body["prompt"] = long_prompt(tiny_model, 22)
    arm(faulty, "drop_write")
    with httpx.stream("POST", f"{faulty.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in events
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "kv_integrity_error"
    for e in events[:-1]:  # at most the chat role chunk before the failure: never content
        assert json.loads(e[6:])["choices"][0].get("finish_reason") is None
        assert not json.loads(e[6:])["choices"][0].get("text")
        assert not json.loads(e[6:])["choices"][0].get("delta", {}).get("content")
    arm(faulty, "drop_write")
    client = faulty.client()
    create = client.completions.create if path == C else client.chat.completions.create
    with pytest.raises(openai.APIError, match="integrity"):
        list(create(**{k: v for k, v in body.items()}))


def integrity_lines(caplog) -> list[dict[str, object]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvfence.requests"]
    return [line for line in lines if line["outcome"] != "rejected"]


def test_one_failed_choice_fails_the_whole_response(faulty, caplog):
    """n > 1, not streamed: one choice fails I1, the answer is a 500 with no text from any choice."""
    body = {**BASE[C], "prompt": "Hello world", "max_tokens": 6, "n": 3, "ignore_eos": True, "temperature": 0}
    ok = post(faulty, C, body).json()["choices"]
    assert all(c["text"] for c in ok)  # without the fault every choice has text
    arm(faulty, "drop_write")  # fires once: one choice is the victim, its siblings are healthy
    with caplog.at_level(logging.INFO, logger="kvfence.requests"):
        r = post(faulty, C, {**body, "prompt": "Goodbye, cruel world"})  # no prefix-cache hit: full prefill
        faulty.wait_idle()
    assert set(r.json()) == {"error"} and error_of(r, 500)["code"] == "kv_integrity_error"
    lines = integrity_lines(caplog)
    (failed,) = [line for line in lines if line["outcome"] == "failed"]
    assert (failed["reason"], failed["integrity"]) == ("kv_integrity_error", "failed")
    assert len(lines) == 3 and all(line["integrity"] != "failed" for line in lines if line is not failed)


def test_one_failed_choice_fails_the_whole_stream(faulty):
    body = {**BASE[CHAT], "max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True}
    arm(faulty, "drop_write")
    with httpx.stream("POST", f"{faulty.base_url}{CHAT}", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in events
    assert json.loads(events[-1][6:])["error"]["code"] == "kv_integrity_error"
    assert all("error" not in json.loads(e[6:]) for e in events[:-1])  # exactly one error event, last
