"""A prefill chunk after a cached prefix on the CPU: SDPA with a boolean mask against the torch
backend's two calls (the prefix unmasked, the chunk causal, merged by log-sum-exp).

Times a long prompt through the engine under two budgets (the chunk after the first one takes
the masked path), alternating the two forms in one process (the masked one is patched in),
medians of `--rounds`.

    .venv/bin/python benchmarks/prefix_attention.py [--prompt 4096 --budgets 2048,512]
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
from chunkserve.model import attention_torch
from chunkserve.model.attention import causal_mask
from chunkserve.model.factory import load_model
from chunkserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_speed import MODEL, prompt  # noqa: E402
from host import cpu_model  # noqa: E402

Backend = attention_torch.TorchPagedAttention
SPLIT = Backend._prefix_then_causal


def masked(self: Backend, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
           start: int) -> torch.Tensor:
    mask = causal_mask(start, qh.shape[2])
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--budgets", default="2048,512")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
    loaded = load_model(MODEL, dtype="auto", max_model_len=args.prompt + 512)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for budget in map(int, args.budgets.split(",")):
        engine = LLMEngine.from_kwargs(loaded=loaded, max_num_batched_tokens=budget,
                                       num_kv_blocks=-(-(args.prompt + 512) // 16) + 8,
                                       block_size=16, enable_prefix_caching=False)
        times: dict[str, list[float]] = {"mask": [], "split": []}
        for r in range(args.rounds):
            forms = [("mask", masked), ("split", SPLIT)]
            for name, form in forms if r % 2 == 0 else reversed(forms):
                Backend._prefix_then_causal = form  # type: ignore[method-assign]
                engine.add_request(None, prompt(args.prompt, 50 + r), params)
                t0 = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                times[name].append(time.perf_counter() - t0)
        Backend._prefix_then_causal = SPLIT  # type: ignore[method-assign]
        mask_s, split_s = (statistics.median(times[k]) for k in ("mask", "split"))
        print(f"budget {budget}: {args.prompt}-token prompt in {-(-args.prompt // budget)} "
              f"chunks: masked {mask_s:.2f} s, split {split_s:.2f} s "
              f"(ratio {split_s / mask_s:.2f})", flush=True)


if __name__ == "__main__":
    main()
