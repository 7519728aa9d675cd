"""The server under stress: a real `chunkserve serve` subprocess on loopback (server_utils), its
RSS, its /metrics after a phase, and its log."""
from __future__ import annotations

import re
import time

import httpx
from server_utils import RemoteServer

from stress.report import Idle

API_KEY = "stress-key"
HEADER_TIMEOUT_S = 3.0  # --header-timeout and --body-timeout of the server under stress
CONNECTION_CAP = 200  # its --limit-concurrency: above the storm's and the soak's clients
IDLE_DEADLINE_S = 5.0  # the target: running = waiting = KV = 0 within 5 s of a phase


def server_args(model: str, max_model_len: int, max_waiting: int, max_num_seqs: int,
                shutdown_timeout: float) -> list[str]:
    """Small budgets keep CPU cost down; the KV pool fits every running request at full length,
    so no preemption pushes a running request back among the waiting (the cap is on arrivals)."""
    args = ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-waiting-requests", str(max_waiting), "--max-num-batched-tokens", "256",
            "--num-kv-blocks", str((max_num_seqs + 1) * -(-max_model_len // 16)),
            "--shutdown-timeout", str(shutdown_timeout),
            # Short deadlines and a small cap, so the slow-clients phase runs in seconds.
            "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(HEADER_TIMEOUT_S),
            "--limit-concurrency", str(CONNECTION_CAP)]
    return [*args, "--dtype", "float32"] if model == "tiny-llama" else args


class Target:
    def __init__(self, model: str, args: list[str], max_waiting: int) -> None:
        self.server = RemoteServer(model, args, api_key=API_KEY)
        self.max_waiting = max_waiting
        self.num_blocks = int(self.metrics_text_value("vllm:cache_config_info", "num_gpu_blocks"))

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def rss_mb(self) -> float:
        assert self.server.proc is not None
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def metrics_text_value(self, name: str, label: str) -> str:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        match = re.search(rf'^{re.escape(name)}{{[^}}]*{label}="([^"]*)"', text, re.M)
        assert match, f"{name} not in /metrics"
        return match.group(1)

    def wait_idle(self, deadline_s: float = IDLE_DEADLINE_S) -> Idle:
        start = time.monotonic()
        while True:
            m = self.server.metrics()
            blocks = round(m.kv_usage * self.num_blocks)
            elapsed = time.monotonic() - start
            if m.idle:
                return Idle(m.running, m.waiting, m.kv_usage, blocks, elapsed, True)
            if elapsed > deadline_s:
                return Idle(m.running, m.waiting, m.kv_usage, blocks, elapsed, False)
            time.sleep(0.05)

    def log_problems(self) -> list[str]:
        """Tracebacks or uvicorn's own error lines: never expected, whatever the input."""
        text = self.server.log_tail(10_000_000)
        problems = []
        for pattern in ("Traceback", "Exception in ASGI application", "CancelledError",
                        "ASGI callable returned without", "timeout graceful shutdown exceeded"):
            n = text.count(pattern)
            if n:
                problems.append(f"server log has {n}× {pattern!r}")
        return problems

    def close(self) -> None:
        self.server.close()
