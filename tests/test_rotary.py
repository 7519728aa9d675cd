"""RoPE scaling types (default, linear, llama3, yarn, longrope) and partial rotary: our cos/sin
tables against transformers' own rotary embeddings, and the refusals of check_rope_scaling."""
import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from chunkserve.model.layers.rope_scaling import check_rope_scaling, rope_attention_factor
from chunkserve.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

HEAD_DIM = 64
SUPPORTED = "default, linear, llama3, yarn, longrope"
FAMILIES = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
    "qwen3": (Qwen3Config, Qwen3RotaryEmbedding),
    "phi3": (Phi3Config, Phi3RotaryEmbedding),
}


def hf_cos_sin(family: str, rope_scaling: dict | None, positions: int, theta: float,
               max_pos: int, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin ([positions, rotary_dim], cat'ed halves) for one config."""
    config_cls, rope_cls = FAMILIES[family]
    if family != "phi3":
        extra["head_dim"] = HEAD_DIM  # Qwen3's default head_dim is 128, not hidden/heads
    config = config_cls(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
                        max_position_embeddings=max_pos, rope_theta=theta,
                        rope_scaling=None if rope_scaling is None else dict(rope_scaling), **extra)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope_cls(config)(x, torch.arange(positions)[None])
    return cos[0], sin[0]


def assert_tables_match(ours: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = cos.shape[-1] // 2
    assert ours.cos.dtype == torch.float32 and ours.cos.shape == (cos.shape[0], half)
    # transformers repeats the half-table (rotate-half layout): both halves must be ours.
    for ref, got in ((cos, ours.cos), (sin, ours.sin)):
        torch.testing.assert_close(got, ref[:, :half], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, ref[:, half:], rtol=1e-6, atol=1e-7)


def check_against_hf(family: str, scaling: dict | None, max_pos: int, positions: int,
                     theta: float = 10000.0, **extra) -> RotaryEmbedding:
    normalized = check_rope_scaling(scaling, max_pos, extra.get("original_max_position_embeddings"))
    ours = RotaryEmbedding(HEAD_DIM, positions, theta, normalized)
    assert_tables_match(ours, *hf_cos_sin(family, scaling, positions, theta, max_pos, **extra))
    return ours


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_default_and_linear_match_transformers(family):
    check_against_hf(family, None, 4096, 1024, theta=1e6)
    assert check_rope_scaling({"rope_type": "default", "rope_theta": 1e6}, 4096) is None
    check_against_hf(family, {"type": "linear", "factor": 4.0}, 4096, 1024)


def test_llama3_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    assert check_rope_scaling(scaling, 4096) == scaling
    check_against_hf("llama", scaling, 4096, 2048, theta=500000.0)


YARN_CASES = [
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},  # Qwen2.5
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
     "attention_factor": 1.25},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
     "mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek-style ratio
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
     "mscale": 1.0},  # mscale alone is ignored
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
     "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
     "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
     "beta_fast": 64, "beta_slow": 0.5, "truncate": False},
]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("scaling", YARN_CASES)
def test_yarn_matches_transformers(family, scaling):
    max_pos = int(scaling["factor"] * scaling["original_max_position_embeddings"])
    ours = check_against_hf(family, scaling, max_pos, 1024, theta=1e6)
    if "attention_factor" in scaling:
        assert ours.attention_factor == scaling["attention_factor"]
    else:
        assert ours.attention_factor != 1.0


def test_yarn_defaults_and_derived_factor():
    # No factor: the ratio of the two lengths (transformers, for DeepSeek-V3-style configs).
    scaling = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512}
    got = check_rope_scaling(scaling, 4096)
    assert got == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                   "attention_factor": pytest.approx(0.1 * math.log(8.0) + 1.0)}
    assert check_rope_scaling(got, 4096) == got  # idempotent
    check_against_hf("qwen2", scaling, 4096, 1024)
    # No original length: transformers takes max_position_embeddings.
    got = check_rope_scaling({"type": "yarn", "factor": 2.0}, 8192)
    assert got["original_max_position_embeddings"] == 8192


def phi3_factors(n: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(n, generator=gen)).tolist()


