"""The transfer digest (I3): xxh3-128 of each page's bytes, then xxh3-128 over those in logical page order.

It depends only on the bytes and their logical order, never on where pages sit in either pool, so the sender
computes it from its pages and the receiver from the frames it applied, each on its own placement.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def page_digest(payload: bytes) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def transfer_digest(page_digests: Iterable[bytes]) -> bytes:
    h = xxhash.xxh3_128()
    for d in page_digests:
        h.update(d)
    return h.digest()
