"""The PD router's decisions, without sockets or threads: worker registry (I6), admission over every stage (I5),
placement, and fan-in of outputs. Control messages and clock ticks in, control messages out through `_send`.

The ZeroMQ `Router` (kvfence/pd/router.py) puts this behind a socket and an I/O thread; the deterministic
simulator (kvfence/sim) drives it directly. Messages from workers go through one dispatch table
(`control_handlers`); whatever it cannot use is counted on `control` (a `control.Dispatch`) and dropped.

I10 (docs/invariants.md) on the router: every message arrives with its sender's *principal*, the identity the
transport authenticated (the CURVE public key; the simulator's node name; "" in a cluster without keys). A
worker registers only in the role its principal is allowed (`roles`), one live worker per principal; a
heartbeat counts only for a worker of the same principal; a request's outputs and errors count only from the
decode worker it was placed on, its first token only from its prefill worker. Everything else is dropped and
counted by reason (`refused`), and changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvfence.engine.admission import Limits, admit
from kvfence.engine.fairness import DEFAULT_SHARE, TenantShare
from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.ids import RequestId
from kvfence.kv.pool import PoolStats
from kvfence.pd import control
from kvfence.pd.control import ControlMessage
from kvfence.pd.messages import TransferId

log = logging.getLogger("kvfence.pd.router")
OnOutput = Callable[[RequestOutput], None]


PLACEMENTS = ("load", "round-robin")
AFFINITY_SLACK = 0.25  # a tenant stays on its prefill worker while it is at most this much (of a pool) busier
AFFINITY_TENANTS = 4096  # tenants remembered for affinity (least recently placed forgotten first)


class NoWorkers(RuntimeError):
    pass


@dataclass
class WorkerInfo:
    identity: bytes
    role: str
    fingerprint: dict[str, Any]
    data_addr: str
    last_seen: float
    pool_free: int | None = None  # from the latest heartbeat
    health: dict[str, Any] = field(default_factory=dict)  # the latest heartbeat: pool page counts, failures
    pid: int | None = None  # for operators' logs (and tests that kill a worker)
    config: dict[str, Any] = field(default_factory=dict)  # the worker's public configuration tree (register)
    principal: str = ""  # who the transport authenticated (a CURVE public key, z85); "" without keys
    name: str = ""  # the principal's name in the keys directory (operators' logs and metrics)
    draining: bool = False  # no new placements; told to shut down once its last request ends
    placed: int = 0  # requests placed here and not yet done (on a prefill: until its first token)
    placed_total: int = 0  # requests ever placed here
    committed_pages: int = 0  # the pages those requests need here at most (placement by load)
    num_waiting: int | None = None  # the worker's own queue, from its latest heartbeat

    @property
    def pool_pages(self) -> int:
        return int(self.fingerprint["pool_pages"])

    def load(self) -> float:
        """How full this worker is, as placement sees it: the pages in use over its pool (the more of what the
        router committed to it and what its latest heartbeat reports held: leased, quarantined, sealed in use;
        not the evictable cache), plus its own waiting queue."""
        pool = self.health.get("pool") or {}
        held = int(pool.get("num_pages", 0)) - int(pool.get("num_free", 0))  # num_free counts the cache too
        return max(self.committed_pages, held) / max(1, self.pool_pages) + (self.num_waiting or 0) / 64


@dataclass
class _Routed:
    prompt_len: int
    prefill: bytes
    decode: bytes
    on_output: OnOutput
    prefill_pages: int = 0  # committed on the prefill worker until its first token (or the end)
    decode_pages: int = 0  # committed on the decode worker until the end
    done: bool = False
    # output tokens and text the client has been given (the first token may come from the prefill worker)
    sent_tokens: int = 0
    sent_text: str = ""


def _unseen(routed: _Routed, out: RequestOutput) -> RequestOutput:
    """What of `out` the client has not seen; records it as seen. The prefill worker sends the first token as
    soon as it is sampled (the time to first token is then the prefill's, not the prefill's plus the
    transfer's), and the decode worker's outputs carry it again. Tokens and logprobs already sent are dropped;
    text is cut from the cumulative text, since the decode worker's detokenizer may still hold back what the
    prefill worker's already showed (a character split across tokens)."""
    skip = max(0, routed.sent_tokens - (out.num_output_tokens - len(out.new_token_ids)))
    routed.sent_tokens = max(routed.sent_tokens, out.num_output_tokens)
    sent = routed.sent_text
    if out.text.startswith(sent):
        new_text, routed.sent_text = out.text[len(sent) :], out.text
    else:  # behind what was sent (held back), or an error's empty text
        new_text = "" if sent.startswith(out.text) else out.new_text
    if skip == 0 and new_text == out.new_text:
        return out
    return replace(
        out, new_token_ids=out.new_token_ids[skip:], new_text=new_text, logprobs=out.logprobs[skip:]
    )


FINGERPRINT_INTS = ("vocab_size", "context_length", "pool_pages", "page_size")
SCHEDULING_POLICIES = ("vtc", "fcfs")


def _fingerprint_problem(fp: Mapping[str, Any]) -> str | None:
    """What is wrong with a registration's fingerprint (kvfence/pd/worker.py::fingerprint), or None: placement
    and admission (I5, I6) read every one of these fields."""
    if not isinstance(fp.get("layout"), str) or not fp["layout"]:
        return "layout must be a non-empty string"
    for key in FINGERPRINT_INTS:
        value = fp.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key} must be a positive integer, got {value!r}"
    if fp.get("scheduling_policy") not in SCHEDULING_POLICIES:
        return f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {fp.get('scheduling_policy')!r}"
    return None


