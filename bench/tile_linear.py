"""The AMX tile kernels of the bfloat16 linear layers and the output head, on a real model's shapes.

    python bench/tile_linear.py [--size qwen05|llama1b] [--rows 32,64,256,512,1024,2048] [--threads 2] [--reps 10]

Random weights in the shapes of `bench/make_synthetic.py`'s models (no model files needed), packed as the model
packs them: every layer's q/k/v, o, gate/up (gated, as the MLP calls it) and down. Two measurements, each
alternated in one process so that machine noise falls on all alike:
  - the layers' linears, all of them in order, for each row count: `tile_linear` with its own pass size (`m_block`
    0: as many rows of x as fill half of a core's L2) against passes that fill the whole L2 (session 27's
    choice), and the weights' read rate;
  - the output head (`linear_f32`, float32 logits) at each row count up to 128, with the weights cold: 720 MB are
    streamed between calls, as a decode step's layers stream theirs.
Needs a CPU with AMX (`head_tiles`); prints medians in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvfence.model.kernels import KernelOps, library
from kvfence.model.linears import interleave_gated

# hidden, intermediate, layers, heads, KV heads, head dim, vocabulary (bench/make_synthetic.py's shapes)
SHAPES = {"qwen05": (896, 4864, 24, 14, 2, 64, 49152), "llama1b": (2048, 8192, 16, 32, 8, 64, 49152)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SHAPES), default="qwen05")
    ap.add_argument("--rows", default="32,64,256,512,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = library()
    if lib is None or not lib.head_tiles():
        raise SystemExit("needs the C++ kernels on a CPU with AMX")
    ops = KernelOps(lib)
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = SHAPES[args.size]
    g = torch.Generator().manual_seed(26)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.02).bfloat16()

    assert heads * head_dim == hidden
    qkv_n = (heads + 2 * kv_heads) * head_dim
    packed = [
        (
            ops.pack_tiles(weight(qkv_n, hidden)),
            ops.pack_tiles(weight(hidden, heads * head_dim)),
            ops.pack_tiles(interleave_gated(weight(2 * inter, hidden))),
            ops.pack_tiles(weight(hidden, inter)),
        )
        for _ in range(layers)
    ]
    nbytes = sum(t.numel() * 2 for layer in packed for t in layer)
    l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE") if "SC_LEVEL2_CACHE_SIZE" in os.sysconf_names else 0
    whole = l2 if l2 >= 256 << 10 else 2 << 20

    def m_block(k: int) -> int:  # passes that fill the whole L2 with x: session 27's choice
        return max(32, min(1024, whole // (k * 2) // 32 * 32))

    def step(x: torch.Tensor, own: bool) -> None:
        for qkv, o, gate_up, down in packed:
            ops.tile_linear(x, qkv, None, 0 if own else m_block(hidden))
            ops.tile_linear(x, o, None, 0 if own else m_block(hidden))  # heads * head_dim == hidden here
            act = ops.tile_linear(x, gate_up, None, 0 if own else m_block(hidden), silu=True)
            ops.tile_linear(act, down, None, 0 if own else m_block(inter))

    print(
        f"{args.size}: {layers} layers, {nbytes / 2**20:.0f} MiB of packed weights, L2 {whole >> 10} KiB a core"
    )
    print("rows  half of L2 (default)  whole L2   weights read (default)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for own in (True, False) if rep % 2 == 0 else (False, True):
                start = time.perf_counter()
                step(x, own)
                times[own].append(time.perf_counter() - start)
        own_ms, whole_ms = (statistics.median(times[k]) * 1e3 for k in (True, False))
        print(f"{rows:5d}  {own_ms:10.1f} ms  {whole_ms:10.1f} ms   {nbytes / own_ms / 1e6:5.1f} GB/s")

    head = weight(vocab, hidden)
    flush = torch.empty(720 << 20, dtype=torch.uint8)
    print(f"output head {vocab} x {hidden}, float32 logits, weights cold")
    for rows in (1, 16, 32, 64, 128):
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        times_h = []
        for _ in range(args.reps):
            flush.add_(1)
            start = time.perf_counter()
            ops.linear_f32(x, head)
            times_h.append(time.perf_counter() - start)
        print(f"{rows:5d}  {statistics.median(times_h) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
