"""Tool calling (kvfence/server/tools.py): `tools`, `tool_choice` (none, auto, required, a named function),
`parallel_tool_calls`, the `tool` and `developer` roles, streamed tool-call deltas, through the official `openai`
client. On the tiny model (random weights) the grammar alone makes `required` and named calls parse and follow
their schemas; `auto` gives text that never opens a call, or calls that parse. Malformed tools and messages are a
400 before anything is allocated."""

from __future__ import annotations

import json
import shutil
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from kvfence.engine.grammar import Grammars
from kvfence.model.loader import load_model
from kvfence.model.tokenizer import IncrementalDetokenizer
from kvfence.server import tools as T
from tests.server_harness import MODEL, running_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# a template that renders tools and tool calls itself, in the hermes format (Qwen2.5's convention)
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


POOL = {
    "kv_pages": 1024,
    "max_num_batched_tokens": 512,
}  # prompts with tools run to ~1,000 tiny-tokenizer tokens


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    from tests.model_factory import write_tiny_hf_dir

    return write_tiny_hf_dir(tmp_path_factory.mktemp("tools") / "llama", seed=0, context_length=2048)


@pytest.fixture(scope="module")
def server(tools_dir):
    with running_server(load_model(tools_dir), **POOL) as handle:
        yield handle
        handle.assert_pool_clean()


@pytest.fixture(scope="module")
def hermes_server(tools_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tools_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    with running_server(load_model(path), **POOL) as handle:
        yield handle
        handle.assert_pool_clean()


def post(server: Any, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 400, "temperature": 0.0, **extra}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)


def choice(server: Any, **extra: Any) -> dict[str, Any]:
    r = post(server, **extra)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def assert_valid(call: dict[str, Any]) -> dict[str, Any]:
    """A call names a tool and its arguments follow that tool's schema."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
        assert len(args["city"]) <= 16 and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert call["function"]["name"] == "add"
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    return dict(args)


# ---- tool_choice ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["server", "hermes_server"])
def test_required_calls_parse_and_follow_their_schemas(fixture, request):
    server = request.getfixturevalue(fixture)
    for seed in range(4):  # sampled, not only greedy
        got = choice(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        assert got["finish_reason"] == "tool_calls", got
        calls = got["message"]["tool_calls"]
        assert calls and got["message"]["content"] is None
        for call in calls:
            assert_valid(call)
        assert len({c["id"] for c in calls}) == len(calls)


def test_a_named_choice_calls_that_function_once(server):
    for seed in range(3):
        named = {"type": "function", "function": {"name": "add"}}
        got = choice(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed)
        [call] = got["message"]["tool_calls"]
        assert call["function"]["name"] == "add"
        assert_valid(call)


def test_parallel_tool_calls_false_gives_one_call(server):
    for seed in range(4):
        got = choice(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                     temperature=1.0, seed=seed)  # fmt: skip
        assert len(got["message"]["tool_calls"]) == 1


def test_auto_gives_text_that_opens_no_call_or_calls_that_parse(server):
    kinds = set()
    for seed in range(6):
        got = choice(server, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=48)
        if got["message"].get("tool_calls"):
            kinds.add("calls")
            for call in got["message"]["tool_calls"]:
                assert_valid(call)
        else:
            kinds.add("text")
            assert "<tool_call>" not in got["message"]["content"]
    assert kinds  # which one a random model picks is its own business; both are well formed


def test_tools_are_rendered_into_the_prompt_unless_tool_choice_is_none(server):
    plain = post(server, max_tokens=1).json()["usage"]["prompt_tokens"]
    offered = post(server, max_tokens=1, tools=TOOLS).json()["usage"]["prompt_tokens"]
    none = post(server, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert offered > plain + 50
    assert none.json()["usage"]["prompt_tokens"] == plain
    assert "tool_calls" not in none.json()["choices"][0]["message"]


# ---- the round trip with the official client, streamed and not -----------------------------------------


@pytest.mark.parametrize("fixture", ["server", "hermes_server"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_with_the_openai_client(fixture, stream, request):
    server = request.getfixturevalue(fixture)
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "max_tokens": 400, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls = _streamed_calls(client, messages=ASK, tool_choice=named, **kw)
    else:
        done = client.chat.completions.create(messages=ASK, tool_choice=named, **kw)
        assert done.choices[0].finish_reason == "tool_calls"
        calls = [c.model_dump() for c in done.choices[0].message.tool_calls]
    [call] = calls
    assert call["function"]["name"] == "get_weather"
    assert_valid(call)
    history = [
        {"role": "developer", "content": "Answer briefly."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
    ]
    answer = client.chat.completions.create(messages=history, tool_choice="none", max_tokens=8, **{
        k: v for k, v in kw.items() if k != "max_tokens"})  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None


def _streamed_calls(client: Any, **kw: Any) -> list[dict[str, Any]]:
    """Rebuild calls from streamed deltas the way OpenAI's clients do: by index, the first delta brings the id,
    type and name, later ones append to the arguments."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": ""}}  # fmt: skip
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    return [calls[i] for i in sorted(calls)]


