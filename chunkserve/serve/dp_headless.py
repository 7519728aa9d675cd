"""A node other than 0 under `serve --data-parallel-size N --nnodes M` (vLLM's "headless" node):
its share of the engines, no HTTP server. Node 0's API server routes to them through its store
(serve/dp_remote.py, serve/store_queue.py); they run node 0's engine config.

This process starts its engines, adds to the node's beat counter every BEAT_S and reports each
engine's exit to the server. It exits 0 when the server stopped every engine, or on
SIGTERM/SIGINT (its engines' requests fail with "node K is shutting down", and the server
stops as it does for any lost engine); 1 when an engine failed or node 0's store is gone (its engines
stopped first). Its engines exit when it does, even by SIGKILL (engine/parent_watch.py).
"""
from __future__ import annotations

import logging
import pickle
import signal
import threading
from dataclasses import replace
from multiprocessing.connection import wait

import torch.multiprocessing as mp
from torch.distributed import TCPStore

from chunkserve.config import EngineConfig, ParallelConfig
from chunkserve.engine.tp_worker import warn_if_flags_differ
from chunkserve.serve.dp_remote import BEAT_S, EngineExited
from chunkserve.serve.engine_client import JOIN_TIMEOUT_S
from chunkserve.serve.engine_loop import Stop
from chunkserve.serve.engine_proc import engine_specs, spawn_engine
from chunkserve.serve.store_queue import (
    CONFIG_KEY, StoreLostError, StoreQueue, beat_key, commands_key, connect, events_key,
)

log = logging.getLogger("chunkserve.headless")


class _Engine:
    """One engine process of this node and the queues it shares with node 0's server."""

    def __init__(self, index: int, process: mp.Process, commands: StoreQueue,
                 events: StoreQueue) -> None:
        self.index, self.process, self.commands, self.events = index, process, commands, events
        self.reported = False

    def report_exit(self, why: str) -> None:
        """Tells the server this engine has ended (once)."""
        if not self.reported:
            self.reported = True
            self.events.put(EngineExited(self.process.exitcode, why))


def run_dp_headless(config: EngineConfig, profiler_dir: str | None = None) -> int:
    """Runs this node's engines until they end; the process's exit status. `config`: this
    launch's own flags (node 0's engine config is used; its own node rank places it)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    pc = config.parallel_config
    node = pc.node_rank
    store = connect(pc.master_addr, pc.master_port)
    try:
        node0: EngineConfig = pickle.loads(store.get(CONFIG_KEY))
    except RuntimeError as e:
        raise StoreLostError(f"node 0 at {pc.master_addr}:{pc.master_port} published no "
                             f"data-parallel engine config: is it started with "
                             f"--data-parallel-size? ({e})") from e
    n0 = node0.parallel_config
    mine = replace(node0, parallel_config=replace(n0, node_rank=node))
    _check_layout(pc, mine)
    if store.add(f"dp/node{node}/joined", 1) > 1:
        raise ValueError(f"node {node} has already joined node 0 at {pc.master_addr}:"
                         f"{pc.master_port}: is another launch running with --node-rank {node}?")
    warn_if_flags_differ(f"node {node}", config, node0,
                         ("model_config", "cache_config", "scheduler_config"))
    store.add(beat_key(node), 1)
    engines: list[_Engine] = []
    for spec in engine_specs(mine, profiler_dir):
        commands = StoreQueue(pc.master_addr, pc.master_port, commands_key(spec.index))
        events = StoreQueue(pc.master_addr, pc.master_port, events_key(spec.index))
        engines.append(_Engine(spec.index, spawn_engine(spec, commands, events), commands,
                               events))
    log.info("node %d of %d: data-parallel engines %s (pids %s), serving node 0 at %s:%d",
             node, pc.nnodes, ", ".join(str(e.index) for e in engines),
             " ".join(str(e.process.pid) for e in engines), pc.master_addr, pc.master_port)
    return _watch(store, node, engines)


def _check_layout(own: ParallelConfig, mine: EngineConfig) -> None:
    """This launch's --data-parallel-size and --nnodes must be node 0's: they place the
    engines. Node 0 hears of a mismatch at once (its engines' start fails with it)."""
    n0 = mine.parallel_config
    if (own.data_parallel_size, own.nnodes) == (n0.data_parallel_size, n0.nnodes):
        return
    why = (f"node {n0.node_rank} was started with --data-parallel-size "
           f"{own.data_parallel_size} --nnodes {own.nnodes}, node 0 with "
           f"{n0.data_parallel_size} and {n0.nnodes}: give every node the same")
    for index in n0.node_engines:
        StoreQueue(n0.master_addr, n0.master_port, events_key(index)).put(("error", why))
    raise ValueError(why)


def _watch(store: TCPStore, node: int, engines: list[_Engine]) -> int:
    """Beats, and reports each engine's exit, until every engine has ended (0, or 1 if any
    failed), a signal (0: the engines are stopped first) or the loss of node 0's store (1)."""
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.is_set():
            live = [e for e in engines if e.process.exitcode is None]
            wait([e.process.sentinel for e in live], BEAT_S)
            store.add(beat_key(node), 1)
            for e in engines:
                code = e.process.exitcode
                if code is not None and not e.reported:
                    e.report_exit("stopped" if code == 0 else
                                  f"its process on node {node} exited with code {code}")
            if all(e.reported for e in engines):
                failed = [e for e in engines if e.process.exitcode != 0]
                log.info("every engine of this node has ended%s",
                         f"; {len(failed)} failed" if failed else "")
                return 1 if failed else 0
        log.info("stopping this node's engines")
        _stop(engines, node)
        return 0
    except (StoreLostError, RuntimeError) as e:
        log.error("node 0's store is gone (%s): stopping this node's engines", e)
        for e_ in engines:
            e_.process.terminate()
        return 1
    finally:
        for e in engines:
            e.process.join(JOIN_TIMEOUT_S)
            if e.process.is_alive():
                e.process.kill()
                e.process.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _stop(engines: list[_Engine], node: int) -> None:
    """Stops the engines, their requests failing as if the engine had died (which it has,
    for the server), and tells the server."""
    why = f"node {node} is shutting down"
    for e in engines:
        if e.process.exitcode is None:
            e.commands.put(Stop(f"engine {e.index} died: {why}"))
    for e in engines:
        e.process.join(JOIN_TIMEOUT_S)
        if e.process.is_alive():
            log.warning("engine %d did not stop in time: killed", e.index)
            e.process.kill()
            e.process.join()
        e.report_exit(why)
