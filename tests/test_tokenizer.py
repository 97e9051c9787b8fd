"""Tokenizer: GGUF and Hugging Face construction, special tokens, chat templates, streaming detokenization.

The SmolLM2 tests read only the tokenizer metadata of the real GGUF file (about a second) and are skipped when
the file is absent. Their ground truth is llama.cpp's fingerprint of the Hugging Face SmolLM tokenizer: the
SHA-256 of the ids it gives for a fixed probe text (`chkhsh` in llama.cpp's `convert_hf_to_gguf.py`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import load_tokenizer
from kvfence.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests import model_factory as mf

SAMPLES = [
    "Hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\nruns      of spaces",
    "digits 1234567890 and 3.14159, 2024-01-01",
    "naïve café, Grüße, ¿qué?",
    "日本語のテキスト、中文，한국어",
    "emoji 🚀🦙 and zwj 😶\u200d🌫️ families 👨\u200d👩\u200d👧",
    "code: def f(x):\n    return x**2  # comment",
    "",
]
# llama.cpp's pre-tokenizer probe text and the hash it recorded for HuggingFaceTB/SmolLM-135M (`smollm`).
LLAMA_CPP_CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n"
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"


@pytest.fixture(scope="module")
def tiny_gguf_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(mf.write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf"))


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.write_tiny_hf_dir(tmp_path_factory.mktemp("tok") / "hf")


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if not DEFAULT_MODEL_PATH.is_file():
        pytest.skip("default model not fetched (run `kvfence fetch-model`)")
    return load_tokenizer(DEFAULT_MODEL_PATH)


def stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    sizes = iter(chunks or [])
    deltas, i = [], 0
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


# -- tiny tokenizer: GGUF and HF directory agree ---------------------------------------------------------


def test_gguf_tokenizer_matches_the_original(tiny_gguf_tok: Tokenizer, tiny_hf_dir: Path) -> None:
    hf = Tokenizer.from_hf_dir(tiny_hf_dir)
    raw = mf.tiny_tokenizer()
    for text in [*SAMPLES, "<|im_start|>user\n12 apples<|im_end|>"]:
        expected = raw.encode(text).ids
        assert tiny_gguf_tok.encode(text) == expected
        assert hf.encode(text) == expected
    assert (hf.bos_token_id, hf.eos_token_ids) == (tiny_gguf_tok.bos_token_id, tiny_gguf_tok.eos_token_ids)
    assert hf.chat_template == tiny_gguf_tok.chat_template == mf.CHAT_TEMPLATE
    assert hf.vocab_size == tiny_gguf_tok.vocab_size == 384


@pytest.mark.parametrize("text", SAMPLES)
def test_tiny_roundtrip(tiny_gguf_tok: Tokenizer, text: str) -> None:
    assert tiny_gguf_tok.decode(tiny_gguf_tok.encode(text)) == text


def test_special_tokens_and_bos(tiny_gguf_tok: Tokenizer, tiny_hf_dir: Path, tmp_path: Path) -> None:
    ids = tiny_gguf_tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny_gguf_tok.decode(ids) == "hi"
    assert tiny_gguf_tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tiny_gguf_tok.encode("hi", add_special_tokens=True) == tiny_gguf_tok.encode("hi")  # add_bos false

    cfg = json.loads((tiny_hf_dir / "tokenizer_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_hf_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert tok.eos_token_ids == (2, 0)


# -- chat templates ---------------------------------------------------------------------------------------


def test_chat_template(tiny_gguf_tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny_gguf_tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny_gguf_tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chat_template_errors(tiny_gguf_tok: Tokenizer, tiny_hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        tiny_gguf_tok.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer.json").write_bytes((tiny_hf_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_hf_dir(tmp_path)  # no tokenizer_config.json: no template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins(tiny_hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_hf_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'user' %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}\n"
        "  {% endif %}\n"
        "{% endfor %}"
    )
    # trim_blocks/lstrip_blocks drop the newlines and indentation around the tags, as in transformers.
    out = Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert out == "<|im_start|>x<|im_end|>\n"


# -- incremental detokenization ---------------------------------------------------------------------------


def test_incremental_holds_back_split_characters(tiny_gguf_tok: Tokenizer) -> None:
    text = "ok 🦙 done"
    ids = tiny_gguf_tok.encode(text)
    assert any("\ufffd" in tiny_gguf_tok.decode([i]) for i in ids), "the emoji should span several tokens"
    deltas = stream(tiny_gguf_tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_flush_releases_an_incomplete_tail(tiny_gguf_tok: Tokenizer) -> None:
    ids = tiny_gguf_tok.encode("a🦙")[:-1]  # the stream stopped mid-character
    detok = IncrementalDetokenizer(tiny_gguf_tok)
    assert [detok.push([i]) for i in ids] == ["a"] + [""] * (len(ids) - 1)
    assert detok.flush() == tiny_gguf_tok.decode(ids)[1:]
    assert detok.text == tiny_gguf_tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), chunks=st.lists(st.integers(1, 4), max_size=40))
def test_incremental_equals_full_decode(tiny_gguf_tok: Tokenizer, text: str, chunks: list[int]) -> None:
    ids = tiny_gguf_tok.encode(text)
    assert "".join(stream(tiny_gguf_tok, ids, chunks)) == tiny_gguf_tok.decode(ids) == text


# -- the real SmolLM2 tokenizer ---------------------------------------------------------------------------


def test_smollm2_matches_llama_cpp_fingerprint(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(LLAMA_CPP_CHKTXT)
    assert hashlib.sha256(str(ids).encode()).hexdigest() == SMOLLM_CHKHSH


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert smollm2.decode(ids) == "user\nHi"
    assert (smollm2.bos_token_id, smollm2.eos_token_ids, smollm2.vocab_size) == (1, (2,), 49152)
    assert smollm2.encode("Hello world") == [19556, 905]  # regression value, consistent with the fingerprint


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_roundtrip(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_smollm2_splits_digits(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("12345")
    assert [smollm2.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    assert [smollm2.decode([i]) for i in smollm2.encode("year 2024")][-4:] == ["2", "0", "2", "4"]


def test_smollm2_chat_template(smollm2: Tokenizer) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_smollm2_incremental(smollm2: Tokenizer) -> None:
    text = "Grüße aus Zürich! 世界へ 🚀🦙 — naïve “quotes” ∑x²"
    ids = smollm2.encode(text)
    assert any("\ufffd" in smollm2.decode([i]) for i in ids), "some character should span several tokens"
    for chunks in (None, [2, 3, 1, 5, 2, 4, 1, 3]):
        assert "".join(stream(smollm2, ids, chunks)) == text
