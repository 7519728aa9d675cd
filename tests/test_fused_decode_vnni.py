"""The fused decode step on the VNNI group GEMM (CPUs with AVX512_VNNI and BF16, where it is
the default): bit for bit the op-by-op path's tokens and logprobs, with bfloat16 activations
(this CPU's default: q, the attention's output and the GEMM outputs as bfloat16's values) and
with float32 ones. Skipped where the kernel is not built; the AVX2 stack is
tests/test_fused_decode.py's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve.model.layers import group_gemm

from test_fused_decode import _prompts, _same, folders  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif("vnni" not in group_gemm.kernels(),
                                reason="the vnni group GEMM needs AVX512_VNNI and BF16")

# Llama (GQA, tied head), Qwen2 (q/k/v biases: rounded after the add, as PyTorch's bfloat16
# add), Qwen3 (q/k norms), Phi-3 with partial rotary, Mistral (head 128: the bfloat16
# attention path's other head size).
CASES = [("llama", "int4", "bfloat16"), ("qwen2", "int8", "bfloat16"),
         ("qwen3", "int4", "bfloat16"), ("phi3-partial-rotary", "int8", "bfloat16"),
         ("mistral", "int4", "bfloat16"), ("llama", "int8", "float32"),
         ("qwen2", "int4", "float32")]


@pytest.mark.parametrize("arch,quantization,dtype", CASES)
def test_vnni_fused_equals_op_by_op(folders: dict[str, Path], arch: str,  # noqa: F811
                                    quantization: str, dtype: str) -> None:
    _same(str(folders[arch]), _prompts([3, 17, 40, 70], 512), dtype=dtype,
          quantization=quantization, kv_cache_dtype="bfloat16")


def test_vnni_many_decodes_fused_equals_op_by_op(folders: dict[str, Path]) -> None:  # noqa: F811
    """24 decodes a step: passes of 6 rows over two channel blocks, and their tail."""
    steps = _same(str(folders["llama"]), _prompts([3 + 5 * i for i in range(24)], 512),
                  dtype="bfloat16", quantization="int4", kv_cache_dtype="bfloat16",
                  max_num_seqs=32, max_num_batched_tokens=2048)
    assert max(steps) == 24


def test_default_model_on_this_cpu_fused_equals_op_by_op(smollm2_path: str) -> None:
    """SmolLM2 as this CPU serves it by default (dtype and quantization auto: bfloat16
    activations, int4 layers from its Q4 file, a bfloat16 cache)."""
    _same(smollm2_path, _prompts([5, 30, 66], 49152))
