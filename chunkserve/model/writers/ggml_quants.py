"""Float32 rows packed into llama.cpp's block formats, for files written here (gguf_export.py).

The `gguf` package packs Q4_0, Q5_0, Q8_0, F16 and BF16 but only unpacks the k-quants; Q4_K and
Q6_K (the two types of a Q4_K_M file) are packed here in numpy, block for block in the layout
that `gguf.quants` (and llama.cpp) reads back. The scales are the plain absmax/min-max choice,
not llama.cpp's search for the least error: these files hold random weights for speed
benchmarks, where only the layout has to be right (tests/test_export.py reads every type back).
"""
from __future__ import annotations

import gguf
import numpy as np

GGMLType = gguf.GGMLQuantizationType
QK_K = 256  # values in a k-quant super-block

# Rows packed a pass: bounds the float32 temporaries of one pass to ~100 MB at 4096 columns.
ROWS_PER_PASS = 4096


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _safe_inverse(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0.0, 1.0 / x).astype(np.float32)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] bytes: d, dmin (f16), 12 bytes of 6-bit sub-block scales
    and mins, 128 bytes of 4-bit values. Each 32-value sub-block j is d*sc[j]*q - dmin*m[j]."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # the format subtracts a non-negative min
    scale = (sub.max(axis=-1) - low) / 15.0
    d = scale.max(axis=-1, keepdims=True) / 63.0
    dmin = (-low).max(axis=-1, keepdims=True) / 63.0
    # The f16 super-block scales are what the reader multiplies by: quantize against them.
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _safe_inverse(d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low * _safe_inverse(dmin)), 0, 63).astype(np.uint8)
    step = d * sc
    q = np.rint((sub + (dmin * mn)[..., None]) * _safe_inverse(step)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    # Bytes 0-3: sc[0..3] and sc[4..7]'s top two bits; 4-7: the same for the mins; 8-11: the
    # low four bits of sc[4..7] and of mn[4..7].
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    # 64 values a 32-byte group: sub-block 2g in the low nibbles, 2g+1 in the high.
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
    sub-block scales, d (f16). Each 16-value sub-block s is d*scales[s]*(q - 32)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0
    d = (scale.max(axis=-1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(scale * _safe_inverse(d)), 0, 127).astype(np.int8)
    step = d * scales.astype(np.float32)
    q = np.clip(np.rint(sub * _safe_inverse(step)[..., None]) + 32, 0, 63).astype(np.uint8)
    # Value h*128 + r: its low nibble in byte h*64 + r%64 (nibble r//64), its high two bits in
    # byte h*32 + r%32 (bits 2*(r//32)).
    q = q.reshape(n, 2, 128)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), _f16_bytes(d)], axis=-1)


_OURS = {GGMLType.Q4_K: quantize_q4_k, GGMLType.Q6_K: quantize_q6_k}
_PLAIN = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}


def quantize_rows(rows: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """A [rows, cols] float32 array as `qtype`: the values themselves for F32/F16, else
    [rows, bytes] of blocks. Callers pack big tensors a slice of ROWS_PER_PASS rows at a time."""
    if qtype in _PLAIN:
        return rows.astype(_PLAIN[qtype])
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if rows.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, "
                         f"got {rows.shape[-1]}")
    if qtype not in _OURS:
        return gguf.quants.quantize(rows, qtype)
    n_rows = rows.shape[0]
    blocks = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK_K)
    return _OURS[qtype](blocks).reshape(n_rows, -1)


def packed_nbytes(shape: tuple[int, ...], qtype: GGMLType) -> int:
    """Bytes of a tensor of `shape` (slowest first) stored as `qtype`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    values = 1
    for d in shape:
        values *= d
    return values // block * size
