"""The llama-server comparison's report, on recorded bench serve results (no build, no run)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository root
from benchmarks.serving import compare_llama_server as cmp  # noqa: E402


def _result(throughput: float, itl_p50: float, completed: int = 48, rate: object = "inf") -> dict:
    return {"num_prompts": 48, "completed": completed, "request_rate": rate,
            "request_throughput": throughput, "output_throughput": 80 * throughput,
            "median_ttft_ms": 900.0, "p99_ttft_ms": 11800.0, "median_itl_ms": itl_p50,
            "p99_itl_ms": 827.0, "max_itl_ms": 7700.0, "p99_tpot_ms": 548.0,
            "median_e2el_ms": 23000.0}


def test_side_by_side_table_has_both_engines_and_ratios():
    results = {
        "chunkserve": {"capacity": _result(0.5, 60.0), "open-loop": _result(0.147, 50.0)},
        "llama-server": {"capacity": _result(0.25, 73.0), "open-loop": _result(0.147, 73.0,
                                                                                rate=0.147)},
    }
    for engine in results.values():
        for r in engine.values():
            r["failed"] = cmp.failed_count(r)
    text = cmp.side_by_side(results)
    assert "| capacity (req/s) | 0.500 | 0.250 | 2.00 |" in text
    assert "| ITL p50 (ms) | 60.0 | 73.0 | 0.82 |" in text
    assert "**open-loop**" in text and "| failed requests | 0.0 | 0.0 | – |" in text


def test_failed_count_and_server_commands():
    assert cmp.failed_count(_result(0.5, 60.0, completed=45)) == 3
    chunk = cmp.server_command("chunkserve", 8123, "/m.gguf", None)
    assert chunk[-4:] == ["--host", "127.0.0.1", "--port", "8123"]
    llama = cmp.server_command("llama-server", 8124, "/m.gguf", "/bin/llama-server")
    assert llama[:3] == ["/bin/llama-server", "-m", "/m.gguf"] and "--parallel" in llama
    extra = cmp.server_command("llama-server", 8124, "/m.gguf", "/bin/llama-server",
                               ["--no-repack"])
    assert extra == llama + ["--no-repack"]
    # Each engine gets its own extra flags (--peer-args, --chunkserve-args), after its defaults.
    assert cmp.server_command("chunkserve", 8123, "/m.gguf", None,
                              ["--kv-cache-dtype", "bfloat16"]) == chunk + [
        "--kv-cache-dtype", "bfloat16"]
    gemma = cmp.server_command("chunkserve", 8123, "/g.gguf", None, model="gemma3-270m")
    assert gemma[gemma.index("--model") + 1] == "gemma3-270m"


def test_cpu_info_names_model_and_flags():
    info = cmp.cpu_info()
    assert info["model"] and isinstance(info["flags"], list) and info["cores"] >= 1
