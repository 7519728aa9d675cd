"""A real `chunkserve serve` subprocess for the server tests, as vLLM's RemoteOpenAIServer.

Every wait here has a deadline: a wedged server fails a test, it never hangs the suite.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 120.0  # SmolLM2 dequantises its GGUF at start (~8 s idle, more when loaded)
HTTP_TIMEOUT_S = 30.0
# A server writes its whole KV pool at start (launcher.commit_kv_memory): the default 2 GiB
# costs seconds of page faults per server (more with other servers holding theirs), and no
# test here needs it. 64 MiB holds thousands of the tiny models' blocks; a test that sizes the
# pool itself (or serves a model whose max_model_len needs more, as SmolLM2's 8192) passes
# --kv-cache-memory or --num-kv-blocks.
TEST_KV_ARGS = ["--kv-cache-memory", "0.0625"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, model: str, args: list[str], api_key: str | None = None) -> None:
        self.model = model
        self.args = list(args)
        self.api_key = api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="chunkserve-server-", suffix=".log",
                                               delete=False)
        self.port = 0
        self.start()

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        for attempt in range(3):  # another process may grab the free port before we bind it
            self.port = free_port()
            sized = any(a in ("--kv-cache-memory", "--num-kv-blocks") for a in self.args)
            cmd = [sys.executable, "-m", "chunkserve.cli", "serve", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--uvicorn-log-level", "warning", *([] if sized else TEST_KV_ARGS),
                   *self.args]
            if self.api_key:
                cmd += ["--api-key", self.api_key]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            env.pop("CHUNKSERVE_API_KEY", None)
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
            if self._wait_healthy():
                return
            if attempt == 2 or "address already in use" not in self.log_tail().lower():
                break
        tail = self.log_tail()
        self.terminate()
        raise RuntimeError(f"server did not become healthy:\n{tail}")

    def _wait_healthy(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        # One client for the whole wait: httpx.get builds a client (and its SSL context) per
        # call, ~20 ms of CPU taken from the starting server ten times a second. Until the port
        # accepts a connection, a bare connect attempt is all the polling costs.
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                if self._port_open():
                    try:
                        if http.get(self.url + "/health").status_code == 200:
                            return True
                    except httpx.HTTPError:
                        pass
                time.sleep(0.1)
        return False

    def _port_open(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def close(self) -> None:
        self.terminate()
        self.log.close()
        os.unlink(self.log.name)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    # ---- clients ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "dummy")
        return openai.OpenAI(base_url=self.url + "/v1", timeout=HTTP_TIMEOUT_S, max_retries=0,
                             **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "dummy",
                                  timeout=HTTP_TIMEOUT_S, max_retries=0)

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        return httpx.Client(base_url=self.url, headers=self.headers(), **kwargs)

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers(),
                          timeout=HTTP_TIMEOUT_S)

    # ---- metrics ----------------------------------------------------------------------------
    def metrics(self) -> Metrics:
        r = httpx.get(self.url + "/metrics", timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        return Metrics(r.text)

    def wait_for(self, pred: Callable[[Metrics], bool], timeout: float) -> Metrics:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if pred(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics condition not met in {timeout}s:\n"
                                     f"{m.summary()}")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 5.0) -> Metrics:
        return self.wait_for(lambda m: m.idle, timeout)


class Metrics:
    """One /metrics scrape, by sample name and labels (model_name left out)."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.model_names: set[str] = set()
        for family in self.families.values():
            for s in family.samples:
                labels = dict(s.labels)
                if "model_name" in labels:
                    self.model_names.add(labels.pop("model_name"))
                self.samples[(s.name, frozenset(labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels (a per-engine gauge: engine 0's by default)."""
        key = (name, frozenset(labels.items()))
        if key not in self.samples and "engine" not in labels:
            key = (name, frozenset({**labels, "engine": "0"}.items()))
        return self.samples[key]

    @property
    def running(self) -> float:
        return self.get("vllm:num_requests_running")

    @property
    def waiting(self) -> float:
        return self.get("vllm:num_requests_waiting")

    @property
    def kv_usage(self) -> float:
        return self.get("vllm:kv_cache_usage_perc")

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0

    def summary(self) -> str:
        return (f"running={self.running} waiting={self.waiting} kv={self.kv_usage} "
                f"success={[(k[1], v) for k, v in self.samples.items() if k[0] == 'vllm:request_success_total']}")


def assert_error(r: httpx.Response, status: int, err_type: str | None = None,
                 message: str | None = None, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape: {"error": {"message", "type", "param", "code"}} and the status."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if err_type is not None:
        assert err["type"] == err_type, err
    if message is not None:
        assert message in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err
