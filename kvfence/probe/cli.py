"""`kvfence probe` and `kvfence audit`: arguments, exit statuses, output. The work is in probe.py and audit.py.

Exit statuses, both commands: 0 clean, 1 a finding (a leak, a limit or timing violation; an undersized pool),
2 the target could not be judged (unreachable or misconfigured server, bad arguments, unreadable or unknown logs).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("probe", help="probe an OpenAI-compatible deployment for cross-tenant KV leaks")
    p.add_argument("--base-url", required=True, help="the API's base URL, e.g. http://host:8000/v1")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--key-a", required=True, help="API key of tenant A (plants secrets)")
    p.add_argument("--key-b", required=True, help="API key of tenant B (attacks); must map to another tenant")
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="the context length the service advertises (default: /v1/models max_model_len)",
    )
    p.add_argument(
        "--pool-tokens",
        type=int,
        default=None,
        help="the smallest KV pool in tokens, if known (kvfence audit): adds over-pool prompts",
    )
    p.add_argument("--requests", type=int, default=200, help="requests to send, besides <= 7 for calibration")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument(
        "--flood",
        type=int,
        default=16,
        help="tenant A's long requests in flight at the load-timing check's heavy level (0: no check); the check "
        "runs when --requests leaves room for its 24 probes, and sends up to 12x this many of A's requests on top",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=900.0, help="seconds for the whole probe")
    p.add_argument("--chat", action="store_true", help="use /chat/completions (for chat-only servers)")
    p.add_argument("--seed", type=int, default=None, help="make the prompts and secrets reproducible")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("audit", help="read server startup logs: KV pool tokens vs context length, per node")
    p.add_argument("files", nargs="+", type=Path, help="SGLang, vLLM or kvfence startup logs")
    p.add_argument("--json", action="store_true", help="print the audit as JSON")
    p.set_defaults(func=cmd_audit)


def cmd_probe(args: argparse.Namespace) -> int:
    from kvfence.probe.calibrate import TargetError
    from kvfence.probe.client import Target, normalize_base_url
    from kvfence.probe.plan import MIN_REQUESTS
    from kvfence.probe.probe import ProbeConfig, run_probe

    problem = _probe_arg_problem(args, MIN_REQUESTS)
    if problem:
        print(f"kvfence probe: {problem}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    target = Target(
        normalize_base_url(args.base_url), args.model, args.key_a, args.key_b, args.chat, args.timeout
    )
    config = ProbeConfig(
        target,
        args.context_length,
        args.pool_tokens,
        args.requests,
        args.concurrency,
        args.max_duration,
        args.seed,
        progress=not args.no_progress,
        flood=args.flood,
    )
    try:
        report = run_probe(config)
    except TargetError as exc:
        print(f"kvfence probe: {exc}", file=sys.stderr)
        return 2
    print(report.summary(), flush=True)
    if args.report is not None:
        args.report.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report.exit_status


def _probe_arg_problem(args: argparse.Namespace, min_requests: int) -> str | None:
    if args.key_a == args.key_b:
        return "--key-a and --key-b must differ: the probe needs two tenants"
    if args.requests < min_requests:
        return f"--requests must be at least {min_requests} (the attack mix has that many kinds of request)"
    if args.concurrency < 1 or args.timeout <= 0 or args.max_duration <= 0:
        return "--concurrency, --timeout and --max-duration must be positive"
    if args.flood < 0 or args.flood == 1:
        return "--flood must be 0 (no load-timing check) or at least 2 (its light level is a quarter of it)"
    if args.context_length is not None and args.context_length < 64:
        return "--context-length below 64 leaves no room for the probe's prompts"
    if args.pool_tokens is not None and args.pool_tokens < 1:
        return "--pool-tokens must be positive"
    return None


def cmd_audit(args: argparse.Namespace) -> int:
    from kvfence.probe.audit import audit_files

    audit = audit_files(args.files)
    print(json.dumps(audit.to_json(), indent=2) if args.json else audit.summary())
    return audit.exit_status
