"""A secondary node of a multi-node tensor-parallel group (vLLM's "headless" node): only its
ranks, as worker processes (engine/tp/worker.py); no scheduler, no HTTP server. Node 0's engine
drives them and sends their engine config.

This process only watches its workers. It exits 0 when rank 0 stops the group (every worker
exits 0) or on SIGTERM/SIGINT (its workers stopped first), and 1 when a worker fails, for
instance because rank 0 is gone; the rest are stopped then, so nothing is left behind. A
SIGKILL here leaves no orphan either: each worker exits when its parent is gone.
"""
from __future__ import annotations

import logging

import torch.multiprocessing as mp

from chunkserve.config import EngineConfig
from chunkserve.engine.tp.group import Rendezvous
from chunkserve.engine.tp.worker import start_workers
from chunkserve.procs.cpu_binding import rank_cores
from chunkserve.procs.lifecycle import supervise

log = logging.getLogger("chunkserve.headless")

POLL_S = 0.5  # how soon a SIGTERM is acted on while the workers run


def run_headless(config: EngineConfig) -> int:
    """Runs this node's ranks until they end; the process's exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    pc = config.parallel_config
    if pc.node_rank == 0:
        raise ValueError("node 0 runs the engine, not a headless node")
    ranks = pc.node_ranks
    rendezvous = Rendezvous(pc.master_addr, pc.master_port, pc.tensor_parallel_size,
                            pc.nnodes)
    workers = start_workers(ranks, rendezvous, rank_cores(len(ranks)), len(ranks),
                            own_config=config)
    log.info("node %d of %d: tensor-parallel ranks %d-%d (pids %s), joining rank 0 at %s:%d",
             pc.node_rank, pc.nnodes, ranks[0], ranks[-1],
             " ".join(str(w.pid) for w in workers), pc.master_addr, pc.master_port)

    def on_exit(w: mp.Process) -> None:
        if w.exitcode != 0:
            log.error("%s exited with code %s; stopping this node", w.name, w.exitcode)

    status = supervise(workers, POLL_S, fail_fast=True, on_exit=on_exit,
                       on_signal=lambda: log.info("stopping this node's ranks"))
    if status == 0 and all(w.exitcode == 0 for w in workers):
        log.info("rank 0 stopped the group")
    return status
