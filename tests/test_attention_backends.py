"""Choosing the attention backend, and the whole engine on the Triton backend.

Without a GPU the Triton kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1),
slowly: the end-to-end check keeps prompts and outputs short.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine.trace import read_trace
from chunkserve.cli import main
from chunkserve.engine.cuda_graph import CUDAGraphRunner, capture_sizes
from chunkserve.model.attention.select import make_attention_backend

TINY = (4, 2, 8)  # heads, kv_heads, head_dim
CPU = torch.device("cpu")


def test_auto_is_the_batched_kernel_on_the_cpu():
    assert make_attention_backend("auto", *TINY, CPU).name == "cpu"


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch, caplog):
    from chunkserve.model.kernels import cpu_library

    def no_compiler() -> str:
        raise cpu_library.KernelBuildError("found no C compiler")

    monkeypatch.setattr(cpu_library, "load", no_compiler)
    assert make_attention_backend("auto", *TINY, CPU).name == "torch"
    assert "no C compiler" in caplog.text and "Falling back" in caplog.text


def test_triton_on_a_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", *TINY, CPU)


def test_triton_not_installed_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match="needs the triton package"):
        make_attention_backend("triton", *TINY, CPU)


def test_cli_reports_triton_on_cpu_without_traceback(monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code = main(["generate", "--model", tiny_model_dir, "--attention-backend", "triton",
                 "--device", "cpu", "--prompt", "hi", "--max-tokens", "2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "chunkserve: error:" in err and "Traceback" not in err


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(model="smollm2-135m", attention_backend="flash")


def test_enforce_eager_on_cpu_is_accepted(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, enforce_eager=True, dtype="float32", max_model_len=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.executor.graphs is None  # type: ignore[attr-defined]


def test_engine_on_triton_matches_torch_on_smollm2(smollm2_path, tmp_path):
    """Chunked prefill (budget 16, so prompts split and mix with decodes), greedy tokens equal."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    "
               "# return the n-th Fibonacci number, computed iteratively"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        trace = str(tmp_path / f"{backend}.jsonl")
        llm = LLM(model=smollm2_path, attention_backend=backend, dtype="float32",
                  max_num_batched_tokens=16, num_kv_blocks=32, max_model_len=256,
                  trace_file=trace)
        outs = llm.generate(prompts, params)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        llm.engine.close()
        steps = read_trace(trace)
        assert any(r.num_prefill_tokens and r.num_decode_tokens for r in steps), "no mixed step"
    assert tokens["triton"] == tokens["torch"]


# ---- CUDA graphs, minus the GPU ------------------------------------------------------------
class EagerReplay(CUDAGraphRunner):
    """Everything a CUDA graph runner does — persistent padded inputs refilled by one copy,
    replay, output buffer — with the capture replaced by re-running the forward."""

    def _record(self, inputs, meta):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, meta)

        hidden = run().clone()
        return (lambda: hidden.copy_(run())), hidden


def test_capture_sizes_follow_vllm():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256


def test_graph_runner_replays_padded_decodes_with_the_same_tokens(tiny_model_dir):
    """Three requests decode through the size-4 "graph" (one padding row) on the Triton
    backend; tokens equal the plain eager run's."""
    prompts = [[5, 6, 7, 8, 9], list(range(100, 123)), [42] * 17]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    kwargs = dict(model=tiny_model_dir, attention_backend="triton", dtype="float32",
                  max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=32)
    plain = LLM(**kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

    graphed = LLM(**kwargs)
    runner = graphed.engine.executor
    runner.graphs = EagerReplay(runner.model, runner.kv_caches, runner.stager, [1, 2, 4],
                                max_blocks_per_seq=8, block_size=16)
    runner.graphs.capture()
    tokens = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert tokens == expected
    assert runner.graphs.num_replays >= 4  # every step after the prefills
