"""Noisy neighbour in the engine alone: bench/fairness.py's loads without HTTP, with every step accounted for.

    python bench/noisy_engine.py [--a-in-flight 16] [--a-prompt-len 1700] [--b-weight 8]
        [--max-num-batched-tokens 512] [--policy vtc] [--steps-out steps.jsonl]

Tenant B runs W1's shape (32 distinct prompts of 176-216 tokens, 64 output tokens, 8 in flight, closed loop: a
request that ends is replaced in the same step) alone, then while tenant A keeps --a-in-flight requests of
--a-prompt-len tokens (64 output tokens) in flight, from --a-head-start seconds before B starts until B is done.
Prompts are random token ids (distinct: no prefix-cache hits). Time is the engine's own: each step's wall time,
one thread driving `LLMEngine.step` (so no HTTP, no tokenizer, no client on the cores). As over HTTP, a request
arrives while a step runs (halfway through it, for its TTFT) and waits for the next: a request that ends is
replaced one step later, and B's first requests arrive during a step of A's (--arrive-between-steps: at a step's
end, replaced at once).

Alone and flooded alternate --rounds times (this machine's noise moves a run by 10-20%). Each round prints B's
wall time, output tokens/s and TTFT p50/p99 flooded against alone (issue 25's ratios), what the engine computed
for each tenant in the flooded run (prompt and output tokens, from the counters' charges: A's share, not just
its completed requests), and the steps after B started by what they held (A's prefill or decodes, B's), with
their total and mean time: where B's extra time went. --steps-out writes the last flooded run's steps, one JSON
line each (time, each tenant's prompt tokens and decodes, the waiting queues, the counters).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from kvfence.config import Config
from kvfence.engine.fairness import TenantShare
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import SamplingParams
from kvfence.flags import resolve
from kvfence.model.fetch import DEFAULT_MODEL_PATH

B_REQUESTS, B_IN_FLIGHT, B_PROMPT, OUT = 32, 8, 196, 64
MID_STEP = True  # requests arrive halfway through a step, as over HTTP (--arrive-between-steps: at its end)
SERVED: dict[str, list[int]] = {}  # tenant -> [prompt tokens, output tokens] the engine computed (its counters' input)


def count_service(engine: LLMEngine) -> None:
    """Tally what the scheduler charges each tenant (prompt tokens, decodes) as it charges it."""
    fairness = engine.scheduler.fairness
    charge = fairness.charge

    def counted(tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        served = SERVED.setdefault(tenant, [0, 0])
        served[0] += prompt_tokens
        served[1] += output_tokens
        charge(tenant, prompt_tokens, output_tokens)

    fairness.charge = counted  # type: ignore[method-assign]


class Client:
    """One tenant's closed loop: keeps `in_flight` requests queued or running, `total` of them (None: forever)."""

    def __init__(self, engine: LLMEngine, tenant: str, prompts: list[list[int]], in_flight: int,
                 total: int | None) -> None:  # fmt: skip
        self.engine, self.tenant, self.prompts = engine, tenant, prompts
        self.in_flight, self.total = in_flight, total
        self.sent = 0
        self.live: dict[str, float] = {}  # request id -> submit time
        self.ttft: list[float] = []
        self.first: set[str] = set()
        self.output_tokens = self.completed = 0
        self.params = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)

    def top_up(self, now: float) -> None:
        while len(self.live) < self.in_flight and (self.total is None or self.sent < self.total):
            rid = f"{self.tenant}{self.sent}"
            self.engine.add_request(self.prompts[self.sent % len(self.prompts)], self.params, rid, self.tenant)
            self.live[rid] = now
            self.sent += 1

    def observe(self, rid: str, new_tokens: int, finished: bool, now: float) -> None:
        if rid not in self.live:
            return
        if new_tokens and rid not in self.first:
            self.first.add(rid)
            self.ttft.append(now - self.live[rid])
        self.output_tokens += new_tokens
        if finished:
            del self.live[rid]
            self.first.discard(rid)
            self.completed += 1

    @property
    def done(self) -> bool:
        return self.total is not None and self.sent >= self.total and not self.live


