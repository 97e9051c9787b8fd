"""Token sampling for a batch of rows, each with its own parameters.

Greedy rows take the argmax. Other rows: temperature, then top-k, then top-p, then an exponential race
(argmax of p / Exp(1) noise, equivalent to multinomial sampling). Rows with a seed draw their noise from a
generator seeded by (seed, number of tokens generated so far), so a seeded request produces the same tokens
whether it runs alone, in a batch, or after a preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvfence.engine.request import SamplingParams


class Sampler:
    def __init__(self, device: str | torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def __call__(
        self, logits: Tensor, params: Sequence[SamplingParams], num_generated: Sequence[int]
    ) -> tuple[Tensor, Tensor | None]:
        """logits [N, V] float32 -> (token ids [N], log-probabilities [N, V] of the raw distribution, computed
        only when some row asked for logprobs)."""
        want = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want else None
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=self._row_generator(params[i], num_generated[i]))
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens, logprobs

    def _row_generator(self, p: SamplingParams, num_generated: int) -> torch.Generator:
        if p.seed is None:
            return self._generator
        g = torch.Generator(device=self.device)
        g.manual_seed((p.seed * 1_000_003 + num_generated) % (1 << 63))
        return g

    @staticmethod
    def _filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        # logits: [R, V]
        temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        if any(p.top_k is not None for p in params):
            vocab = logits.shape[-1]
            ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # drop a token if the tokens ranked above it already cover top_p
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        return probs
