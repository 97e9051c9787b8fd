"""Fault knobs that reintroduce historical KV-cache bugs, for tests and demos. All off by default.

Each knob names the real bug class it recreates (see ../docs/faults.md). They exist so that tests can prove the
integrity machinery catches what it claims to catch: turn a knob on, and the victim request must fail with
`kv_integrity_error`; turn the integrity check off as well, and the same scenario must visibly corrupt output.

Knobs are counters, not booleans: `double_lease=1` fires once, on the next eligible event, then disarms itself, so
a test decides exactly which request becomes the victim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class Faults:
    # Allocator hands a page that a live request still leases to the next allocation ("free while in use").
    double_lease: int = 0
    # A KV write lands but the page's tag is not stamped (a writer that bypasses the tagging path).
    skip_stamp: int = 0
    # A KV write for one page is silently dropped while the step reports success ("prefill wrote 1 of 8 pages").
    drop_write: int = 0
    # PD prefill believes the prompt is one page (the 2026 incident's 1-token placeholder) and says so.
    placeholder_prefill: int = 0
    # PD: one page frame's payload is garbled in flight (a bit flipped in every byte).
    corrupt_frame: int = 0
    # PD decode: a timed-out transfer's pages are freed without revoking the transfer (late frames still land).
    free_on_timeout: int = 0
    # PD router: the next request gets the previous request's transfer id (a metadata collision).
    reuse_transfer_id: int = 0
    # PD prefill: frames carry pages the request does not hold (stale KV shipped as the request's own).
    stale_frame: int = 0
    # PD prefill worker: the process exits abruptly after sending its first page frame (kill -9 mid-transfer).
    die_mid_transfer: int = 0

    # PD router: a request's outputs and errors are taken from any registered worker, not only the ones it was
    # placed on (a cluster without I10's binding: a member, or a process that joined, answers for others).
    unbound_outputs: int = 0
    # PD prefill: a transfer's pages go to whoever presents its ticket, not only the decode worker the router
    # named (a stolen transfer id is enough to read a tenant's KV).
    unbound_tickets: int = 0

    # Prefix cache: the next request's cache keys leave out its tenant, so its pages are shared with every tenant
    # (the historical cross-tenant prefix-cache bug, a time-to-first-token side channel and a KV leak).
    shared_prefix_cache: int = 0

    def fire(self, name: str) -> bool:
        """Consume one shot of knob `name`; True if the fault should happen now."""
        left: int = getattr(self, name)
        if left <= 0:
            return False
        setattr(self, name, left - 1)
        return True

    @property
    def any_armed(self) -> bool:
        return any(getattr(self, f.name) > 0 for f in fields(self))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Knobs armed from a spec like "double_lease=1,drop_write=2": the `faults` option of the configuration
        tree (`--faults`, or KVFENCE_FAULTS, which feeds it; debug/test only)."""
        faults = cls()
        faults.arm(spec)
        return faults

    def arm(self, spec: str) -> None:
        """Add shots from a spec like "double_lease=1,drop_write=2" (a bare name is one shot)."""
        items = [(name, int(count or 1)) for name, _, count in
                 (s.strip().partition("=") for s in spec.split(",") if s.strip())]  # fmt: skip
        for name, _ in items:
            if name not in {f.name for f in fields(self)}:
                raise ValueError(f"unknown fault knob {name!r}")
        for name, count in items:
            setattr(self, name, getattr(self, name) + count)