def prompts(rng: random.Random, vocab: int, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_b(engine: LLMEngine, b_prompts: list[list[int]], a: Client | None, head_start: float,
          steps_out: list[dict[str, Any]]) -> tuple[Client, float]:  # fmt: skip
    """Run A (if given) for `head_start` seconds of engine time, then B's 32 requests to the end; then abort what
    A has left and drain. B's client and B's wall time (the sum of step times from B's first request)."""
    clock = 0.0  # the sum of step times: the engine's own time, nothing else counted
    b = Client(engine, "B", b_prompts, B_IN_FLIGHT, B_REQUESTS)
    clients = [b] if a is None else [b, a]
    started, b_start = False, 0.0
    if a is not None:
        a.top_up(clock)
    while not (started and b.done):
        if not started and clock >= head_start:
            started, b_start = True, clock
            if not MID_STEP:
                b.top_up(clock)
        scheduler = engine.scheduler
        before = {t: list(v) for t, v in SERVED.items()}
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        clock += dt
        if MID_STEP:  # what ended in the last step is replaced now, as if it arrived halfway through this one
            for client in clients:
                if started or client is a:
                    client.top_up(clock - dt / 2)
        for out in outputs:
            rid = str(out.request_id)
            for client in clients:
                if rid.startswith(client.tenant):
                    client.observe(rid, len(out.new_token_ids), out.finished, clock)
        did = {t: [v[0] - before.get(t, [0, 0])[0], v[1] - before.get(t, [0, 0])[1]] for t, v in SERVED.items()}
        steps_out.append({"t": round(clock, 4), "dt_ms": round(dt * 1000, 2), "did": did, "b_started": started,
                          "waiting": {t: sum(1 for r in scheduler.waiting if r.tenant == t) for t in ("A", "B")},
                          "counters": {t: round(v, 1) for t, v in scheduler.fairness.counters.items()}})  # fmt: skip
        if not MID_STEP:
            for client in clients:
                if started or client is a:
                    client.top_up(clock)
    if a is not None:
        a.in_flight = 0
        for rid in list(a.live):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        a.live.clear()
    return b, clock - b_start


def summary(b: Client, wall: float) -> dict[str, float]:
    return {
        "wall_s": round(wall, 2),
        "out_tok_s": round(b.output_tokens / wall, 1),
        "ttft_p50_ms": round(pct(b.ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(pct(b.ttft, 99) * 1000, 1),
    }


def step_split(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Steps after B started, by what they computed: time, count and mean per kind."""
    kinds: dict[str, list[float]] = {}
    for s in steps:
        if not s["b_started"]:
            continue
        a, b = s["did"].get("A", [0, 0]), s["did"].get("B", [0, 0])
        kind = ("A prefill " if a[0] else "") + ("A decode " if a[1] else "")
        kind += ("B prefill " if b[0] else "") + ("B decode" if b[1] else "")
        kinds.setdefault(kind.strip() or "empty", []).append(s["dt_ms"])
    return {
        k: {"steps": len(v), "total_s": round(sum(v) / 1000, 2), "mean_ms": round(statistics.mean(v), 1)}
        for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_PATH)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--a-in-flight", type=int, default=16)
    p.add_argument("--a-prompt-len", type=int, default=1700)
    p.add_argument("--a-head-start", type=float, default=2.0)
    p.add_argument("--b-weight", type=float, default=8.0)
    p.add_argument("--policy", choices=["vtc", "fcfs"], default="vtc")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-batch-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alone / flooded pairs, alternated (machine noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrive-between-steps", action="store_true", help="requests arrive as a step ends, not halfway through"
    )
    p.add_argument("--steps-out", default=None, help="the last flooded run's steps, one JSON line each")
    args = p.parse_args()
    global MID_STEP
    MID_STEP = not args.arrive_between_steps
    torch.set_num_threads(args.threads)
    config = Config.of(model=args.model, dtype=args.dtype, policy=args.policy, threads=args.threads,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       prefill_batch_tokens=args.prefill_batch_tokens)  # fmt: skip
    engine = LLMEngine(resolve(config))
    if args.policy == "vtc":
        engine.set_tenants({"B": TenantShare(weight=args.b_weight)})
    count_service(engine)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    spread = (round(B_PROMPT * 0.9), round(B_PROMPT * 1.1))
    engine.generate(prompts(rng, vocab, 2, *spread), SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True))
    rounds = []
    steps: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        b_alone, wall_alone = run_b(engine, prompts(rng, vocab, B_REQUESTS, *spread), None, 0.0, [])
        SERVED.clear()
        steps.clear()
        a_prompts = prompts(rng, vocab, 64, args.a_prompt_len, args.a_prompt_len)
        a = Client(engine, "A", a_prompts, args.a_in_flight, None)
        b_flooded, wall_flooded = run_b(engine, prompts(rng, vocab, B_REQUESTS, *spread), a, args.a_head_start,
                                        steps)  # fmt: skip
        alone, flooded = summary(b_alone, wall_alone), summary(b_flooded, wall_flooded)
        rounds.append({
            "b_alone": alone,
            "b_flooded": flooded,
            "b_ratio": {k: round(flooded[k] / alone[k], 2) for k in alone},
            "served_tokens": {t: {"prompt": v[0], "output": v[1]} for t, v in sorted(SERVED.items())},
            "a_completed": a.completed,
            "steps_after_b_started": step_split(steps),
        })  # fmt: skip
    config_out = {k: str(v) if k == "model" else v for k, v in vars(args).items()}
    print(json.dumps({"config": config_out, "rounds": rounds}, indent=2))
    for i, r in enumerate(rounds):
        ratio = r["b_ratio"]
        print(f"round {i}: B flooded / alone: wall {ratio['wall_s']}x, tok/s {ratio['out_tok_s']}, "
              f"TTFT p50 {ratio['ttft_p50_ms']}x, p99 {ratio['ttft_p99_ms']}x; A served {r['served_tokens'].get('A')}, "
              f"completed {r['a_completed']}")  # fmt: skip
    if args.steps_out:
        with open(args.steps_out, "w") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")


if __name__ == "__main__":
    main()