DATA_ADDR = re.compile(
    r"tcp://([A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}"
)  # a prefill's data socket


def _data_addr_problem(addr: str) -> str | None:
    """Why decode workers could not connect to a prefill's registered data address, or None."""
    if not (m := DATA_ADDR.fullmatch(addr)):
        return f"data_addr must be tcp://HOST:PORT, got {addr[:80]!r}"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(m.group(1).strip("[]")).is_unspecified:
            return (
                f"data_addr {addr} is where the prefill listens, not an address decode workers can reach: give "
                "--data this host's address"
            )
    return None


MAX_COUNT = 1 << 53  # a heartbeat's counts: exact as floats (placement divides them, /metrics exports them)
POOL_FIELDS = frozenset(f.name for f in fields(PoolStats))
MAX_REFUSED_REASONS = 64  # a worker's refusal reasons become /metrics labels: bounded


def _count_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_COUNT


def _counts_ok(pool: Mapping[str, Any] | None, pool_pages: int) -> bool:
    """A heartbeat's pool page counts: PoolStats' fields, each a count, the pool the size the worker registered
    and every page count within it (the lifetime eviction count aside)."""
    if pool is None:
        return True
    if set(pool) != POOL_FIELDS or not all(_count_ok(v) for v in pool.values()):
        return False
    return pool["num_pages"] == pool_pages and all(
        pool[k] <= pool_pages for k in POOL_FIELDS - {"num_evictions"}
    )


def _refused_ok(refused: Mapping[str, Any] | None) -> bool:
    return refused is None or (
        len(refused) <= MAX_REFUSED_REASONS
        and all(isinstance(k, str) and 0 < len(k) <= 64 and _count_ok(v) for k, v in refused.items())
    )


TENANT_FIELDS = frozenset({"pages", "running", "waiting", "virtual_tokens"})
MAX_HEARTBEAT_TENANTS = 4096  # a worker's per-tenant numbers become /metrics labels: bounded


def _tenants_ok(tenants: Mapping[str, Any] | None) -> bool:
    """A heartbeat's per-tenant numbers: at most MAX_HEARTBEAT_TENANTS tenants, each with its four fields,
    non-negative finite numbers."""
    if tenants is None:
        return True
    return len(tenants) <= MAX_HEARTBEAT_TENANTS and all(
        isinstance(numbers, dict)
        and set(numbers) == TENANT_FIELDS
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < MAX_COUNT
            for v in numbers.values()
        )
        for numbers in tenants.values()
    )


def _drain_key(w: WorkerInfo, keyed: bool) -> str:
    return f"name:{w.name}" if keyed else f"pid:{w.pid}"


