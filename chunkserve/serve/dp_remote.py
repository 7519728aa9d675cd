"""Node 0's side of data-parallel engines on other nodes (`serve -dp N --nnodes M`; issue 30).

The API server hosts a torch.distributed `TCPStore` on --master-port and publishes its engine
config there. Each other node's headless launch (serve/dp_headless.py) reads it, starts its
share of the engines, and adds to a beat counter every BEAT_S. An engine there reads its
commands from, and sends its events to, queues in this store (serve/store_queue.py), so the
front end holds a `RemoteEngineClient` for it exactly as it holds an `EngineProcessClient`
for an engine here (serve/engine_proc.py).

When an engine of another node ends, its launch says so (`EngineExited`, with the exit code);
when a whole node goes (its launch killed, the machine or the network lost), its counter stops,
and `NodeWatch` says so for each of its engines after NODE_SILENT_S. Either way the front end
sees the engine die as it would a local one: its requests fail and the server stops.
"""
from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from chunkserve.config import EngineConfig
from chunkserve.engine.tp_group import TIMEOUT, TPGroup
from chunkserve.engine.tp_worker import first_line
from chunkserve.serve.engine_client import JOIN_TIMEOUT_S, EngineInfo, EventHandler
from chunkserve.serve.engine_loop import STOP, LoopEvent
from chunkserve.serve.store_queue import (
    CONFIG_KEY, StoreLostError, StoreQueue, beat_key, commands_key, events_key,
)

log = logging.getLogger("chunkserve.server")
BEAT_S = 1.0  # how often a headless node adds to its beat counter
NODE_SILENT_S = 10.0  # a node whose counter stands still this long is gone


@dataclass(frozen=True)
class EngineExited:
    """An engine of another node has ended: its launch's report (`code`, its exit status), or
    node 0's when the whole node went silent (`code` None). `why` is the reason the front end
    gives: "engine K died: <why>"."""

    code: int | None
    why: str


