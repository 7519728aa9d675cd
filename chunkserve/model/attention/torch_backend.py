"""The reference backend: PyTorch SDPA, one call per request, over views of the paged cache.

A request whose blocks are consecutive ids (the allocator prefers that) is attended over as a
*view* of the cache, with no copy; only the breaks between runs of consecutive blocks need a
concatenation. This is the CPU path. On CUDA it works but issues one call per request per
layer; the triton backend is the GPU path.

With a sliding window W a request reads its blocks from the first one its step's first query
sees (`first_window_block`: the ones before may be freed), a decode only its last W keys (a
slice), and a chunk whose last query no longer sees the first key read is attended in bands of
query rows, each over just the keys its rows see, with a band mask: a chunk that straddles the
window's edge has early queries that see older keys than its later ones.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from chunkserve.model.attention.backend import (FP8_DTYPES, block_runs, causal_mask,
                                                first_visible_key, first_window_block)
from chunkserve.model.batch import BatchTensors


@dataclass
class Band:
    """Query rows [q_lo, q_hi) of a windowed chunk over the keys [k_lo, k_hi) they see (indices
    into the request's keys as read, from its SeqSpan.key_start), with their mask."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    mask: torch.Tensor  # [q_hi - q_lo, k_hi - k_lo] bool: causal and within the window


@dataclass
class SeqSpan:
    """One request's part of the step."""

    q_start: int  # offset of its first new token in the flat batch
    q_len: int  # new tokens this step (1 for a decode)
    context_len: int  # tokens with KV after this step: cached + new
    # (first block id, number of blocks) covering positions key_start .. context_len - 1
    runs: list[tuple[int, int]]
    # [q_len, context_len - key_start] bool: chunks after a prefix, off the CPU only
    mask: torch.Tensor | None = None
    key_start: int = 0  # position of the first key `runs` hold: 0, or a window's first block's
    window: int | None = None  # the sliding window, None: full attention
    bands: list[Band] | None = None  # a windowed chunk some of whose rows see fewer keys


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    seqs: list[SeqSpan] = field(default_factory=list)


# On CUDA, PyTorch picks cuDNN's SDPA on Hopper, which spends ~1.3 ms of host time per call on
# shapes it has not seen; every request's shape is new. Flash / memory-efficient kernels have no
# such set-up cost; math is the last resort for inputs neither takes.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchPagedAttention:
    name = "torch"
    supports_cuda_graphs = False  # the per-request loop reads host values
    supports_narrow_kv_cache = True  # K/V are widened to the query's dtype as they are read
    # Query rows of a windowed chunk's band (at least the window): fewer SDPA calls against
    # fewer keys read and masked per row (a band of R rows reads R + W - 1 keys).
    band_rows = 256

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def build_metadata(self, batch: BatchTensors,
                       sliding_window: int | None = None) -> TorchMetadata:
        return TorchMetadata(batch.slot_mapping, self._spans(
            batch, range(len(batch.layout.seq_lens)), sliding_window))

    def _spans(self, batch: BatchTensors, rows: Iterable[int],
               window: int | None = None) -> list[SeqSpan]:
        """The SeqSpans of the step's requests `rows` (what the SDPA loop attends)."""
        layout = batch.layout
        device = batch.slot_mapping.device
        qsl = layout.query_start_loc.tolist()
        seq_lens = layout.seq_lens.tolist()
        bs = layout.block_size
        seqs = []
        for i in rows:
            ctx, q_start, q_len = seq_lens[i], qsl[i], qsl[i + 1] - qsl[i]
            start = ctx - q_len
            first = first_window_block(start, window, bs)  # 0 without a window
            runs = block_runs(layout.block_table[i][first:], -(-ctx // bs) - first)
            span = SeqSpan(q_start, q_len, ctx, runs, key_start=first * bs, window=window)
            if window is not None and ctx - 1 - span.key_start >= window:
                # The last query no longer sees the first key read: rows differ in their keys.
                span.bands = _bands(start, q_len, span.key_start, window,
                                    max(window, self.band_rows), device) if q_len > 1 else None
            elif q_len > 1 and start > span.key_start and device.type != "cpu":
                # A chunk after a prefix needs a mask only off the CPU (_prefix_then_causal).
                span.mask = causal_mask(start, q_len, device, key_start=span.key_start)
            seqs.append(span)
        return seqs

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: TorchMetadata) -> None:
        """The step's new K/V rows into their slots of the paged cache (rounded to an fp8
        cache's format by PyTorch's conversion)."""
        num_blocks, block_size, kvh, d = k_cache.shape
        for new, cache in ((k, k_cache), (v, v_cache)):
            new, flat = new.to(cache.dtype), cache.view(num_blocks * block_size, kvh, d)
            if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel on the CPU: as bytes
                new, flat = new.view(torch.uint8), flat.view(torch.uint8)
            flat.index_copy_(0, meta.slot_mapping, new)

    def forward(self, q, k, v, k_cache, v_cache, meta):  # type: ignore[no-untyped-def]
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype,
                          device=q.device)
        self._attend(q, k_cache, v_cache, meta.seqs, out)
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seqs: list[SeqSpan], out: torch.Tensor) -> None:
        """Each request's rows of `out`, one SDPA call each, over its K/V already in the cache."""
        num_blocks, block_size, kvh, d = k_cache.shape
        flat_k = k_cache.view(num_blocks * block_size, kvh, d)
        flat_v = v_cache.view(num_blocks * block_size, kvh, d)
        kernels = sdpa_kernel(_CUDA_SDPA) if q.is_cuda else contextlib.nullcontext()
        with kernels:
            for seq in seqs:
                keys = _read(flat_k, seq, block_size).to(q.dtype)  # [ctx, kvh, d]
                values = _read(flat_v, seq, block_size).to(q.dtype)  # (copies only from fp8)
                qs = q[seq.q_start : seq.q_start + seq.q_len]
                if seq.q_len == 1:
                    if seq.window is not None:  # its last W keys (a view)
                        keys, values = keys[-seq.window :], values[-seq.window :]
                    o = self._decode(qs, keys, values)
                else:
                    o = self._prefill(qs, keys, values, seq)
                out[seq.q_start : seq.q_start + seq.q_len] = o

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
        start = seq.context_len - seq.q_len - seq.key_start  # the prefix among the keys read
        if seq.bands is not None:  # a window cuts some rows' keys short
            o = self._banded(qh, kh, vh, seq.bands)
        elif start == 0:  # the chunk is the whole context so far: plain causal
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        elif seq.mask is None:  # on the CPU
            o = self._prefix_then_causal(qh, kh, vh, start)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seq.mask, scale=self.scale)
        return o[0].transpose(0, 1).reshape(seq.q_len, -1)

    def _banded(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                bands: list[Band]) -> torch.Tensor:
        """A windowed chunk band by band: each band's rows over only the keys they see."""
        out = torch.empty_like(qh)
        for b in bands:
            out[:, :, b.q_lo : b.q_hi] = F.scaled_dot_product_attention(
                qh[:, :, b.q_lo : b.q_hi], kh[:, :, b.k_lo : b.k_hi], vh[:, :, b.k_lo : b.k_hi],
                attn_mask=b.mask, scale=self.scale)
        return out

    def _prefix_then_causal(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                            start: int) -> torch.Tensor:
        """A chunk after a cached prefix of `start` tokens, as two fused CPU SDPA calls: all of
        the prefix (no mask), and the chunk over itself (causal), merged by their log-sum-exps.
        With the boolean mask instead, the kernel computes the masked-out half of the chunk's
        own square too, and reads the mask: 143 vs 107 ms for a 2048-token chunk after 2048
        (docs/performance.md)."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, lse1 = flash(qh, kh[:, :, :start], vh[:, :, :start], 0.0, False, scale=self.scale)[:2]
        o2, lse2 = flash(qh, kh[:, :, start:], vh[:, :, start:], 0.0, True, scale=self.scale)[:2]
        top = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
        return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(qh.dtype)


def _bands(start: int, q_len: int, key_start: int, window: int, rows: int,
           device: torch.device) -> list[Band]:
    """A windowed chunk of `q_len` queries from position `start`, whose keys were read from
    position `key_start`, cut into bands of `rows` queries: each over the keys from its first
    row's oldest visible one to its last row (at most rows + window - 1 of them)."""
    bands = []
    for lo in range(0, q_len, rows):
        hi = min(q_len, lo + rows)
        k_lo = first_visible_key(start + lo, window)
        mask = causal_mask(start + lo, hi - lo, device, window, key_start=k_lo)
        bands.append(Band(lo, hi, k_lo - key_start, start + hi - key_start, mask))
    return bands


def _read(flat: torch.Tensor, seq: SeqSpan, block_size: int) -> torch.Tensor:
    """The request's K (or V) rows of positions key_start .. context_len - 1."""
    views = [flat[b * block_size : (b + n) * block_size] for b, n in seq.runs]
    whole = views[0] if len(views) == 1 else torch.cat(views)
    return whole[: seq.context_len - seq.key_start]
