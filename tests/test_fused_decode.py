"""The fused decode step (model/fused_decode.py: a decode step's layers as one C call) gives the
op-by-op path's numbers bit for bit, and only runs where it applies.

Each case generates the same prompts twice, fused and under --enforce-eager (op by op), through
chunked prefill (the prefill and mixed steps take the op-by-op path both times, the pure decode
steps the C stack in one run): tokens and their logprobs must be equal, not close. Needs the AVX2
group GEMM (any x86-64-v3 CPU); skipped elsewhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.model.fused_decode import FusedDecodeStack, why_not
from chunkserve.model.layers import group_gemm

from arch_models import hf_model, save_hf_folder

pytestmark = pytest.mark.skipif(group_gemm.available("avx2") is None,
                                reason="the fused decode step runs on the AVX2 group GEMM")


@pytest.fixture(autouse=True)
def avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels as an AVX2-only CPU builds them, so that a CPU with AVX512_BF16 (whose
    own group GEMM is another) runs these tests too."""
    monkeypatch.setenv("CHUNKSERVE_CPU_ISA", "avx2")

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def _prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[(7919 * (i + 1) + 104729 * j) % (vocab - 10) + 5 for j in range(n)]
            for i, n in enumerate(lengths)]


def _run(path: str, eager: bool, prompts: list[list[int]], **kwargs: Any) -> tuple[list, list]:
    """(each output's (token ids, logprobs)), and the token count of each step that ran the C
    stack. A budget of 32 by default: prompts in chunks, steps of chunks and decodes mixed."""
    llm = LLM(model=path, enforce_eager=eager, **{"max_num_batched_tokens": 32,
                                                  "max_model_len": 256, **kwargs})
    runner = llm.engine.executor
    fused: FusedDecodeStack | None = runner.fused_decode  # type: ignore[attr-defined]
    steps: list[int] = []
    if fused is not None:
        run = fused.run

        def counting(input_ids: Any, *args: Any) -> Any:
            hidden = run(input_ids, *args)
            if hidden is not None:
                steps.append(input_ids.shape[0])
            return hidden
        fused.run = counting  # type: ignore[method-assign]
    outs = llm.generate(prompts, PARAMS)
    llm.engine.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps


def _same(path: str, prompts: list[list[int]], **kwargs: Any) -> list[int]:
    """Asserts equal outputs; returns the token counts of the fused steps."""
    fused, steps = _run(path, False, prompts, **kwargs)
    eager, eager_steps = _run(path, True, prompts, **kwargs)
    assert steps and not eager_steps, "the fused step did not run (or ran under eager)"
    assert fused == eager
    return steps


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    names = ["llama", "mistral", "qwen2", "qwen3", "phi3-partial-rotary"]
    return {n: save_hf_folder(hf_model(n), root / n) for n in names}


# Llama (GQA, tied head), Mistral (head 128), Qwen2 (q/k/v biases), Qwen3 (q/k norms),
# Phi-3 with partial rotary: int8 layers over float32 caches ("auto" under --dtype float32);
# two of them int4 over bfloat16 ones.
CASES = [("llama", "int8", "auto"), ("mistral", "int8", "auto"),
         ("qwen2", "int8", "auto"), ("qwen3", "int8", "auto"),
         ("phi3-partial-rotary", "int8", "auto"), ("llama", "int4", "bfloat16"),
         ("qwen3", "int4", "bfloat16")]


@pytest.mark.parametrize("arch,quantization,kv", CASES)
def test_fused_equals_op_by_op(folders: dict[str, Path], arch: str, quantization: str,
                               kv: str) -> None:
    prompts = _prompts([3, 17, 40, 70], 512)
    _same(str(folders[arch]), prompts, dtype="float32", quantization=quantization,
          kv_cache_dtype=kv)


def test_many_decodes_fused_equals_op_by_op(folders: dict[str, Path]) -> None:
    """24 decodes a step: int4's many-row GEMM path (group_gemm_avx2.c's WIDE_MIN_ROWS, 20)
    inside the stack, and attention tasks of many decodes."""
    prompts = _prompts([3 + 5 * i for i in range(24)], 512)
    steps = _same(str(folders["llama"]), prompts, dtype="float32", quantization="int4",
                  kv_cache_dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=2048)
    assert max(steps) == 24


def test_default_model_fused_equals_op_by_op(smollm2_path: str) -> None:
    """SmolLM2 as a CPU without AVX512_BF16 serves it by default (float32 activations, int4
    layers from its Q4 file, a bfloat16 cache; spelled out, so that every host runs it), a
    batch of decodes of several context lengths."""
    _same(smollm2_path, _prompts([5, 30, 66], 49152), dtype="float32", quantization="int4",
          kv_cache_dtype="bfloat16")


def test_models_it_does_not_take(folders: dict[str, Path]) -> None:
    """Float32 dense layers and an fp8 cache run op by op, and say why."""
    dense = LLM(model=str(folders["llama"]), dtype="float32", quantization="none",
                max_model_len=64)
    runner = dense.engine.executor
    assert runner.fused_decode is None  # type: ignore[attr-defined]
    reason = why_not(runner.model, runner.kv_caches)  # type: ignore[attr-defined]
    assert reason is not None and "group GEMM with a team entry" in reason
    dense.engine.close()
    fp8 = LLM(model=str(folders["llama"]), dtype="float32", quantization="int8",
              kv_cache_dtype="fp8", max_model_len=64)
    runner = fp8.engine.executor
    assert runner.fused_decode is None  # type: ignore[attr-defined]
    reason = why_not(runner.model, runner.kv_caches)  # type: ignore[attr-defined]
    assert reason is not None and "KV cache" in reason
    fp8.engine.close()
