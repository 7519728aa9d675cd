"""Tensor parallelism: an `Executor` over N ranks (issue 30, part 1).

Rank 0 runs in the engine's process; ranks 1..N-1 are workers started with torch.multiprocessing
`spawn`. Every rank loads its own shard of the model (model/parallel.py: heads, MLP rows and a
vocabulary slice; model/tp_layers.py: the all-reduces and the logits' all-gather on the ranks'
gloo group, engine/tp/group.py) and its own KV pool, of its KV heads. Only rank 0 schedules: every step
its scheduler output reaches the workers once (a broadcast), every rank builds its own tensors
and runs the step in lockstep (the collectives inside the model keep them together), and rank
0's sampled tokens are the step's. The engine loop does not change: it sees one Executor.

Over several machines (--nnodes) the ranks split evenly: node 0 holds rank 0 and the next
ranks as its workers, every other node runs only its own (engine/tp/headless.py); all meet at rank
0's store, at --master-addr:--master-port.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from chunkserve.config import EngineConfig, ParallelConfig
from chunkserve.procs.cpu_binding import bind_this_thread, rank_cores, threads
from chunkserve.procs.lifecycle import exit_reason, first_dead, join_then_kill
from chunkserve.procs.rendezvous import first_line
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.engine.executor import FatalExecutorError, RunnerOutput
from chunkserve.engine.tp import step_wire
from chunkserve.engine.tp.group import TIMEOUT, Rendezvous, TPGroup
from chunkserve.engine.tp.worker import (
    load_rank,
    start_workers,
    with_resolved_device,
)

__all__ = ["TensorParallelExecutor"]


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"tensor parallelism needs at least 2 ranks, got {world_size}")
        pc = config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(f"--node-rank {pc.node_rank} runs no engine, only its node's "
                             "ranks: launch it with `chunkserve serve` or `chunkserve generate`")
        self._nnodes = pc.nnodes
        local = range(world_size // pc.nnodes)  # this node's ranks: 0 here, then its workers
        cores = rank_cores(len(local))  # VLLM_CPU_OMP_THREADS_BIND, or an even split
        store = _host_store(pc, world_size)
        rendezvous = Rendezvous(pc.master_addr, store.port, world_size, pc.nnodes)
        self.workers = start_workers(local[1:], rendezvous, cores[1:], len(local))
        self._failed = False
        try:
            self.group = _join(rendezvous, store, pc.nnodes, self.workers)
            # Every worker takes the engine config from here: a headless node's own flags may
            # differ, and every rank's KV pool must be the size of this one's. Its device is
            # resolved here, so that every rank's collectives are on the same backend.
            config = with_resolved_device(config)
            self.group.broadcast_bytes(step_wire.encode_config(config))
            # Rank 0's cores, for the thread that builds the engine (and steps it: one OpenMP
            # pool, engine/compute_thread.py); close() gives them back to it.
            self._bound_thread = threading.get_ident()
            self._affinity_before = bind_this_thread(cores[0])
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads(cores[0], len(local)))
            # The engine reads the tokenizer, the whole model's config and the resolved
            # engine config from rank 0's load.
            self.loaded, self.config, self.runner = load_rank(config, self.group)
        except BaseException:
            self._unbind()
            join_then_kill(self.workers, terminate=True)  # no engine for them to serve
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_swap_blocks = self.runner.num_swap_blocks
        self.kv_cache_groups = self.runner.kv_cache_groups
        self._closed = False
        # An engine never closed (a script's LLM at interpreter exit) still stops its workers
        # the clean way, so none of them logs the group's loss as an error.
        self._at_exit = weakref.finalize(self, _stop_group, self.group, self.workers)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._check_workers()
        try:
            self.group.broadcast_bytes(step_wire.encode_step(scheduler_output))
            return self.runner.execute(scheduler_output)
        except RuntimeError as e:
            # A collective fails as soon as a dying worker's sockets close, a moment before
            # its exit is reported: give it that moment, then call it dead if it is.
            for worker in self.workers:
                worker.join(0.2)
            self._check_workers()
            if self._nnodes > 1:
                # A rank on another node, most likely; the group cannot run another step.
                self._failed = True
                raise FatalExecutorError("the tensor-parallel group failed (a node gone?): "
                                         + first_line(e)) from e
            raise

    def commit_kv_memory(self) -> None:
        self.runner.commit_kv_memory()

    def close(self) -> None:
        """Tells the workers to stop and waits for them; kills any that do not."""
        if self._closed:
            return
        self._closed = True
        self._at_exit.detach()
        self._unbind()
        if self._failed:
            join_then_kill(self.workers)
        else:
            _stop_group(self.group, self.workers)

    def _unbind(self) -> None:
        """Gives the engine's thread back its threads and cores (from that thread only: the
        affinity is the thread's own, and a server closes its engine from another)."""
        if hasattr(self, "_threads_before"):
            torch.set_num_threads(self._threads_before)
        if (hasattr(self, "_affinity_before")
                and threading.get_ident() == self._bound_thread):
            os.sched_setaffinity(0, self._affinity_before)

    def _check_workers(self) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            self.close()
            raise FatalExecutorError("tensor-parallel worker " + ", ".join(
                f"{w.name} exited with code {w.exitcode}" for w in dead))



