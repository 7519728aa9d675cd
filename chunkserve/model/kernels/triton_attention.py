"""Triton kernels for paged attention: one launch per layer for a whole mixed step.

`unified_attention` computes every request of a step in one launch — prefill chunks (causal
over their cached prefix plus the chunk itself) and decodes alike — reading K/V through the
block table, so there is no gather, no per-request Python loop and no repeat of K/V for GQA:
one program handles a tile of query tokens times all query heads that share a KV head.
`reshape_and_cache` writes the step's new K/V into the paged cache by slot mapping.

A sliding window (WINDOW > 0, a compile-time constant: 0 compiles exactly the full-attention
kernel) hides keys more than WINDOW - 1 before a query; each program's key loop starts at its
first query's oldest visible key, so the blocks before it (which the KV cache may have freed,
their table entries pointing at another request's block) are never read.

The design follows vLLM V1's unified Triton attention (query_start_loc, seq_lens, block_table;
grid over "query blocks" found by a binary search). Every input is a device tensor of fixed
shape, and launch sizes depend only on shapes, so both kernels can be captured in CUDA graphs.
Under TRITON_INTERPRET=1 the same code runs on the CPU (slowly), which is how the tests run it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
    stride_k_t, stride_v_t,  # new K/V: [T, kv_heads, head_dim], heads and dim contiguous
    stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,  # cache: [blocks, block_size, kvh, d]
    ROW: tl.constexpr,  # kv_heads * head_dim
    ROW_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    # A padding row of a CUDA-graph batch has slot -1: nothing to write.
    t_ok = slot >= 0
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    i = tl.arange(0, ROW_P2)
    ok = t_ok[:, None] & (i < ROW)[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_k_t + i[None, :], mask=ok)
    v = tl.load(value_ptr + t64 * stride_v_t + i[None, :], mask=ok)
    k_dst = k_cache_ptr + (block * stride_kc_b + offset * stride_kc_s)[:, None] + i[None, :]
    v_dst = v_cache_ptr + (block * stride_vc_b + offset * stride_vc_s)[:, None] + i[None, :]
    tl.store(k_dst, k, mask=ok)
    tl.store(v_dst, v, mask=ok)


def reshape_and_cache(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; -1 skips the row
) -> None:
    T, kv_heads, head_dim = key.shape
    assert key.stride(1) == head_dim and key.stride(2) == 1, "K rows must be contiguous"
    assert value.stride(1) == head_dim and value.stride(2) == 1, "V rows must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = kv_heads * head_dim
    block_t = 16
    _reshape_and_cache_kernel[(triton.cdiv(T, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, T,
        key.stride(0), value.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
    )


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The request that query block `q_block_id` belongs to.

    Request i owns query blocks [qsl[i] // BLOCK_Q + i, ... + cdiv(q_len_i, BLOCK_Q)): the "+ i"
    leaves room for each request's partial last block, so the ranges never overlap and the
    grid needs only T // BLOCK_Q + num_seqs programs, whatever the mix of lengths.
    """
    lo: tl.int32 = 0  # typed: the loop carries it, and it must not start as a constant
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start_n, kv_end, q_pos, row_ok, d, d_ok, bt_row, kv_head, scale,
    k_cache_ptr, v_cache_ptr, stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """One tile of TILE_N keys from `start_n` into the rows' online softmax: returns the new
    (row max, row sum, accumulator)."""
    n = start_n + tl.arange(0, TILE_N)
    n_ok = n < kv_end
    block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_block = n % BLOCK_SIZE
    k_off = block * stride_kc_b + in_block * stride_kc_s + kv_head * stride_kc_h
    k = tl.load(
        k_cache_ptr + k_off[None, :] + d[:, None],
        mask=n_ok[None, :] & d_ok[:, None], other=0.0,
    )  # [HEAD_DIM_P2, TILE_N]
    s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale
    visible = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        visible = visible & (q_pos[:, None] - n[None, :] < WINDOW)
    s = tl.where(visible, s, float("-inf"))
    # Online softmax; a row that has seen no key yet keeps max -inf, so shift by 0 there
    # to avoid (-inf) - (-inf).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = block * stride_vc_b + in_block * stride_vc_s + kv_head * stride_vc_h
    v = tl.load(
        v_cache_ptr + v_off[:, None] + d[None, :],
        mask=n_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [TILE_N, HEAD_DIM_P2]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, num_seqs,
    stride_q_t, stride_q_h,  # q: [T, heads, head_dim]
    stride_o_t, stride_o_h,  # out: [T, heads, head_dim]
    stride_kc_b, stride_kc_s, stride_kc_h,  # caches: [blocks, block_size, kv_heads, head_dim]
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,  # block_table: [num_seqs, max_blocks]
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV block size of the cache
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration (may span several KV blocks)
    INPUT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window in tokens; 0: full attention
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # a spare program: its request has fewer query blocks
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # tokens already in the cache before this step

    # Row m is query token q_tok of this request and query head `head`: the GROUP heads that
    # share one KV head sit side by side, so each K/V tile loaded serves all of them.
    m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q_pos = prefix + q_tok  # each row's absolute position: it sees keys 0..q_pos
    # (or q_pos - WINDOW + 1 .. q_pos with a window)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    # Causality bounds the loop: no row of this block sees past its last token.
    kv_end = prefix + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_begin = 0
    if WINDOW > 0:
        # The block's first row sees the oldest key any row does: start the loop there.
        # (int32 like the 0 above, should WINDOW be compiled as a run-time value.)
        kv_begin = tl.maximum(prefix + q_block * BLOCK_Q - WINDOW + 1, 0).to(tl.int32)
    for start_n in range(kv_begin, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, kv_end, q_pos, row_ok, d, d_ok, bt_row, kv_head, scale,
            k_cache_ptr, v_cache_ptr, stride_kc_b, stride_kc_s, stride_kc_h,
            stride_vc_b, stride_vc_s, stride_vc_h,
            BLOCK_SIZE, TILE_N, INPUT_PRECISION, WINDOW,
        )

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def tile_sizes(group: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps) for a step.

    Decodes (one query token x GROUP heads per program) get the smallest tile tl.dot takes, 16
    rows; prefill chunks get the tile shapes of Triton's flash-attention tutorial (128 x 64 with
    8 warps for long chunks), since there each program has many query rows to share K/V with.
    These are starting points, not tuned on a GPU yet.
    """
    rows = max_query_len * group
    if group > 16:
        block_m = triton.next_power_of_2(group)
    elif rows <= 16:
        block_m = 16
    elif rows < 512:
        block_m = 64
    else:
        block_m = 128
    tile_n = 32 if block_m == 16 else 64
    num_warps = 8 if block_m >= 128 else 4
    return block_m, max(1, block_m // group), tile_n, num_warps


def unified_attention(
    out: torch.Tensor,  # [T, heads, head_dim]
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tokens with KV after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    window: int = 0,  # sliding window in tokens; 0: full attention
) -> None:
    T, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    num_seqs = seq_lens.shape[0]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous()
    block_m, block_q, tile_n, num_warps = tile_sizes(group, max_query_len)
    # fp32 stays fp32 (tests compare to 1e-5); bf16 inputs ignore the setting.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (T // block_q + num_seqs, kv_heads)
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        INPUT_PRECISION=precision, WINDOW=window, num_warps=num_warps,
    )
