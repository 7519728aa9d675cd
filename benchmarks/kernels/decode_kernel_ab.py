"""The CPU decode-attention kernel of this tree against a baseline commit's, on a whole step.

`cpu_attention.py` times one layer, whose K/V (a few MB) then sit in the L3 cache; a served
step reads every layer's K/V from DRAM. Here both kernels are compiled (the baseline's sources
taken from git) and called directly, alternately, on a step of `--layers` layers, each with its
own caches: B decodes of L context tokens in blocks of `--block-size` scattered over the pool
(`--layout shuffled`, a pool after some serving) or request by request (`--layout sequential`,
what a benchmark that prefills first gets). SmolLM2's heads (9 query, 3 KV, head size 64),
bfloat16 (or `--kv-dtype float32`, or `fp8_e4m3|fp8_e5m2` caches, for kernels that read them;
`--kv-dtype bfloat16:fp8_e4m3` gives the baseline bfloat16 caches and this tree fp8 ones, the
same values rounded: with `--baseline HEAD`, one kernel on both cache types). The queries and
outputs are float32 where the engine would run float32 activations (no AVX512_BF16, or
`CHUNKSERVE_CPU_ISA=avx2`) or the caches are float32, else bfloat16. Both kernels are built for
`CHUNKSERVE_CPU_ISA`'s instruction set, as the engine builds them. Prints ms per step (median),
the K/V read rate, and the largest output difference between the two kernels.

    .venv/bin/python benchmarks/kernels/decode_kernel_ab.py --baseline HEAD \
        [--batch 64 --context 512]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from chunkserve.model.kernels import cpu_library
from chunkserve.model.attention.backend import FP8_BY_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # so that `benchmarks.*` imports when this file runs as a script
from benchmarks.common.host import cpu_model  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
KERNEL_DIR = "chunkserve/model/kernels/csrc"
OLD_KERNEL_DIR = "chunkserve/model/cpu_kernels"  # where the sources lived before model/ by role


def kernel_dir_at(rev: str) -> str:
    """The kernel folder's path in commit `rev` (it moved once)."""
    found = subprocess.run(["git", "cat-file", "-e", f"{rev}:{KERNEL_DIR}"], cwd=REPO,
                           capture_output=True)
    return KERNEL_DIR if found.returncode == 0 else OLD_KERNEL_DIR


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "fp8_e4m3": FP8_BY_NAME["fp8_e4m3"],
             "fp8_e5m2": FP8_BY_NAME["fp8_e5m2"]}


def build_library(source_dir: str, out_dir: str, source: str) -> tuple[ctypes.CDLL, str]:
    """One kernel source of `source_dir` compiled as the engine compiles it (with storage.c,
    where that tree has it), loaded; and the source's text (callers check its signature)."""
    so = os.path.join(out_dir, source.replace(".c", ".so"))
    sources = [os.path.join(source_dir, n) for n in (source, "storage.c")
               if os.path.exists(os.path.join(source_dir, n))]
    error = cpu_library.compile_shared("cc", sources, so, cpu_library.cflags(cpu_library.isa()))
    if error:
        sys.exit(error)
    with open(sources[0]) as f:
        return ctypes.CDLL(so), f.read()


def compile_kernel(source_dir: str, out_dir: str, source: str = "paged_decode.c",
                   symbol: str = "paged_decode_attention", argtypes: list | None = None,
                   kv_kind_at: int = 5) -> Callable[..., int]:
    """One kernel source of `source_dir` compiled as the engine compiles it (with storage.c,
    where that tree has it), and its entry point (chunk_kernel_ab.py passes the chunk
    kernel's). The caller always passes the cache's storage kind as argument `kv_kind_at`;
    kernels from before fp8 caches take no such argument, and are called without it."""
    lib, text = build_library(source_dir, out_dir, source)
    takes_kind = "kv_kind" in text
    fn = getattr(lib, symbol)
    argtypes = list(argtypes or cpu_library.ARGTYPES)
    fn.argtypes = argtypes if takes_kind else argtypes[:kv_kind_at] + argtypes[kv_kind_at + 1:]
    fn.restype = ctypes.c_int
    if takes_kind:
        return fn  # type: ignore[no-any-return]
    return lambda *args: fn(*args[:kv_kind_at], *args[kv_kind_at + 1:])


def baseline_sources(rev: str, out_dir: str) -> str:
    """The kernel folder as of `rev`, written under out_dir."""
    folder = kernel_dir_at(rev)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=REPO,
                              check=True, capture_output=True).stdout
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(blob)
    return out_dir


def alternate(baseline: str, step: Any, out_shape: tuple[int, ...], rounds: int,
              out_dtype: torch.dtype = torch.bfloat16,
              **build: Any) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Compiles the baseline's kernel and this tree's (`build`: compile_kernel's source, symbol
    and argtypes) and times `step.run(kernel, out, is_this_tree)` with each, alternately, the
    order flipped each round. Returns the seconds and the last output of each, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        kernels = {baseline: compile_kernel(baseline_sources(baseline, base), base, **build),
                   "this tree": compile_kernel(os.path.join(REPO, KERNEL_DIR), tmp, **build)}
        runs = {name: (lambda out, fn=fn, mine=name == "this tree": step.run(fn, out, mine))
                for name, fn in kernels.items()}
        return time_alternately(runs, out_shape, rounds, out_dtype)


