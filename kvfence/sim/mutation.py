"""The mutation check: each fault knob that reintroduces a historical bug, armed inside the simulator with the
integrity checks off (--no-integrity-checks), must make the simulator report a violation. A simulator that
cannot fail proves nothing."""

from __future__ import annotations

from collections.abc import Iterable

from kvfence.sim.cluster import Violation, run_seed

# knob -> arming spec. Counts are large so the bug happens in most scenarios of a seed.
MUTANTS = {
    "placeholder_prefill": "placeholder_prefill=1000",
    "stale_frame": "stale_frame=1000",
    "corrupt_frame": "corrupt_frame=1000",
    "free_on_timeout": "free_on_timeout=1000",
    "reuse_transfer_id": "reuse_transfer_id=1000",
    "double_lease": "double_lease=1000",
    "drop_write": "drop_write=1000",
}


def find_violation(knob: str, seeds: Iterable[int]) -> tuple[int, str] | None:
    """The first seed (and its violation) that catches mutant `knob`; None if none does."""
    for seed in seeds:
        try:
            run_seed(seed, checks=False, faults=MUTANTS[knob])
        except Violation as exc:
            return seed, str(exc)
    return None
