"""The PD supervisor (kvfence/runtime/supervisor.py) with fake workers and a fake clock: restart with backoff,
a crash loop given up on after the bound, scaling out and in by draining. Deterministic: `tick()` by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvfence.runtime.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeWorker:
    pid: int
    status: int | None = None
    stopped: bool = False

    def exited(self) -> int | None:
        return self.status

    def stop(self) -> None:
        self.stopped = True
        self.status = 0


@dataclass
class FakeRouter:
    events: list[tuple[str, int | None, str]] = field(default_factory=list)
    never_registers: set[int | None] = field(default_factory=set)

    def worker_exited(self, pid: int | None, name: str) -> None:
        self.events.append(("exited", pid, name))

    def drain_worker(self, pid: int | None, name: str) -> None:
        self.events.append(("drain", pid, name))

    def is_registered(self, pid: int | None) -> bool:
        return pid not in self.never_registers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def supervisor(policy: RestartPolicy) -> tuple[Supervisor, FakeRouter, Clock, list[FakeWorker]]:
    router, clock, started = FakeRouter(), Clock(), []

    def launch(role: str, name: str) -> FakeWorker:
        started.append(FakeWorker(pid=100 + len(started)))
        return started[-1]

    return Supervisor(router, launch, policy, clock=clock), router, clock, started


def test_a_dead_worker_is_reported_and_restarted_after_a_growing_delay():
    sup, router, clock, started = supervisor(RestartPolicy(max_restarts=5, window=300, base_delay=0.5))
    sup.add("prefill")
    sup.add("decode")
    sup.tick()
    assert [s["state"] for s in sup.status()] == ["running", "running"]
    delays = []
    for n in range(3):
        started[-1].status = -9  # the decode worker (the newest one) is killed
        died_at = clock.now
        sup.tick()
        assert router.events[-1] == ("exited", started[-1].pid, "decode-0")  # the router drops it at once
        assert sup.status()[1]["state"] == "restarting"
        while len(started) == 2 + n:  # no new process until the delay has passed
            clock.now += 0.1
            sup.tick()
        delays.append(round(clock.now - died_at, 1))
    assert delays == [0.5, 1.0, 2.0]
    decode = sup.status()[1]
    assert decode["restarts"] == 3 and decode["pid"] == started[-1].pid and decode["last_exit"] == -9
    assert sup.status()[0]["restarts"] == 0  # the other worker was left alone


def test_a_crash_loop_is_given_up_on_after_the_bound_and_counts_only_recent_exits():
    sup, _router, clock, started = supervisor(RestartPolicy(max_restarts=2, window=60, base_delay=1.0))
    sup.add("decode")
    sup.tick()  # running and registered

    def crash_and_wait() -> None:
        started[-1].status = 1
        sup.tick()
        while sup.status()[0]["state"] == "restarting":
            clock.now += 0.5
            sup.tick()
        sup.tick()  # started: seen running at the next tick

    crash_and_wait()
    clock.now += 120  # long enough: the first exit leaves the window
    crash_and_wait()
    crash_and_wait()
    assert sup.status()[0]["state"] == "running"  # two exits within 60 s: still restarted
    crash_and_wait()
    assert sup.status()[0]["state"] == "given_up" and sup.status()[0]["pid"] is None
    clock.now += 1000
    sup.tick()
    assert len(started) == 4  # never started again by itself
    assert sup.scale(1, 1)["added"] == ["prefill-0", "decode-1"]  # scaling starts a fresh one


def test_scaling_out_adds_workers_and_scaling_in_drains_the_newest_then_lets_them_go():
    sup, router, _clock, started = supervisor(RestartPolicy())
    sup.scale(1, 1)
    assert sup.scale(2, 3) == {"added": ["prefill-1", "decode-1", "decode-2"], "draining": []}
    sup.tick()
    assert sup.scale(2, 1) == {"added": [], "draining": ["decode-2", "decode-1"]}
    assert [e for e in router.events if e[0] == "drain"] == [
        ("drain", started[4].pid, "decode-2"),
        ("drain", started[3].pid, "decode-1"),
    ]
    started[4].status = 0  # the router told it to shut down once its requests ended
    sup.tick()
    names = [(s["name"], s["state"]) for s in sup.status()]
    assert ("decode-2", "draining") not in names and ("decode-1", "draining") in names
    assert len(started) == 5  # a drained worker is not restarted
    with pytest.raises(ValueError, match="at least one worker"):
        sup.scale(0, 1)


def test_a_worker_that_exits_before_registering_is_a_configuration_error_and_not_restarted():
    """Its preflight refused the pool, or its keys were bad: a restart would be refused the same way. A worker
    killed by a signal before registering is restarted as usual."""
    sup, router, _clock, started = supervisor(RestartPolicy(max_restarts=5))
    router.never_registers.update({100, 101})
    sup.add("prefill")
    sup.add("decode")
    sup.tick()
    started[0].status = 1  # refused by its preflight
    started[1].status = -9  # killed while loading
    sup.tick()
    assert [s["state"] for s in sup.status()] == ["given_up", "restarting"]


def test_a_worker_its_router_refuses_after_it_registered_is_not_restarted():
    """Exit 2 is a configuration error whenever it comes (a router restarted with tenants' guarantees its pool
    cannot hold refuses it on re-registration); a worker that registered and crashed with 1 is restarted."""
    sup, _router, _clock, started = supervisor(RestartPolicy(max_restarts=5))
    sup.add("prefill")
    sup.add("decode")
    sup.tick()
    started[0].status = 2
    started[1].status = 1
    sup.tick()
    assert [s["state"] for s in sup.status()] == ["given_up", "restarting"]


def test_stop_stops_every_worker():
    sup, _, _, started = supervisor(RestartPolicy())
    sup.scale(1, 2)
    sup.stop()
    assert all(w.stopped for w in started)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-workers", "2"], "--prefill-workers only applies to --mode pd"),
        (["--ray", "auto", "--decode-kv-pages", "8"], "--decode-kv-pages, --ray only apply to --mode pd"),
        (["--mode", "pd", "--decode-workers", "0"], "--decode-workers must be at least 1"),
        (["--mode", "pd", "--ray", "auto", "--insecure-cluster"], "--ray always uses cluster keys"),
        (["--mode", "pd", "--ray", "auto", "--restart-window", "300"], "Ray counts --max-restarts"),
        (["--placement", "load"], "--placement only applies to --mode pd"),
        (["--max-restarts", "3"], "--max-restarts only applies to --mode pd"),
        (["--transfer-timeout", "5", "--no-share-cores"], "--no-share-cores, --transfer-timeout only apply"),
        (["--insecure-cluster"], "--insecure-cluster only applies to --mode pd"),
        (
            ["--mode", "pd", "--decode-threads", "1"],
            "--decode-threads does nothing while the workers share cores",
        ),
        (
            ["--prefill-timeout", "9", "--registration-timeout", "9", "--transfer-window", "2"],
            "--transfer-window, --prefill-timeout, --registration-timeout only apply",
        ),
        (["--mode", "pd", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--mode", "pd", "--placement", "random"], "invalid choice"),
    ],
)
def test_scale_out_flags_that_would_do_nothing_or_contradict_are_refused(flags, message):
    """Never accepted and ignored: each gets exit 2 and a line naming the flag, before anything loads."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvfence", "serve", "--model", "none", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_scaling_in_a_worker_that_waits_to_restart_removes_it_and_one_still_starting_is_drained():
    sup, router, clock, started = supervisor(RestartPolicy(base_delay=5.0))
    sup.scale(1, 3)
    sup.tick()
    started[-1].status = -9  # decode-2 died: waiting 5 s to restart
    sup.tick()
    assert sup.status()[-1]["state"] == "restarting"
    sup.scale(1, 1)  # decode-2 (restarting) goes at once; decode-1 is drained by the router
    assert [s["name"] for s in sup.status()] == ["prefill-0", "decode-0", "decode-1"]
    assert ("drain", started[2].pid, "decode-1") in router.events
    clock.now += 60
    sup.tick()
    assert len(started) == 4  # decode-2 was never restarted


def test_bundle_and_unpack_round_trip_and_unpack_refuses_paths_outside_its_directory(tmp_path):
    from kvfence.pd import keys

    directory = keys.ephemeral(prefill=1, decode=2)
    try:
        files = keys.bundle(directory, "prefill", "prefill-0")
        assert sorted(files) == [
            "decode/decode-0.key", "decode/decode-1.key", "prefill/prefill-0.key", "prefill/prefill-0.key_secret",
            "router.key",
        ]  # fmt: skip
        out = keys.unpack(files)
        assert keys.WorkerKeys.load(out, "prefill", "prefill-0").own.secret is not None
        assert (out / "prefill" / "prefill-0.key_secret").stat().st_mode & 0o077 == 0
        keys.remove(out)
    finally:
        keys.remove(directory)
    for bad in ("/tmp/x.key", "../router.key", "decode/../../x.key", "cron/x.key", "router.txt", "a/b/c.key"):
        with pytest.raises(keys.KeyFileError):
            keys.unpack({bad: b"x"})
