"""How the front end (frontend/async_engine.py) reaches one engine loop (engine/engine_loop.py).

`InProcessClient` runs the loop on the server's compute thread and hands its events over
directly; `frontend/core_client.py`'s `CoreClient` reaches one in another process, on this host
or another (`--data-parallel-size`, `--nnodes`). The front end holds a list of clients and
never asks which kind.
"""
from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from chunkserve.engine.processor import Processor
from chunkserve.engine.wire import EngineInfoSpec
from chunkserve.engine.profiler import engine_profiler
from chunkserve.engine.compute_thread import ComputeThread
from chunkserve.engine.engine_loop import STOP, EngineLoop, LoopEvent

if TYPE_CHECKING:
    from chunkserve.engine.llm_engine import LLMEngine

EventHandler = Callable[[int, LoopEvent], None]  # (engine index, event), on any thread


@dataclass(frozen=True)
class EngineInfo:
    """What the API server needs of an engine it may not hold (sent once at start as an
    EngineInfoSpec, engine/wire.py)."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str
    processor: Processor  # validates requests on the HTTP side, tokenizer included

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls.from_spec(EngineInfoSpec.of(engine, with_processor=False), engine.processor)

    @classmethod
    def from_spec(cls, spec: EngineInfoSpec, processor: Processor | None = None) -> EngineInfo:
        """`processor`: the engine's own, where it is in this process; else built from the
        spec's (its tokenizer from tokenizer.json)."""
        if processor is None:
            assert spec.processor is not None, "an engine of another process sends its own"
            processor = Processor.from_spec(spec.processor)
        return cls(spec.model, spec.max_model_len, spec.num_kv_blocks, spec.block_size,
                   spec.kv_cache_dtype, processor)


class EngineClient(Protocol):
    index: int
    info: EngineInfo

    def start(self, handle: EventHandler) -> None:
        """Starts the loop; each of its events goes to `handle(index, event)`."""
        ...

    def send(self, command: object) -> None:
        """Queues a command (engine/engine_loop.py) for the loop, in order."""
        ...

    def is_alive(self) -> bool: ...

    def shutdown(self, timeout: float) -> None:
        """Stops the loop (its requests fail) and releases the engine; idempotent."""
        ...


class InProcessClient:
    def __init__(self, engine: LLMEngine, compute: ComputeThread | None = None,
                 index: int = 0, profiler_dir: str | None = None) -> None:
        """`compute`: the thread that built `engine` (the loop then runs there too: one OpenMP
        pool, engine/compute_thread.py); a thread of its own when None. `profiler_dir`: where
        /stop_profile writes its traces (None: profiling is off)."""
        self.engine = engine
        self.index = index
        self.profiler_dir = profiler_dir
        self.info = EngineInfo.of(engine)
        self._compute = compute or ComputeThread()
        self._commands: queue.Queue[object] = queue.Queue()
        self._running: concurrent.futures.Future[None] | None = None

    def start(self, handle: EventHandler) -> None:
        loop = EngineLoop(self.engine, self._commands, lambda ev: handle(self.index, ev),
                          engine_profiler(self.profiler_dir, self.index))
        self._running = self._compute.start(loop.run)

    def send(self, command: object) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def shutdown(self, timeout: float) -> None:
        if self._running is None:
            return
        self._commands.put(STOP)
        concurrent.futures.wait([self._running], timeout)
        self._running = None
        self._compute.shutdown()
        self.engine.close()
