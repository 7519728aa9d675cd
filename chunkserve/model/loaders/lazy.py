"""A checkpoint's tensors, each read from its file when it is taken, not all at load.

The model pops its tensors one by one and converts each to its device and dtype at once
(models/llama.py `_take`); a tensor-parallel rank slices each into its shard
(model/parallel.py). Reading them all first held the whole checkpoint in float32 beside the
model: 32 GB for an 8B model, and every rank of a tensor-parallel group held all of it, the
very thing tensor parallelism is for avoiding. Read lazily, the peak is the model (or the
rank's shard) plus the one tensor being converted.

Reading a tensor twice reads its file twice: the mapping keeps no copy, by design.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping

import torch

Reader = Callable[[], torch.Tensor]


class LazyWeights(MutableMapping[str, torch.Tensor]):
    def __init__(self) -> None:
        self._readers: dict[str, tuple[Reader, tuple[int, ...]]] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # set explicitly (replacements)

    def add(self, name: str, read: Reader, shape: tuple[int, ...]) -> None:
        """`read()` returns the tensor (float32, under its HF name's layout) of `shape`."""
        self._tensors.pop(name, None)
        self._readers[name] = (read, tuple(shape))

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape without reading it."""
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return self._readers[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        read, shape = self._readers[name]
        t = read()
        if tuple(t.shape) != shape:  # a reader bug, not the checkpoint's (checked by shape)
            raise AssertionError(f"{name}: read {tuple(t.shape)}, indexed as {shape}")
        return t

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        self._readers.pop(name, None)
        self._tensors[name] = t

    def __delitem__(self, name: str) -> None:
        if name in self._tensors:
            del self._tensors[name]
        else:
            del self._readers[name]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._readers)
        yield from list(self._tensors)

    def __len__(self) -> int:
        return len(self._readers) + len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._readers or name in self._tensors


def tensor_shape(weights: MutableMapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape, read from the file's index when the weights are lazy."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
