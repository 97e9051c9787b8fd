"""The probe's report: a readable summary for the terminal, and a JSON document for machines.

Keys never appear in either. Secrets do, for the findings that leaked them: they are random strings the probe
made up, and a leak report that does not show what leaked cannot be checked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvfence.probe.calibrate import Calibration
from kvfence.probe.client import Result, Target
from kvfence.probe.findings import Finding, FindingKind, LoadTest, TimingTest

REPORT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProbeReport:
    target: Target
    calibration: Calibration
    results: list[Result]  # calibration requests included
    findings: list[Finding]
    timing: TimingTest
    load: LoadTest
    notes: list[str]
    planned: int
    complete: bool
    elapsed_s: float

    @property
    def exit_status(self) -> int:
        return 1 if self.findings else 0

    def of_kind(self, kind: FindingKind) -> list[Finding]:
        return [f for f in self.findings if f.kind is kind]

    def outcomes(self) -> Counter[str]:
        return Counter(_outcome(r) for r in self.results)

    def summary(self) -> str:
        cal, t = self.calibration, self.target
        rate = f"{cal.prefill_tokens_per_s:.0f} tokens/s" if cal.prefill_tokens_per_s else "not measured"
        tenants = Counter(r.job.tenant.value for r in self.results)
        outcomes = ", ".join(f"{n} {name}" for name, n in sorted(self.outcomes().items()))
        lines = [
            f"kvfence probe: {t.base_url} model {t.model} ({'chat' if t.chat else 'completions'})",
            f"  context length  {cal.capacity} ({cal.capacity_source})",
            f"  prefill rate    {rate}",
            f"  requests        {len(self.results)} sent (A {tenants['A']}, B {tenants['B']}) in "
            f"{self.elapsed_s:.1f} s: {outcomes}",
            f"  prefix timing   {_timing_line(self.timing)}",
            f"  load timing     {_load_line(self.load)}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        if self.findings:
            lines.append(f"FINDINGS ({len(self.findings)}):")
            lines += [f"  [{f.kind.value}] {f.message}" for f in self.findings]
        kinds = sorted({f.kind.value for f in self.findings})
        lines.append(f"verdict: {'FINDINGS: ' + ', '.join(kinds) if kinds else 'clean'}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        cal = self.calibration
        return {
            "tool": "kvfence probe",
            "version": REPORT_VERSION,
            "target": {
                "base_url": self.target.base_url,
                "model": self.target.model,
                "api": "chat" if self.target.chat else "completions",
            },
            "verdict": "findings" if self.findings else "clean",
            "exit_status": self.exit_status,
            "complete": self.complete,
            "elapsed_s": round(self.elapsed_s, 3),
            "calibration": {
                "context_length": cal.capacity,
                "context_length_source": cal.capacity_source,
                "token_model": {
                    "method": cal.tokens.method,
                    "base": cal.tokens.base,
                    "per_word": cal.tokens.per_word,
                    "exact": cal.tokens.exact,
                },
                "prefill_tokens_per_s": cal.prefill_tokens_per_s,
            },
            "requests": {
                "planned": self.planned,
                "sent": len(self.results),
                "outcomes": dict(self.outcomes()),
            },
            "findings": [
                {"kind": f.kind.value, "request_id": f.request_id, "message": f.message, "details": f.details}
                for f in self.findings
            ],
            "prefix_timing": {
                "num_prefix": self.timing.num_prefix,
                "num_fresh": self.timing.num_fresh,
                "median_prefix_s": self.timing.median_prefix_s,
                "median_fresh_s": self.timing.median_fresh_s,
                "p_value": self.timing.p_value,
                "significant": self.timing.significant,
            },
            "load_timing": {
                "in_flight": self.load.in_flight,
                "light_in_flight": self.load.light_in_flight,
                "num_light": self.load.num_light,
                "num_busy": self.load.num_busy,
                "median_quiet_s": self.load.median_quiet_s,
                "median_light_s": self.load.median_light_s,
                "median_busy_s": self.load.median_busy_s,
                "ratio": self.load.ratio,
                "p_value": self.load.p_value,
                "significant": self.load.significant,
            },
            "notes": self.notes,
            "results": [_result_json(r) for r in self.results],
        }


def _outcome(r: Result) -> str:
    if r.aborted:
        return "aborted by the probe"
    if r.ok:
        return "served"
    if r.rejected:
        return f"rejected ({r.status})"
    return "failed"


def _timing_line(t: TimingTest) -> str:
    if t.p_value is None or t.median_prefix_s is None or t.median_fresh_s is None:
        return f"not tested: {t.skipped}"
    return (
        f"prefix {t.median_prefix_s * 1000:.0f} ms vs fresh {t.median_fresh_s * 1000:.0f} ms (median "
        f"TTFT, {t.num_prefix} vs {t.num_fresh}), one-sided p = {t.p_value:.2g}"
    )


def _load_line(t: LoadTest) -> str:
    if t.p_value is None or t.median_light_s is None or t.median_busy_s is None or t.ratio is None:
        return f"not tested: {t.skipped}"
    idle = f"{t.median_quiet_s * 1000:.0f} ms" if t.median_quiet_s is not None else "?"
    return (
        f"B's TTFT {idle} with A idle, {t.median_light_s * 1000:.0f} ms with A's {t.light_in_flight} in flight, "
        f"{t.median_busy_s * 1000:.0f} ms with A's {t.in_flight} ({t.ratio:.1f}x, median, {t.num_light} vs "
        f"{t.num_busy}), one-sided p = {t.p_value:.2g}"
    )


def _result_json(r: Result) -> dict[str, Any]:
    j = r.job
    return {
        "id": j.id,
        "tenant": j.tenant.value,
        "kind": j.kind.value,
        "stream": j.stream,
        "max_tokens": j.max_tokens,
        "predicted_prompt_tokens": str(j.tokens),
        "expect": j.expect.value,
        "status": r.status,
        "error_code": r.error_code,
        "aborted": r.aborted,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "ttft_s": r.ttft_s,
        "latency_s": round(r.latency_s, 4),
        "reply": r.text[:200],
    }
