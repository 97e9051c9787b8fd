"""The time of one decode step at a given batch: N requests with short prompts, all decoding, median step time.

    python bench/decode_step.py [--model PATH] [--rows 32 64] [--prompt-len 32] [--steps 12] [--threads 2]

For each --rows value, that many requests (random prompts of --prompt-len tokens) are prefilled, then the engine
steps with all of them decoding and the median of --steps step times is printed; the requests then run out
before the next batch. The engine is `kvfence serve`'s (the default configuration tree, `--dtype auto`), so the
model takes the path the server would: on a bfloat16 Hugging Face model, oneDNN's linear layers and the output
head's `linear_f32`; on a GGUF, the int8 panels up to 16 rows. Compare two commits by running this from two
worktrees in alternation (this machine's noise moves a run by 10-20%).
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
from kvfence.flags import resolve
from kvfence.model.fetch import DEFAULT_MODEL_PATH


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_PATH)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--amx-tiles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AMX tile kernels for bfloat16 linear layers and prefill and decode attention where the CPU has them "
        "(--no-amx-tiles: oneDNN's products, torch's prefill attention, AVX-512 decode attention)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(resolve(Config.of(model=args.model, threads=args.threads, amx_tiles=args.amx_tiles)))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for rows in args.rows:
        for i in range(rows):
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            engine.add_request(prompt, params, f"r{rows}-{i}", "bench")
        engine.step()  # takes the submitted requests in
        while engine.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        decoding = len(engine.scheduler.running)
        print(f"{decoding} rows: median decode step {statistics.median(times) * 1000:.1f} ms", flush=True)
        while engine.scheduler.running or engine.num_waiting:
            engine.step()


if __name__ == "__main__":
    main()
