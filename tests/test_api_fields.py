"""Issue 24, first part: no request field silently dropped, and the sampling set (presence, frequency and
repetition penalties, logit_bias, min_p, min_tokens, stop_token_ids), through the official `openai` client
against the real app on the tiny model. Each parameter has a test that fails without it, against the greedy
baseline of the same request without it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest

from kvfence.engine.request import SamplingParams
from kvfence.pd import control
from tests.server_harness import MODEL, running_server

PROMPT = [5, 9, 17, 33, 65, 129]


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model) as handle:
        engine = handle.engine.engine
        step = engine.step
        seen: list[list[int]] = []

        def recording_step() -> Any:
            outputs = step()
            seen.extend(list(o.token_ids) for o in outputs if o.finished)
            return outputs

        engine.step = recording_step  # type: ignore[method-assign]
        handle.last_token_ids = lambda: seen[-1]  # type: ignore[attr-defined]
        yield handle
        handle.assert_pool_clean()


def tokens(server: Any, **extra: Any) -> tuple[list[int], str]:
    """The completion's token ids and finish reason, greedy unless `extra` says otherwise: through the HTTP
    server, the ids read back by tokenizing nothing (the engine request's outputs, between steps)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, **extra}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return server.last_token_ids(), choice["finish_reason"]


def repeats(ids: list[int]) -> int:
    return sum(n - 1 for n in Counter(ids).values())


def test_logit_bias_of_minus_100_bans_a_token(server):
    greedy, _ = tokens(server, ignore_eos=True)
    banned = greedy[0]
    biased, _ = tokens(server, ignore_eos=True, logit_bias={str(banned): -100})
    assert banned not in biased
    boosted, _ = tokens(server, ignore_eos=True, logit_bias={"42": 100})
    assert boosted == [42] * 24


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}]
)
def test_each_penalty_reduces_repeats_against_the_greedy_baseline(server, penalty):
    greedy, _ = tokens(server, ignore_eos=True)
    assert repeats(greedy) > 0  # the tiny model loops when greedy: something to reduce
    penalized, _ = tokens(server, ignore_eos=True, **penalty)
    assert repeats(penalized) < repeats(greedy)


def test_min_tokens_holds_off_eos(server, tiny_model):
    eos = tiny_model.tokenizer.eos_token_ids[0]
    forced = {str(eos): 100}  # EOS at once, without min_tokens
    ids, reason = tokens(server, logit_bias=forced)
    assert (len(ids), reason) == (1, "stop")
    ids, reason = tokens(server, logit_bias=forced, min_tokens=5)
    assert (len(ids), reason) == (6, "stop") and eos not in ids[:5]


def test_stop_token_ids_end_the_request_at_that_token(server):
    greedy, _ = tokens(server, ignore_eos=True)
    stop = greedy[3]
    ids, reason = tokens(server, ignore_eos=True, stop_token_ids=[stop])
    first = greedy.index(stop)
    assert ids == greedy[: first + 1] and reason == "stop"


def test_min_p_of_one_keeps_only_the_most_likely_token(server):
    greedy, _ = tokens(server, ignore_eos=True)
    sampled, _ = tokens(server, ignore_eos=True, temperature=1.0, seed=7)
    assert sampled != greedy  # sampling differs from greedy here...
    only_top, _ = tokens(server, ignore_eos=True, temperature=1.0, seed=7, min_p=1.0)
    assert only_top == greedy  # ...and min_p=1 leaves it nothing but the argmax


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/completions", "best_of", 2),
        ("/completions", "suffix", "x"),
        ("/completions", "guided_json", {"type": "object"}),
        ("/chat/completions", "guided_regex", "a+"),
        ("/chat/completions", "functions", [{"name": "f"}]),
        ("/chat/completions", "function_call", "auto"),
        ("/chat/completions", "audio", {"voice": "alloy"}),
        ("/chat/completions", "reasoning_effort", "low"),
        ("/chat/completions", "no_such_field", 1),
    ],
)
def test_a_field_kvfence_does_not_implement_is_refused_naming_it(server, path, field, value):
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"prompt": "hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field and field in error["message"]
    if field.startswith("guided_"):
        assert "structured_outputs" in error["message"]


