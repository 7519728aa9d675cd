"""The API server's own settings (vLLM's FrontendArgs): every `serve` flag that is not the
engine's, read from the command line once and checked there, so that nothing past the
launcher's first lines reads `args`. The engine's flags are chunkserve/config.py's EngineConfig
(engine/arg_utils.py); field names here match the flags."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from chunkserve.serve.http.h11_protocol import ConnectionLimits
from chunkserve.serve.openai.tools.parsers import TOOL_CALL_PARSERS

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM's; --profiler-dir wins over it


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_require_key: bool = False
    enable_dev_endpoints: bool = False
    # --profiler-dir, else $VLLM_TORCH_PROFILER_DIR, checked and created; None: profiling off.
    profiler_dir: str | None = None
    web_ui: bool = True
    served_model_name: str | None = None  # None: the model's name
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 5.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    header_timeout: float | None = 10.0  # None: off
    body_timeout: float | None = 60.0
    timeout_keep_alive: float = 5.0
    limit_concurrency: int | None = 1024
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("--max-waiting-requests must be at least 1")
        if not self.shutdown_timeout >= 0:
            raise ValueError("--shutdown-timeout must be non-negative")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError("--limit-concurrency must be at least 1")
        if not self.timeout_keep_alive > 0:
            raise ValueError("--timeout-keep-alive must be positive")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser "
                             f"(one of {', '.join(sorted(TOOL_CALL_PARSERS))})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The checked settings of `serve`'s flags (ValueError: the CLI prints it)."""
        names = [f for f in cls.__dataclass_fields__ if f != "profiler_dir"]
        return cls(**{n: getattr(args, n) for n in names},
                   profiler_dir=_profiler_dir(args.profiler_dir))

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser that reads tool_choice "auto"'s calls; None refuses "auto"."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def connection_limits(self, on_reject: Callable[[str], None] | None) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout, self.body_timeout, self.limit_concurrency,
                                on_reject=on_reject)


def _profiler_dir(flag: str | None) -> str | None:
    """--profiler-dir, else $VLLM_TORCH_PROFILER_DIR, checked (and created) before any model
    loads; None when neither is set."""
    from chunkserve.engine.profiler import check_profiler_dir  # torch: not for `--help`

    if flag:
        return check_profiler_dir(flag, "--profiler-dir")
    env = os.environ.get(PROFILER_DIR_ENV)
    return check_profiler_dir(env, PROFILER_DIR_ENV) if env else None
