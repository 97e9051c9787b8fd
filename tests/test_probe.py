"""`kvfence probe`: the finding logic on synthetic replies; small fake OpenAI servers (honest, one that serves
other requests' text back, one that answers over-length prompts with 200); and kvfence itself: clean colocated and
in PD mode with an undersized prefill pool, a leak found with a fault knob and the integrity checks off, and a
clean report (victims failed closed) with the checks on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfence.cli import main as kvfence_main
from kvfence.faults import Faults
from kvfence.probe.canary import FRAGMENT_CHARS, Form, Secret, find_leak, make_secret, normalize
from kvfence.probe.client import Result
from kvfence.probe.findings import (
    FindingKind,
    TimingTest,
    failures,
    leaks,
    limits,
    load_test,
    load_timing,
    prefix_timing,
    speed,
    timing_test,
    usage,
)
from kvfence.probe.plan import (
    FLOOD_MAX_TOKENS,
    NUM_LOAD_SAMPLES,
    Expect,
    Job,
    Kind,
    Limits,
    Tenant,
    build_plan,
)
from kvfence.probe.prompts import TRIGGER, TokenModel, TokenRange, a_prompt, b_prompt, fit, shuffled
from kvfence.probe.stats import mann_whitney_less
from kvfence.server.background import serve_in_thread
from tests.pd_cluster import free_port, pd_serve, undersized_prefill

KEYS = {"key-a": "team-a", "key-b": "team-b"}
EXACT = TokenModel("usage", base=6.0, per_word=1.0, exact=True)
TEN_TOKENS = TokenRange(10, 10)


def job(kind: Kind = Kind.BAIT, tenant: Tenant = Tenant.B, prompt: str = "Notes: river\nSecret code:", *,
        tokens: TokenRange = TEN_TOKENS, max_tokens: int = 16, expect: Expect = Expect.SERVE,
        secret: Secret | None = None, jid: str = "") -> Job:  # fmt: skip
    return Job(
        jid or f"{tenant.value}-{kind.value}", tenant, kind, prompt, max_tokens, False, expect, tokens, secret
    )


def reply(j: Job, text: str = "", status: int = 200, prompt_tokens: int | None = None,
          completion_tokens: int | None = None, ttft: float | None = None, latency: float = 1.0,
          error: str | None = None) -> Result:  # fmt: skip
    return Result(j, status, text, prompt_tokens, completion_tokens, ttft, latency, error)


# ---- secrets and the leak test -----------------------------------------------------------------------------


def test_a_secret_leaks_whole_or_as_a_long_enough_run_but_not_from_the_replys_own_prompt():
    s = Secret("zorvek tamuli 4829", Form.WORDS)
    assert find_leak(s, "it says ZORVEK-Tamuli_4829.").complete
    assert find_leak(s, "the answer: zorvek tam").fragment == "zorvektam"
    assert find_leak(s, "zorve and 4829 only") is None  # five letters, four digits: under FRAGMENT_CHARS
    assert find_leak(s, "zorvek", own_prompt="say zorvek") is None  # an echo of its own prompt is no leak
    assert FRAGMENT_CHARS == 6


def test_secrets_come_in_three_forms_and_never_repeat():
    rng = random.Random(7)
    secrets = [make_secret(rng, form) for form in Form for _ in range(50)]
    assert len({s.key for s in secrets}) == len(secrets)
    assert all(len(s.key) >= 12 for s in secrets)
    assert {s.form for s in secrets} == set(Form)


# ---- the Mann-Whitney U test -------------------------------------------------------------------------------


def test_mann_whitney_exact_values_and_the_normal_approximation():
    low, high = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    assert mann_whitney_less(low, high) == pytest.approx(1 / 924)  # one ordering of C(12, 6)
    assert mann_whitney_less(high, low) == 1.0
    assert mann_whitney_less([1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12]) == pytest.approx(323 / 924)
    rng = random.Random(3)
    x, y = [rng.random() for _ in range(25)], [rng.random() + 0.3 for _ in range(25)]
    exact_like = mann_whitney_less(x[:20], y[:20])  # 400 pairs: exact
    assert 0 < exact_like < 0.05 and mann_whitney_less(x, y) < 0.05  # 625 pairs: normal approximation
    assert mann_whitney_less([1, 1, 2, 2], [2, 3, 3, 4]) < 0.1  # ties: normal approximation with correction


# ---- prompts and token counts ------------------------------------------------------------------------------


def test_a_token_model_is_exact_only_on_a_line_with_an_integral_slope():
    exact = fit("usage", [(8, 14), (24, 30), (40, 46)])
    assert exact is not None and exact.exact and exact.filler_range(100) == TokenRange(106, 106)
    assert exact.words_for(256) == 250
    rough = fit("usage", [(8, 40), (24, 118), (40, 205)])
    assert rough is not None and not rough.exact
    assert rough.filler_range(40).lo < 205 < rough.filler_range(40).hi
    assert fit("usage", [(8, 14), (8, 14)]) is None


def test_prompt_shapes():
    rng = random.Random(1)
    secret = make_secret(rng, Form.NUMBER)
    plant = a_prompt(secret, "river stone glass")
    assert plant.count(secret.text) == 3 and plant.endswith(TRIGGER)
    bait = b_prompt("river stone glass")
    assert plant.startswith(bait.removesuffix(TRIGGER)) and secret.key not in normalize(bait)
    words = " ".join(f"w{i}" for i in range(20))
    other = shuffled(rng, words)
    assert sorted(other.split()) == sorted(words.split()) and other.split()[:2] != words.split()[:2]


# ---- the plan ----------------------------------------------------------------------------------------------


def test_the_plan_holds_every_attack_within_the_budget():
    plan = build_plan(random.Random(0), 40, Limits(256, pool_tokens=100), EXACT, concurrency=4)
    jobs = plan.jobs()
    assert plan.num_requests == len(jobs) == 40 and plan.load is None  # no room for the load check
    load_kinds = {Kind.LOAD_QUIET, Kind.LOAD_LIGHT, Kind.LOAD_BUSY, Kind.FLOOD}
    assert {j.kind for j in jobs} == set(Kind) - {Kind.CALIBRATION} - load_kinds
    by_kind = {j.kind: j for j in jobs}
    assert by_kind[Kind.UNDER_LIMIT].tokens.lo + by_kind[Kind.UNDER_LIMIT].max_tokens == 256
    assert by_kind[Kind.AT_LIMIT].tokens == TokenRange(256, 256) and by_kind[Kind.OVER_LIMIT].tokens.lo > 256
    assert by_kind[Kind.OVER_POOL].tokens.lo > 100
    assert all((j.expect is Expect.REJECT) == (j.kind in (Kind.AT_LIMIT, Kind.OVER_LIMIT, Kind.OVER_OUTPUT))
               for j in jobs)  # fmt: skip
    secrets = [j.secret for j in jobs if j.secret is not None]
    assert len(secrets) == sum(j.tenant is Tenant.A for j in jobs) >= 6
    assert not any(
        s.key[:FRAGMENT_CHARS] in normalize(j.prompt) for s in secrets for j in jobs if j.tenant is Tenant.B
    )
    burst = [item for item in plan.main if isinstance(item, list)]
    assert len(burst) == 1 and len(burst[0]) == 8 and all(j.kind is Kind.BURST for j in burst[0])


def test_the_load_check_takes_its_part_of_the_budget_and_floods_with_long_secret_bearing_prompts():
    plan = build_plan(random.Random(0), 200, Limits(8192), EXACT, concurrency=8, flood=16)
    assert plan.load is not None and plan.num_requests == 200 == len(plan.jobs()) - len(plan.load.flood)
    load = plan.load
    assert (load.light_in_flight, load.in_flight) == (4, 16) and len(
        load.flood
    ) == 192  # 12 rounds of 16, on top
    for probes, kind in (
        (load.quiet, Kind.LOAD_QUIET),
        (load.light, Kind.LOAD_LIGHT),
        (load.busy, Kind.LOAD_BUSY),
    ):
        assert len(probes) == NUM_LOAD_SAMPLES
        assert all(j.kind is kind and j.tenant is Tenant.B and j.stream and j.tokens.lo <= 64 for j in probes)
    assert all(
        j.tenant is Tenant.A and j.secret is not None and j.max_tokens == FLOOD_MAX_TOKENS for j in load.flood
    )
    assert all(len(j.prompt.split()) > 2000 for j in load.flood)  # half the context, at most 2048 tokens
    assert len({j.prompt for j in load.flood}) == len(
        load.flood
    )  # distinct: A's own prefix cache cannot help it
    # --flood 0 (or 1: no light level below it), or too small a budget: no check, the whole budget for the rest
    for flood, budget in ((0, 200), (1, 200), (16, 63)):
        plain = build_plan(random.Random(0), budget, Limits(8192), EXACT, concurrency=8, flood=flood)
        assert plain.load is None and plain.num_requests == budget


def load_results(light_s: list[float], busy_s: list[float], quiet_s: float = 0.02) -> list[Result]:
    q, lt, b = job(Kind.LOAD_QUIET), job(Kind.LOAD_LIGHT), job(Kind.LOAD_BUSY)
    return (
        [reply(q, ttft=quiet_s)] * 6
        + [reply(lt, ttft=t) for t in light_s]
        + [reply(b, ttft=t) for t in busy_s]
    )


def test_load_timing_finds_a_wait_that_grows_with_the_other_tenants_load_not_one_steps_share():
    queue = load_test(load_results([0.3, 0.35, 0.28, 0.4, 0.33, 0.31], [3.1, 2.8, 4.0, 3.3, 2.9, 3.6]), 16, 4)
    assert queue.significant and queue.ratio is not None and queue.ratio > 9
    found = load_timing(queue)
    assert [f.kind for f in found] == [FindingKind.LOAD_TIMING] and "16 requests in flight" in found[
        0
    ].message
    # fair: B's wait is about one step at both levels, however much slower than with A idle (not tested)
    fair = load_test(
        load_results([0.3, 0.35, 0.28, 0.4, 0.33, 0.31], [0.36, 0.4, 0.3, 0.45, 0.38, 0.33]), 16, 4
    )
    assert fair.p_value is not None and not fair.significant and not load_timing(fair)
    assert fair.median_quiet_s == 0.02 and fair.ratio is not None and fair.ratio < 2
    # significant and twice as slow, but by less than MIN_TIMING_DIFF_S: noise at this scale
    tiny = load_test(
        load_results([0.001 * (i + 1) for i in range(6)], [0.01 + 0.001 * i for i in range(6)]), 16, 4
    )
    assert tiny.p_value is not None and tiny.p_value < 0.01 and not tiny.significant
    assert load_test([], 0, 0).skipped.startswith("no flood")
    assert load_test(load_results([0.3] * 3, [3.0] * 6), 16, 4).skipped.startswith("too few")


def test_prefix_probes_reuse_each_long_plant_once_and_fresh_probes_match_their_length():
    plan = build_plan(random.Random(5), 40, Limits(512), EXACT, concurrency=2)
    long_plants = [j for j in plan.jobs() if j.kind is Kind.PLANT_LONG]
    prefixes = [j for j in plan.timing if j.kind is Kind.PREFIX]
    fresh = [j for j in plan.timing if j.kind is Kind.FRESH]
    assert len(long_plants) == len(prefixes) == len(fresh) == 6
    for plant in long_plants:
        (probe,) = [p for p in prefixes if plant.prompt.startswith(p.prompt)]
        assert probe.prompt.endswith(TRIGGER)
    assert sorted(p.tokens.lo for p in prefixes) == sorted(f.tokens.lo for f in fresh)
    assert not any(plant.prompt.startswith(f.prompt.split()[1]) for f in fresh for plant in long_plants)


# ---- findings ----------------------------------------------------------------------------------------------


def test_leaks_across_tenants_and_between_two_requests_of_tenant_a():
    rng = random.Random(2)
    s1, s2 = make_secret(rng, Form.WORDS), make_secret(rng, Form.IDENTIFIER)
    a1 = job(Kind.PLANT, Tenant.A, a_prompt(s1), secret=s1, jid="A1")
    a2 = job(Kind.PLANT, Tenant.A, a_prompt(s2), secret=s2, jid="A2")
    b = job(jid="B1")
    results = [reply(a1, f" {s1.text}"), reply(a2, f" {s1.text[:9]}"), reply(b, f"sure: {s2.text}")]
    found = leaks(results)
    assert [(f.request_id, f.details["secret_owner"], f.details["cross_tenant"]) for f in found] == [
        ("A2", "A1", False),
        ("B1", "A2", True),
    ]  # A1 printing its own secret is no leak
    assert found[1].details["complete"] and found[1].kind is FindingKind.LEAK


def test_a_2xx_for_an_over_limit_prompt_is_a_finding_by_the_servers_count_or_the_probes_lower_bound():
    at = job(Kind.AT_LIMIT, tokens=TokenRange(256, 256), max_tokens=1, expect=Expect.REJECT)
    loose = job(Kind.OVER_LIMIT, tokens=TokenRange(100, 400), max_tokens=1, expect=Expect.REJECT)
    found, notes = limits([reply(at, " x", prompt_tokens=None), reply(at, status=400)], capacity=256)
    assert [f.kind for f in found] == [FindingKind.ACCEPTED_OVER_LIMIT] and not notes
    found, notes = limits([reply(loose, " x", prompt_tokens=300), reply(loose, " x", prompt_tokens=200)], 256)
    assert [f.details["prompt_tokens"] for f in found] == [300] and len(notes) == 1
    over_out = job(Kind.OVER_OUTPUT, tokens=TokenRange(128, 128), max_tokens=256, expect=Expect.REJECT)
    found, notes = limits([reply(over_out, " x", prompt_tokens=128, completion_tokens=128)], 256)
    assert not found and "stopping within the context" in notes[0]
    found, _ = limits([reply(over_out, " x", prompt_tokens=128, completion_tokens=200)], 256)
    assert [f.kind for f in found] == [FindingKind.PAST_CONTEXT]


def test_usage_that_disagrees_with_the_prompt_sent():
    j = job(tokens=TokenRange(90, 110))
    assert [f.request_id for f in usage([reply(j, prompt_tokens=1), reply(j, prompt_tokens=100)])] == [j.id]
    assert not usage([reply(j, status=400, prompt_tokens=1), reply(job(Kind.CALIBRATION), prompt_tokens=1)])


def test_a_reply_far_faster_than_the_servers_own_prefill():
    long = job(tokens=TokenRange(1000, 1000))
    fast, normal = reply(long, ttft=0.05, prompt_tokens=1000), reply(long, ttft=0.9, prompt_tokens=1000)
    assert [f.kind for f in speed([fast, normal], tokens_per_s=1000.0)] == [FindingKind.TOO_FAST]
    assert not speed([fast], tokens_per_s=None)  # no measured rate, no judgement
    short = job(tokens=TokenRange(20, 20))
    assert not speed([reply(short, ttft=0.001)], tokens_per_s=1000.0)  # 20 ms of prefill: within noise


def timing_results(prefix_s: list[float], fresh_s: list[float]) -> list[Result]:
    p, f = job(Kind.PREFIX, tokens=TokenRange(500, 500)), job(Kind.FRESH, tokens=TokenRange(500, 500))
    return [reply(p, ttft=t) for t in prefix_s] + [reply(f, ttft=t) for t in fresh_s]


def test_prefix_timing_needs_significance_an_effect_and_enough_prefill_to_save():
    shared = timing_test(
        timing_results([0.10, 0.11, 0.12, 0.10, 0.13, 0.11], [0.5, 0.52, 0.49, 0.55, 0.5, 0.6]), 1000.0
    )
    assert shared.significant and [f.kind for f in prefix_timing(shared)] == [FindingKind.PREFIX_TIMING]
    same = timing_test(
        timing_results([0.5, 0.52, 0.49, 0.55, 0.5, 0.6], [0.51, 0.5, 0.53, 0.5, 0.56, 0.58]), 1000.0
    )
    assert same.p_value is not None and not same.significant and not prefix_timing(same)
    small_effect = TimingTest(6, 6, 0.45, 0.5, 0.001)  # significant, but only 10% faster
    assert not small_effect.significant
    too_fast_to_tell = timing_test(timing_results([0.01] * 6, [0.02] * 6), tokens_per_s=1e6)
    assert too_fast_to_tell.p_value is None and "too fast" in (too_fast_to_tell.skipped or "")
    assert timing_test(timing_results([0.1] * 3, [0.2] * 6), 1000.0).skipped.startswith("too few")


def test_failures_are_notes_never_findings():
    j = job()
    results = [
        reply(j, status=500, error="kv_integrity_error"),
        reply(j, error="kv_integrity_error"),  # an error event in a 200 stream
        reply(j, status=None, error="timeout"),
        reply(j, status=400, error="context_length_exceeded"),
    ]
    notes = failures(results)
    assert "3 request(s) failed" in notes[0] and "kv_integrity_error x2" in notes[0]
    assert "refused" in notes[1]  # a SERVE job that got a 400
    assert not leaks(results) and not usage(results) and not limits(results, 256)[0]


# ---- fake servers --------------------------------------------------------------------------------------------


class FakeServer:
    """A minimal OpenAI-compatible server: one word is one token (plus one), /tokenize, keys, streaming.
    `leaky`: replies carry the previous request's prompt (someone else's text). `lenient`: never rejects."""

    def __init__(
        self, context_length: int = 512, leaky: bool = False, lenient: bool = False, b_latency_s: float = 0.0
    ) -> None:
        """`b_latency_s`: tenant B's replies take this long (the server's own pace, not the test's timing)."""
        self.context_length, self.leaky, self.lenient = context_length, leaky, lenient
        self.b_latency_s = b_latency_s
        self.prompts: deque[str] = deque(maxlen=4)

    def count(self, body: dict[str, Any]) -> int:
        text = body.get("prompt") or body["messages"][-1]["content"]
        return len(text.split()) + 1

    def text(self, body: dict[str, Any]) -> str:
        prompt = body.get("prompt", "")
        other = next((p for p in reversed(self.prompts) if p != prompt), "")
        self.prompts.append(prompt)
        return f" {other[-120:]}" if self.leaky else " fine" * min(3, body["max_tokens"])

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if request.headers.get("authorization", "").removeprefix("Bearer ") not in KEYS:
                return JSONResponse({"error": {"code": "invalid_api_key", "message": "no"}}, status_code=401)
            return JSONResponse({"data": [{"id": "fake", "max_model_len": self.context_length}]})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return JSONResponse({"count": self.count(await request.json())})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            if request.headers.get("authorization") == "Bearer key-b":
                await asyncio.sleep(self.b_latency_s)
            n = self.count(body)
            if n + body["max_tokens"] > self.context_length and not self.lenient:
                error = {
                    "code": "context_length_exceeded",
                    "message": "too long",
                    "type": "invalid_request_error",
                }
                return JSONResponse({"error": error}, status_code=400)
            text = self.text(body)
            usage = {"prompt_tokens": n, "completion_tokens": body["max_tokens"]}
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": text, "finish_reason": "length"}], "usage": usage})
            return StreamingResponse(self.events(text, usage), media_type="text/event-stream")

        return app

    async def events(self, text: str, usage: dict[str, int]) -> AsyncIterator[str]:
        for word in text.split(" ")[1:]:
            yield f"data: {json.dumps({'choices': [{'text': ' ' + word, 'finish_reason': None}]})}\n\n"
            await asyncio.sleep(0)
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


