"""I10 with real processes: a PD cluster whose members hold CURVE keys (kvfence/pd/keys.py), and intruders on
its ports: without a key, with a key nobody listed, with a stolen member key. Each intrusion is refused and
counted, and nothing of the intruder's reaches a client. The router runs in this process (the tests read its
counters); prefill and decode workers are real subprocesses on loopback.

Keeping a request in flight while the intruder acts: the decode worker is stopped (SIGSTOP) and continued once the
router's counters show the refusal; the router's `dead_after_s` is longer than that.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.pd import control, keys, wire
from kvfence.pd.control import ControlMessage
from kvfence.pd.messages import Ticket, TransferId
from kvfence.pd.router import Router, WorkerInfo
from tests.pd_cluster import audit_clean, collect, colocated_reference, jobs_for, start_cluster

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE_SIZE = 4  # tests/pd_cluster.py


def wait_for(condition: Callable[[], Any], what: str, within_s: float = 30.0) -> Any:
    """Poll `condition` until it is truthy (its value is returned) or fail after `within_s`."""
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # poll interval
    return value


class Intruder:
    """A process that reached a port: a DEALER with no key, or with `key` (CURVE client of `server`)."""

    def __init__(self, addr: str, key: keys.KeyPair | None = None, server: str | None = None) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a refused handshake can leave the DEALER with no pipe, and a send with none waits for one forever (a
        # clean-clone run hung here for 17 minutes): a send gives up after a second (`try_send` says so)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        if key is not None:
            assert server is not None
            keys.connect_curve(self.sock, key, server)
        self.sock.connect(addr)

    def send(self, message: ControlMessage) -> None:
        self.sock.send(control.encode(message))

    def try_send(self, message: ControlMessage) -> None:
        """Send, unless the router refused the handshake already and the message has nowhere to go."""
        with contextlib.suppress(zmq.Again):
            self.send(message)

    def send_data(self, message: Any) -> None:
        self.sock.send_multipart(wire.encode(message))

    def received(self) -> list[list[bytes]]:
        got = []
        while self.sock.poll(0):
            got.append(self.sock.recv_multipart())
        return got

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@contextlib.contextmanager
def intruder(*args: Any) -> Iterator[Intruder]:
    it = Intruder(*args)
    try:
        yield it
    finally:
        it.close()


def worker(router: Router, role: str) -> WorkerInfo:
    return next(w for w in list(router.workers.values()) if w.role == role)


@contextlib.contextmanager
def stopped(pid: int | None) -> Iterator[None]:
    """The process frozen (a slow or partitioned worker) for the duration; continued after, whatever happens."""
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def stolen_key(router: Router, role: str, name: str = "stolen") -> keys.KeyPair:
    """A member key an intruder took: a listed key no running worker holds (the router re-reads its keys
    directory within a second)."""
    directory: Path = router.keys_dir  # type: ignore[attr-defined]
    secret = keys.add(directory, role, name)
    pair = keys.load_pair(secret)
    wait_for(
        lambda: router.roles is not None and pair.principal in router.roles, "the router to list the key"
    )
    return pair


def test_a_process_without_a_listed_key_cannot_join_and_receives_nothing(tiny_dir, tiny_model):
    jobs = jobs_for(tiny_model, 4, seed=31)
    expected = colocated_reference(tiny_model, jobs, PARAMS)
    unlisted = keys.ephemeral()  # a well-formed key pair of another cluster
    try:
        with start_cluster(tiny_dir) as router:
            fp = dict(worker(router, "decode").fingerprint)  # anyone holding the model file can compute it
            stranger_key = keys.load_pair(unlisted / "decode" / "decode-0.key_secret")
            with (
                intruder(router.addr) as plain,
                intruder(router.addr, stranger_key, router.principal) as stranger,
            ):
                for it in (plain, stranger):
                    it.try_send(control.Register("decode", fp, "", 4242))
                    it.try_send(
                        control.Heartbeat(worker=worker(router, "decode").identity.hex(), pool_free=999)
                    )
                counts = router.connection_counts
                wait_for(lambda: counts().get("protocol", 0) >= 1 and counts().get("auth", 0) >= 1,
                         "the router to refuse both handshakes")  # fmt: skip
                assert sorted(w.role for w in router.workers.values()) == ["decode", "prefill"]
                got = collect(router, jobs, PARAMS)
                assert {k: v.token_ids for k, v in got.items()} == expected
                assert plain.received() == [] and stranger.received() == []
            audit_clean(router)
    finally:
        keys.remove(unlisted)


def test_a_stolen_prefill_key_cannot_answer_for_the_decode_worker_nor_read_kv(tiny_dir, tiny_model):
    """The intruder registers with a listed prefill key (a member, as far as keys go). It still cannot end or
    answer a request placed on the real workers, speak for another worker, register twice, register in the
    wrong role, or open the prefill's data socket (decode keys only)."""
    jobs = jobs_for(tiny_model, 1, seed=32, prefix="victim")
    expected = colocated_reference(tiny_model, jobs, PARAMS)
    with start_cluster(tiny_dir, dead_after_s=15.0) as router:
        real_p, real_d = worker(router, "prefill"), worker(router, "decode")
        key = stolen_key(router, "prefill")
        with intruder(router.addr, key, router.principal) as it:
            it.send(control.Register("decode", dict(real_d.fingerprint), "", 4242))  # the wrong role
            refused = wait_for(lambda: [m for m in it.received() if b'"refused"' in m[0]], "a refusal")
            assert b"may register as prefill" in refused[0][0]
            it.send(control.Register("prefill", dict(real_p.fingerprint), "tcp://127.0.0.1:9", 4242))
            wait_for(lambda: len(router.workers) == 3, "the intruder to register as prefill")
            it.send(control.Register("prefill", dict(real_p.fingerprint), "tcp://127.0.0.1:9", 4242))  # again
            it.send(control.Heartbeat(worker=real_d.identity.hex(), pool_free=0))  # speaking for decode
            with intruder(real_p.data_addr, key, real_p.principal) as data:  # KV: only decode keys get in
                seen: queue.Queue[RequestOutput] = queue.Queue()
                (rid, prompt), = jobs.items()  # fmt: skip
                with stopped(real_d.pid):  # the victim stays in flight while the intruder talks
                    while True:  # round robin: until a victim lands on the real prefill
                        router.submit(prompt, PARAMS, rid, "alice", seen.put)
                        placed = wait_for(lambda: router.placement(rid), "placement")
                        if placed[0].identity == real_p.identity:
                            break
                        router.abort(rid)
                        wait_for(lambda: router.placement(rid) is None, "the abort")
                        while not seen.empty():
                            seen.get()
                    forged = RequestOutput(RequestId(rid), (7,), "FORGED", True, "stop", None, len(prompt), 1,
                                           "FORGED", (7,))  # fmt: skip
                    first = RequestOutput(RequestId(rid), (7,), "FORGED", False, None, None, len(prompt), 1,
                                          "FORGED", (7,))  # fmt: skip
                    it.send(control.Output(first))  # a prefill's first token: not the request's prefill
                    it.send(control.Output(forged))
                    it.send(control.RequestError(RequestId(rid), "worker_unavailable", "forged", 503))
                    wait_for(
                        lambda: router.refused["not_placed_here"] >= 3, "the forged outputs to be refused"
                    )
                    assert router.refused["duplicate_registration"] == 1
                    assert router.refused["heartbeat_for_another_worker"] == 1
                    assert router.refused["role_not_allowed"] == 1
                    prefill_refused = lambda: worker(router, "prefill").health.get("refused") or {}  # noqa: E731
                    wait_for(
                        lambda: prefill_refused().get("handshake_auth", 0) >= 1, "the data socket to refuse"
                    )
                outputs = []
                while not (outputs and outputs[-1].finished):
                    outputs.append(seen.get(timeout=60))
                assert data.received() == []
            assert all("FORGED" not in o.new_text for o in outputs) and outputs[-1].error_code is None
            assert outputs[-1].token_ids == expected[rid]
            it.send(control.RequestError(RequestId("victim0"), "x", "y", 500))  # ended: unknown now
            wait_for(lambda: router.refused["unknown_request"] >= 1, "the late error to be refused")
        metrics = scrape(router)
        for line in ('kvfence_router_control_dropped_total{reason="not_placed_here"} 3.0',
                     'kvfence_router_registrations_refused_total{reason="role_not_allowed"} 1.0',
                     'kvfence_router_registrations_refused_total{reason="duplicate_registration"} 1.0',
                     'kvfence_router_control_dropped_total{reason="heartbeat_for_another_worker"} 1.0'):  # fmt: skip
            assert line in metrics, line
        assert 'kvfence_cluster_handshakes_refused_total{kind="auth",plane="data"' in metrics


