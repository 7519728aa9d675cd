"""The front end's client of engines in other processes, reached over ZeroMQ as vLLM V1's core
client reaches its engine cores (issue 52).

`--data-parallel-size N` starts N engine processes (engine/core_proc.py); with `--nnodes` the
other nodes' headless launches start theirs (engine/dp_headless.py, frontend/remote_engines.py).
All of them connect to the one `EngineHub` here: a ROUTER that sends each its commands and a
PULL that takes every engine's messages (engine/wire.py), on ipc:// sockets for this host's
engines and tcp:// for other nodes', all under CURVE keyed from one secret
(engine/channel.py). One reader thread takes every message and hands it to that engine's
`CoreClient`, the front end's EngineClient (frontend/engine_client.py) for it.

An engine that exits unasked (its process here, or its node's report, or a node gone silent)
is reported to the front end as dead: its requests fail and the server stops.
"""
from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import threading
import time
from typing import Protocol

import msgspec
import torch.multiprocessing as mp
import zmq

from chunkserve.engine import wire
from chunkserve.engine.channel import Guard, Keys, server_socket
from chunkserve.engine.core_proc import Endpoints, routing_id
from chunkserve.engine.engine_loop import STOP, LoopEvent
from chunkserve.engine.output_tails import OutputReceiver
from chunkserve.frontend.engine_client import EngineInfo, EventHandler
from chunkserve.procs.lifecycle import JOIN_TIMEOUT_S, POLL_S, join_then_kill

log = logging.getLogger("chunkserve.server")
SEND_RETRY_S = 1.0  # a command to an engine whose connection is not up yet is retried this long


class EngineHub:
    """The server's sockets for every engine in another process, and their one reader."""

    def __init__(self, secret: bytes, tcp: bool = False) -> None:
        """`tcp`: also listen on tcp:// (every interface, free ports) for other nodes."""
        keys = Keys.of(secret)
        self.ctx = zmq.Context()
        self._guard = Guard(self.ctx, keys)  # before any bind: it vets every handshake
        self._dir = tempfile.mkdtemp(prefix="chunkserve-")  # 0700: this user's engines only
        self._commands = server_socket(self.ctx, zmq.ROUTER, keys)
        self._commands.router_mandatory = True  # an unknown engine is an error, not a drop
        self._events = server_socket(self.ctx, zmq.PULL, keys)
        self.local = Endpoints(f"ipc://{self._dir}/commands", f"ipc://{self._dir}/events", secret)
        self._commands.bind(self.local.commands)
        self._events.bind(self.local.events)
        self.remote_ports: tuple[int, int] | None = None
        if tcp:
            self.remote_ports = (self._commands.bind_to_random_port("tcp://*"),
                                 self._events.bind_to_random_port("tcp://*"))
        self._guard.watch(self._commands, "commands")
        self._guard.watch(self._events, "events")
        self._send_lock = threading.Lock()
        self._clients: dict[int, CoreClient] = {}
        self._open = 0
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True, name="engine-events")
        self._reader.start()

    def attach(self, client: CoreClient) -> None:
        self._clients[client.index] = client
        self._open += 1

    def send(self, index: int, command: object) -> None:
        """Sends engine `index` a command; retried briefly while its connection comes up."""
        frames = wire.command_frames(command)
        deadline = time.monotonic() + SEND_RETRY_S
        with self._send_lock:
            while True:
                try:
                    self._commands.send_multipart([routing_id(index), *frames])
                    return
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH or time.monotonic() > deadline:
                        log.warning("engine %d is unreachable: a command was dropped", index)
                        return
                    time.sleep(0.001)

    def release(self) -> None:
        """A client has shut down; the last one closes the sockets."""
        self._open -= 1
        if self._open <= 0:
            self.close()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._reader.join(timeout=2.0)
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._guard.close()
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _read(self) -> None:
        """Every engine's messages, to their clients; between them, the local processes'
        liveness (an exit is reported once what it sent before has been read)."""
        next_check = 0.0
        while not self._stop.is_set():
            if self._events.poll(int(POLL_S * 1000)):
                self._dispatch(self._events.recv_multipart())
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + POLL_S
            for client in list(self._clients.values()):
                if client.process_exited():
                    while self._events.poll(50):  # its last words first
                        self._dispatch(self._events.recv_multipart())
                    client.on_message(client.exit_report())

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode_message(frames[0])
        except msgspec.DecodeError as e:
            log.error("dropped a malformed engine message (%d bytes): %s", len(frames[0]), e)
            return
        client = self._clients.get(msg.index)
        if client is None:
            log.error("dropped a message from engine %d, which this server does not run",
                      msg.index)
            return
        client.on_message(msg, frames)


