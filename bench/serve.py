"""Load benchmark for any OpenAI-compatible completions endpoint (kvfence, vLLM, llama.cpp's llama-server).

    python bench/serve.py --base-url http://127.0.0.1:8000 --workload W1 [--json out.json]
    python bench/serve.py --base-url ... --num-requests 64 --prompt-len 512 --prompt-len-spread 0.2 \
        --output-len 128 --rate 2.0

Prompts are distinct texts of random words, deterministic from --seed, cut so that each is exactly the drawn
number of tokens under the model's tokenizer (a local one from --tokenizer, the default model's by default;
if the server has a /tokenize endpoint, the lengths are checked against it too). Every request streams
(`stream=True`, `ignore_eos`, greedy, exactly --output-len new tokens), so TTFT and inter-token latency are
measured on the client, as a user sees them. Arrivals: a fixed number of requests in flight (--concurrency), or
a Poisson process (--rate requests/s, optionally capped by --concurrency).

Workloads (the serving issue's): W1 = 32 prompts of ~196 tokens (±10%), 64 new tokens, 8 in flight;
W2 = 8 prompts of exactly 200 tokens, 64 new tokens, one at a time (batch-1 TTFT and decode ms/token).
At scale (issue 26): W3 = 64 prompts of ~200 tokens, 128 new tokens, 32 in flight; W4 = the same, 128 prompts,
64 in flight; W5 = 16 prompts of 2,000 tokens, 64 new tokens, all in flight; W6 = 24 prompts of 50-950 tokens,
128 new tokens, open loop at --rate (required). Goodput: requests per second that met the service level (their
own TTFT <= 2 s and their own inter-token p99 <= 150 ms, --slo-ttft-ms / --slo-itl-ms), over the whole run.

--structured json_schema asks every request for JSON under a built-in schema (`response_format` json_schema,
OpenAI's shape, which vLLM takes on completions too) that cannot close within --output-len tokens, so each request
still generates exactly --output-len tokens, now under a token mask each step: W1 with it against W1 without is
the cost of structured outputs. (ignore_eos is left out then: the grammar decides when the output may end.)

Reports output and total tokens/s, TTFT p50/p90/p99, inter-token latency p50/p99, time per output token after
the first (TPOT), failures; --json writes the same as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import load_tokenizer
from kvfence.model.tokenizer import Tokenizer

WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": dict(num_requests=32, prompt_len=196, prompt_len_spread=0.1, output_len=64, concurrency=8),
    "W2": dict(num_requests=8, prompt_len=200, prompt_len_spread=0.0, output_len=64, concurrency=1),
    # at scale (issue 26): two waves of 32 and of 64 in flight, long prompts, and an open loop (give --rate)
    "W3": dict(num_requests=64, prompt_len=200, prompt_len_spread=0.1, output_len=128, concurrency=32),
    "W4": dict(num_requests=128, prompt_len=200, prompt_len_spread=0.1, output_len=128, concurrency=64),
    "W5": dict(num_requests=16, prompt_len=2000, prompt_len_spread=0.0, output_len=64, concurrency=16),
    "W6": dict(num_requests=24, prompt_len=500, prompt_len_spread=0.9, output_len=128, concurrency=None),
}
# W6's service level (DistServe's goodput): a request counts when its own TTFT and its own inter-token p99 meet these
SLO_TTFT_MS, SLO_ITL_MS = 2000.0, 150.0
WORD = re.compile(r"^ [a-z]{3,9}$")
# --structured json_schema: nested objects, bounded integers and strings, and far more items than --output-len
# tokens can write, so the grammar never completes and every request runs to its length
LOG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "log": {
            "type": "array",
            "minItems": 512,
            "items": {
                "type": "object",
                "properties": {
                    "step": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "note": {"type": "string", "maxLength": 24},
                },
                "required": ["step", "note"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["log"],
    "additionalProperties": False,
}
STRUCTURED: dict[str, dict[str, Any]] = {
    "none": {"ignore_eos": True},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "log", "schema": LOG_SCHEMA, "strict": True}}},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    prompt_len: int  # mean prompt length in tokens
    prompt_len_spread: float  # lengths are uniform in prompt_len * (1 ± spread)
    output_len: int
    concurrency: int | None  # requests in flight at most; None: unbounded (with a rate)
    rate: float | None  # Poisson arrivals per second; None: send as soon as a slot is free
    seed: int


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int  # as the client built it
    ok: bool = False
    error: str | None = None
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when the server reports it
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks


# ---- prompts ----------------------------------------------------------------------------------------------


def word_list(tokenizer: Tokenizer) -> list[str]:
    """Plain lower-case words that are single tokens with a leading space: text whose token count is easy to
    steer."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if WORD.match(text):
            words.append(text)
    return words


