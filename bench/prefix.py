"""Prefix cache: time to first token with and without a cache hit, and the decode step cost with the cache on/off.

    python bench/prefix.py [--model PATH] [--system-tokens 1000] [--repeats 5] [--threads N]
                           [--decode-requests 32] [--decode-prompt 128] [--decode-new 64] [--decode-pairs 2]

Part 1, TTFT (one warm engine, one request at a time, max_tokens=1): every request is a --system-tokens "system
prompt" followed by a fresh 24-token question.
  - off:  the prefix cache switched off (nothing looked up, nothing sealed);
  - miss: cache on, a system prompt never seen before (pays key hashing and sealing digests);
  - hit:  cache on, the system prompt already cached (pays digest re-checks of the idle pages it reuses).
Part 2, decode step cost: --decode-requests random prompts (no hits) run to the end together, runs alternating
cache on/off; prints the median pure-decode step time and the time spent taking sealing digests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import SamplingParams
from kvfence.model.fetch import DEFAULT_MODEL_PATH

TEXT = (
    "You are the support assistant of a small bicycle shop. Answer politely and briefly. The shop opens at nine "
    "and closes at six, except on Sundays. Repairs take two days; wheels are trued while you wait. "
)


def set_prefix_cache(engine: LLMEngine, on: bool) -> None:
    """Toggle the cache on one warm engine: with it off the scheduler neither looks up nor seals."""
    engine.scheduler.cache = engine.prefix_cache if on else None


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while True:
        for out in engine.step():
            if out.request_id == request.request_id and out.finished:
                assert out.error_code is None, out.error_code
                return time.perf_counter() - start


def system_prompt(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """n tokens of instructions; `salt` changes the first token, so no earlier key matches any page."""
    ids = engine.tokenizer.encode(TEXT * (n // 30 + 2))[:n]
    return [salt, *ids[1:]]


def bench_ttft(engine: LLMEngine, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def question() -> list[int]:
        return [rng.randrange(vocab) for _ in range(24)]

    cached = system_prompt(engine, args.system_tokens, salt=1)
    ttft(engine, cached + question())  # warm-up, and puts `cached` in the cache
    times: dict[str, list[float]] = {"off": [], "miss": [], "hit": []}
    cache = engine.prefix_cache
    assert cache is not None
    for i in range(args.repeats):
        for kind in ("off", "miss", "hit") if i % 2 == 0 else ("hit", "miss", "off"):
            set_prefix_cache(engine, kind != "off")
            prompt = cached if kind == "hit" else system_prompt(engine, args.system_tokens, salt=100 + 3 * i)
            times[kind].append(ttft(engine, prompt + question()))
    set_prefix_cache(engine, True)
    print(f"TTFT, {args.system_tokens}-token system prompt + 24-token question, {args.repeats} runs each:")
    print(f"{'':6} {'p50 ms':>9} {'min ms':>9} {'max ms':>9}")
    for kind, values in times.items():
        print(
            f"{kind:6} {1e3 * statistics.median(values):9.1f} {1e3 * min(values):9.1f} {1e3 * max(values):9.1f}"
        )
    off, hit = statistics.median(times["off"]), statistics.median(times["hit"])
    print(f"hit / off = {hit / off:.3f} ({off / hit:.1f}x faster); miss / off = "
          f"{statistics.median(times['miss']) / off:.3f}")  # fmt: skip
    print(f"digests: sealing {1e3 * cache.seal_seconds:.1f} ms, re-checks {1e3 * cache.verify_seconds:.1f} ms "
          f"({cache.pages_verified} pages) over the whole run\n")  # fmt: skip


def decode_run(engine: LLMEngine, args: argparse.Namespace, on: bool, seed: int) -> dict[str, float]:
    set_prefix_cache(engine, on)
    cache = engine.prefix_cache
    assert cache is not None
    seal_before = cache.seal_seconds
    rng = random.Random(seed)  # fresh prompts every run: nothing may hit what an earlier run cached
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.decode_new, temperature=0.0, ignore_eos=True)
    for _ in range(args.decode_requests):
        engine.add_request([rng.randrange(vocab) for _ in range(args.decode_prompt)], params)
    decode_steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        computed, t0 = engine.stats.tokens_computed, time.perf_counter()
        engine.step()
        if engine.stats.tokens_computed - computed <= args.decode_requests:  # every row a single token
            decode_steps.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return {
        "elapsed": elapsed,
        "decode_p50": statistics.median(decode_steps),
        "steps": len(decode_steps),
        "seal_s": cache.seal_seconds - seal_before,
    }


def bench_decode(engine: LLMEngine, args: argparse.Namespace) -> None:
    print(f"decode: {args.decode_requests} requests x ({args.decode_prompt} prompt + {args.decode_new} new), "
          "random prompts (no hits), runs alternating")  # fmt: skip
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(args.decode_pairs):
        for on in (True, False) if i % 2 == 0 else (False, True):
            r = decode_run(engine, args, on, seed=len(results[True]) + len(results[False]) + 1)
            results[on].append(r)
            print(f"cache={'on ' if on else 'off'}  {r['elapsed']:7.2f} s  decode step p50 "
                  f"{1e3 * r['decode_p50']:7.1f} ms over {r['steps']:.0f} steps  "
                  f"sealing digests {1e3 * r['seal_s']:6.1f} ms")  # fmt: skip
    on = statistics.median(r["decode_p50"] for r in results[True])
    off = statistics.median(r["decode_p50"] for r in results[False])
    share = statistics.median(r["seal_s"] / r["elapsed"] for r in results[True])
    print(f"decode step p50 on/off = {1e3 * on:.1f}/{1e3 * off:.1f} ms = {on / off:.4f}; "
          f"sealing digests = {100 * share:.3f}% of engine time with the cache on")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5, help="TTFT runs of each kind (0: skip part 1)")
    ap.add_argument("--decode-requests", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-new", type=int, default=64)
    ap.add_argument("--decode-pairs", type=int, default=2, help="pairs of decode runs, alternating on/off")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engine = LLMEngine(Config.of(model=args.model, dtype=args.dtype, max_num_seqs=64, threads=args.threads))
    print(f"model={args.model} dtype={args.dtype} threads={args.threads or torch.get_num_threads()} "
          f"page_size={engine.pool.page_size}\n")  # fmt: skip
    if args.repeats:
        bench_ttft(engine, args)
    if args.decode_pairs:
        bench_decode(engine, args)
    engine.check_integrity()


if __name__ == "__main__":
    main()
