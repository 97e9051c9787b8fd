"""`kvfence serve --mode pd` (router + one prefill + one decode worker on this machine) and `kvfence router`
(the HTTP front alone; workers join from anywhere with `kvfence prefill|decode --router tcp://HOST:PORT`).

Boundary: process setup only. The HTTP layer is the colocated server's, driven through `RemoteEngine`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvfence.pd import cores
from kvfence.pd.router import Router

log = logging.getLogger("kvfence.pd")
REGISTRATION_TIMEOUT_S = 300


def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-kv-pages", type=int, default=None, help="PD: the prefill worker's pool (pages)")
    p.add_argument("--decode-kv-pages", type=int, default=None, help="PD: the decode worker's pool (pages)")
    p.add_argument("--transfer-window", type=int, default=8, help="PD: page frames in flight per transfer")
    p.add_argument(
        "--share-cores", action=argparse.BooleanOptionalAction, default=True,
        help="PD: a worker steps on all --threads while the other has nothing to step, on half while it has "
        "(kvfence/pd/cores.py); --no-share-cores: always half",
    )  # fmt: skip
    add_timeout_args(p)


def add_timeout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transfer-timeout", type=float, default=30.0,
        help="PD: seconds without progress (a frame, an ack) before a KV transfer is given up",
    )  # fmt: skip
    p.add_argument(
        "--prefill-timeout", type=float, default=300.0,
        help="PD: seconds a reserved transfer may wait for its prefill to finish (long prompts, busy workers)",
    )  # fmt: skip


def add_router_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvfence.cli import add_engine_args
    from kvfence.server.launch import add_server_args

    p = sub.add_parser("router", help="PD: the HTTP front; prefill and decode workers register with it")
    p.add_argument("--bind", default="tcp://0.0.0.0:7000", help="control address workers connect to")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers to wait for before serving")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers to wait for before serving")
    add_engine_args(p)  # --model names the tokenizer; the workers hold the weights
    add_server_args(p, serving=True)
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    router = Router(bind=args.bind)
    print(f"kvfence router: workers connect to {router.addr}", flush=True)
    try:
        if not router.wait_for_workers(args.num_prefill, args.num_decode, REGISTRATION_TIMEOUT_S):
            print("kvfence router: workers did not register in time", file=sys.stderr)
            return 1
        return serve_http(router, args)
    finally:
        router.shutdown()


def _exit_on_sigterm() -> None:
    """uvicorn re-raises the SIGTERM it caught once it has shut down; turn it into SystemExit so our `finally`
    blocks still stop the workers (a router killed with -9 is covered by the workers' own silence timeout)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def cmd_serve_pd(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    router = Router(bind="tcp://127.0.0.1:0")
    with _workers(router, args) as procs:
        if not router.wait_for_workers(
            1, 1, REGISTRATION_TIMEOUT_S, alive=lambda: all(p.poll() is None for p in procs)
        ):
            print(
                "kvfence serve --mode pd: the workers did not register (see their preflight above)",
                file=sys.stderr,
            )
            return 1
        return serve_http(router, args)


@contextlib.contextmanager
def _workers(router: Router, args: argparse.Namespace) -> Iterator[list[subprocess.Popen[bytes]]]:
    from kvfence.engine.config import resolve_dtype

    total = args.threads or _usable_cpus()
    threads = str(max(1, total // 2))  # two workers share this machine's cores
    dtype = resolve_dtype(args.dtype, args.device)  # here, so both workers get the same concrete dtype
    common = ["--router", router.addr, "--model", args.model, "--dtype", dtype, "--device", args.device,
              "--page-size", str(args.page_size), "--threads", threads,
              "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--prefill-batch-tokens", str(args.prefill_batch_tokens),
              "--transfer-timeout", str(args.transfer_timeout), "--prefill-timeout", str(args.prefill_timeout),
              "--kv-canary-interval", str(args.kv_canary_interval)]  # fmt: skip
    common += ["--context-length", str(args.context_length)] if args.context_length is not None else []
    common += ["--clamp-context-length"] if args.clamp_context_length else []
    common += ["--allow-undersized-pool"] if args.allow_undersized_pool else []
    common += ["--no-integrity-checks"] if args.no_integrity_checks else []
    common += [] if args.enable_prefix_cache else ["--no-enable-prefix-cache"]
    share = None
    if args.share_cores:
        fd, name = tempfile.mkstemp(
            prefix="kvfence-cores-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        os.close(fd)
        share = cores.create(Path(name))
        common += ["--share-cores", str(share), "--max-threads", str(total)]
    die_with_parent = _parent_death_signal()
    procs = []
    for role, pages in (("prefill", args.prefill_kv_pages), ("decode", args.decode_kv_pages)):
        cmd = [sys.executable, "-m", "kvfence", role, *common]
        # a role's own size wins over --kv-pages, which wins over --kv-cache-memory
        size = pages or args.kv_pages
        if size:
            cmd += ["--kv-pages", str(size)]
        elif args.kv_cache_memory is not None:
            cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
        cmd += ["--transfer-window", str(args.transfer_window)] if role == "prefill" else []
        procs.append(subprocess.Popen(cmd, preexec_fn=die_with_parent))
    try:
        yield procs
    finally:
        router.shutdown()  # tells the workers to exit
        reap(procs)
        if share is not None:
            share.unlink(missing_ok=True)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 2


def reap(procs: Sequence[subprocess.Popen[bytes]], terminate: bool = False, grace_s: float = 30.0) -> None:
    """Wait for processes to exit (after SIGTERM when `terminate`); kill the ones that outlive `grace_s`."""
    for p in procs:
        if terminate:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a `preexec_fn` that makes the child get SIGTERM when this process dies, even by kill -9 (elsewhere
    the workers' own silence timeouts end them). libc is loaded here, before the fork: the child only calls it."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve_http(router: Router, args: argparse.Namespace) -> int:
    import uvicorn

    from kvfence.model.loader import load_tokenizer
    from kvfence.pd.remote import RemoteEngine, WorkersCollector
    from kvfence.server.app import build_app
    from kvfence.server.async_engine import AsyncEngine
    from kvfence.server.auth import load_api_keys
    from kvfence.server.launch import how_to_call
    from kvfence.server.metrics import ServerMetrics
    from kvfence.server.serving import ServerSettings

    keys = load_api_keys(args.api_keys) if args.api_keys else None
    remote = RemoteEngine(router, load_tokenizer(args.model))
    print(
        f"kvfence router: context length {remote.context_length} (the smallest any worker holds)", flush=True
    )
    metrics = ServerMetrics()
    metrics.registry.register(WorkersCollector(router))  # each worker's pool, from its heartbeats
    engine = AsyncEngine(remote, max_queue=args.max_queue, observer=metrics)  # type: ignore[arg-type]
    name = args.served_model_name or Path(args.model).stem
    settings = ServerSettings(
        name, api_keys=keys, max_body_bytes=args.max_body_bytes, admin_key=args.admin_key
    )
    print(how_to_call(args.host, args.port, name, with_key=keys is not None), flush=True)
    uvicorn.run(build_app(engine, settings, metrics), host=args.host, port=args.port, log_level="info")
    return 0
