"""`chunkserve serve`: build the engine, the app, and run uvicorn with a clean shutdown."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import uvicorn

from chunkserve.engine.arg_utils import add_engine_args, config_from_args
from chunkserve.serve.compute_thread import ComputeThread

if TYPE_CHECKING:
    from chunkserve.engine.llm_engine import LLMEngine

log = logging.getLogger("chunkserve.server")
# SIGTERM/SIGINT: the process exits 0 within this many seconds (--shutdown-timeout). In-flight
# requests get all but the last STOP_RESERVE_S of it to finish; the rest are then aborted, each
# with an error (an error event and [DONE] on a stream), and the reserve covers ending those
# responses and stopping the engine (~0.3 s measured on 2 busy cores).
SHUTDOWN_GRACE_S = 5.0
STOP_RESERVE_S = 1.0
UVICORN_STARTUP_FAILURE = 3  # what `uvicorn.run` exits with when it cannot start


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="'smollm2-135m' (default), a .gguf file or a HF folder")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("CHUNKSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env CHUNKSERVE_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: MODEL)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 with Retry-After once this many requests are queued")
    s.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_GRACE_S,
                   help="after SIGTERM/SIGINT the process exits within this many seconds; "
                        f"requests still running {STOP_RESERVE_S:g} s before that are aborted, "
                        "each with an error (default %(default)s)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
    by the signal; we want to finish cleanly and exit 0, so we install plain handlers."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()  # starts the app's grace period as uvicorn stops accepting
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        yield


def build_engine(args: argparse.Namespace) -> LLMEngine:
    from chunkserve.engine.llm_engine import LLMEngine  # torch: not for `--help`

    engine = LLMEngine.from_config(config_from_args(args))
    engine.commit_kv_memory()  # RSS is flat from the start, not creeping up to it while serving
    return engine


def run_server(args: argparse.Namespace) -> int:
    from chunkserve.serve.api_server import begin_shutdown, build_app

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be at least 1")
    if not args.shutdown_timeout >= 0:
        raise ValueError("--shutdown-timeout must be non-negative")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Built on the thread its loop will run on: one OpenMP pool (serve/compute_thread.py).
    compute = ComputeThread()
    engine = compute.call(lambda: build_engine(args))
    name = args.served_model_name or args.model
    app = build_app(engine, name, args.api_key, args.max_waiting_requests, compute=compute)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        # uvicorn cancels what still runs at the deadline: only a backstop, since every
        # response has ended by then (a cancelled stream would end without its final event).
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    abort_after = max(0.0, args.shutdown_timeout - STOP_RESERVE_S)
    server = _Server(config, lambda: begin_shutdown(app, abort_after))
    log.info("serving %s as %r on http://%s:%d", args.model, name, args.host, args.port)
    asyncio.run(server.serve())
    if not server.started:  # e.g. the port is taken; uvicorn has logged why
        return UVICORN_STARTUP_FAILURE
    # Everything is stopped and closed. Skip the interpreter's teardown: unloading torch's
    # modules takes ~1 s of CPU here, time that the --shutdown-timeout deadline would count.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
