"""`kvfence serve` and `kvfence preflight`: load the model, run the preflight (I6), then serve or stop.

Boundary: process setup only (arguments, files, uvicorn). Order matters: the preflight decides on numbers
before the engine allocates its KV pool, so a refused configuration never allocates anything.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence.server.preflight import PreflightReport, Verdict, preflight_config

if TYPE_CHECKING:  # heavy (torch); imported when a command runs, not when the CLI parses
    from kvfence.engine.config import EngineConfig
    from kvfence.model.loader import LoadedModel

log = logging.getLogger("kvfence.server")


def add_server_args(p: argparse.ArgumentParser, serving: bool) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--clamp-context-length",
        action="store_true",
        help="if the KV pool cannot hold one full-context request, advertise only what it holds",
    )
    size.add_argument(
        "--allow-undersized-pool",
        action="store_true",
        help="test/debug: start even if the pool cannot hold one full-context request",
    )
    if not serving:
        return
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: file stem)")
    p.add_argument("--api-keys", default=None, help="TOML or JSON file mapping API key -> tenant name")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 503")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted")
    p.add_argument(
        "--admin-key",
        default=os.environ.get("KVFENCE_ADMIN_KEY") or None,
        help="key that opens GET /debug/kv, the KV page map behind /dashboard and `kvfence top` "
        "(default: $KVFENCE_ADMIN_KEY; unset: nobody may read it)",
    )


def size_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the size arguments, checked before anything loads: a context or a pool of no
    tokens would otherwise be ignored (`--context-length 0`) or fail deep in the preflight."""
    if args.context_length is not None and args.context_length < 1:
        return f"--context-length must be at least 1, got {args.context_length}"
    if args.kv_pages is not None and args.kv_pages < 1:
        return f"--kv-pages must be at least 1, got {args.kv_pages}"
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        return f"--page-size must be a power of two, got {args.page_size}"
    if getattr(args, "max_queue", 1) < 1:
        return f"--max-queue must be at least 1, got {args.max_queue}"
    return None


def run_preflight(config: EngineConfig, args: argparse.Namespace) -> tuple[PreflightReport, LoadedModel]:
    """Load the model (not the KV pool) and size-check the configuration; prints the summary."""
    from kvfence.model.loader import load_model

    loaded = load_model(config.model, dtype=config.torch_dtype)
    report = preflight_config(
        loaded.config, config, clamp=args.clamp_context_length, allow_undersized=args.allow_undersized_pool
    )
    print(report.summary(), flush=True)
    return report, loaded


def cmd_preflight(args: argparse.Namespace) -> int:
    from kvfence.cli import engine_config_from_args

    if problem := size_problem(args):
        print(f"kvfence preflight: {problem}", file=sys.stderr)
        return 2
    try:
        report, _ = run_preflight(engine_config_from_args(args), args)
    except ValueError as e:
        print(f"kvfence preflight: {e}", file=sys.stderr)
        return 2
    return 0 if report.can_start else 1


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfence.cli import engine_config_from_args
    from kvfence.engine.llm_engine import LLMEngine, on_passing_thread, return_freed_memory
    from kvfence.server.app import build_app
    from kvfence.server.async_engine import AsyncEngine
    from kvfence.server.auth import load_api_keys
    from kvfence.server.metrics import ServerMetrics
    from kvfence.server.serving import ServerSettings

    if problem := size_problem(args):
        print(f"kvfence serve: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "mode", "colocated") == "pd":
        from kvfence.pd.serve import cmd_serve_pd

        return cmd_serve_pd(args)
    config = engine_config_from_args(args)
    try:
        keys = load_api_keys(args.api_keys) if args.api_keys else None
        report, loaded = on_passing_thread(lambda: run_preflight(config, args))  # not on main: OpenMP pools
    except (OSError, ValueError) as e:
        print(f"kvfence serve: {e}", file=sys.stderr)
        return 2
    if not report.can_start:
        return 1
    if report.verdict is Verdict.CLAMPED:
        config = replace(config, context_length=report.context_length)
    if keys is None and not _is_loopback(args.host):
        log.warning("serving on %s without --api-keys: every client is the anonymous tenant", args.host)
    metrics = ServerMetrics()
    llm = on_passing_thread(functools.partial(LLMEngine, config, loaded))  # the engine thread steps it
    del loaded
    return_freed_memory()
    engine = AsyncEngine(llm, max_queue=args.max_queue, observer=metrics)
    name = args.served_model_name or Path(config.model).stem
    settings = ServerSettings(
        name, api_keys=keys, max_body_bytes=args.max_body_bytes, admin_key=args.admin_key, preflight=report
    )
    print(how_to_call(args.host, args.port, name, with_key=keys is not None), flush=True)
    uvicorn.run(build_app(engine, settings, metrics), host=args.host, port=args.port, log_level="info")
    return 0


def how_to_call(host: str, port: int, model: str, with_key: bool) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{host}:{port}/v1"
    auth = " -H 'Authorization: Bearer YOUR_KEY'" if with_key else ""
    key = "YOUR_KEY" if with_key else "none"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "What is a KV cache?"}}]}}'
    return (
        f"\nkvfence serves {model} at {base} (OpenAI API). Try:\n"
        f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f'  python -c \'from openai import OpenAI; c = OpenAI(base_url="{base}", api_key="{key}"); '
        f'print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", '
        f'"content": "Hello!"}}]).choices[0].message.content)\'\n'
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
