"""A child process that must not outlive its parent: tensor-parallel workers, engine processes.

A parent killed outright (SIGKILL, the OOM killer) runs no clean-up, and its children would go
on waiting for steps that never come. A child calls `exit_with_parent` first thing; a daemon
thread then notices within POLL_S that it was re-parented and exits. (Linux's PR_SET_PDEATHSIG
would be immediate, but it fires when the parent *thread* that started the child ends: an
engine built on a worker thread that then finishes would lose its workers while still in use.)
"""
from __future__ import annotations

import os
import threading
import time

POLL_S = 0.5


def exit_with_parent() -> None:
    """Call first thing in a child: it exits soon after the process that started it dies."""
    parent = os.getppid()
    threading.Thread(target=_poll, args=(parent,), daemon=True, name="parent-watch").start()


def _poll(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os._exit(1)