def scrape(router: Router) -> str:
    """The router's /metrics families for its workers and the I10 counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvfence.pd.remote import WorkersCollector

    registry = CollectorRegistry()
    registry.register(WorkersCollector(router))
    return generate_latest(registry).decode()


@pytest.mark.parametrize("secure", [True, False], ids=["keys", "insecure"])
def test_a_stolen_decode_key_cannot_take_the_pages_of_a_transfer_named_for_another(
    tiny_dir, tiny_model, secure
):
    """The intruder holds a listed decode key and knows a live request's id and transfer id; it sends its own
    ticket to the prefill before the real decode worker can. With keys the prefill refuses it (the router named
    another decode worker) and the request completes; without keys (--insecure-cluster) the prefill ships the
    victim's KV pages to the intruder: the hole I10 closes."""
    warmup, victim = (
        jobs_for(tiny_model, 1, seed=33, prefix="warm"),
        jobs_for(tiny_model, 1, seed=34, prefix="v"),
    )
    expected = colocated_reference(tiny_model, victim, PARAMS)
    with start_cluster(tiny_dir, secure=secure, dead_after_s=15.0) as router:
        real_p, real_d = worker(router, "prefill"), worker(router, "decode")
        key = stolen_key(router, "decode") if secure else None
        collect(router, warmup, PARAMS)  # transfer ids count up: the victim's is the next
        (rid, prompt), = victim.items()  # fmt: skip
        pages = math.ceil(len(prompt) / PAGE_SIZE)
        ticket = Ticket(TransferId(router._last_tid + 1), RequestId(rid), tuple(PageId(i) for i in range(pages)),
                        tuple(LeaseId(1) for _ in range(pages)), real_p.fingerprint["layout"])  # fmt: skip
        with intruder(real_p.data_addr, key, real_p.principal or None) as thief:
            seen: queue.Queue[RequestOutput] = queue.Queue()
            with stopped(real_d.pid):
                thief.send_data(ticket)
                router.submit(prompt, PARAMS, rid, "alice", seen.put)
                if not secure:
                    frames = wait_for(lambda: [m for m in thief.received() if m[0] == b"F"], "stolen pages")
                    assert len(frames[0][2]) > 0  # a page of the victim's KV, in the intruder's hands
                    return
                refused = lambda: worker(router, "prefill").health.get("refused") or {}  # noqa: E731
                wait_for(
                    lambda: refused().get("not_the_named_decode_worker", 0) >= 1, "the ticket to be refused"
                )
            outputs = []
            while not (outputs and outputs[-1].finished):
                outputs.append(seen.get(timeout=60))
            assert outputs[-1].error_code is None and outputs[-1].token_ids == expected[rid]
            assert thief.received() == []
        audit_clean(router)


