"""The linear layers of the CPU paths: packed bfloat16 weights, the GGUF's blocks, and the float32 output head.

Boundary: what a linear layer multiplies by and with which kernel; the model (kvfence/model/llama.py) only calls
them. At load, `pack_linears` turns every bfloat16 `nn.Linear` into a `PackedLinear` (oneDNN's layout), and
`attach_quantized` gives those whose GGUF weight is Q4_1/Q8_0 blocks the blocks, as the model's `Backend`
(kvfence/model/kernels/ops.py) says: as panels for int8 activations, or as the GGUF lays them out for bfloat16
ones. The output head (`OutputHead`) returns float32 logits on every path. `fuse_projections` and
`fuse_quantized` concatenate Hugging Face's separate q/k/v and gate/up weights (or their blocks) into the fused
projections the model uses.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvfence.model import hugepages
from kvfence.model.config import ModelConfig
from kvfence.model.kernels.ops import Backend, KernelOps
from kvfence.model.quant import QuantBlocks, QuantPanels

T = TypeVar("T")

# Rows up to which `panel_linear` quantizes activations in two int8 levels, finer than bfloat16: a step of so few
# rows is bound by reading the weights, so the second level's multiplies cost less than reading bfloat16 weights
# (3.6x the bytes of Q4_1) would. Longer steps take oneDNN on the bfloat16 weights, or with int8 "all"
# (`KernelOptions.int8`) one int8 level (llama.cpp's precision, faster, coarser). 16, not 8 (session 22): a
# tenant's request joining eight others' made every layer switch to oneDNN, +5.7 ms on a 16 ms step of
# SmolLM2 (docs/performance.md).
FINE_MAX_ROWS = 16
# The output head's two-level limit: it reads 49,152 rows of blocks for each step, where a second level costs
# more than it does in the layers; kept where session 10 measured it.
HEAD_FINE_MAX_ROWS = 8


class PackedLinear(nn.Module):
    """A bfloat16 CPU linear layer whose weight oneDNN reordered once, at load, into its blocked layout. Same
    results as `F.linear` (bit for bit in our tests), which reorders the weight on every call: 1.7-1.9x faster
    for the few rows of a decode step, the same for a long prefill (docs/performance.md).

    When the GGUF stored this weight as Q4_1 or Q8_0 blocks and the C++ kernels run, steps of few rows multiply
    by those blocks instead (`attach_quantized`), reading a third of the bytes (Q4_1). By default `panels` holds
    them repacked for `panel_linear`, which quantizes the activations to int8 per block of 32 (AVX512-VNNI and
    BF16): two levels up to `FINE_MAX_ROWS` rows; with int8 "all" one level for longer steps too, and the
    bfloat16 weight is dropped. With int8 "0", `quant` holds them as the GGUF stores them and steps of
    at most `QUANT_MAX_ROWS` rows multiply by them with bfloat16 activations. (The output head is an
    `OutputHead`: float32 logits.)"""

    packed_weight: Tensor  # empty once every step takes the panels, or on AMX tiles
    tiles: Tensor | None = (
        None  # the weight packed for `tile_linear` (`on_tiles`), instead of oneDNN's layout
    )
    bias_f32: Tensor | None = None  # the bias in float32, for `tile_linear`
    # a [gate | up] layer whose tiles hold gate and up rows interleaved 16 by 16 (`interleave_gated`): `silu_mul`
    # then takes silu(gate) * up from the tiles' float32 sums in one call
    gated = False
    quant: QuantBlocks | None = None
    panels: QuantPanels | None = None
    panel_max_rows = FINE_MAX_ROWS  # steps of more rows take the bfloat16 weight ...
    fine_max_rows = FINE_MAX_ROWS  # ... and steps of more rows than this one int8 level
    kernels: KernelOps | None = None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_ROWS_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.out_features, self.in_features = linear.weight.shape
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @classmethod
    def on_tiles(
        cls, linear: nn.Linear, packed: Tensor, kernels: KernelOps, gated: bool = False
    ) -> PackedLinear:
        """A layer whose every step multiplies on AMX tiles, its weight `packed` by `kernels.pack_tiles` (with
        `gated`, of `interleave_gated(weight)`)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.register_buffer("packed_weight", torch.empty(0, dtype=packed.dtype), persistent=False)
        self.tiles = packed
        self.kernels = kernels
        self.out_features, self.in_features = linear.weight.shape
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float()
        self.gated = gated
        return self

    @staticmethod
    def takes_gated(linear: nn.Linear) -> bool:
        """A [gate | up] layer the gated tiles take: no bias, each half a whole number of 16 rows."""
        n, _ = linear.weight.shape
        return linear.bias is None and n % 32 == 0

    def silu_mul(self, x: Tensor, ops: KernelOps) -> Tensor:
        """silu(gate) * up of this [gate | up] layer's product, [T, N / 2]: in one call on gated tiles, where this
        step would take the tiles; else the product, then `ops.silu_mul` on its bfloat16 result."""
        if self.gated and self._path(x) == "tiles":
            assert self.kernels is not None and self.tiles is not None
            y = self.kernels.tile_linear(x.reshape(-1, self.in_features), self.tiles, None, 0, True)
            return y.view(*x.shape[:-1], self.out_features // 2)
        return ops.silu_mul(self.forward(x))

    @staticmethod
    def takes_tiles(linear: nn.Linear) -> bool:
        """Shapes `tile_linear` takes: both sides whole multiples of 32."""
        n, k = linear.weight.shape
        return n % 32 == 0 and k % 32 == 0

    @staticmethod
    def supported(dtype: torch.dtype, device: str) -> bool:
        return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and onednn_bf16_packing()

    def _path(self, x: Tensor) -> str:
        """Which weights this step multiplies by: "panels", "quant", "tiles" or "onednn"."""
        if self.kernels is not None:
            rows = x.numel() // self.in_features
            if self.panels is not None and rows <= self.panel_max_rows:
                return "panels"
            if self.quant is not None and x.dim() == 2 and rows <= QUANT_MAX_ROWS[self.quant.kind]:
                return "quant"
            if self.tiles is not None:
                return "tiles"
        return "onednn"

    def forward(self, x: Tensor) -> Tensor:
        path = self._path(x)
        assert self.kernels is not None or path == "onednn"
        if path == "panels":
            assert self.panels is not None and self.kernels is not None
            rows = x.reshape(-1, self.in_features)
            levels = 2 if rows.shape[0] <= self.fine_max_rows else 1
            out = self.kernels.panel_linear(rows, self.panels, levels)
            return out.view(*x.shape[:-1], self.panels.n)
        if path == "quant":
            assert self.quant is not None and self.kernels is not None
            y: Tensor = self.kernels.quant_linear(x, self.quant)
            return y
        if path == "tiles":
            assert self.tiles is not None and self.kernels is not None
            rows = x.reshape(-1, self.in_features)
            y = self.kernels.tile_linear(rows, self.tiles, self.bias_f32)
            if self.gated:  # back to [gate | up] from gate and up interleaved 16 by 16
                y = y.view(-1, self.out_features // 32, 2, 16).transpose(1, 2).reshape(-1, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return y


def interleave_gated(weight: Tensor) -> Tensor:
    """A [gate | up] weight [2 I, K] with its rows reordered as 16 gate rows, the 16 matching up rows, the next 16
    gate rows, ...: packed for the tiles, each 32-column panel then holds a gate tile and its up tile."""
    n, k = weight.shape
    gate, up = weight[: n // 2], weight[n // 2 :]
    return torch.stack([gate.reshape(-1, 16, k), up.reshape(-1, 16, k)], dim=1).reshape(n, k)


@functools.cache
def onednn_bf16_packing() -> bool:
    """Whether oneDNN reorders bfloat16 weights here: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and refuses
    otherwise, also when `ONEDNN_MAX_CPU_ISA` caps it below them. Without it the linear layers stay plain
    `nn.Linear` (torch's own bfloat16 matmul, slower) and do not take the GGUF's blocks."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):  # type: ignore[no-untyped-call]
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), DECODE_ROWS_HINT)
    except RuntimeError:
        return False
    return True


DECODE_ROWS_HINT = 8  # oneDNN picks the packed layout for this many rows; any row count works
# rows up to which the quantized-block kernels beat oneDNN on bfloat16 weights (docs/performance.md)
QUANT_MAX_ROWS = {"Q4_1": 6, "Q8_0": 2}


class OutputHead(nn.Module):
    """The output head: hidden states [N, D] -> float32 logits [N, V], in every dtype and on every path.

    Logits are never rounded to bfloat16 (issue 20, docs/quality.md): at a logit of 25 one bfloat16 step is 0.125,
    so two tokens 0.08 apart in float32 became an exact tie, greedy took the lower token id, and the same prompt
    answered differently on two CPUs. The sums of every path below stay float32:
      - `panels` (the GGUF's Q4_1/Q8_0 blocks, with AVX512-VNNI): `panel_linear_f32`, int8 activations in two
        levels up to HEAD_FINE_MAX_ROWS rows and one beyond, for every step; the bfloat16 weight is then dropped;
      - the C++ kernels otherwise: `linear_f32` on the bfloat16 weight (exact products, float32 sums), on AMX
        tiles where the CPU has them, AVX512-BF16 otherwise;
      - the torch path: float32 matmuls over slices of the bfloat16 weight, upcast one slice at a time.
    A tied head holds the embedding's tensor itself: no second copy."""

    panels: QuantPanels | None = None
    fine_max_rows = HEAD_FINE_MAX_ROWS
    kernels: KernelOps | None = None
    SLICE_ROWS = 1024  # vocabulary rows upcast at a time on the torch path (2.3 MB of float32 at D = 576)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape

    def drop_weight(self) -> None:
        """Every step takes the panels: the bfloat16 weight goes (a tied embedding keeps its own reference)."""
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        p, ops = self.panels, self.kernels
        if p is not None and ops is not None:
            levels = 2 if rows.shape[0] <= self.fine_max_rows else 1
            out = ops.panel_linear_f32(rows, p, levels)
        elif ops is not None and self.in_features % 32 == 0:
            out = ops.linear_f32(rows, self.weight)
        else:
            out = float32_linear(rows, self.weight, self.SLICE_ROWS)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.view(*x.shape[:-1], self.out_features)


def float32_linear(x: Tensor, weight: Tensor, slice_rows: int) -> Tensor:
    """x @ weight^T in float32 whatever their dtype. A lower-precision weight is upcast `slice_rows` output rows at a
    time (never a float32 copy of the whole matrix, which is 2 GB for a head of 128k x 4096)."""
    xf = x.float()
    if weight.dtype == torch.float32:
        return F.linear(xf, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], slice_rows):
        part = weight.detach()[start : start + slice_rows]
        torch.matmul(xf, part.float().t(), out=out[:, start : start + part.shape[0]])
    return out


def fuse_quantized(quantized: Mapping[str, QuantBlocks], cfg: ModelConfig) -> dict[str, QuantBlocks]:
    """The blocks under this model's parameter names: q/k/v and gate/up concatenated like `fuse_projections`
    (a group whose parts differ in kind is dropped, and those layers keep the bfloat16 weights); a tied head
    takes the embedding's blocks."""
    fused = _fuse(quantized, cfg.num_layers, QuantBlocks.cat)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in fused:
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    return fused


def attach_quantized(model: nn.Module, quantized: Mapping[str, QuantBlocks], backend: Backend) -> None:
    """Give each bias-free PackedLinear its weight's blocks, when they have its shape: as panels for int8
    activations (the default where the CPU has AVX512-VNNI and AVX512-BF16; the output head, which sees one row
    per sequence, takes them for every step and drops its bfloat16 copy, as every layer does with
    int8 "all"), or as the GGUF lays them out for bfloat16 activations (int8 "0", or a CPU
    without those instructions; the output head then keeps its bfloat16 weight for `linear_f32`). Every decode
    step streams all of them, so they move into one buffer, on huge pages if the backend asks (`hugepages.pack`).
    `backend.ops` must be the kernels."""
    ops = backend.ops
    assert ops is not None
    takers: list[tuple[PackedLinear | OutputHead, QuantBlocks]] = []
    panels = backend.int8_panels
    for name, module in model.named_modules():
        blocks = quantized.get(name + ".weight")
        if (
            (isinstance(module, PackedLinear) or (panels and isinstance(module, OutputHead)))
            and blocks is not None
            and module.bias is None
            and blocks.shape == (module.out_features, module.in_features)
        ):
            takers.append((module, blocks))
    if panels:
        # one layer repacked at a time, straight into its place: the panels of all layers never exist twice
        specs = [spec for _, blocks in takers for spec in blocks.panel_shapes()]
        placed = iter(hugepages.slots(specs, huge=backend.hugepages))
        for module, blocks in takers:
            p = blocks.panels()
            wp, d, m = next(placed), next(placed), next(placed)
            wp.copy_(p.wp)
            d.copy_(p.d)
            m.copy_(p.m)
            module.panels = QuantPanels(p.kind, p.n, wp, d, m)
            module.kernels = ops
            # The head sees only sampled rows (one per sequence): every step takes its panels, in one level beyond
            # HEAD_FINE_MAX_ROWS, where two levels are slower than oneDNN was (docs/performance.md, session 10).
            if isinstance(module, OutputHead):
                module.drop_weight()
            elif backend.int8_prefill:  # the bfloat16 weight goes, in either layout
                module.panel_max_rows = sys.maxsize
                module.packed_weight = torch.empty(0, dtype=module.packed_weight.dtype)
        return
    placed = iter(hugepages.pack([t for _, b in takers for t in (b.qs, b.d, b.m)], huge=backend.hugepages))
    for module, blocks in takers:
        assert isinstance(module, PackedLinear)  # the head takes blocks only as panels
        module.quant = QuantBlocks(blocks.kind, next(placed), next(placed), next(placed))
        module.kernels = ops


def pack_linears(model: nn.Module, backend: Backend) -> None:
    """Replace every nn.Linear by a PackedLinear (the output head is an `OutputHead`, whose logits stay float32):
    on AMX tiles where `backend.tiles` and the shape allows (the packed weights of all layers in one buffer, on
    huge pages if the backend asks: a decode step streams them all), in oneDNN's layout otherwise (also with
    int8 "all", whose layers on the GGUF's blocks drop their bfloat16 weight)."""
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]
    # int8 "all" drops the bfloat16 weights of every layer that takes the GGUF's blocks: those weights are not
    # packed (one shared buffer would outlive the layers that drop their views of it)
    ops = backend.ops if backend.tiles and not backend.int8_prefill else None
    tiled = [child for _, _, child in linears if ops is not None and PackedLinear.takes_tiles(child)]
    slots = hugepages.slots(
        [((m.out_features // 32, m.in_features // 32, 16, 64), m.weight.dtype) for m in tiled],
        huge=backend.hugepages,
    )
    placed = {id(m): slot for m, slot in zip(tiled, slots, strict=True)}
    for parent, name, child in linears:
        slot = placed.get(id(child))
        if ops is not None and slot is not None:
            # the MLP's [gate | up] layer packed gated: its step and silu_mul in one call (MLP._rows)
            gated = name == "gate_up_proj" and PackedLinear.takes_gated(child)
            weight = child.weight.detach()
            weight = interleave_gated(weight) if gated else weight.contiguous()
            slot.copy_(ops.pack_tiles(weight))  # one layer's packing alive at once
            setattr(parent, name, PackedLinear.on_tiles(child, slot, ops, gated))
        else:
            setattr(parent, name, PackedLinear(child))


FUSED = (  # fused parameter <- the Hugging Face parameters it concatenates, in row order
    (
        "self_attn.qkv_proj.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    ("self_attn.qkv_proj.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)


def fuse_projections(weights: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """A copy of `weights` (HF names) where each layer's q/k/v and gate/up projections are concatenated into the
    fused parameters this model uses. A group that is absent (no attention bias) is skipped; a partial group is
    left alone so that the missing-weights check names what is missing."""
    return _fuse(weights, num_layers, torch.cat)


def _fuse(items: Mapping[str, T], num_layers: int, cat: Callable[[list[T]], T | None]) -> dict[str, T]:
    """Each layer's complete FUSED groups concatenated by `cat` in row order (None from `cat`: dropped)."""
    fused = dict(items)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for target, parts in FUSED:
            names = [prefix + p for p in parts]
            if all(n in fused for n in names):
                joined = cat([fused.pop(n) for n in names])
                if joined is not None:
                    fused[prefix + target] = joined
    return fused
