"""`kvfence` command line: fetch-model, generate, preflight, serve, the PD router and workers (router, prefill,
decode), `keys` (the cluster's CURVE keys), `cluster` (status and scaling), `top` (the KV page map in a
terminal), probe and audit.

A leaf: nothing imports it. The flags of the engine, server and PD commands are generated from the
configuration tree (kvfence/config.py, kvfence/flags.py); the commands run in kvfence/runtime.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from kvfence import config as tree
from kvfence import options
from kvfence.flags import add_flags, config_from_args, resolve
from kvfence.model.tokenizer import ModelLoadError
from kvfence.runtime.process import process_defaults

log = logging.getLogger("kvfence")
Command = Callable[[tree.Config, argparse.Namespace], int]


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from kvfence.model.fetch import fetch_model

    print(fetch_model(verify=args.verify))
    return 0


def run_configured(args: argparse.Namespace) -> int:
    """Build the effective tree (a bad value is refused before anything loads), log it, run the command."""
    try:
        config = resolve(config_from_args(args))
    except (OSError, ValueError) as e:
        print(f"kvfence {args.command}: {e}", file=sys.stderr)
        return 2
    log.info("effective configuration:\n%s", config.describe())
    run: Command = args.run
    return int(run(config, args))


def _serve(config: tree.Config, args: argparse.Namespace) -> int:
    if config.pd.mode == "colocated" and (given := config.pd.cluster_flags_given()):
        verb = "apply" if len(given) > 1 else "applies"
        print(f"kvfence serve: {', '.join(given)} only {verb} to --mode pd (this server is colocated)",
              file=sys.stderr)  # fmt: skip
        return 2
    sharing = config.pd.mode == "pd" and config.pd.ray is None and config.pd.share_cores  # Ray actors: never
    if sharing and config.engine.decode_threads is not None:
        print("kvfence serve: --decode-threads does nothing while the workers share cores (the default in --mode "
              "pd: each steps on all of --threads or half); add --no-share-cores", file=sys.stderr)  # fmt: skip
        return 2
    if config.pd.ray is not None:
        from kvfence.runtime.ray_cluster import cmd_serve_ray

        return cmd_serve_ray(config, args)
    if config.pd.mode == "pd":
        from kvfence.runtime.pd import cmd_serve_pd

        return cmd_serve_pd(config, args)
    from kvfence.runtime.colocated import cmd_serve

    return cmd_serve(config, args)


def _lazy(module: str, name: str) -> Command:
    """A command whose module (torch, uvicorn, zmq) loads only when it runs."""

    def run(config: tree.Config, args: argparse.Namespace) -> int:
        import importlib

        command: Command = getattr(importlib.import_module(module), name)
        return command(config, args)

    return run


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
    configured(p, options.GENERATE, _lazy("kvfence.runtime.colocated", "cmd_generate"))

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (colocated or PD mode)")
    configured(p, options.SERVE, _serve)
    p = sub.add_parser("preflight", help="print the KV pool vs context length check (I6) and exit")
    configured(p, options.PREFLIGHT, _lazy("kvfence.runtime.colocated", "cmd_preflight"))
    p = sub.add_parser("router", help="PD: the HTTP front; prefill and decode workers register with it")
    configured(p, options.ROUTER, _lazy("kvfence.runtime.pd", "cmd_router"))
    for role in (options.PREFILL, options.DECODE):
        p = sub.add_parser(role, help=f"run a PD {role} worker that registers with a router")
        configured(p, role, _lazy("kvfence.runtime.pd", "cmd_worker"))

    from kvfence.dashboard.top import add_top_command
    from kvfence.probe.cli import add_commands as add_probe_commands
    from kvfence.runtime.cluster_cli import add_cluster_command
    from kvfence.runtime.cluster_keys import add_keys_command

    add_keys_command(sub)
    add_cluster_command(sub)
    add_top_command(sub)
    add_probe_commands(sub)  # probe, audit (docs/probe.md)
    return parser


def configured(p: argparse.ArgumentParser, command: str, run: Command) -> None:
    add_flags(p, command)
    p.set_defaults(func=run_configured, run=run)


def main(argv: list[str] | None = None) -> int:
    process_defaults(os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ModelLoadError as exc:  # a missing or broken model: its message names the file and what is wrong
        print(f"kvfence {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
