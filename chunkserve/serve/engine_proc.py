"""Data parallelism: engines in processes of their own behind the one API server (issue 30).

`--data-parallel-size N` starts N engine processes with torch.multiprocessing `spawn`. Each
holds a whole model (or, with `-tp`, rank 0 of its own tensor-parallel group) with its own
scheduler and KV pool, and runs the same engine loop as a one-engine server
(serve/engine_loop.py) on its main thread. Commands come in on one queue, the loop's events go
out on another; a thread in the API server hands them to the front end
(serve/async_engine.py), which routes each request (serve/dp_router.py).

Each engine gets its own share of the cores (CPU affinity, inherited by its tensor-parallel
workers), as vLLM gives each CPU rank its own cores. An engine that exits unasked is reported
to the front end as dead: its requests fail and the server stops. An engine whose API server
dies exits too (engine/parent_watch.py), so none is left orphaned.

With `--nnodes` the engines split evenly over the machines: node 0 runs the API server and its
own share here; every other node runs its share under a headless launch
(serve/dp_headless.py), whose engines reach the server through node 0's store
(serve/dp_remote.py, serve/store_queue.py).
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch.multiprocessing as mp

from chunkserve.config import EngineConfig
from chunkserve.engine.cpu_binding import ENV, explicit_lists, rank_cores
from chunkserve.engine.gpu_placement import VISIBLE_ENV, engine_gpus
from chunkserve.engine.parent_watch import exit_with_parent
from chunkserve.engine.profiler import engine_profiler
from chunkserve.serve.engine_client import (
    JOIN_TIMEOUT_S,
    EngineClient,
    EngineInfo,
    EventHandler,
)
from chunkserve.serve.engine_loop import STOP, CommandQueue, EngineLoop, LoopEvent

if TYPE_CHECKING:
    from chunkserve.serve.dp_remote import RemoteEngineClient

log = logging.getLogger("chunkserve.server")
POLL_S = 0.2  # how often a waiting reader checks that its engine process still lives


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    index: int
    cores: tuple[int, ...]  # the CPUs this engine (and its tensor-parallel workers) may use
    bind: str | None = None  # its ranks' VLLM_CPU_OMP_THREADS_BIND lists, when given
    profiler_dir: str | None = None  # where its /stop_profile traces go (None: off)
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES on a GPU node (engine/gpu_placement.py)


def split_cores(num_engines: int, tp: int = 1) -> list[tuple[tuple[int, ...], str | None]]:
    """Each engine's cores and, where VLLM_CPU_OMP_THREADS_BIND lists every rank's cores
    (num_engines x tp lists), the part of it that is its own ranks'; else the CPUs this
    process may use split evenly (engine/cpu_binding.py), and its ranks split its share."""
    lists = explicit_lists()
    if lists is None:
        return [(cores or (), None) for cores in rank_cores(num_engines, "auto")]
    if len(lists) != num_engines * tp:
        raise ValueError(f"{ENV} lists {len(lists)} CPU set(s) for {num_engines} engines of "
                         f"{tp} rank(s): give one per rank, separated by '|'")
    mine = [lists[i * tp:(i + 1) * tp] for i in range(num_engines)]
    return [(tuple(sorted({c for group in m for c in group})),
             "|".join(",".join(map(str, group)) for group in m)) for m in mine]


class EventSink(Protocol):
    def put(self, obj: object) -> None: ...


def _engine_main(spec: EngineSpec, commands: CommandQueue, events: EventSink) -> None:
    """An engine process: build the engine, say so, run the loop until told to stop. Its
    queues are torch.multiprocessing ones, or node 0's store's for an engine of another node
    (serve/store_queue.py)."""
    import torch

    from chunkserve.engine.llm_engine import LLMEngine

    if spec.gpus is not None:  # before CUDA starts here; its tensor-parallel workers inherit it
        os.environ[VISIBLE_ENV] = spec.gpus
    exit_with_parent()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s engine-{spec.index} %(name)s: %(message)s")
    os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(len(spec.cores))
    if spec.bind is not None:
        os.environ[ENV] = spec.bind  # its own ranks' lists, for its tensor-parallel executor
    try:
        engine = LLMEngine.from_config(spec.config)
        engine.commit_kv_memory()
    except Exception as e:  # noqa: BLE001 - reported to the server, which says it once
        events.put(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    events.put(("ready", EngineInfo.of(engine)))
    try:
        EngineLoop(engine, commands, events.put,
                   engine_profiler(spec.profiler_dir, spec.index)).run()
    except BaseException:  # the loop logged it and failed its requests; exit non-zero
        sys.exit(1)
    finally:
        engine.close()


def spawn_engine(spec: EngineSpec, commands: CommandQueue, events: EventSink) -> mp.Process:
    """Starts engine `spec.index` in a process of its own, reading `commands` and sending
    its events to `events`."""
    # Not a daemon: a daemon process may not start the tensor-parallel workers of its own.
    process = mp.get_context("spawn").Process(target=_engine_main, name=f"engine-{spec.index}",
                                              args=(spec, commands, events))
    process.start()
    return process


class EngineProcessClient:
    """One engine process, as the front end's EngineClient (serve/engine_client.py)."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")
        self.index = spec.index
        self._commands = ctx.Queue()
        self._events = ctx.Queue()
        self.process = spawn_engine(spec, self._commands, self._events)
        self._stopping = False
        self._receiver: threading.Thread | None = None
        self.info: EngineInfo  # set by wait_ready

    def wait_ready(self, timeout: float) -> EngineInfo:
        """Blocks until the engine has loaded; raises with its reason if it could not (a
        ValueError, like the one-engine server's refusals: the CLI prints it, no traceback)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._get()
            if msg is not None:
                kind, payload = msg
                if kind == "error":
                    raise ValueError(f"engine {self.index} failed to start: {payload}")
                self.info = payload
                return payload
            if not self.process.is_alive():
                raise ValueError(f"engine {self.index} exited with code "
                                   f"{self.process.exitcode} while loading")
            if time.monotonic() > deadline:
                raise ValueError(f"engine {self.index} did not load within {timeout:g} s")

    def start(self, handle: EventHandler) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(handle,), daemon=True,
                                          name=f"engine-{self.index}-events")
        self._receiver.start()

    def send(self, command: object) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.process.is_alive():
            self._commands.put(STOP)
            self.process.join(min(timeout, JOIN_TIMEOUT_S))
        if self.process.is_alive():
            log.warning("engine %d did not stop in time: killed", self.index)
            self.process.kill()
            self.process.join()
        if self._receiver is not None:
            self._receiver.join(timeout)
        # Dropped now, not at interpreter exit (which the server skips): their semaphores
        # are unlinked as they go, instead of being reported as leaked.
        self._commands.close()
        self._events.close()
        del self._commands, self._events

    def _get(self) -> object | None:
        try:
            return self._events.get(timeout=POLL_S)
        except queue.Empty:
            return None

    def _receive(self, handle: EventHandler) -> None:
        """Forwards the loop's events until the process is gone and its queue drained; an
        exit nobody asked for is reported as the engine's death."""
        fatal_seen = False
        while True:
            ev = self._get()
            if isinstance(ev, LoopEvent):
                fatal_seen = fatal_seen or ev.fatal is not None
                handle(self.index, ev)
            elif ev is None and not self.process.is_alive():
                ev = self._get()  # what it sent just before exiting
                if isinstance(ev, LoopEvent):
                    handle(self.index, ev)
                    continue
                if not self._stopping and not fatal_seen:
                    handle(self.index, LoopEvent(
                        fatal=f"its process exited with code {self.process.exitcode}"))
                return


