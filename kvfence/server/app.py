"""The FastAPI app: routes, authentication, body limits. `build_app(async_engine, settings) -> FastAPI`.

Boundary: HTTP in, HTTP out. Each route authenticates (the tenant comes from the API key, I7), reads the body
under a size limit (413 on Content-Length and again while reading), validates it (400 naming the parameter)
and hands it to `Serving`. A client that disconnects before its body is complete is counted as aborted. The
app's lifespan starts and stops the engine thread. With API keys configured, every route but /health and the
page itself needs a key.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/usage (the caller's own
tenant's counters), GET /health; and the operator routes, which a tenant's key never opens (403; `Operators` in
auth.py, docs/security.md): GET /metrics (its series name tenants: the admin key or the scrape key), GET /debug/kv
(the KV page map's data, kvfence/dashboard) and GET /debug/config (the effective configuration tree,
kvfence/config.py), both the admin key only. GET /dashboard, the page map's page, holds no data and needs no key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvfence.dashboard.routes import KvSource, add_dashboard_routes, local_kv_source
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.auth import Authenticator, Operators
from kvfence.server.errors import OpenAIError, install_handlers, invalid
from kvfence.server.metrics import CONTENT_TYPE, ServerMetrics
from kvfence.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    capacity,
    parse_body,
)
from kvfence.server.serving import ClusterControl, ServerSettings, Serving

M = TypeVar("M", bound=BaseModel)


def build_app(
    engine: AsyncEngine,
    settings: ServerSettings,
    metrics: ServerMetrics | None = None,
    *,
    kv_source: KvSource | None = None,
) -> FastAPI:
    """The app for one engine. `metrics` must be the engine's observer if the caller set one. `kv_source`: where
    the KV page map comes from (default: the local engine, between its steps)."""
    metrics = metrics or _observer_metrics(engine)
    auth = Authenticator(settings.api_keys)
    operators = Operators(settings.admin_key, settings.metrics_key, auth)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvfence", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    _generation_routes(app, Serving(engine, settings, metrics), auth, settings.max_body_bytes, metrics)
    _info_routes(app, engine, settings, auth, metrics)
    _operator_routes(app, engine, settings, operators, metrics)
    add_dashboard_routes(app, kv_source or local_kv_source(engine, settings.preflight), operators)
    return app


def _generation_routes(
    app: FastAPI, serving: Serving, auth: Authenticator, max_body_bytes: int, metrics: ServerMetrics
) -> None:
    async def handle(
        request: Request, model: type[M], endpoint: Callable[[M, Request, str], Awaitable[Response]]
    ) -> Response:
        tenant = "unauthenticated"
        try:
            tenant = auth.tenant(request.headers.get("authorization"))
            body = parse_body(await read_body(request, max_body_bytes), model)
        except OpenAIError as e:
            metrics.on_rejected("-", tenant, e.code or e.type, e.status)
            raise
        except ClientDisconnect:  # gone mid-body: an abort, not a server error
            metrics.on_client_gone(tenant)
            return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
        return await endpoint(body, request, tenant)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest, serving.chat)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await handle(request, TokenizeRequest, serving.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await handle(request, DetokenizeRequest, serving.detokenize)


def _info_routes(
    app: FastAPI, engine: AsyncEngine, settings: ServerSettings, auth: Authenticator, metrics: ServerMetrics
) -> None:
    created = int(time.time())

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        auth.tenant(request.headers.get("authorization"))
        card = {
            "id": settings.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvfence",
            "max_model_len": capacity(engine.engine.limits),
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict[str, Any]:
        """The caller's own tenant's counters, never another tenant's (docs/server.md)."""
        tenant = auth.tenant(request.headers.get("authorization"))
        snapshot = await engine.run_between_steps(engine.snapshot) if engine.healthy else None
        cache = snapshot.prefix_cache if snapshot is not None else None
        return {"object": "usage", "tenant": tenant, **metrics.usage_of(tenant, cache)}

    @app.get("/health")
    @app.get("/health/ready")
    async def ready() -> Response:
        """Readiness: 200 while a request could be served now; 503 with the reason (PD: no prefill/decode pair
        registered, e.g. while a dead worker restarts), so a load balancer sends traffic elsewhere."""
        reason = engine.unready()
        if reason is None:
            return JSONResponse({"status": "ok"})
        headers = {"Retry-After": str(settings.retry_after_s)}
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503, headers=headers)

    @app.get("/health/live")
    async def live() -> Response:
        """Liveness: 200 while the engine loop runs, even with no worker to serve (restart only a dead loop)."""
        if engine.healthy:
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "dead"}, status_code=503)


def _operator_routes(
    app: FastAPI, engine: AsyncEngine, settings: ServerSettings, operators: Operators, metrics: ServerMetrics
) -> None:
    """The routes a tenant's key never opens (GET /debug/kv is the dashboard's)."""

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        # the series name every tenant, with their request counts and prefix-cache hits
        operators.check_metrics(request.headers.get("authorization"))
        snapshot = await engine.run_between_steps(engine.snapshot) if engine.healthy else None
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE)

    @app.get("/cluster/status")
    async def cluster_status(request: Request) -> dict[str, Any]:
        """PD: the workers as placement sees them, and what the launcher supervises (`kvfence cluster status`)."""
        operators.check_cluster(request.headers.get("authorization"), "/cluster/status")
        return {"object": "cluster", "ready": engine.unready() is None, **_cluster(settings).status()}

    @app.post("/cluster/scale")
    async def cluster_scale(request: Request) -> dict[str, Any]:
        """PD: add workers, or drain the newest, to N prefill and M decode (`kvfence cluster scale`)."""
        operators.check_cluster(request.headers.get("authorization"), "/cluster/scale")
        cluster = _cluster(settings)
        body = parse_body(await read_body(request, settings.max_body_bytes), ScaleRequest)
        if cluster.scale is None:
            message = "this router does not launch its workers (`kvfence router`): start or stop them by hand"
            raise OpenAIError(409, message, code="not_supported")
        try:
            changed = await asyncio.to_thread(cluster.scale, body.prefill_workers, body.decode_workers)
        except ValueError as exc:
            raise invalid("prefill_workers", str(exc)) from exc
        return {"object": "cluster.scale", **changed}

    @app.get("/debug/config")
    async def debug_config(request: Request) -> dict[str, Any]:
        """The effective configuration (secrets left out), and in PD mode each worker's: admin key only."""
        operators.check_admin(request.headers.get("authorization"), "/debug/config")
        if settings.config_view is None:
            raise OpenAIError(404, "this server was built without a configuration view", code="not_found")
        return settings.config_view()


class ScaleRequest(BaseModel):
    model_config = {"extra": "forbid", "strict": True}  # "2" or true is not a worker count
    prefill_workers: int = Field(ge=1, le=64)
    decode_workers: int = Field(ge=1, le=64)


def _cluster(settings: ServerSettings) -> ClusterControl:
    if settings.cluster is None:
        raise OpenAIError(
            404, "this server is colocated: it has no cluster (kvfence serve --mode pd)", code="not_found"
        )
    return settings.cluster


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes: up front from Content-Length, and again while reading
    (chunked bodies, or a Content-Length that lies)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid(None, "invalid Content-Length header", code="invalid_request")
        if int(declared) > limit:
            raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


def _observer_metrics(engine: AsyncEngine) -> ServerMetrics:
    if isinstance(engine.observer, ServerMetrics):
        return engine.observer
    metrics = ServerMetrics()
    engine.observer = metrics
    return metrics