def probe(url: str, tmp_path: Path, *extra: str, model: str = "fake", requests: int = 40) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    argv = ["probe", "--base-url", url, "--model", model, "--key-a", "key-a", "--key-b", "key-b",
            "--requests", str(requests), "--concurrency", "4", "--seed", "1", "--no-progress", "--report",
            str(report), *extra]  # fmt: skip
    status = kvfence_main(argv)
    return status, json.loads(report.read_text()) if report.exists() else {}


@contextlib.contextmanager
def fake(**kw: Any) -> Iterator[str]:
    with serve_in_thread(FakeServer(**kw).app()) as url:
        yield url


def kinds(report: dict) -> set[str]:
    return {f["kind"] for f in report["findings"]}


def test_an_honest_server_is_clean(tmp_path):
    with fake() as url:
        status, report = probe(url, tmp_path)
    assert status == 0 and report["verdict"] == "clean" and not report["findings"], report["findings"]
    assert report["calibration"]["token_model"]["method"] == "tokenize"  # exact counts for every prompt
    assert (
        report["requests"]["sent"] == 40 + 4
    )  # the budget plus calibration (prefill rate; /tokenize counts)
    assert report["requests"]["outcomes"]["rejected (400)"] == 3  # at, over, over_output


def test_the_load_check_finishes_when_the_flood_runs_out_before_the_heavy_level(tmp_path):
    """A server that answers A at once and B in 50 ms: A's whole flood is answered while B still probes the light
    level, and the heavy level must not wait for a flood request that will never be sent (the run ends complete,
    every probe answered)."""
    with fake(b_latency_s=0.05) as url:
        status, report = probe(url, tmp_path, "--flood", "2", "--max-duration", "60", requests=64)
    load = report["load_timing"]
    assert report["complete"] and (load["num_light"], load["num_busy"]) == (8, 8), (report["notes"], load)
    assert status == 0 and not load["significant"]