def test_a_stream_sends_the_same_calls_as_the_whole_response(server):
    client = server.client()
    for seed in range(3):
        kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
              "temperature": 1.0, "seed": seed}  # fmt: skip
        whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
        streamed = _streamed_calls(client, **kw)
        assert [(c.function.name, c.function.arguments) for c in whole] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in streamed
        ]


def test_a_call_cut_off_by_max_tokens_is_text_with_finish_reason_length(server):
    got = choice(server, tools=TOOLS, tool_choice="required", max_tokens=20)
    assert got["finish_reason"] == "length"
    assert "tool_calls" not in got["message"] and got["message"]["content"].startswith("<tool_call>")


# ---- refusals: 400 before any page ---------------------------------------------------------------------


_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
            "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools"),  # compiles to no grammar
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"functions": [{"name": "x"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "1"}]},
         "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [_CALL]}]}, "messages[0]"),
        ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages[1]"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
            {**_CALL, "function": {"name": "add", "arguments": "not json"}}]}]}, "messages[1]"),
    ],
)  # fmt: skip
def test_malformed_tools_and_messages_are_a_400_before_any_page(server, extra, param):
    before = server.pool_stats()
    r = post(server, **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert server.pool_stats() == before


# ---- the parser, on grammar-constrained random text (no server) ----------------------------------------


@pytest.mark.parametrize("fmt", [T.SMOLLM2, T.HERMES, T.LLAMA3_JSON], ids=lambda f: f.name)
def test_stream_and_whole_parse_agree_on_random_grammar_output(tiny_model, fmt):
    tok = tiny_model.tokenizer
    grammars = Grammars(tok, tiny_model.config.vocab_size)
    functions = [T.Function("get_weather", None, WEATHER), T.Function("add", "adds", ADD)]
    grammar = T.grammar(fmt, functions, only_calls=True, parallel=True)
    assert grammars.check(grammar) is None
    complete = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        state, out, stream, deltas = grammars.start(grammar), [], T.ToolStream(fmt), []
        detok = IncrementalDetokenizer(tok)  # as the engine streams text: never half a character
        while not state.done and len(out) < 600:
            token = int(rng.choice(np.flatnonzero(state.allowed())))
            out.append(token)
            state.consume(token)
            detok.push([token])
            deltas += stream.feed(detok.text, final=False)
        detok.flush()
        text = detok.text
        assert text == tok.decode(out)
        deltas += stream.feed(text, final=True)
        content, calls = T.parse(text, fmt)
        if not state.done:
            assert calls == [] and content == text  # cut off: all text
            continue
        complete += 1
        assert content is None and calls
        rebuilt: dict[int, str] = {}
        for d in deltas:
            assert "content" not in d
            for tc in d["tool_calls"]:
                rebuilt[tc["index"]] = rebuilt.get(tc["index"], "") + tc["function"]["arguments"]
        assert [c.arguments for c in calls] == [rebuilt[i] for i in sorted(rebuilt)]
        for call in calls:
            assert_valid(call.as_openai())
    assert complete >= 3


def test_text_is_held_back_only_while_it_may_open_a_call():
    stream = T.ToolStream(T.SMOLLM2)
    assert stream.feed("Hello <tool", final=False) == [{"content": "Hello "}]
    assert stream.feed("Hello <tools are", final=False) == [{"content": "<tools are"}]
    assert stream.feed("Hello <tools are", final=True) == []
    assert T.parse('<tool_call>[{"name": "f", "arguments": {"x"', T.SMOLLM2) == (
        '<tool_call>[{"name": "f", "arguments": {"x"',
        [],
    )
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": [1, "}"]}}\n</tool_call>'
    content, [call] = T.parse(text, T.HERMES)
    assert content == "Sure." and call.name == "f" and json.loads(call.arguments) == {"x": [1, "}"]}


