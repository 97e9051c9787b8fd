"""Structured outputs: a request's grammar (a JSON schema, a regex, a choice, a Lark grammar) as a token mask per
step, with llguidance (no torch, no triton: a 3 MB wheel; docs/server.md, "Structured outputs").

The server turns `response_format` / `structured_outputs` into one llguidance grammar text (`grammar_text`) and
checks it compiles against the tokenizer (`Grammars.check`) before anything is allocated: a bad schema is a 400.
The text travels in `SamplingParams.grammar`, so a PD decode worker rebuilds the same state from it and the tokens
already generated (`GrammarState.start`): the state survives the prefill -> decode hand-off by construction.
Each engine step asks the state for the allowed tokens (`allowed`), the sampler masks the rest, and the sampled
token advances the state (`consume`); a grammar that is complete ends the request with `stop`.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from kvfence.engine.errors import InvalidSamplingParams
from kvfence.model.tokenizer import Tokenizer

CACHE_GRAMMARS = 256  # compiled-grammar checks remembered (bounded memory)
FORMATS = ("json_schema", "regex", "choice", "lark")
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def grammar_text(kind: str, spec: Any) -> str:
    """The llguidance grammar for one structured-output request: `kind` is json_schema (a schema object),
    regex (a string), choice (a list of strings) or lark (a grammar string). Raises ValueError naming the
    problem."""
    if kind not in FORMATS:
        raise ValueError(f"unknown structured output kind {kind!r}")
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise ValueError("a JSON schema must be an object")
        if "x-guidance" not in spec:  # one space after ':' and ',', none elsewhere: what models write, and a
            # model cannot spend its tokens on whitespace (llguidance's default allows any)
            spec = {**spec, "x-guidance": JSON_LAYOUT}
    text = spec if isinstance(spec, str) else json.dumps(spec)
    try:
        fmt: Any = "json" if kind == "json_schema" else kind
        return str(llguidance.grammar_from(fmt, text))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{kind}: {exc}") from exc


class Grammars:
    """The tokenizer as llguidance sees it (built once, on first use: ~0.3 s for a 49k vocabulary), compiled
    grammar checks (LRU) and fresh states. Any thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = (
            vocab_size  # the model's (may exceed the tokenizer's; the extra ids are never allowed)
        )
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.check = functools.lru_cache(maxsize=CACHE_GRAMMARS)(self._check)

    @property
    def ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(
                    tok.to_json(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
                )
            return self._ll

    def _check(self, grammar: str) -> str | None:
        """None if `grammar` compiles against this tokenizer, else the compiler's message."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        return str(error).strip() or None

    def start(self, grammar: str, generated: Sequence[int] = ()) -> GrammarState:
        """A state at the start of `grammar`, advanced over `generated` (a PD decode worker's first token)."""
        if (error := self.check(grammar)) is not None:
            raise InvalidSamplingParams("response_format", f"the grammar does not compile: {error}")
        state = GrammarState(
            llguidance.LLMatcher(self.ll, grammar), self.vocab_size, self._tokenizer.vocab_size
        )
        for token in generated:
            state.consume(token)
        return state


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer_vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = llnp.allocate_token_bitmask(1, tokenizer_vocab)
        self._tokenizer_vocab = tokenizer_vocab

    def bitmask(self) -> np.ndarray:
        """The tokens the grammar allows next (EOS once it is complete), packed: int32[ceil(tokenizer vocab /
        32)], bit t % 32 of word t // 32 set = token t allowed (what the sampler takes: kvfence/model/sampler.py).
        A fresh array: the plan keeps it while the state moves on."""
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        words: np.ndarray = self._bitmask[0].copy()
        return words

    def allowed(self) -> np.ndarray:
        """bool[vocab]: the tokens the grammar allows next, unpacked (tests, tools)."""
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")[: self._tokenizer_vocab]
        out = np.zeros(self._vocab, dtype=bool)
        out[: len(bits)] = bits.astype(bool)
        return out

    def consume(self, token: int) -> None:
        """Advance over a token the mask allowed (an error state only ends the request: `failed`)."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends with `stop`)."""
        return bool(self._matcher.is_stopped())

    @property
    def failed(self) -> str | None:
        return str(self._matcher.get_error()) or None if self._matcher.is_error() else None
