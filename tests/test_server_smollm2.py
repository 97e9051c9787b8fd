"""The server end to end on the real default model (SmolLM2-135M-Instruct), with the official `openai` client."""

from __future__ import annotations

import pytest

from tests.conftest import SERVED_DTYPE, float32_answer
from tests.server_harness import MODEL, running_server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Complete the sentence: The capital of France is"}]  # clear margins


@pytest.fixture(scope="module")
def server(smollm2_served):
    """The dtype and kernels `kvfence serve` takes here; no prefix cache, so that the same prompt sent twice is
    computed in the same chunks: a hit leaves a short tail, whose rows take the int8 decode kernels instead of
    the prompt's bfloat16 products, and the answers parted after 5 words on an Intel Xeon with AMX (not on AMD
    Zen4). Equal answers from a hit are not promised (docs/quality.md); a hit's output on this model is held to
    the cold one in float32 by tests/test_prefix_cache_engine.py."""
    with running_server(
        smollm2_served,
        page_size=16,
        kv_pages=64,
        max_num_batched_tokens=512,
        dtype=SERVED_DTYPE,
        enable_prefix_cache=False,
    ) as handle:
        yield handle
        handle.assert_pool_clean()


def test_chat_answers_and_counts_tokens(server, smollm2):
    expected = float32_answer(smollm2, QUESTION, "Paris")
    r = server.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert r.choices[0].message.content.startswith(expected), (r.choices[0].message.content, expected)
    tok = smollm2.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(QUESTION)))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_the_non_streamed_answer(server):
    client = server.client()
    question = [{"role": "user", "content": "Name three colours of the rainbow."}]
    full = client.chat.completions.create(model=MODEL, messages=question, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=question,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    assert chunks[-1].usage is not None and counts(chunks[-1].usage) == counts(full.usage)


def test_a_tool_round_trip_on_the_real_model(server):
    """SmolLM2's chat template knows no tools: kvfence offers them in SmolLM2's own tool-calling prompt and the
    grammar holds the call to the schema; the model fills in the city from the question."""
    import json

    weather = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
               "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": weather}}]  # fmt: skip
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = server.client()
    done = client.chat.completions.create(
        model=MODEL, messages=ask, tools=tools, tool_choice="required", max_tokens=64, temperature=0
    )
    assert done.choices[0].finish_reason == "tool_calls"
    [call] = done.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    assert "paris" in args["city"].lower()  # the grammar fixes the shape; the model reads the city
    history = [*ask, done.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, max_tokens=24, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