@pytest.mark.parametrize("name", ["longrope", "su"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_matches_transformers(name, partial):
    rotary_dim = int(HEAD_DIM * partial)
    original, max_pos = 256, 4096
    scaling = {"type": name, "short_factor": phi3_factors(rotary_dim // 2, 0),
               "long_factor": phi3_factors(rotary_dim // 2, 1)}
    # Phi-3 keeps the pretraining length at the config's top level; the parser copies it in.
    normalized = check_rope_scaling({**scaling, "original_max_position_embeddings": original},
                                    max_pos, rotary_dim=rotary_dim)
    assert normalized["rope_type"] == "longrope" and normalized["factor"] == 16.0
    expected = math.sqrt(1 + math.log(16.0) / math.log(original))
    assert normalized["attention_factor"] == pytest.approx(expected)
    assert check_rope_scaling(scaling, max_pos, original, rotary_dim) == normalized
    # max_positions <= original: short_factor (transformers for sequences up to `original`);
    # above it: long_factor (transformers once the sequence passes `original`).
    for positions in (original, 1024):
        ours = RotaryEmbedding(HEAD_DIM, positions, 10000.0, normalized, rotary_dim=rotary_dim)
        assert ours.rotary_dim == rotary_dim and ours.attention_factor == pytest.approx(expected)
        # transformers 5.24's Phi3Config mis-handles "su" (renamed after its defaults are set).
        ref = hf_cos_sin("phi3", {**scaling, "type": "longrope"}, positions, 10000.0, max_pos,
                         partial_rotary_factor=partial, original_max_position_embeddings=original)
        assert_tables_match(ours, *ref)


def test_longrope_explicit_factors_and_phi3_yarn_name():
    short, long = phi3_factors(32, 2), phi3_factors(32, 3)
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 512, "factor": 4.0, "attention_factor": 1.1}
    got = check_rope_scaling(scaling, 131072)
    assert got["factor"] == 4.0 and got["attention_factor"] == 1.1
    ours = RotaryEmbedding(HEAD_DIM, 1024, 10000.0, got)
    ref = hf_cos_sin("phi3", scaling, 1024, 10000.0, 131072, original_max_position_embeddings=512)
    assert_tables_match(ours, *ref)
    # Early Phi-3 configs said "yarn" with LongRoPE's lists; transformers' Phi3Config renames it.
    renamed = check_rope_scaling({**scaling, "rope_type": "yarn"}, 131072)
    assert renamed == got


def test_partial_rotary_default_matches_transformers():
    ours = RotaryEmbedding(HEAD_DIM, 512, 10000.0, None, rotary_dim=48)
    assert ours.cos_sin(torch.tensor([0, 5, 7]))[0].shape == (3, 1, 24)
    ref = hf_cos_sin("phi3", None, 512, 10000.0, 512, partial_rotary_factor=0.75)
    assert_tables_match(ours, *ref)
    with pytest.raises(ValueError):
        RotaryEmbedding(HEAD_DIM, 16, 10000.0, None, rotary_dim=47)


def test_backwards_compatible_entry_points():
    # Raw HF dicts (with "type") still work without check_rope_scaling when they are complete.
    raw = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    normalized = check_rope_scaling(raw, 4096)
    assert torch.equal(rope_inv_freq(HEAD_DIM, 1e6, raw), rope_inv_freq(HEAD_DIM, 1e6, normalized))
    assert rope_attention_factor(raw) == rope_attention_factor(normalized) > 1.0
    assert rope_attention_factor(None) == 1.0
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None)
    cos, sin = rope.cos_sin(torch.tensor([3, 9]))
    assert cos.shape == sin.shape == (2, 1, HEAD_DIM // 2)
    x = torch.randn(2, 3, HEAD_DIM)
    # Rotation keeps each pair's norm.
    torch.testing.assert_close(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("scaling, max_pos, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, 4096, "'dynamic'"),
    ({"type": "ntk", "factor": 2.0}, 4096, "'ntk'"),
    ({"rope_type": "linear"}, 4096, "'factor'"),
    ({"rope_type": "linear", "factor": "2"}, 4096, "'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 4096,
     "'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     4096, "high_freq_factor > low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0},
     4096, "nonzero"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
      "truncate": "yes"}, 4096, "'truncate'"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 32,
      "original_max_position_embeddings": 4096}, 131072, "'short_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 31, "long_factor": [1.0] * 32,
      "original_max_position_embeddings": 4096}, 131072, "short_factor"),
    ({"type": "su", "short_factor": [1.0] * 24, "long_factor": [1.0] * 24,
      "original_max_position_embeddings": 4096}, 131072, "needs 32"),
    ([1.0, 2.0], 4096, "must be a dict"),
])
def test_refusals_name_the_supported_types(scaling, max_pos, match):
    with pytest.raises(ValueError, match=match) as err:
        check_rope_scaling(scaling, max_pos, rotary_dim=HEAD_DIM)
    assert SUPPORTED in str(err.value)


def test_incomplete_dicts_need_check_rope_scaling():
    # The table cannot guess the model's max_position_embeddings: the parser must normalize.
    phi3 = {"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="check_rope_scaling") as err:
        RotaryEmbedding(HEAD_DIM, 8192, 10000.0, phi3)
    assert SUPPORTED in str(err.value)
    with pytest.raises(ValueError, match="check_rope_scaling"):
        rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "yarn", "factor": 2.0})
