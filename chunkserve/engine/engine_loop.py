"""The engine side of the server: one `LLMEngine` stepped in a loop, fed commands, emitting events.

The loop knows nothing of asyncio, HTTP or where it runs. In one process it runs on the
compute thread (engine/compute_thread.py) and its events are handled right there; under
`--data-parallel-size N` each engine process runs one (engine/core_proc.py) and its events
cross a ZeroMQ socket to the API server (engine/wire.py). Either way the front end
(frontend/async_engine.py) sees the same `LoopEvent`s, so there is one loop and one handler.

Commands and events are msgspec Structs, typed all the way: what crosses a process or a
machine is encoded and decoded as exactly these types, never pickled. An error travels as a
`LoopError` (its kind, message and HTTP status) and becomes the front end's exception there.

Commands arrive in order on one queue, so an abort always follows its request's add: a request
aborted before the engine applied it is added and dropped in the same drain.
"""
from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from typing import Protocol

import msgspec

from chunkserve.engine.executor import FatalExecutorError
from chunkserve.engine.llm_engine import EngineStats, LLMEngine, StepError
from chunkserve.engine.processor import EngineRequest
from chunkserve.engine.profiler import ProfilerStateError, StepProfiler
from chunkserve.engine.trace import StepRecord
from chunkserve.outputs import RequestOutput

log = logging.getLogger("chunkserve.engine")
IDLE_WAIT_S = 0.5  # an idle loop wakes this often (a stop is a command, so this is only a bound)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; the engine itself carries on. `status`:
    400 where the request's own input caused it, else 500."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class ShuttingDownError(EngineDeadError):
    """The server is stopping and its grace period for in-flight requests is over."""


# An error's kind on the wire, and the exception it is on either side. Order matters for
# `LoopError.of`: a subclass before its base.
_KINDS: tuple[tuple[str, type[Exception]], ...] = (
    ("shutting_down", ShuttingDownError),
    ("engine_dead", EngineDeadError),
    ("request_failed", RequestFailedError),
    ("profiler_state", ProfilerStateError),
    ("invalid", ValueError),
    ("runtime", RuntimeError),
)


class LoopError(msgspec.Struct, frozen=True):
    """An error that ends one request or refuses one command, as the loop reports it."""

    kind: str  # one of _KINDS
    message: str
    status: int = 500

    @classmethod
    def of(cls, error: BaseException) -> LoopError:
        status = getattr(error, "status", 500)
        for kind, exc_type in _KINDS:
            if isinstance(error, exc_type):
                return cls(kind, str(error), status)
        return cls("runtime", f"{type(error).__name__}: {error}", status)

    def exception(self) -> Exception:
        exc_type = dict(_KINDS).get(self.kind, RuntimeError)
        if exc_type is RequestFailedError:
            return RequestFailedError(self.message, self.status)
        return exc_type(self.message)


# ---- commands (front end -> loop) ---------------------------------------------------------------
class Add(msgspec.Struct, frozen=True, tag=True):
    request: EngineRequest


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class FailAll(msgspec.Struct, frozen=True, tag=True):
    reason: str


class ResetPrefixCache(msgspec.Struct, frozen=True, tag=True):
    token: int  # echoed in the event that answers it


class StartProfile(msgspec.Struct, frozen=True, tag=True):
    token: int  # echoed in the event that answers it


