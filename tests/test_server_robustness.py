"""Bad clients never crash the server nor leak a page: fuzzed bodies, and clients that go away mid-request.

Disconnect tests are deterministic: the engine thread is parked between steps while the client leaves, and the
test waits for the server's abort call (an event), not for time to pass.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_harness import MODEL, TIMEOUT, Handle, running_server


@pytest.fixture(scope="module")
def server(tiny_model):
    # a short context keeps fuzzed requests that omit max_tokens (chat: "everything left") fast
    with running_server(tiny_model, context_length=48, max_queue=64) as handle:
        yield handle


@contextmanager
def parked(srv: Handle) -> Iterator[threading.Event]:
    """Park the engine thread between two steps until the returned gate is set (or the block exits)."""
    entered, gate = threading.Event(), threading.Event()
    blocker = threading.Thread(target=srv.between_steps, args=(lambda: (entered.set(), gate.wait(TIMEOUT)),))
    blocker.start()
    assert entered.wait(TIMEOUT)
    try:
        yield gate
    finally:
        gate.set()
        blocker.join(TIMEOUT)


def watch_aborts(srv: Handle, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    aborted = threading.Event()
    real = srv.engine.abort

    def abort(request_id: str) -> None:
        real(request_id)
        aborted.set()

    monkeypatch.setattr(srv.engine, "abort", abort)
    return aborted


def aborted_count(srv: Handle) -> float:
    return srv.metric("kvfence_requests_total", outcome="aborted", reason="abort", tenant="anonymous")


def test_disconnect_mid_stream_aborts_and_returns_pages(server, monkeypatch):
    before = aborted_count(server)
    aborted = watch_aborts(server, monkeypatch)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        with parked(server):
            r.close()  # the client goes away while its request is live
            assert aborted.wait(TIMEOUT), "the server did not abort the request"
    server.wait_idle()
    assert aborted_count(server) == before + 1
    server.assert_pool_clean()


def test_disconnect_while_waiting_for_a_non_streamed_answer(server, monkeypatch):
    before = aborted_count(server)
    aborted = watch_aborts(server, monkeypatch)
    submitted = threading.Event()
    real_submit = server.engine.submit

    def submit(*args, **kw):
        sub = real_submit(*args, **kw)
        submitted.set()
        return sub

    monkeypatch.setattr(server.engine, "submit", submit)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with parked(server):
        sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        assert submitted.wait(TIMEOUT)
        sock.close()
        assert aborted.wait(TIMEOUT)
    server.wait_idle()
    assert aborted_count(server) == before + 1
    server.assert_pool_clean()


def test_disconnect_mid_body_is_an_abort_not_a_server_error(server, monkeypatch, caplog):
    gone = threading.Event()
    real = server.metrics.on_client_gone

    def on_client_gone(tenant: str) -> None:
        real(tenant)
        gone.set()

    monkeypatch.setattr(server.metrics, "on_client_gone", on_client_gone)
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b'{"model": "tiny", "pro')  # then leaves, 978 bytes short
        sock.close()
        assert gone.wait(TIMEOUT), "the disconnect was not counted"
    assert server.metric(
        "kvfence_requests_total", outcome="aborted", reason="client_disconnect", tenant="anonymous"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no stack trace, no 500
    server.assert_pool_clean()


# ---- fuzz ---------------------------------------------------------------------------------------------------
# Bodies start valid-ish and get up to three mutations (a field replaced by arbitrary JSON, or deleted), so the
# fuzz reaches the engine as often as it reaches validation.

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, -1, 5, 20, 48, 10**6])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
short_text = st.text(min_size=1, max_size=3)
GOOD = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": short_text | st.lists(short_text, max_size=4),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=10),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "logit_bias": st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=4),
    "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 12),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
}
completion = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.text(max_size=40)
        | st.lists(st.integers(0, 383), min_size=1, max_size=20)
        | st.lists(st.text(max_size=20), min_size=1, max_size=3),
    },
    optional={**GOOD, "logprobs": st.integers(0, 5)},
)
chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                    "content": st.text(max_size=30),
                }
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional={
        **GOOD,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "max_completion_tokens": st.integers(1, 12),
    },
)
# beside the known fields, ones kvfence refuses (400 unsupported_parameter) and ones it accepts and ignores
NAMES = sorted({"model", "prompt", "messages", "logprobs", "top_logprobs", "max_completion_tokens", *GOOD,
                "tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "best_of",
                "no_such_field", "metadata", "store"})  # fmt: skip
mutations = st.lists(st.tuples(st.sampled_from(NAMES), st.none() | junk, st.booleans()), max_size=3)


def mutate(body: dict, changes: list) -> dict:
    body = dict(body)
    for name, value, delete in changes:
        if delete:
            body.pop(name, None)
        else:
            body[name] = value
    return body


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(kind=st.sampled_from(["/completions", "/chat/completions"]), data=st.data())
def test_fuzzed_requests_get_an_answer_and_leak_nothing(server, kind, data):
    base = data.draw(completion if kind == "/completions" else chat)
    path = data.draw(
        st.sampled_from([kind, kind, kind, "/completions", "/chat/completions"])
    )  # sometimes crossed
    body = mutate(base, data.draw(mutations))
    try:
        content = json.dumps(body).encode()
    except (ValueError, TypeError):
        return
    with httpx.stream("POST", f"{server.base_url}{path}", content=content, timeout=TIMEOUT) as r:
        raw = r.read()
    assert r.status_code in (200, 400, 404), raw
    if r.status_code != 200:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert raw.decode().rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(raw)["usage"]["total_tokens"] > 0


def test_after_the_fuzz_the_pool_is_whole(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.assert_pool_clean()


def test_a_crashed_engine_loop_fails_requests_loudly(tiny_model, caplog):
    with running_server(tiny_model) as srv, caplog.at_level(logging.INFO, logger="kvfence.requests"):

        def broken_step():
            raise RuntimeError("scheduler bug")

        srv.engine.engine.step = broken_step  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(f"{srv.base_url}/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "scheduler bug" in r.json()["error"]["message"]
        # the killed request is counted and logged as failed, like any other that ends
        labels = {"outcome": "failed", "reason": "engine_unavailable", "tenant": "anonymous"}
        assert srv.metric("kvfence_requests_total", **labels) == 1
        (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvfence.requests"]
        assert (line["outcome"], line["reason"], line["completion_tokens"]) == (
            "failed",
            "engine_unavailable",
            0,
        )
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.base_url}/completions", json={**body, "stream": True}, timeout=TIMEOUT)
        assert r.status_code == 503
