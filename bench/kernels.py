"""The C++ kernels against the torch path: one forward step, alternated in one process on the same inputs.

    python bench/kernels.py [--threads N] [--reps 8] [--quant-max-rows R]

Loads the default model in bfloat16, builds plans (8, 4 and 1 decode rows at context 230, one 196-token prefill;
pages scattered over a 2,048-page pool) and runs each of these in rotating blocks, so that machine noise falls on
all alike:
  - int8 all: every linear layer on the GGUF's Q4_1/Q8_0 blocks with int8 activations (`panel_linear`: two
    levels up to 8 rows, one level beyond; KVFENCE_INT8=all);
  - int8 decode: the server's default, the same up to 8 rows, oneDNN on the bfloat16 weights beyond;
  - bf16 activations: the blocks with bfloat16 activations for steps of few rows (`quant_linear`, up to
    QUANT_MAX_ROWS), oneDNN beyond (KVFENCE_INT8=0);
  - bf16 weights: the same kernels, every linear layer on the bfloat16 weights (KVFENCE_QUANT_KERNELS=0);
  - torch: no C++ kernels (KVFENCE_KERNELS=0).
Prints the median step time of each and the ratios to torch (the output head gives float32 logits in every one:
panels, `linear_f32`, float32 slices on the torch path), then the head alone with bfloat16 and float32 outputs.
--quant-max-rows moves the row count up to which `quant_linear` is used. Needs the kernels
(`python -m kvfence.model.kernels`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvfence.config import Config
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.plan import Plan, PlanRow
from kvfence.engine.request import SamplingParams
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.model import linears as linear_layers
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.kernels import KernelOps
from kvfence.model.linears import OutputHead, PackedLinear, float32_linear, fuse_quantized
from kvfence.model.llama import MLP, Attention, LlamaForCausalLM
from kvfence.model.loader import load_model
from kvfence.model.quant import QuantPanels


def plan(rng: random.Random, rows: int, new: int, ctx: int, pool_pages: int) -> Plan:
    greedy = SamplingParams(temperature=0)
    out = []
    for i in range(rows):
        pages = tuple(PageId(p) for p in rng.sample(range(pool_pages), -(-ctx // 16)))
        tokens = tuple(rng.randrange(3, 49000) for _ in range(new))
        out.append(
            PlanRow(RequestId(f"r{i}"), tokens, ctx - new, pages, (LeaseId(1),) * len(pages), True, greedy, 0)
        )
    return Plan(tuple(out), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8, help="rotations per plan")
    ap.add_argument("--quant-max-rows", type=int, default=None, help="one limit for every kind of block")
    args = ap.parse_args()
    pool_pages = 2048
    config = Config.of(  # int8 decode keeps the bfloat16 weights: every variant runs on this one model
        model=str(DEFAULT_MODEL_PATH),
        dtype="bfloat16",
        threads=args.threads,
        kv_pages=pool_pages,
        int8="decode",
    )
    runner = LLMEngine(config).runner
    model = runner.model
    ops = model.kernels
    if ops is None:
        raise SystemExit("the C++ kernels are not available (python -m kvfence.model.kernels)")
    torch.set_num_threads(args.threads)

    if args.quant_max_rows is not None:
        linear_layers.QUANT_MAX_ROWS = dict.fromkeys(linear_layers.QUANT_MAX_ROWS, args.quant_max_rows)
    loaded = load_model(config.model.model, dtype=torch.bfloat16)
    fused = fuse_quantized(loaded.quantized, loaded.config)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    panels = {name: m.panels for name, m in linears.items()}
    blocks = {name: fused.get(name + ".weight") for name in linears}
    if not any(blocks.values()):
        print("note: this model has no Q4_1/Q8_0 blocks; the first four columns are the same")

    head = model.lm_head
    assert isinstance(head, OutputHead)
    head_panels = head.panels
    if head.weight.numel() == 0:  # the server drops it (its head takes the blocks): back, for the other paths
        if not loaded.config.tie_word_embeddings:
            raise SystemExit("an untied head whose bfloat16 weight was dropped: load with KVFENCE_INT8=0")
        head.weight = model.model.embed_tokens.weight

    def use(kernels_on: bool, linear: str) -> None:
        for m in model.modules():
            if isinstance(m, (Attention, MLP, LlamaForCausalLM, OutputHead)):
                m.kernels = ops if kernels_on else None
        for name, m in linears.items():
            m.panels = panels[name] if linear.startswith("int8") else None
            every_step = linear == "int8 all"  # as the server runs them
            m.panel_max_rows = sys.maxsize if every_step else linear_layers.FINE_MAX_ROWS
            m.quant = blocks[name] if linear == "bf16 activations" else None
            m.kernels = ops
        head.panels = head_panels if linear.startswith("int8") else None  # float32 logits on every path

    variants = {
        "int8 all": (True, "int8 all"),
        "int8 decode": (True, "int8 decode"),
        "bf16 activations": (True, "bf16 activations"),
        "bf16 weights": (True, "bf16 weights"),
        "torch": (False, "bf16 weights"),
    }
    rng = random.Random(0)
    plans = {
        "decode, 8 rows": (plan(rng, 8, 1, 230, pool_pages), 10),
        "decode, 4 rows": (plan(rng, 4, 1, 230, pool_pages), 10),
        "decode, 1 row": (plan(rng, 1, 1, 230, pool_pages), 10),
        "prefill, 196 tokens": (plan(rng, 1, 196, 196, pool_pages), 3),
    }
    names = list(variants)
    limits = linear_layers.QUANT_MAX_ROWS
    print(f"threads {args.threads}, {args.reps} rotations, blocks up to {limits} rows; median step ms")
    print(f"{'':20s}" + "".join(f"{n:>18s}" for n in names) + "   ratios to torch")
    for name, (step_plan, calls) in plans.items():
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            for v in names[rep % len(names) :] + names[: rep % len(names)]:
                use(*variants[v])
                for _ in range(calls):
                    t0 = time.perf_counter()
                    runner.run(step_plan)
                    times[v].append((time.perf_counter() - t0) * 1e3)
        med = {n: statistics.median(times[n]) for n in names}
        ratios = " ".join(f"{med[n] / med['torch']:.2f}" for n in names[:-1])
        print(f"{name:20s}" + "".join(f"{med[n]:18.2f}" for n in names) + f"   {ratios}")
    use(True, "int8 decode")
    head_costs(ops, head_panels, head.weight, args.reps)


def head_costs(ops: KernelOps, panels: QuantPanels | None, weight: torch.Tensor, reps: int) -> None:
    """What float32 logits cost (issue 20, docs/quality.md): the output head alone, each path's float32 version
    beside the bfloat16-output one it replaced, alternated on the same rows."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), linear_layers.DECODE_ROWS_HINT)
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "oneDNN bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "linear_f32": lambda x: ops.linear_f32(x, weight),
        "torch F.linear bf16": lambda x: torch.nn.functional.linear(x, weight),
        "torch f32 slices": lambda x: float32_linear(x, weight, OutputHead.SLICE_ROWS),
    }
    if panels is not None:
        p = panels
        variants = {
            "panels bf16": lambda x: ops.panel_linear(x, p, 2 if len(x) <= 8 else 1),
            "panels f32": lambda x: ops.panel_linear_f32(x, p, 2 if len(x) <= 8 else 1),
            **variants,
        }
    names = list(variants)
    print("\noutput head alone, median ms (bfloat16 outputs, as before issue 20, beside float32 ones)")
    print(f"{'':20s}" + "".join(f"{n:>22s}" for n in names))
    for rows in (1, 4, 8, 32):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(reps):
            for n in names[rep % len(names) :] + names[: rep % len(names)]:
                for _ in range(5):
                    t0 = time.perf_counter()
                    variants[n](x)
                    times[n].append((time.perf_counter() - t0) * 1e3)
        print(f"{f'{rows} rows':20s}" + "".join(f"{statistics.median(times[n]):22.2f}" for n in names))


if __name__ == "__main__":
    main()
