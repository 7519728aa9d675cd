"""torch.distributed's TCPStore, for what it is: a rendezvous of small metadata (where to connect,
a config as JSON, a beat counter). Commands and events never go through it (engine/wire.py),
and nothing read from it is unpickled."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# A store operation that waits longer than this fails instead of hanging.
TIMEOUT = timedelta(seconds=120)


class StoreLostError(ConnectionError):
    """A store stopped answering (or never did): the process hosting it is gone."""


def first_line(e: BaseException) -> str:
    """The first line of an error's message (torch's carry a C++ stack trace after it)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def host_store(host: str, world_size: int | None, port: int = 0) -> dist.TCPStore:
    """A store served from this process, on a free port with 0 (read it back from `.port`).
    It listens on every interface: `host` is only where this process itself connects."""
    return dist.TCPStore(host, port, world_size, True, timeout=TIMEOUT, wait_for_workers=False)


def connect_store(host: str, port: int, timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    """A client of the store at host:port; waits up to `timeout` for it to listen."""
    try:
        return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as e:  # DistNetworkError / DistStoreError
        raise StoreLostError(f"node 0 at {host}:{port} did not answer within "
                             f"{timeout.total_seconds():.0f} s: {first_line(e)}") from e

