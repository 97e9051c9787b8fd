"""Structured outputs (kvfence/engine/grammar.py, llguidance): OpenAI's response_format (json_object,
json_schema) and vLLM's structured_outputs (json, regex, choice, grammar), through the official `openai` client.
On the tiny model (random weights) the grammar alone makes the output valid: it always parses and validates, and
ends with `stop`. A grammar that cannot be built is a 400 before anything is allocated."""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from kvfence.engine.request import SamplingParams
from tests.server_harness import MODEL, running_server

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
HI = [{"role": "user", "content": "Describe the sky."}]


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model) as handle:
        yield handle
        handle.assert_pool_clean()


def chat(server: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": HI, "max_tokens": 64, "temperature": 0.0, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def test_json_schema_output_parses_and_validates(server):
    for seed in range(3):  # sampled, not only greedy
        choice = chat(server, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}})  # fmt: skip
        value = json.loads(choice["message"]["content"])
        assert (
            set(value) == {"ok", "color"}
            and isinstance(value["ok"], bool)
            and value["color"] in ("red", "green", "blue")
        )
        assert choice["finish_reason"] == "stop"


def test_json_object_is_an_object(server):
    choice = chat(server, max_tokens=200, response_format={"type": "json_object"})
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may write a long object: then it ran out of tokens, and says so
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_structured_outputs_regex_choice_and_grammar(server):
    text = chat(server, structured_outputs={"regex": r"\d{3}-[a-z]{2}"})["message"]["content"]
    assert re.fullmatch(r"\d{3}-[a-z]{2}", text)
    text = chat(server, structured_outputs={"choice": ["yes", "no", "maybe"]})["message"]["content"]
    assert text in ("yes", "no", "maybe")
    lark = 'start: "sky is " COLOR\nCOLOR: "blue" | "grey"'
    assert chat(server, structured_outputs={"grammar": lark})["message"]["content"] in (
        "sky is blue",
        "sky is grey",
    )
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["A", "B"]}}
    completion = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert completion.json()["choices"][0]["text"] in ("A", "B")


class Color(StrEnum):
    red = "red"
    green = "green"


class Sky(BaseModel):
    clear: bool
    color: Color


def test_the_openai_clients_parse_returns_the_pydantic_object(server):
    client = server.client()
    done = client.chat.completions.parse(
        model=MODEL, messages=HI, response_format=Sky, max_tokens=64, temperature=0
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Sky)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 6}, "min_tokens"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}, "description": "d"},
                }
            },
            "response_format",
        ),
    ],
)
def test_a_structured_output_that_cannot_be_built_is_a_400_before_any_page(server, extra, param):
    before = server.pool_stats()
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.pool_stats() == before


def test_the_grammar_state_survives_a_hand_off(tiny_model):
    """PD: the decode side rebuilds the state from the grammar and the first token (what `complete_transfer`
    does); the continuation is the colocated one."""
    from kvfence.engine.grammar import Grammars, grammar_text

    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size)
    g = grammar_text("json_schema", SCHEMA)
    whole = grammars.start(g)
    first = int(whole.allowed().nonzero()[0][0])
    whole.consume(first)
    rebuilt = grammars.start(g, [first])
    assert (rebuilt.allowed() == whole.allowed()).all()
    assert SamplingParams(grammar=g).grammar == g


def test_the_sampler_masks_exactly_the_disallowed_tokens_of_its_structured_rows():
    """Packed masks (bit t % 32 of word t // 32) applied to some rows of a batch; ids past the tokenizer's
    vocabulary (a model vocabulary padded beyond it) are never allowed."""
    import numpy as np
    import torch

    from kvfence.model.sampler import _mask_disallowed

    rng = np.random.default_rng(0)
    logits = torch.randn(3, 70)
    words = [rng.integers(-(2**31), 2**31, size=2, dtype=np.int64).astype(np.int32) for _ in range(2)]
    got = logits.clone()
    _mask_disallowed(got, [0, 2], words)
    for row, w in zip([0, 2], words, strict=True):
        allowed = [bool((int(w[t // 32]) >> (t % 32)) & 1) if t < 64 else False for t in range(70)]
        for t in range(70):
            assert (got[row, t] == logits[row, t]) if allowed[t] else got[row, t] == float("-inf")
    assert torch.equal(got[1], logits[1])
