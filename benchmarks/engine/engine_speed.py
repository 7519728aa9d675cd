"""Engine speed on this CPU, set against a roofline measured in the same run.

For each compute dtype it prints:
  1. the roofline: peak GEMM GFLOP/s (the model's own GEMM shapes and a large square one) and
     memory bandwidth (copy, read+write; and a read-only reduction, used for decode);
  2. prefill tok/s for single-step prompts, and the fraction of the FLOP roofline reached;
  3. decode ms/step at several batch sizes with a ~512-token context, and the fraction of the
     memory-bandwidth roofline reached (plus the FLOP fraction, for completeness);
and ends with a markdown table for docs/performance.md.

Times are whole `engine.step()` durations from the step trace (schedule + model + sample +
bookkeeping), i.e. what a user of the engine gets, not a bare forward pass. The machine may be
shared and noisy: every number is a median, and the roofline is re-measured right before each
dtype's runs so the fractions compare numbers taken under the same conditions.

    .venv/bin/python benchmarks/engine/engine_speed.py [--dtype auto|float32|bfloat16|both]
                                                       [--repeats 3] [--quick]

Other scripts reuse its roofline, model cost and step loops (engine/decode_scaling.py,
engine/chunk_attention.py, gpu/gpu_check.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.model.factory import LoadedModel, load_model, resolve_dtype
from chunkserve.model.layers.dense_gemm import DenseWeight
from chunkserve.sampling_params import SamplingParams

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.common.timing import median_time  # noqa: E402

MODEL = "smollm2-135m"
PREFILL_SIZES = (128, 512, 2048, 4096)
DECODE_BATCHES = (1, 8, 32, 64)
QUICK_PREFILL_SIZES = (128, 512)
QUICK_DECODE_BATCHES = (1, 8)
DECODE_CONTEXT = 512
BLOCK_SIZE = 16
GB = 1e9  # decimal GB/s and GFLOP/s, as vendors quote bandwidth
MiB = 1 << 20


# ---- roofline ----------------------------------------------------------------------------------
@dataclass
class Roofline:
    gemm: dict[str, float]  # shape label -> GFLOP/s (median)
    copy_gbs: float  # copy_: bytes read + bytes written
    read_gbs: float  # sum(): bytes read

    @property
    def peak_gflops(self) -> float:
        return max(self.gemm.values())


@torch.inference_mode()
def measure_gemm(loaded: LoadedModel, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """GFLOP/s of the GEMMs a 2048-token prefill runs (the model's own GEMM: `DenseWeight`, on
    the CPU a weight pre-packed for oneDNN), the brief's torch.matmul form of the MLP shape,
    and a large square matmul."""
    layer = loaded.model.layers[0]
    T = 2048
    hidden = loaded.config.hidden_size
    cases: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}
    for name, lin in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up),
                      ("down", layer.down)):
        out_f, in_f = lin.shape
        x = torch.randn(T, in_f).to(dtype)
        cases[f"linear {T}x{in_f}·{in_f}x{out_f} ({name})"] = (
            x, torch.randn(out_f, in_f).to(dtype), True)
    inter = loaded.config.intermediate_size
    cases[f"matmul {T}x{hidden}·{hidden}x{inter}"] = (
        torch.randn(T, hidden).to(dtype), torch.randn(hidden, inter).to(dtype), False)
    cases["matmul 2048^3"] = (
        torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype), False)

    # The first GEMMs of a process run slow (thread pool start-up, clocks ramping): without
    # this ~0.5 s of square matmuls the first shape measured reads 3-4x low.
    a, b = cases["matmul 2048^3"][:2]
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        a @ b

    out: dict[str, float] = {}
    for label, (a, b, is_linear) in cases.items():
        n = b.shape[0] if is_linear else b.shape[1]
        flops = 2 * a.shape[0] * a.shape[1] * n
        fn = (lambda a=a, g=DenseWeight(b): g(a)) if is_linear else (lambda a=a, b=b: a @ b)
        out[label] = flops / median_time(fn, max(repeats, 5), warmup=2) / GB
    return out


@torch.inference_mode()
def measure_bandwidth(repeats: int, size_mib: int = 256) -> tuple[float, float]:
    """(copy GB/s counting read+write, read-only GB/s) on float32 tensors far larger than the
    L3. Bytes are bytes, so one dtype serves both compute dtypes; float32 keeps the reduction
    itself cheap (a bf16 sum would also pay for widening each element)."""
    n = size_mib * MiB // 4
    src = torch.ones(n)  # written once so its pages exist before timing
    dst = torch.zeros(n)
    reps = max(repeats, 5)
    copy_s = median_time(lambda: dst.copy_(src), reps, warmup=2)
    read_s = median_time(lambda: src.sum(), reps, warmup=2)
    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / copy_s / GB, nbytes / read_s / GB


def measure_roofline(loaded: LoadedModel, dtype: torch.dtype, repeats: int) -> Roofline:
    gemm = measure_gemm(loaded, dtype, repeats)
    copy_gbs, read_gbs = measure_bandwidth(repeats)
    return Roofline(gemm, copy_gbs, read_gbs)


# ---- model cost ---------------------------------------------------------------------------------
@dataclass
class ModelCost:
    """FLOP and byte counts of one step, from the loaded model's own tensors."""

    linear_params: int  # q/k/v/o/gate/up/down weights of all layers (non-embedding GEMMs)
    head_params: int  # lm_head (tied to the embedding here): vocab x hidden
    norm_params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    weight_stream_bytes: int  # what a decode step reads of the linears and the head, as stored
    kv_elem: int  # bytes per element of the KV cache (float32 whatever the linears use)

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelCost:
        m = loaded.model
        linear = sum(lin.shape[0] * lin.shape[1]
                     for L in m.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
        norms = m.norm.numel() + sum(L.input_norm.numel() + L.post_norm.numel() for L in m.layers)
        head = m.lm_head.shape[0] * m.lm_head.shape[1]
        # Each linear's own count: int8 and int4 (with their scales) stream fewer bytes.
        stream = m.lm_head.weight_bytes + sum(
            lin.weight_bytes for L in m.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
        return cls(linear, head, norms, len(m.layers), m.num_heads,
                   m.num_kv_heads, m.head_dim, stream,
                   torch.empty((), dtype=m.kv_dtype).element_size())

    def attention_flops(self, context_sum: int) -> int:
        # Per query token and head: QK^T and PV are each 2*head_dim FLOPs per visible key,
        # so 4 * layers * heads * head_dim * (keys it sees), summed over the step's tokens.
        return 4 * self.layers * self.heads * self.head_dim * context_sum

    def prefill_flops(self, n: int) -> int:
        # FLOPs = 2 * linear_params * n            (every token through every GEMM)
        #       + 2 * head_params * 1              (lm_head only for the one sampled token)
        #       + 4 * L * H * d * sum_{i=1..n} i   (causal attention: token i sees i keys,
        #                                           ~n^2/2 per head, x2 for QK^T and PV)
        return 2 * self.linear_params * n + 2 * self.head_params + self.attention_flops(
            n * (n + 1) // 2)

    def decode_flops(self, batch: int, context_sum: int) -> int:
        # Each of the `batch` tokens runs every GEMM and the lm_head, and attends over its context.
        return 2 * (self.linear_params + self.head_params) * batch + self.attention_flops(
            context_sum)

    @property
    def weight_bytes(self) -> int:
        # Everything a decode step must stream from memory once: every weight as stored,
        # lm_head counted once (the embedding gather of B rows is negligible), float32 norms.
        return self.weight_stream_bytes + self.norm_params * 4

    def kv_bytes(self, context_sum: int) -> int:
        # K and V of every layer for every context token read: ctx * L * 2 * kv_heads * d * elem.
        return context_sum * self.layers * 2 * self.kv_heads * self.head_dim * self.kv_elem

    def decode_bytes(self, context_sum: int) -> int:
        return self.weight_bytes + self.kv_bytes(context_sum)


# ---- engine runs -------------------------------------------------------------------------------
@dataclass
class Result:
    phase: str  # "prefill" or "decode"
    size: int  # prompt tokens (prefill) or batch size (decode)
    seconds: float  # median step duration
    tokens: int  # tokens produced/processed by that step
    flops: int
    nbytes: int  # bytes the bandwidth roofline charges (decode only; 0 for prefill)
    context: float = 0.0  # mean context per request during the measured decode steps

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / GB

    @property
    def gbs(self) -> float:
        return self.nbytes / self.seconds / GB


def prompt(n: int, salt: int) -> list[int]:
    # Plain in-vocabulary ids well above the special tokens; the salt keeps requests distinct.
    return [100 + (i * 7 + salt * 13) % 40000 for i in range(n)]


def make_engine(loaded: LoadedModel, prefill_sizes: tuple[int, ...],
                batches: tuple[int, ...], decode_steps: int,
                **engine_kwargs: Any) -> tuple[LLMEngine, int]:
    """One engine for both phases (they never overlap). Returns it and the decode max_tokens.
    `engine_kwargs` add engine flags (gpu_check.py: enforce_eager)."""
    budget = max(max(prefill_sizes), DECODE_CONTEXT)  # >= every prompt: one step per prefill
    max_b = max(batches)
    # Output tokens a decode request may need: one per step while the others still prefill
    # (decode-first mixes them), then warmup + measured steps for each batch size, plus slack.
    setup_steps = -(-max_b * DECODE_CONTEXT // budget) + 1
    max_tokens = setup_steps + len(batches) * (decode_steps + 1) + 4
    decode_tokens = max_b * (DECODE_CONTEXT + max_tokens + BLOCK_SIZE)
    # At least one request of max_model_len: the engine refuses a pool that could never run one.
    num_blocks = -(-max(decode_tokens, budget + 1, loaded.max_model_len) // BLOCK_SIZE) + 8
    assert DECODE_CONTEXT + max_tokens < loaded.max_model_len, "raise max_model_len"
    engine = LLMEngine.from_kwargs(
        loaded=loaded,  # its max_model_len (budget + 512) becomes the engine's
        max_num_batched_tokens=budget,
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        # Every prompt is computed in full: the sizes share their first tokens, and a prefix
        # cache hit would time a shorter prefill than the one reported.
        enable_prefix_caching=False,
        **engine_kwargs,
    )
    return engine, max_tokens


def run_prefill(engine: LLMEngine, n: int, salt: int) -> float:
    """One request, max_tokens=1: its whole prompt is a single step. Returns that step's time."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(None, prompt(n, salt), greedy)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step().record)
    assert len(steps) == 1 and steps[0].num_prefill_tokens == n, "prefill was not one step"
    return steps[0].duration


def bench_prefill(engine: LLMEngine, cost: ModelCost, sizes: tuple[int, ...],
                  repeats: int) -> list[Result]:
    run_prefill(engine, 512, salt=0)  # warm the kernels and the allocator once
    results = []
    for n in sizes:
        median = statistics.median(run_prefill(engine, n, salt=r + 1) for r in range(repeats))
        results.append(Result("prefill", n, median, n, cost.prefill_flops(n), 0))
        print(f"  prefill {n:5d} tok: {median * 1e3:8.1f} ms  {n / median:8.0f} tok/s", flush=True)
    return results


def bench_decode(engine: LLMEngine, cost: ModelCost, batches: tuple[int, ...], steps: int,
                 max_tokens: int) -> list[Result]:
    """Prefills max(batches) requests of DECODE_CONTEXT tokens once, then measures the largest
    batch first and aborts requests down to each smaller batch: one shared prefill instead of
    one per batch size (it dominates the run time). Contexts drift up by a few tokens per batch
    size, so the KV bytes use the measured contexts, not the nominal 512."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    max_b = max(batches)
    ids = [engine.add_request(None, prompt(DECODE_CONTEXT, 1000 + b), params)
           for b in range(max_b)]
    while True:  # until every request is past its prefill: the first pure decode step
        last = engine.step().record
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == max_b:
            break

    results = []
    for b in sorted(batches, reverse=True):
        engine.abort_request(ids[b:])
        ids = ids[:b]
        durations, context_sums = [], []
        for i in range(steps + 1):  # the first step after an abort is a warmup
            step = engine.step()
            outputs, rec = step.outputs, step.record
            assert rec.num_prefill_tokens == 0 and rec.num_decode_tokens == b, rec
            assert rec.num_preemptions == 0 and all(not o.finished for o in outputs), rec
            if i == 0:
                continue
            durations.append(rec.duration)
            # This step's context of a request = its tokens after the step minus the new one.
            context_sums.append(sum(
                len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs))
        median = statistics.median(durations)
        ctx_sum = round(statistics.mean(context_sums))
        res = Result("decode", b, median, b, cost.decode_flops(b, ctx_sum),
                     cost.decode_bytes(ctx_sum), ctx_sum / b)
        results.append(res)
        print(f"  decode B={b:3d} ctx~{res.context:.0f}: {median * 1e3:8.2f} ms/step  "
              f"{res.tok_s:8.1f} tok/s", flush=True)
    engine.abort_request(ids)
    return sorted(results, key=lambda r: r.size)


# ---- reporting ---------------------------------------------------------------------------------
def print_roofline(roof: Roofline) -> None:
    for label, g in roof.gemm.items():
        print(f"  {label:44s} {g:8.1f} GFLOP/s")
    print(f"  peak GEMM {roof.peak_gflops:.1f} GFLOP/s | copy_ {roof.copy_gbs:.1f} GB/s "
          f"(read+write) | sum() {roof.read_gbs:.1f} GB/s (read)", flush=True)


def print_fractions(results: list[Result], roof: Roofline) -> None:
    for r in results:
        line = (f"  {r.phase} {r.size:5d}: {r.gflops:7.1f} GFLOP/s = "
                f"{r.gflops / roof.peak_gflops:6.1%} of FLOP roofline")
        if r.phase == "decode":
            line += (f" | {r.gbs:6.2f} GB/s = {r.gbs / roof.read_gbs:6.1%} of read-bandwidth "
                     f"roofline ({r.nbytes / 1e6:.0f} MB/step)")
        print(line)


def markdown(sections: list[tuple[str, Roofline, list[Result]]], elapsed: float) -> str:
    lines = [
        f"Machine: {cpu_model()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}, model {MODEL}; "
        f"load average at the end {os.getloadavg()[0]:.1f}.  ",
        f"Command: `{shlex.join(['python', *sys.argv])}` ({elapsed:.0f} s). "
        "Times are medians of whole engine steps.",
        "",
        "| dtype | peak GEMM GFLOP/s | copy GB/s (r+w) | read GB/s |",
        "|---|---:|---:|---:|",
    ]
    for dtype, roof, _ in sections:
        lines.append(f"| {dtype} | {roof.peak_gflops:.0f} | {roof.copy_gbs:.1f} | "
                     f"{roof.read_gbs:.1f} |")
    lines += [
        "",
        "| dtype | phase | size | ms/step | tok/s | GFLOP/s | % FLOP roof | GB/s | % BW roof |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, roof, results in sections:
        for r in results:
            size = f"{r.size} tok" if r.phase == "prefill" else f"B={r.size}, ctx {r.context:.0f}"
            bw = (f"{r.gbs:.1f} | {r.gbs / roof.read_gbs:.0%}" if r.phase == "decode"
                  else "– | –")
            lines.append(f"| {dtype} | {r.phase} | {size} | {r.seconds * 1e3:.1f} | "
                         f"{r.tok_s:.0f} | {r.gflops:.0f} | {r.gflops / roof.peak_gflops:.0%} | "
                         f"{bw} |")
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="both",
                   choices=["auto", "float32", "bfloat16", "int8", "both", "all"],
                   help="auto: what the engine picks by default (dtype and --quantization "
                        "auto); int8: --quantization int8 in the auto dtype; both: float32 and "
                        "bfloat16 (dense); all: the three")
    p.add_argument("--repeats", type=int, default=3, help="prefill runs per size (median)")
    p.add_argument("--decode-steps", type=int, default=8, help="measured decode steps per batch")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: prefill 128/512, decode B=1/8, repeats 1")
    return p.parse_args()


def bench_dtype(name: str, args: argparse.Namespace) -> tuple[str, Roofline, list[Result]]:
    prefill_sizes = QUICK_PREFILL_SIZES if args.quick else PREFILL_SIZES
    batches = QUICK_DECODE_BATCHES if args.quick else DECODE_BATCHES
    steps = 3 if args.quick else args.decode_steps
    # Room for the longest prompt plus its sampled token; 4608 for the full run.
    quantization = {"int8": "int8", "auto": "auto"}.get(name, "none")
    dtype = "auto" if name == "int8" else name
    loaded = load_model(MODEL, dtype, max_model_len=max(max(prefill_sizes), DECODE_CONTEXT) + 512,
                        quantization=quantization)
    engine, max_tokens = make_engine(loaded, prefill_sizes, batches, steps)
    cost = ModelCost.of(loaded)
    label = str(loaded.model.dtype).removeprefix("torch.")
    label = f"{loaded.model.quantization}/{label}" if loaded.model.quantization else label

    print(f"\n== {label} ({engine.num_kv_blocks} KV blocks, weights "
          f"{cost.weight_bytes / 1e6:.0f} MB) ==", flush=True)
    roof = measure_roofline(loaded, loaded.model.dtype, args.repeats)
    print_roofline(roof)
    results = bench_prefill(engine, cost, prefill_sizes, args.repeats)
    results += bench_decode(engine, cost, batches, steps, max_tokens)
    print_fractions(results, roof)
    engine.close()
    return label, roof, results


def main() -> None:
    args = parse_args()
    if args.quick:
        args.repeats = 1
    start = time.perf_counter()
    names = {"both": ["float32", "bfloat16"], "all": ["float32", "bfloat16", "int8"]}.get(
        args.dtype, [args.dtype])
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"auto -> {resolve_dtype('auto')}")
    sections = [bench_dtype(name, args) for name in names]
    print("\n" + markdown(sections, time.perf_counter() - start))


if __name__ == "__main__":
    main()
