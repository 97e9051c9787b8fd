"""Keeps a PD deployment's workers running and sizes it: restart with backoff, crash loops given up on, scaling
out and in by draining. `kvfence serve --mode pd` supervises local processes (`ProcessLauncher`); on Ray, Ray
restarts actors and the same `Supervisor` does the rest (kvfence/runtime/ray_cluster.py).

A worker that dies is told to the router at once (`Router.forget`): its requests fail with 503
`worker_unavailable` now, not when its heartbeats run out. Its replacement is a new process with a new engine
and pool: it registers through the fingerprint check like any worker (I6) and inherits no lease, transfer or
request of the dead one. A worker that keeps dying (more than `max_restarts` exits within `window` s) is given
up on and reported (`kvfence cluster status`, the log); readiness (GET /health) tells load balancers whether a
prefill/decode pair is left.

Scaling in drains: the router stops placing requests on the worker, its in-flight requests finish, then the
router tells it to shut down and the supervisor lets it go instead of restarting it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("kvfence.supervisor")
CONFIG_EXIT = 2  # a worker's exit status for a configuration error (refused by its router, a bad flag)
TICK_S = 0.2
ROLES = ("prefill", "decode")


class Handle(Protocol):
    """One started worker: a local process or a Ray actor."""

    pid: int | None

    def exited(self) -> int | None:
        """None while it runs; else its exit status (a negative signal number for a killed process)."""

    def stop(self) -> None:
        """Ask it to exit (and make sure it does, soon)."""


Launch = Callable[[str, str], Handle]  # (role, name) -> a started worker


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # exits within `window` s before the worker is given up on; 0: never restart
    window: float = 300.0
    base_delay: float = 0.5  # first restart after this long, doubling with each restart in the window
    max_delay: float = 30.0

    def delay(self, recent: int) -> float:
        return float(min(self.max_delay, self.base_delay * 2**recent))


@dataclass
class Slot:
    role: str
    name: str  # its cluster key's name (prefill-0, ...): a restarted worker keeps it
    handle: Handle | None = None
    state: str = "starting"  # starting, running, restarting, draining, given_up
    exits: collections.deque[float] = field(default_factory=collections.deque)  # when it exited, recently
    restarts: int = 0  # over its whole life
    registered: bool = False  # its current process registered with the router (else it is still starting)
    next_start: float | None = None
    last_exit: int | None = None

    def view(self) -> dict[str, Any]:
        pid = self.handle.pid if self.handle is not None else None
        node = getattr(self.handle, "node", None)  # Ray: the node it runs on (locally: this host)
        return {
            "node": node,
            "role": self.role,
            "name": self.name,
            "state": self.state,
            "pid": pid,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }


class RouterHooks(Protocol):
    """What the supervisor tells the router (kvfence/pd/router.py)."""

    def worker_exited(self, pid: int | None, name: str) -> None: ...

    def drain_worker(self, pid: int | None, name: str) -> None: ...

    def is_registered(self, pid: int | None) -> bool: ...


class Supervisor:
    """The worker slots of one deployment. `tick()` runs on the supervisor's thread (`start`), or by hand in
    tests with a fake clock; `scale` and `status` from any thread."""

    def __init__(
        self,
        router: RouterHooks,
        launch: Launch,
        policy: RestartPolicy | None = None,
        names: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        retire: Callable[[str, str], None] = lambda role, name: None,
    ) -> None:
        """`names(role)` makes the next worker's name (and its key, where there are keys); `retire(role, name)`
        is called when a drained worker has left (its key is withdrawn)."""
        self.router = router
        self.launch = launch
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self._names = names or self._default_name
        self._retire = retire
        self._counts = collections.Counter[str]()
        self.slots: list[Slot] = []
        self._lock = threading.RLock()  # every change of the slots, from tick() and from scale()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _default_name(self, role: str) -> str:
        name = f"{role}-{self._counts[role]}"
        self._counts[role] += 1
        return name

    # ---- any thread -----------------------------------------------------------------------------------------

    def add(self, role: str) -> Slot:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        with self._lock:
            slot = Slot(role, self._names(role))
            self.slots.append(slot)
            self._start(slot)
            return slot

    def scale(self, prefill: int, decode: int) -> dict[str, Any]:
        """Add workers, or drain the newest ones, until each role has the number asked for (given-up and
        draining workers do not count). Returns what changed. Two calls at once run one after the other."""
        if prefill < 1 or decode < 1:
            raise ValueError(f"a cluster needs at least one worker of each role, got {prefill} and {decode}")
        added, draining = [], []
        with self._lock:
            for role, want in (("prefill", prefill), ("decode", decode)):
                serving = [
                    s for s in self.slots if s.role == role and s.state not in ("draining", "given_up")
                ]
                for _ in range(want - len(serving)):
                    added.append(self.add(role).name)
                for slot in reversed(serving[want:] if want < len(serving) else []):
                    self._drain(slot)
                    draining.append(slot.name)
        return {"added": added, "draining": draining}

    def _drain(self, slot: Slot) -> None:
        """(lock held) A worker waiting to restart just goes; a running or starting one is drained by the router
        (at once if it has not registered yet, when it does)."""
        handle = slot.handle
        slot.state, slot.next_start = "draining", None
        if handle is None:
            self.slots.remove(slot)
            self._retire(slot.role, slot.name)
            return
        self.router.drain_worker(handle.pid, slot.name)  # it leaves once its requests end (`tick` sees it)

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.view() for s in self.slots]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfence-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising, then every worker."""
        self.stop_supervising()
        self.stop_workers()

    def stop_supervising(self) -> None:
        """No more restarts: first thing at shutdown, before the router tells the workers to exit."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def stop_workers(self) -> None:
        with self._lock:
            handles = [s.handle for s in self.slots if s.handle is not None]
        for handle in handles:
            handle.stop()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # the supervisor must outlive any one launch failure
                log.exception("supervisor tick failed")

    # ---- the supervisor's thread ----------------------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        with self._lock:
            for slot in list(self.slots):
                handle = slot.handle
                if handle is not None and slot.state in ("starting", "running", "draining"):
                    status = handle.exited()
                    if status is None:
                        slot.state = "running" if slot.state == "starting" else slot.state
                        slot.registered = slot.registered or self.router.is_registered(handle.pid)
                        continue
                    self._exited(slot, handle, status, now)
                if slot.state == "restarting" and slot.next_start is not None and now >= slot.next_start:
                    slot.restarts += 1
                    self._start(slot)

    def _exited(self, slot: Slot, handle: Handle, status: int, now: float) -> None:
        """(lock held) Its worker exited: let it go (drained), give up on it, or restart it after a delay."""
        slot.last_exit = status
        self.router.worker_exited(handle.pid, slot.name)  # its requests fail now (503 worker_unavailable)
        handle.stop()  # a process that exited: nothing; a Ray actor whose worker ended: its process goes too
        if slot.state == "draining":
            log.warning("%s worker %s drained and left", slot.role, slot.name)
            self.slots.remove(slot)
            self._retire(slot.role, slot.name)
            return
        if status == CONFIG_EXIT or (not slot.registered and status > 0):
            # exited on its own before it ever registered (its preflight or its keys refused it: exit 1 or 2), or
            # the router refused it (exit 2, also on a later registration): a restart would be refused the same way
            slot.state, slot.handle = "given_up", None
            log.error("%s worker %s exited with status %s (see its preflight or error above): a configuration "
                      "error, not restarted", slot.role, slot.name, status)  # fmt: skip
            return
        while slot.exits and now - slot.exits[0] > self.policy.window:
            slot.exits.popleft()
        slot.exits.append(now)
        if len(slot.exits) > self.policy.max_restarts:
            slot.state, slot.handle = "given_up", None
            log.error(
                "%s worker %s exited %d times within %.0f s (last status %s): giving up on it; `kvfence "
                "cluster status` shows it, and `kvfence cluster scale` starts a fresh one",
                slot.role, slot.name, len(slot.exits), self.policy.window, status,
            )  # fmt: skip
            return
        delay = self.policy.delay(len(slot.exits) - 1)
        log.error(
            "%s worker %s (pid %s) exited with status %s; restarting it in %.1f s",
            slot.role, slot.name, handle.pid, status, delay,
        )  # fmt: skip
        slot.state, slot.handle, slot.next_start = "restarting", None, now + delay

    def _start(self, slot: Slot) -> None:
        """(lock held) Start the slot's worker."""
        slot.next_start = None
        slot.handle = self.launch(slot.role, slot.name)
        slot.state, slot.registered = "starting", False
