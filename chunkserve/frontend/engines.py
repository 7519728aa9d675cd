"""Data parallelism, the front end's side: the `--data-parallel-size` engines behind the one API
server (issue 30), this node's as processes (engine/core_proc.py), the other nodes' through their
headless launches (frontend/remote_engines.py), every one reached through one `EngineHub`
(frontend/core_client.py)."""
from __future__ import annotations

import logging
import os

from chunkserve.config import EngineConfig
from chunkserve.engine.channel import local_secret, require_secret
from chunkserve.engine.core_proc import engine_specs, spawn_engine
from chunkserve.frontend.core_client import CoreClient, EngineHub
from chunkserve.frontend.engine_client import EngineClient
from chunkserve.frontend.remote_engines import serve_other_nodes
from chunkserve.procs.cpu_binding import RESERVED_ENV, reserved_cpus
from chunkserve.procs.lifecycle import JOIN_TIMEOUT_S

log = logging.getLogger("chunkserve.server")


def start_engines(config: EngineConfig, timeout: float = 600.0,
                  profiler_dir: str | None = None) -> list[EngineClient]:
    """The `data_parallel_size` engines of `config`, in index order: this node's as processes,
    loaded in parallel with the other nodes' (`--nnodes`: frontend/remote_engines.py); all
    stopped if any fails. `profiler_dir`: this node's engines profile into it on
    /start_profile."""
    pc = config.parallel_config
    multi = pc.nnodes > 1
    secret = require_secret(f"--nnodes {pc.nnodes}") if multi else local_secret()
    specs = engine_specs(config, profiler_dir)  # placed before the server binds itself
    _bind_server(reserved_cpus())
    hub = EngineHub(secret, tcp=multi)
    clients: list[CoreClient] = []
    try:
        for spec in specs:
            clients.append(CoreClient(hub, spec.index, spawn_engine(spec, hub.local)))
        if multi:
            clients += serve_other_nodes(config, hub)
            clients.sort(key=lambda c: c.index)
        for client in clients:
            client.wait_ready(timeout)
    except BaseException:
        for client in clients:
            client.shutdown(JOIN_TIMEOUT_S)
        hub.close()
        raise
    log.info("%d data-parallel engines ready, over %d node(s)", len(clients), pc.nnodes)
    return list(clients)


def _bind_server(cpus: tuple[int, ...]) -> None:
    """Keeps this thread, and the threads it starts from now on (the hub's reader, uvicorn's
    loop, the tokenizer's pool), on the API server's reserved CPUs; none reserved: as is."""
    if cpus:
        os.sched_setaffinity(0, cpus)
        log.info("the API server runs on CPU(s) %s (%s); the engines on the others",
                 ",".join(map(str, cpus)), RESERVED_ENV)
