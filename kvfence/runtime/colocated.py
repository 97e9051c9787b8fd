"""`kvfence generate`, `kvfence preflight` and `kvfence serve` (colocated): load the model, run the preflight
(I6), then generate, stop, or serve.

Order matters: the preflight decides on numbers before the engine allocates its KV pool, so a refused
configuration never allocates anything.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import TYPE_CHECKING, Any

from kvfence.config import Config
from kvfence.engine.preflight import PreflightReport, Verdict, preflight_config

if TYPE_CHECKING:  # heavy (torch); imported when a command runs, not when the CLI parses
    from kvfence.model.loader import LoadedModel


def run_preflight(config: Config) -> tuple[PreflightReport, LoadedModel]:
    """Load the model (not the KV pool) and size-check the configuration; prints the summary."""
    from kvfence.engine.config import torch_dtype
    from kvfence.model.loader import load_model

    loaded = load_model(config.model.model, dtype=torch_dtype(config), kernels=config.kernels)
    report = preflight_config(loaded.config, config)
    print(report.summary(), flush=True)
    return report, loaded


def clamped(config: Config, report: PreflightReport) -> Config:
    """The tree the engine runs with: the advertised context when the preflight clamped it."""
    if report.verdict is Verdict.CLAMPED:
        return config.replace(context_length=report.context_length)
    return config


def cmd_preflight(config: Config, args: argparse.Namespace) -> int:
    try:
        report, _ = run_preflight(config)
    except ValueError as e:
        print(f"kvfence preflight: {e}", file=sys.stderr)
        return 2
    return 0 if report.can_start else 1


def cmd_generate(config: Config, args: argparse.Namespace) -> int:
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.request import SamplingParams

    engine = LLMEngine(config)
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


def cmd_serve(config: Config, args: argparse.Namespace) -> int:
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.engine.loop import on_passing_thread
    from kvfence.engine.memory import return_freed_memory
    from kvfence.runtime.http import FrontDoorClosed, open_front_door, serve_http
    from kvfence.server.metrics import ServerMetrics
    from kvfence.server.tenants import load_keys_file

    try:
        listeners = open_front_door(config, "serve")  # keys, TLS, the port: before minutes of loading
    except FrontDoorClosed as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        report, loaded = on_passing_thread(lambda: run_preflight(config))  # not on main: OpenMP pools
    except (OSError, ValueError) as e:
        print(f"kvfence serve: {e}", file=sys.stderr)
        return 2
    if not report.can_start:
        return 1
    config = clamped(config, report)
    shares = load_keys_file(config.server.api_keys).shares if config.server.api_keys else None
    try:
        llm = on_passing_thread(
            functools.partial(LLMEngine, config, loaded, tenants=shares)
        )  # the engine thread
    except ValueError as e:  # tenants' guaranteed pages beyond the pool
        print(f"kvfence serve: {config.server.api_keys}: {e}", file=sys.stderr)
        return 2
    del loaded
    return_freed_memory()

    def config_view() -> dict[str, Any]:
        return {"mode": "colocated", "config": config.to_dict(public=True)}

    return serve_http(
        llm, config, ServerMetrics(), config_view=config_view, preflight=report, listeners=listeners
    )
