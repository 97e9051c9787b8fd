"""`GET /dashboard` (the page) and `GET /debug/kv` (its data) on the HTTP front, colocated or PD router.

Boundary: HTTP only. The data comes from a `KvSource`: colocated, a `KvMapper` run on the engine thread between
two steps; PD, the router asking every worker (`Router.debug_kv`), each answering between its own steps.

Access: /debug/kv names tenants and shows prompt text, so it needs the admin key (`--admin-key`, sent as
`Authorization: Bearer KEY`; `Operators.check_admin` in kvfence/server/auth.py): a tenant's API key or the scrape key
gets 403, no key or an unknown one 401, and a server started without an admin key opens it to nobody. The page
holds no data and needs no key: it asks for the admin key and keeps it in the tab's sessionStorage, or takes it
from the URL fragment (`/dashboard#key=...`), which browsers never send to a server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvfence.dashboard.snapshot import SCHEMA_VERSION, KvMapper
from kvfence.engine.errors import EngineUnavailable
from kvfence.engine.preflight import PreflightReport
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.auth import Operators
from kvfence.server.errors import OpenAIError, unavailable

KvSource = Callable[[], Awaitable[dict[str, Any]]]
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PAGE_HEADERS = {
    # everything comes from kvfence itself: no CDN, no inline script, nothing loads from elsewhere
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def add_dashboard_routes(app: FastAPI, source: KvSource, operators: Operators) -> None:
    page = _static("dashboard.html")
    assets = {name: _static(name) for name in ASSETS}

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/dashboard/{name}")
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            raise OpenAIError(404, f"no dashboard asset {name!r}", code="not_found")
        return Response(assets[name], media_type=f"{ASSETS[name]}; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/debug/kv")
    async def debug_kv(request: Request) -> Response:
        operators.check_admin(request.headers.get("authorization"), "/debug/kv")
        return JSONResponse(await source(), headers={"Cache-Control": "no-store"})


def local_kv_source(engine: AsyncEngine, preflight: PreflightReport | None) -> KvSource:
    """The page map of the engine this server steps, taken on its engine thread between two steps. A PD
    router passes its own source (every worker's map, kvfence/runtime/pd.py)."""
    from kvfence.engine.llm_engine import LLMEngine

    local = engine.engine
    if not isinstance(local, LLMEngine):  # a front whose builder gave no source of its own has no page map
        return no_kv_source
    mapper = KvMapper(local, name="colocated", role="colocated", preflight=preflight)

    async def from_engine() -> dict[str, Any]:
        try:
            worker = await engine.run_between_steps(mapper.snapshot)
        except EngineUnavailable as e:
            raise unavailable(str(e)) from e
        return envelope("colocated", [worker], [])

    return from_engine


async def no_kv_source() -> dict[str, Any]:
    raise OpenAIError(
        404, "this server has no KV page map (no local engine, no source given)", code="not_found"
    )


def envelope(mode: str, workers: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    return {
        "version": SCHEMA_VERSION,
        "mode": mode,
        "time": time.time(),
        "workers": workers,
        "errors": errors,
    }


def _static(name: str) -> bytes:
    return (resources.files("kvfence.dashboard") / "static" / name).read_bytes()
