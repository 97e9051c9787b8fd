"""What one step costs while a flooding tenant's long requests decode, and how many steps a newcomer waits.

    python bench/flooded_step.py [--model PATH] [--a-requests 23] [--a-prompt-len 2000] [--b-prompt-len 196]
        [--policy vtc] [--b-weight 1]

Tenant A's requests (random prompts of --a-prompt-len tokens, long outputs) are prefilled first; then the engine
steps with all of them decoding (the median step time is printed), then tenant B submits one request and the
script prints how many steps and how long B waited for its first token, and each of those steps' time and
tokens. The engine is `kvfence serve`'s (the default configuration tree; --policy, B's weight). Issue 25's
question: under a flood of long contexts, is it the steps' length or their number that B waits for?
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvfence.config import Config
from kvfence.engine.fairness import TenantShare
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import SamplingParams
from kvfence.flags import resolve
from kvfence.model.fetch import DEFAULT_MODEL_PATH


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_PATH)
    p.add_argument("--a-requests", type=int, default=23)
    p.add_argument("--a-prompt-len", type=int, default=2000)
    p.add_argument("--b-prompt-len", type=int, default=196)
    p.add_argument("--policy", choices=["vtc", "fcfs"], default="vtc")
    p.add_argument("--b-weight", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(resolve(Config.of(model=args.model, policy=args.policy, threads=args.threads)))
    engine.set_tenants({"B": TenantShare(weight=args.b_weight)})
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    a_params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i in range(args.a_requests):
        engine.add_request(
            [rng.randrange(3, vocab) for _ in range(args.a_prompt_len)], a_params, f"a{i}", "A"
        )
    engine.step()  # takes the submitted requests in (then the loop below sees them)
    while engine.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # A's prompts, until every one that fits the pool decodes
    decode_steps = []
    for _ in range(10):
        start = time.perf_counter()
        engine.step()
        decode_steps.append(time.perf_counter() - start)
    held = engine.scheduler.held_pages().get("A", 0)
    print(f"A: {len(engine.scheduler.running)} requests decoding, {held} pages of {engine.pool.num_pages}; "
          f"median decode step {statistics.median(decode_steps) * 1000:.0f} ms")  # fmt: skip
    b_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request([rng.randrange(3, vocab) for _ in range(args.b_prompt_len)], b_params, "b", "B")
    start, steps = time.perf_counter(), 0
    while True:
        t0 = time.perf_counter()
        outs = engine.step()
        steps += 1
        print(f"  step {steps}: {(time.perf_counter() - t0) * 1000:.0f} ms, {engine.scheduler.num_preemptions} "
              f"preemptions so far, running {len(engine.scheduler.running)}")  # fmt: skip
        if any(o.request_id == "b" for o in outs):
            break
    print(f"B: first token after {steps} steps, {(time.perf_counter() - start) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
