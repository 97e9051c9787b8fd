"""Engine behaviour on a tiny generated model: batching invariance, preemption, admission, aborts, sampling."""

from __future__ import annotations

import queue
import random
import threading

import pytest

from kvfence.engine.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    EmptyPromptError,
    PoolCapacityExceeded,
)
from kvfence.engine.request import IllegalTransition, Request, RequestState, SamplingParams
from kvfence.ids import RequestId
from tests.conftest import make_engine, run_all


def prompts_for(model, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def solo_outputs(model, prompts, params) -> list[tuple[int, ...]]:
    outs = []
    for prompt, p in zip(prompts, params, strict=True):
        engine = make_engine(model)
        engine.add_request(prompt, p)
        (final,) = run_all(engine).values()
        outs.append(final.token_ids)
    return outs


@pytest.fixture(scope="module")
def batch_case(tiny_model):
    prompts = prompts_for(tiny_model, 16, seed=1)
    rng = random.Random(2)
    params = [greedy(rng.randint(8, 20)) for _ in prompts]
    return prompts, params, solo_outputs(tiny_model, prompts, params)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # everything fits: one big batch
        dict(max_num_batched_tokens=24),  # chunked prefill, prefill and decode mixed in a step
        dict(kv_pages=24, max_num_batched_tokens=64),  # the pool runs out: preempt and recompute
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_greedy_output_is_the_same_alone_and_batched(tiny_model, batch_case, overrides):
    prompts, params, expected = batch_case
    engine = make_engine(tiny_model, **overrides)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    final = run_all(engine)
    assert [final[i].token_ids for i in ids] == expected
    assert all(final[i].finish_reason == "length" for i in ids)
    if "kv_pages" in overrides:
        assert engine.stats.preemptions > 0, "the case must actually preempt"


def test_seeded_sampling_is_the_same_alone_and_batched(tiny_model):
    prompts = prompts_for(tiny_model, 6, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=i) for i in range(6)]
    expected = solo_outputs(tiny_model, prompts, params)
    engine = make_engine(tiny_model, kv_pages=20)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    final = run_all(engine)
    assert [final[i].token_ids for i in ids] == expected
    assert len(set(expected)) > 1
    assert engine.stats.preemptions > 0, "the case must actually preempt"


def test_top_k_one_is_greedy(tiny_model):
    prompt = prompts_for(tiny_model, 1, seed=4)
    (g,) = solo_outputs(tiny_model, prompt, [greedy(12)])
    (k,) = solo_outputs(
        tiny_model, prompt, [SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)]
    )
    assert g == k


def test_stop_token_ids_and_max_tokens(tiny_model):
    prompt = prompts_for(tiny_model, 1, seed=5)
    (ref,) = solo_outputs(tiny_model, prompt, [greedy(12)])
    stop_at = ref[5]
    (out,) = solo_outputs(
        tiny_model, prompt, [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,))]
    )
    assert out == ref[: ref.index(stop_at) + 1]


def test_stop_string_cuts_text_and_never_streams_it(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts_for(tiny_model, 1, seed=6)[0]
    engine.add_request(prompt, greedy(16))
    (ref,) = run_all(engine).values()
    assert len(ref.text) > 6
    stop = ref.text[3:6]
    engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,)))
    streamed = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            streamed.append(out.new_text)
            final = out
    assert final is not None and final.finish_reason == "stop"
    assert final.text == ref.text[: ref.text.index(stop)]
    assert "".join(streamed) == final.text


# ---- admission (I5) ---------------------------------------------------------------------------------------


def test_admission_rejects_before_allocating(tiny_model):
    engine = make_engine(tiny_model, kv_pages=8, page_size=4, context_length=64)
    before = engine.pool.stats()
    with pytest.raises(EmptyPromptError):
        engine.add_request([], greedy(4))
    with pytest.raises(ContextLengthExceeded) as exc:
        engine.add_request([5] * 60, greedy(10))
    assert "64" in str(exc.value) and "70" in str(exc.value)
    with pytest.raises(PoolCapacityExceeded) as exc:
        engine.add_request([5] * 30, greedy(10))  # fits the context (64) but not the pool (32 tokens)
    assert "40 tokens" in str(exc.value) and "8 pages" in str(exc.value)
    assert engine.pool.stats() == before
    assert not engine.has_unfinished()
    assert engine.stats.outcomes == {"rejected:invalid_prompt": 1, "rejected:context_length_exceeded": 2}


def test_rejected_is_terminal_and_never_holds_pages():
    request = Request(RequestId("r"), [1, 2], SamplingParams())
    request.transition(RequestState.REJECTED)
    for state in RequestState:
        with pytest.raises(IllegalTransition):
            request.transition(state)
    with pytest.raises(AssertionError):
        request.add_leases([])


# ---- aborts -----------------------------------------------------------------------------------------------


