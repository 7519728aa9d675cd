"""A built model's layers made tensor-parallel: the collectives around the sharded weights.

parallel.py decides what each rank holds; a model built from its shard (local heads, local
MLP rows, a vocabulary slice) then needs, per step (Megatron's scheme, as vLLM does it):
- the embedding: each rank looks up the ids it holds, zeros elsewhere, all-reduced (summed);
- `o_proj` and `down`: row-parallel, each rank's partial output all-reduced before the norm
  that adds it to the residual;
- the LM head: each rank's logits for its vocabulary slice, all-gathered and the padding cut.
The model code is unchanged: its `embed_tokens`, `layers[i].o / .down` and `lm_head` are
wrapped. The collectives come from whoever runs the ranks (engine/tp/group.py).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from chunkserve.model.models.llama import LlamaForCausalLM
from chunkserve.model.parallel import TPShard, assemble_logits, partial_embedding


class Collectives(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks."""
        ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape everywhere), in rank order."""
        ...


class RowParallel:
    """A row-parallel linear: the rank's partial product, summed over the ranks."""

    def __init__(self, linear: Any, group: Collectives) -> None:
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))

    def __getattr__(self, name: str) -> Any:  # shape, weight_bytes, ... of the wrapped linear
        return getattr(self.linear, name)


class VocabParallelHead:
    """The LM head over the rank's vocabulary slice: logits gathered to the full vocabulary."""

    def __init__(self, linear: Any, group: Collectives, vocab_size: int) -> None:
        self.linear, self.group, self.vocab_size = linear, group, vocab_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).contiguous()
        return assemble_logits(self.group.all_gather(local), self.vocab_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.linear, name)


def parallelize(model: LlamaForCausalLM, group: Collectives, shard: TPShard) -> None:
    """Wraps a model built from rank `shard.rank`'s weights with its collectives, in place."""
    embed = model.embed

    def embed_tokens(input_ids: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(partial_embedding(embed, input_ids, shard).contiguous())

    model.embed_tokens = embed_tokens  # type: ignore[method-assign]
    for layer in model.layers:
        layer.o = RowParallel(layer.o, group)
        layer.down = RowParallel(layer.down, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, shard.vocab_size)
    model.tp_shard = shard