def test_a_nested_unknown_field_is_refused_and_harmless_fields_are_accepted(server):
    message = {"role": "user", "content": "hi", "refusal": "x"}
    body = {"model": MODEL, "max_tokens": 2, "messages": [message]}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].refusal", r.text
    harmless = {"metadata": {"run": "1"}, "store": False, "service_tier": "auto", "no_such_field": None}
    ok = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=harmless
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_the_sampling_set_crosses_the_pd_control_plane_intact():
    params = SamplingParams(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
        logit_bias=((3, -100.0), (7, 2.5)), min_p=0.1, min_tokens=2, stop_token_ids=(4, 9),
    )  # fmt: skip
    wire = control.encode(control.Prefill("r", 1, (1, 2), control.params_to_json(params), "t", ""))  # type: ignore[arg-type]
    decoded = control.decode(wire)
    assert isinstance(decoded, control.Prefill)
    assert control.params_from_json(decoded.params) == params


@pytest.mark.parametrize(
    "bad",
    [{"bogus": 1}, {"temperature": "x"}, {"max_tokens": True}, {"grammar": 5}, {"stop": "a"},
     {"stop_token_ids": [1.5]}, {"logit_bias": [[1]]}, {"top_p": float("nan")}, {"seed": 1.0}],
)  # fmt: skip
def test_a_peers_sampling_params_of_the_wrong_shape_are_a_control_error(bad):
    """A PD worker takes a peer's parameters only as SamplingParams' own fields with their own types: anything
    else is a ControlError (a ValueError: the worker answers 400 and goes on), never dropped and never a
    TypeError out of the dataclass's comparisons (it ended the worker's loop)."""
    from dataclasses import fields

    assert set(control._PARAM_CHECKS) == {f.name for f in fields(SamplingParams)}
    with pytest.raises(control.ControlError):
        control.params_from_json({"max_tokens": 4, **bad})


def test_tokenize_and_detokenize(server, tiny_model):
    tok = tiny_model.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "hello there"}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tok.encode("hello there", add_special_tokens=True) and got["count"] == len(
        got["tokens"]
    )
    assert got["max_model_len"] > 0
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": got["tokens"]}, timeout=60)
    assert back.status_code == 200 and "hello there" in back.json()["prompt"]
    messages = [{"role": "user", "content": "hi"}]
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    chat = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert counted.json()["count"] == chat.usage.prompt_tokens  # exactly what the engine was given
    for path, body, param in (
        ("/detokenize", {"model": MODEL, "tokens": [10**6]}, "tokens"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": messages}, None),
        ("/tokenize", {"model": MODEL}, None),
        ("/tokenize", {"model": MODEL, "prompt": "a", "truncate": 3}, "truncate"),
        (
            "/tokenize",
            {"model": MODEL, "messages": messages, "add_special_tokens": False},
            "add_special_tokens",
        ),
        (
            "/tokenize",
            {"model": MODEL, "prompt": "a", "add_generation_prompt": False},
            "add_generation_prompt",
        ),
    ):
        bad = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert bad.status_code == 400, bad.text
        assert param is None or bad.json()["error"]["param"] == param
    wrong = httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "a"}, timeout=60)
    assert wrong.status_code == 404


NAMED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_messages_name_is_rendered_by_a_template_that_uses_it_and_refused_by_one_that_does_not(
    server, tiny_model
):
    """Never accepted and ignored: `name` reaches the chat template; a template that does not render it (the
    tiny model's, like SmolLM2's) gets a 400 naming the message, and nothing is queued."""
    from kvfence.model.tokenizer import Tokenizer
    from kvfence.server.errors import OpenAIError
    from kvfence.server.serving import render_chat
    from kvfence.server.tools import Function, ToolFormat

    tok = tiny_model.tokenizer
    named = Tokenizer(tok._hf, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                      add_bos=tok.add_bos, chat_template=NAMED_TEMPLATE)  # fmt: skip
    messages = [{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}]
    text = render_chat(named, ToolFormat.for_template(NAMED_TEMPLATE), messages, [])
    assert "<|im_start|>user (alice)" in text and text.count("(") == 1
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.name"):
        render_chat(tok, ToolFormat.for_template(tok.chat_template), messages, [])
    # with tools, kvfence's own system prompt goes first: the index is still the client's
    tool = Function("f", None, {"type": "object"})
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.name"):
        render_chat(tok, ToolFormat.for_template(tok.chat_template), messages, [tool])

    before = server.engine.engine.pool.num_free
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": "bob"}]
    body = {"model": MODEL, "max_tokens": 4, "messages": chat}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "messages[1].name" in r.json()["error"]["message"]
    assert server.engine.engine.pool.num_free == before
    del body["messages"][1]["name"]
    assert httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60).status_code == 200
