"""Paged attention over a flattened (varlen) batch, behind a small backend interface.

The step's tokens are one flat sequence; each request owns a slice of it (its prefill chunk or
its single decode token). New K/V are written into the paged cache by slot mapping first, then
every request attends over its own blocks, read as *views* of the cache: a request whose blocks
are consecutive ids (the allocator prefers that) costs no copy at all, and only the breaks
between runs of consecutive blocks need a concatenation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    """One request's part of the step."""

    q_start: int  # offset of its first new token in the flat batch
    q_len: int  # new tokens this step (1 for a decode)
    context_len: int  # tokens with KV after this step: cached + new
    runs: list[tuple[int, int]]  # (first block id, number of blocks) covering context_len
    mask: torch.Tensor | None = None  # [q_len, context_len] bool, for chunks after a prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    seqs: list[SeqSpan] = field(default_factory=list)


def block_runs(block_table: list[int], num_blocks: int) -> list[tuple[int, int]]:
    """Splits the first `num_blocks` ids of a table into runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block in block_table[:num_blocks]:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def causal_mask(start: int, q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Query i (position start+i) sees keys 0..start+i: causal aligned to the bottom right."""
    q_pos = torch.arange(start, start + q_len, device=device).unsqueeze(1)
    return torch.arange(start + q_len, device=device).unsqueeze(0) <= q_pos


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, heads * head_dim]
        ...


class TorchPagedAttention:
    """CPU (and plain-CUDA) backend on `scaled_dot_product_attention`, one call per request."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, k_cache, v_cache, meta):  # type: ignore[no-untyped-def]
        num_blocks, block_size, kvh, d = k_cache.shape
        flat_k = k_cache.view(num_blocks * block_size, kvh, d)
        flat_v = v_cache.view(num_blocks * block_size, kvh, d)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape[0], self.num_heads * d, dtype=q.dtype, device=q.device)
        for seq in meta.seqs:
            keys = _read(flat_k, seq, block_size)  # [ctx, kvh, d]
            values = _read(flat_v, seq, block_size)
            qs = q[seq.q_start : seq.q_start + seq.q_len]
            if seq.q_len == 1:
                o = self._decode(qs, keys, values)
            else:
                o = self._prefill(qs, keys, values, seq)
            out[seq.q_start : seq.q_start + seq.q_len] = o
        return out

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # The query heads sharing a KV head become that head's "query rows": one SDPA call with
        # kv_heads batches and no repeat of K/V.
        # (4-D inputs: PyTorch's fused CPU kernel only takes [batch, heads, len, dim]; 3-D ones
        # fall back to the unfused math path, 2-5x slower.)
        qg = q.view(1, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(
            qg, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale=self.scale
        )
        return o.reshape(1, -1)

    def _prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq: SeqSpan
    ) -> torch.Tensor:
        qh = q.transpose(0, 1)[None]  # [1, heads, L, d]
        # K/V are repeated per query head: the fused kernel has no GQA mode, and the copy is
        # small next to a prefill's attention FLOPs.
        kh = keys.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]
        vh = values.transpose(0, 1).repeat_interleave(self.group, dim=0)[None]
        if seq.mask is None:  # the chunk is the whole context so far: plain causal
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seq.mask, scale=self.scale)
        return o[0].transpose(0, 1).reshape(seq.q_len, -1)


def _read(flat: torch.Tensor, seq: SeqSpan, block_size: int) -> torch.Tensor:
    views = [flat[b * block_size : (b + n) * block_size] for b, n in seq.runs]
    whole = views[0] if len(views) == 1 else torch.cat(views)
    return whole[: seq.context_len]
