"""The simulated processes: the real router core and real worker roles, each with the simulated network as its
transport. Their engines are real `LLMEngine`s whose model runner is the provenance runner (kvfence/sim/runner.py).
Every message goes through the real encodings (`control.encode`, `wire.encode`) on its way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import tokenizers

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.model_runner import ModelRunner
from kvfence.faults import Faults
from kvfence.model.config import ModelConfig
from kvfence.model.loader import LoadedModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.pd import control, wire
from kvfence.pd.control import ControlMessage
from kvfence.pd.decode_role import DecodeRole
from kvfence.pd.messages import Message, Ticket
from kvfence.pd.prefill_role import PrefillRole
from kvfence.pd.roles import Role
from kvfence.pd.router_core import RouterCore
from kvfence.pd.worker import fingerprint
from kvfence.sim.runner import ProvenanceRunner
from kvfence.sim.scenario import SimConfig

VOCAB = 64
INTERRUPT_TOKENS = 8  # SimConfig.interrupts: steps with more prompt tokens than this may be interrupted
P_INTERRUPT = 0.3  # ... and each time such a step asks, it is
ROUTER = "router"


class Crash(Exception):
    """Raised inside a role to end its worker at once (the die_mid_transfer knob)."""


class Network(Protocol):
    """What the simulated processes see of the simulation: its clock and its two planes."""

    cfg: SimConfig

    def now(self) -> float: ...
    def send_control(self, src: str, dst: str, packed: bytes) -> None: ...
    def send_data(self, src: str, dst: str, frames: list[bytes]) -> None: ...
    def note_start(self, node: str, request_id: str) -> None: ...


def sim_model() -> LoadedModel:
    """Model config and tokenizer for engines whose runner is the provenance runner (no weights)."""
    vocab = {"<|endoftext|>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer = Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos=False, chat_template=None)
    config = ModelConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
        context_length=128, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
        eos_token_ids=(2,), name="sim",
    )  # fmt: skip
    return LoadedModel(config, {}, tokenizer, "sim")


def make_engine(
    cfg: SimConfig, num_pages: int, faults: Faults, lease_prefix: int
) -> tuple[LLMEngine, ProvenanceRunner]:
    runner = ProvenanceRunner(num_pages, cfg.page_size, VOCAB, faults)
    config = Config.of(
        model="sim", dtype="float32", page_size=cfg.page_size, kv_pages=num_pages,
        context_length=cfg.context_length, max_num_seqs=8, max_num_batched_tokens=32, integrity_checks=cfg.checks,
        lease_prefix=lease_prefix, enable_prefix_cache=False, policy=cfg.policy,
        **({"prefill_batch_tokens": INTERRUPT_TOKENS} if cfg.interrupts else {}),
    )  # fmt: skip
    return LLMEngine(config, sim_model(), runner=cast(ModelRunner, runner), faults=faults), runner


class SimPrefillRole(PrefillRole):
    def die(self) -> None:
        raise Crash("die_mid_transfer")


@dataclass
class SimWorker:
    """A worker process: a role and its engine, with the simulator as its transport."""

    name: str
    kind: str  # "prefill" | "decode"
    sim: Network
    engine: LLMEngine
    runner: ProvenanceRunner
    role: Role = field(init=False)
    alive: bool = True

    def __post_init__(self) -> None:
        options = self.sim.cfg.pd_options()
        if self.kind == "prefill":
            self.role = SimPrefillRole(self.engine, self, options, self.sim.now)
        else:
            self.role = DecodeRole(self.engine, self, options, self.sim.now)

    # Transport
    def send_control(self, message: ControlMessage) -> None:
        self.sim.send_control(self.name, ROUTER, control.encode(message))

    def send_data(self, peer: Any, message: Message) -> None:
        if isinstance(message, Ticket):  # a decode worker's scheduling decision: it reserved this request
            self.sim.note_start(self.name, message.request_id)
        self.sim.send_data(self.name, str(peer), wire.encode(message))

    def connect(self, data_addr: str, principal: str = "") -> Any:
        return node_of(data_addr)

    def principal(self, peer: Any) -> str:
        return str(peer)  # the simulated network names every sender truthfully (as CURVE would)

    def control_handlers(self) -> dict[type[ControlMessage], control.Handler]:
        """Registration only: a simulated worker stays up when refused or told to shut down."""
        return {
            control.Reregister: lambda msg: self.register(),
            control.Registered: lambda msg: self.engine.set_tenants(msg.tenants),
            control.Refused: control.ignore,
            control.Ping: control.ignore,
            control.Shutdown: control.ignore,
        }

    def register(self) -> None:
        fp = fingerprint(self.engine)
        self.send_control(control.Register(self.kind, fp, data_addr=f"tcp://{self.name}:7000", pid=0))


class SimRouter(RouterCore):
    def __init__(self, sim: Network, dead_after_s: float, faults: Faults, tid_prefix: int) -> None:
        tenants = sim.cfg.tenant_shares()
        super().__init__(dead_after_s, faults, clock=sim.now, tid_prefix=tid_prefix, tenants=tenants)
        self.sim = sim

    def _send(self, identity: bytes, message: ControlMessage) -> None:
        self.sim.send_control(ROUTER, identity.decode(), control.encode(message))


def node_of(data_addr: str) -> str:
    """The simulated node a data address names (tcp://NAME:PORT, as a real prefill registers it)."""
    return data_addr.removeprefix("tcp://").rsplit(":", 1)[0]
