"""`kvfence cluster status|scale`: a PD deployment's workers, pools and load, and its size at run time, through
the router's HTTP front (GET /cluster/status, POST /cluster/scale; the admin key where one is set).

kvfence cluster status [--url URL] [--admin-key KEY] [--json]
kvfence cluster scale --prefill-workers N --decode-workers M [--url URL] [--admin-key KEY]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


class ClusterError(Exception):
    pass


def add_cluster_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cluster", help="a PD deployment's workers and load, and scaling it (docs/scale-out.md)"
    )
    cs = p.add_subparsers(dest="cluster_command", required=True)
    for name, text in (("status", "workers, pools and load"), ("scale", "add workers, or drain the newest")):
        q = cs.add_parser(name, help=text)
        q.add_argument(
            "--url", default=DEFAULT_URL, help=f"the router's HTTP address (default {DEFAULT_URL})"
        )
        q.add_argument(
            "--admin-key",
            default=os.environ.get("KVFENCE_ADMIN_KEY"),
            help="the router's admin key (default: $KVFENCE_ADMIN_KEY)",
        )
        if name == "status":
            q.add_argument("--json", action="store_true", help="print the raw JSON")
        else:
            q.add_argument("--prefill-workers", type=int, required=True, metavar="N")
            q.add_argument("--decode-workers", type=int, required=True, metavar="M")
    p.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        if args.cluster_command == "status":
            status = call(args.url, "GET", "/cluster/status", args.admin_key)
            print(json.dumps(status, indent=2) if args.json else render(status))
        else:
            body = {"prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers}
            changed = call(args.url, "POST", "/cluster/scale", args.admin_key, body)
            print(
                f"added: {', '.join(changed['added']) or 'none'}; draining: {', '.join(changed['draining']) or 'none'}"
            )
    except ClusterError as exc:
        print(f"kvfence cluster {args.cluster_command}: {exc}", file=sys.stderr)
        return 1
    return 0


def call(url: str, method: str, path: str, admin_key: str | None, body: Any = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if admin_key:
        request.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ClusterError(f"{path}: HTTP {exc.code}: {message}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ClusterError(f"{url}: {exc}") from exc


def render(status: dict[str, Any]) -> str:
    """The status as a table: one line per registered worker, then the launcher's slots."""
    lines = [f"ready: {'yes' if status.get('ready') else 'NO (no prefill/decode pair can serve)'}"]
    header = f"{'role':8} {'name':12} {'pid':>7} {'state':9} {'pool':>6} {'free':>6} {'in flight':>9} {'waiting':>7}"
    lines += ["", "registered workers", header]
    for w in sorted(status.get("workers", []), key=lambda w: (w["role"] != "prefill", w["name"] or "")):
        lines.append(
            f"{w['role']:8} {w['name'] or '-':12} {w['pid'] or '-':>7} {w['state']:9} {w['pool_pages']:>6} "
            f"{_dash(w['pool_free']):>6} {w['in_flight']:>9} {_dash(w['waiting']):>7}"
        )
    supervised = status.get("supervised")
    if supervised is None:
        lines += ["", "workers are started by hand (kvfence router): nothing here restarts them"]
    else:
        lines += [
            "",
            "supervised",
            f"{'role':8} {'name':12} {'pid':>7} {'state':11} {'restarts':>8} {'where':>10}",
        ]
        for s in supervised:
            lines.append(
                f"{s['role']:8} {s['name']:12} {_dash(s['pid']):>7} {s['state']:11} {s['restarts']:>8} "
                f"{s.get('node') or 'this host':>10}"
            )
    return "\n".join(lines)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)
