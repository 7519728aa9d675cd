"""A GGUF file opened once and shared: the weight loader (model/loaders/gguf.py) and the
tokenizer (tokenizer/gguf_vocab.py) both read it. A leaf module: it imports nothing of ours."""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import gguf


def open_gguf(path: str) -> gguf.GGUFReader:
    """The parsed file, shared by the config, weight and tokenizer readers: parsing the metadata
    of a 49k-token vocabulary takes seconds, and every model load reads the file twice. The
    reader only memory-maps the file, so keeping it costs no RAM; a changed file is re-read."""
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of a metadata key as a Python value (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
