"""The tensor-parallel ranks' process group: gloo over a TCP rendezvous, owned, not global.

torch.distributed's default group is one per process; an engine's group is its own object
instead (a `ProcessGroupGloo` on a `TCPStore`), so tests, sweeps and a data-parallel server may
hold several engines in one process. Rank 0 lives in the engine's process and hosts the store.

On CUDA the model's collectives (all-reduce, all-gather) run on a second group, NCCL's, on the
same store (`use_device`), as vLLM keeps a gloo "CPU group" beside its device group: the
scheduler's output, a typed message (engine/tp/step_wire.py), still travels over gloo.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chunkserve.procs.gpu_placement import rank_device
from chunkserve.procs.rendezvous import host_store

# A collective that waits longer than this fails instead of hanging (a dead peer, a step
# that never comes); generous, since one CPU step of a long prefill can take seconds.
TIMEOUT = timedelta(seconds=120)
# A worker's wait for rank 0's next step has no deadline of its own: a server may idle for
# days. A rank 0 that dies ends the wait at once (its sockets close); one that goes silent
# (a node's power or network lost) ends it through the worker's watch (engine/tp/worker.py).
IDLE_WAIT = timedelta(days=3650)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's store."""

    host: str
    port: int
    world_size: int
    nnodes: int = 1  # the ranks split evenly over the nodes, in order (config.ParallelConfig)


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
        self.ranks_per_node = rendezvous.world_size // rendezvous.nnodes
        self.local_rank = rank % self.ranks_per_node
        if os.environ.get("GLOO_SOCKET_IFNAME"):  # the user's interfaces (torch reads it)
            self.pg = dist.ProcessGroupGloo(store, rank, self.world_size, TIMEOUT)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(
                hostname=route_address(rendezvous.host, rendezvous.port))]
            options._timeout = TIMEOUT
            self.pg = dist.ProcessGroupGloo(store, rank, self.world_size, options)
        self.tensor_pg: Any = self.pg  # the model's collectives: NCCL's on CUDA (use_device)

    def use_device(self, device: torch.device) -> torch.device:
        """The device this rank computes on, its collectives set up over it: on CUDA, GPU
        `local_rank` of its node and an NCCL group (every rank calls this together: the
        group's rendezvous waits for all)."""
        if device.type != "cuda":
            return device
        device = rank_device(self.local_rank, self.ranks_per_node, torch.cuda.device_count())
        torch.cuda.set_device(device)
        self.tensor_pg = _nccl_group(self.store, self.rank, self.world_size)
        return device

    @staticmethod
    def host_store(host: str, world_size: int, port: int = 0) -> dist.TCPStore:
        """Rank 0's store, on a free port with 0 (procs/rendezvous.py)."""
        return host_store(host, world_size, port)

    def broadcast_bytes(self, data: bytes = b"", timeout: timedelta | None = None) -> bytes:
        """Rank 0's `data` on every rank: its length, then its bytes (two broadcasts; one
        step's message is a few KB: engine/tp/step_wire.py says what). `timeout`: how long the
        other ranks wait for the first (IDLE_WAIT: the next step may be days away); then
        TIMEOUT."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        if timeout is None:
            self.pg.broadcast([size]).wait()
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.timeout = 0, timeout
            self.pg.broadcast([size], opts).wait()
        n = int(size.item())
        if n == 0:
            return b""
        if self.rank != 0:
            payload = torch.empty(n, dtype=torch.uint8)
        self.pg.broadcast([payload]).wait()
        return data if self.rank == 0 else payload.numpy().tobytes()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks (row-parallel layers' partial outputs)."""
        self.tensor_pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (the same shape on each), in rank order (the LM head's logits)."""
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.tensor_pg.allgather([out], [t]).wait()
        return out


def _nccl_group(store: dist.Store, rank: int, world_size: int) -> Any:
    """NCCL's group for the ranks' CUDA tensors, under its own prefix of the store (gloo's
    keys stay apart); its collectives fail after TIMEOUT rather than hang."""
    if not dist.is_nccl_available():
        raise ValueError("tensor parallelism on CUDA needs NCCL, which this torch build lacks")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to `host`: where gloo's sockets listen, so the
    other ranks can reach them. gloo's own default, the address the hostname resolves to, is
    often a loopback one (Debian's 127.0.1.1) that no other node can reach."""
    family, _, _, _, address = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)  # UDP: sends nothing, only picks the route
        return str(s.getsockname()[0])
