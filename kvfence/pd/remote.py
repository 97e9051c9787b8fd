"""`RemoteEngine`: the PD router seen through the engine interface the HTTP server already drives.

Boundary: adapts `Router` (ZeroMQ, workers) to the handful of `LLMEngine` members that `AsyncEngine` and the
HTTP layer uses (the `Engine` protocol, kvfence/engine/protocol.py), so the router's
HTTP front is the colocated server unchanged: same API, same errors, same admission code path (I5), against
the smallest context any worker holds (I6) and the largest pool a pair offers; the router then places each
request only on workers whose pools hold it. `step()` waits briefly for outputs from the
decode workers instead of computing anything.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfence.engine.admission import Limits
from kvfence.engine.errors import EngineUnavailable
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.engine.stats import EngineSnapshot, EngineStats
from kvfence.kv.pool import PoolStats
from kvfence.model.tokenizer import Tokenizer
from kvfence.pd.router import NoWorkers, Router
from kvfence.pd.router_core import WorkerInfo

STEP_WAIT_S = 0.05
REGISTRATION_REFUSALS = (
    "role_not_allowed",
    "key_in_use",
    "duplicate_registration",
    "fingerprint_mismatch",
    "malformed_fingerprint",
    "malformed_data_addr",
    "tenant_shares",
)


@dataclass(frozen=True, slots=True)
class RemoteRequest:
    request_id: str
    tenant: str
    num_pages_checked: int = 0  # checked on the decode worker; the router does not see pages


class RemoteEngine:
    def __init__(self, router: Router, tokenizer: Tokenizer) -> None:
        self.router = router
        self.tokenizer = tokenizer
        prefill, decode = router.limits()
        self._limits = Limits(
            prefill.context_length, min(prefill.pool_pages, decode.pool_pages), decode.page_size
        )
        self.context_length = prefill.context_length
        vocab = {w.fingerprint["vocab_size"] for w in router.workers.values()}
        self.vocab_size: int = vocab.pop()
        self.num_waiting = 0  # requests wait in the workers' queues, not here
        self.stats = EngineStats()
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._live: set[str] = set()
        self._lock = threading.Lock()

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str, tenant: str = "anonymous"
    ) -> RemoteRequest:
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live.add(request_id)
        try:
            self.router.submit(list(prompt), params, request_id, tenant, self._outputs.put)
        except NoWorkers as exc:
            with self._lock:
                self._live.discard(request_id)
            raise EngineUnavailable(str(exc)) from exc
        except BaseException:
            with self._lock:
                self._live.discard(request_id)
            raise
        return RemoteRequest(request_id, tenant)

    def abort(self, request_id: str) -> None:
        self.router.abort(request_id)

    def debug_kv(self, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
        """Every worker's KV page map (kvfence/dashboard); see `Router.debug_kv`."""
        return self.router.debug_kv(timeout)

    def snapshot(self) -> EngineSnapshot:
        """The router's own view for /metrics: it holds no KV pages (the workers' pools are in their heartbeats,
        `WorkersCollector`), so its pool shows as empty rather than invented."""
        return EngineSnapshot(
            num_running=0,  # requests run (and wait) on the workers
            num_waiting=0,
            pool=PoolStats(num_pages=0, num_free=0, num_leased=0, num_quarantined=0, num_held=0),
            integrity_checks=0,
            integrity_failures=0,
            pages_checked=0,
            outcomes=dict(self.stats.outcomes),
        )

    def unready(self) -> str | None:
        """None while some prefill/decode pair can serve; else why not (GET /health answers 503 with it)."""
        return None if self.router.ready() else "no prefill/decode worker pair is registered"

    @property
    def limits(self) -> Limits:
        """One Limits for the HTTP layer's defaults and first check: the smallest context, and the largest pool
        any prefill/decode pair offers now (the router's own admission checks each role, and placement each
        worker). The last known value while no pair is registered (requests then get 503)."""
        try:
            prefill, decode = self.router.limits()
        except NoWorkers:
            return self._limits
        self._limits = Limits(
            prefill.context_length, min(prefill.pool_pages, decode.pool_pages), decode.page_size
        )
        return self._limits

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    def step(self) -> list[RequestOutput]:
        """Outputs that arrived from the workers; waits up to STEP_WAIT_S for the first one. Raises if the
        router's I/O thread died: the engine loop then fails every request and liveness turns 503."""
        if not self.router.alive():
            raise EngineUnavailable("the router's I/O thread stopped")
        try:
            outputs = [self._outputs.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                outputs.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
                    self.stats.count((out.error_code and f"failed:{out.error_code}") or "finished")
        return outputs


class WorkersCollector(Collector):
    """The router's /metrics view of its workers, from their latest heartbeats (at most `HEARTBEAT_S` old):
    KV pool pages by state and integrity failures, labelled by role and worker (role-pid); and the control
    messages the router dropped (malformed, unknown op, unexpected), by reason."""

    def __init__(
        self, router: Router, supervised: Callable[[], list[dict[str, Any]] | None] = lambda: None
    ) -> None:
        """`supervised`: the launcher's worker slots (`Supervisor.status`), None for workers started by hand."""
        self.router = router
        self.supervised = supervised

    def collect(self) -> Iterator[Metric]:
        workers = GaugeMetricFamily("kvfence_workers", "Registered PD workers", labels=["role"])
        pages = GaugeMetricFamily("kvfence_worker_kv_pages", "Worker KV pool pages by state",
                                  labels=["role", "worker", "state"])  # fmt: skip
        total = GaugeMetricFamily("kvfence_worker_kv_pages_total", "Worker KV pool size in pages",
                                  labels=["role", "worker"])  # fmt: skip
        failures = CounterMetricFamily("kvfence_worker_integrity_failures", "Requests failed by an I1 check on "
                                       "the worker", labels=["role", "worker"])  # fmt: skip
        requests = GaugeMetricFamily("kvfence_worker_requests", "Requests on each worker's scheduler (its last "
                                     "heartbeat), by state", labels=["role", "worker", "state"])  # fmt: skip
        live = list(self.router.workers.values())
        for role in ("prefill", "decode"):
            workers.add_metric([role], sum(w.role == role for w in live))
        for w in live:
            name, pool = f"{w.role}-{w.pid}", w.health.get("pool")
            if pool is None:
                continue  # no heartbeat yet
            cached = pool.get("num_cached", 0)
            for state, value in (("free", pool["num_free"] - cached), ("leased", pool["num_leased"]),
                                 ("quarantined", pool["num_quarantined"]), ("sealed", pool.get("num_sealed", 0)),
                                 ("cached", cached)):  # fmt: skip
                pages.add_metric([w.role, name, state], value)
            total.add_metric([w.role, name], pool["num_pages"])
            failures.add_metric([w.role, name], w.health.get("integrity_failures", 0))
            requests.add_metric([w.role, name, "running"], w.health.get("num_running", 0))
            requests.add_metric([w.role, name, "waiting"], w.num_waiting or 0)
        yield from _worker_tenant_metrics(live)
        dropped = CounterMetricFamily("kvfence_router_control_dropped", "Control messages from workers the router "
                                      "dropped, by reason (malformed, unknown op, unexpected; and what the I10 "
                                      "binding refused: not_placed_here, unregistered, ...)",
                                      labels=["reason"])  # fmt: skip
        refused = dict(self.router.refused)
        registrations = {r: refused.pop(r) for r in list(refused) if r in REGISTRATION_REFUSALS}
        for reason, count in {**self.router.control.counts(), **refused}.items():
            dropped.add_metric([reason], count)
        regs = CounterMetricFamily("kvfence_router_registrations_refused", "Worker registrations the router "
                                   "refused, by reason", labels=["reason"])  # fmt: skip
        for reason in REGISTRATION_REFUSALS:
            regs.add_metric([reason], registrations.get(reason, 0))
        handshakes = CounterMetricFamily("kvfence_cluster_handshakes_refused", "Connections refused at the "
                                         "handshake (CURVE): protocol = no CURVE or a wrong server key, auth = a key "
                                         "not in the allowlist", labels=["plane", "worker", "kind"])  # fmt: skip
        for kind, count in self.router.connection_counts().items():
            handshakes.add_metric(["control", "router", kind], count)
        worker_refused = CounterMetricFamily("kvfence_worker_refused", "What a worker refused under I10 (tickets "
                                             "from a decode worker the router did not name), by reason",
                                             labels=["role", "worker", "reason"])  # fmt: skip
        for w in live:
            for reason, count in (w.health.get("refused") or {}).items():
                if reason.startswith("handshake_"):
                    handshakes.add_metric(["data", f"{w.role}-{w.pid}", reason[10:]], count)
                else:
                    worker_refused.add_metric([w.role, f"{w.role}-{w.pid}", reason], count)
        ready = GaugeMetricFamily("kvfence_cluster_ready", "1 while a prefill/decode pair can take requests "
                                  "(what GET /health answers)")  # fmt: skip
        ready.add_metric([], float(self.router.ready()))
        yield from (
            workers,
            pages,
            total,
            failures,
            requests,
            dropped,
            regs,
            handshakes,
            worker_refused,
            ready,
        )
        slots = self.supervised()
        if slots is not None:
            restarts = CounterMetricFamily("kvfence_cluster_worker_restarts", "Restarts of each supervised worker "
                                           "(serve --mode pd; on Ray, Ray restarts them)",
                                           labels=["role", "name"])  # fmt: skip
            states = GaugeMetricFamily("kvfence_cluster_supervised_workers", "Supervised workers by state "
                                       "(given_up: a crash loop the supervisor stopped restarting)",
                                       labels=["role", "state"])  # fmt: skip
            counts: dict[tuple[str, str], int] = {}
            for s in slots:
                restarts.add_metric([s["role"], s["name"]], s["restarts"])
                counts[(s["role"], s["state"])] = counts.get((s["role"], s["state"]), 0) + 1
            for (role, state), n in sorted(counts.items()):
                states.add_metric([role, state], n)
            yield from (restarts, states)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _worker_tenant_metrics(live: list[WorkerInfo]) -> Iterator[Metric]:
    """Per tenant on each worker, from its latest heartbeat: what the colocated server's kvfence_tenant_* say."""
    labels = ["role", "worker", "tenant"]
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "pages": GaugeMetricFamily("kvfence_worker_tenant_kv_pages", "KV pages a tenant holds on the worker "
                                   "(running requests, and transfers: prefilled pages, decode reservations)",
                                   labels=labels),
        "running": GaugeMetricFamily("kvfence_worker_tenant_requests_running", "A tenant's requests in the "
                                     "worker's running batch", labels=labels),
        "waiting": GaugeMetricFamily("kvfence_worker_tenant_requests_waiting", "A tenant's requests waiting on "
                                     "the worker (its queue; a decode worker's queue for pages too)", labels=labels),
        "virtual_tokens": CounterMetricFamily("kvfence_worker_tenant_virtual_tokens", "A tenant's virtual token "
                                              "counter on the worker (docs/fairness.md)", labels=labels),
    }  # fmt: skip
    for w in live:
        for tenant, numbers in sorted((w.health.get("tenants") or {}).items()):
            for key, family in families.items():
                family.add_metric([w.role, f"{w.role}-{w.pid}", tenant], numbers[key])
    yield from families.values()