def make_prompt(tokenizer: Tokenizer, words: Sequence[str], rng: random.Random, num_tokens: int) -> str:
    """A text of random words that encodes to exactly `num_tokens` tokens (no special tokens added)."""
    picked = [rng.choice(words) for _ in range(num_tokens)]
    text = "".join(picked).lstrip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) != num_tokens:  # merges across word boundaries are rare; fix the count a word at a time
        if len(ids) > num_tokens:
            picked.pop()
        else:
            picked.append(rng.choice(words))
        text = "".join(picked).lstrip()
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > num_tokens + 2:  # cut in token space and decode: exact by construction
            text = tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
    return text


def make_prompts(tokenizer: Tokenizer, w: Workload) -> list[tuple[str, int]]:
    # seeded by the workload's shape too: W1 and W2 with one --seed must not start with the same words (a
    # server's prefix cache would then serve part of W2's first prompt from W1's)
    rng = random.Random(f"{w.seed}/{w.num_requests}/{w.prompt_len}/{w.prompt_len_spread}")
    words = word_list(tokenizer)
    lo = max(1, round(w.prompt_len * (1 - w.prompt_len_spread)))
    hi = max(lo, round(w.prompt_len * (1 + w.prompt_len_spread)))
    prompts = []
    for _ in range(w.num_requests):
        n = rng.randint(lo, hi)
        prompts.append((make_prompt(tokenizer, words, rng, n), n))
    assert len({p for p, _ in prompts}) == len(prompts), "prompts must be distinct"
    return prompts


async def server_token_count(client: httpx.AsyncClient, model: str, text: str) -> int | None:
    """The server's own count: vLLM's POST /tokenize, then llama.cpp's; None if it has neither."""
    for body, key in (({"model": model, "prompt": text}, "tokens"), ({"content": text}, "tokens")):
        try:
            r = await client.post("/tokenize", json=body)
            tokens = r.json().get(key) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if tokens:  # an empty list: the server read another field (llama.cpp ignores "prompt")
            return len(tokens)
    return None


# ---- one request ------------------------------------------------------------------------------------------


async def send(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    num_tokens: int,
    output_len: int,
    structured: str = "none",
) -> RequestResult:
    result = RequestResult(prompt_tokens=num_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **STRUCTURED[structured],
    }
    start = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in event.get("choices") or []):
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.server_prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = done and result.ttft is not None
    if not result.ok:
        result.error = "stream ended without [DONE]" if not done else "no text"
    return result


# ---- the run ----------------------------------------------------------------------------------------------


async def run(
    args: argparse.Namespace, w: Workload, prompts: list[tuple[str, int]], warmup: list[tuple[str, int]]
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=(w.concurrency or len(prompts)) + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout) as client:
        model = args.model or await served_model(client)
        counts = await check_lengths(client, model, prompts[:4])
        for prompt, n in warmup:  # not timed: first requests compile and allocate; other texts, no cache hits
            await send(client, model, prompt, n, w.output_len, args.structured)
        results = await drive(client, model, w, prompts, not args.quiet, args.structured)
    return summarize(w, results, model, counts, args)


async def served_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def check_lengths(
    client: httpx.AsyncClient, model: str, sample: list[tuple[str, int]]
) -> list[tuple[int, int | None]]:
    counts = [(n, await server_token_count(client, model, p)) for p, n in sample]
    for ours, theirs in counts:
        if theirs is not None and theirs != ours:
            print(f"warning: prompt of {ours} tokens is {theirs} tokens on the server", file=sys.stderr)
    return counts