def time_alternately(runs: dict[str, Callable[[torch.Tensor], float]],
                     out_shape: tuple[int, ...], rounds: int, out_dtype: torch.dtype
                     ) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Calls each of `runs` (given its output tensor, it returns the seconds it took) in turn,
    `rounds` times, the order flipped each round. Returns the seconds and the last output of
    each, by name."""
    outs = {name: torch.empty(out_shape, dtype=out_dtype) for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs.items())
        for name, run in order if r % 2 == 0 else reversed(order):
            times[name].append(run(outs[name]))
    return times, outs


def activations(kv_dtypes: list[torch.dtype]) -> torch.dtype:
    """The queries' and outputs' dtype: float32 for float32 caches (the kernels take q and K/V
    in one dtype) or where the engine runs float32 activations (no AVX512_BF16)."""
    from chunkserve.model.factory import cpu_has_avx512_bf16

    if torch.float32 in kv_dtypes or not cpu_has_avx512_bf16():
        return torch.float32
    return torch.bfloat16


class Step:
    """`layers` layers of caches and block tables, and the call of one kernel on all."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        bs, b = args.block_size, args.batch
        self.width = -(-args.context // bs)
        rng = np.random.default_rng(0)
        self.layers = []
        names = args.kv_dtype.split(":")
        self.kv_dtypes = [KV_DTYPES[n] for n in (names[0], names[-1])]  # baseline, this tree
        for _ in range(args.layers):
            blocks = b * self.width
            order = rng.permutation(blocks) if args.layout == "shuffled" else np.arange(blocks)
            kv = [torch.randn(blocks, bs, KV_HEADS, HEAD_DIM) for _ in range(2)]
            self.layers.append(([[c.to(dtype) for c in kv] for dtype in self.kv_dtypes],
                                np.ascontiguousarray(order.reshape(b, self.width))))
        self.q = torch.randn(b, HEADS, HEAD_DIM).to(activations(self.kv_dtypes))
        self.seq_lens = np.full(b, args.context, np.int64)
        self.rows = np.arange(b, dtype=np.int64)

    def run(self, fn: Callable[..., int], out: torch.Tensor, this_tree: bool) -> float:
        dtype = self.kv_dtypes[this_tree]
        kind = cpu_library.STORAGE_KINDS[dtype]
        t0 = time.perf_counter()
        for caches, table in self.layers:
            kc, vc = caches[this_tree]
            fn(out.data_ptr(), self.q.data_ptr(), kc.data_ptr(), vc.data_ptr(),
               int(self.q.dtype == torch.bfloat16), kind,
               table.ctypes.data, self.width, self.seq_lens.ctypes.data, self.rows.ctypes.data,
               self.args.batch, 0, HEADS, KV_HEADS, HEAD_DIM, self.args.block_size,
               HEAD_DIM ** -0.5, torch.get_num_threads())
        return time.perf_counter() - t0

    def kv_bytes(self, this_tree: bool) -> int:
        a = self.args
        elem = torch.empty((), dtype=self.kv_dtypes[this_tree]).element_size()
        return 2 * a.batch * a.context * KV_HEADS * HEAD_DIM * elem * a.layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layout", choices=("shuffled", "sequential"), default="shuffled")
    p.add_argument("--kv-dtype", default="bfloat16",
                   help=f"the caches' ({', '.join(KV_DTYPES)}; fp8: the kernel must read it), "
                        "or BASELINE:THIS_TREE")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
    names = args.kv_dtype.split(":")
    if len(names) > 2 or any(n not in KV_DTYPES for n in names):
        sys.exit(f"--kv-dtype: one or two (BASELINE:THIS_TREE) of {', '.join(KV_DTYPES)}")
    if names[0] not in ("bfloat16", "float32"):
        source = subprocess.run(["git", "show",
                                 f"{args.baseline}:{kernel_dir_at(args.baseline)}/paged_decode.c"],
                                cwd=REPO, check=True, capture_output=True, text=True).stdout
        if "kv_kind" not in source:
            sys.exit(f"{args.baseline}'s kernel reads bfloat16 and float32 caches only")
    step = Step(args)
    times, outs = alternate(args.baseline, step, (args.batch, HEADS, HEAD_DIM), args.rounds,
                            step.q.dtype)
    print(f"{args.layers} layers x {args.batch} decodes x {args.context} tokens, blocks of "
          f"{args.block_size}, {args.layout}, K/V {args.kv_dtype}, q {step.q.dtype}")
    print("| kernel | K/V MB a step | ms/step (median) | K/V GB/s |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        med, gb = statistics.median(ts), step.kv_bytes(name == "this tree") / 1e9
        print(f"| {name} | {gb * 1e3:.0f} | {med * 1e3:.2f} | {gb / med:.1f} |")
    base, new = outs.values()
    print(f"max |difference| of the outputs: {(base.float() - new.float()).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
