"""Before the attack mix: is the target there, does it serve the model to both keys, how long is its context,
how does it count tokens, and how fast does it prefill?

Token counts, best source first: the server's `/tokenize` (vLLM, SGLang), else `usage.prompt_tokens` of three
filler prompts (fitted into a `TokenModel`), else character bounds (`prompts.char_bounds`).
The prefill rate is the server's own: time to first token of a long and a short prompt, twice each, the fastest
of each pair (noise only ever slows a request down), and the rate is the difference in tokens over the
difference in time. It is the yardstick for the "reply faster than its prefill" finding.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvfence.probe.client import Result, Target, send
from kvfence.probe.plan import Expect, Job, Kind, Plan, Tenant
from kvfence.probe.prompts import CHAR_MODEL, TokenModel, TokenRange, b_prompt, filler, fit

CALIBRATION_WORDS = (4, 10, 16)  # small: the prompts must fit even a short context with a verbose tokenizer
LONG_PREFILL_TOKENS = 2048
CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length", "context_window")


Counter = Callable[[str], Awaitable[int | None]]


class TargetError(Exception):
    """The target is unreachable or misconfigured; the probe cannot say anything about it (exit status 2)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    capacity: int
    capacity_source: str
    tokens: TokenModel
    prefill_tokens_per_s: float | None
    notes: tuple[str, ...]
    results: tuple[Result, ...]  # the calibration requests' own replies (scanned for leaks like any other)
    count: Counter | None = None  # the server's /tokenize, when it has one


async def calibrate(
    client: httpx.AsyncClient, target: Target, context_length: int | None, rng: random.Random
) -> Calibration:
    capacity, source = await discover(client, target, context_length)
    notes: list[str] = []
    results: list[Result] = []
    count = await _tokenize_endpoint(client, target)
    tokens = await _token_model(client, target, rng, count, results)
    if tokens is CHAR_MODEL:
        notes.append("token counts: no /tokenize and no usable usage; prompt sizes are character estimates")
    else:
        how = "exact" if tokens.exact else "approximate"
        notes.append(f"token counts: {tokens.method} ({how}: {tokens.base:.1f} + {tokens.per_word:.3f}/word)")
    rate = await _prefill_rate(client, target, rng, tokens, capacity, results)
    if rate is None:
        notes.append(
            "prefill rate: not measured (calibration requests failed, or the context is too short to time a "
            "prefill); the fast-reply check is skipped"
        )
    return Calibration(capacity, source, tokens, rate, tuple(notes), tuple(results), count)


async def discover(client: httpx.AsyncClient, target: Target, context_length: int | None) -> tuple[int, str]:
    """(context length, where it came from). Raises TargetError with a message an operator can act on."""
    models: list[dict[str, Any]] = []
    for tenant in ("A", "B"):
        models = await _list_models(client, target, tenant)
    entry = next((m for m in models if m.get("id") == target.model), None)
    if entry is None:
        served = ", ".join(str(m.get("id")) for m in models) or "none"
        raise TargetError(f"model {target.model!r} is not served at {target.base_url} (it lists: {served})")
    if context_length is not None:
        return context_length, "--context-length"
    for name in CONTEXT_FIELDS:
        value = entry.get(name)
        if isinstance(value, int) and value > 0:
            return value, f"/v1/models {name}"
    raise TargetError("the server does not say its context length in /v1/models; pass --context-length")


async def _list_models(client: httpx.AsyncClient, target: Target, tenant: str) -> list[dict[str, Any]]:
    url = f"{target.base_url}/models"
    try:
        response = await client.get(url, headers=target.headers(tenant), timeout=min(30.0, target.timeout_s))
    except httpx.HTTPError as exc:
        raise TargetError(f"cannot reach {url}: {exc.__class__.__name__}: {exc}") from exc
    if response.status_code in (401, 403):
        raise TargetError(f"the server refused tenant {tenant}'s key (HTTP {response.status_code} on {url})")
    if response.status_code != 200:
        raise TargetError(
            f"GET {url} answered HTTP {response.status_code}; is this an OpenAI-compatible API?"
        )
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError) as exc:
        raise TargetError(f"GET {url} did not return a model list") from exc
    if not isinstance(data, list):
        raise TargetError(f"GET {url} did not return a model list")
    return [m for m in data if isinstance(m, dict)]


