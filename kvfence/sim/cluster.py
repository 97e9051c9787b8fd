"""A deterministic simulation of a PD cluster running the real code.

The router is the real `RouterCore`; each worker is a real `PrefillRole` or `DecodeRole` around a real
`LLMEngine` (scheduler, page pool, I1 checks, prefix cache off) whose model runner is the provenance runner
(kvfence/sim/runner.py). Only the outside world is simulated, on one seeded event queue and a simulated clock:

- the network: control messages (router <-> workers) are reliable and FIFO per link, as over ZeroMQ/TCP, but
  delayed; data messages (tickets, frames, acks, finals, aborts) can be dropped, duplicated, delayed and
  reordered; everything goes through the real wire encodings (`control.encode`, `wire.encode`);
- time: engine steps, heartbeats, timeouts and the router's dead-worker reaping run on the simulated clock;
- clients: two tenants submit requests (admission is the router's) and abort some at random moments;
- failures: workers crash (their messages in flight still arrive; nothing reaches them any more) and new ones
  join; the fault knobs of kvfence/faults.py can be armed on every worker and the router.

After every event the simulator checks the invariants on the real data structures (`Violation`): every live
worker's pool, engine and receiver integrity (`Role.check_integrity`: pages in exactly one state, leased pages
held by exactly their leaseholders, reservations intact); no read of foreign or unwritten K/V (the provenance
oracle); every output is a prefix of the request's exact expected tokens, and an error carries no tokens (fail
closed). At the end (quiescence) every request has ended exactly once, every live pool is whole, and no
transfer, sender or routed request is left behind (liveness).

Event names in the trace follow the Promela model (verify/transfer.pml): `net_recv` (delivery), `engine_step`,
`rx_timeout`/`tx_timeout` (a worker's tick), `client_submit`, `client_abort`, `crash`, `restart`, `heartbeat`,
`router_reap`.

Modules: scenario.py (the configuration drawn from a seed, the clients), nodes.py (the router and workers, with
this simulation as their transport), runner.py (the provenance runner), trace_check.py (the page-event oracle).
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

from kvfence import trace
from kvfence.engine.errors import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.pd import control, wire
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import PageFrame, Ticket
from kvfence.pd.router_core import NoWorkers
from kvfence.sim.nodes import P_INTERRUPT, ROUTER, VOCAB, Crash, SimRouter, SimWorker, make_engine, node_of
from kvfence.sim.runner import expected_token
from kvfence.sim.scenario import BOOKKEEPING_KNOBS, Client, SimConfig
from kvfence.sim.trace_check import TraceChecker

STEP_S = (0.002, 0.02)  # simulated time between two steps of one worker
HEARTBEAT_S = 0.5
REAP_S = 0.25


class Violation(AssertionError):
    """An invariant failed; the message says which, and the trace says how."""


class Simulation:
    def __init__(self, cfg: SimConfig, record: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.time = 0.0
        self._queue: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._link_free: dict[tuple[str, str], float] = {}  # control links are FIFO: next free delivery time
        self._record = record
        self.events = 0
        self.faults_spec = cfg.faults
        self.tracer = TraceChecker()
        self.safety_only = cfg.checks and any(k in cfg.faults for k in BOOKKEEPING_KNOBS)
        self.router = SimRouter(self, cfg.dead_after_s, self._faults(), tid_prefix=cfg.seed % (1 << 24))
        self.workers: dict[str, SimWorker] = {}
        self._names = itertools.count()
        self._lease_prefixes = itertools.count(1)
        self.clients: dict[str, Client] = {}
        # transfer id -> the decode workers the router named for it (I10; several only under reuse_transfer_id)
        self._named: dict[int, set[str]] = {}
        self.rogue: str | None = None  # cfg.rogue: the compromised decode worker's name
        # (worker, request id) in the order each worker started a request: a prefill's first computation for it,
        # a decode's reservation (its ticket). The workers' scheduling decisions, for the fairness tests.
        self.started: list[tuple[str, str]] = []
        self._seen_started: set[tuple[str, str]] = set()
        self.peak_held: dict[
            tuple[str, str], int
        ] = {}  # (worker kind, tenant) -> the most pages it held at once
        for _ in range(cfg.num_prefill):
            self.start_worker("prefill")
        for _ in range(cfg.num_decode):
            worker = self.start_worker("decode")
            if cfg.rogue and self.rogue is None:
                self.rogue = worker.name
        self._schedule(REAP_S, "router_reap", ())
        self._plan_clients()

    # ---- setup ---------------------------------------------------------------------------------------

    def now(self) -> float:
        return self.time

    def _faults(self) -> Faults:
        if not self.faults_spec:
            return Faults()
        faults = Faults()
        for item in self.faults_spec.split(","):
            name, _, count = item.partition("=")
            setattr(faults, name, int(count or 1))
        return faults

    def start_worker(self, kind: str) -> SimWorker:
        name = f"{kind}{next(self._names)}"
        pages = self.cfg.prefill_pages if kind == "prefill" else self.cfg.decode_pages
        engine, runner = make_engine(self.cfg, pages, self._faults(), next(self._lease_prefixes))
        if self.cfg.interrupts and kind == "prefill":  # as if a newcomer's request were waiting, at random
            draw = random.Random(f"{self.cfg.seed}/{name}")
            engine.arrivals = lambda: [f"newcomer-{draw.random()}"] if draw.random() < P_INTERRUPT else []
        worker = SimWorker(name, kind, self, engine, runner)
        self.workers[name] = worker
        worker.register()
        self._schedule(self.rng.uniform(*STEP_S), "engine_step", (name,))
        self._schedule(HEARTBEAT_S, "heartbeat", (name,))
        return worker

    def _plan_clients(self) -> None:
        cfg, rng = self.cfg, self.rng
        flooders = (2 * cfg.num_requests) // 3  # cfg.flood: tenant-a's, all submitted before tenant-b's
        for i in range(cfg.num_requests):
            tenant = "tenant-a" if (i < flooders if cfg.flood else i % 2 == 0) else "tenant-b"
            rid = f"s{cfg.seed}-r{i}"
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, cfg.max_prompt))]
            self.clients[rid] = Client(rid, tenant, prompt, rng.randint(1, cfg.max_tokens))
            at = rng.uniform(0.05, cfg.submit_until_s)
            if cfg.flood:
                at = 0.05 + i * 0.001
            self._schedule(at, "client_submit", (rid,))
            if rng.random() < cfg.p_abort:
                self._schedule(at + rng.uniform(0.0, 0.3), "client_abort", (rid,))
        for _ in range(cfg.crashes):
            at = rng.uniform(0.1, cfg.submit_until_s + 0.5)
            self._schedule(at, "crash", (rng.choice(["prefill", "decode"]),))

    # ---- the network -----------------------------------------------------------------------------------

    def send_control(self, src: str, dst: str, packed: bytes) -> None:
        at = max(self.time + self.rng.uniform(0.0001, 0.002), self._link_free.get((src, dst), 0.0))
        self._link_free[(src, dst)] = at
        self._schedule_at(at, "net_recv", ("control", src, dst, packed))

    def send_data(self, src: str, dst: str, frames: list[bytes]) -> None:
        cfg, rng = self.cfg, self.rng
        if rng.random() < cfg.p_drop:
            self.trace("net_drop", src=src, dst=dst)
            return
        for _ in range(2 if rng.random() < cfg.p_dup else 1):
            self._schedule(rng.uniform(0.0, cfg.max_delay_s), "net_recv", ("data", src, dst, list(frames)))

    # ---- the event loop --------------------------------------------------------------------------------

    def _schedule(self, delay: float, kind: str, args: tuple[Any, ...]) -> None:
        self._schedule_at(self.time + delay, kind, args)

    def _schedule_at(self, at: float, kind: str, args: tuple[Any, ...]) -> None:
        heapq.heappush(self._queue, (at, next(self._seq), kind, args))

    def trace(self, ev: str, **fields_: Any) -> None:
        if self._record is not None:
            self._record({"t": round(self.time, 6), "ev": ev, **fields_})

    def run(self) -> None:
        """Run to the horizon, checking the invariants after every event; then check quiescence. The real
        code's page events (kvfence/trace.py) go through the trace checker as they happen: a second oracle."""
        trace.install(self._on_page_event)
        try:
            while self._queue and self._queue[0][0] <= self.cfg.horizon_s:
                at, _, kind, args = heapq.heappop(self._queue)
                self.time = at
                self.events += 1
                touched = self._dispatch(kind, args)
                if touched is not None:
                    self.check_invariants(kind, touched)
                if self.time > self.cfg.submit_until_s and self.quiescent():
                    break
        finally:
            trace.install(None)
        self.check_quiescence()

    def _on_page_event(self, event: dict[str, Any]) -> None:
        self.tracer.feed(event)
        if event["ev"] == "read" and event["node"].startswith("prefill"):
            self.note_start(event["node"], event["request_id"])
        if self._record is not None:
            self._record({"t": round(self.time, 6), **event})

    def note_start(self, node: str, request_id: str) -> None:
        """`node` started `request_id` (its first step for it): recorded once, in order."""
        if (node, request_id) not in self._seen_started:
            self._seen_started.add((node, request_id))
            self.started.append((node, request_id))

    def _dispatch(self, kind: str, args: tuple[Any, ...]) -> SimWorker | None:
        """Run one event; return the worker whose state it may have changed (None: only the router's)."""
        if kind == "net_recv":
            return self._deliver(*args)
        if kind == "engine_step":
            return self._step(args[0])
        if kind == "restart":
            self.trace("restart", kind=args[0])
            return self.start_worker(args[0])
        if kind == "heartbeat":
            worker = self.workers.get(args[0])
            if worker is not None and worker.alive:
                beat = control.Heartbeat(worker.name.encode().hex(), pool_free=worker.engine.pool.num_free)
                worker.send_control(beat)
                self._schedule(HEARTBEAT_S, "heartbeat", (worker.name,))
        elif kind == "router_reap":
            self.trace("router_reap")
            self.router.reap_dead_workers()
            self._schedule(REAP_S, "router_reap", ())
        elif kind == "client_submit":
            self._submit(args[0])
        elif kind == "client_abort":
            self.trace("client_abort", request_id=args[0])
            self.router.cancel(RequestId(args[0]))
        elif kind == "crash":
            live = [w for w in self.workers.values() if w.alive and w.kind == args[0]]
            if live:
                self._crash(self.rng.choice(live), "crash")
        return None

    def _guarded(self, worker: SimWorker, fn: Callable[[], object]) -> None:
        trace.node = worker.name  # the page events that follow are this worker's
        try:
            fn()
        except Crash as exc:
            self._crash(worker, str(exc))

    def _crash(self, worker: SimWorker, why: str) -> None:
        self.trace("crash", node=worker.name, why=why)
        worker.alive = False
        self._schedule(self.rng.uniform(0.2, 1.0), "restart", (worker.kind,))

    def _deliver(self, plane: str, src: str, dst: str, payload: Any) -> SimWorker | None:
        if dst == ROUTER:
            msg = self.router.control.decode(payload)
            self.trace("net_recv", plane=plane, src=src, dst=dst, op=msg.op if msg else None)
            if msg is not None:
                self.router.on_message(src.encode(), msg, src)  # the network names senders truthfully
            return None
        worker = self.workers.get(dst)
        if worker is None or not worker.alive:
            self.trace("net_lost", plane=plane, src=src, dst=dst)
            return None
        if plane == "control":
            msg = worker.role.control.decode(payload)
            if isinstance(msg, control.Expect):
                self._named.setdefault(msg.transfer_id, set()).add(dst)
                if self.rogue is not None and dst != self.rogue:
                    self._rogue_acts(msg)
            rid = (
                msg.request_id
                if isinstance(msg, control.Prefill | control.Expect | control.AbortRequest)
                else None
            )
            self.trace("net_recv", plane=plane, src=src, dst=dst, op=msg.op if msg else None, request_id=rid)
            if msg is not None:
                self._guarded(worker, lambda: worker.role.control(msg))
        else:
            message = wire.decode(payload)
            named = self._named.get(message.transfer_id)
            if isinstance(message, PageFrame) and named is not None and dst not in named:
                raise Violation(
                    f"I10: a page of transfer {message.transfer_id} went to {dst}, not to {named}"
                )
            self.trace("net_recv", plane=plane, src=src, dst=dst, msg=type(message).__name__,
                       tid=message.transfer_id, index=getattr(message, "index", None))  # fmt: skip
            self._guarded(worker, lambda: worker.role.on_message(src, message))
        return worker

    def _rogue_acts(self, expect: control.Expect) -> None:
        """The compromised member, for a request placed on another decode worker: a forged final output (a
        token that is not the request's) to the router, and its own ticket for the transfer to the prefill."""
        rogue, rid = self.rogue, expect.request_id
        assert rogue is not None
        if not self.workers[rogue].alive:
            return
        n = len(expect.prompt_ids)
        wrong = (expected_token(rid, n, VOCAB) + 1) % VOCAB
        forged = RequestOutput(rid, (wrong,), "", True, "stop", None, n, 1, "", (wrong,))
        self.trace("rogue", request_id=rid, tid=expect.transfer_id)
        self.send_control(rogue, ROUTER, control.encode(control.Output(forged)))
        engine = self.workers[rogue].engine
        pages = engine.pool.pages_for(n)
        ticket = Ticket(expect.transfer_id, rid, tuple(PageId(i) for i in range(pages)),
                        tuple(LeaseId(1) for _ in range(pages)), layout_fingerprint(engine))  # fmt: skip
        self.send_data(rogue, node_of(expect.prefill_addr), wire.encode(ticket))

    def _step(self, name: str) -> SimWorker | None:
        worker = self.workers[name]
        if not worker.alive:
            return None
        self._schedule(self.rng.uniform(*STEP_S), "engine_step", (name,))
        role = worker.role
        if not worker.engine.has_unfinished() and not role.pending():
            return None  # nothing to step, nothing that can time out
        self.trace("engine_step", node=name)
        self._guarded(worker, role.step)
        if worker.alive:
            self._guarded(worker, role.on_tick)
        return worker

    def _submit(self, rid: str) -> None:
        client = self.clients[rid]
        params = SamplingParams(max_tokens=client.max_tokens, temperature=0.0)
        self.trace("client_submit", request_id=rid, tenant=client.tenant, prompt_len=len(client.prompt))
        try:
            self.router.admit(len(client.prompt), params, client.tenant)
        except (AdmissionError, NoWorkers) as exc:
            client.rejected = type(exc).__name__
            return
        self.router.route(list(client.prompt), params, RequestId(rid), client.tenant, self._on_output)

    def _on_output(self, out: RequestOutput) -> None:
        client = self.clients[out.request_id]
        if client.ended:
            raise Violation(f"{out.request_id}: output after the request ended: {out}")
        client.outputs.append(out)
        self.trace("client_output", request_id=out.request_id, finished=out.finished,
                   error=out.error_code, tokens=list(out.new_token_ids))  # fmt: skip
        want = [
            expected_token(out.request_id, len(client.prompt) + i, VOCAB) for i in range(len(out.token_ids))
        ]
        if list(out.token_ids) != want:  # never a token that is not the request's own (fail closed)
            raise Violation(f"OUT: {out.request_id} got tokens {list(out.token_ids)}, expected {want}")

    # ---- invariants ------------------------------------------------------------------------------------

    def live_workers(self) -> Iterator[SimWorker]:
        return (w for w in self.workers.values() if w.alive)

    def check_invariants(self, after: str, worker: SimWorker) -> None:
        """The invariants of the one worker an event touched (the others did not change)."""
        violations = self.tracer.report.violations
        if violations and not self.safety_only:
            raise Violation(f"trace (after {after}): {violations[0]}")
        if worker.alive:
            if worker.runner.foreign_reads:
                raise Violation(f"I1 (after {after}) on {worker.name}: {worker.runner.foreign_reads[0]}")
            if self.safety_only:
                return
            try:
                worker.role.check_integrity()
            except AssertionError as exc:
                raise Violation(f"integrity (after {after}) on {worker.name}: {exc}") from exc
            self._check_caps(after, worker)

    def _check_caps(self, after: str, worker: SimWorker) -> None:
        """Fairness: no tenant holds more pages on a worker than its max_pages (running requests, requests
        whose pages await a transfer, decode reservations)."""
        fairness = worker.engine.scheduler.fairness
        held = worker.engine.scheduler.held_pages()
        for tenant, pages in held.items():
            key = (worker.kind, tenant)
            self.peak_held[key] = max(self.peak_held.get(key, 0), pages)
            cap = fairness.share(tenant).max_pages
            if fairness.enabled and cap is not None and pages > cap:
                raise Violation(f"fairness (after {after}) on {worker.name}: {tenant} holds {pages} > {cap}")

    def quiescent(self) -> bool:
        """Every request ended and every live worker idle (called once all submissions are past)."""
        ended = all(c.ended for c in self.clients.values())
        return ended and (self.safety_only or all(self._idle(w) for w in self.live_workers()))

    def _idle(self, worker: SimWorker) -> bool:
        role, engine = worker.role, worker.engine
        if engine.has_unfinished() or engine.pool.num_free != engine.pool.num_pages:
            return False
        rx = role.receiver()
        return not role.pending() and (rx is None or rx.num_active == 0)

    def check_quiescence(self) -> None:
        stuck = [c.request_id for c in self.clients.values() if not c.ended]
        if stuck:
            raise Violation(f"liveness: requests never ended by t={self.time:.2f}: {stuck}")
        if self.safety_only:
            return
        for worker in self.live_workers():
            if not self._idle(worker):
                pool = worker.engine.pool.stats()
                raise Violation(
                    f"liveness: {worker.name} not idle at the end: {pool}, {self._leftovers(worker)}"
                )
        if self.router._routed:
            raise Violation(f"liveness: the router still routes {sorted(self.router._routed)}")

    def _leftovers(self, worker: SimWorker) -> str:
        rx = worker.role.receiver()
        return f"pending={worker.role.pending()} active={rx.num_active if rx is not None else '-'}"

    def summary(self) -> dict[str, Any]:
        outcomes: dict[str, int] = {}
        for c in self.clients.values():
            key = c.rejected or next(
                (o.error_code or o.finish_reason or "?" for o in c.outputs if o.finished), "none"
            )
            outcomes[key] = outcomes.get(key, 0) + 1
        return {
            "seed": self.cfg.seed,
            "events": self.events,
            "time": round(self.time, 3),
            "outcomes": outcomes,
            "interrupted": sum(w.engine.stats.steps_interrupted for w in self.workers.values()),
        }


def run_seed(
    seed: int, record: Callable[[dict[str, Any]], None] | None = None, **overrides: Any
) -> dict[str, Any]:
    """Run one seeded scenario; raises Violation. Returns a summary."""
    sim = Simulation(SimConfig.from_seed(seed, **overrides), record)
    sim.run()
    return sim.summary()


def replay_command(seed: int, **overrides: Any) -> str:
    extra = "".join(f" --set {k}={json.dumps(v)}" for k, v in overrides.items())
    return f"python -m kvfence.sim --seed {seed}{extra} --trace sim-{seed}.jsonl"
