"""Numerical quality of each compute path against float32, teacher-forced on a fixed text (issue 20).

Every fast path (bfloat16 weights, the C++ kernels, int8 activations on the GGUF's blocks) computes something a
little different from float32. This module measures how far, on the same tokens, position by position:
perplexity, KL divergence of each path's next-token distribution from float32's (mean, median, p99, max), how
often its top token is float32's, and the largest difference of a raw logit. `bench/quality.py` runs it for
every path under every oneDNN ISA cap and kernel build (docs/quality.md); `tests/test_quality.py` asserts the
gate on a few positions.

Scoring follows llama.cpp's `llama-perplexity` so that its `--kl-divergence` numbers sit beside ours: the text is
cut into chunks of `ctx` tokens (512), the first half of each chunk is context, and the logits at positions
ctx/2 .. ctx-2 are scored against the token that follows. Two ways to get them, because a server computes them two
ways:
  - "decode": the context is one prefill, then every scored position is one decode step (one token per row, all
    chunks of a batch in one step, as a server's decode batch: up to `FINE_MAX_ROWS` rows take two int8 levels);
  - "prefill": the chunk in two prefill chunks of ctx/2 tokens, as a server's chunked prefill runs a prompt; the
    scored logits all come from the second chunk, which attends over the first one's pages.

A path is a dtype plus the kernel switches (`KernelOptions` fields) that pick the compute path at load (`PATHS`);
the model is built with them, so it is the server's own forward pass, not a reimplementation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfence.config import KernelOptions
from kvfence.model import kernels
from kvfence.model.linears import onednn_bf16_packing
from kvfence.model.llama import AttentionMetadata, LlamaForCausalLM, PrefillSeq
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.paged_kv import PagedKV


@dataclass(frozen=True, slots=True)
class ComputePath:
    name: str
    dtype: torch.dtype
    switches: Mapping[str, Any]  # the `KernelOptions` fields this path sets (the other switches: defaults)
    what: str

    def options(self, base: KernelOptions) -> KernelOptions:
        """`base` (its build target and huge pages) with the kernel switches at their defaults, then this path's."""
        default = KernelOptions()
        switched = {name: getattr(default, name) for name in SWITCHES} | dict(self.switches)
        return dataclasses.replace(base, **switched)


SWITCHES = ("kernels", "quant_kernels", "int8")
PATHS: dict[str, ComputePath] = {
    p.name: p
    for p in (
        ComputePath("float32", torch.float32, {}, "float32 weights and activations (the reference)"),
        ComputePath(
            "bf16-torch", torch.bfloat16, {"kernels": False}, "bfloat16, plain torch (oneDNN matmuls)"
        ),
        ComputePath(
            "bf16-kernels",
            torch.bfloat16,
            {"quant_kernels": False},
            "bfloat16 weights, C++ attention and small operators",
        ),
        ComputePath(
            "q-bf16act",
            torch.bfloat16,
            {"int8": "0"},
            "C++ kernels; few-row steps on the GGUF's blocks with bfloat16 activations",
        ),
        ComputePath(
            "default",
            torch.bfloat16,
            {"int8": "decode"},
            "the server's default: few-row steps on the GGUF's blocks with int8 activations (two levels)",
        ),
        ComputePath(
            "int8-all",
            torch.bfloat16,
            {"int8": "all"},
            "KVFENCE_INT8=all: every step on the blocks, one int8 level beyond 8 rows",
        ),
    )
}
MODES = ("decode", "prefill")


def build(
    path: ComputePath, loaded: Mapping[torch.dtype, LoadedModel], base: KernelOptions | None = None
) -> LlamaForCausalLM:
    """The model of `path`; `base`: the options its switches change (None: `KernelOptions.from_env()`)."""
    m = loaded[path.dtype]
    options = path.options(KernelOptions.from_env() if base is None else base)
    return LlamaForCausalLM.from_weights(m.config, m.weights, path.dtype, "cpu", m.quantized, options)


def chunks_of(ids: Sequence[int], ctx: int, limit: int | None = None) -> list[list[int]]:
    """Whole chunks of `ctx` tokens, as llama-perplexity cuts them (the remainder is dropped)."""
    n = len(ids) // ctx if limit is None else min(limit, len(ids) // ctx)
    return [list(ids[i * ctx : (i + 1) * ctx]) for i in range(n)]