async def drive(
    client: httpx.AsyncClient,
    model: str,
    w: Workload,
    prompts: list[tuple[str, int]],
    progress: bool,
    structured: str = "none",
) -> tuple[list[RequestResult], float]:
    rng = random.Random(w.seed + 1)
    slots = asyncio.Semaphore(w.concurrency or len(prompts))
    bar = tqdm(total=len(prompts), unit="req", disable=not progress, file=sys.stderr)

    async def one(prompt: str, n: int) -> RequestResult:
        async with slots:
            result = await send(client, model, prompt, n, w.output_len, structured)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for prompt, n in prompts:
        if w.rate is None:
            await slots.acquire()  # keep exactly `concurrency` in flight, in prompt order
            slots.release()
        tasks.append(asyncio.create_task(one(prompt, n)))
        if w.rate is not None:
            await asyncio.sleep(rng.expovariate(w.rate))
        else:
            await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bar.close()
    return list(results), elapsed


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(
    w: Workload,
    run_result: tuple[list[RequestResult], float],
    model: str,
    counts: list[tuple[int, int | None]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    results, elapsed = run_result
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.server_prompt_tokens or r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    slo_ttft, slo_itl = args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0
    good = [
        r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (percentile(r.itl, 99) or 0) <= slo_itl
    ]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft and r.output_tokens > 1]
    ms = 1000.0

    def p(values: Sequence[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(v * ms, 2)

    return {
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "workload": {k: v for k, v in asdict(w).items()},
        "structured": args.structured,
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 2),
        "total_tok_s": round((out_tokens + in_tokens) / elapsed, 2),
        "mean_prompt_tokens": round(in_tokens / len(ok), 1) if ok else None,
        "mean_output_tokens": round(out_tokens / len(ok), 1) if ok else None,
        "server_token_counts": [theirs for _, theirs in counts],
        "ttft_ms": {"p50": p(ttft, 50), "p90": p(ttft, 90), "p99": p(ttft, 99)},
        "ttft_ms_each": [round(x * 1e3, 1) for x in ttft],  # in completion order
        "itl_ms": {"p50": p(itl, 50), "p99": p(itl, 99)},
        "tpot_ms": {"p50": p(tpot, 50), "mean": round(statistics.fmean(tpot) * ms, 2) if tpot else None},
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_p99_ms": args.slo_itl_ms},
        "num_good": len(good),
        "goodput_req_s": round(len(good) / elapsed, 3),
        "request_rate": round(len(results) / elapsed, 3),
    }


def print_summary(s: dict[str, Any]) -> None:
    w = s["workload"]
    arrival = f"rate {w['rate']}/s" if w["rate"] else f"concurrency {w['concurrency']}"
    print(
        f"{s['label'] or s['base_url']}: {w['num_requests']} requests x ({s['mean_prompt_tokens']} prompt + "
        f"{s['mean_output_tokens']} new tokens), {arrival}"
    )
    print(f"  ok {s['num_ok']}, failed {s['num_failed']} {s['errors'] or ''}")
    print(f"  {s['elapsed_s']} s  output {s['output_tok_s']} tok/s  total {s['total_tok_s']} tok/s")
    t, i, d = s["ttft_ms"], s["itl_ms"], s["tpot_ms"]
    print(f"  TTFT ms p50 {t['p50']}  p90 {t['p90']}  p99 {t['p99']}")
    print(f"  ITL ms p50 {i['p50']}  p99 {i['p99']}   TPOT ms p50 {d['p50']}")
    print(
        f"  goodput {s['goodput_req_s']} req/s ({s['num_good']} of {s['num_ok']} within TTFT "
        f"{s['slo']['ttft_ms']:.0f} ms, inter-token p99 {s['slo']['itl_p99_ms']:.0f} ms) at {s['request_rate']} req/s"
    )


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Workload]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL_PATH), help="GGUF file or HF directory")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="preset; flags override it")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--prompt-len-spread", type=float, help="uniform in prompt_len * (1 ± spread)")
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--rate", type=float, help="Poisson arrivals per second (default: closed loop)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="untimed requests first (one at a time)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--structured", choices=sorted(STRUCTURED), default="none",
                    help="json_schema: every request under a JSON schema's token mask (see above)")  # fmt: skip
    ap.add_argument(
        "--slo-ttft-ms", type=float, default=SLO_TTFT_MS, help="goodput: a request's TTFT at most"
    )
    ap.add_argument(
        "--slo-itl-ms", type=float, default=SLO_ITL_MS, help="goodput: its inter-token p99 at most"
    )
    ap.add_argument("--label", default="")
    ap.add_argument("--json", dest="json_path", default=None, help="write the summary here ('-': stdout)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    preset = dict(WORKLOADS[args.workload]) if args.workload else dict(WORKLOADS["W1"])
    for key in ("num_requests", "prompt_len", "prompt_len_spread", "output_len", "concurrency"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if args.rate is not None and args.concurrency is None:
        preset["concurrency"] = None
    if preset["concurrency"] is None and args.rate is None:
        ap.error(f"--workload {args.workload} is an open loop: give --rate (requests per second)")
    return args, Workload(**preset, rate=args.rate, seed=args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    args, workload = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = make_prompts(tokenizer, workload)
    warmup = Workload(**{**asdict(workload), "num_requests": args.warmup, "seed": workload.seed + 10_000})
    summary = asyncio.run(run(args, workload, prompts, make_prompts(tokenizer, warmup)))
    if args.json_path == "-":
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(summary, f, indent=2)
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
