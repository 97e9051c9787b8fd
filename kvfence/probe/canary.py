"""Tenant A's secrets, and the test that decides whether a reply leaked one.

A secret is random, so a server can only ever produce it by reading the KV cache of the request that carried it.
Three forms, because tokenizers split them differently: pseudo-words (`zorvek tamuli qesdar`), digit groups
(`4829 1573 0061`) and code identifiers (`vokel_tarimu_7391`). Pseudo-words are built from syllables, never
English words, so a model does not produce them by chance.

The leak test works on letters and digits only (case and separators ignored, because a model that copies a
secret from stale KV often drops or changes them): a reply leaks a secret when it contains a run of at least
`FRAGMENT_CHARS` consecutive characters of it that the reply's own prompt does not contain. Six random
characters are one chance in ~10^6 (digits) to ~10^8 (letters) per position, so a clean server does not trip it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from enum import Enum

FRAGMENT_CHARS = 6
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


class Form(Enum):
    WORDS = "words"
    NUMBER = "number"
    IDENTIFIER = "identifier"


@dataclass(frozen=True, slots=True)
class Secret:
    text: str  # as it appears in tenant A's prompt
    form: Form

    @property
    def key(self) -> str:
        """The letters and digits of the secret, lowercased: what the leak test compares."""
        return normalize(self.text)


@dataclass(frozen=True, slots=True)
class Leak:
    secret: Secret
    fragment: str  # the normalized run found in the reply

    @property
    def complete(self) -> bool:
        return self.fragment == self.secret.key


def normalize(text: str) -> str:
    return _NON_ALNUM.sub("", text.lower())


def pseudo_word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(
        _CONSONANTS
    )


def make_secret(rng: random.Random, form: Form) -> Secret:
    if form is Form.WORDS:
        text = " ".join(pseudo_word(rng) for _ in range(3))
    elif form is Form.NUMBER:
        text = " ".join(f"{rng.randrange(10_000):04d}" for _ in range(3))
    else:
        text = f"{pseudo_word(rng, 2)}_{pseudo_word(rng, 2)}_{rng.randrange(1000, 10_000)}"
    return Secret(text, form)


def find_leak(secret: Secret, reply: str, own_prompt: str = "") -> Leak | None:
    """The longest run of the secret's characters in `reply` (at least FRAGMENT_CHARS long, or the whole secret
    if it is shorter) that `own_prompt` does not contain; None when there is none."""
    key, text, own = secret.key, normalize(reply), normalize(own_prompt)
    need = min(FRAGMENT_CHARS, len(key))
    if not key or len(text) < need:
        return None
    for length in range(len(key), need - 1, -1):  # longest first: report the most telling fragment
        for start in range(len(key) - length + 1):
            piece = key[start : start + length]
            if piece in text and piece not in own:
                return Leak(secret, piece)
    return None
