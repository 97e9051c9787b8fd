"""Trace replay (issue 5): page events recorded by real PD processes (KVFENCE_TRACE) are checked against the
invariants by kvfence.sim.trace_check; a clean run is clean, and a historical bug shows up in the trace."""

from __future__ import annotations

from kvfence.engine.request import SamplingParams
from kvfence.sim.trace_check import TraceChecker, check_files, main
from tests.pd_cluster import collect, jobs_for, start_cluster

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_the_checker_accepts_a_clean_lifecycle_and_names_each_violation():
    clean = [
        {"ev": "alloc", "node": "n", "page": 3, "lease": 10},
        {"ev": "read", "node": "n", "request_id": "r", "pages": [3], "leases": [10], "written": 0},
        {"ev": "stamp", "node": "n", "pages": [3], "leases": [10]},
        {"ev": "read", "node": "n", "request_id": "r", "pages": [3], "leases": [10], "written": 1},
        {"ev": "hold", "node": "n", "pages": [3]},
        {"ev": "release", "node": "n", "page": 3, "lease": 10, "ok": True},
        {"ev": "quarantine", "node": "n", "page": 3},
        {"ev": "unhold", "node": "n", "pages": [3]},
        {"ev": "reclaim", "node": "n", "page": 3},
        {"ev": "alloc", "node": "n", "page": 3, "lease": 11},
    ]
    assert TraceChecker().check(clean).ok
    bad = {
        "lease": [*clean, {"ev": "alloc", "node": "n", "page": 4, "lease": 11}],
        "I4": [*clean, {"ev": "alloc", "node": "n", "page": 3, "lease": 12}],
        "I1": [
            *clean,
            {"ev": "read", "node": "n", "request_id": "r", "pages": [3], "leases": [11], "written": 1},
        ],
        "I2": [*clean, {"ev": "apply", "node": "n", "tid": 1, "page": 3, "lease": 10}],
        "freed while": [*clean[:6], clean[6], {"ev": "reclaim", "node": "n", "page": 3}],
    }
    for what, events in bad.items():
        report = TraceChecker().check(events)
        assert not report.ok and what in report.violations[0], (what, report.violations)


def test_a_real_pd_run_leaves_a_clean_trace(tiny_dir, tiny_model, tmp_path, capsys):
    with start_cluster(tiny_dir, env={"KVFENCE_TRACE": str(tmp_path)}) as router:
        got = collect(router, jobs_for(tiny_model, 6, seed=51), PARAMS, tenant="tenant-a")
        got |= collect(router, jobs_for(tiny_model, 6, seed=52, prefix="b"), PARAMS, tenant="tenant-b")
    assert all(v.error_code is None for v in got.values())
    files = sorted(tmp_path.glob("*.jsonl"))
    assert {f.name.split("-")[0] for f in files} == {"prefill", "decode"}
    report = check_files(files)
    assert report.ok, report.violations[:5]
    assert report.counts["apply"] > 0 and report.counts["read"] > 0 and report.counts["reclaim"] > 0
    assert main([str(tmp_path)]) == 0 and "clean" in capsys.readouterr().out


def test_a_historical_bug_shows_in_the_trace_of_a_real_run(tiny_dir, tiny_model, tmp_path):
    """The 2026 incident with every check off: nothing fails, every answer is a 200, and the trace checker
    finds the decode step that read pages its request never wrote."""
    with start_cluster(tiny_dir, checks=False, env={"KVFENCE_TRACE": str(tmp_path)}) as router:
        (prefill,) = [w for w in router.workers.values() if w.role == "prefill"]
        router.arm(prefill.identity, "placeholder_prefill=1")
        jobs = {k: v * 3 for k, v in jobs_for(tiny_model, 2, seed=53).items()}  # several pages each
        got = collect(router, jobs, PARAMS)
    assert all(v.error_code is None for v in got.values())
    report = check_files(sorted(tmp_path.glob("*.jsonl")))
    assert any(v.startswith("event") and "I1:" in v for v in report.violations), report.violations[:5]
