"""A node other than 0 under `serve --data-parallel-size N --nnodes M` (vLLM's "headless" node):
its share of the engines, no HTTP server. Its engines connect to node 0's sockets over tcp://,
proving the shared secret (engine/channel.py); they run node 0's engine config, which this
launch reads from node 0's store with the sockets' addresses (engine/dp_rendezvous.py).

This process starts its engines, adds to the node's beat counter every BEAT_S and reports each
engine's exit to the server. It exits 0 when the server stopped every engine, or on
SIGTERM/SIGINT (its engines' requests fail with "node K is shutting down", and the server
stops as it does for any lost engine); 1 when an engine failed or node 0's store is gone (its
engines stopped first). Its engines exit when it does, even by SIGKILL (procs/parent_watch.py).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch.multiprocessing as mp
import zmq
from torch.distributed import TCPStore

from chunkserve.config import EngineConfig, ParallelConfig
from chunkserve.engine import wire
from chunkserve.engine.channel import Keys, engine_socket, require_secret
from chunkserve.engine.core_proc import Endpoints, engine_specs, spawn_engine
from chunkserve.engine.dp_rendezvous import beat_key, joined_key, read_published
from chunkserve.engine.tp.worker import warn_if_flags_differ
from chunkserve.procs.lifecycle import supervise
from chunkserve.procs.rendezvous import StoreLostError, connect_store

log = logging.getLogger("chunkserve.headless")
BEAT_S = 1.0  # how often this node adds to its beat counter (frontend/remote_engines.py)


class _Engine:
    """One engine process of this node."""

    def __init__(self, index: int, process: mp.Process) -> None:
        self.index, self.process = index, process
        self.reported = False


class _Reporter:
    """This launch's own socket to node 0's events: its engines' exits."""

    def __init__(self, events: str, secret: bytes) -> None:
        self._ctx = zmq.Context()
        self._sock = engine_socket(self._ctx, zmq.PUSH, Keys.of(secret))
        self._sock.connect(events)

    def send(self, msg: wire.Exited | wire.StartFailed) -> None:
        self._sock.send(wire.encode(msg))

    def exited(self, e: _Engine, why: str) -> None:
        """Tells the server engine `e` has ended (once)."""
        if not e.reported:
            e.reported = True
            self.send(wire.Exited(e.index, e.process.exitcode, why))

    def close(self) -> None:
        self._sock.close()  # lingers: the last reports still go out
        self._ctx.term()


def run_dp_headless(config: EngineConfig, profiler_dir: str | None = None) -> int:
    """Runs this node's engines until they end; the process's exit status. `config`: this
    launch's own flags (node 0's engine config is used; its own node rank places it)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    pc = config.parallel_config
    node = pc.node_rank
    secret = require_secret(f"node {node}")
    store = connect_store(pc.master_addr, pc.master_port)
    node0, commands, events = read_published(store, f"{pc.master_addr}:{pc.master_port}")
    # Node 0's config, placed on this node; the adaptive policy's step-time model (a callable,
    # which does not travel) is this launch's own, made from its own flags.
    mine = replace(node0, parallel_config=replace(node0.parallel_config, node_rank=node),
                   scheduler_config=replace(node0.scheduler_config,
                                            step_time=config.scheduler_config.step_time))
    reporter = _Reporter(events, secret)
    try:
        _check_layout(pc, mine, reporter)
        if store.add(joined_key(node), 1) > 1:
            raise ValueError(f"node {node} has already joined node 0 at {pc.master_addr}:"
                             f"{pc.master_port}: is another launch running with --node-rank "
                             f"{node}?")
        warn_if_flags_differ(f"node {node}", config, node0,
                             ("model_config", "cache_config", "scheduler_config"))
        store.add(beat_key(node), 1)
        endpoints = Endpoints(commands, events, secret)
        engines = [_Engine(spec.index, spawn_engine(spec, endpoints))
                   for spec in engine_specs(mine, profiler_dir)]
        log.info("node %d of %d: data-parallel engines %s (pids %s), serving node 0 at %s:%d",
                 node, pc.nnodes, ", ".join(str(e.index) for e in engines),
                 " ".join(str(e.process.pid) for e in engines), pc.master_addr, pc.master_port)
        return _watch(store, node, engines, reporter)
    finally:
        reporter.close()


def _check_layout(own: ParallelConfig, mine: EngineConfig, reporter: _Reporter) -> None:
    """This launch's --data-parallel-size and --nnodes must be node 0's: they place the
    engines. Node 0 hears of a mismatch at once (its engines' start fails with it)."""
    n0 = mine.parallel_config
    if (own.data_parallel_size, own.nnodes) == (n0.data_parallel_size, n0.nnodes):
        return
    why = (f"node {n0.node_rank} was started with --data-parallel-size "
           f"{own.data_parallel_size} --nnodes {own.nnodes}, node 0 with "
           f"{n0.data_parallel_size} and {n0.nnodes}: give every node the same")
    for index in n0.node_engines:
        reporter.send(wire.StartFailed(index, why))
    raise ValueError(why)


def _watch(store: TCPStore, node: int, engines: list[_Engine], reporter: _Reporter) -> int:
    """Beats, and reports each engine's exit, until every engine has ended (0, or 1 if any
    failed), a signal (0: the engines are stopped first) or the loss of node 0's store (1)."""
    by_process = {id(e.process): e for e in engines}
    signalled: list[bool] = []

    def on_exit(p: mp.Process) -> None:
        code = p.exitcode
        reporter.exited(by_process[id(p)], "stopped" if code == 0 else
                        f"its process on node {node} exited with code {code}")

    def on_signal() -> None:
        signalled.append(True)
        log.info("stopping this node's engines")
        # Node 0 hears first, so that their requests fail with this reason, not a lost engine's.
        for e in engines:
            reporter.exited(e, f"node {node} is shutting down")

    try:
        status = supervise([e.process for e in engines], BEAT_S, fail_fast=False,
                           on_exit=on_exit, tick=lambda: store.add(beat_key(node), 1),
                           on_signal=on_signal)
    except (StoreLostError, RuntimeError) as e:
        log.error("node 0's store is gone (%s): this node's engines are stopped", e)
        return 1
    if not signalled:
        failed = sum(e.process.exitcode != 0 for e in engines)
        log.info("every engine of this node has ended%s", f"; {failed} failed" if failed else "")
    return status