def test_abort_from_another_thread_at_any_time(tiny_model):
    """The engine loop runs in its own thread; the test thread aborts requests as their outputs arrive."""
    engine = make_engine(tiny_model, kv_pages=40)
    outputs: queue.Queue = queue.Queue()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for out in engine.step():
                outputs.put(out)
            engine.pool.check_integrity()

    prompts = prompts_for(tiny_model, 20, seed=7)
    ids = [engine.add_request(p, greedy(30)).request_id for p in prompts]
    engine.abort(ids[0])  # before it ever runs
    thread = threading.Thread(target=loop)
    thread.start()
    done: dict[str, str] = {}
    seen = 0
    while len(done) < len(ids):
        out = outputs.get(timeout=120)
        seen += 1
        if seen % 3 == 0:
            engine.abort(out.request_id)  # mid-flight, possibly while a step runs
        if out.finished:
            done[out.request_id] = out.finish_reason
    engine.abort("no-such-request")
    stop.set()
    thread.join()
    assert done[ids[0]] == "abort"
    assert set(done.values()) <= {"abort", "length"} and "abort" in done.values()
    engine.pool.check_integrity()
    assert engine.pool.stats().num_free == engine.pool.num_pages


def token_boundaries(engine, token_ids) -> list[int]:
    """Character offsets in the decoded text where one output token ends and the next begins."""
    return [len(engine.tokenizer.decode(list(token_ids[:i]))) for i in range(1, len(token_ids))]


def run_streamed(engine, prompt, params):
    engine.add_request(prompt, params)
    streamed, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            streamed.append(out.new_text)
            final = out
    return final, "".join(streamed)


def test_stop_string_split_across_tokens_and_at_the_last_token(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts_for(tiny_model, 1, seed=8)[0]
    engine.add_request(prompt, greedy(16))
    (ref,) = run_all(engine).values()
    cuts = [b for b in token_boundaries(engine, ref.token_ids) if 2 <= b <= len(ref.text) - 2]
    b = cuts[len(cuts) // 2]
    split = ref.text[b - 1 : b + 1]  # one character of each neighbouring token
    final, streamed = run_streamed(
        engine, prompt, SamplingParams(max_tokens=16, temperature=0, stop=(split,))
    )
    assert final.finish_reason == "stop" and final.text == ref.text[: ref.text.index(split)] == streamed
    # the stop string is completed by the very token that also hits max_tokens
    n = next(i for i in range(1, 17) if split in engine.tokenizer.decode(list(ref.token_ids[:i])))
    final, streamed = run_streamed(engine, prompt, SamplingParams(max_tokens=n, temperature=0, stop=(split,)))
    assert final.finish_reason == "stop" and final.text == ref.text[: ref.text.index(split)] == streamed


def test_duplicate_request_ids_are_refused_while_live(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request([5, 6, 7], greedy(3), request_id="same")
    with pytest.raises(DuplicateRequestId):
        engine.add_request([8, 9], greedy(3), request_id="same")
    run_all(engine)
    engine.add_request([8, 9], greedy(3), request_id="same")  # free again once the first one ended
    assert set(run_all(engine)) == {"same"}


def test_a_failing_forward_step_fails_its_requests_and_the_engine_goes_on(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    ids = [engine.add_request(p, greedy(5)).request_id for p in prompts_for(tiny_model, 3, seed=9)]
    real_run = engine.runner.run
    calls = iter([RuntimeError("simulated device fault")])

    def flaky(plan, stop=None):
        exc = next(calls, None)
        if exc is not None:
            raise exc
        return real_run(plan, stop)

    monkeypatch.setattr(engine.runner, "run", flaky)
    final = run_all(engine)
    assert {final[i].error_code for i in ids} == {"internal_error"}
    later = engine.add_request([5, 6, 7], greedy(4)).request_id
    assert run_all(engine)[later].finish_reason == "length"


def test_decode_threads_apply_to_decode_only_steps(tiny_model):
    """--decode-threads: steps with prefill tokens run on --threads, decode-only steps on --decode-threads; the
    output does not change."""
    import torch

    before = torch.get_num_threads()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        engine = make_engine(tiny_model, threads=2, decode_threads=1)
        engine.add_request([5, 6, 7, 8, 9], params, request_id="a")
        engine.step()  # the prefill
        assert torch.get_num_threads() == 2
        engine.step()  # a decode
        assert torch.get_num_threads() == 1
        got = run_all(engine)["a"].token_ids
        reference = make_engine(tiny_model)
        reference.add_request([5, 6, 7, 8, 9], params, request_id="a")
        assert run_all(reference)["a"].token_ids == got
    finally:
        torch.set_num_threads(before)


def test_a_row_whose_logits_are_not_finite_fails_its_request_and_no_other(tiny_model, batch_case):
    """A NaN in one request's logits (a kernel or numerical fault, a corrupt page that passed every check): the
    sampler's pick among NaNs is an index, not the model's answer. That request fails (non_finite_logits, a 500
    at the HTTP front) with nothing more emitted; the other requests of the same steps finish with the tokens
    they get alone."""
    prompts, params, expected = batch_case
    engine = make_engine(tiny_model)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    sampler, calls = engine.runner.sampler, []

    def poisoned(logits, *args):
        calls.append(len(calls))
        if len(calls) == 4:  # a decode step of every request: the third sampling row's logits go NaN
            logits = logits.clone()
            logits[2, 7] = float("nan")
        return sampler(logits, *args)

    engine.runner.sampler = poisoned
    final = run_all(engine)
    failed = [i for i in ids if final[i].finish_reason == "error"]
    assert len(failed) == 1 and final[failed[0]].error_code == "non_finite_logits"
    assert final[failed[0]].token_ids == expected[ids.index(failed[0])][: len(final[failed[0]].token_ids)]
    for i, want in zip(ids, expected, strict=True):
        if i not in failed:
            assert final[i].token_ids == want and final[i].finish_reason == "length"
    assert engine.stats.outcomes.get("failed:non_finite_logits") == 1
