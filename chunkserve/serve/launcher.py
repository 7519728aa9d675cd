"""`chunkserve serve`: build the engine, the app, and run uvicorn with a clean shutdown."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterator

import uvicorn

from chunkserve.engine.arg_utils import add_engine_args, config_from_args

log = logging.getLogger("chunkserve.server")


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
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
    by the signal; we want to finish cleanly and exit 0, so we install plain handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        yield


def run_server(args: argparse.Namespace) -> int:
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.serve.api_server import build_app

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(config_from_args(args))
    name = args.served_model_name or args.model
    app = build_app(engine, name, args.api_key, args.max_waiting_requests)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        # In-flight requests get this long to finish; then they are cancelled and aborted.
        timeout_graceful_shutdown=5,
    )
    log.info("serving %s as %r on http://%s:%d", args.model, name, args.host, args.port)
    asyncio.run(_Server(config).serve())
    return 0
