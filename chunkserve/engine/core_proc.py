"""An engine process (vLLM V1's EngineCoreProc): one `LLMEngine` and its loop, talking to the API
server over ZeroMQ (engine/channel.py) in typed messages (engine/wire.py).

`--data-parallel-size N` runs N of these, each holding a whole model (or, with `-tp`, rank 0
of its own tensor-parallel group) with its own scheduler and KV pool, on its own share of the
cores (CPU affinity, inherited by its tensor-parallel workers) or its own GPUs. It connects,
loads, says `Ready` (or `StartFailed`, with the reason), then runs the same engine loop as a
one-engine server until told to stop. An engine whose parent dies exits too
(procs/parent_watch.py), so none is left orphaned.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
from dataclasses import dataclass, replace

import torch.multiprocessing as mp
import zmq

from chunkserve.config import EngineConfig
from chunkserve.engine import wire
from chunkserve.engine.channel import Keys, engine_socket
from chunkserve.engine.engine_loop import EngineLoop, LoopEvent
from chunkserve.engine.output_tails import OutputSender
from chunkserve.engine.profiler import engine_profiler
from chunkserve.procs.cpu_binding import ENV, engine_cpus, explicit_lists, rank_cores
from chunkserve.procs.gpu_placement import VISIBLE_ENV, engine_gpus
from chunkserve.procs.lifecycle import spawn
from chunkserve.procs.parent_watch import exit_with_parent


@dataclass(frozen=True)
class Endpoints:
    """Where an engine reaches the API server, and the secret it proves there."""

    commands: str  # the server's ROUTER (ipc:// or tcp://)
    events: str  # the server's PULL
    secret: bytes


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    index: int
    cores: tuple[int, ...]  # the CPUs this engine (and its tensor-parallel workers) may use
    bind: str | None = None  # its ranks' VLLM_CPU_OMP_THREADS_BIND lists, when given
    profiler_dir: str | None = None  # where its /stop_profile traces go (None: off)
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES on a GPU node (procs/gpu_placement.py)


def routing_id(index: int) -> bytes:
    """Engine `index`'s DEALER identity: the ROUTER addresses its commands by it."""
    return f"engine-{index}".encode()


class SocketCommands:
    """The loop's CommandQueue over the engine's DEALER: each frame decoded as a Command."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        wait_ms = 0 if not block else None if timeout is None else int(1000 * timeout)
        if not self._sock.poll(wait_ms):
            raise queue.Empty
        return wire.decode_command(self._sock.recv_multipart())

    def get_nowait(self) -> object:
        return self.get(block=False)


def engine_main(spec: EngineSpec, endpoints: Endpoints) -> None:
    """An engine process: connect, build the engine, say so, run the loop until told to stop."""
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
    ctx, keys = zmq.Context(), Keys.of(endpoints.secret)
    commands = engine_socket(ctx, zmq.DEALER, keys)
    commands.routing_id = routing_id(spec.index)
    commands.connect(endpoints.commands)  # first: the server can address it once it is Ready
    events = engine_socket(ctx, zmq.PUSH, keys)
    events.connect(endpoints.events)
    try:
        try:
            engine = LLMEngine.from_config(spec.config)
            engine.commit_kv_memory()
        except Exception as e:  # noqa: BLE001 - reported to the server, which says it once
            events.send(wire.encode(wire.StartFailed(spec.index, f"{type(e).__name__}: {e}")))
            sys.exit(1)
        events.send(wire.encode(wire.Ready(spec.index, wire.EngineInfoSpec.of(engine))))

        sender = OutputSender()

        def emit(ev: LoopEvent) -> None:
            events.send_multipart(wire.event_frames(spec.index, ev, sender))

        try:
            EngineLoop(engine, SocketCommands(commands), emit,
                       engine_profiler(spec.profiler_dir, spec.index)).run()
        except BaseException:  # the loop logged it and failed its requests; exit non-zero
            sys.exit(1)
        finally:
            engine.close()
    finally:
        commands.close(linger=0)
        events.close()  # lingers: the last events (its requests' failures) still go out
        ctx.term()


def spawn_engine(spec: EngineSpec, endpoints: Endpoints) -> mp.Process:
    """Starts engine `spec.index` in a process of its own."""
    return spawn(engine_main, f"engine-{spec.index}", (spec, endpoints))


def split_cores(num_engines: int, tp: int = 1) -> list[tuple[tuple[int, ...], str | None]]:
    """Each engine's cores and, where VLLM_CPU_OMP_THREADS_BIND lists every rank's cores
    (num_engines x tp lists), the part of it that is its own ranks'; else the CPUs this
    process may use but the API server's reserved ones split evenly (procs/cpu_binding.py),
    and its ranks split its share."""
    lists = explicit_lists()
    if lists is None:
        return [(cores or (), None)
                for cores in rank_cores(num_engines, "auto", engine_cpus())]
    if len(lists) != num_engines * tp:
        raise ValueError(f"{ENV} lists {len(lists)} CPU set(s) for {num_engines} engines of "
                         f"{tp} rank(s): give one per rank, separated by '|'")
    mine = [lists[i * tp:(i + 1) * tp] for i in range(num_engines)]
    return [(tuple(sorted({c for group in m for c in group})),
             "|".join(",".join(map(str, group)) for group in m)) for m in mine]


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
