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
from chunkserve.engine.compute_thread import ComputeThread
from chunkserve.serve.http.heap import configure_allocator
from chunkserve.serve.http.h11_protocol import ConnectionLimits, protocol_class
from chunkserve.serve.openai.tools.parsers import TOOL_CALL_PARSERS
from chunkserve.serve.server_config import PROFILER_DIR_ENV, ServerConfig

if TYPE_CHECKING:
    from chunkserve.config import EngineConfig
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.frontend.engine_client import EngineClient

log = logging.getLogger("chunkserve.server")
# SIGTERM/SIGINT: the process exits 0 within this many seconds (--shutdown-timeout). In-flight
# requests get all but the last STOP_RESERVE_S of it to finish; the rest are then aborted, each
# with an error (an error event and [DONE] on a stream), and the reserve covers ending those
# responses and stopping the engine (~0.3 s measured on 2 busy cores).
SHUTDOWN_GRACE_S = 5.0
STOP_RESERVE_S = 1.0
# vLLM's: 1 runs one engine in a process of its own, as `-dp` runs each (frontend/engines.py).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
UVICORN_STARTUP_FAILURE = 3  # what `uvicorn.run` exits with when it cannot start


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="'smollm2-135m' (default), a .gguf file or a HF folder")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine processes behind this server, each with its own scheduler, "
                        "KV pool and share of the cores; requests go to the least loaded, "
                        "or to the one that recently served the same prompt prefix. With "
                        "--nnodes they split evenly over the nodes (docs/parallel.md)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("CHUNKSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health, "
                        "/version, /metrics and the web page's static files, which ask for "
                        "the key (env CHUNKSERVE_API_KEY)")
    s.add_argument("--metrics-require-key", action="store_true",
                   help="with --api-key, require the key on /metrics too")
    s.add_argument("--enable-dev-endpoints", action="store_true",
                   help="serve POST /reset_prefix_cache (vLLM: VLLM_SERVER_DEV_MODE=1)")
    s.add_argument("--profiler-dir", default=None, metavar="DIR",
                   help="serve POST /start_profile and /stop_profile, which write each "
                        "engine's torch.profiler trace (Chrome JSON) into DIR, created if "
                        f"missing (vLLM: {PROFILER_DIR_ENV}, used when this is not given)")
    s.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                   help="do not serve the chat page at / nor its live step stream "
                        "(/engine/steps): both answer 404")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: MODEL)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="at most this many admitted requests wait to run; beyond it a 503 "
                        "with Retry-After. A request of n x prompts > 1 that does not fit "
                        "takes places as they free, ahead of later arrivals, for up to 30 s "
                        "(docs/reliability.md)")
    s.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_GRACE_S,
                   help="after SIGTERM/SIGINT the process exits within this many seconds; "
                        f"requests still running {STOP_RESERVE_S:g} s before that are aborted, "
                        "each with an error (default %(default)s)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model may call tools, and '
                        "--tool-call-parser reads the calls out of its text")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call> JSON blocks: "
                        "Qwen, Hermes) or llama3_json (Llama 3.1+ JSON calls)")
    add_connection_args(s)
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def add_connection_args(s: argparse._ArgumentGroup) -> None:
    d = ConnectionLimits()
    s.add_argument("--header-timeout", type=_timeout, default=d.header_timeout,
                   help="seconds a client has to send the request line and headers, from the "
                        "connection or the request's first byte; then 408 and close; 0: off "
                        "(default %(default)s)")
    s.add_argument("--body-timeout", type=_timeout, default=d.body_timeout,
                   help="seconds a client has to send the request body once its headers are "
                        "in; then 408 and close; 0: off. Never applies to the response, so "
                        "long streams are not cut (default %(default)s)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="close an idle keep-alive connection after this many seconds "
                        "(uvicorn's flag; default %(default)s)")
    s.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="most open connections; one opened beyond it gets a 503 for its "
                        "request (uvicorn's flag; default %(default)s)")


def _timeout(text: str) -> float | None:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text}")
    return value or None


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