async def _tokenize_endpoint(client: httpx.AsyncClient, target: Target) -> Counter | None:
    """A token counter backed by the server's /tokenize, if it has one that answers with a count."""
    for url in (f"{target.root}/tokenize", f"{target.base_url}/tokenize"):

        async def count(text: str, url: str = url) -> int | None:
            body: dict[str, Any] = {"model": target.model}
            body.update(
                {"messages": [{"role": "user", "content": text}]} if target.chat else {"prompt": text}
            )
            try:
                response = await client.post(url, json=body, headers=target.headers("B"), timeout=30.0)
                data = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            if isinstance(data, dict) and isinstance(data.get("count"), int):
                return int(data["count"])
            tokens = data.get("tokens") if isinstance(data, dict) else None
            return len(tokens) if isinstance(tokens, list) else None

        if await count(b_prompt("the")) is not None:
            return count
    return None


async def _token_model(
    client: httpx.AsyncClient,
    target: Target,
    rng: random.Random,
    count: Counter | None,
    results: list[Result],
) -> TokenModel:
    points: list[tuple[int, int]] = []
    for words in CALIBRATION_WORDS:
        prompt = b_prompt(filler(rng, words))
        if count is not None:
            n = await count(prompt)
        else:
            job = _calibration_job(len(results), prompt, max_tokens=1, stream=False)
            result = await send(client, target, job)
            results.append(result)
            n = result.prompt_tokens if result.ok else None
        if n is not None:
            points.append((words, n))
    model = fit("tokenize" if count is not None else "usage", points) if len(points) >= 2 else None
    return model or CHAR_MODEL


async def _prefill_rate(
    client: httpx.AsyncClient,
    target: Target,
    rng: random.Random,
    tokens: TokenModel,
    capacity: int,
    results: list[Result],
) -> float | None:
    short_tokens, long_tokens = max(8, capacity // 16), min(LONG_PREFILL_TOKENS, capacity // 2)
    best: dict[int, tuple[float, int]] = {}
    for size in (short_tokens, long_tokens) * 2:
        words = tokens.words_for(size)
        job = _calibration_job(len(results), b_prompt(filler(rng, words)), max_tokens=1, stream=True)
        result = await send(client, target, replace(job, tokens=tokens.filler_range(words)))
        results.append(result)
        if not result.ok or result.ttft_s is None:
            return None
        n = result.prompt_tokens or tokens.filler_range(words).lo
        if size not in best or result.ttft_s < best[size][0]:
            best[size] = (result.ttft_s, n)
    (t_short, n_short), (t_long, n_long) = best[short_tokens], best[long_tokens]
    if t_long <= t_short or n_long <= n_short:
        return None
    return (n_long - n_short) / (t_long - t_short)


def _calibration_job(index: int, prompt: str, max_tokens: int, stream: bool) -> Job:
    return Job(
        f"B-cal{index:02d}-calibration",
        Tenant.B,
        Kind.CALIBRATION,
        prompt,
        max_tokens,
        stream,
        Expect.SERVE,
        TokenRange(1, len(prompt) + 64),
    )


async def count_plan(plan: Plan, count: Counter) -> Plan:
    """Every job's prompt counted by the server's /tokenize: exact expectations for all of them."""

    async def exact(job: Job) -> Job:
        n = await count(job.prompt)
        return job if n is None else replace(job, tokens=TokenRange(n, n))

    main: list[Job | list[Job]] = []
    for item in plan.main:
        main.append([await exact(j) for j in item] if isinstance(item, list) else await exact(item))
    load = plan.load
    if load is not None:
        load = replace(
            load,
            quiet=[await exact(j) for j in load.quiet],
            light=[await exact(j) for j in load.light],
            busy=[await exact(j) for j in load.busy],
            # (A's flood is not counted: up to 8 x --flood long prompts, most never sent, judged for leaks only)
        )
    return Plan(main, [await exact(j) for j in plan.timing], load)
