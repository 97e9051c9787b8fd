"""Shared fixtures: tiny generated models (seconds) and the real SmolLM2 model (skipped if not fetched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.faults import Faults
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import LoadedModel, load_model
from kvfence.options import resolve_dtype

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import write_tiny_hf_dir

    return write_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir)


def require_default_model() -> Path:
    """The default model's path, or a skip that says how to get it (`make test` fetches it first)."""
    if not Path(DEFAULT_MODEL_PATH).exists():
        pytest.skip("default model not fetched: run `kvfence fetch-model` (`make test` does it first)")
    return Path(DEFAULT_MODEL_PATH)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(require_default_model())


SERVED_DTYPE = resolve_dtype("auto", "cpu")  # what `kvfence serve` computes in here (bfloat16 on AVX512-BF16)


@pytest.fixture(scope="session")
def smollm2_served() -> LoadedModel:
    """The default model as the shipped server loads it here: in SERVED_DTYPE, with its blocks for the kernels.
    Engines on it need `dtype=SERVED_DTYPE`."""
    return load_model(require_default_model(), dtype=getattr(torch, SERVED_DTYPE))


MIN_GAP = 1.0  # logits: 4x the largest float32 gap at which a fast path's top token flipped (docs/quality.md)


def float32_answer(
    loaded: LoadedModel, messages: list[dict[str, str]], answer: str, max_tokens: int = 16
) -> str:
    """Float32's greedy reply to a chat, up to and including `answer`, after checking that every greedy choice on
    the way is at least MIN_GAP logits ahead of the runner-up. An exact-text test may expect only such text: at a
    near-tie the fast paths pick either token, and which one depends on the CPU (issue 20: "What is the capital of
    France?" starts 0.08 logits from "L'Étoile" and answered that on an Intel CPU with AMX)."""
    from kvfence.model.quality import float32_greedy

    tok = loaded.tokenizer
    tokens, gaps = float32_greedy(loaded, tok.encode(tok.apply_chat_template(messages)), max_tokens)
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n])
        if answer in text:
            near = [
                (tok.decode([t]), round(g, 2))
                for t, g in zip(tokens[:n], gaps[:n], strict=True)
                if g < MIN_GAP
            ]
            assert not near, (
                f"a near-tie on the way to {answer!r}: {near}; choose a prompt with clear margins"
            )
            return text
    raise AssertionError(f"float32 does not answer {answer!r} in {max_tokens} tokens: {tok.decode(tokens)!r}")


def make_engine(loaded: LoadedModel, faults: Faults | None = None, **overrides: object) -> LLMEngine:
    """An engine on `loaded` with the tree's defaults but a small pool and float32 (the tests' references);
    `overrides` are fields of the configuration tree by name (`Config.of`)."""
    values: dict[str, object] = dict(
        dtype="float32", kv_pages=256, page_size=4, max_num_seqs=32, max_num_batched_tokens=256
    )
    values.update(overrides)
    return LLMEngine(Config.of(model=str(loaded.source), **values), loaded=loaded, faults=faults)


def run_all(engine: LLMEngine, pool_only: bool = False) -> dict[str, RequestOutput]:
    """Step the engine until idle, checking integrity after every step; final output per request.
    `pool_only`: check only the pool's own invariants (for runs where a fault knob breaks ownership on purpose
    and the integrity checks are off, so the engine-level lease check would flag the injected fault itself)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.pool.check_integrity() if pool_only else engine.check_integrity()
    stats = engine.pool.stats()
    assert stats.num_free == stats.num_pages, f"pages leaked: {stats}"
    return final