class TeacherForcer:
    """Runs one model over a batch of chunks and yields the scored logits, step by step: [rows, V] float32 for
    scored position `pos` of every chunk (decode), or [chunks * (ctx - first - 1), V] at once (prefill)."""

    PAGE = 16

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, batch: int, ctx: int) -> None:
        self.model, self.ctx = model, ctx
        self.pages_per_seq = -(-ctx // self.PAGE)
        self.cache = PagedKV(model.config, batch * self.pages_per_seq, self.PAGE, dtype, "cpu")

    def _pages(self, i: int) -> torch.Tensor:
        return torch.arange(i * self.pages_per_seq, (i + 1) * self.pages_per_seq)

    def _slots(self, i: int, start: int, end: int) -> list[int]:
        pages = self._pages(i).tolist()
        return [pages[p // self.PAGE] * self.PAGE + p % self.PAGE for p in range(start, end)]

    def _prefill(
        self, chunks: Sequence[Sequence[int]], start: int, end: int, sample_all: bool
    ) -> torch.Tensor:
        n = end - start
        tokens = [t for c in chunks for t in c[start:end]]
        meta = AttentionMetadata(
            positions=torch.arange(start, end).repeat(len(chunks)),
            slot_mapping=torch.tensor([s for i in range(len(chunks)) for s in self._slots(i, start, end)]),
            prefills=[
                PrefillSeq(i * n, n, start, self._pages(i)[: -(-end // self.PAGE)])
                for i in range(len(chunks))
            ],
            decode_idx=None,
            decode_pages=None,
            decode_lens=None,
            sample_idx=(torch.arange(len(tokens)) if sample_all else torch.arange(n - 1, len(tokens), n)),
        )
        out: torch.Tensor = self.model(torch.tensor(tokens), meta, self.cache)
        return out

    def decode(self, chunks: Sequence[Sequence[int]], first: int) -> Iterator[torch.Tensor]:
        self._prefill(chunks, 0, first, sample_all=False)
        b = len(chunks)
        table = torch.stack([self._pages(i) for i in range(b)])
        for pos in range(first, self.ctx - 1):
            meta = AttentionMetadata(
                positions=torch.full((b,), pos),
                slot_mapping=torch.tensor([self._slots(i, pos, pos + 1)[0] for i in range(b)]),
                prefills=[],
                decode_idx=torch.arange(b),
                decode_pages=table,
                decode_lens=torch.full((b,), pos + 1),
                sample_idx=torch.arange(b),
            )
            yield self.model(torch.tensor([c[pos] for c in chunks]), meta, self.cache)

    def prefill(self, chunks: Sequence[Sequence[int]], first: int) -> torch.Tensor:
        """[chunks, ctx - first - 1, V]: the second prefill chunk's logits at the scored positions."""
        self._prefill(chunks, 0, first, sample_all=False)
        out = self._prefill(chunks, first, self.ctx, sample_all=True)
        return out.view(len(chunks), self.ctx - first, -1)[:, :-1]


@dataclass
class Tally:
    """Per-position statistics of one path against the reference, accumulated over batches."""

    kl: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    agree: int = 0
    max_dlogit: float = 0.0
    max_flip_gap: float = 0.0  # largest top-2 gap of the reference where this path's top token differed

    ROWS = 256  # rows scored at a time: a prefill batch's 2,040 rows in float64 would take gigabytes

    def add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        """ref, got: [rows, V] logits; targets: [rows] the tokens that follow. KL(float32 || path), as llama.cpp's
        --kl-divergence; a NaN anywhere stays NaN in every statistic."""
        for i in range(0, ref.shape[0], self.ROWS):
            self._add(ref[i : i + self.ROWS], got[i : i + self.ROWS], targets[i : i + self.ROWS])

    def _add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        ref64, got64 = ref.double(), got.double()
        lp_ref, lp_got = ref64.log_softmax(-1), got64.log_softmax(-1)
        self.kl.extend((lp_ref.exp() * (lp_ref - lp_got)).sum(-1).clamp_min(0).tolist())
        self.nll.extend((-lp_got.gather(1, targets[:, None])[:, 0]).tolist())
        same = ref.argmax(-1) == got.argmax(-1)
        self.agree += int(same.sum())
        d = float((ref64 - got64).abs().max())
        self.max_dlogit = d if not d <= self.max_dlogit else self.max_dlogit  # NaN wins
        if not bool(same.all()):
            top2 = ref[~same].topk(2, dim=-1).values
            gap = float((top2[:, 0] - top2[:, 1]).max())
            self.max_flip_gap = gap if not gap <= self.max_flip_gap else self.max_flip_gap  # NaN wins

    def summary(self) -> dict[str, float]:
        kl = np.asarray(self.kl)
        return {
            "positions": len(self.kl),
            "ppl": float(np.exp(np.mean(self.nll))),
            "kl_mean": float(kl.mean()),
            "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max()),
            "top1": self.agree / len(self.kl),
            "max_dlogit": self.max_dlogit,
            "max_gap_of_a_flip": self.max_flip_gap,  # how clear a margin must be for exact-text tests
        }


def measure(
    loaded: Mapping[torch.dtype, LoadedModel],
    ids: Sequence[int],
    paths: Sequence[str],
    modes: Sequence[str] = MODES,
    ctx: int = 512,
    batch: int = 8,
    max_chunks: int | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {path: summary}} of every path against float32 (float32 itself: its perplexity, KL 0)."""
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"unknown path {p!r}: expected one of {', '.join(PATHS)}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    if ctx < 4 or batch < 1 or (max_chunks is not None and max_chunks < 1):
        raise ValueError(
            f"ctx {ctx}, batch {batch}, max_chunks {max_chunks}: expected ctx >= 4 and positive counts"
        )
    first = ctx // 2
    chunks = chunks_of(ids, ctx, max_chunks)
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    ref_model = build(PATHS["float32"], loaded)
    models = {p: build(PATHS[p], loaded) for p in paths if p != "float32"}
    tallies = {mode: {p: Tally() for p in ["float32", *models]} for mode in modes}
    for b0 in range(0, len(chunks), batch):
        group = chunks[b0 : b0 + batch]
        targets = torch.tensor([c[first + 1 :] for c in group])  # [b, ctx - first - 1]
        forcers = {
            p: TeacherForcer(m, PATHS[p].dtype, len(group), ctx)
            for p, m in [("float32", ref_model), *models.items()]
        }
        if "decode" in modes:
            streams = {p: f.decode(group, first) for p, f in forcers.items()}
            for j in range(ctx - first - 1):
                ref = next(streams["float32"])
                tallies["decode"]["float32"].add(ref, ref, targets[:, j])
                for p in models:
                    tallies["decode"][p].add(ref, next(streams[p]), targets[:, j])
        if "prefill" in modes:
            ref = forcers["float32"].prefill(group, first)
            flat = targets.reshape(-1)
            tallies["prefill"]["float32"].add(
                ref.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1]), flat
            )
            for p, f in forcers.items():
                if p != "float32":
                    got = f.prefill(group, first)
                    tallies["prefill"][p].add(
                        ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1]), flat
                    )
    return {mode: {p: t.summary() for p, t in per.items()} for mode, per in tallies.items()}


def float32_greedy(
    loaded: LoadedModel, prompt: Sequence[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Float32's greedy continuation of `prompt` and, at each of its tokens, how far the chosen logit is ahead of the
    runner-up: an exact-text test can only expect the same text from the fast paths where every gap is clear of
    their error (about 1 logit, docs/quality.md); a near-tie is a coin flip between CPUs."""
    if max_tokens < 1 or not prompt:
        raise ValueError("float32_greedy: a prompt and at least one token to generate")
    model = build(PATHS["float32"], {torch.float32: loaded})
    forcer = TeacherForcer(model, torch.float32, 1, len(prompt) + max_tokens)
    logits = forcer._prefill([prompt], 0, len(prompt), sample_all=False)[0]
    tokens: list[int] = []
    gaps: list[float] = []
    table = forcer._pages(0)[None]
    while True:
        top2 = logits.topk(2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        pos = len(prompt) + len(tokens) - 1
        if len(tokens) == max_tokens:
            return tokens, gaps
        meta = AttentionMetadata(
            positions=torch.tensor([pos]),
            slot_mapping=torch.tensor(forcer._slots(0, pos, pos + 1)),
            prefills=[],
            decode_idx=torch.tensor([0]),
            decode_pages=table,
            decode_lens=torch.tensor([pos + 1]),
            sample_idx=torch.tensor([0]),
        )
        logits = model(torch.tensor([tokens[-1]]), meta, forcer.cache)[0]


def main(argv: Sequence[str] | None = None) -> None:
    """One process, one oneDNN ISA cap and kernel build (both fixed at process start): JSON on stdout or --json."""
    ap = argparse.ArgumentParser(prog="python -m kvfence.model.quality", description=main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="the corpus, a UTF-8 text file")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-chunks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = [p for p in args.paths.split(",") if p]
    dtypes = {PATHS[p].dtype for p in paths if p in PATHS} | {torch.float32}
    loaded = {dt: load_model(args.model, dtype=dt) for dt in dtypes}
    text = Path(args.text).read_text(encoding="utf-8")
    ids = loaded[torch.float32].tokenizer.encode(text)
    options = (
        KernelOptions.from_env()
    )  # the build target (KVFENCE_KERNELS_MARCH, as bench/quality.py sets it)
    result = {
        "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
        "kernels_march": options.kernels_march,
        "kernels": (ops := kernels.ops(options)) is not None,
        "panel_vnni": ops is not None and ops.panel_vnni,
        "head_tiles": ops is not None and ops.head_tiles,
        "onednn_bf16_packing": onednn_bf16_packing(),
        "tokens": len(ids),
        "ctx": args.ctx,
        "results": measure(
            loaded, ids, paths, [m for m in args.modes.split(",") if m], args.ctx, args.batch, args.max_chunks
        ),
        "paths": {p: asdict(PATHS[p]) | {"dtype": str(PATHS[p].dtype)} for p in paths},
    }
    out = json.dumps(result, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(out)
    else:
        sys.stdout.write(out + "\n")


if __name__ == "__main__":
    main()