class RemoteEngineClient:
    """An engine process of another node, as the front end's EngineClient
    (serve/engine_client.py)."""

    def __init__(self, index: int, node: int, host: str, port: int) -> None:
        self.index = index
        self.node = node
        self._commands = StoreQueue(host, port, commands_key(index))
        self._events = StoreQueue(host, port, events_key(index))
        self._stopping = False
        self._exited = threading.Event()
        self._receiver: threading.Thread | None = None
        self.watch: NodeWatch | None = None  # released when this client shuts down
        self.info: EngineInfo  # set by wait_ready

    def wait_ready(self, timeout: float) -> EngineInfo:
        """Blocks until the engine has loaded on its node; a ValueError with the reason when
        it could not (the CLI prints it, no traceback)."""
        try:
            msg = self._events.get(timeout=timeout)
        except queue.Empty:
            raise ValueError(f"engine {self.index} (node {self.node}) did not load within "
                             f"{timeout:g} s") from None
        if isinstance(msg, EngineExited):
            self._exited.set()
            raise ValueError(f"engine {self.index} (node {self.node}) could not start: "
                             f"{msg.why}")
        kind, payload = msg  # type: ignore[misc]
        if kind == "error":
            raise ValueError(f"engine {self.index} (node {self.node}) failed to start: "
                             f"{payload}")
        self.info = payload
        return payload

    def start(self, handle: EventHandler) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(handle,), daemon=True,
                                          name=f"engine-{self.index}-events")
        self._receiver.start()

    def send(self, command: object) -> None:
        try:
            self._commands.put(command)
        except StoreLostError:
            pass  # node 0 hosts the store: only when this process is on its way out

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def report(self, exited: EngineExited) -> None:
        """Queues `exited` as if the engine's node had sent it (NodeWatch: the node is gone)."""
        self._events.put(exited)

    def shutdown(self, timeout: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        if not self._exited.is_set():
            self.send(STOP)
            if self._receiver is not None:  # it sets _exited when the node reports the exit
                self._exited.wait(min(timeout, JOIN_TIMEOUT_S))
        self._events.close()  # no thread may be left blocked in the store at exit: it aborts
        if self._receiver is not None:
            self._receiver.join(timeout)
        if self.watch is not None:
            self.watch.release()

    def _receive(self, handle: EventHandler) -> None:
        """Forwards the loop's events until its node reports the engine's exit; an exit
        nobody asked for is reported as the engine's death."""
        fatal_seen = False
        while True:
            try:
                ev = self._events.get()
            except StoreLostError as e:
                ev = EngineExited(None, f"lost node 0's store: {e}")
            if isinstance(ev, LoopEvent):
                fatal_seen = fatal_seen or ev.fatal is not None
                handle(self.index, ev)
            elif isinstance(ev, EngineExited):
                self._exited.set()
                if not self._stopping and not fatal_seen:
                    handle(self.index, LoopEvent(fatal=ev.why))
                return


class NodeWatch:
    """Reports each other node's engines dead once its beat counter stands still for
    NODE_SILENT_S, or has not started within the join timeout (TIMEOUT)."""

    def __init__(self, store: dist.TCPStore, clients: list[RemoteEngineClient],
                 join_hint: str) -> None:
        self._store = store  # node 0's store itself: it lives as long as this watch
        self._nodes: dict[int, list[RemoteEngineClient]] = {}
        for client in clients:
            self._nodes.setdefault(client.node, []).append(client)
        self._join_hint = join_hint
        self._open = len(clients)  # clients not yet shut down
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for client in clients:
            client.watch = self
        self._thread = threading.Thread(target=self._run, daemon=True, name="dp-node-watch")
        self._thread.start()

    def release(self) -> None:
        """A client has shut down; the last one stops the watch and closes the store."""
        with self._lock:
            self._open -= 1
            if self._open:
                return
        self._stop.set()
        self._thread.join()
        del self._store

    def _run(self) -> None:
        started = time.monotonic()
        last = {node: (0, started) for node in self._nodes}  # (count, when it last moved)
        while last and not self._stop.wait(BEAT_S):
            now = time.monotonic()
            for node in list(last):
                count = self._store.add(beat_key(node), 0)
                if not any(c.is_alive() for c in self._nodes[node]):
                    del last[node]  # its engines have all ended: nothing left to watch
                elif count != last[node][0]:
                    last[node] = (count, now)
                elif count == 0 and now - started > TIMEOUT.total_seconds():
                    self._gone(node, f"node {node} did not join within "
                                     f"{TIMEOUT.total_seconds():g} s: {self._join_hint}")
                    del last[node]
                elif count and now - last[node][1] > NODE_SILENT_S:
                    self._gone(node, f"node {node} stopped answering for "
                                     f"{NODE_SILENT_S:g} s")
                    del last[node]

    def _gone(self, node: int, why: str) -> None:
        log.error("node %d is gone: %s", node, why)
        for client in self._nodes[node]:
            if client.is_alive():
                client.report(EngineExited(None, why))


def serve_other_nodes(config: EngineConfig) -> list[RemoteEngineClient]:
    """Hosts node 0's store on --master-port, publishes `config` there for the headless
    nodes, and returns a client for each of their engines (not yet loaded: `wait_ready`)."""
    pc = config.parallel_config
    try:
        store = TPGroup.host_store(pc.master_addr, None, pc.master_port)  # type: ignore[arg-type]
    except RuntimeError as e:  # DistNetworkError: the port is taken, the address not ours
        raise OSError(f"node 0 cannot listen on {pc.master_addr}:{pc.master_port} "
                      f"(--master-addr, --master-port): {first_line(e)}") from e
    store.set(CONFIG_KEY, pickle.dumps(config))
    per_node = pc.data_parallel_size // pc.nnodes
    clients = [RemoteEngineClient(i, i // per_node, pc.master_addr, pc.master_port)
               for i in range(per_node, pc.data_parallel_size)]
    hint = (f"are the other {pc.nnodes - 1} node(s) started with --data-parallel-size "
            f"{pc.data_parallel_size} --nnodes {pc.nnodes} --master-addr {pc.master_addr} "
            f"--master-port {pc.master_port}?")
    NodeWatch(store, clients, hint)
    return clients
