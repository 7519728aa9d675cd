"""The Triton kernels compile for real GPUs (Hopper, Ampere) on a machine without one.

The interpreter (test_triton_attention.py) checks what the kernels compute but not that they
compile: it never type-checks loop-carried values or lowers tl.dot. Triton's ahead-of-time
compiler does both down to a cubin with the ptxas it ships, no GPU needed. It runs in a child
process because TRITON_INTERPRET (set for this test session) is read when kernels are defined.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from chunkserve.model.kernels import triton_attention as tk

    def compile_kernel(fn, pointers, constexprs, arch, num_warps=4):
        types = {n: "i32" for n in fn.arg_names}
        types.update(pointers)
        types.update({n: "constexpr" for n in constexprs})
        if "scale" in types:
            types["scale"] = "fp32"
        src = ASTSource(fn, types, constexprs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})

    def compile_step(arch, dtype, head_dim, group, block_size, max_query_len, window):
        block_m, block_q, tile_n, num_warps = tk.tile_sizes(group, max_query_len)
        data = {n: "*" + dtype for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        data.update({n: "*i64" for n in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")})
        compile_kernel(tk._unified_attention_kernel, data, dict(
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
            WINDOW=window, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32"), arch, num_warps)
        row = 8 * head_dim
        cache = {n: "*" + dtype for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        cache["slot_mapping_ptr"] = "*i64"
        compile_kernel(tk._reshape_and_cache_kernel, cache, dict(
            ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_SIZE=block_size, BLOCK_T=16), arch)

    for case in sys.argv[1:]:
        arch, dtype, head_dim, group, block_size, max_query_len, *window = case.split(',')
        compile_step(int(arch), dtype, int(head_dim), int(group), int(block_size),
                     int(max_query_len), int(window[0]) if window else 0)
        print('compiled', case, flush=True)
''')


CASES = [
    # arch, dtype, head_dim, group, block_size, max_query_len[, sliding window]
    "90,bf16,128,4,16,1",  # Llama-3-8B decode on an H100/H200
    "90,bf16,128,4,16,2048",  # ... and a long prefill chunk (128-row tiles, 8 warps)
    "90,bf16,128,4,16,64",  # ... a short one (64-row tiles)
    "90,bf16,128,1,32,512",  # MHA (Llama-2-13B), larger KV blocks
    "80,bf16,64,3,16,64",  # SmolLM2's shape on an A100
    "80,fp32,64,3,16,1",  # the fp32 (ieee) path the GPU parity tests use
    "90,fp32,16,2,16,40",
    "90,bf16,96,1,16,64",  # Phi-3-mini (head size 96, padded to 128 in the tiles)
    "80,fp32,96,2,16,1",  # the GPU tests' tiny Phi-3, decode
    "90,bf16,256,4,16,512,512",  # Gemma 3 270M's sliding-window layers, a chunk
    "90,bf16,128,2,16,1,1024",  # Gemma 3 27B's, decode
]


def test_kernels_compile_for_gpu():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *CASES], env=env, capture_output=True,
                          text=True, timeout=600)
    compiled = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("compiled")]
    assert proc.returncode == 0 and compiled == CASES, proc.stderr[-3000:]
