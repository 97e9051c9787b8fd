"""End to end with the real default model: the CLI answers a chat prompt; a batch of chats with integrity on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfence.engine.request import SamplingParams
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from tests.conftest import make_engine, run_all

pytestmark = pytest.mark.slow


def test_generate_cli_answers_a_chat_prompt():
    if not DEFAULT_MODEL_PATH.exists():
        pytest.skip("default model not fetched")
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "generate", "--chat", "--max-tokens", "24", "--threads", "2",
         "--kv-pages", "64", "--prompt", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr and "time to first token" in proc.stderr


def test_chat_batch_on_smollm2(smollm2):
    engine = make_engine(smollm2, page_size=16, kv_pages=64, max_num_batched_tokens=512)
    questions = ["What is the capital of France?", "What is the capital of Japan?", "What is 2 + 2?"]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    ids = [
        engine.add_request(
            smollm2.tokenizer.apply_chat_template([{"role": "user", "content": q}]), params
        ).request_id
        for q in questions
    ]
    final = run_all(engine)
    answers = [final[i].text for i in ids]
    assert "Paris" in answers[0] and "Tokyo" in answers[1] and "4" in answers[2], answers
    assert engine.stats.integrity_failures == 0 and engine.stats.pages_checked > 0