class StopProfile(msgspec.Struct, frozen=True, tag=True):
    token: int


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Ends the loop; the requests it still holds fail with `reason` (a headless node shut
    down: engine/dp_headless.py; else STOP's)."""

    reason: str


STOP = Stop("the server is shutting down")
Command = Add | Abort | FailAll | ResetPrefixCache | StartProfile | StopProfile | Stop


# ---- events (loop -> front end) -----------------------------------------------------------------
class LoopEvent(msgspec.Struct):
    """What one pass of the loop did, in the order the front end must apply it: outputs, then
    errors (an error ends its request, so it comes after any output of the same pass)."""

    # (request id, its output, output tokens new since its last output)
    outputs: list[tuple[str, RequestOutput, int]] = msgspec.field(default_factory=list)
    errors: list[tuple[str, LoopError]] = msgspec.field(default_factory=list)  # (id, why)
    record: StepRecord | None = None  # the step run, if any
    # Requests aborted without a final output (vllm:request_success "abort"): by id, so that
    # whoever keeps per-request state across events (engine/output_tails.py) can let it go.
    aborted: list[str] = msgspec.field(default_factory=list)
    num_applied: int = 0  # adds applied so far (the front end counts the ones it sent)
    stats: EngineStats | None = None  # the engine's state after this pass
    reset_answers: list[tuple[int, int]] = msgspec.field(default_factory=list)  # (token, result)
    # (token, None when done or the error refusing it)
    profile_answers: list[tuple[int, LoopError | None]] = msgspec.field(default_factory=list)
    fatal: str | None = None  # the loop died: every request it held was failed above


class CommandQueue(Protocol):
    """queue.Queue in one process; a socket's reader across processes (engine/core_proc.py)."""

    def get(self, block: bool = True, timeout: float | None = None) -> object: ...

    def get_nowait(self) -> object: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, commands: CommandQueue,
                 emit: Callable[[LoopEvent], None],
                 profiler: StepProfiler | None = None) -> None:
        """`profiler`: what StartProfile/StopProfile drive (None: profiling is off)."""
        self.engine = engine
        self.commands = commands
        self.emit = emit
        self.profiler = profiler
        self._num_tokens: dict[str, int] = {}  # output tokens already reported, per request
        self._num_applied = 0
        self._refusal: str | None = None  # the FailAll reason: later adds are refused with it
        self._stop_reason = "the server is shutting down"
        self._event = LoopEvent()

    def run(self) -> None:
        """Until STOP: apply commands, step, emit. A loop that dies fails every request."""
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._flush()
        except BaseException as e:  # a dead executor or a bug in the loop: fail everyone
            log.exception("engine loop died")
            # A dead executor's own words (which worker, its exit code), not the StepError
            # wrapping them.
            cause = e.__cause__ if isinstance(e, StepError) and e.__cause__ else e
            reason = (str(cause) if isinstance(cause, FatalExecutorError)
                      else f"the engine loop died: {cause!r}")
            self._fail_all(EngineDeadError(reason))
            self._event.fatal = reason
            self._flush()
            raise
        finally:
            if self.profiler is not None:
                self.profiler.discard()
        self._fail_all(EngineDeadError(self._stop_reason))
        self._flush()

    def _drain_commands(self, block: bool) -> bool:
        """Applies all queued commands; returns False when asked to stop."""
        try:
            cmd = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                self._stop_reason = cmd.reason
                return False
            self._apply(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: object) -> None:
        ev = self._event
        if isinstance(cmd, Add):
            self._num_applied += 1
            rid = cmd.request.request_id
            if self._refusal is not None:  # sent just before FailAll
                ev.errors.append((rid, LoopError.of(ShuttingDownError(self._refusal))))
                return
            try:
                self.engine.add_engine_request(cmd.request)
                self._num_tokens[rid] = 0
            except ValueError as e:
                ev.errors.append((rid, LoopError.of(e)))
        elif isinstance(cmd, Abort):
            if self._num_tokens.pop(cmd.request_id, None) is not None:
                self.engine.abort_request(cmd.request_id)
                ev.aborted.append(cmd.request_id)
        elif isinstance(cmd, ResetPrefixCache):
            ev.reset_answers.append((cmd.token, self.engine.reset_prefix_cache()))
        elif isinstance(cmd, (StartProfile, StopProfile)):
            error = self._profile(cmd)
            ev.profile_answers.append((cmd.token, None if error is None else LoopError.of(error)))
        elif isinstance(cmd, FailAll):
            self._refusal = cmd.reason
            self._fail_all(ShuttingDownError(cmd.reason))

    def _profile(self, cmd: StartProfile | StopProfile) -> BaseException | None:
        """Starts or stops the profiler here, on the thread that runs the steps (torch's
        profiler records the operators of the thread that starts it); None when done, else
        the error refusing it."""
        if self.profiler is None:
            return ProfilerStateError("Profiling is not enabled on this engine.")
        try:
            if isinstance(cmd, StartProfile):
                self.profiler.start()
            else:
                self.profiler.stop()
        except ProfilerStateError as e:
            return e
        except Exception as e:  # noqa: BLE001 - a failed profile must not stop the engine
            log.exception("the profiler failed")
            return RuntimeError(f"the profiler failed: {e}")
        return None

    def _step(self) -> None:
        ev = self._event
        step_scope = (self.profiler.step() if self.profiler is not None
                      else contextlib.nullcontext())
        try:
            with step_scope:
                result = self.engine.step()
        except StepError as e:
            # Contain a failure to the requests of the failed step: fail and drop them, keep
            # serving the rest. fail_step raises when no step can run any more (a dead
            # executor) or the engine is unsound: then the loop dies (run's handler).
            log.exception("engine step failed")
            for out in self.engine.fail_step(e):
                self._num_tokens.pop(out.request_id, None)
                ev.outputs.append((out.request_id, out, 0))
            return
        ev.record = result.record
        for out in result.outputs:
            n = len(out.outputs[0].token_ids)
            new = n - self._num_tokens.get(out.request_id, 0)
            self._num_tokens[out.request_id] = n
            if out.finished:
                self._num_tokens.pop(out.request_id, None)
            ev.outputs.append((out.request_id, out, new))

    def _fail_all(self, error: BaseException) -> None:
        """Aborts every request the engine holds; each consumer gets the error."""
        ids = list(self._num_tokens)
        if ids:
            try:
                self.engine.abort_request(ids)
            except Exception:  # noqa: BLE001 - the requests fail below either way
                log.exception("aborting the engine's requests failed")
        wire = LoopError.of(error)
        for rid in ids:
            self._event.errors.append((rid, wire))
        self._event.aborted.extend(ids)
        self._num_tokens.clear()

    def _flush(self) -> None:
        """Emits what this pass did, with the engine's state after it."""
        ev, self._event = self._event, LoopEvent()
        ev.num_applied = self._num_applied
        ev.stats = self.engine.stats()
        self.emit(ev)
