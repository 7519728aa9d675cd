"""A tensor-parallel worker: one rank other than 0, in a process of its own, started by the
engine's executor on node 0 (engine/tp/executor.py) or by a headless launch on another node
(engine/tp/headless.py).

A worker never outlives what it serves: it exits when rank 0 broadcasts stop (0), when the
group fails under it (1: rank 0 or another rank gone), when the process that started it is
gone (1, parent_watch.py: a SIGKILLed engine or launch leaves no orphan), and when rank 0's
store stops answering (1: a node lost silently, where no socket ever closes).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, fields, replace
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkserve.config import EngineConfig
from chunkserve.procs.cpu_binding import bind_this_thread, threads
from chunkserve.procs.lifecycle import spawn
from chunkserve.procs.parent_watch import exit_with_parent
from chunkserve.procs.rendezvous import first_line
from chunkserve.engine.tp import step_wire
from chunkserve.engine.tp.group import IDLE_WAIT, TIMEOUT, Rendezvous, TPGroup

logger = logging.getLogger(__name__)

STORE_POLL_S = 5.0  # how often it checks that rank 0's store answers
STOP_GRACE_S = 2.0  # a store gone while rank 0's stop is on its way is not a failure


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    rendezvous: Rendezvous
    cores: tuple[int, ...] | None  # the cores it is bound to (cpu_binding.py; None: unbound)
    num_threads: int  # one per core it is bound to, else its share of its node's cores
    # A headless node's own flags: only to warn where they differ from rank 0's, which every
    # worker receives and uses (None: the worker is rank 0's child, with rank 0's flags).
    own_config: EngineConfig | None = None


def load_rank(config: EngineConfig, group: TPGroup):  # type: ignore[no-untyped-def]
    """(the rank's LoadedModel, the config resolved against it, its ModelRunner). Every rank
    resolves the same config the same way, so their KV pools have the same number of blocks."""
    from chunkserve.engine.model_runner import ModelRunner
    from chunkserve.model.factory import load_configured, resolve_device

    device = group.use_device(resolve_device(config.model_config.device))
    loaded = load_configured(config.model_config, group, device)
    model = loaded.model
    resolved = config.resolve(loaded.max_model_len, device=model.device.type,
                              dtype=str(model.dtype).removeprefix("torch."))
    return loaded, resolved, ModelRunner.from_config(model, resolved)


def with_resolved_device(config: EngineConfig) -> EngineConfig:
    """`config` with its device `auto` made cpu or cuda, as this process sees it."""
    from chunkserve.model.factory import resolve_device

    device = resolve_device(config.model_config.device).type
    return replace(config, model_config=replace(config.model_config, device=device))


def start_workers(ranks: range, rendezvous: Rendezvous,
                  cores: list[tuple[int, ...] | None], num_local: int,
                  own_config: EngineConfig | None = None) -> list[mp.Process]:
    """Workers for `ranks`, each bound to its `cores` (cpu_binding.rank_cores, in the same
    order); `num_local`: the ranks on this node, rank 0 included where it is here."""
    specs = [WorkerSpec(rank, rendezvous, c, threads(c, num_local), own_config)
             for rank, c in zip(ranks, cores, strict=True)]
    return [spawn(worker_main, f"tp-rank-{spec.rank}", (spec,), daemon=True) for spec in specs]


def worker_main(spec: WorkerSpec) -> None:
    """A worker's life: join the group, take rank 0's engine config, load its shard, then run
    every step rank 0 broadcasts until it broadcasts None."""
    # Ctrl-C reaches the whole process group: the engine (or the headless launch) decides
    # when its workers stop, and a worker that died first would fail its last steps.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its warnings and errors only: its INFO lines would repeat rank 0's.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    bind_this_thread(spec.cores)  # before torch's thread pool exists: its threads inherit
    torch.set_num_threads(spec.num_threads)
    name = f"tp-rank-{spec.rank}"
    exit_with_parent()  # a SIGKILLed engine or headless launch leaves no orphan
    stopping = threading.Event()
    try:
        group = TPGroup(spec.rendezvous, spec.rank)
        config = step_wire.decode_config(group.broadcast_bytes(timeout=IDLE_WAIT))
    except RuntimeError as e:  # DistNetworkError, gloo's errors
        _exit(name, f"could not join rank 0 at {spec.rendezvous.host}:"
                    f"{spec.rendezvous.port}: {first_line(e)}")
    threading.Thread(target=_watch_store, args=(spec.rendezvous, stopping, name),
                     name=f"{name}-store-watch", daemon=True).start()
    if spec.own_config is not None:
        warn_if_flags_differ(name, spec.own_config, config)
    try:
        runner = load_rank(config, group)[2]
    except ValueError as e:
        # A config every rank refuses alike: rank 0 reports it to the user; one line here.
        _exit(name, str(e))
    try:
        while (frame := group.broadcast_bytes(timeout=IDLE_WAIT)) != step_wire.STOP_FRAME:
            runner.execute(step_wire.decode_step(frame))
    except RuntimeError as e:
        _exit(name, f"the tensor-parallel group failed (rank 0 or another rank is gone): "
                    f"{first_line(e)}")
    stopping.set()


def _watch_store(rendezvous: Rendezvous, stopping: threading.Event, name: str) -> None:
    """A daemon thread's: ends the process once rank 0's store stops answering (each check
    waits at most TIMEOUT), unless rank 0's stop arrives meanwhile (a clean stop, which the
    main thread ends with 0)."""
    try:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, None, False, timeout=TIMEOUT,
                              wait_for_workers=False)
        while not stopping.wait(STORE_POLL_S):
            store.check(["alive"])
    except RuntimeError as e:
        if not stopping.wait(STOP_GRACE_S):
            _exit(name, f"rank 0's store at {rendezvous.host}:{rendezvous.port} is gone: "
                        f"{first_line(e)}")


def warn_if_flags_differ(name: str, own: EngineConfig, node0: EngineConfig,
                         parts: tuple[str, ...] = ("model_config", "cache_config")) -> None:
    """Warns where this node's flags in `parts` differ from node 0's, which it runs with. A
    rank's own work depends on its load and its KV pool (the scheduler runs on rank 0 alone);
    a data-parallel engine's on its scheduler's flags too."""
    differ = [f.name for part in parts for f in fields(getattr(own, part))
              if getattr(getattr(own, part), f.name) != getattr(getattr(node0, part), f.name)]
    if differ:
        logger.warning("%s: this node's flags differ from node 0's (%s): node 0's are used, "
                       "and the model must be at the same path on every node", name,
                       ", ".join(differ))


def _exit(name: str, why: str) -> NoReturn:
    logger.error("%s: %s: exiting", name, why)
    sys.stderr.flush()
    os._exit(1)