def test_a_revoked_key_drops_its_worker_and_fails_its_requests(tiny_dir, tiny_model):
    """`kvfence keys revoke` moves the decode worker's public key out of the allowlist: the router drops the
    worker at its next re-read (SIGHUP: `reload_keys`), its in-flight request fails with worker_unavailable,
    and what it sends afterwards is refused."""
    (rid, prompt), = jobs_for(tiny_model, 1, seed=35).items()  # fmt: skip
    with start_cluster(tiny_dir, dead_after_s=15.0) as router:
        real_d = worker(router, "decode")
        seen: queue.Queue[RequestOutput] = queue.Queue()
        with stopped(real_d.pid):
            router.submit(prompt, PARAMS, rid, "alice", seen.put)
            wait_for(lambda: router.placement(rid), "placement")
            directory = router.keys_dir  # type: ignore[attr-defined]
            revoke = [sys.executable, "-m", "kvfence", "keys", "revoke", str(directory), "decode", "decode-0"]
            subprocess.run(revoke, check=True, capture_output=True)
            router.reload_keys()  # what SIGHUP does in `kvfence router`
            wait_for(
                lambda: all(w.role != "decode" for w in router.workers.values()), "the worker to be dropped"
            )
            out = seen.get(timeout=30)
            while not out.finished:
                out = seen.get(timeout=30)
            assert out.error_code == "worker_unavailable"
        # What it sends afterwards is refused: on the connection it already had, by the router (its principal is no
        # longer in the allowlist), or at the handshake if ZeroMQ reconnected it while it was stopped.
        handshakes = lambda: router.gate.refused[keys.CONTROL_DOMAIN] if router.gate else 0  # noqa: E731
        wait_for(
            lambda: router.refused["unknown_principal"] + handshakes() >= 1,
            "the revoked worker's messages to be refused",
        )
        audit_clean(router)  # the prefill let go of the failed request's pages


