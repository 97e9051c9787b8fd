"""The C++ kernels against the torch path: one forward step, alternated in one process on the same inputs.

    python bench/kernels.py [--threads N] [--reps 8]

Loads the default model in bfloat16, builds three plans (8 decode rows at context 230, 1 decode row, one 196-token
prefill; pages scattered over a 2,048-page pool) and runs each with the kernels on and off in alternating blocks
(on/off, off/on, ...), so that machine noise falls on both sides alike. Prints the median step time of each and
their ratio. Needs the kernels (`python -m kvfence.model.kernels`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.plan import Plan, PlanRow
from kvfence.engine.request import SamplingParams
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.llama import MLP, Attention, LlamaForCausalLM


def plan(rng: random.Random, rows: int, new: int, ctx: int, pool_pages: int) -> Plan:
    greedy = SamplingParams(temperature=0)
    out = []
    for i in range(rows):
        pages = tuple(PageId(p) for p in rng.sample(range(pool_pages), -(-ctx // 16)))
        tokens = tuple(rng.randrange(3, 49000) for _ in range(new))
        out.append(
            PlanRow(RequestId(f"r{i}"), tokens, ctx - new, pages, (LeaseId(1),) * len(pages), True, greedy, 0)
        )
    return Plan(tuple(out), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8, help="alternations per plan")
    args = ap.parse_args()
    pool_pages = 2048
    config = EngineConfig(
        model=str(DEFAULT_MODEL_PATH), dtype="bfloat16", num_threads=args.threads, kv_pages=pool_pages
    )
    runner = LLMEngine(config).runner
    model = runner.model
    ops = model.kernels
    if ops is None:
        raise SystemExit("the C++ kernels are not available (python -m kvfence.model.kernels)")
    torch.set_num_threads(args.threads)

    def use_kernels(on: bool) -> None:
        for m in model.modules():
            if isinstance(m, (Attention, MLP, LlamaForCausalLM)):
                m.kernels = ops if on else None

    rng = random.Random(0)
    plans = {
        "decode, 8 rows": (plan(rng, 8, 1, 230, pool_pages), 10),
        "decode, 1 row": (plan(rng, 1, 1, 230, pool_pages), 10),
        "prefill, 196 tokens": (plan(rng, 1, 196, 196, pool_pages), 3),
    }
    print(f"threads {args.threads}, {args.reps} alternations; median step time")
    for name, (step_plan, calls) in plans.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                use_kernels(on)
                for _ in range(calls):
                    t0 = time.perf_counter()
                    runner.run(step_plan)
                    times[on].append((time.perf_counter() - t0) * 1e3)
        on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
        print(f"{name:20s} kernels {on_ms:8.2f} ms   torch {off_ms:8.2f} ms   ratio {on_ms / off_ms:.3f}")
    use_kernels(True)


if __name__ == "__main__":
    main()
