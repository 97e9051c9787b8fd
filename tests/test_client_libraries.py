"""Client libraries nobody here wrote, unchanged, against kvfence: `instructor` (1.17.0) extracting a pydantic
model through a forced tool call, and LangChain's `ChatOpenAI` (langchain-openai 1.8.1) with
`with_structured_output` (response_format json_schema) and `bind_tools` (tools, a named and a required
tool_choice). On the tiny model (random weights) only the grammar makes the answers valid, which is the point:
what these libraries parse always parses."""

from __future__ import annotations

from typing import Literal

import instructor
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from kvfence.model.loader import load_model
from tests.server_harness import MODEL, running_server

ASK = "What is the weather in Paris?"


class Weather(BaseModel):
    """Weather in a city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties false: a random model may not add keys

    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    """Add two integers."""

    model_config = ConfigDict(extra="forbid")

    a: int = Field(ge=-999, le=999)
    b: int = Field(ge=-999, le=999)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.model_factory import write_tiny_hf_dir

    path = write_tiny_hf_dir(tmp_path_factory.mktemp("clients") / "llama", seed=0, context_length=2048)
    with running_server(load_model(path), kv_pages=1024, max_num_batched_tokens=512) as handle:
        yield handle
        handle.assert_pool_clean()


def test_instructor_extracts_a_pydantic_model(server):
    client = instructor.from_openai(server.client(), mode=instructor.Mode.TOOLS)
    for seed in range(3):
        got = client.chat.completions.create(
            model=MODEL, response_model=Weather, messages=[{"role": "user", "content": ASK}],
            max_tokens=400, temperature=1.0, seed=seed, max_retries=0,
        )  # fmt: skip
        assert isinstance(got, Weather)


def test_instructor_json_schema_mode(server):
    client = instructor.from_openai(server.client(), mode=instructor.Mode.JSON_SCHEMA)
    got = client.chat.completions.create(
        model=MODEL, response_model=Add, messages=[{"role": "user", "content": "1 + 2"}], max_tokens=400,
        temperature=0, max_retries=0,
    )  # fmt: skip
    assert isinstance(got, Add)


def _chat(server) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="none", temperature=0, max_tokens=400,
                      max_retries=0, timeout=60)  # fmt: skip


def test_langchain_with_structured_output(server):
    for method in ("json_schema", "function_calling"):
        got = _chat(server).with_structured_output(Weather, method=method).invoke(ASK)
        assert isinstance(got, Weather), method


def test_langchain_bind_tools_round_trip(server):
    llm = _chat(server)
    for choice in ("Weather", "required"):
        reply = llm.bind_tools([Weather, Add], tool_choice=choice).invoke([HumanMessage(ASK)])
        assert reply.tool_calls and not reply.invalid_tool_calls, reply
        call = reply.tool_calls[0]
        if choice == "Weather":
            assert call["name"] == "Weather"
        parsed = (Weather if call["name"] == "Weather" else Add).model_validate(call["args"])
        history = [
            HumanMessage(ASK),
            reply,
            ToolMessage(content=parsed.model_dump_json(), tool_call_id=call["id"]),
        ]
        answer = llm.bind_tools([Weather, Add], tool_choice="none").invoke(history, max_tokens=8)
        assert answer.response_metadata["finish_reason"] in ("stop", "length")
