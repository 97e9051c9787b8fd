"""The compute path is chosen once, at load, from `KernelOptions` (kvfence/model/kernels): each choice reaches the
model's layers, and nothing under kvfence/ reads the kernel switches from the environment behind the options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.config import KernelOptions
from kvfence.model.linears import OutputHead, PackedLinear, onednn_bf16_packing
from kvfence.model.llama import MLP, Attention, LlamaForCausalLM
from kvfence.model.loader import load_model
from tests.kernel_ops import kernel_ops, kernel_options
from tests.model_factory import write_tiny_gguf

OPS = kernel_ops()
SWITCHES = (
    "KVFENCE_KERNELS",
    "KVFENCE_QUANT_KERNELS",
    "KVFENCE_INT8",
    "KVFENCE_KERNELS_MARCH",
    "KVFENCE_HUGEPAGES",
    "KVFENCE_AMX_TILES",
)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("backend") / "m.gguf"
    return write_tiny_gguf(
        path, qtype="Q4_1", tie=True, seed=5, qtype_overrides={"token_embd.weight": "Q8_0"}
    )


def build(path: Path, options: KernelOptions) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_loaded(
        load_model(path, torch.bfloat16, kernels=options), torch.bfloat16, "cpu"
    )


def layers_with_kernels(model: LlamaForCausalLM) -> list[object]:
    return [
        m.kernels for m in model.modules() if isinstance(m, (LlamaForCausalLM, Attention, MLP, OutputHead))
    ]


def packed_linears(model: LlamaForCausalLM) -> list[PackedLinear]:
    """The linear layers in oneDNN's layout: all of them where oneDNN packs bfloat16 weights, none where it cannot
    (a CPU, or an ONEDNN_MAX_CPU_ISA cap, below AVX512-BW/VL/DQ: they stay `nn.Linear` and never take blocks)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert bool(linears) == onednn_bf16_packing()
    return linears


def test_kernels_off_gives_the_torch_path_everywhere(gguf_path):
    model = build(gguf_path, kernel_options(kernels=False))
    assert model.backend.ops is None and set(layers_with_kernels(model)) == {None}
    linears = packed_linears(model)
    assert all(m.kernels is None and m.quant is None and m.panels is None for m in linears)
    assert model.lm_head.panels is None and model.lm_head.weight.numel() > 0


def test_kernels_on_reach_every_layer_and_the_linears_take_the_blocks(gguf_path):
    model = build(gguf_path, kernel_options(kernels=True, quant_kernels=True, int8="decode"))
    ops = model.backend.ops
    assert ops is not None and ops.lib is OPS
    assert set(map(id, layers_with_kernels(model))) == {id(ops)}
    qkv = model.model.layers[0].self_attn.qkv_proj
    if packed_linears(model):
        assert (qkv.panels is not None) == OPS.panel_vnni() and (qkv.quant is not None) != OPS.panel_vnni()
    else:  # plain nn.Linear: no blocks to take
        assert not isinstance(qkv, PackedLinear)


def test_int8_off_gives_no_panels(gguf_path):
    model = build(gguf_path, kernel_options(kernels=True, quant_kernels=True, int8="0"))
    assert model.backend.int8 == "0" and not model.backend.int8_panels
    assert all(m.panels is None and m.quant is not None for m in packed_linears(model))
    assert model.lm_head.panels is None


def test_quant_kernels_off_keeps_the_bfloat16_weights(gguf_path):
    model = build(gguf_path, kernel_options(kernels=True, quant_kernels=False))
    assert model.backend.ops is not None and not model.backend.takes_blocks
    linears = packed_linears(model)
    assert all(m.panels is None and m.quant is None for m in linears)
    # the bfloat16 weight, in oneDNN's layout or packed for AMX tiles
    assert all((m.packed_weight.numel() > 0) != (m.tiles is not None) for m in linears)


def test_the_options_win_over_the_environment(gguf_path, monkeypatch):
    """Switches in the environment that say the opposite change nothing once options are given: the layers never
    read the environment (`load_model` without options reads it once, through `KernelOptions.from_env`)."""
    loaded = load_model(gguf_path, torch.bfloat16, kernels=kernel_options(kernels=True, int8="0"))
    for name, value in zip(SWITCHES, ("0", "0", "all", "bogus target!", "0", "0"), strict=True):
        monkeypatch.setenv(name, value)
    model = LlamaForCausalLM.from_loaded(loaded, torch.bfloat16, "cpu")
    assert model.backend.ops is not None and model.backend.int8 == "0" and model.backend.hugepages
    with pytest.raises(ValueError, match="kernels-march"):
        load_model(gguf_path, torch.bfloat16)  # no options: the environment's, validated


def test_no_module_reads_the_switches_but_the_configuration():
    root = Path(__file__).resolve().parent.parent / "kvfence"
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "config.py" or path.parent != root
        for line in path.read_text().splitlines()
        if ("environ" in line or "getenv" in line) and any(name in line for name in SWITCHES)
    ]
    assert readers == []
