"""`kvfence` command line: fetch-model, generate, preflight, serve, the PD workers (prefill, decode), and
`top` (the KV page map in a terminal)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from kvfence.faults import Faults

if TYPE_CHECKING:
    from kvfence.engine.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from kvfence.model.fetch import DEFAULT_MODEL_PATH

    p.add_argument("--model", default=str(DEFAULT_MODEL_PATH), help="GGUF file or Hugging Face directory")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-pages", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-cache-memory", type=float, default=None, help="KV pool size in GiB (default 1)")
    p.add_argument("--context-length", type=int, default=None, help="lower the model's context length")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most")
    p.add_argument(
        "--prefill-batch-tokens", type=int, default=256,
        help="a step with prefill tokens takes another request's prefill only within this many (0: no limit)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--decode-threads", type=int, default=None,
        help="torch threads for steps without prefill tokens (default: --threads)",
    )  # fmt: skip
    p.add_argument(
        "--no-integrity-checks",
        action="store_true",
        help="debug/benchmark only: skip I1 checks and tag stamping",
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--enable-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse sealed KV pages of earlier requests of the same tenant (docs/prefix-cache.md; default on)",
    )
    cache.add_argument(
        "--disable-prefix-cache",
        dest="enable_prefix_cache",
        action="store_false",
        help="same as --no-enable-prefix-cache",
    )
    p.add_argument(
        "--kv-canary-interval",
        type=int,
        default=64,
        metavar="STEPS",
        help="re-verify the digests of a few cached pages every STEPS engine steps (0: only on reuse)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from kvfence.engine.config import EngineConfig, resolve_dtype

    return EngineConfig(
        model=args.model,
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        kv_cache_memory=args.kv_cache_memory,
        context_length=args.context_length,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_batch_tokens=args.prefill_batch_tokens,
        integrity_checks=not args.no_integrity_checks,
        num_threads=args.threads,
        decode_threads=args.decode_threads,
        enable_prefix_cache=args.enable_prefix_cache,
        kv_canary_interval=args.kv_canary_interval,
        faults=Faults.from_env(),
    )


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from kvfence.model.fetch import fetch_model

    path = fetch_model(verify=args.verify)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.request import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    start = time.perf_counter()
    first: float | None = None
    out = None
    for out in engine.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    end = time.perf_counter()
    assert out is not None and first is not None
    n = out.num_output_tokens
    decode_rate = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
    print(
        f"\n\n[{out.num_prompt_tokens} prompt tokens, {n} generated, finish={out.finish_reason}; "
        f"time to first token {first - start:.2f}s, {decode_rate:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0 if out.error_code is None else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "fetch-model", help="download the default model (SmolLM2-135M-Instruct GGUF) into the cache"
    )
    p.add_argument("--verify", action="store_true", help="re-check the sha256 even if the file is cached")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser("generate", help="generate text for one prompt, streaming it, and print tokens/s")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    from kvfence.server.launch import add_server_args, cmd_preflight, cmd_serve

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (colocated or PD mode)")
    serve.add_argument(
        "--mode", choices=["colocated", "pd"], default="colocated",
        help="pd: a router here plus one prefill and one decode worker process on this machine",
    )  # fmt: skip
    add_engine_args(serve)
    add_server_args(serve, serving=True)
    serve.set_defaults(func=cmd_serve)

    p = sub.add_parser("preflight", help="print the KV pool vs context length check (I6) and exit")
    add_engine_args(p)
    add_server_args(p, serving=False)
    p.set_defaults(func=cmd_preflight)

    from kvfence.pd.cli import add_worker_commands
    from kvfence.pd.serve import add_pd_args, add_router_command

    add_pd_args(serve)
    add_worker_commands(sub)
    add_router_command(sub)

    from kvfence.dashboard.top import add_top_command

    add_top_command(sub)

    from kvfence.probe.cli import add_commands as add_probe_commands

    add_probe_commands(sub)  # probe, audit (docs/probe.md)
    return parser


# oneDNN keeps every primitive it creates, up to 1,024 by default: one set per linear layer shape for each
# distinct prefill token count, about 45 MB after two W1 runs. 64 cost no measurable throughput on W1
# (docs/performance.md, session 6). Read by oneDNN when it first needs its cache; a value already in the
# environment wins. PD workers inherit it from `serve --mode pd`.
ONEDNN_CACHE_ENTRIES = "64"
# torch's own cache in front of oneDNN's (ideep's, per thread, 1,024 entries by default) keeps, per distinct
# input shape of every linear layer, about 0.7 MB: RSS grew by some 10 MB per W1 with new prompt lengths, with
# room for hundreds of MB more (docs/performance.md, session 8). A miss finds the primitive in oneDNN's cache.
TORCH_LINEAR_CACHE_ENTRIES = "32"


def process_defaults(environ: MutableMapping[str, str]) -> None:
    """Environment defaults for every kvfence process, applied before anything loads."""
    environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    environ.setdefault("LRU_CACHE_CAPACITY", TORCH_LINEAR_CACHE_ENTRIES)


def main(argv: list[str] | None = None) -> int:
    import logging

    process_defaults(os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