def test_a_server_that_serves_other_requests_text_is_caught_leaking(tmp_path):
    with fake(leaky=True) as url:
        status, report = probe(url, tmp_path)
    assert status == 1
    cross = [f for f in report["findings"] if f["kind"] == "leak" and f["details"]["cross_tenant"]]
    assert cross and all(f["request_id"].startswith("B") for f in cross)


def test_a_server_that_answers_over_length_prompts_with_200_is_reported(tmp_path):
    with fake(lenient=True) as url:
        status, report = probe(url, tmp_path)
    assert status == 1 and kinds(report) == {"accepted_over_limit", "past_context"}
    over = {f["request_id"].split("-")[1] for f in report["findings"] if f["kind"] == "accepted_over_limit"}
    assert over == {"at_limit", "over_limit"}


@pytest.mark.parametrize(
    "case",
    ["unreachable", "wrong key", "unknown model", "no context length", "same keys", "too few requests"],
)
def test_a_target_that_cannot_be_probed_exits_2_with_a_reason(tmp_path, capsys, case):
    server = FakeServer(context_length=0 if case == "no context length" else 512)
    with serve_in_thread(server.app()) as url:
        url = f"http://127.0.0.1:{free_port()}" if case == "unreachable" else url
        extra = {"same keys": ["--key-b", "key-a"], "wrong key": ["--key-b", "key-z"]}.get(case, [])
        status, report = probe(url, tmp_path, *extra, model="nope" if case == "unknown model" else "fake",
                               requests=10 if case == "too few requests" else 40)  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and not report
    expected = {
        "unreachable": "cannot reach",
        "wrong key": "refused tenant B's key",
        "unknown model": "not served",
        "no context length": "--context-length",
        "same keys": "must differ",
        "too few requests": "at least",
    }
    assert expected[case] in err


