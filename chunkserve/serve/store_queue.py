"""A one-way queue of Python objects through node 0's torch.distributed `TCPStore`: how the API
server and the data-parallel engines of other nodes talk (issue 30, part 3).

The store's own queues (`queue_push` / `queue_pop`) carry pickles, so an engine on another
machine reads the same commands and sends the same `LoopEvent`s as one behind a
torch.multiprocessing queue (serve/engine_proc.py): the engine loop never knows which. A
`StoreQueue` is picklable (an address and a key); each process connects on first use. Its
reader blocks on its own connection, on a thread that fills a local buffer, so `get` takes
a timeout as `queue.Queue.get` does without the store's timeout logging a warning on every
idle wake-up.
"""
from __future__ import annotations

import pickle
import queue
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chunkserve.engine.tp_group import IDLE_WAIT, TIMEOUT
from chunkserve.engine.tp_worker import first_line

# The data-parallel keys in node 0's store, one place for the server and the headless nodes.
CONFIG_KEY = "dp/config"  # node 0's pickled EngineConfig


def commands_key(engine: int) -> str:
    return f"dp/engine{engine}/commands"


def events_key(engine: int) -> str:
    return f"dp/engine{engine}/events"


def beat_key(node: int) -> str:
    """A counter the node adds to every second while it lives (serve/dp_remote.py)."""
    return f"dp/node{node}/beat"


_CLOSE = "chunkserve.store_queue.close"  # wakes and ends this process's reader


class StoreLostError(ConnectionError):
    """Node 0's store stopped answering: the other end of every queue is gone."""


def connect(host: str, port: int, timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    """A client connection to node 0's store; waits up to `timeout` for it to listen."""
    try:
        return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as e:  # DistNetworkError / DistStoreError
        raise StoreLostError(f"node 0 at {host}:{port} did not answer within "
                             f"{timeout.total_seconds():.0f} s: {first_line(e)}") from e


class StoreQueue:
    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port, self.key = host, port, key
        self._lock = threading.Lock()
        self._writer: dist.TCPStore | None = None
        self._buffer: queue.Queue[Any] | None = None  # filled by the reader thread
        self._reader: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "key": self.key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["host"], state["port"], state["key"])  # type: ignore[misc]

    def put(self, obj: object) -> None:
        """Queues `obj`; raises StoreLostError when node 0's store is gone."""
        data = pickle.dumps(obj)
        with self._lock:
            try:
                if self._writer is None:
                    self._writer = connect(self.host, self.port)
                self._writer.queue_push(self.key, data)
            except RuntimeError as e:
                raise StoreLostError(f"node 0's store is gone: {first_line(e)}") from e

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        """The next object, as queue.Queue.get (queue.Empty on a timeout); StoreLostError
        once node 0's store is gone."""
        item = self._start_reader().get(block, timeout)
        if isinstance(item, StoreLostError):
            self._buffer.put(item)  # type: ignore[union-attr] # every later get says so too
            raise item
        return item

    def get_nowait(self) -> object:
        return self.get(block=False)

    def close(self) -> None:
        """Ends this process's reader (it may be blocked waiting for the next object)."""
        if self._reader is not None and self._reader.is_alive():
            try:
                self.put(_CLOSE)
            except StoreLostError:
                pass  # the reader has ended on the same loss
            self._reader.join(timeout=1.0)

    def _start_reader(self) -> queue.Queue[Any]:
        with self._lock:
            if self._buffer is None:
                self._buffer = queue.Queue()
                self._reader = threading.Thread(target=self._read, args=(self._buffer,),
                                                daemon=True, name=f"store-queue {self.key}")
                self._reader.start()
            return self._buffer

    def _read(self, buffer: queue.Queue[Any]) -> None:
        try:
            store = connect(self.host, self.port)
            store.set_timeout(IDLE_WAIT)  # the next object may be days away
            while (item := pickle.loads(store.queue_pop(self.key))) != _CLOSE:
                buffer.put(item)
        except StoreLostError as e:
            buffer.put(e)
        except RuntimeError as e:
            buffer.put(StoreLostError(f"node 0's store is gone: {first_line(e)}"))