def engine_specs(config: EngineConfig, profiler_dir: str | None = None) -> list[EngineSpec]:
    """The engines this node runs (`config`'s node_engines), each on its share of the node's
    cores, with its own tensor-parallel group on this node."""
    pc = config.parallel_config
    one = replace(config, parallel_config=pc.one_engine())
    local = pc.node_engines
    gpus = engine_gpu_lists(config, len(local))
    return [EngineSpec(one, i, cores, bind, profiler_dir, g) for i, (cores, bind), g
            in zip(local, split_cores(len(local), pc.tensor_parallel_size), gpus, strict=True)]


def engine_gpu_lists(config: EngineConfig, num_engines: int) -> list[str | None]:
    """Each of this node's engines' GPUs (a CUDA_VISIBLE_DEVICES value), where the model runs
    on CUDA; None for each on the CPU."""
    import torch

    from chunkserve.model.factory import resolve_device

    if resolve_device(config.model_config.device).type != "cuda":
        return [None] * num_engines
    tp, count = config.parallel_config.tensor_parallel_size, torch.cuda.device_count()
    return [engine_gpus(i, tp, num_engines, count, os.environ.get(VISIBLE_ENV))
            for i in range(num_engines)]


def start_engines(config: EngineConfig, timeout: float = 600.0,
                  profiler_dir: str | None = None) -> list[EngineClient]:
    """The `data_parallel_size` engines of `config`, in index order: this node's as processes,
    loaded in parallel with the other nodes' (`--nnodes`: serve/dp_remote.py); all stopped if
    any fails. `profiler_dir`: this node's engines profile into it on /start_profile."""
    pc = config.parallel_config
    clients: list[EngineProcessClient | RemoteEngineClient] = []
    try:
        for spec in engine_specs(config, profiler_dir):
            clients.append(EngineProcessClient(spec))
        if pc.nnodes > 1:
            from chunkserve.serve.dp_remote import serve_other_nodes

            clients += serve_other_nodes(config)
            clients.sort(key=lambda c: c.index)
        for client in clients:
            client.wait_ready(timeout)
    except BaseException:
        for client in clients:
            client.shutdown(JOIN_TIMEOUT_S)
        raise
    log.info("%d data-parallel engines ready, over %d node(s)", len(clients), pc.nnodes)
    return list(clients)
