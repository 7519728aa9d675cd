"""Node 0's side of data-parallel engines on other nodes (`serve -dp N --nnodes M`; issue 30).

The API server hosts a torch.distributed `TCPStore` on --master-port and publishes there its
engine config and where its sockets listen (engine/dp_rendezvous.py). Each other node's
headless launch (engine/dp_headless.py) reads them, starts its share of the engines, and adds
to a beat counter every BEAT_S. Its engines connect to node 0's `EngineHub` over tcp://,
proving the shared secret (engine/channel.py), so the front end holds a `CoreClient` for each
exactly as for an engine here (frontend/core_client.py).

When an engine of another node ends, its launch says so (`Exited`, with the exit code); when
a whole node goes (its launch killed, the machine or the network lost), its counter stops, and
`NodeWatch` says so for each of its engines after NODE_SILENT_S. Either way the front end sees
the engine die as it would a local one: its requests fail and the server stops.
"""
from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from chunkserve.config import EngineConfig
from chunkserve.engine.dp_rendezvous import beat_key, publish
from chunkserve.engine.wire import Exited
from chunkserve.frontend.core_client import CoreClient, EngineHub
from chunkserve.procs.rendezvous import TIMEOUT, first_line, host_store

log = logging.getLogger("chunkserve.server")
BEAT_S = 1.0  # how often a headless node adds to its beat counter
NODE_SILENT_S = 10.0  # a node whose counter stands still this long is gone


class NodeWatch:
    """Reports each other node's engines dead once its beat counter stands still for
    NODE_SILENT_S, or has not started within the join timeout (TIMEOUT)."""

    def __init__(self, store: dist.TCPStore, clients: list[CoreClient],
                 join_hint: str) -> None:
        self._store = store  # node 0's store itself: it lives as long as this watch
        self._nodes: dict[int, list[CoreClient]] = {}
        for client in clients:
            assert client.node is not None
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
                client.report(Exited(client.index, None, why))


def serve_other_nodes(config: EngineConfig, hub: EngineHub) -> list[CoreClient]:
    """Hosts node 0's store on --master-port, publishes `config` and `hub`'s tcp:// addresses
    there for the headless nodes, and returns a client for each of their engines (not yet
    loaded: `wait_ready`)."""
    pc = config.parallel_config
    assert hub.remote_ports is not None, "the hub must listen on tcp://"
    try:
        store = host_store(pc.master_addr, None, pc.master_port)
    except RuntimeError as e:  # DistNetworkError: the port is taken, the address not ours
        raise OSError(f"node 0 cannot listen on {pc.master_addr}:{pc.master_port} "
                      f"(--master-addr, --master-port): {first_line(e)}") from e
    commands, events = (f"tcp://{pc.master_addr}:{port}" for port in hub.remote_ports)
    publish(store, config, commands, events)
    per_node = pc.data_parallel_size // pc.nnodes
    clients = [CoreClient(hub, i, None, i // per_node)
               for i in range(per_node, pc.data_parallel_size)]
    hint = (f"are the other {pc.nnodes - 1} node(s) started with --data-parallel-size "
            f"{pc.data_parallel_size} --nnodes {pc.nnodes} --master-addr {pc.master_addr} "
            f"--master-port {pc.master_port}?")
    NodeWatch(store, clients, hint)
    return clients
