"""What a simulated run is: its configuration (cluster shape, network faults, load, timeouts), drawn from a seed,
and the clients whose requests it submits. The simulation itself is kvfence/sim/cluster.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

from kvfence.config import PDOptions
from kvfence.engine.fairness import TenantShare
from kvfence.engine.output import RequestOutput

KNOBS = ("placeholder_prefill", "stale_frame", "corrupt_frame", "free_on_timeout", "reuse_transfer_id",
         "die_mid_transfer", "skip_stamp", "drop_write", "double_lease")  # fmt: skip
# Knobs that break the pool's bookkeeping themselves (a page leased twice, a reservation whose pages were freed):
# with them armed and the checks on, the simulator checks what the checks must still guarantee (no foreign read,
# no wrong token, every request ends), not the bookkeeping invariants the knob breaks on purpose.
BOOKKEEPING_KNOBS = ("double_lease", "free_on_timeout")


@dataclass
class SimConfig:
    seed: int
    num_prefill: int = 2
    num_decode: int = 1
    prefill_pages: int = 24
    decode_pages: int = 24
    page_size: int = 4
    context_length: int = 64
    num_requests: int = 8
    max_prompt: int = 30
    max_tokens: int = 5
    p_drop: float = 0.0  # data plane only
    p_dup: float = 0.0
    max_delay_s: float = 0.005  # data plane latency is uniform in [0, max_delay_s]: reordering
    p_abort: float = 0.1
    crashes: int = 0
    checks: bool = True  # the engines' I1 checks and the receivers' checks (--no-integrity-checks when False)
    faults: str = ""  # "knob=count,..." armed on every worker engine and the router
    # I10: the first decode worker is compromised (a member with a stolen key): for every request placed on
    # another decode worker it sends the router a forged final output and the prefill a ticket of its own
    rogue: bool = False
    window: int = 2
    policy: str = "vtc"  # the workers' --scheduling-policy
    # tenant -> {"weight", "min_pages", "max_pages"}: the router's keys file, sent to the workers at registration
    shares: dict[str, dict[str, Any]] = field(default_factory=dict)
    flood: bool = False  # tenant-a submits all its requests first, tenant-b a moment later (fairness tests)
    # prefill workers' steps of more than INTERRUPT_TOKENS prompt tokens stop at random between rows, as for a
    # newcomer tenant's request (engine/llm_engine.py, `_interruptible`): their partial writes under every check
    interrupts: bool = False
    transfer_timeout_s: float = 1.5
    prefill_timeout_s: float = 3.0
    dead_after_s: float = 1.2
    submit_until_s: float = 2.0
    horizon_s: float = 30.0

    @classmethod
    def from_seed(cls, seed: int, **overrides: Any) -> SimConfig:
        """A random but reproducible scenario: network, pool sizes, load, aborts and crashes vary with the seed."""
        rng = random.Random(seed)
        lossy = rng.random() < 0.5
        config = cls(
            seed=seed,
            num_prefill=rng.choice([1, 2, 2]),
            num_decode=rng.choice([1, 1, 2]),
            prefill_pages=rng.choice([10, 16, 24]),
            decode_pages=rng.choice([10, 16, 24]),
            num_requests=rng.randint(3, 10),
            max_prompt=rng.choice([8, 20, 36]),
            max_tokens=rng.randint(1, 6),
            p_drop=rng.choice([0.02, 0.1]) if lossy else 0.0,
            p_dup=rng.choice([0.02, 0.1]) if lossy else 0.0,
            max_delay_s=rng.choice([0.0005, 0.005, 0.05]),
            p_abort=rng.choice([0.0, 0.1, 0.3]),
            crashes=rng.choice([0, 0, 0, 1]),
            window=rng.choice([1, 2, 8]),
        )
        if rng.random() < 0.35:  # a fault knob armed, with every check on: victims fail, invariants hold
            config.faults = f"{rng.choice(KNOBS)}={rng.randint(1, 3)}"
        # fairness (drawn last: the draws above, and so every earlier seed's scenario, are unchanged)
        config.policy = rng.choice(["vtc", "vtc", "fcfs"])
        if config.policy == "vtc" and rng.random() < 0.5:
            small = min(config.prefill_pages, config.decode_pages)
            config.shares = {
                "tenant-a": {"weight": 1.0, "max_pages": rng.randint(small // 2, small)},
                "tenant-b": {"weight": rng.choice([1.0, 2.0, 4.0]), "min_pages": rng.randint(0, small // 3)},
            }
        config.interrupts = config.policy == "vtc" and rng.random() < 0.5
        names = {f.name for f in fields(cls)}
        for key, value in overrides.items():
            assert key in names, key
            setattr(config, key, value)
        small = min(config.prefill_pages, config.decode_pages)
        guaranteed = sum(share.get("min_pages", 0) for share in config.shares.values())
        if "shares" not in overrides and (config.policy != "vtc" or guaranteed > small):
            config.shares = {}  # the drawn shares do not fit the overrides: the router would refuse every worker
        return config

    def tenant_shares(self) -> dict[str, TenantShare]:
        return {tenant: TenantShare(**share) for tenant, share in self.shares.items()}

    def pd_options(self) -> PDOptions:
        """The workers' transfer window and timeouts: smaller than a real cluster's, so runs end quickly."""
        return PDOptions(
            transfer_window=self.window,
            transfer_timeout=self.transfer_timeout_s,
            prefill_timeout=self.prefill_timeout_s,
        )


@dataclass
class Client:
    request_id: str
    tenant: str
    prompt: list[int]
    max_tokens: int
    outputs: list[RequestOutput] = field(default_factory=list)
    rejected: str | None = None

    @property
    def ended(self) -> bool:
        return self.rejected is not None or any(o.finished for o in self.outputs)
