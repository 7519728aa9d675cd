"""What node 0 publishes in its TCPStore for the headless nodes of `serve -dp N --nnodes M`, and
how they read it: rendezvous metadata only (the engine config as JSON, where node 0's sockets
listen, each node's beat counter). Commands and events go over ZeroMQ (engine/channel.py);
the secret is never published: every node is given it (CHUNKSERVE_SECRET)."""
from __future__ import annotations

import msgspec
import torch.distributed as dist

from chunkserve.config import EngineConfig
from chunkserve.procs.rendezvous import StoreLostError

CONFIG_KEY = "dp/config"  # node 0's EngineConfig, msgspec JSON
COMMANDS_KEY = "dp/commands"  # node 0's ROUTER: tcp://host:port
EVENTS_KEY = "dp/events"  # node 0's PULL


def beat_key(node: int) -> str:
    """A counter the node adds to every second while it lives (frontend/remote_engines.py)."""
    return f"dp/node{node}/beat"


def joined_key(node: int) -> str:
    return f"dp/node{node}/joined"


def publish(store: dist.TCPStore, config: EngineConfig, commands: str, events: str) -> None:
    store.set(COMMANDS_KEY, commands)
    store.set(EVENTS_KEY, events)
    store.set(CONFIG_KEY, msgspec.json.encode(config.portable()))  # last: a node reading it finds the rest


def read_published(store: dist.TCPStore, where: str) -> tuple[EngineConfig, str, str]:
    """Node 0's config and socket addresses; StoreLostError when it published none."""
    try:
        config = msgspec.json.decode(store.get(CONFIG_KEY), type=EngineConfig)
        return config, store.get(COMMANDS_KEY).decode(), store.get(EVENTS_KEY).decode()
    except RuntimeError as e:
        raise StoreLostError(f"node 0 at {where} published no data-parallel engine config: is "
                             f"it started with --data-parallel-size? ({e})") from e