class Watch(Protocol):
    """What watches a remote engine's node (frontend/remote_engines.py's NodeWatch)."""

    def release(self) -> None: ...


class CoreClient:
    """An engine in another process, on this host (`process`) or another node (None: its
    node's launch reports its exit; frontend/remote_engines.py watches the node)."""

    def __init__(self, hub: EngineHub, index: int, process: mp.Process | None = None,
                 node: int | None = None) -> None:
        self.index = index
        self.node = node
        self.process = process
        self.info: EngineInfo  # set by wait_ready
        self.watch: Watch | None = None  # released at shutdown (frontend/remote_engines.py)
        self._hub = hub
        self._where = "" if node is None else f" (node {node})"
        self._lock = threading.RLock()
        self._ready = threading.Event()
        self._start_error: str | None = None
        self._handle: EventHandler | None = None
        self._pending: list[LoopEvent] = []  # events before start()
        self._exited = threading.Event()
        self._stopping = False
        self._fatal_seen = False
        self._outputs = OutputReceiver()  # its outputs' lists so far (engine/output_tails.py)
        hub.attach(self)

    # ---- the front end's EngineClient ---------------------------------------------------------
    def wait_ready(self, timeout: float) -> EngineInfo:
        """Blocks until the engine has loaded; a ValueError with its reason if it could not
        (the CLI prints it, no traceback)."""
        if not self._ready.wait(timeout):
            raise ValueError(f"engine {self.index}{self._where} did not load within "
                             f"{timeout:g} s")
        if self._start_error is not None:
            raise ValueError(self._start_error)
        return self.info

    def start(self, handle: EventHandler) -> None:
        with self._lock:
            self._handle = handle
            for ev in self._pending:
                handle(self.index, ev)
            self._pending.clear()

    def send(self, command: object) -> None:
        if not self._exited.is_set():
            self._hub.send(self.index, command)

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def shutdown(self, timeout: float) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        if not self._exited.is_set():
            self.send(STOP)
        wait = min(timeout, JOIN_TIMEOUT_S)
        if self.process is not None:
            join_then_kill([self.process], wait)
            self._exited.set()
        else:
            self._exited.wait(wait)  # its node reports the exit
        if self.watch is not None:
            self.watch.release()
        self._hub.release()

    # ---- from the hub's reader (or the node watch) -------------------------------------------
    def report(self, exited: wire.Exited) -> None:
        """`exited` as if the engine's node had sent it (the node watch: the node is gone)."""
        self.on_message(exited)

    def process_exited(self) -> bool:
        p = self.process
        return p is not None and p.exitcode is not None and not self._exited.is_set()

    def exit_report(self) -> wire.Exited:
        code = self.process.exitcode if self.process is not None else None
        return wire.Exited(self.index, code, f"its process exited with code {code}")

    def on_message(self, msg: wire.EngineMessage, frames: list[bytes] | None = None) -> None:
        """`frames`: the message's frames as received (an Event's ids ride in the second)."""
        with self._lock:
            if isinstance(msg, wire.Event):
                if self._exited.is_set():
                    return
                try:
                    ev = wire.restore_event(msg, frames or [], self._outputs)
                except ValueError as e:
                    log.error("dropped a malformed event of engine %d: %s", self.index, e)
                    return
                self._fatal_seen = self._fatal_seen or ev.fatal is not None
                self._deliver(ev)
            elif isinstance(msg, wire.Ready):
                self.info = EngineInfo.from_spec(msg.info)
                self._ready.set()
            elif isinstance(msg, wire.StartFailed):
                self._start_error = f"engine {self.index}{self._where} failed to start: {msg.why}"
                self._ready.set()
            elif isinstance(msg, wire.Exited):
                self._on_exit(msg)

    def _on_exit(self, msg: wire.Exited) -> None:
        if self._exited.is_set():
            return
        self._exited.set()
        was_ready = self._ready.is_set()
        if not was_ready:
            self._start_error = (
                f"engine {self.index} exited with code {msg.code} while loading"
                if self.process is not None else
                f"engine {self.index}{self._where} could not start: {msg.why}")
            self._ready.set()
        if (was_ready or self._handle is not None) and not self._stopping \
                and not self._fatal_seen:
            self._deliver(LoopEvent(fatal=msg.why))

    def _deliver(self, ev: LoopEvent) -> None:
        if self._handle is None:
            self._pending.append(ev)
        else:
            self._handle(self.index, ev)
