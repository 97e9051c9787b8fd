"""Shared fixtures: tiny generated models (seconds) and the real SmolLM2 model (skipped if not fetched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.engine.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import LoadedModel, load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import write_tiny_hf_dir

    return write_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    if not Path(DEFAULT_MODEL_PATH).exists():
        pytest.skip("default model not fetched (run `kvfence fetch-model`)")
    return load_model(DEFAULT_MODEL_PATH)


def make_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    defaults: dict[str, object] = dict(
        kv_pages=256, page_size=4, max_num_seqs=32, max_num_batched_tokens=256, seed=0
    )
    defaults.update(overrides)
    return LLMEngine(EngineConfig(model=loaded.source, **defaults), loaded=loaded)  # type: ignore[arg-type]


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
