"""A CPU prefill-chunk attention kernel of this tree against a baseline commit's, or against
PyTorch's SDPA, called directly and alternately on the chunks of `--layers` layers.

One chunk of `--chunk` query tokens after a cached prefix of `--prefix` tokens, SmolLM2's heads
(9 query, 3 KV, head size 64), `--head-dim 128` with 8 and 2, or `--head-dim 256` with Gemma 3
270M's 4 and 1; blocks of `--block-size` scattered over each layer's own pool. `--dtype
bfloat16` (default) times chunk_attention_bf16.c, `--dtype float32` chunk_attention_avx2.c
(float32 queries and caches, built for `CHUNKSERVE_CPU_ISA`'s instruction set as the engine
builds it). `--baseline sdpa` puts the kernel against the torch backend's SDPA path, which the
cpu backend takes where it has no chunk kernel (K/V gathered out of the blocks and repeated per
query head; after a prefix, two calls merged). Prints ms per call of all layers (median), the
attention FLOP rate (causal: query i sees prefix + i + 1 keys), and the largest output
difference between the two and against float32 attention over the same values (last layer).

    .venv/bin/python benchmarks/kernels/chunk_kernel_ab.py --baseline HEAD [--chunk 2048 --prefix 0]
    CHUNKSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python \
        benchmarks/kernels/chunk_kernel_ab.py --dtype float32 --baseline sdpa --chunk 512
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import BatchLayout, DeviceStager
from chunkserve.model.kernels import cpu_library

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.kernels.decode_kernel_ab import (  # noqa: E402
    KERNEL_DIR, REPO, alternate, compile_kernel, time_alternately)


HEADS = {64: (9, 3), 128: (8, 2), 256: (4, 1)}  # query and KV heads by head size
KERNELS = {torch.bfloat16: "chunk_attention_bf16", torch.float32: "chunk_attention_avx2"}


class Chunk:
    """`layers` layers of caches holding prefix + chunk tokens, and one kernel call each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dtype = getattr(torch, args.dtype)
        self.heads, self.kv_heads = HEADS[args.head_dim]
        self.seq_len = args.prefix + args.chunk
        bs, d = args.block_size, args.head_dim
        self.width = -(-self.seq_len // bs)
        rng = np.random.default_rng(0)
        self.layers = []
        for _ in range(args.layers):
            kc, vc = (torch.randn(self.width, bs, self.kv_heads, d).to(self.dtype)
                      for _ in range(2))
            table = np.ascontiguousarray(rng.permutation(self.width)[None], dtype=np.int64)
            self.layers.append((kc, vc, table))
        self.q = torch.randn(args.chunk, self.heads, d).to(self.dtype)
        self.arrays = [np.array([v], np.int64) for v in (self.seq_len, 0, args.chunk)]

    def run(self, fn, out: torch.Tensor,  # type: ignore[no-untyped-def]
            this_tree: bool) -> float:  # one cache type for both kernels here
        a, (seq_lens, starts, lens) = self.args, self.arrays
        kind = cpu_library.STORAGE_KINDS[self.dtype]
        t0 = time.perf_counter()
        for kc, vc, table in self.layers:
            assert fn(out.data_ptr(), self.q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kind,
                      table.ctypes.data, self.width, seq_lens.ctypes.data, starts.ctypes.data,
                      lens.ctypes.data, 1, 0, self.heads, self.kv_heads, a.head_dim,
                      a.block_size, a.head_dim ** -0.5, torch.get_num_threads()) == 0
        return time.perf_counter() - t0

    def sdpa(self) -> Callable[[torch.Tensor], float]:
        """The torch backend's SDPA over each layer's chunk (its metadata built beforehand, as
        the engine builds it once a step), timed as `run` times a kernel."""
        backend = TorchPagedAttention(self.heads, self.kv_heads, self.args.head_dim)
        metas = []
        for _, _, table in self.layers:
            positions = np.arange(self.args.prefix, self.seq_len)
            slots = table[0][positions // self.args.block_size] * self.args.block_size + \
                positions % self.args.block_size
            layout = BatchLayout(np.zeros(self.args.chunk, np.int64), positions, slots,
                                 np.array([0, self.args.chunk]), np.array([self.seq_len]),
                                 table, self.args.block_size)
            metas.append(backend.build_metadata(DeviceStager(torch.device("cpu")).to_device(
                layout)))

        def run(out: torch.Tensor) -> float:
            flat = out.view(self.args.chunk, -1)
            t0 = time.perf_counter()
            with torch.inference_mode():
                for (kc, vc, _), meta in zip(self.layers, metas):
                    backend._attend(self.q, kc, vc, meta.seqs, flat)
            return time.perf_counter() - t0
        return run

    def flops(self) -> int:
        a = self.args
        keys = a.chunk * a.prefix + a.chunk * (a.chunk + 1) // 2
        return 4 * self.heads * a.head_dim * keys * a.layers

    def reference(self) -> torch.Tensor:
        """Float32 attention over the last layer's values (each call leaves its output)."""
        kc, vc, table = self.layers[-1]
        idx = torch.from_numpy(table[0])
        k, v = (c[idx].reshape(-1, self.kv_heads, self.args.head_dim)[: self.seq_len].float()
                .transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)[None]
                for c in (kc, vc))
        mask = torch.arange(self.seq_len)[None, :] <= torch.arange(self.args.prefix,
                                                                   self.seq_len)[:, None]
        o = F.scaled_dot_product_attention(self.q.float().transpose(0, 1)[None], k, v,
                                           attn_mask=mask)
        return o[0].transpose(0, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD",
                   help="git revision to compare against, or `sdpa`: the torch backend's SDPA")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=0)
    p.add_argument("--head-dim", type=int, choices=sorted(HEADS), default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
    step = Chunk(args)
    symbol, shape = KERNELS[step.dtype], (args.chunk, step.heads, args.head_dim)
    build = {"source": f"{symbol}.c", "symbol": symbol, "argtypes": cpu_library.CHUNK_ARGTYPES,
             "kv_kind_at": 4}
    if args.baseline == "sdpa":
        with tempfile.TemporaryDirectory() as tmp:
            kernel = compile_kernel(os.path.join(REPO, KERNEL_DIR), tmp, **build)
            times, outs = time_alternately(
                {"SDPA (torch backend)": step.sdpa(),
                 "this tree": lambda out: step.run(kernel, out, True)},
                shape, args.rounds, step.dtype)
    else:
        times, outs = alternate(args.baseline, step, shape, args.rounds, step.dtype, **build)
    print(f"{args.layers} layers x a {args.chunk}-token chunk after {args.prefix}, head size "
          f"{args.head_dim}, {args.dtype}, blocks of {args.block_size} shuffled")
    ref = step.reference()
    print("| kernel | ms/call (median) | GFLOP/s | max abs error vs float32 |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        err = (outs[name].float() - ref).abs().max().item()
        print(f"| {name} | {med * 1e3:.2f} | {step.flops() / med / 1e9:.0f} | {err:.2g} |")
    base, new = outs.values()
    print(f"max |difference| of the outputs: {(base.float() - new.float()).abs().max().item():.3g}")
    first, second = (statistics.median(ts) for ts in times.values())
    print(f"{list(times)[0]} / this tree: {first / second:.2f}x")


if __name__ == "__main__":
    main()
