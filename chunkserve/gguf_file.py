"""A GGUF file opened once and shared: the weight loader (model/loaders/gguf.py) and the
tokenizer (tokenizer/gguf_vocab.py) both read it. A leaf module: it imports nothing of ours.

The `gguf` package's reader builds a numpy view per value it parses: 12 s of a Gemma 3 load
went to the 262,144 strings of its vocabulary (1.5 s for SmolLM2's 49,152), before a single
weight was read. This reader parses the same format (the spec: github.com/ggml-org/ggml,
docs/gguf.md) from one memoryview with struct, keeps the tensors as views of one memory map,
and takes the format's constants (value and tensor types, block sizes) from the `gguf` package.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
V = gguf.GGUFValueType
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    V.UINT8: ("<B", np.dtype("<u1")), V.INT8: ("<b", np.dtype("<i1")),
    V.UINT16: ("<H", np.dtype("<u2")), V.INT16: ("<h", np.dtype("<i2")),
    V.UINT32: ("<I", np.dtype("<u4")), V.INT32: ("<i", np.dtype("<i4")),
    V.UINT64: ("<Q", np.dtype("<u8")), V.INT64: ("<q", np.dtype("<i8")),
    V.FLOAT32: ("<f", np.dtype("<f4")), V.FLOAT64: ("<d", np.dtype("<f8")),
    V.BOOL: ("<?", np.dtype("?")),
}
Q = gguf.GGMLQuantizationType
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
          Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}


@dataclass(frozen=True)
class Field:
    name: str
    value: Any  # str, int, float, bool, or a list of them

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's dims, fastest first (ne0 = columns), as the gguf package has it
    data: np.ndarray  # a read-only view of the map: numbers, or [rows, bytes] for block types


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._map)
        if bytes(self._view[:4]) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._view, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self._offset = 4 + struct.calcsize("<IQQ")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            name = self._string()
            self.fields[name] = Field(name, self._value(self._u32()))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", Field("", DEFAULT_ALIGNMENT)).value)
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---- the metadata ---------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._view, self._offset)[0]
        self._offset += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return int(self._unpack("<I"))

    def _string(self) -> str:
        n = self._unpack("<Q")
        start, self._offset = self._offset, self._offset + n
        return str(self._view[start:self._offset], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == V.STRING:
            return self._string()
        if kind == V.ARRAY:
            item, count = self._u32(), self._unpack("<Q")
            if item == V.STRING:
                return [self._string() for _ in range(count)]
            if item in _SCALARS:  # numbers in one piece
                dtype = _SCALARS[item][1]
                values = np.frombuffer(self._view, dtype, count, self._offset)
                self._offset += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])
        raise ValueError(f"{self.path}: unknown GGUF value type {kind}")

    def _tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = self._string()
        dims = np.array([self._unpack("<Q") for _ in range(self._u32())], dtype=np.uint64)
        return name, dims, self._u32(), self._unpack("<Q")

    # ---- the tensors ----------------------------------------------------------------------
    def _tensor(self, start: int, name: str, dims: np.ndarray, kind: int, offset: int) -> Tensor:
        qtype = Q(kind)
        shape = tuple(int(d) for d in reversed(dims.tolist()))  # slowest first
        n = int(np.prod(shape)) if shape else 1
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        first = start + offset
        if qtype in _PLAIN:
            dtype = np.dtype(_PLAIN[qtype])
            data = self._map[first:first + n * dtype.itemsize].view(dtype).reshape(shape)
        else:
            rows = (*shape[:-1], shape[-1] // block * type_size)
            data = self._map[first:first + n // block * type_size].reshape(rows)
        return Tensor(name, qtype, dims, data)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file, shared by the config, weight and tokenizer readers: every model load
    reads the file twice. It only memory-maps the file, so keeping it costs no RAM; a changed
    file is re-read."""
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of a metadata key as a Python value (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
