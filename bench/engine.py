"""Offline engine throughput with integrity checks on and off, in one run.

    python bench/engine.py [--model PATH] [--requests 64] [--prompt-len 200] [--new-tokens 64] [--repeats 1]
    python bench/engine.py --profile [--torch-profile]     # where a step's time goes, per phase

Every request gets a random prompt of exactly --prompt-len tokens (fixed seed) and generates exactly --new-tokens
tokens (ignore_eos), all submitted at once. One engine serves every run (after a warm-up), toggling its integrity
checks; runs alternate on/off, off/on so drift on a shared machine hits both. Prints per-run throughput, the
on/off ratio, and the time spent inside the I1 checks themselves as a share of engine time, which is the less
noisy measure of their cost. Tag stamping is part of the write path and runs in both modes; its time is printed
too.

--profile runs once with checks on and times each phase of every step by wrapping the engine's methods from
outside (the engine itself carries no timers): scheduling, the I1/I9 checks, tag stamping, tensor preparation,
the forward pass, sampling, postprocessing (token append, stops, sealing with digests), detokenization, and the
prefix-cache canary. --torch-profile adds the forward pass's top operators from torch.profiler.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import SamplingParams
from kvfence.engine.stats import EngineStats
from kvfence.model.fetch import DEFAULT_MODEL_PATH

_RUN_SEEDS = itertools.count()


def run_once(engine: LLMEngine, args: argparse.Namespace, checks: bool) -> dict[str, float]:
    engine.integrity_checks = checks
    engine.stats = EngineStats()
    rng = random.Random(next(_RUN_SEEDS))  # fresh prompts every run: no prefix-cache hits on earlier runs
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for _ in range(args.requests):
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
            first_token.setdefault(out.request_id, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    assert generated == args.requests * args.new_tokens, generated
    engine.pool.check_integrity()
    return {
        "elapsed": elapsed,
        "out_tok_s": generated / elapsed,
        "total_tok_s": (generated + args.requests * args.prompt_len) / elapsed,
        "ttft_p50": statistics.median(first_token.values()),
        "check_s": engine.stats.check_seconds,
        "stamp_s": engine.stats.stamp_seconds,
        "pages_checked": engine.stats.pages_checked,
        "steps": engine.stats.steps,
    }


PHASES = (  # (label, owner attribute path, method): what each phase of a step wraps
    ("schedule", "scheduler", "schedule"),
    ("I1 checks", "", "_verify"),
    ("I9 write checks", "", "_check_writes"),
    ("tag stamping", "", "_stamp"),
    ("tensor prep", "runner", "_prepare"),
    ("forward", "runner.model", "forward"),
    ("sampling", "runner", "sampler"),
    ("postprocess", "scheduler", "postprocess"),
    ("detokenize", "outputs", "process"),
    ("canary", "", "_canary"),
)


def instrument(engine: LLMEngine) -> dict[str, float]:
    """Wrap each phase's method on this engine instance with a timer; returns the (live) totals in seconds."""
    totals: dict[str, float] = defaultdict(float)

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] += time.perf_counter() - t0

        return wrapper

    for label, path, name in PHASES:
        owner: Any = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        setattr(owner, name, timed(label, getattr(owner, name)))
    step = engine.step
    engine.step = timed("step (all)", step)  # type: ignore[method-assign]
    return totals


def profile(engine: LLMEngine, args: argparse.Namespace) -> None:
    totals = instrument(engine)
    if args.torch_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            r = run_once(engine, args, True)
    else:
        r = run_once(engine, args, True)
    steps = r["steps"]
    print(f"one run, checks on: {r['elapsed']:.2f} s, {r['out_tok_s']:.1f} out tok/s, {steps} steps\n")
    print(f"{'phase':<18}{'total s':>9}{'share':>8}{'ms/step':>9}")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        share = 100 * seconds / r["elapsed"]
        print(f"{label:<18}{seconds:9.3f}{share:7.1f}%{1e3 * seconds / max(steps, 1):9.2f}")
    if args.torch_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs; pairs alternate on/off and off/on")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="one run, time per phase of the step")
    ap.add_argument("--torch-profile", action="store_true", help="with --profile: top torch operators")
    ap.add_argument(
        "--amx-tiles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AMX tile kernels for bfloat16 linear layers and prefill and decode attention where the CPU has them "
        "(--no-amx-tiles: oneDNN's products, torch's prefill attention, AVX-512 decode attention)",
    )
    args = ap.parse_args()
    engine = LLMEngine(
        Config.of(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.max_batched_tokens,
            threads=args.threads,
            amx_tiles=args.amx_tiles,
        )
    )
    warmup = argparse.Namespace(**{**vars(args), "new_tokens": 4})
    run_once(engine, warmup, True)  # page in the KV pool and warm the kernels before anything is timed
    print(f"model={args.model} dtype={args.dtype} threads={args.threads or torch.get_num_threads()}")
    print(
        f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), ignore_eos\n"
    )
    if args.profile:
        profile(engine, args)
        return
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(args.repeats):
        for checks in (True, False) if i % 2 == 0 else (False, True):
            r = run_once(engine, args, checks)
            results[checks].append(r)
            print(
                f"checks={'on ' if checks else 'off'}  {r['elapsed']:7.2f} s  {r['out_tok_s']:7.1f} out tok/s  "
                f"{r['total_tok_s']:8.1f} total tok/s  TTFT p50 {r['ttft_p50']:6.2f} s  "
                f"checks {r['check_s'] * 1e3:6.1f} ms, stamping {r['stamp_s'] * 1e3:5.1f} ms, {r['steps']} steps "
                f"({r['pages_checked']} page checks)"
            )
    on = statistics.median(r["out_tok_s"] for r in results[True])
    off = statistics.median(r["out_tok_s"] for r in results[False])
    ttft_on = statistics.median(r["ttft_p50"] for r in results[True])
    ttft_off = statistics.median(r["ttft_p50"] for r in results[False])
    share = statistics.median(r["check_s"] / r["elapsed"] for r in results[True])
    stamp = statistics.median(r["stamp_s"] / r["elapsed"] for r in results[True] + results[False])
    ratios = [a["out_tok_s"] / b["out_tok_s"] for a, b in zip(results[True], results[False], strict=True)]
    print(f"\nthroughput on/off = {on:.1f}/{off:.1f} = {on / off:.4f}  (cost {100 * (1 - on / off):+.2f}%)")
    print(f"TTFT p50 on/off   = {ttft_on:.2f}/{ttft_off:.2f} s = {ttft_on / ttft_off:.4f}")
    print(
        f"per-pair on/off ratios: {', '.join(f'{x:.4f}' for x in ratios)}; median {statistics.median(ratios):.4f}"
    )
    print(
        f"time inside the I1 checks = {100 * share:.3f}% of engine time (stamping, always on: {100 * stamp:.3f}%)"
    )


if __name__ == "__main__":
    main()