# ---- keys on the command line -------------------------------------------------------------------------------


def kvfence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfence", *args], capture_output=True, text=True, timeout=120
    )


def test_keys_init_writes_private_secrets_and_lists_them(tmp_path):
    directory = tmp_path / "keys"
    done = kvfence("keys", "init", str(directory), "--prefill", "2", "--decode", "1")
    assert done.returncode == 0, done.stderr
    secrets = sorted(directory.rglob("*.key_secret"))
    assert [p.relative_to(directory).as_posix() for p in secrets] == [
        "decode/decode-0.key_secret", "prefill/prefill-0.key_secret", "prefill/prefill-1.key_secret",
        "router.key_secret"]  # fmt: skip
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in secrets)
    assert directory.stat().st_mode & 0o777 == 0o700
    listed = kvfence("keys", "list", str(directory)).stdout
    assert listed.count("prefill ") == 2 and listed.count("decode ") == 1
    assert kvfence("keys", "init", str(directory)).returncode == 2  # never overwrites a cluster's keys


@pytest.mark.parametrize("command", ["router", "prefill", "decode"])
def test_without_keys_a_cluster_member_refuses_to_start_and_says_how(command, tmp_path):
    done = kvfence(command, "--router", "tcp://127.0.0.1:9", "--model", str(tmp_path)) if command != "router" \
        else kvfence("router", "--model", str(tmp_path))  # fmt: skip
    assert done.returncode == 2
    assert "kvfence keys init DIR" in done.stderr and "--insecure-cluster" in done.stderr


def test_bad_key_files_exit_2_naming_the_path_and_the_problem(tmp_path):
    directory = tmp_path / "keys"
    keys.init(directory, ["prefill-0"], ["decode-0"])
    secret = directory / "decode" / "decode-0.key_secret"
    worker_args = ("decode", "--router", "tcp://127.0.0.1:9", "--model", str(tmp_path), "--cluster-keys")

    def garble() -> None:
        secret.write_text("garbage\n")
        secret.chmod(0o600)

    cases: list[tuple[Callable[[], None], tuple[str, ...], str]] = [
        (lambda: secret.chmod(0o644), (*worker_args, str(directory)), "readable by other users"),
        (garble, (*worker_args, str(directory)), "not a ZeroMQ CURVE certificate"),
        (lambda: (directory / "router.key_secret").unlink(), ("router", "--model", str(tmp_path),
                                                              "--cluster-keys", str(directory)), "cannot read"),
        (lambda: None, ("router", "--model", str(tmp_path), "--cluster-keys", str(tmp_path / "nope")),
         "no such directory"),
    ]  # fmt: skip
    for damage, args, problem in cases:
        damage()
        done = kvfence(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert problem in done.stderr, done.stderr
        assert str(tmp_path) in done.stderr  # names the path


def test_insecure_cluster_warns_at_every_start_and_contradicts_keys(tmp_path):
    done = kvfence("router", "--model", str(tmp_path), "--insecure-cluster", "--cluster-keys", str(tmp_path))
    assert done.returncode == 2 and "contradict" in done.stderr
