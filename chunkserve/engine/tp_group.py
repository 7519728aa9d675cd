"""The tensor-parallel ranks' process group: gloo over a TCP rendezvous, owned, not global.

torch.distributed's default group is one per process; an engine's group is its own object
instead (a `ProcessGroupGloo` on a `TCPStore`), so tests, sweeps and a data-parallel server may
hold several engines in one process. Rank 0 lives in the engine's process and hosts the store.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this fails instead of hanging (a dead peer, a step
# that never comes); generous, since one CPU step of a long prefill can take seconds.
TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's store."""

    host: str
    port: int
    world_size: int


class TPGroup:
    def __init__(self, rendezvous: Rendezvous, rank: int,
                 store: dist.TCPStore | None = None) -> None:
        """Rank 0 passes the store it created (`host_store`); the others connect to it."""
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size,
                                  False, timeout=TIMEOUT)
        self.store = store
        self.rank = rank
        self.world_size = rendezvous.world_size
        self.pg = dist.ProcessGroupGloo(store, rank, self.world_size, TIMEOUT)

    @staticmethod
    def host_store(host: str, world_size: int) -> dist.TCPStore:
        """Rank 0's store on a free port (read it back from `.port`)."""
        return dist.TCPStore(host, 0, world_size, True, timeout=TIMEOUT, wait_for_workers=False)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank: its pickle's length, then its bytes (two broadcasts;
        the scheduler's output of one step, a few KB)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast([size]).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast([data]).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks (row-parallel layers' partial outputs)."""
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (the same shape on each), in rank order (the LM head's logits)."""
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([out], [t]).wait()
        return out
