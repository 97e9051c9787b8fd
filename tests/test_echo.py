"""`echo` on completions, with prompt logprobs (SamplingParams.prompt_logprobs): the prompt comes back before the
completion and, with `logprobs`, every prompt token after the first is scored, as lm-eval-harness's
loglikelihood requests need (`echo=True, max_tokens=0, logprobs=k`). The scores are the model's own: they match a
whole-sequence forward of Hugging Face transformers on the same weights, however the prefill is chunked."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
import transformers

from kvfence.engine.request import SamplingParams
from tests.conftest import make_engine, run_all
from tests.server_harness import MODEL, running_server

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world!"


def reference(tiny_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: log P(ids[i + 1] | ids[: i + 1]) from transformers, float32, one forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("chunk", [8, 256])
def test_prompt_logprobs_match_a_whole_sequence_forward(tiny_model, tiny_dir, chunk):
    ids = tiny_model.tokenizer.encode(PROMPT)
    engine = make_engine(tiny_model, max_num_batched_tokens=chunk)
    engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), "scored")
    engine.add_request(ids[::-1], SamplingParams(max_tokens=4, temperature=0), "plain")  # batched beside it
    first = next(o for o in _outputs(engine) if o.request_id == "scored" and o.new_token_ids)
    entries = first.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    got = torch.tensor([e[0] for e in entries[1:]])
    torch.testing.assert_close(got, reference(tiny_dir, ids), atol=1e-4, rtol=1e-4)
    for e in entries[1:]:
        assert len(e[1]) == 3 and e[1][0][1] >= e[1][1][1] >= e[1][2][1] and e[1][0][1] >= e[0] - 1e-6


def _outputs(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        engine.check_integrity()
    return outs


def test_a_prompt_logprobs_request_reads_nothing_from_the_prefix_cache(tiny_model):
    ids = tiny_model.tokenizer.encode(PROMPT)
    engine = make_engine(tiny_model)
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), "warm")
    run_all(engine)
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), "scored")
    final = run_all(engine)["scored"]
    assert final.num_cached_tokens == 0


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model, max_num_batched_tokens=16) as handle:
        yield handle
        handle.assert_pool_clean()


def complete(server: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, **extra}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_echo_returns_the_prompt_then_the_completion(server, tiny_model):
    plain = complete(server, max_tokens=4)["choices"][0]["text"]
    echoed = complete(server, max_tokens=4, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + plain
    ids = tiny_model.tokenizer.encode(PROMPT)
    as_ids = complete(server, prompt=ids, max_tokens=4, echo=True)["choices"][0]["text"]
    assert as_ids == tiny_model.tokenizer.decode(ids, skip_special_tokens=False) + plain


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(server, tiny_model, tiny_dir):
    ids = tiny_model.tokenizer.encode(PROMPT)
    done = complete(server, max_tokens=3, echo=True, logprobs=2)
    lp = done["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
    torch.testing.assert_close(got, reference(tiny_dir, ids), atol=1e-4, rtol=1e-4)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert done["usage"]["completion_tokens"] == 3 and done["usage"]["prompt_tokens"] == len(ids)


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(server, tiny_model):
    ids = tiny_model.tokenizer.encode(PROMPT)
    done = complete(server, max_tokens=0, echo=True, logprobs=1)
    choice = done["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert done["usage"]["completion_tokens"] == 0
    r = httpx.post(f"{server.base_url}/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_sends_what_the_whole_response_does(server, max_tokens):
    kw = {"max_tokens": max_tokens, "echo": True, "logprobs": 2, "n": 2, "seed": 5, "temperature": 1.0}
    whole = complete(server, **kw)
    body = {"model": MODEL, "prompt": PROMPT, **kw, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    for index in (0, 1):
        parts = [c for e in events for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in parts) == whole["choices"][index]["text"]
        tokens = [t for c in parts if c["logprobs"] for t in c["logprobs"]["tokens"]]
        scores = [t for c in parts if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        assert tokens == whole["choices"][index]["logprobs"]["tokens"]
        assert scores == whole["choices"][index]["logprobs"]["token_logprobs"]
        assert parts[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]
    assert events[-1]["usage"] == whole["usage"]