def _stop_group(group: TPGroup, workers: list[mp.Process]) -> None:
    """Tells the workers to stop (the empty frame) and waits for them; kills any that do not."""
    if all(w.is_alive() for w in workers):
        try:
            group.broadcast_bytes(step_wire.STOP_FRAME)
        except RuntimeError:
            pass  # a worker died meanwhile: stopped below either way
    join_then_kill(workers)


def _host_store(pc: ParallelConfig, world_size: int) -> TCPStore:
    try:
        return TPGroup.host_store(pc.master_addr, world_size, pc.master_port)
    except RuntimeError as e:  # DistNetworkError: the port is taken, the address not ours
        raise OSError(f"rank 0's store cannot listen on {pc.master_addr}:{pc.master_port} "
                      f"(--master-addr, --master-port): {first_line(e)}") from e


def _join(rendezvous: Rendezvous, store: TCPStore, nnodes: int,
          workers: list[mp.Process]) -> TPGroup:
    """Rank 0's group, once every rank has joined. The join runs on a thread of its own while
    this one watches this node's workers: one that dies first (a script fed on stdin, whose
    `__main__` a spawned worker cannot re-import) is an error at once, not TIMEOUT later."""
    joined: dict[str, object] = {}

    def join() -> None:
        try:
            joined["group"] = TPGroup(rendezvous, 0, store)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            joined["error"] = e

    thread = threading.Thread(target=join, daemon=True, name="tp-join")
    thread.start()
    while thread.is_alive():
        dead = first_dead(workers, 0.1) if workers else None
        if dead is not None:
            raise RuntimeError(f"tensor-parallel worker {dead.name} died before it joined rank "
                               f"0 ({exit_reason(dead)}){_spawn_hint()}")
        thread.join(0 if workers else None)
    if "error" in joined:
        e = joined["error"]
        hint = (f"; are the other {nnodes - 1} node(s) started with --master-addr "
                f"{rendezvous.host} --master-port {rendezvous.port}?") if nnodes > 1 else ""
        raise TimeoutError(f"the {rendezvous.world_size} tensor-parallel ranks did not all "
                           f"join within {TIMEOUT.total_seconds():.0f} s{hint} "
                           f"({first_line(e)})") from e  # type: ignore[arg-type]
    return joined["group"]  # type: ignore[return-value]


def _spawn_hint() -> str:
    """Why a spawned worker may die before running any of our code, where we can tell."""
    import __main__

    main_file = getattr(__main__, "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        return (f": this program's main module ({main_file}) is not a file, so a spawned "
                f"process cannot re-import it (a script fed on stdin, `python - <<EOF`); save "
                f"the script to a file and run that, with the LLM built under "
                f"`if __name__ == \"__main__\":`")
    return ": its own error is above"
