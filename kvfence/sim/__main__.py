"""`python -m kvfence.sim`: run seeds, replay one with its event trace, or run the mutation check.

python -m kvfence.sim --seeds 0:2000                 every seed must hold every invariant
python -m kvfence.sim --seed 17 --trace t.jsonl      replay one seed and write its event trace
python -m kvfence.sim --mutate placeholder_prefill   the knob armed, checks off: a violation must show
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvfence.sim.cluster import Violation, replay_command, run_seed
from kvfence.sim.mutation import MUTANTS, find_violation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfence.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seed", type=int, help="run (replay) one seed")
    p.add_argument("--seeds", default="0:200", help="a range of seeds, start:stop")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=JSON", help="override a SimConfig field"
    )
    p.add_argument("--trace", help="write the event trace (JSON lines) of --seed here")
    p.add_argument("--mutate", choices=sorted(MUTANTS), help="arm a fault knob with the checks off")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    if args.mutate:
        start, stop = (int(x) for x in args.seeds.split(":"))
        found = find_violation(args.mutate, range(start, stop))
        if found is None:
            print(f"mutant {args.mutate}: no violation in seeds {args.seeds}: the simulator missed it")
            return 1
        seed, message = found
        print(f"mutant {args.mutate}: caught by seed {seed}: {message}")
        return 0
    if args.seed is not None:
        records: list[dict[str, Any]] = []
        try:
            print(json.dumps(run_seed(args.seed, records.append, **overrides)))
            code = 0
        except Violation as exc:
            print(f"seed {args.seed}: VIOLATION: {exc}")
            code = 1
        if args.trace:
            with open(args.trace, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            print(f"{len(records)} events -> {args.trace}")
        return code
    start, stop = (int(x) for x in args.seeds.split(":"))
    t0, events = time.perf_counter(), 0
    for seed in range(start, stop):
        try:
            events += run_seed(seed, **overrides)["events"]
        except Violation as exc:
            print(f"seed {seed}: VIOLATION: {exc}\nreplay: {replay_command(seed, **overrides)}")
            return 1
    print(f"{stop - start} seeds, {events} events, no violation ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