class RouterCore:
    def __init__(
        self,
        dead_after_s: float = 5.0,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        tid_prefix: int | None = None,
        roles: Mapping[str, tuple[str, str]] | None = None,
        placement: str = "load",
        tenants: Mapping[str, TenantShare] | None = None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement_policy = placement
        # tenants' weights and page shares (the keys file): sent to every worker at registration, so each
        # worker's scheduler orders and shares its own queue and pool by them (engine/fairness.py)
        self.tenants = dict(tenants or {})
        # principal -> (role, name) it may register as; None: a cluster without keys (--insecure-cluster)
        self.roles = roles
        self.refused: Counter[str] = Counter()  # messages dropped by the I10 binding, by reason
        self.dead_after_s = dead_after_s  # no heartbeat for this long: the worker is gone
        self.faults = faults or Faults()
        self.clock = clock
        self.workers: dict[bytes, WorkerInfo] = {}
        self._routed: dict[RequestId, _Routed] = {}
        self._rr = itertools.count()
        self._pending_drains: set[str] = set()  # workers to drain when they register (`drain_matching`)
        self._affinity: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # tenant -> prefill
        self.decisions: collections.deque[tuple[RequestId, bytes, bytes]] = collections.deque(maxlen=4096)
        # transfer ids: a 24-bit random prefix per router, then a counter (increasing: receivers rely on it)
        prefix = int.from_bytes(os.urandom(3), "little") if tid_prefix is None else tid_prefix
        self._tids = itertools.count((prefix << 40) + 1)
        self._last_tid = 0
        self.control = control.Dispatch("router", self.control_handlers())

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        """What the router does with each message from a worker; handlers take (message, sender identity)."""
        return {
            control.Register: self._register,
            control.Output: self._on_output,
            control.Heartbeat: self._on_heartbeat,
            control.RequestError: self._on_request_error,
        }

    def _send(self, identity: bytes, message: ControlMessage) -> None:
        raise NotImplementedError

    def _workers_changed(self) -> None:
        """Hook: the registry gained or lost a worker."""

    # ---- admission and placement --------------------------------------------------------------------

    def limits(self) -> tuple[Limits, Limits]:
        """(prefill, decode) limits: the smallest context any worker holds (I6), and the largest pool of each
        role. A request passes admission if some worker of each role can hold it; placement then takes only
        such workers (`_pick`): I5 per worker, not the smallest pool for everyone."""
        workers = [w for w in list(self.workers.values()) if not w.draining]
        by_role = {role: [w for w in workers if w.role == role] for role in ("prefill", "decode")}
        if not by_role["prefill"] or not by_role["decode"]:
            raise NoWorkers("no prefill or no decode worker registered")
        ctx = min(int(w.fingerprint["context_length"]) for w in workers)
        page = int(by_role["decode"][0].fingerprint["page_size"])
        return (
            Limits(ctx, max(w.pool_pages for w in by_role["prefill"]), page),
            Limits(ctx, max(w.pool_pages for w in by_role["decode"]), page),
        )

    def ready(self) -> bool:
        """Whether a prefill/decode pair can take a request now (readiness: GET /health)."""
        try:
            self.limits()
        except NoWorkers:
            return False
        return True

    def admit(self, num_prompt_tokens: int, params: SamplingParams, tenant: str = "") -> None:
        """I5 against every stage, and the tenant's page cap, before anything is sent; raises AdmissionError or
        NoWorkers."""
        prefill_limits, decode_limits = self.limits()
        cap = self.tenants.get(tenant, DEFAULT_SHARE).max_pages
        admit(num_prompt_tokens, params, prefill_limits, prefill_only=True, max_pages=cap)
        admit(num_prompt_tokens, params, decode_limits, max_pages=cap)

    def placement(self, request_id: str) -> tuple[WorkerInfo, WorkerInfo] | None:
        """(prefill, decode) serving a live request, or None."""
        routed = self._routed.get(RequestId(request_id))
        if routed is None:
            return None
        workers = dict(self.workers)
        p, d = workers.get(routed.prefill), workers.get(routed.decode)
        return (p, d) if p is not None and d is not None else None

    def _pick(self, role: str, pages: int, turn: int, tenant: str = "") -> WorkerInfo | None:
        """The worker of `role` this request goes to: never one draining or whose own pool cannot hold `pages`
        (I5 per worker). By load (the default): the least loaded, ties broken in turn, except that a tenant's
        requests stay on the prefill worker that served its last one while that worker is at most
        AFFINITY_SLACK more loaded than the least (its prefix cache is there: the cache is per tenant and per
        worker, so affinity shares nothing across tenants); round-robin: in turn."""
        fits = [
            w for w in self.workers.values() if w.role == role and not w.draining and w.pool_pages >= pages
        ]
        if not fits:
            return None
        if self.placement_policy == "round-robin":
            return fits[turn % len(fits)]
        best = min(fits, key=lambda w: (w.load(), w.placed, (fits.index(w) - turn) % len(fits)))
        if role == "prefill" and tenant:
            last = self.workers.get(self._affinity.get(tenant, b""))
            if last is not None and last in fits and last.load() <= best.load() + AFFINITY_SLACK:
                best = last
            self._affinity[tenant] = best.identity
            self._affinity.move_to_end(tenant)
            while len(self._affinity) > AFFINITY_TENANTS:
                self._affinity.popitem(last=False)
        return best

    def route(
        self, ids: list[int], params: SamplingParams, rid: RequestId, tenant: str, cb: OnOutput
    ) -> None:
        page_size = next(iter(self.workers.values())).fingerprint["page_size"] if self.workers else 1
        prefill_pages = -(-(len(ids) + 1) // page_size)
        decode_pages = -(-(len(ids) + params.max_tokens) // page_size)
        turn = next(self._rr)
        p = self._pick("prefill", prefill_pages, turn, tenant)
        d = self._pick("decode", decode_pages, turn)
        if p is None or d is None:  # the workers that could hold it left between admission and now
            cb(RequestOutput(rid, (), "", True, "error", "worker_unavailable", len(ids), 0, "", ()))
            return
        self._routed[rid] = _Routed(len(ids), p.identity, d.identity, cb, prefill_pages, decode_pages)
        for w, pages in ((p, prefill_pages), (d, decode_pages)):
            w.placed, w.placed_total, w.committed_pages = (
                w.placed + 1,
                w.placed_total + 1,
                w.committed_pages + pages,
            )
        self.decisions.append((rid, p.identity, d.identity))
        tid = self._last_tid if self._last_tid and self.faults.fire("reuse_transfer_id") else next(self._tids)
        self._last_tid = tid
        prompt, body = tuple(ids), control.params_to_json(params)
        expect = control.Expect(rid, TransferId(tid), prompt, body, p.data_addr, tenant, p.principal)
        self._send(d.identity, expect)
        self._send(p.identity, control.Prefill(rid, TransferId(tid), prompt, body, tenant, d.principal))

    def _release(self, routed: _Routed, prefill: bool = True, decode: bool = True) -> None:
        """Placement's bookkeeping: the request no longer loads its prefill worker (first token or end) and/or
        its decode worker (end). A draining worker none of whose requests is still routed is told to shut down:
        a prefill worker sends the first token before its pages, so it stays until the request ends."""
        for identity, flag, attr in (
            (routed.prefill, prefill, "prefill_pages"),
            (routed.decode, decode, "decode_pages"),
        ):
            pages = getattr(routed, attr)
            if not flag or pages == 0:
                continue
            setattr(routed, attr, 0)
            w = self.workers.get(identity)
            if w is not None:
                w.placed, w.committed_pages = w.placed - 1, w.committed_pages - pages
        for identity in (routed.prefill, routed.decode):
            w = self.workers.get(identity)
            if w is not None:
                self._retire_if_drained(w)

    # ---- draining ----------------------------------------------------------------------------------------

    def drain(self, identity: bytes) -> bool:
        """Stop placing requests on a worker; once its in-flight requests end it is told to shut down and leaves
        the registry (scale-in). False if no such worker."""
        w = self.workers.get(identity)
        if w is None:
            return False
        if not w.draining:
            log.warning("%s worker %r draining: %d request(s) in flight", w.role, w.name or w.pid, w.placed)
            w.draining = True
            self._workers_changed()
        self._retire_if_drained(w)
        return True

    def drain_matching(self, pid: int | None, name: str) -> None:
        """Drain the worker of that key name (with keys) or pid (without); one that has not registered yet is
        drained as soon as it does (a scale-in can overtake a worker still loading its model)."""
        key = f"name:{name}" if self.roles is not None else f"pid:{pid}"
        found = [w for w in self.workers.values() if _drain_key(w, self.roles is not None) == key]
        for w in found:
            self.drain(w.identity)
        if not found:
            self._pending_drains.add(key)

    def _retire_if_drained(self, w: WorkerInfo) -> None:
        if not w.draining or w.identity not in self.workers:
            return
        if any(w.identity in (r.prefill, r.decode) for r in self._routed.values()):
            return  # a request still needs it (its decode steps, or the transfer of its pages)
        log.warning("%s worker %r drained; shutting it down", w.role, w.name or w.pid)
        self._send(w.identity, control.Shutdown())
        self.workers.pop(w.identity, None)
        self._workers_changed()

    def forget(self, pid: int | None = None, name: str | None = None) -> None:
        """A launcher saw a worker's process (or actor) die: drop it now rather than after its heartbeats stop;
        its requests fail with `worker_unavailable`. By pid and, with keys, name: a replacement that registered
        meanwhile (a new pid) is not touched."""
        self._pending_drains.discard(f"name:{name}" if self.roles is not None else f"pid:{pid}")
        for w in [w for w in self.workers.values() if w.pid == pid and (not name or w.name == name)]:
            log.error("%s worker %r (pid %s) exited; failing its requests", w.role, w.name, w.pid)
            self._drop_worker(w)

    def cancel(self, rid: RequestId) -> None:
        """The client went away: both sides abort the request (by request id)."""
        routed = self._routed.get(rid)
        if routed is None:
            return
        for identity in (routed.decode, routed.prefill):
            self._send(identity, control.AbortRequest(rid))

    # ---- messages from workers, and time --------------------------------------------------------------

    def on_frame(self, identity: bytes, frame: bytes, principal: str = "") -> None:
        """A control frame from `identity`, authenticated as `principal`: decoded and dispatched, or counted
        and dropped."""
        message = self.control.decode(frame)
        if message is not None:
            self.on_message(identity, message, principal)

    def on_message(self, identity: bytes, message: ControlMessage, principal: str = "") -> None:
        worker = self.workers.get(identity)
        if worker is not None and worker.principal != principal:
            return self.refuse("identity_mismatch", message)  # a registered connection, another principal
        if self.roles is not None and principal not in self.roles:
            return self.refuse("unknown_principal", message)  # not (or no longer) in the allowlist
        if worker is None and not isinstance(message, control.Register | control.Heartbeat):
            return self.refuse("unregistered", message)
        if worker is not None:
            worker.last_seen = self.clock()
        self.control(message, identity, principal)

    def refuse(self, reason: str, message: ControlMessage) -> None:
        """Drop a message the I10 binding does not allow; counted by reason (for /metrics)."""
        self.refused[reason] += 1
        log.warning("router: dropped a %r message: %s", message.op, reason)

    def _on_output(self, msg: control.Output, sender: bytes, principal: str = "") -> None:
        out = msg.output
        routed = self._routed.get(out.request_id)
        if routed is None or routed.done:
            return self.refuse("unknown_request", msg)
        first = sender == routed.prefill and not out.finished and out.num_output_tokens == 1
        if sender != routed.decode and not first and not self.faults.fire("unbound_outputs"):
            # I10: the decode worker it was placed on speaks for a request; its prefill for the first token only
            return self.refuse("not_placed_here", msg)
        out = _unseen(routed, out)
        routed.done = out.finished
        routed.on_output(out)
        if out.finished:
            self._routed.pop(out.request_id, None)
            self._release(routed)
        elif first:
            self._release(routed, decode=False)  # the prefill is done with it
        if out.finished and out.error_code is not None:
            # decode failed it (a refused reservation, a failed transfer): the prefill may still hold pages for
            # it. By request id, never by transfer id, which a collision could share (finding 2).
            self._send(routed.prefill, control.AbortRequest(out.request_id))

    def _on_heartbeat(self, msg: control.Heartbeat, sender: bytes, principal: str = "") -> None:
        """Heartbeats come from each worker's own heartbeat socket and name the worker's control identity; they
        count only from the principal that worker registered as (one member cannot speak for another)."""
        try:
            identity = bytes.fromhex(msg.worker)
        except ValueError:
            return self.refuse("malformed_heartbeat", msg)
        worker = self.workers.get(identity)
        if worker is None:  # alive after all (or the router restarted): ask it to register again
            if identity not in self.workers and self._known_principal(principal):
                self._send(identity, control.Reregister())
            return
        if worker.principal != principal:
            return self.refuse("heartbeat_for_another_worker", msg)
        if (
            not _counts_ok(msg.pool, worker.pool_pages)
            or not _tenants_ok(msg.tenants)
            or not _refused_ok(msg.refused)
            or not all(
                v is None or _count_ok(v)
                for v in (msg.pool_free, msg.num_waiting, msg.num_running, msg.integrity_failures)
            )
        ):
            return self.refuse("malformed_heartbeat", msg)  # placement and /metrics read these numbers
        worker.last_seen = self.clock()
        worker.pool_free = msg.pool_free
        worker.num_waiting = msg.num_waiting
        health = {
            "pool": msg.pool,
            "integrity_failures": msg.integrity_failures,
            "num_running": msg.num_running,  # requests the worker's scheduler runs (operators: /cluster/status)
            "refused": msg.refused,
            "tenants": msg.tenants,
        }
        worker.health = {k: v for k, v in health.items() if v is not None}

    def reap_dead_workers(self) -> None:
        """A worker that went silent is gone: its requests fail (503 to clients), the surviving side of each is
        told to abort (revoking its reservations), and placement skips it from now on."""
        now = self.clock()
        for w in [w for w in self.workers.values() if now - w.last_seen > self.dead_after_s]:
            log.error("%s worker %s missed its heartbeats; failing its requests", w.role, w.data_addr or "")
            self._drop_worker(w)

    def revoke(self, roles: Mapping[str, tuple[str, str]]) -> None:
        """A new allowlist (the keys directory re-read): a worker whose key left it is dropped at once, as a
        dead one is; its requests fail with `worker_unavailable`, and whatever it sends later is refused."""
        self.roles = roles
        for w in [w for w in self.workers.values() if roles.get(w.principal, ("",))[0] != w.role]:
            log.error("%s worker %r: its key was revoked; failing its requests", w.role, w.name)
            self._send(w.identity, control.Shutdown())
            self._drop_worker(w)

    def _drop_worker(self, w: WorkerInfo) -> None:
        if self.workers.pop(w.identity, None) is None:
            return  # gone already (retired while an earlier worker in the same sweep was dropped)
        self._workers_changed()
        for rid, routed in list(self._routed.items()):
            if w.identity in (routed.prefill, routed.decode):
                self._on_error(w.identity, rid, "worker_unavailable")

    def _known_principal(self, principal: str) -> bool:
        return self.roles is None or principal in self.roles

    def _register(self, msg: control.Register, identity: bytes, principal: str = "") -> None:
        if identity in self.workers:  # a second registration on a registered connection: nothing changes
            return self.refuse("duplicate_registration", msg)
        name = ""
        if self.roles is not None:
            role, name = self.roles.get(principal, ("", ""))
            if role != msg.role:
                reason = f"this cluster key may register as {role or 'nothing'}, not as {msg.role}"
                self.refuse("role_not_allowed", msg)
                self._send(identity, control.Refused(reason))
                return
            holder = next((w for w in self.workers.values() if w.principal == principal), None)
            if holder is not None:  # one live worker per key: a second process with it waits for the first
                self.refuse("key_in_use", msg)
                reason = f"key {name!r} is in use by {holder.role} worker pid {holder.pid}"
                self._send(identity, control.Refused(reason, retry=True))
                return
        fp = msg.fingerprint
        if problem := _fingerprint_problem(fp):  # a peer's bad input: refused, nothing registered
            self.refuse("malformed_fingerprint", msg)
            self._send(identity, control.Refused(f"fingerprint: {problem}"))
            return
        if msg.role == "prefill" and (problem := _data_addr_problem(msg.data_addr)):  # decode workers connect
            self.refuse("malformed_data_addr", msg)
            self._send(identity, control.Refused(problem))
            return
        if problem := self._shares_problem(
            msg.role, fp
        ):  # never accepted and ignored: the keys file's shares
            log.error("refusing %s worker: %s", msg.role, problem)
            self.refused["tenant_shares"] += 1
            self._send(identity, control.Refused(problem))
            return
        for other in self.workers.values():
            if (
                other.fingerprint["layout"] != fp["layout"]
                or other.fingerprint["vocab_size"] != fp["vocab_size"]
            ):
                reason = f"fingerprint {fp} does not match registered worker {other.fingerprint}"
                log.error("refusing %s worker: %s", msg.role, reason)
                self.refused["fingerprint_mismatch"] += 1
                self._send(identity, control.Refused(reason))
                return
        info = WorkerInfo(
            identity, msg.role, fp, msg.data_addr, self.clock(), pid=msg.pid, config=dict(msg.config),
            principal=principal, name=name,
        )  # fmt: skip
        self.workers[identity] = info
        self._workers_changed()
        log.info("registered %s worker %s", msg.role, fp)
        self._send(identity, control.Registered(self.tenants))
        pending = _drain_key(info, self.roles is not None)
        if pending in self._pending_drains:  # scaled in while it was still starting
            self._pending_drains.discard(pending)
            self.drain(identity)

    def _shares_problem(self, role: str, fp: Mapping[str, Any]) -> str | None:
        """Why a worker cannot apply the tenants' shares, or None: its policy must be vtc where any tenant has a
        weight or page share, and its pool must hold every tenant's guarantee (each worker reserves them in its
        own pool)."""
        shared = sorted(t for t, s in self.tenants.items() if s != DEFAULT_SHARE)
        if shared and fp["scheduling_policy"] != "vtc":
            return (
                f"tenants {', '.join(shared)} have weights or page shares (the router's keys file), which a "
                f"{role} worker with --scheduling-policy {fp['scheduling_policy']} would not apply"
            )
        guaranteed = sum(s.min_pages for s in self.tenants.values())
        if guaranteed > fp["pool_pages"]:
            return (
                f"tenants' min_pages add up to {guaranteed}, more than this {role} worker's pool of "
                f"{fp['pool_pages']} pages (each worker reserves the guarantees in its own pool)"
            )
        return None

    def worker_configs(self) -> list[dict[str, Any]]:
        """Each registered worker's public configuration tree, as it sent it at registration (any thread)."""
        return [
            {
                "role": w.role,
                "pid": w.pid,
                "data_addr": w.data_addr,
                "worker": w.identity.hex(),
                "config": w.config,
            }
            for w in list(self.workers.values())
        ]

    def _on_request_error(self, msg: control.RequestError, identity: bytes, principal: str = "") -> None:
        routed = self._routed.get(msg.request_id)
        if routed is None:
            return self.refuse("unknown_request", msg)
        if identity not in (routed.prefill, routed.decode) and not self.faults.fire("unbound_outputs"):
            return self.refuse("not_placed_here", msg)  # I10: only the request's own workers can end it
        self._on_error(identity, msg.request_id, msg.code)

    def _on_error(self, identity: bytes, rid: RequestId, code: str) -> None:
        """A worker refused or failed the request: end it for the client, and stop the other side."""
        routed = self._routed.pop(rid, None)
        if routed is None or routed.done:
            return
        self._release(routed)
        other = routed.decode if identity == routed.prefill else routed.prefill
        self._send(other, control.AbortRequest(rid))
        routed.on_output(RequestOutput(rid, (), "", True, "error", code, routed.prompt_len, 0, "", ()))
