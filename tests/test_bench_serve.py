"""`chunkserve bench serve` end to end: the CLI against a real `chunkserve serve` subprocess."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import TEST_KV_ARGS

START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 120.0

# vLLM's saved-result keys (docs/conventions.md), with the default percentile 99.
VLLM_KEYS = {
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}
DETAIL_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
               "errors"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    cmd = [sys.executable, "-m", "chunkserve.cli", "serve", tiny_model_dir, "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "64",
           "--uvicorn-log-level", "warning", *TEST_KV_ARGS]  # a small pool: see server_utils
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _bench(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "chunkserve.cli", "bench", "serve", "--base-url", url,
           "--disable-tqdm", *args]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)


def _saved(result_dir: Path) -> dict:
    files = list(result_dir.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_completions_rate_inf(server: str, tmp_path: Path, tiny_model_dir: str) -> None:
    r = _bench(server, "--dataset-name", "random", "--num-prompts", "6",
               "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--goodput", "e2el:600000",
               "--save-result", "--result-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "{:=^50}".format(" Serving Benchmark Result ") in lines
    assert "{:<40} {:<10}".format("Successful requests:", 6) in lines
    assert "{:<40} {:<10}".format("Failed requests:", 0) in lines
    assert "{:<40} {:<10}".format("Total input tokens:", 96) in lines
    assert "{:<40} {:<10}".format("Total generated tokens:", 48) in lines
    assert not any(line.startswith("Request rate configured") for line in lines)
    for header in ("Time to First Token", "Time per Output Token (excl. 1st token)",
                   "Inter-token Latency", "End-to-end Latency"):
        assert "{:-^50}".format(header) in lines
    assert any(line.startswith("Max ITL (ms):") for line in lines)

    saved = _saved(tmp_path)
    assert VLLM_KEYS <= set(saved), VLLM_KEYS - set(saved)
    assert not DETAIL_KEYS & set(saved)
    assert saved["completed"] == 6 and saved["failed"] == 0
    assert saved["total_output_tokens"] == 48 and saved["total_input_tokens"] == 96
    assert saved["request_rate"] == "inf" and saved["backend"] == "openai"
    assert saved["model_id"] == tiny_model_dir and saved["tokenizer_id"] == tiny_model_dir
    # A generous e2el SLO: every completed request is good.
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert saved["mean_tpot_ms"] > 0 and saved["p99_ttft_ms"] >= saved["median_ttft_ms"] > 0
    assert 1 <= saved["max_concurrent_requests"] <= 6


def test_chat_rate_20_detailed(server: str, tmp_path: Path) -> None:
    r = _bench(server, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
               "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
               "--request-rate", "20", "--max-concurrency", "2", "--save-detailed",
               "--result-dir", str(tmp_path), "--result-filename", "chat.json")
    assert r.returncode == 0, r.stderr
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 2) in r.stdout.splitlines()
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 20) in r.stdout.splitlines()
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert VLLM_KEYS <= set(saved) and DETAIL_KEYS <= set(saved)
    assert saved["backend"] == "openai-chat" and saved["request_rate"] == 20.0
    assert saved["completed"] == 6 and saved["total_output_tokens"] == 48
    assert saved["request_goodput"] is None
    assert saved["max_concurrent_requests"] <= 2
    assert saved["input_lens"] == [16] * 6 and saved["output_lens"] == [8] * 6
    assert saved["errors"] == [""] * 6 and all(saved["generated_texts"])
    # A streamed chunk may carry several tokens, so at most out - 1 gaps per request.
    assert all(0 < len(itl) <= 7 for itl in saved["itls"])
    assert all(ttft > 0 for ttft in saved["ttfts"])


def test_failures_are_recorded_not_raised(server: str, tmp_path: Path,
                                          tiny_model_dir: str) -> None:
    # An unknown model name: the server answers 404 for every request.
    r = _bench(server, "--model", "no-such-model", "--tokenizer", tiny_model_dir,
               "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
               "--save-detailed", "--result-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "{:<40} {:<10}".format("Failed requests:", 2) in r.stdout.splitlines()
    saved = _saved(tmp_path)
    assert saved["completed"] == 0 and saved["failed"] == 2
    assert all(e.startswith("HTTP 404") for e in saved["errors"])


def test_json_schema_outputs_parse(server: str, tmp_path: Path, smollm2_path: str) -> None:
    """`--dataset-name json-schema` (tests/test_bench_json_schema.py has the offline checks)."""
    import jsonschema

    from chunkserve.benchlib.json_schemas import json_schema_requests
    from chunkserve.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    # /v1/completions: the server's 256-token context leaves a chat-templated prompt with its
    # schema (up to 200 tokens) too little room; the chat payload is checked above.
    r = _bench(server, "--dataset-name", "json-schema",
               "--num-prompts", "6", "--random-output-len", "64", "--temperature", "0",
               "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert r.returncode == 0, r.stderr
    assert "{:<40} {:<10}".format("Outputs that parse as JSON:", "6/6") in r.stdout.splitlines()
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["ignore_eos"] is False
    sent = json_schema_requests(tokenizer, 6, seed=0, output_len=64)  # the bench's, in order
    for text, req in zip(saved["generated_texts"], sent, strict=True):
        jsonschema.validate(json.loads(text), req.json_schema)  # type: ignore[arg-type]
    # The JSON's end stopped each request, before max_tokens.
    assert all(0 < n < 64 for n in saved["output_lens"])
