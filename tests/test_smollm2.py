"""End to end with the real default model: the CLI answers a chat prompt; a batch of chats with integrity on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfence.engine.request import SamplingParams
from tests.conftest import SERVED_DTYPE, float32_answer, make_engine, run_all

pytestmark = pytest.mark.slow

# Prompts whose float32 answers are clear of near-ties (checked by `float32_answer`): the path the server takes must
# give float32's text exactly, on every CPU. "What is the capital of France?" is not one (docs/quality.md).
FRANCE = "Complete the sentence: The capital of France is"


def test_generate_cli_answers_a_chat_prompt(smollm2):
    expected = float32_answer(smollm2, [{"role": "user", "content": FRANCE}], "Paris")
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "generate", "--chat", "--max-tokens", "24", "--threads", "2",
         "--kv-pages", "64", "--prompt", FRANCE],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert expected in proc.stdout, (expected, proc.stdout)
    assert "tokens/s" in proc.stderr and "time to first token" in proc.stderr


def test_chat_batch_on_smollm2(smollm2, smollm2_served):
    """A batch on the path the server takes here (bfloat16, kernels, int8 decode steps) gives float32's text."""
    engine = make_engine(
        smollm2_served, page_size=16, kv_pages=64, max_num_batched_tokens=512, dtype=SERVED_DTYPE
    )
    questions = {f"Complete the sentence: The capital of {c} is": a for c, a in
                 (("France", "Paris"), ("Japan", "Tokyo"), ("Germany", "Berlin"))}  # fmt: skip
    expected = [float32_answer(smollm2, [{"role": "user", "content": q}], a) for q, a in questions.items()]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    ids = [
        engine.add_request(
            smollm2_served.tokenizer.apply_chat_template([{"role": "user", "content": q}]), params
        ).request_id
        for q in questions
    ]
    final = run_all(engine)
    answers = [final[i].text for i in ids]
    assert all(a.startswith(e) for a, e in zip(answers, expected, strict=True)), (answers, expected)
    assert engine.stats.integrity_failures == 0 and engine.stats.pages_checked > 0
