#!/usr/bin/env python3
"""Model-check the PD KV-transfer protocol (verify/transfer.pml) with Spin.

    python3 verify/run.py              # the CI suite: correct model (safety + liveness) and every must-fail variant
    python3 verify/run.py --deep       # bigger configurations (slow; minutes to tens of minutes)
    python3 verify/run.py --only a     # one run by name (see --list)
    python3 verify/run.py --install    # apt-get install spin gcc first if they are missing (needs root)

Each run: `spin -a` with the run's -D switches, gcc -O2 on pan.c, ./pan, then for a counterexample the trail is
replayed (`spin -t`) to name the violated property (the model prints PROPERTY-VIOLATED <name>) and to show the
run's events (the model's `EV ...` lines). A run expected to pass must finish its search with no error; a must-fail
variant must be refuted, by one of the properties it is expected to break. Exit status 0 only if every run met its
expectation. docs/verification.md explains the model, the properties and the variants.

Standard library only: it runs from the Makefile and from tests/test_verify.py without the project's venv.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "transfer.pml"

SAFETY_CC = ["-DSAFETY", "-DNOCLAIM"]
LTL_CC = [
    "-DNOREDUCE",
    "-DNFAIR=10",
]  # weak fairness (-f) over the model's 9 processes; no partial order reduction
ALL_PROPS = ["I1", "OUT", "I2", "I3", "I4", "ONE", "RX", "WIN", "LEASE", "CODE", "QUI"]


@dataclass(frozen=True)
class Run:
    name: str
    what: str  # one line: what this run shows
    defines: tuple[str, ...] = ()
    ltl: bool = False  # True: check `ltl live` with -a -f (assertions off: -A); False: safety (assertions, end states)
    expect: str = "pass"  # "pass" | "fail"
    expect_props: tuple[str, ...] = ()  # for "fail": properties any of which may be the refutation
    cc: tuple[str, ...] = ()  # extra gcc flags (-DCOLLAPSE, -DBITSTATE, -DMEMLIM=...)
    pan: tuple[str, ...] = ()  # extra pan flags (-w, -k)
    shortest: bool = False  # look for a short counterexample (pan -i, compiled with -DREACH)
    timeout_s: int = 600

    def props_checked(self) -> list[str]:
        if self.ltl:
            return ["live"]
        off = {
            d[len("-DCHK_") :].split("=")[0]
            for d in self.defines
            if d.startswith("-DCHK_") and d.endswith("=0")
        }
        return [p for p in ALL_PROPS if p not in off]


# Properties switched off in a must-fail run are switched off only so that the trail shows the headline
# consequence of the bug rather than an earlier symptom; every variant is refuted with all properties on as well
# (the first symptom is then one of the earlier ones: see docs/verification.md).
_NOFENCE_QUIET = ("-DCHK_RX=0", "-DCHK_CODE=0")

CI: list[Run] = [
    Run(
        "safety",
        "correct model: all safety properties; 2 duplicates, a corrupted frame, every buggy-placeholder "
        "prefill mode",
        ("-DNDUP=2", "-DPH_SHORT1", "-DCORRUPT"),
    ),
    Run(
        "liveness",
        "correct model: <> quiescent (every request ends, every page free, no sender stuck) under "
        "weak fairness",
        (),
        ltl=True,
    ),
    Run(
        "a",
        "(a) placeholder prefill + receiver trusts the final frame as a done flag",
        ("-DTRUST_DONE",),
        expect="fail",
        expect_props=("I3",),
        shortest=True,
    ),
    Run(
        "a-incident",
        "(a) end to end, as in 2026: also no per-step tag check -> the client reads another request's data",
        ("-DTRUST_DONE", "-DNO_TAG_CHECK", "-DCHK_I3=0"),
        expect="fail",
        expect_props=("I1", "OUT"),
        shortest=True,
    ),
    Run(
        "a-no-digest",
        "count and completeness without the digest: a frame corrupted in flight is decoded",
        ("-DNO_DIGEST_CHECK", "-DCORRUPT"),
        expect="fail",
        expect_props=("I3",),
        shortest=True,
    ),
    Run(
        "b",
        "(b) tags checked once, before the first step, and no fence (release without revocation, no "
        "stale_lease check): a late write lands between check and read",
        (
            "-DCHECK_ONCE",
            "-DRELEASE_NO_REVOKE",
            "-DNO_OWNER_CHECK",
            *_NOFENCE_QUIET,
            "-DCHK_I2=0",
            "-DCHK_I3=0",
            "-DCHK_ONE=0",
        ),
        expect="fail",
        expect_props=("I1", "OUT"),
    ),
    Run(
        "b-output",
        "(b) with the read assertion off: the foreign data reaches the client as a token",
        (
            "-DCHECK_ONCE",
            "-DRELEASE_NO_REVOKE",
            "-DNO_OWNER_CHECK",
            *_NOFENCE_QUIET,
            "-DCHK_I2=0",
            "-DCHK_I3=0",
            "-DCHK_ONE=0",
            "-DCHK_I1=0",
            "-DCHK_I4=0",
        ),
        expect="fail",
        expect_props=("OUT",),
    ),
    Run(
        "c",
        "(c) decode timeout releases the pages without revoking the transfer, and on_frame has no "
        "stale_lease check: a late frame lands on a reused page",
        ("-DRELEASE_NO_REVOKE", "-DNO_OWNER_CHECK", *_NOFENCE_QUIET),
        expect="fail",
        expect_props=("I2",),
        shortest=True,
    ),
    Run(
        "c-with-owner-check",
        "(c) alone, the code's stale_lease check still in place: no late write lands, "
        "but the receiver keeps a reservation on pages it no longer owns",
        ("-DRELEASE_NO_REVOKE",),
        expect="fail",
        expect_props=("RX",),
        shortest=True,
    ),
    Run(
        "d",
        "(d) the sender takes the first ack of its window as 'everything in flight has drained'",
        ("-DDRAIN_FIRST_ACK",),
        expect="fail",
        expect_props=("WIN",),
        shortest=True,
    ),
    Run(
        "d-decode-side-holds",
        "(d) with WIN off: every decode-side property still holds (count + completeness fail the transfer)",
        ("-DDRAIN_FIRST_ACK", "-DCHK_WIN=0"),
    ),
    Run(
        "e",
        "(e) a reused transfer id (router reuses it, reserve() does not refuse it)",
        ("-DREUSE_TID",),
        expect="fail",
        expect_props=("ONE", "RX", "QUI"),
        shortest=True,
    ),
    Run(
        "e-as-coded",
        "(e) as the code has it: the router reuses a transfer id (fault knob reuse_transfer_id), reserve() "
        "refuses it, the second request fails with kv_integrity_error; everything else holds",
        ("-DREUSE_TID_ROUTER",),
    ),
    Run(
        "e-as-coded-prefill-leak",
        "... but worker.py never tells the prefill about the refusal: on a lossless network, without a prefill "
        "timeout, the prefilled request waits for its ticket forever (even with the tombstone fix)",
        (
            "-DREUSE_TID_ROUTER",
            "-DNO_PREFILL_TIMEOUT",
            "-DNO_LOSS",
            "-DNET=8",
            "-DNDUP=0",
            "-DPREFILL_TOMBSTONE",
        ),
        expect="fail",
        expect_props=("QUI",),
        shortest=True,
    ),
    Run(
        "fix-refusal-aborts-prefill",
        "fix: the router aborts the prefill (by request id) when the decode refuses the reservation",
        (
            "-DREUSE_TID_ROUTER",
            "-DNO_PREFILL_TIMEOUT",
            "-DNO_LOSS",
            "-DNET=8",
            "-DNDUP=0",
            "-DPREFILL_TOMBSTONE",
            "-DREFUSAL_ABORTS",
        ),
    ),
    Run(
        "e-liveness",
        "(e) as a liveness failure: the first request never ends, its page never returns",
        ("-DREUSE_TID",),
        ltl=True,
        expect="fail",
        expect_props=("live",),
    ),
    Run(
        "no-prefill-timeout",
        "nobody calls TransferSender.fail() on a stuck sender: a lost Abort leaves it sending forever",
        ("-DNO_PREFILL_TIMEOUT",),
        expect="fail",
        expect_props=("QUI",),
        shortest=True,
    ),
    Run(
        "no-prefill-timeout-liveness",
        "the same, as a liveness (LTL) failure",
        ("-DNO_PREFILL_TIMEOUT",),
        ltl=True,
        expect="fail",
        expect_props=("live",),
    ),
    Run(
        "as-implemented-prefill-leak",
        "kvfence/pd/worker.py as it is, on a lossless network (ZeroMQ/TCP): no prefill-side timeout, and an Abort "
        "that reaches the prefill before its sender exists is ignored; the sender starts later and never ends",
        ("-DNO_PREFILL_TIMEOUT", "-DNO_LOSS", "-DNET=8", "-DNDUP=0"),
        expect="fail",
        expect_props=("QUI",),
        shortest=True,
    ),
    Run(
        "fix-prefill-tombstone",
        "fix for a lossless network: the prefill remembers an Abort that comes before its sender (no timeout "
        "needed)",
        ("-DNO_PREFILL_TIMEOUT", "-DNO_LOSS", "-DNET=8", "-DNDUP=0", "-DPREFILL_TOMBSTONE"),
    ),
    Run(
        "fix-prefill-tombstone-liveness",
        "the same fix, liveness (LTL)",
        ("-DNO_PREFILL_TIMEOUT", "-DNO_LOSS", "-DNET=8", "-DNDUP=0", "-DPREFILL_TOMBSTONE"),
        ltl=True,
    ),
    Run(
        "finding-stale-placeholder",
        "finding: a placeholder prefill that ships a stale page under a full "
        "count passes count and byte digest",
        ("-DSTALE_PH",),
        expect="fail",
        expect_props=("I3",),
        shortest=True,
    ),
    Run(
        "finding-stale-placeholder-read",
        "the same, as a foreign read that passes every tag check",
        ("-DSTALE_PH", "-DCHK_I3=0"),
        expect="fail",
        expect_props=("I1", "OUT"),
        shortest=True,
    ),
    Run(
        "fix-provenance-digest",
        "fix: digest what the prefill computed (I9 seal digests), not the bytes handed to frame()",
        ("-DSTALE_PH", "-DPROVENANCE_DIGEST"),
    ),
    Run(
        "finding-write-fails",
        "finding: on_frame stamps and records the digest before the caller's write; if "
        "the write raises, a duplicate frame is acked and the page is decoded with stale bytes",
        ("-DWRITE_CAN_FAIL",),
        expect="fail",
        expect_props=("WIN", "I3", "I1"),
        shortest=True,
    ),
    Run(
        "finding-write-fails-read",
        "the same, down to the foreign read (tags pass: the page was stamped)",
        ("-DWRITE_CAN_FAIL", "-DCHK_WIN=0", "-DCHK_I3=0"),
        expect="fail",
        expect_props=("I1", "OUT"),
        shortest=True,
    ),
    Run(
        "fix-write-fails-revokes",
        "fix: a failed payload write revokes the transfer",
        ("-DWRITE_CAN_FAIL", "-DWRITE_FAIL_REVOKES"),
    ),
]

_BIG = ("-DNPAGES=3", "-DNP2=2", "-DNET=5")
DEEP: list[Run] = [
    Run(
        "deep-safety",
        "3 pages (r0:2, r1:1, r2:2 pages; r0 and r1 concurrent, r2 reuses r0's pages), bag of 5, "
        "2 duplicates, 2 client aborts, every buggy-placeholder mode",
        (*_BIG, "-DNDUP=2", "-DNABORT=2", "-DPH_SHORT1"),
        cc=("-DCOLLAPSE", "-DMEMLIM=12000"),
        pan=("-w27",),
        timeout_s=3600,
    ),
    Run(
        "deep-liveness",
        "liveness at 3 pages, 1 duplicate",
        (*_BIG,),
        ltl=True,
        cc=("-DCOLLAPSE", "-DMEMLIM=12000"),
        pan=("-w26",),
        timeout_s=3600,
    ),
    Run(
        "deep-safety-k3-dup3",
        "2 pages, 3 decode steps, 3 duplicates, a corrupted frame, 2 client aborts, window 1, bag of 5",
        ("-DKSTEPS=3", "-DNDUP=3", "-DWINDOW=1", "-DNET=5", "-DPH_SHORT1", "-DCORRUPT", "-DNABORT=2"),
        cc=("-DCOLLAPSE",),
        pan=("-w26",),
        timeout_s=3600,
    ),
    Run(
        "deep-owner-check-alone-fences",
        "defense in depth: (c)'s bug with the stale_lease check in place; no "
        "late write lands, no foreign read",
        ("-DRELEASE_NO_REVOKE", "-DCHK_RX=0", "-DCHK_CODE=0", "-DCHK_I3=0"),
        cc=("-DCOLLAPSE",),
        pan=("-w26",),
        timeout_s=3600,
    ),
    Run(
        "deep-tid-reuse-isolation-holds",
        "(e) with the bookkeeping properties off: isolation (I1-I4, OUT, WIN) still holds under a reused "
        "transfer id, because every frame is validated against its lease",
        ("-DREUSE_TID", "-DCHK_ONE=0", "-DCHK_RX=0", "-DCHK_QUI=0"),
        cc=("-DCOLLAPSE",),
        pan=("-w26",),
        timeout_s=3600,
    ),
    Run(
        "deep-tags-detect",
        "defense in depth: no fences at all (no revocation, no stale_lease check) but tags "
        "checked before and after every step: late writes land and are read, yet no foreign token is emitted",
        (
            "-DRELEASE_NO_REVOKE",
            "-DNO_OWNER_CHECK",
            "-DCHK_RX=0",
            "-DCHK_CODE=0",
            "-DCHK_I2=0",
            "-DCHK_I3=0",
            "-DCHK_ONE=0",
            "-DCHK_I1=0",
            "-DCHK_I4=0",
        ),
        cc=("-DHC4", "-DMEMLIM=12000"),  # hash-compact: ~36 M states in ~1.5 GB instead of ~5.5 GB
        pan=("-w27",),
        timeout_s=3600,
    ),
]


@dataclass
class Result:
    name: str
    what: str
    kind: str
    defines: list[str]
    expect: str
    ok: bool = False
    verdict: str = ""
    errors: int | None = None
    violated: str | None = None  # property name, or "live" for an LTL counterexample
    states: int | None = None
    visited: float | None = None  # with -f, states visited (each stored state times fairness copies)
    transitions: int | None = None
    depth: int | None = None
    state_vector: int | None = None
    memory_mb: float | None = None
    pan_seconds: float | None = None
    wall_seconds: float | None = None
    complete: bool = False
    trail_steps: int | None = None  # length of the counterexample (spin -t)
    props: list[str] = field(default_factory=list)
    trail: str | None = None
    events: list[str] = field(default_factory=list)
    detail: str = ""


# ---- tools -------------------------------------------------------------------------------------------------------


def tools_missing() -> list[str]:
    return [t for t in ("spin", "gcc") if shutil.which(t) is None]


def ensure_tools(install: bool = True) -> tuple[bool, str]:
    """Spin and gcc present? If not and `install`, try `apt-get install -y spin gcc` once (root only)."""
    missing = tools_missing()
    if not missing:
        return True, "spin and gcc found"
    if not install:
        return False, f"not installed: {', '.join(missing)}"
    apt = shutil.which("apt-get")
    if apt is None:
        return False, f"not installed: {', '.join(missing)}; no apt-get to install them"
    if os.geteuid() != 0:
        return False, f"not installed: {', '.join(missing)}; apt-get needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "spin", "gcc"]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"{' '.join(cmd)} failed: {e}"
        if proc.returncode != 0:
            return False, f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}"
    missing = tools_missing()
    return (not missing), (
        "installed spin and gcc" if not missing else f"still missing: {', '.join(missing)}"
    )


# ---- one run -----------------------------------------------------------------------------------------------------

_RE = {
    "vector": re.compile(r"State-vector (\d+) byte, depth reached (\d+), errors: (\d+)"),
    "stored": re.compile(r"^\s*([\d.e+]+) states, stored(?: \(([\d.e+]+) visited\))?", re.M),
    "transitions": re.compile(r"^\s*([\d.e+]+) transitions", re.M),
    "memory": re.compile(r"^\s*([\d.]+)\s+total actual memory usage", re.M),
    "elapsed": re.compile(r"pan: elapsed time ([\d.e+]+) seconds"),
}


def _sh(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_one(run: Run, out_root: Path) -> Result:
    kind = "liveness (LTL, -a -f)" if run.ltl else "safety"
    res = Result(run.name, run.what, kind, list(run.defines), run.expect, props=run.props_checked())
    work = out_root / run.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.copy(MODEL, work / MODEL.name)
    t0 = time.monotonic()
    try:
        gen = _sh(["spin", "-a", *run.defines, MODEL.name], work, 120)
        if gen.returncode != 0 or not (work / "pan.c").exists():
            res.verdict, res.detail = "ERROR", "spin -a failed:\n" + (gen.stdout + gen.stderr)[-2000:]
            return res
        cc = ["gcc", "-O2", "-w", "-o", "pan", "pan.c", *(LTL_CC if run.ltl else SAFETY_CC), *run.cc]
        if run.shortest:
            cc.append("-DREACH")
        comp = _sh(cc, work, 300)
        if comp.returncode != 0:
            res.verdict, res.detail = "ERROR", "gcc failed:\n" + comp.stderr[-2000:]
            return res
        pan = ["./pan", "-m20000", *run.pan]
        if not any(p.startswith("-w") for p in run.pan):
            pan.append("-w22")
        if run.ltl:
            pan += ["-a", "-f", "-A", "-N", "live"]
        elif run.shortest:
            pan.append("-i")
        proc = _sh(pan, work, run.timeout_s)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        res.verdict, res.detail = "ERROR", f"timed out after {e.timeout} s: {' '.join(map(str, e.cmd))}"
        return res
    finally:
        res.wall_seconds = round(time.monotonic() - t0, 1)
    (work / "pan.out").write_text(out)
    _parse(res, out)
    if res.errors is None:
        res.verdict, res.detail = "ERROR", "could not parse pan's output:\n" + out[-2000:]
        return res
    if "max search depth too small" in out:
        res.complete = False
    trail = work / (MODEL.name + ".trail")
    if res.errors and trail.exists():
        res.trail = str(trail)
        _replay(res, run, work)
    _judge(res, run, out)
    return res


def _parse(res: Result, out: str) -> None:
    if m := _RE["vector"].search(out):
        res.state_vector, res.depth, res.errors = int(m[1]), int(m[2]), int(m[3])
    if m := _RE["stored"].search(out):
        res.states = int(float(m[1]))
        res.visited = float(m[2]) if m[2] else None
    if m := _RE["transitions"].search(out):
        res.transitions = int(float(m[1]))
    if m := _RE["memory"].search(out):
        res.memory_mb = float(m[1])
    if m := _RE["elapsed"].search(out):
        res.pan_seconds = float(m[1])
    res.complete = "Search not completed" not in out or bool(res.errors)
    if "acceptance cycle" in out:
        res.violated = "live"
    elif "invalid end state" in out:
        res.violated = "END"


def _replay(res: Result, run: Run, work: Path) -> None:
    try:
        rep = _sh(["spin", "-t", *run.defines, MODEL.name], work, 300)
    except subprocess.TimeoutExpired:
        return
    text = rep.stdout + rep.stderr
    (work / "replay.txt").write_text(text)
    if m := re.search(r"trail ends after (\d+) steps", text):
        res.trail_steps = int(m[1])
    if m := re.search(r"PROPERTY-VIOLATED (\w+)", text):
        res.violated = m[1] if res.violated != "live" else res.violated
    events = [line.strip() for line in text.splitlines() if line.strip().startswith(("EV ", "PROPERTY-"))]
    res.events = [_readable(e) for e in events]


_KINDS = {1: "Ticket", 2: "FrameAck", 3: "Abort(to prefill)", 4: "PageFrame", 5: "FinalFrame",
          6: "Abort(to decode)", 7: "AbortAck"}  # fmt: skip
_MODES = {0: "ok", 1: "placeholder, start() aborts", 2: "placeholder, claims 2 pages",
          3: "placeholder, claims 1 page", 4: "placeholder, ships a stale page"}  # fmt: skip


def _readable(event: str) -> str:
    """The model prints numbers; name the message kinds and prefill modes."""
    event = re.sub(r"kind=(\d)", lambda m: _KINDS.get(int(m[1]), m[0]), event)
    return re.sub(r"mode (\d)\)", lambda m: f"mode: {_MODES.get(int(m[1]), m[1])})", event)


def _judge(res: Result, run: Run, out: str) -> None:
    if run.expect == "pass":
        if res.errors == 0 and res.complete:
            res.ok, res.verdict = True, "VERIFIED"
        elif res.errors == 0:
            res.verdict, res.detail = "INCOMPLETE", "search did not complete"
        else:
            res.verdict = f"VIOLATED {res.violated or '?'}"
    else:
        if not res.errors:
            res.verdict = "NOT REFUTED"
        elif res.violated in run.expect_props:
            res.ok, res.verdict = True, f"REFUTED by {res.violated}"
        else:
            res.verdict = f"REFUTED by {res.violated or '?'} (expected {'/'.join(run.expect_props)})"


# ---- suite -------------------------------------------------------------------------------------------------------


def _fmt_int(n: int | float | None) -> str:
    return "-" if n is None else f"{n:,.0f}"


def report_line(r: Result) -> str:
    states = _fmt_int(r.states) + (f" ({r.visited:.3g} visited)" if r.visited else "")
    mem = "-" if r.memory_mb is None else f"{r.memory_mb:.0f} MB"
    secs = "-" if r.pan_seconds is None else f"{r.pan_seconds:g} s"
    mark = "ok  " if r.ok else "FAIL"
    return (
        f"{mark} {r.name:<32} {r.verdict:<26} states {states:<28} depth {_fmt_int(r.depth):>4}  "
        f"time {secs:<8} mem {mem}"
    )


def run_suite(runs: list[Run], out_root: Path, jobs: int = 1, echo: bool = True) -> list[Result]:
    out_root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_one, r, out_root): r for r in runs}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[r.name] = r
            if echo:
                print(report_line(r), flush=True)
                if not r.ok and r.detail:
                    print("     " + r.detail.replace("\n", "\n     "), flush=True)
    return [results[r.name] for r in runs]


def print_details(results: list[Result], runs: list[Run], max_events: int) -> None:
    by_name = {r.name: r for r in runs}
    for res in results:
        run = by_name[res.name]
        print(f"\n== {res.name}: {res.verdict}  [{res.kind}]")
        print(f"   {run.what}")
        print(f"   switches: {' '.join(run.defines) or '(none)'}")
        if run.expect == "pass":
            print(f"   properties checked: {', '.join(res.props)}")
        print(
            f"   states stored {_fmt_int(res.states)}, transitions {_fmt_int(res.transitions)}, depth "
            f"{_fmt_int(res.depth)}, state vector {_fmt_int(res.state_vector)} B, pan {res.pan_seconds} s, "
            f"memory {res.memory_mb} MB, wall {res.wall_seconds} s"
        )
        if res.trail:
            print(f"   trail: {res.trail} ({res.trail_steps} steps)")
            events = res.events
            if len(events) > max_events:
                print(f"   counterexample (last {max_events} of {len(events)} events):")
                events = events[-max_events:]
            else:
                print("   counterexample:")
            for line in events:
                print(f"     {line}")


def print_property_table(results: list[Result], runs: list[Run]) -> None:
    """Per property: the runs that verified it, and the must-fail runs it refuted."""
    by_name = {r.name: r for r in runs}
    print("\nverdict per property:")
    for prop in [*ALL_PROPS, "live"]:
        verified = [r.name for r in results if by_name[r.name].expect == "pass" and r.ok and prop in r.props]
        refuted = [r.name for r in results if by_name[r.name].expect == "fail" and r.violated == prop]
        broken = [r.name for r in results if by_name[r.name].expect == "pass" and r.violated == prop]
        line = f"  {prop:<6} holds in: {', '.join(verified) or '-'}"
        if refuted:
            line += f"; refutes: {', '.join(refuted)}"
        if broken:
            line += f"; VIOLATED in: {', '.join(broken)}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deep", action="store_true", help="run the bigger configurations (after the CI suite)")
    ap.add_argument("--deep-only", action="store_true", help="run only the bigger configurations")
    ap.add_argument("--only", action="append", default=[], help="run only these runs (by name; repeatable)")
    ap.add_argument("--list", action="store_true", help="list the runs and exit")
    ap.add_argument("--install", action="store_true", help="apt-get install spin gcc if missing (root)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="runs in parallel (default 1: clean timings)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvfence-verify",
        help="where models, pan binaries and trails go (default: %(default)s)",
    )
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--events", type=int, default=40, help="counterexample events shown per trail")
    ap.add_argument("-q", "--quiet", action="store_true", help="one line per run, no trails")
    args = ap.parse_args(argv)

    runs = [] if args.deep_only else list(CI)
    if args.deep or args.deep_only:
        runs += DEEP
    if args.only:
        everything = {r.name: r for r in CI + DEEP}
        unknown = [n for n in args.only if n not in everything]
        if unknown:
            ap.error(f"unknown run(s): {', '.join(unknown)}; see --list")
        runs = [everything[n] for n in args.only]
    if args.list:
        for r in CI + DEEP:
            tag = "deep" if r in DEEP else "ci"
            print(f"{r.name:<32} {tag:<5} expect {r.expect:<5} {r.what}")
        return 0

    ok, why = ensure_tools(install=args.install)
    if not ok:
        print(
            f"verify: {why}. Install Spin (Debian package `spin`) and gcc, or run with --install as root.",
            file=sys.stderr,
        )
        return 2
    spin_version = subprocess.run(["spin", "-V"], capture_output=True, text=True).stdout.strip()
    print(f"{spin_version}; model {MODEL}; output under {args.out}")
    t0 = time.monotonic()
    results = run_suite(runs, args.out, args.jobs)
    if not args.quiet:
        print_details(results, runs, args.events)
    print_property_table(results, runs)
    bad = [r for r in results if not r.ok]
    print(
        f"\n{len(results) - len(bad)}/{len(results)} runs as expected in {time.monotonic() - t0:.0f} s"
        + (f"; NOT as expected: {', '.join(r.name for r in bad)}" if bad else "")
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
