"""The C++ kernels as typed Python calls (`KernelOps`, one method per kernel), and the `Backend` a model keeps.

`KernelOps` wraps the compiled module (kvfence/model/kernels/*.cpp): each method passes its tensors straight
through, so it costs one Python call, and says what the kernel takes, mutates and returns. Every kernel runs
without the GIL. `Backend` is the compute path chosen once when a model loads (`kernels.configure`, from its
`KernelOptions`); the layers read it, never the environment.

Shapes: T = rows (tokens), D = hidden size, H = query heads, Hkv = KV heads, Dh = head dim, P = pages, S = page
size, B = decode rows, N = output columns, K = input columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from kvfence.model.quant import QuantBlocks, QuantPanels


class KernelOps:
    """The compiled kernels (bfloat16 on the CPU unless said otherwise). `lib` is the raw module."""

    def __init__(self, lib: ModuleType) -> None:
        self.lib = lib
        # whether panel_linear has its AVX512-VNNI path here (else its slow scalar path): fixed by the build
        self.panel_vnni: bool = bool(lib.panel_vnni())
        # whether linear_f32 runs on AMX tiles here (else AVX512-BF16, or scalar): the build and the kernel's leave
        self.head_tiles: bool = bool(lib.head_tiles())
        # whether long prefill chunks take torch's flash attention rather than `prefill_attention`: where oneDNN
        # runs its products on AMX tiles (3x faster at 2,000 tokens), not elsewhere (on AMD Zen4's AVX512-BF16
        # the kernel is 1.6-3x faster at every size; docs/performance.md, session 22)
        self.prefill_sdpa: bool = self.head_tiles and onednn_may_use_amx()
        # whether `prefill_attention_tiles` runs here (AMX, and the process may use it)
        self.attention_tiles: bool = bool(lib.attention_tiles())

    def paged_decode_attention(
        self,
        out: Tensor,
        q: Tensor,
        kv: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        scale: float,
        tiles: bool = True,
    ) -> None:
        """Writes `out` [B, H, Dh]: q [B, H, Dh] over the first context_lens[b] slots of the pages in
        block_tables[b] ([B, n] int64), read in place from one layer's kv [2, P, S, Hkv, Dh]. On AMX tiles where
        `attention_tiles` and the shapes allow (Dh a multiple of 32, at most 16 query heads a KV head, pages of
        16-token multiples), unless `tiles` is False."""
        self.lib.paged_decode_attention(out, q, kv, block_tables, context_lens, scale, tiles)

    def write_kv(self, kv: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes k, v [T, Hkv, Dh] into slots [T] (page * S + offset) of one layer's kv [2, P, S, Hkv, Dh]."""
        self.lib.write_kv(kv, slots, k, v)

    def prefill_attention(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> None:
        """Writes `out` [Lq, H, Dh]: causal attention of q [Lq, H, Dh] over k, v [Lk, Hkv, Dh], query i seeing
        keys 0 .. Lk - Lq + i."""
        self.lib.prefill_attention(out, q, k, v, scale)

    def prefill_attention_tiles(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float) -> None:
        """`prefill_attention` on AMX tiles (only where `attention_tiles`; Dh a multiple of 32, at most 256)."""
        self.lib.prefill_attention_tiles(out, q, k, v, scale)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm of every row of x [T, D]: a new tensor."""
        out: Tensor = self.lib.rms_norm(x, weight, eps)
        return out

    def add_rms_norm_(self, x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x += delta in place (rounded as `x + delta`), then returns RMSNorm of the new x [T, D]."""
        out: Tensor = self.lib.add_rms_norm_(x, delta, weight, eps)
        return out

    def rotary_(self, x: Tensor, heads: int, cos: Tensor, signed_sin: Tensor) -> None:
        """Rotary embedding in place on the first `heads` heads of x [T, >= heads, Dh]; cos, signed_sin [T, Dh]
        float32."""
        self.lib.rotary_(x, heads, cos, signed_sin)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up for gate_up [T, 2I] laid out [gate | up]: a new [T, I]."""
        out: Tensor = self.lib.silu_mul(gate_up)
        return out

    def quant_linear(self, x: Tensor, blocks: QuantBlocks) -> Tensor:
        """x [M, K] @ W^T with W [N, K] as the GGUF's Q4_1/Q8_0 blocks, bfloat16 activations: [M, N] bfloat16."""
        out: Tensor = self.lib.quant_linear(x, blocks.qs, blocks.d, blocks.m, blocks.kind_id)
        return out

    def panel_linear(self, x: Tensor, panels: QuantPanels, levels: int) -> Tensor:
        """x [M, K] @ W^T with W as panels of blocks, x quantized to `levels` (1 or 2) int8 levels per block of 32:
        [M, N] bfloat16."""
        out: Tensor = self.lib.panel_linear(
            x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels
        )
        return out

    def panel_linear_f32(self, x: Tensor, panels: QuantPanels, levels: int) -> Tensor:
        """`panel_linear` with float32 outputs [M, N] (the output head's logits)."""
        out: Tensor = self.lib.panel_linear_f32(
            x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels
        )
        return out

    def linear_f32(self, x: Tensor, weight: Tensor, tiles: bool = True) -> Tensor:
        """x [M, K] @ weight^T with weight [N, K] bfloat16 (K a multiple of 32): float32 [M, N], float32 sums.
        On AMX tiles where `head_tiles` (8x faster at 32 rows), unless `tiles` is False (tests, benchmarks)."""
        out: Tensor = self.lib.linear_f32(x, weight, tiles)
        return out

    def pack_tiles(self, weight: Tensor) -> Tensor:
        """weight [N, K] bfloat16 (N and K multiples of 32) packed for `tile_linear`: [N / 32, K / 32, 16, 64]."""
        out: Tensor = self.lib.pack_tiles(weight)
        return out

    def tile_linear(
        self, x: Tensor, packed: Tensor, bias: Tensor | None, m_block: int = 0, silu: bool = False
    ) -> Tensor:
        """x [M, K] @ W^T (+ bias [N]) on AMX tiles (only where `head_tiles`), W packed by `pack_tiles`: [M, N]
        bfloat16, float32 sums rounded once; a row's outputs have the same bits in any batch. `m_block`: rows
        per pass over the weights (0: the kernel's choice by K). `silu`: W holds gate and up rows interleaved 16
        by 16 (`linears.interleave_gated`), and the result is silu(gate) * up of the float32 sums, [M, N / 2]."""
        out: Tensor = self.lib.tile_linear(x, packed, bias, m_block, silu)
        return out


def onednn_may_use_amx() -> bool:
    """Whether `ONEDNN_MAX_CPU_ISA` (or its older name `DNNL_MAX_CPU_ISA`) leaves oneDNN its AMX kernels: unset,
    or a cap that names AMX."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    return cap in ("", "ALL", "DEFAULT") or "AMX" in cap


@dataclass(frozen=True)
class Backend:
    """The compute path of one model, fixed when it loads (`kernels.configure`): read by its layers, never changed.

    `ops`: the C++ kernels, or None for the plain torch path. `quant`: linear layers multiply by the GGUF's
    Q4_1/Q8_0 blocks in steps of few rows. `int8`: "decode" (those steps take int8 activations, `panel_linear`),
    "all" (every step does, and the bfloat16 weights are dropped) or "0" (bfloat16 activations, `quant_linear`).
    `hugepages`: big long-lived buffers (KV pool, blocks) ask for transparent huge pages. `tiles`: bfloat16
    linear layers multiply on AMX tiles (`tile_linear`) instead of oneDNN's product (only where `ops.head_tiles`)."""

    ops: KernelOps | None = None
    quant: bool = True
    int8: str = "decode"
    hugepages: bool = True
    tiles: bool = False

    @property
    def takes_blocks(self) -> bool:
        """Linear layers take the GGUF's blocks (when the checkpoint has them)."""
        return self.ops is not None and self.quant

    @property
    def int8_panels(self) -> bool:
        """The blocks go in as panels for int8 activations: asked for, and the CPU has AVX512-VNNI and BF16."""
        return self.ops is not None and self.int8 != "0" and self.ops.panel_vnni

    @property
    def int8_prefill(self) -> bool:
        """Longer steps (prefills) on the panels too, in one int8 level (llama.cpp's precision)."""
        return self.int8 == "all"
