"""The sampler's greedy pick (kvfence/model/sampler.py): the first of tied maxima, as `argmax`, on the row
lengths and batch sizes the engine runs; a row with a NaN gives its first NaN's index, as `argmax` does, and is
reported as broken (the engine fails its request)."""

from __future__ import annotations

import torch

from kvfence.engine.request import SamplingParams
from kvfence.model.sampler import Sampler


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    gen = torch.Generator().manual_seed(25)
    sampler = Sampler("cpu")
    for rows, vocab in ((1, 49_152), (7, 49_152), (32, 49_152), (64, 151_936), (3, 17)):
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()  # many ties
        logits[0, : vocab // 2] = float("-inf")
        logits[-1, vocab // 3] = float("nan")
        logits[-1, vocab // 2] = float("nan")
        tokens, _, broken = sampler(logits, [SamplingParams(temperature=0.0)] * rows, [0] * rows)
        assert tokens.tolist() == logits.argmax(dim=-1).tolist() and broken == [rows - 1]
        first = [int((row == row.max()).nonzero()[0]) for row in logits[:-1]]
        assert tokens[:-1].tolist() == first and int(tokens[-1]) == vocab // 3


def test_rows_with_a_nan_or_plus_inf_are_reported_whatever_their_sampling():
    sampler = Sampler("cpu", seed=3)
    logits = torch.randn(5, 1_000, generator=torch.Generator().manual_seed(4))
    logits[1, 17] = float("nan")
    logits[3, 900] = float("inf")
    logits[4, :999] = float("-inf")  # a grammar's mask: one token left, not broken
    params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 0.0, 1.0, 0.7)]
    _, _, broken = sampler(logits, params, [0] * 5)
    assert broken == [1, 3]
