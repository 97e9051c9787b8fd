"""The model runner: turns a `Plan` into tensors, runs one forward step, samples, and reports what it wrote.

Boundary: the only engine module that touches torch. It owns the model and the KV tensors (`PagedKV`) and
writes K/V only at the slots the plan's block tables give it. It reports, per request, which pages it actually
wrote, so the engine stamps tags from the write path itself rather than from the plan's intentions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.engine.plan import Plan, PlanRow, StepInterrupted, StepResult, Stop
from kvfence.faults import Faults
from kvfence.ids import PageId, RequestId
from kvfence.model.config import ModelConfig
from kvfence.model.llama import AttentionMetadata, LlamaForCausalLM, PrefillSeq
from kvfence.model.paged_kv import PagedKV
from kvfence.model.sampler import Sampler

LogprobEntry = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class _Head:
    """Which token positions pay for the LM head: the sampled ones and, for prompt logprobs, the scored prompt
    positions, ascending (so that a step that needs every position is the model's no-index fast path).
    `sample_at` / `prompt_at`: where the sampled / scored rows are among the head's rows (None: all of them /
    none)."""

    idx: torch.Tensor
    sample_at: torch.Tensor | None
    prompt_at: torch.Tensor | None

    @staticmethod
    def of(sample_idx: list[int], prompt_idx: list[int], dev: str) -> _Head:
        if not prompt_idx:
            return _Head(torch.tensor(sample_idx, dtype=torch.long, device=dev), None, None)
        both = sorted(set(sample_idx) | set(prompt_idx))
        row = {flat: i for i, flat in enumerate(both)}
        sample_at = torch.tensor([row[x] for x in sample_idx], dtype=torch.long, device=dev)
        prompt_at = torch.tensor([row[x] for x in prompt_idx], dtype=torch.long, device=dev)
        return _Head(torch.tensor(both, dtype=torch.long, device=dev), sample_at, prompt_at)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        faults: Faults | None = None,
        seed: int = 0,
        threads: tuple[int, int] | None = None,
    ) -> None:
        """`threads`: (for steps with prefill tokens, for decode-only steps), set before each step; None leaves
        torch's setting alone."""
        self.model = model
        self.config: ModelConfig = model.config
        self.page_size = page_size
        self.device = device
        # one page more than the pool: a scratch sink that only the drop_write fault knob ever writes to
        self.cache = PagedKV(self.config, num_pages + 1, page_size, dtype, device, model.backend.hugepages)
        self._sink_slot = num_pages * page_size
        self.sampler = Sampler(device, seed)
        self.faults = faults or Faults()
        self.threads = threads

    def page_digests(self, pages: Sequence[PageId]) -> list[int]:
        """Content digests of whole pages (xxh3-64 over each page's K/V bytes), for sealing and re-checking
        prefix-cache pages (kv/prefix_cache.py)."""
        return [self.cache.page_digest(page) for page in pages]

    def run(self, plan: Plan, stop: Stop | None = None) -> StepResult:
        """One forward step and its sampling. `stop`: asked between layers; yes raises StepInterrupted."""
        token_ids, meta, written, head = self._prepare(plan)
        if self.threads is not None:
            want = self.threads[0] if meta.prefills else self.threads[1]
            if torch.get_num_threads() != want:  # per thread in OpenMP: set here, on the thread that steps
                torch.set_num_threads(want)
        try:  # [N, V]: the rows of meta.sample_idx, in its order
            logits = self.model(token_ids, meta, self.cache, stop)
        except StepInterrupted:
            if self.device.startswith("cuda"):  # its pages are unheld next: no kernel of it may still write
                torch.cuda.synchronize()
            raise
        prompt_lp = self._prompt_logprobs(plan, logits, head)
        sample_rows = [row for row in plan.rows if row.sample]
        if not sample_rows:
            return StepResult(sampled={}, written=written, prompt_logprobs=prompt_lp)
        if head.sample_at is not None:
            logits = logits[head.sample_at]
        tokens, logprobs, broken = self.sampler(
            logits,
            [r.params for r in sample_rows],
            [r.num_generated for r in sample_rows],
            [r.history for r in sample_rows],
            [r.banned for r in sample_rows],
            [r.allowed for r in sample_rows],
        )
        token_list = tokens.tolist()
        sampled = {r.request_id: t for r, t in zip(sample_rows, token_list, strict=True)}
        top = self._logprobs(sample_rows, tokens, logprobs)
        return StepResult(
            sampled=sampled,
            written=written,
            logprobs=top,
            prompt_logprobs=prompt_lp,
            nonfinite=frozenset(sample_rows[i].request_id for i in broken),
        )

    def _prepare(
        self, plan: Plan
    ) -> tuple[torch.Tensor, AttentionMetadata, tuple[tuple[int, ...], ...], _Head]:
        S, dev = self.page_size, self.device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        sample_idx: list[int] = []
        prompt_idx: list[int] = []  # flat positions whose logits score prompt tokens (prompt logprobs)
        written: list[tuple[int, ...]] = []
        for i, row in enumerate(plan.rows):
            q_start = len(tokens)
            tokens.extend(row.token_ids)
            pos = range(row.start_pos, row.context_len)
            positions.extend(pos)
            slots.extend(row.pages[p // S] * S + p % S for p in pos)
            first, last = row.start_pos // S, (row.context_len - 1) // S
            written.append(tuple(range(first, last + 1)))
            if row.num_new_tokens == 1:
                decode_rows.append(i)
            else:
                pages = torch.tensor(row.pages, dtype=torch.long, device=dev)
                prefills.append(PrefillSeq(q_start, row.num_new_tokens, row.start_pos, pages))
            if row.sample:
                sample_idx.append(len(tokens) - 1)
            at = q_start + row.prompt_offset
            prompt_idx.extend(range(at, at + len(row.prompt_targets)))
        head = _Head.of(sample_idx, prompt_idx, dev)
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=dev)
        self._maybe_drop_write(plan, slot_tensor, written)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=slot_tensor,
            prefills=prefills,
            decode_idx=None,
            decode_pages=None,
            decode_lens=None,
            sample_idx=head.idx,
        )
        if decode_rows:
            self._prepare_decode(plan, decode_rows, meta)
        return torch.tensor(tokens, dtype=torch.long, device=dev), meta, tuple(written), head

    def _prepare_decode(self, plan: Plan, decode_rows: list[int], meta: AttentionMetadata) -> None:
        S, dev = self.page_size, self.device
        rows = [plan.rows[i] for i in decode_rows]
        max_pages = max(len(r.pages) for r in rows)
        pad = self._sink_slot // S  # padding points at the scratch page, never at a page someone owns
        table = [list(r.pages) + [pad] * (max_pages - len(r.pages)) for r in rows]
        ctx = torch.tensor([r.context_len for r in rows], dtype=torch.long, device=dev)
        flat_idx, offset = [], 0
        for row in plan.rows:
            offset += row.num_new_tokens
            if row.num_new_tokens == 1:
                flat_idx.append(offset - 1)
        meta.decode_idx = torch.tensor(flat_idx, dtype=torch.long, device=dev)
        meta.decode_pages = torch.tensor(table, dtype=torch.long, device=dev)
        meta.decode_lens = ctx  # the model masks (or, with the kernels, stops) past each row's length

    def _maybe_drop_write(self, plan: Plan, slots: torch.Tensor, written: list[tuple[int, ...]]) -> None:
        """Fault knob `drop_write`: the first page a prefill row writes is silently not written (its slots are
        redirected to a scratch page outside the pool), and the runner does not report it as written."""
        if not self.faults.any_armed:
            return
        offset = 0
        for i, row in enumerate(plan.rows):
            full_page = row.start_pos % self.page_size == 0 and row.num_new_tokens > self.page_size
            if full_page and self.faults.fire("drop_write"):
                slots[offset : offset + self.page_size] = self._sink_slot
                written[i] = written[i][1:]
                return
            offset += row.num_new_tokens

    @staticmethod
    def _prompt_logprobs(
        plan: Plan, logits: torch.Tensor, head: _Head
    ) -> dict[RequestId, tuple[LogprobEntry, ...]] | None:
        """Each prompt-logprob row's entries: the logprob of the prompt token that follows each of its scored
        positions, and its top-k alternatives, from the unmodified distribution (as vLLM reports them)."""
        if head.prompt_at is None:
            return None
        rows = [r for r in plan.rows if r.prompt_targets]
        lp = torch.log_softmax(logits[head.prompt_at].float(), dim=-1)  # [P, V]
        targets = torch.tensor(
            [t for r in rows for t in r.prompt_targets], dtype=torch.long, device=lp.device
        )
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = max(r.params.prompt_logprobs or 0 for r in rows)
        top = lp.topk(k) if k else None
        ids = top.indices.tolist() if top is not None else None
        vals = top.values.tolist() if top is not None else None
        out, i = {}, 0
        for r in rows:
            kr = r.params.prompt_logprobs or 0
            entries = []
            for _ in r.prompt_targets:
                pairs = tuple(zip(ids[i][:kr], vals[i][:kr], strict=True)) if ids and vals and kr else ()
                entries.append((chosen[i], pairs))
                i += 1
            out[r.request_id] = tuple(entries)
        return out

    def _logprobs(
        self, rows: list[PlanRow], tokens: torch.Tensor, logprobs: torch.Tensor | None
    ) -> dict[RequestId, tuple[float, tuple[tuple[int, float], ...]]] | None:
        wanted = [(i, r) for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted or logprobs is None:
            return None
        out = {}
        for i, row in wanted:
            chosen = float(logprobs[i, tokens[i]])
            k = row.params.logprobs
            top = logprobs[i].topk(k) if k else None
            pairs = (
                tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
            )
            out[row.request_id] = (chosen, pairs)
        return out
