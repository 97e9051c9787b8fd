"""`kvfence prefill` / `kvfence decode`: run one PD worker process that registers with a router."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvfence.cli import add_engine_args, engine_config_from_args, process_defaults
from kvfence.pd.serve import add_timeout_args
from kvfence.server.launch import add_server_args


def add_worker_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run a PD {role} worker that registers with a router")
        p.add_argument(
            "--router", required=True, help="the router's control address, e.g. tcp://10.0.0.1:7000"
        )
        add_timeout_args(p)
        p.add_argument(
            "--share-cores", default=None, metavar="PATH",
            help="a file shared with the other worker on this host (kvfence/pd/cores.py; made if missing): step on "
            "--max-threads while it has nothing to step, on --threads while it has (--decode-threads unused)",
        )  # fmt: skip
        p.add_argument(
            "--max-threads", type=int, default=None, help="threads when alone (with --share-cores)"
        )
        if role == "prefill":
            p.add_argument("--data", default="tcp://127.0.0.1:0", help="address to bind the KV data socket")
            p.add_argument(
                "--transfer-window", type=int, default=8, help="page frames in flight per transfer"
            )
        add_engine_args(p)
        add_server_args(p, serving=False)  # --clamp-context-length / --allow-undersized-pool (I6)
        p.set_defaults(func=run_worker, role=role)


def run_worker(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvfence.config import PDOptions
    from kvfence.engine.llm_engine import LLMEngine, return_freed_memory
    from kvfence.pd.cores import CoreShare
    from kvfence.pd.worker import DecodeWorker, PrefillWorker
    from kvfence.server.launch import run_preflight
    from kvfence.server.preflight import Verdict

    config = engine_config_from_args(args)
    cores = None
    if args.share_cores:  # before the model loads: a bad thread count fails at once
        threads = args.threads or 1
        cores = CoreShare(Path(args.share_cores), args.role, threads, args.max_threads or threads)
    report, loaded = run_preflight(config, args)  # I6: a worker whose pool cannot hold its context refuses
    if not report.can_start:
        return 1
    if report.verdict is Verdict.CLAMPED:
        config = replace(config, context_length=report.context_length)
    from kvfence import trace

    traced = trace.install_from_env(args.role)  # KVFENCE_TRACE=DIR: page events for kvfence.sim.trace_check
    if traced is not None:
        logging.getLogger("kvfence.pd").warning("tracing page events to %s", traced)
    engine = LLMEngine(config, loaded)
    del loaded
    return_freed_memory()
    worker: PrefillWorker | DecodeWorker
    options = PDOptions(transfer_timeout=args.transfer_timeout, prefill_timeout=args.prefill_timeout)
    if args.role == "prefill":
        options = replace(options, transfer_window=args.transfer_window)
        worker = PrefillWorker(engine, args.router, args.data, options, cores=cores)
    else:
        worker = DecodeWorker(engine, args.router, options, cores=cores)
    worker.preflight = report  # shown per worker on the router's page map
    logging.getLogger("kvfence.pd").info("%s worker up, router %s", args.role, args.router)
    worker.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="kvfence")
    add_worker_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    process_defaults(os.environ)  # as `kvfence prefill|decode` does: the caches' caps, before any step
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
