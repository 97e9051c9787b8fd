"""Noisy neighbour: what one tenant's flood does to another tenant's service (issue 25, docs/fairness.md).

    python bench/fairness.py --base-url http://127.0.0.1:8000 --key-a KEY_A --key-b KEY_B [--json out.json]
    python bench/fairness.py ... --a-in-flight 64 --a-prompt-len 2000      # the harder load

Tenant B runs W1 (32 distinct ~196-token prompts, 64 output tokens, 8 in flight; bench/serve.py's client) twice:
alone, then while tenant A keeps --a-in-flight requests of --a-prompt-len-token prompts (distinct, 64 output
tokens) in flight from just before B starts until B is done. Reports B's wall time, output tokens/s and TTFT
p50/p99 flooded against alone (the ratios the issue's target is about: within 20% means <= 1.2), and what A
completed meanwhile (fairness must not starve the flooder: A gets its share, not zero), and with --metrics-key
what kvfence computed for each tenant while B ran (its virtual token counters' gains: A's service even when a
request of A's takes longer than B's whole run). Works against any
OpenAI-compatible server; one without tenants (vLLM) just sees two clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from serve import (
    WORKLOADS,
    RequestResult,
    Workload,
    drive,
    make_prompt,
    make_prompts,
    percentile,
    send,
    word_list,
)

from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import load_tokenizer


async def flood(client: httpx.AsyncClient, model: str, prompts: list[tuple[str, int]], in_flight: int,
                stop: asyncio.Event, done: list[RequestResult]) -> None:  # fmt: skip
    """Keep `in_flight` of A's requests going until `stop` (prompts reused round-robin: distinct enough)."""
    it = iter(range(10**9))

    async def worker() -> None:
        while not stop.is_set():
            prompt, n = prompts[next(it) % len(prompts)]
            result = await send(client, model, prompt, n, 64)
            if not stop.is_set():
                done.append(result)

    tasks = [asyncio.create_task(worker()) for _ in range(in_flight)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def virtual_tokens(client: httpx.AsyncClient, key: str | None) -> dict[str, float] | None:
    """Each tenant's virtual token counter from kvfence's /metrics (the operator's scrape key), None without a
    key or on a server that has none (vLLM)."""
    if key is None:
        return None
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    if r.status_code != 200:
        return None
    found = re.findall(r'^kvfence_tenant_virtual_tokens_total\{tenant="([^"]*)"\} (\S+)$', r.text, re.MULTILINE)
    return {tenant: float(value) for tenant, value in found} or None


def service(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What each tenant's counter gained while B ran: the service it got, in prompt tokens + 2 x output tokens
    divided by its weight (docs/fairness.md). A tenant that stays backlogged gains exactly what it was served;
    so A's gain is A's service (A's weight is 1 in bench/peers.sh), not zero when it completes nothing."""
    if before is None or after is None:
        return None
    return {t: round(after[t] - before.get(t, 0.0), 1) for t in sorted(after)}


def summary(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    p = lambda q: None if not ttft else round(percentile(ttft, q) * 1000, 1)  # type: ignore[operator]  # noqa: E731
    return {
        "wall_s": round(elapsed, 2),
        "out_tok_s": round(sum(r.output_tokens for r in ok) / elapsed, 1),
        "ttft_p50_ms": p(50),
        "ttft_p99_ms": p(99),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(args.tokenizer)
    w1 = Workload(**WORKLOADS["W1"], rate=None, seed=args.seed)
    b_alone = make_prompts(tokenizer, w1)
    b_flooded = make_prompts(tokenizer, Workload(**WORKLOADS["W1"], rate=None, seed=args.seed + 1))
    words, rng = word_list(tokenizer), random.Random(args.seed + 2)
    a_prompts = [
        (make_prompt(tokenizer, words, rng, args.a_prompt_len), args.a_prompt_len) for _ in range(64)
    ]
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=args.a_in_flight + 16)
    auth = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
    async with (
        httpx.AsyncClient(
            base_url=args.base_url, timeout=timeout, limits=limits, headers=auth(args.key_a)
        ) as a,
        httpx.AsyncClient(
            base_url=args.base_url, timeout=timeout, limits=limits, headers=auth(args.key_b)
        ) as b,
    ):
        model = args.model or (await b.get("/v1/models")).json()["data"][0]["id"]
        for prompt, n in make_prompts(tokenizer, Workload(**{**WORKLOADS["W1"], "num_requests": 2},
                                                          rate=None, seed=args.seed + 3)):  # fmt: skip
            await send(b, model, prompt, n, 64)  # warm-up, untimed
        alone = summary(*await drive(b, model, w1, b_alone, False))
        stop, a_done = asyncio.Event(), []
        flooder = asyncio.create_task(flood(a, model, a_prompts, args.a_in_flight, stop, a_done))
        await asyncio.sleep(args.a_head_start)  # A's requests are queued and running when B starts
        start = time.perf_counter()
        counters_before = await virtual_tokens(b, args.metrics_key)
        flooded = summary(*await drive(b, model, w1, b_flooded, False))
        counters_after = await virtual_tokens(b, args.metrics_key)
        a_elapsed = time.perf_counter() - start + args.a_head_start
        stop.set()
        await flooder
    ratio = lambda key: round(flooded[key] / alone[key], 2) if alone[key] else None  # noqa: E731
    a_ok = [r for r in a_done if r.ok]
    return {
        "label": args.label,
        "base_url": args.base_url,
        "a": {
            "in_flight": args.a_in_flight,
            "prompt_len": args.a_prompt_len,
            "completed": len(a_ok),
            "failed": len(a_done) - len(a_ok),
            "out_tok_s": round(sum(r.output_tokens for r in a_ok) / a_elapsed, 1),
            # the server's own count of what it computed for each tenant while B ran (kvfence only)
            "service": service(counters_before, counters_after),
        },
        "b_alone": alone,
        "b_flooded": flooded,
        "b_ratio": {
            "wall": ratio("wall_s"),
            "ttft_p50": ratio("ttft_p50_ms"),
            "ttft_p99": ratio("ttft_p99_ms"),
            "throughput": ratio("out_tok_s"),
        },
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--key-a", default="none", help="tenant A's API key (the flooder)")
    ap.add_argument("--key-b", default="none", help="tenant B's API key (the victim)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--a-in-flight", type=int, default=16)
    ap.add_argument("--a-prompt-len", type=int, default=1700)
    ap.add_argument("--a-head-start", type=float, default=2.0, help="seconds A floods before B starts")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="prompts use seeds SEED..SEED+3: a second run against "
        "the same server needs another (SEED+10), or B's prompts hit the prefix cache the last one filled",
    )
    ap.add_argument(
        "--metrics-key", default=None, help="kvfence's scrape key: each tenant's service while B ran, from /metrics"
    )
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", dest="json_path", default=None)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text)
    return 0 if not result["b_flooded"]["num_failed"] and not result["b_alone"]["num_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