def build_engine(config: EngineConfig) -> LLMEngine:
    from chunkserve.engine.llm_engine import LLMEngine  # torch: not for `--help`

    import torch

    engine = LLMEngine.from_config(config)
    engine.commit_kv_memory()  # RSS is flat from the start, not creeping up to it while serving
    log.info("the engine steps in this process: %d compute thread(s) on CPU(s) %s",
             torch.get_num_threads(), ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    return engine


def _build_engines(config: EngineConfig, profiler_dir: str | None,
                   own_process: bool) -> list[EngineClient]:
    """One engine built on the thread its loop will run on (one OpenMP pool:
    engine/compute_thread.py), or --data-parallel-size engine processes (one, with
    VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's arrangement, the engine off the server's thread)."""
    if config.parallel_config.data_parallel_size > 1 or own_process:
        from chunkserve.frontend.engines import start_engines

        return start_engines(config, profiler_dir=profiler_dir)
    from chunkserve.frontend.engine_client import InProcessClient

    compute = ComputeThread()
    return [InProcessClient(compute.call(lambda: build_engine(config)), compute,
                            profiler_dir=profiler_dir)]


def _engine_process() -> bool:
    value = os.environ.get(MULTIPROCESSING_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESSING_ENV}={value!r}: 0 (the engine in this process) or "
                         "1 (in a process of its own)")
    return value == "1"


def _run_headless(config: EngineConfig, profiler_dir: str | None) -> int:
    """Node k > 0: its share of the data-parallel engines, or of one engine's ranks."""
    if config.parallel_config.data_parallel_size > 1:
        from chunkserve.engine.dp_headless import run_dp_headless

        return run_dp_headless(config, profiler_dir)
    from chunkserve.engine.tp.headless import run_headless

    return run_headless(config)


def run_server(args: argparse.Namespace) -> int:
    """`serve`: the flags read once, into the server's settings and the engine's config
    (each checked: a ValueError is the CLI's one-line error), then nothing reads `args`."""
    if args.model_tag is not None:
        args.model = args.model_tag
    server_config = ServerConfig.from_args(args)
    config = config_from_args(args)  # checked: its errors come before any connection or load
    if config.parallel_config.node_rank > 0:  # a secondary node: no HTTP server
        return _run_headless(config, server_config.profiler_dir)
    own_process = _engine_process()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    configure_allocator()  # before the engine's and the tokenizer's threads allocate (serve/http/heap.py)
    engines = _build_engines(config, server_config.profiler_dir, own_process)
    return _serve(server_config, engines, config.model_config.model)


def _serve(sc: ServerConfig, engines: list[EngineClient], model: str) -> int:
    """Runs the app over `engines` until SIGTERM/SIGINT or a dead engine; exits the process."""
    from chunkserve.serve.app import begin_shutdown, build_app

    name = sc.served_model_name or model
    app = build_app(engines, name, sc.api_key, sc.max_waiting_requests,
                    metrics_require_key=sc.metrics_require_key,
                    enable_dev_endpoints=sc.enable_dev_endpoints,
                    tool_call_parser=sc.auto_tool_parser, profiler_dir=sc.profiler_dir,
                    web_ui=sc.web_ui)
    limits = sc.connection_limits(on_reject=app.state.metrics.count_rejected)
    _raise_open_files_limit(limits.limit_concurrency)
    config = uvicorn.Config(
        app, host=sc.host, port=sc.port, log_level=sc.uvicorn_log_level,
        http=protocol_class(limits), timeout_keep_alive=sc.timeout_keep_alive,  # type: ignore[arg-type]
        # uvicorn cancels what still runs at the deadline: only a backstop, since every
        # response has ended by then (a cancelled stream would end without its final event).
        timeout_graceful_shutdown=sc.shutdown_timeout,
    )
    abort_after = max(0.0, sc.shutdown_timeout - STOP_RESERVE_S)
    server = _Server(config, lambda: begin_shutdown(app, abort_after))
    # An engine that dies (a tensor-parallel worker or an engine process exited) stops the
    # server: uvicorn's loop polls should_exit, so setting it from any thread is enough.
    app.state.async_engine.on_fatal = lambda: setattr(server, "should_exit", True)
    log.info("serving %s as %r on http://%s:%d", model, name, sc.host, sc.port)
    asyncio.run(server.serve())
    if not server.started:  # e.g. the port is taken; uvicorn has logged why
        return UVICORN_STARTUP_FAILURE
    status = 1 if app.state.async_engine.error is not None else 0
    # Everything is stopped and closed. Skip the interpreter's teardown: unloading torch's
    # modules takes ~1 s of CPU here, time that the --shutdown-timeout deadline would count.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _raise_open_files_limit(limit_concurrency: int | None) -> None:
    """Lifts the soft descriptor limit towards the hard one, as vLLM does at startup: each
    connection holds a descriptor, and a soft limit of 1,024 (common) is below the cap."""
    import resource

    wanted = (limit_concurrency or 0) + 256  # the model files, the engine, the listening socket
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < wanted:
            log.warning("open-file limit %d is below --limit-concurrency %s + 256: connections "
                        "may fail with 'too many open files' first", target, limit_concurrency)
