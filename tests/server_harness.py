"""Start the real app with uvicorn on port 0 in a background thread, for server tests. Not a test module."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import openai

from kvfence.kv.pool import PoolStats
from kvfence.model.loader import LoadedModel
from kvfence.server.app import build_app
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.background import serve_in_thread
from kvfence.server.metrics import ServerMetrics
from kvfence.server.serving import ServerSettings
from kvfence.server.tenants import TenantLimits
from tests.conftest import make_engine

T = TypeVar("T")
MODEL = "tiny"
TIMEOUT = 60.0


@dataclass
class Handle:
    url: str
    engine: AsyncEngine
    metrics: ServerMetrics

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, api_key: str = "none", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=TIMEOUT, **kw)

    def between_steps(self, fn: Callable[[], T]) -> T:
        return self.engine.call_between_steps(fn, timeout=TIMEOUT)

    def wait_idle(self) -> None:
        assert self.engine.wait_idle(TIMEOUT), "engine did not become idle"

    def pool_stats(self) -> PoolStats:
        return self.between_steps(self.engine.engine.pool.stats)

    def assert_pool_clean(self) -> None:
        """Idle, integrity holds, and every page is back on the free list."""
        self.wait_idle()
        self.between_steps(self.engine.engine.check_integrity)
        stats = self.pool_stats()
        assert stats.num_free == stats.num_pages, f"pages leaked: {stats}"

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


SCRAPE_KEY = "scrape-key"  # the operator credential that opens /metrics on test servers


@contextmanager
def running_server(
    loaded: LoadedModel,
    *,
    api_keys: dict[str, str] | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = 4 << 20,
    admin_key: str | None = None,
    metrics_key: str | None = SCRAPE_KEY,
    tenant_limits: Mapping[str, TenantLimits] | None = None,
    **engine_overrides: Any,
) -> Iterator[Handle]:
    metrics = ServerMetrics()
    llm = make_engine(loaded, **engine_overrides)
    engine = AsyncEngine(llm, max_queue=max_queue, observer=metrics)
    settings = ServerSettings(
        MODEL,
        api_keys=api_keys,
        tenant_limits=tenant_limits,
        max_body_bytes=max_body_bytes,
        admin_key=admin_key,
        metrics_key=metrics_key,
        config_view=lambda: {"mode": "colocated", "config": llm.config.to_dict(public=True)},
    )
    with serve_in_thread(build_app(engine, settings, metrics), timeout=TIMEOUT) as url:
        yield Handle(url, engine, metrics)
