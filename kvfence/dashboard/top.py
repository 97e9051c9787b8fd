"""`kvfence top`: the KV page map in a terminal (rich), for hosts without a browser.

Boundary: a client of `GET /debug/kv` (colocated server or PD router) with the admin key, exactly like the
/dashboard page; it never talks to an engine. Each worker's pool is drawn as rows of cells; when the pool has
more pages than the screen has cells, one cell stands for a group of pages and shows the most telling state in
it (integrity failure > quarantined > receiving > sealed > leased > free), in its tenant's colour.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvfence.dashboard.snapshot import FREE, QUARANTINED, RECEIVING, SEALED, STATES, decode_pages

MAP_ROWS = 8  # at most this many lines of cells per worker
FAILED = len(STATES)  # a pseudo-state for cells holding a page an integrity check failed on
PRIORITY = np.array([0, 1, 4, 2, 3, 5])  # by state code (and FAILED last): what a group of pages shows
FIXED = {FREE: "grey42", QUARANTINED: "grey85", FAILED: "bold red"}
GLYPHS = {FREE: "·", QUARANTINED: "▪", FAILED: "✖"}


class TopError(RuntimeError):
    pass


def fetch(url: str, admin_key: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET {url}/debug/kv with the admin key. Raises TopError with a readable reason."""
    request = urllib.request.Request(
        url.rstrip("/") + "/debug/kv", headers={"Authorization": f"Bearer {admin_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            snapshot: dict[str, Any] = json.load(response)
            return snapshot
    except urllib.error.HTTPError as e:
        refused = e.code in (
            401,
            403,
        )  # 403: a key the server knows (a tenant's, the scrape key), not the admin key
        reason = "the admin key was refused (see --admin-key)" if refused else f"HTTP {e.code}"
        raise TopError(f"{url}/debug/kv: {reason}") from e
    except (urllib.error.URLError, OSError) as e:
        raise TopError(f"{url}/debug/kv: {e}") from e


class Hues:
    """Tenant -> colour, in order of first sight (the same golden-angle scheme as the page)."""

    def __init__(self) -> None:
        self._hues: dict[str, float] = {}

    def colour(self, tenant: str) -> str:
        if tenant not in self._hues:
            hue = (210 + len(self._hues) * 137.508) % 360
            self._hues[tenant] = (hue + 50) % 360 if hue < 25 or hue > 335 else hue
        r, g, b = colorsys.hls_to_rgb(self._hues[tenant] / 360, 0.55, 0.7)
        return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def render(snapshot: dict[str, Any], width: int, hues: Hues) -> RenderableType:
    workers = snapshot["workers"]
    for w in workers:  # hues in a stable order: sorted tenants of the first snapshot that shows them
        for tenant in sorted({r["tenant"] for r in w["requests"]}):
            hues.colour(tenant)
    title = f"kvfence top · {snapshot['mode']} · {len(workers)} worker(s) · {time.strftime('%H:%M:%S')}"
    parts: list[RenderableType] = [Text(title, style="bold")]
    parts += [Text(e, style="red") for e in snapshot.get("errors", [])]
    parts += [_worker_panel(w, width, hues) for w in workers]
    parts += [_requests(workers, hues), _transfers(workers), _failures(workers), _preflight(workers)]
    return Group(*parts)


def _worker_panel(w: dict[str, Any], width: int, hues: Hues) -> Panel:
    per_row = max(10, width - 4)  # inside the panel's border and padding
    cells, per_cell = _cells(w, decode_pages(w), per_row)
    group = "" if per_cell == 1 else f", 1 cell = {per_cell} pages"
    body = Text(f"{w['num_pages']} pages × {w['page_size']} tokens{group}\n", style="dim")
    body.append(_counts(w) + "\n", style="dim")
    for i, (state, request) in enumerate(cells):
        body.append(*_cell(w, state, request, hues))
        if (i + 1) % per_row == 0 and i + 1 < len(cells):
            body.append("\n")
    verdict = (w.get("preflight") or {}).get("verdict", "not reported")
    return Panel(body, title=f"{w['name']} ({w['role']}) · preflight {verdict}", title_align="left")


def _counts(w: dict[str, Any]) -> str:
    counts = [f"{s} {w['counts'][s]}" for s in STATES]
    counts[SEALED] += f" ({w['num_idle']} idle)" if w.get("num_idle") else ""
    return " · ".join(counts)


def _cell(w: dict[str, Any], state: int, request: int, hues: Hues) -> tuple[str, str]:
    """(glyph, style) of one cell: fixed for free, quarantined and failed pages, else the tenant's colour."""
    if state in FIXED:
        return GLYPHS[state], FIXED[state]
    if request < 0:  # held by no live request: an idle sealed page in the prefix cache
        return ("◇", "grey62") if state == SEALED else ("■", "white")
    return {SEALED: "◆", RECEIVING: "▒"}.get(state, "■"), hues.colour(w["requests"][request]["tenant"])


def _cells(
    w: dict[str, Any], pages: dict[str, npt.NDArray[Any]], width: int
) -> tuple[list[tuple[int, int]], int]:
    """(state, request index) per cell, and pages per cell: each cell shows its most telling page."""
    state = pages["state"].astype(np.int64)
    failed = [f["page"] for f in w["integrity_failures"] if f.get("page") is not None]
    state[np.asarray(failed, dtype=np.int64)] = FAILED
    n = len(state)
    per_cell = -(-n // (width * MAP_ROWS))
    padded = -(-n // per_cell) * per_cell
    state = np.pad(state, (0, padded - n), constant_values=FREE).reshape(-1, per_cell)
    request = np.pad(pages["request"], (0, padded - n), constant_values=-1).reshape(-1, per_cell)
    pick = PRIORITY[state].argmax(axis=1)
    rows = np.arange(len(state))
    return list(zip(state[rows, pick].tolist(), request[rows, pick].tolist(), strict=True)), per_cell


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", expand=True, show_edge=False)
    for c in columns:
        table.add_column(c, overflow="fold")
    return table


def _requests(workers: list[dict[str, Any]], hues: Hues) -> Table:
    table = _table("Requests in flight", "worker", "request", "tenant", "phase", "pages", "tokens", "prompt")
    for w in workers:
        for r in w["requests"]:
            tokens = f"{r['prompt_tokens']} + {r['output_tokens']}"
            tenant = Text(r["tenant"], style=hues.colour(r["tenant"]))
            table.add_row(w["name"], r["id"], tenant, r["phase"], str(r["num_pages"]), tokens, r["preview"])
    return table


def _transfers(workers: list[dict[str, Any]]) -> Table:
    table = _table("Transfers in flight", "worker", "transfer", "request", "frames received")
    for w in workers:
        for t in w["transfers"]:
            table.add_row(w["name"], t["transfer_id"], t["request_id"], f"{t['received']} / {t['expected']}")
    return table


def _failures(workers: list[dict[str, Any]]) -> Table:
    table = _table(
        "Integrity failures", "time", "worker", "request", "tenant", "page", "check", "expected", "found"
    )
    rows = sorted(
        ((f, w["name"]) for w in workers for f in w["integrity_failures"]), key=lambda x: -x[0]["time"]
    )
    for f, name in rows:
        page = "–" if f.get("page") is None else str(f["page"])
        when = time.strftime("%H:%M:%S", time.localtime(f["time"]))
        expected = f.get("expected_tag") or f.get("expected_digest") or "–"
        found = f.get("found_tag") or f.get("found_digest") or "–"
        table.add_row(
            when, name, f.get("request_id") or "–", f.get("tenant") or "–", page, _check(f), expected, found,
            style="red",
        )  # fmt: skip
    return table


def _check(failure: dict[str, Any]) -> str:
    kind = failure.get("kind")
    if kind == "transfer":
        return f"transfer: {failure.get('reason')}"
    if kind:
        return f"I1 {kind}"
    where = failure.get("where")  # a prefix-cache digest canary, or another check that names no request
    return str(failure.get("event", "failure")) + (f" ({where})" if where else "")


def _preflight(workers: list[dict[str, Any]]) -> Table:
    table = _table("Preflight (I6)", "worker", "verdict", "context", "pool", "full-context fits")
    for w in workers:
        p = w.get("preflight")
        if p is None:
            table.add_row(w["name"], "not reported", "", "", "")
            continue
        pool = f"{p['num_pages']} × {p['page_size']}"
        verdict = f"{p['verdict']}: {p['reason']}"
        context = f"{p['context_length']} (model {p['model_context_length']})"
        table.add_row(w["name"], verdict, context, pool, str(p["num_full_context_requests"]))
    return table


def add_top_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "top", help="the live KV page map in the terminal (polls /debug/kv with the admin key)"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server or PD router")
    p.add_argument(
        "--admin-key", default=os.environ.get("KVFENCE_ADMIN_KEY"), help="default: $KVFENCE_ADMIN_KEY"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots (at least 0.25)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    if not args.admin_key:
        print("kvfence top: needs --admin-key (or KVFENCE_ADMIN_KEY)", file=sys.stderr)
        return 2
    hues = Hues()
    try:
        if args.once:
            console.print(render(fetch(args.url, args.admin_key), console.width, hues))
            return 0
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                live.update(render(fetch(args.url, args.admin_key), console.width, hues), refresh=True)
                time.sleep(
                    max(0.25, args.interval)
                )  # the poll interval (a display loop, not synchronization)
    except TopError as e:
        print(f"kvfence top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
