"""RoPE scaling: Llama 3's and linear are applied as transformers applies them, from a Hugging Face folder and
from a GGUF (llama.cpp's `rope_freqs.weight` and `rope.scaling.*`); a scaling kvfence does not implement (yarn,
longrope, ...) is refused at load instead of being ignored, which would change every context past the original
length (until session 18 a warning said so and the model ran unscaled)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kvfence.model.config import RopeScalingError, rope_scaling_factors
from kvfence.model.loader import load_model
from kvfence.model.tokenizer import ModelLoadError
from tests.model_factory import write_tiny_gguf, write_tiny_hf_dir
from tests.test_forward import run_paged

HEAD_DIM, THETA = 16, 10000.0
# a short original context, so that a 96-token prompt is far past it and every kind of frequency is present
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 4.0}
IDS = torch.randint(0, 384, (96,), generator=torch.Generator().manual_seed(5)).tolist()


def _hf_dir(path: Path, rope_scaling: dict[str, Any] | None) -> Path:
    write_tiny_hf_dir(path, arch="llama", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = THETA
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _transformers_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_hf_folder_matches_transformers(tmp_path: Path, scaling: dict[str, Any]) -> None:
    scaled = _hf_dir(tmp_path / "scaled", scaling)
    loaded = load_model(scaled)
    assert loaded.config.rope_freq_factors == rope_scaling_factors(scaling, HEAD_DIM, THETA)
    expected = _transformers_logits(scaled)
    got = run_paged(loaded, IDS, chunks=[40, 30, 1, 1, 1, 23])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    # and the scaling matters here: the same weights unscaled are far from it past the original context
    plain = run_paged(load_model(_hf_dir(tmp_path / "plain", None)), IDS, chunks=[96])
    assert (plain[32:] - expected[32:]).abs().max() > 50 * (got - expected).abs().max()


def test_llama3_factors_cover_the_three_bands() -> None:
    factors = rope_scaling_factors(LLAMA3, HEAD_DIM, THETA)
    assert factors is not None and len(factors) == HEAD_DIM // 2
    assert factors[0] == 1.0 and factors[-1] == 8.0  # high frequencies kept, low ones divided by the factor
    assert any(1.0 < f < 8.0 for f in factors)  # interpolated in between
    assert list(factors) == sorted(factors)


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_gguf_matches_the_hf_folder(tmp_path: Path, scaling: dict[str, Any]) -> None:
    factors = rope_scaling_factors(scaling, HEAD_DIM, THETA)
    assert factors is not None
    if scaling["rope_type"] == "llama3":  # llama.cpp's converter: the divisors as a tensor
        path = write_tiny_gguf(tmp_path / "m.gguf", seed=4, rope_freqs=factors)
    else:
        path = write_tiny_gguf(tmp_path / "m.gguf", seed=4, rope_scaling=("linear", 4.0))
    loaded = load_model(path)
    assert loaded.config.rope_freq_factors == pytest.approx(factors, rel=1e-6)
    expected = run_paged(load_model(_hf_dir(tmp_path / "hf", scaling)), IDS, chunks=[96])
    torch.testing.assert_close(run_paged(loaded, IDS, chunks=[50, 1, 1, 44]), expected, atol=2e-4, rtol=2e-4)


def test_an_unimplemented_scaling_is_refused(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model(_hf_dir(tmp_path / "yarn", yarn))
    with pytest.raises(ModelLoadError, match="missing or bad parameter"):
        load_model(_hf_dir(tmp_path / "bad", {"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model(write_tiny_gguf(tmp_path / "yarn.gguf", rope_scaling=("yarn", 4.0)))
    with pytest.raises(ModelLoadError, match="not positive and finite"):
        load_model(write_tiny_gguf(tmp_path / "zero.gguf", rope_freqs=[1.0] * 7 + [0.0]))
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight has 4 values, expected 8"):
        load_model(write_tiny_gguf(tmp_path / "short.gguf", rope_freqs=[1.0] * 4))
    with pytest.raises(RopeScalingError, match="'longrope' is not supported"):
        rope_scaling_factors({"rope_type": "longrope", "short_factor": [1.0]}, HEAD_DIM, THETA)
    for bad in (0.0, -2.0, float("nan"), "x"):
        with pytest.raises(RopeScalingError):
            rope_scaling_factors({"rope_type": "linear", "factor": bad}, HEAD_DIM, THETA)
    with pytest.raises(ModelLoadError, match="factor must be positive"):
        load_model(write_tiny_gguf(tmp_path / "neg.gguf", rope_scaling=("linear", -1.0)))
    # dynamic NTK changes nothing within max_position_embeddings, the most kvfence serves: exact to leave out
    assert rope_scaling_factors({"type": "dynamic", "factor": 2.0}, HEAD_DIM, THETA) is None
    assert rope_scaling_factors({"rope_type": "default"}, HEAD_DIM, THETA) is None


def test_a_gguf_factor_without_a_type_is_linear(tmp_path: Path) -> None:
    """llama.cpp reads `rope.scaling.factor` without `rope.scaling.type` as a linear scaling; so does kvfence."""
    loaded = load_model(write_tiny_gguf(tmp_path / "m.gguf", seed=4, rope_scaling=("", 4.0)))
    assert loaded.config.rope_freq_factors == rope_scaling_factors(LINEAR, HEAD_DIM, THETA)


def test_the_kv_layout_fingerprint_names_the_rotation(tmp_path: Path) -> None:
    """PD workers keep keys rotated: a prefill and a decode worker that rotate differently (another RoPE base or
    scaling, e.g. one kvfence that ignored scaling) must not pass I6's layout comparison."""
    from types import SimpleNamespace

    from kvfence.pd.local import layout_fingerprint

    def layout(path: Path) -> str:
        cfg = load_model(path).config
        engine = SimpleNamespace(
            model_config=cfg,
            config=SimpleNamespace(
                model=SimpleNamespace(dtype="bfloat16"), cache=SimpleNamespace(page_size=16)
            ),
        )
        return layout_fingerprint(engine)  # type: ignore[arg-type]

    # one model name (the folder's) for all, so that only the rotation can tell the layouts apart
    plain, llama3, linear = (
        _hf_dir(tmp_path / n / "m", s) for n, s in (("p", None), ("l3", LLAMA3), ("lin", LINEAR))
    )
    layouts = {layout(plain), layout(llama3), layout(linear)}
    assert len(layouts) == 3
    assert layout(llama3) == layout(_hf_dir(tmp_path / "again" / "m", LLAMA3))