# ---- kvfence ---------------------------------------------------------------------------------------------------


def test_kvfence_colocated_is_clean(tiny_model, tmp_path):
    from tests.server_harness import running_server

    with running_server(tiny_model, api_keys=KEYS, page_size=4, kv_pages=96) as server:
        status, report = probe(server.url, tmp_path, model="tiny")
        server.assert_pool_clean()
    assert status == 0, report["findings"]
    assert report["requests"]["outcomes"]["served"] >= 35


@pytest.mark.parametrize("mode", ["colocated", "pd"])
@pytest.mark.parametrize("policy", ["fcfs", "vtc"])
def test_the_load_timing_check_finds_a_queue_behind_the_other_tenant_under_fcfs_not_vtc(
    tiny_dir, tmp_path, policy, mode
):
    """kvfence in its own processes, steps of at most 64 tokens (A's flood prompts take two each): under fcfs B's
    probes wait behind A's queue, which grows with A's load (a finding); under vtc B's next step is its own at
    either level (clean). In PD the order is each worker's (the router forwards at once)."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    pages = (
        ["--kv-pages", "1024"]
        if mode == "colocated"
        else ["--prefill-kv-pages", "512", "--decode-kv-pages", "1024"]
    )
    flags = [*pages, "--page-size", "4", "--max-num-batched-tokens", "64", "--scheduling-policy", policy]
    with pd_serve(tiny_dir, keys, *flags, mode=mode) as url:
        status, report = probe(url, tmp_path, "--flood", "16", model=tiny_dir.name, requests=64)
    load = report["load_timing"]
    assert (load["num_light"], load["num_busy"], load["in_flight"]) == (8, 8, 16), load
    if policy == "fcfs":
        assert status == 1 and kinds(report) == {"load_timing"}, (report["findings"], load)
    else:
        assert status == 0 and not report["findings"], (report["findings"], load)


def test_kvfence_pd_with_an_undersized_prefill_pool_is_clean(tiny_dir, tmp_path):
    """The 2026 incident's configuration (a prefill pool smaller than the context), allowed only with
    --allow-undersized-pool: kvfence refuses what the pool cannot hold, and nothing else goes wrong."""
    flags = undersized_prefill(160)
    keys = tiny_dir.parent / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with pd_serve(tiny_dir, keys, *flags) as url:
        status, report = probe(url, tmp_path, "--pool-tokens", "128", "--context-length", "256",
                               model=tiny_dir.name)  # fmt: skip
    assert status == 0, report["findings"]
    refused = [r for r in report["results"] if r["status"] == 400]
    assert {r["kind"] for r in refused} >= {"at_limit", "over_limit", "over_output", "over_pool"}
    # with kvfence's /tokenize the probe counts tokens exactly and sizes its plants at the pool's edge: a few more
    # of them are refused (400, as they must be) than with estimates from usage
    served = report["requests"]["outcomes"]["served"]
    assert served >= 25, [(r["kind"], r["status"]) for r in report["results"] if r["status"] != 200]


@contextlib.contextmanager
def pd_in_process(loaded, *, checks: bool, prefill_faults: Faults) -> Iterator[str]:
    """A PD deployment in this process: router, HTTP front, and prefill and decode workers on threads sharing
    one loaded model (real ZeroMQ sockets on loopback). Yields the base URL."""
    from kvfence.pd.remote import RemoteEngine
    from kvfence.pd.router import Router
    from kvfence.pd.worker import DecodeWorker, PrefillWorker
    from kvfence.server.app import build_app
    from kvfence.server.async_engine import AsyncEngine
    from kvfence.server.metrics import ServerMetrics
    from kvfence.server.serving import ServerSettings
    from tests.conftest import make_engine

    router = Router()
    shape = dict(page_size=16, context_length=96, integrity_checks=checks, max_num_batched_tokens=256)
    prefill = make_engine(loaded, kv_pages=24, faults=prefill_faults, **shape)
    workers = [PrefillWorker(prefill, router.addr, "tcp://127.0.0.1:0"),
               DecodeWorker(make_engine(loaded, kv_pages=40, **shape), router.addr)]  # fmt: skip
    threads = [threading.Thread(target=w.serve, name=f"pd-{w.role.name}", daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        assert router.wait_for_workers(1, 1, timeout=60), "workers did not register"
        engine = AsyncEngine(RemoteEngine(router, loaded.tokenizer))
        app = build_app(engine, ServerSettings("smollm2", api_keys=KEYS), ServerMetrics())
        with serve_in_thread(app) as url:
            yield url
    finally:
        router.shutdown()
        for t in threads:
            t.join(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("checks", [False, True], ids=["checks-off", "checks-on"])
def test_stale_kv_shipped_as_a_requests_own_leaks_only_with_the_checks_off(smollm2, tmp_path, checks):
    """Fault knob `stale_frame` on every transfer: the prefill ships pages its request does not hold as that
    request's KV, so decode continues someone else's prompt. With --no-integrity-checks (debug only) the probe
    sees tenant A's secrets in replies; with the checks on every victim fails closed and the probe is clean."""
    with pd_in_process(smollm2, checks=checks, prefill_faults=Faults(stale_frame=10**6)) as url:
        status, report = probe(  # (no load check: this one is about leaks; its context is too short to flood)
            url,
            tmp_path,
            "--concurrency",
            "8",
            "--flood",
            "0",
            model="smollm2",
            requests=40 if checks else 60,
        )
    found = [f for f in report["findings"] if f["kind"] == "leak"]
    if not checks:  # measured: 4 to 9 leaks a run, 2 to 5 of them across tenants (docs/probe.md)
        assert status == 1 and found, report["notes"]
        assert {f["kind"] for f in report["findings"]} == {"leak"}
    else:
        assert status == 0 and not report["findings"], report["findings"]
        assert "kv_integrity_error" in " ".join(report["notes"])
        assert report["requests"]["outcomes"]["failed"] >= 30


def test_the_two_sided_test_sees_a_difference_either_way_and_none_between_equal_samples():
    from kvfence.probe.stats import mann_whitney_two_sided

    low, high = [float(v) for v in range(1, 7)], [float(v) for v in range(7, 13)]
    assert mann_whitney_two_sided(low, high) == pytest.approx(2 / 924)
    assert mann_whitney_two_sided(high, low) == pytest.approx(2 / 924)
    assert mann_whitney_two_sided([1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12]) == pytest.approx(2 * 323 / 924)
