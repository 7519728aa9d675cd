"""Tensor parallelism: an `Executor` over N ranks (issue 30, part 1).

Rank 0 runs in the engine's process; ranks 1..N-1 are workers started with torch.multiprocessing
`spawn`. Every rank loads its own shard of the model (model/parallel.py: heads, MLP rows and a
vocabulary slice; model/tp_layers.py: the all-reduces and the logits' all-gather on the ranks'
gloo group, tp_group.py) and its own KV pool, of its KV heads. Only rank 0 schedules: every step
its scheduler output reaches the workers once (a broadcast), every rank builds its own tensors
and runs the step in lockstep (the collectives inside the model keep them together), and rank
0's sampled tokens are the step's. The engine loop does not change: it sees one Executor.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from chunkserve.config import EngineConfig
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.engine.executor import RunnerOutput
from chunkserve.engine.tp_group import Rendezvous, TPGroup

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not within this is killed


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig  # as given; each rank resolves it against the model it loads
    rank: int
    rendezvous: Rendezvous
    num_threads: int  # this rank's share of the cores


def threads_per_rank(world_size: int, cores: int | None = None) -> int:
    """Each rank's compute threads: the cores split evenly (at least one each), as vLLM's CPU
    backend binds one NUMA node's cores per rank."""
    return max(1, (cores or os.cpu_count() or 1) // world_size)


def _load_rank(config: EngineConfig, group: TPGroup):  # type: ignore[no-untyped-def]
    """(the rank's LoadedModel, the config resolved against it, its ModelRunner). Every rank
    resolves the same config the same way, so their KV pools have the same number of blocks."""
    from chunkserve.engine.model_runner import ModelRunner
    from chunkserve.model.factory import load_configured

    loaded = load_configured(config.model_config, group)
    model = loaded.model
    resolved = config.resolve(loaded.max_model_len, device=model.device.type,
                              dtype=str(model.dtype).removeprefix("torch."))
    return loaded, resolved, ModelRunner.from_config(model, resolved)


def _worker_main(spec: WorkerSpec) -> None:
    """A worker's life: join the group, load its shard, then run every step rank 0 broadcasts
    until it broadcasts None."""
    torch.set_num_threads(spec.num_threads)
    group = TPGroup(spec.rendezvous, spec.rank)
    try:
        runner = _load_rank(spec.config, group)[2]
    except ValueError as e:
        # A config every rank refuses alike: rank 0 reports it to the user; one line here.
        logger.error("tp-rank-%d: %s", spec.rank, e)
        sys.exit(1)
    while (out := group.broadcast_object()) is not None:
        runner.execute(out)


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, world_size: int, host: str = "127.0.0.1") -> None:
        if world_size < 2:
            raise ValueError(f"tensor parallelism needs at least 2 ranks, got {world_size}")
        threads = threads_per_rank(world_size)
        store = TPGroup.host_store(host, world_size)
        rendezvous = Rendezvous(host, store.port, world_size)
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker_main, daemon=True, name=f"tp-rank-{rank}",
                                    args=(WorkerSpec(config, rank, rendezvous, threads),))
                        for rank in range(1, world_size)]
        for worker in self.workers:
            worker.start()
        try:
            self.group = TPGroup(rendezvous, 0, store)
            # Rank 0's share of the cores, for the engine's process; close() gives them back.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
            # The engine reads the tokenizer, the whole model's config and the resolved
            # engine config from rank 0's load.
            self.loaded, self.config, self.runner = _load_rank(config, self.group)
        except BaseException:
            torch.set_num_threads(getattr(self, "_threads_before", torch.get_num_threads()))
            self._stop_workers()
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_swap_blocks = self.runner.num_swap_blocks
        self.kv_cache_groups = self.runner.kv_cache_groups
        self._closed = False

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._check_workers()
        self.group.broadcast_object(scheduler_output)
        return self.runner.execute(scheduler_output)

    def commit_kv_memory(self) -> None:
        self.runner.commit_kv_memory()

    def close(self) -> None:
        """Tells the workers to stop and waits for them; kills any that do not."""
        if self._closed:
            return
        self._closed = True
        torch.set_num_threads(self._threads_before)
        if all(w.is_alive() for w in self.workers):
            try:
                self.group.broadcast_object(None)
            except RuntimeError:
                pass  # a worker died meanwhile: stopped below either way
        self._stop_workers()

    def _check_workers(self) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            self.close()
            raise RuntimeError("tensor-parallel worker " + ", ".join(
                f"{w.name} exited with code {w.exitcode}" for w in dead))

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
                worker.join()