def test_history_renders_calls_in_the_models_format():
    history = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 1}'}],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    rendered, extra = T.render_messages(history, [T.Function("add", None, ADD)], T.SMOLLM2)
    assert extra == {} and [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].endswith("be brief") and '"name": "add"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>'
    assert rendered[3]["content"] == "<tool_response>\n3\n</tool_response>"
    rendered, extra = T.render_messages(history, [T.Function("add", None, ADD)], T.HERMES)
    assert extra["tools"][0]["function"]["name"] == "add"
    assert rendered[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert rendered[3] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


# ---- PD: the grammar travels with the request; the decode worker finishes the calls --------------------


def test_pd_tool_round_trip_streamed_and_not(tools_dir, tmp_path):
    from tests.pd_cluster import pd_serve

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a"}))
    with pd_serve(
        tools_dir, keys, "--page-size", "4", "--prefill-kv-pages", "512", "--decode-kv-pages", "512"
    ) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0, timeout=120)
        kw: dict[str, Any] = {"model": tools_dir.name, "messages": ASK, "tools": TOOLS, "max_tokens": 400}
        for seed in range(2):
            whole = client.chat.completions.create(tool_choice="required", temperature=1.0, seed=seed, **kw)
            assert whole.choices[0].finish_reason == "tool_calls"
            calls = [c.model_dump() for c in whole.choices[0].message.tool_calls]
            for call in calls:
                assert_valid(call)
            streamed = _streamed_calls(client, tool_choice="required", temperature=1.0, seed=seed, **kw)
            assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        history = [*ASK, {"role": "assistant", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18"}]  # fmt: skip
        answer = client.chat.completions.create(
            **{**kw, "messages": history, "max_tokens": 8}, tool_choice="none", temperature=0
        )
        assert answer.choices[0].finish_reason in ("stop", "length")


# ---- fuzzing: tools fields well formed or not, the pool whole after it ---------------------------------

_schema = st.sampled_from([WEATHER, ADD, {}, {"type": "object"}, {"type": "nope"}, {"properties": 5}])
_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "custom"]),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "add", "f", "bad name", ""])},
                                       optional={"parameters": _schema, "description": st.text(max_size=12),
                                                 "strict": st.booleans()})})  # fmt: skip
_choice = st.sampled_from(["none", "auto", "required", "any", {"type": "function", "function": {"name": "add"}},
                           {"type": "function", "function": {"name": "f"}}, {"type": "function"}])  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": st.none() | st.text(max_size=20), "tool_call_id": st.sampled_from(["call_1", "x"]),
              "tool_calls": st.lists(st.just(_CALL), max_size=2)},
)  # fmt: skip


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tools=st.none() | st.lists(_tool, max_size=3),
    tool_choice=st.none() | _choice,
    parallel=st.none() | st.booleans(),
    history=st.lists(_message, max_size=3),
    stream=st.booleans(),
)
def test_fuzzed_tool_requests_get_an_answer_and_leak_nothing(
    server, tools, tool_choice, parallel, history, stream
):
    body = {"model": MODEL, "messages": [*ASK, *history], "max_tokens": 24, "temperature": 1.0, "seed": 0,
            "stream": stream, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        raw = r.read()
    assert r.status_code in (200, 400), raw
    if r.status_code == 400:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    elif stream:
        assert raw.decode().rstrip().endswith("data: [DONE]")
    else:
        for call in json.loads(raw)["choices"][0]["message"].get("tool_calls") or ():
            json.loads(call["function"]["arguments"])


def test_after_the_tools_fuzz_the_pool_is_whole(server):
    server.wait_idle()
    server.assert_pool_clean()
