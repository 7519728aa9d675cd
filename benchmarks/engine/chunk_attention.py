"""Prefill-chunk attention on the CPU, three ways, through the whole engine in one process:

  mask    PyTorch's fused SDPA, one call per chunk, a boolean mask for a chunk after a prefix;
  split   the torch backend: for a chunk after a prefix, two fused calls (prefix unmasked,
          chunk causal) merged by their log-sum-exps;
  kernel  the cpu backend's C kernel, all chunks of a step in one call, K/V read in place
          (chunk_attention_bf16.c: bfloat16 caches on AVX512_BF16 CPUs; chunk_attention_avx2.c:
          float32 ones, on AVX2 CPUs and under CHUNKSERVE_CPU_ISA=avx2).

Each case is a prompt through the engine (max_tokens=1) at a token budget: one step when the
budget holds the prompt, else chunks after a growing prefix. The forms swap the model's
attention backend between runs, in alternating order each round; medians of `--rounds`.

    .venv/bin/python benchmarks/engine/chunk_attention.py [--cases 512:512,4096:4096,4096:512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.model.attention import torch_backend
from chunkserve.model.attention.backend import causal_mask
from chunkserve.model.attention.cpu_backend import CpuPagedAttention
from chunkserve.model.factory import load_model
from chunkserve.sampling_params import SamplingParams

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.engine.engine_speed import MODEL, prompt  # noqa: E402

Backend = torch_backend.TorchPagedAttention
SPLIT = Backend._prefix_then_causal


def masked(self: Backend, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
           start: int) -> torch.Tensor:
    mask = causal_mask(start, qh.shape[2])
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)


def use(form: str, model: torch.nn.Module, backends: dict[str, object]) -> None:
    """Puts form's backend into the model (and the mask or split path into the torch one)."""
    Backend._prefix_then_causal = masked if form == "mask" else SPLIT  # type: ignore[method-assign]
    model.attn = backends["kernel" if form == "kernel" else "torch"]


def prompt_seconds(engine: LLMEngine, n: int, salt: int) -> float:
    engine.add_request(None, prompt(n, salt), SamplingParams(max_tokens=1, temperature=0,
                                                             ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="512:512,2048:2048,4096:4096,4096:2048,4096:512",
                   help="prompt:budget pairs")
    p.add_argument("--forms", default="mask,split,kernel")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
    cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",")]
    forms = args.forms.split(",")
    longest = max(n for n, _ in cases)
    loaded = load_model(MODEL, dtype="auto", max_model_len=longest + 512)
    m = loaded.model
    backends = {"torch": Backend(m.num_heads, m.num_kv_heads, m.head_dim)}
    if "kernel" in forms:
        kernel = CpuPagedAttention(m.num_heads, m.num_kv_heads, m.head_dim)
        if kernel._chunk_kernel_for(m.kv_dtype, m.kv_dtype) is None:
            sys.exit("no chunk kernel for this cache here (bfloat16 needs AVX512_BF16, float32 "
                     "AVX2); pass --forms mask,split")
        backends["kernel"] = kernel
    print(f"| prompt | budget | chunks | " + " | ".join(f"{f} s" for f in forms)
          + " | kernel / split |\n|---:|---:|---:|" + "---:|" * (len(forms) + 1), flush=True)
    for n, budget in cases:
        engine = LLMEngine.from_kwargs(loaded=loaded, max_num_batched_tokens=budget,
                                       num_kv_blocks=-(-(longest + 512) // 16) + 8,
                                       block_size=16, enable_prefix_caching=False)
        times: dict[str, list[float]] = {f: [] for f in forms}
        use(forms[0], m, backends)
        prompt_seconds(engine, min(n, 512), salt=0)  # warm-up
        for r in range(args.rounds):
            for form in forms if r % 2 == 0 else reversed(forms):
                use(form, m, backends)
                times[form].append(prompt_seconds(engine, n, salt=50 + r))
        med = {f: statistics.median(t) for f, t in times.items()}
        ratio = f"{med['kernel'] / med['split']:.2f}" if {"kernel", "split"} <= med.keys() else "–"
        print(f"| {n} | {budget} | {-(-n // budget)} | "
              + " | ".join(f"{med[f]:.2f}" for f in forms) + f" | {ratio} |", flush=True)
    use("kernel" if "kernel" in forms else "split", m, backends)


if __name__ == "__main__":
    main()
