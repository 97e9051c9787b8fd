"""Would int8 weights and activations (W8A8) pay on this CPU? Speed of the products, and their quality.

    python bench/w8a8.py speed [--rows 32 64 256 2048] [--shapes qwen05|llama1b]
    python bench/w8a8.py quality [--scales channel-token block32 block128 ...] [--chunks 8]

speed: one layer's linear products of the 0.5B (or 1B) synthetic model at each row count, median of 9 calls,
2 threads: oneDNN's bfloat16 product on packed weights (what kvfence and vLLM-CPU run) against `torch._int_mm`
(int8 x int8 -> int32, oneDNN's VNNI kernels) on the same shapes, with and without the per-row quantization of
the activations and the scaling of the int32 sums back to bfloat16 done in torch (a fused kernel would cost less).

quality: SmolLM2 (the default model) in float32 with every linear layer but the head fake-quantized (weights
rounded to int8 with one scale per output row or per block of K, activations per row or per block of K), scored
as kvfence/model/quality.py scores a path (prefill mode, chunks of 512 tokens of bench/data/kjv.txt: KL of the
next-token distribution against float32, top-1 agreement). The gate in `make test`: mean KL <= 0.004, top-1 >=
90% (docs/quality.md). Session 24 (AMD EPYC Zen4): channel-token 0.0448 / 89.6%, block32 0.0049 / 97.3%.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

SHAPES = {  # (K, N) of one layer's products: qkv, o, gate_up, down
    "qwen05": [(896, 1152), (896, 896), (896, 9728), (4864, 896)],
    "llama1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
}
SCALES = {  # weight group, activation group along K (None: one scale for the whole row)
    "channel-token": (None, None),
    "channel-block32": (None, 32),
    "block256": (256, 256),
    "block128": (128, 128),
    "block64": (64, 64),
    "block32": (32, 32),
}


def median_ms(f: Callable[[], object], n: int = 9) -> float:
    f()
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def layer_ms(m: int, k: int, n: int) -> tuple[float, float, float]:
    """One [m, k] x [k, n] product: oneDNN bfloat16 (packed), int_mm alone, int_mm with quantize and scale."""
    w = (torch.randn(n, k) * 0.02).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    x = torch.randn(m, k).bfloat16()
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
    ws = torch.rand(n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)

    def quantized() -> torch.Tensor:
        xf = x.float()
        s = xf.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        q = (xf / s).round().to(torch.int8)
        return (torch._int_mm(q, wq).float() * s * ws).bfloat16()

    return (
        median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
        median_ms(lambda: torch._int_mm(xq, wq)),
        median_ms(quantized),
    )


def speed(rows: list[int], shapes: str) -> None:
    torch.manual_seed(0)
    print(f"{shapes}: one layer's four products, median ms (2 threads)")
    print(f"{'rows':>6} {'oneDNN bf16':>12} {'int_mm':>8} {'+ quant + scale':>16} {'ratio':>6}")
    for m in rows:
        bf16, mm, full = (sum(t) for t in zip(*(layer_ms(m, k, n) for k, n in SHAPES[shapes]), strict=True))
        print(f"{m:>6} {bf16:>12.2f} {mm:>8.2f} {full:>16.2f} {bf16 / full:>6.2f}")


def fake_quant(t: torch.Tensor, group: int | None) -> torch.Tensor:
    """Symmetric int8 rounding of `t` with one scale per row and group of `group` along the last dim."""
    k = t.shape[-1]
    g = k if group is None or k % group else group
    v = t.reshape(-1, k // g, g)
    s = v.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((v / s).round().clamp(-127, 127) * s).reshape(t.shape)


def quality(scales: list[str], chunks: int) -> None:
    from kvfence.model import quality as q
    from kvfence.model.fetch import DEFAULT_MODEL_PATH
    from kvfence.model.loader import load_model

    loaded = {torch.float32: load_model(DEFAULT_MODEL_PATH, dtype=torch.float32)}
    ids = loaded[torch.float32].tokenizer.encode(
        Path(__file__).with_name("data").joinpath("kjv.txt").read_text()
    )
    ref = q.build(q.PATHS["float32"], loaded)
    group_chunks = q.chunks_of(ids, 512, chunks)
    first = 256
    for name in scales:
        w_group, a_group = SCALES[name]
        model = q.build(q.PATHS["float32"], loaded)
        for layer_name, module in model.named_modules():
            if isinstance(module, nn.Linear) and "lm_head" not in layer_name:
                with torch.no_grad():
                    module.weight.copy_(fake_quant(module.weight, w_group))
                module.register_forward_pre_hook(lambda _m, args, g=a_group: (fake_quant(args[0], g),))
        tally = q.Tally()
        for b0 in range(0, len(group_chunks), 8):
            group = group_chunks[b0 : b0 + 8]
            targets = torch.tensor([c[first + 1 :] for c in group]).reshape(-1)
            r = q.TeacherForcer(ref, torch.float32, len(group), 512).prefill(group, first)
            t = q.TeacherForcer(model, torch.float32, len(group), 512).prefill(group, first)
            tally.add(r.reshape(-1, r.shape[-1]), t.reshape(-1, t.shape[-1]), targets)
        s = tally.summary()
        print(f"{name:>16}: KL mean {s['kl_mean']:.5f}  p99 {s['kl_p99']:.4f}  top-1 {s['top1']:.2%}  "
              f"ppl {s['ppl']:.3f}  ({s['positions']} positions)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("speed")
    sp.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256, 2048])
    sp.add_argument("--shapes", choices=sorted(SHAPES), default="qwen05")
    qp = sub.add_parser("quality")
    qp.add_argument("--scales", nargs="+", choices=sorted(SCALES), default=["channel-token", "block32"])
    qp.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.cmd == "speed":
        speed(args.rows, args.shapes)
    else:
        quality(args.scales, args.chunks)


if __name__ == "__main__":
    main()
