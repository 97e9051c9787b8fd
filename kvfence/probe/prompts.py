"""The probe's prompts, and how many tokens each one is, without the server's tokenizer.

Every prompt is built from three parts:

- a fixed header word (`Notes:`), so that every filler word after it is space-prefixed;
- filler: common English words, each a single token in the usual BPE and SentencePiece vocabularies. Tokenizers
  split text at spaces before merging, so a filler's token count does not depend on word order: a shuffled
  filler is a different prompt of the same length (the prefix-cache timing probe needs exactly that);
- a tail: tenant A's canary lines (`Secret code: <secret>`, three times, then `Secret code:`), or tenant B's
  trigger (`Secret code:` alone). A model that reads A's KV through B's request continues B's trigger with A's
  secret: small models copy repeated patterns far more reliably than they follow instructions.

`TokenModel` says how many tokens a prompt of `n` filler words has: `base + per_word * n`, fitted from the
server's own counts (`/tokenize`, or `usage.prompt_tokens` of calibration requests). When the fit is exact
(integral slope, a third point on the line) prompt lengths are exact; otherwise they carry a 20% tolerance. With no
counts at all, `char_bounds` gives loose bounds from characters alone (a token is 1 to 12 characters), which
still catches a server that reports one token for a long prompt.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvfence.probe.canary import Secret

HEADER = "Notes:"
TRIGGER = "Secret code:"
MAX_CHARS_PER_TOKEN = 12
TEMPLATE_SLACK = 64  # tokens a chat template or BOS may add around a prompt
APPROX_SLACK = 0.2  # a fitted, inexact model: filler words cost different numbers of tokens
_FILLER = (
    "the time water people house world river light music table paper story money night field horse "
    "garden window market city road family school friend letter winter summer morning evening bread "
    "stone glass forest island mountain ocean village station office doctor teacher animal flower "
    "color number country language moment picture problem question answer history power voice heart "
    "kitchen street season weather camera bottle button circle corner"
)
FILLER_WORDS = tuple(_FILLER.split())


@dataclass(frozen=True, slots=True)
class TokenRange:
    lo: int
    hi: int

    @property
    def exact(self) -> bool:
        return self.lo == self.hi

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and self.lo <= n <= self.hi

    def __str__(self) -> str:
        return str(self.lo) if self.exact else f"{self.lo}-{self.hi}"


@dataclass(frozen=True, slots=True)
class TokenModel:
    method: str  # "tokenize" | "usage" | "char_bounds"
    base: float  # tokens of a filler prompt with no filler words (header, trigger, template)
    per_word: float  # tokens per filler word
    exact: bool

    def words_for(self, tokens: int) -> int:
        """Filler words for a B prompt of `tokens` tokens (exact when the model is)."""
        return max(1, round((tokens - self.base) / self.per_word))

    def filler_range(self, words: int) -> TokenRange:
        """Expected tokens of a B prompt (header + `words` filler + trigger)."""
        mid = self.base + self.per_word * words
        if self.exact:
            return TokenRange(round(mid), round(mid))
        slack = max(3.0, APPROX_SLACK * mid)
        return TokenRange(max(1, math.floor(mid - slack)), math.ceil(mid + slack))

    def prompt_range(self, prompt: str, words: int) -> TokenRange:
        """Expected tokens of a B prompt with `words` filler words: the fit, or character bounds without one."""
        return char_bounds(prompt) if self.method == "char_bounds" else self.filler_range(words)

    def text_range(self, text: str) -> TokenRange:
        """Loose bounds for any prompt whose tokenization we cannot predict (tenant A's secrets)."""
        return char_bounds(text)


def char_bounds(text: str) -> TokenRange:
    return TokenRange(max(1, len(text) // MAX_CHARS_PER_TOKEN), len(text) + TEMPLATE_SLACK)


CHAR_MODEL = TokenModel("char_bounds", base=4.0, per_word=1.0, exact=False)


def fit(method: str, points: list[tuple[int, int]]) -> TokenModel | None:
    """A TokenModel through (words, tokens) points (at least two, distinct word counts); exact when the slope is
    integral and every point lies on the line. None when the points describe no usable line."""
    (w0, t0), (w1, t1) = points[0], points[-1]
    if w1 == w0 or t1 <= t0:
        return None
    slope = (t1 - t0) / (w1 - w0)
    base = t0 - slope * w0
    on_line = all(abs(base + slope * w - t) < 1e-6 for w, t in points)
    exact = on_line and len(points) >= 3 and slope == int(slope)
    return TokenModel(method, base, slope, exact)


def filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(words))


def shuffled(rng: random.Random, text: str) -> str:
    """The same words in another order: a prompt of the same token count that shares no prefix."""
    words = text.split(" ")
    for _ in range(8):
        rng.shuffle(words)
        if words[:2] != text.split(" ")[:2]:
            break
    return " ".join(words)


def b_prompt(body: str) -> str:
    """Tenant B: header, filler, trigger."""
    return f"{HEADER} {body}\n{TRIGGER}" if body else f"{HEADER}\n{TRIGGER}"


def a_prompt(secret: Secret, preamble: str = "") -> str:
    """Tenant A: an optional filler preamble (the prefix B's timing probes reuse), then the canary lines."""
    lines = "".join(f"{TRIGGER} {secret.text}\n" for _ in range(3)) + TRIGGER
    return f"{HEADER} {preamble}\n{lines}" if preamble else lines
