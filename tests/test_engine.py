"""The offline API and the engine loop: outputs, metrics, stopping, aborts, bad input, trace."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.config import EngineConfig, SchedulerConfig
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.trace import StepRecord, read_trace
from chunkserve.model.factory import LoadedModel, load_model

PROMPT = [(13 * i) % 30000 + 200 for i in range(40)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> LoadedModel:
    return load_model(tiny_model_dir, "float32", max_model_len=256)


def make_llm(tiny: LoadedModel, **kwargs: object) -> LLM:
    return LLM(loaded=tiny, model=tiny.path, **kwargs)


def greedy(n: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


def test_generate_returns_vllm_shaped_outputs(tiny):
    llm = make_llm(tiny, max_num_batched_tokens=16)
    outs = llm.generate(["Hello there", PROMPT], greedy(6))
    assert len(outs) == 2
    text_out, ids_out = outs
    assert text_out.prompt == "Hello there"
    assert text_out.prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    assert ids_out.prompt_token_ids == PROMPT and ids_out.prompt is None
    for out in outs:
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length" and len(c.token_ids) == 6
        assert c.text == llm.get_tokenizer().decode(c.token_ids)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft > 0 and m.tpot > 0 and len(m.token_times) == 6
        assert m.num_preemptions == 0
    # 40 prompt tokens in a 16-token budget take 3 steps: the first token comes on the third.
    engine = llm.engine
    fresh = [t + 1 for t in PROMPT]  # not in the prefix cache: PROMPT's blocks are
    engine.add_request("p", fresh, greedy(6))
    steps = [engine.step() for _ in range(3)]
    assert [s.record.num_prefill_tokens for s in steps] == [16, 16, 8]
    assert [len(s.outputs) for s in steps] == [0, 0, 1]
    engine.abort_request("p")


def test_stop_string_truncates_text(tiny):
    llm = make_llm(tiny)
    full = llm.generate([PROMPT], greedy(12))[0].outputs[0]
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), "the tiny model's text must contain a usable stop string"
    out = llm.generate([PROMPT], greedy(12, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


def test_stop_token_ids_and_eos(tiny):
    llm = make_llm(tiny)
    full = llm.generate([PROMPT], greedy(10))[0].outputs[0].token_ids
    out = llm.generate([PROMPT], greedy(10, stop_token_ids=[full[3]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == full[3]
    assert out.token_ids == full[: full.index(full[3]) + 1]
    # A token that is the model's EOS ends the request unless ignore_eos is set.
    llm.engine.processor.eos_token_ids[:] = [full[2]]
    eos = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids == full[: full.index(full[2]) + 1]


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    llm = make_llm(tiny, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    batched = llm.generate([PROMPT[:10], PROMPT, PROMPT[5:]], [other, params, other])
    assert batched[1].outputs[0].token_ids == alone


def test_abort_frees_blocks(tiny):
    engine = make_llm(tiny, max_num_batched_tokens=16).engine
    rid = engine.add_request("a", PROMPT, greedy(50))
    engine.add_request("b", PROMPT, greedy(50))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.kv.stats().num_used_blocks > 0
    engine.abort_request([rid, "b", "unknown-id"])
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.stats().num_used_blocks == 0
    assert engine.step().outputs == []


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], greedy(4), "cannot be empty"),
        ("", greedy(4), "cannot be empty"),
        (list(range(300, 600)), greedy(4), "maximum context length is 256 tokens"),
        (PROMPT, greedy(250), "'max_tokens' or 'max_completion_tokens' is too large"),
        ([10**9], greedy(4), "Token ids must be integers"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny, prompt, params, message):
    engine = make_llm(tiny).engine
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=-3), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), r"temperature must be in \[0, 100\]"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_k=-2), "top_k must be"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens must be less than or equal"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_is_all_or_nothing_on_bad_prompt(tiny):
    llm = make_llm(tiny)
    with pytest.raises(ValueError):
        llm.generate([PROMPT, []], greedy(4))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scheduler="prefill-first", max_num_batched_tokens=64), "smaller than max_model_len"),
        (dict(enable_chunked_prefill=False, scheduler="decode-first"), "always chunks"),
        (dict(scheduler="fifo"), "scheduler must be one of"),
        (dict(num_kv_blocks=4), "fewer than one request of max_model_len"),
        (dict(num_kv_blocks=4), r"estimated maximum model length is \d+: pass --max-model-len"),
        (dict(preemption_mode="discard"), "preemption_mode must be one of"),
        (dict(block_size=0), "block_size must be positive"),
        (dict(dtype="float16"), "dtype must be one of"),
    ],
)
def test_bad_engine_configs(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny, **kwargs)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_batched_token'"):
        EngineConfig.from_kwargs(max_num_batched_token=5)


def test_scheduler_defaults_follow_vllm():
    chunked = SchedulerConfig(max_model_len=8192).resolve()
    assert (chunked.scheduler, chunked.max_num_batched_tokens) == ("decode-first", 2048)
    plain = SchedulerConfig(max_model_len=8192, enable_chunked_prefill=False).resolve()
    assert (plain.scheduler, plain.max_num_batched_tokens) == ("prefill-first", 8192)


def test_trace_file_records_every_step(tiny, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = make_llm(tiny, max_num_batched_tokens=16, trace_file=str(path))
    outs = llm.generate([PROMPT, PROMPT[:7]], greedy(5))
    llm.engine.close()
    records = read_trace(str(path))
    assert len(records) > 0
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == list(StepRecord.__dataclass_fields__)
    # Every prompt token is prefilled once; every output token but the first is a decode.
    assert sum(r.num_prefill_tokens for r in records) == 47
    assert sum(r.num_decode_tokens for r in records) == sum(
        len(o.outputs[0].token_ids) - 1 for o in outs
    )
    assert all(r.num_tokens <= 16 and r.duration > 0 for r in records)
    # Occupancy is read after scheduling, i.e. what the step itself held.
    assert records[-1].kv_blocks_used > 0 and records[-1].num_running == 2
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
    assert all(0 <= r.internal_fragmentation < 16 * 2 for r in records)


def test_kv_cache_memory_sizes_the_pool(tiny):
    engine = LLMEngine.from_kwargs(loaded=tiny, model=tiny.path, kv_cache_memory=0.001)
    # tiny: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes x 16 slots = 8 KiB per block.
    assert engine.num_kv_blocks == int(0.001 * (1 << 30) // 8192)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chunkserve.cli", *args], capture_output=True, text=True,
        timeout=300,
    )


def test_cli_generate(tiny_model_dir):
    r = _cli("generate", "--model", tiny_model_dir, "--prompt", "Hi", "--max-tokens", "4",
             "--max-num-batched-tokens", "16", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "finish_reason=length" in r.stderr and "4 generated" in r.stderr


def test_cli_bad_input_is_a_message_not_a_traceback(tiny_model_dir):
    r = _cli("generate", "--model", tiny_model_dir, "--prompt", "Hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens must be at least 1" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--model", "/no/such/model", "--prompt", "Hi")
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_logprobs_and_streaming_deltas(tiny):
    engine = make_llm(tiny).engine
    full = make_llm(tiny).generate([PROMPT], greedy(8))[0].outputs[0]
    stop = full.text[-4:-1]
    engine.add_request("s", PROMPT, greedy(8, logprobs=2, stop=[stop]))
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            deltas.append(out.outputs[0].delta_text)
            last = out
    c = last.outputs[0]
    # The deltas never included text that the stop string later cut away.
    assert "".join(deltas) == c.text == full.text[: full.text.index(stop)]
    assert len(c.logprobs) == len(c.token_ids)
    for token, entries in zip(c.token_ids, c.logprobs):
        assert entries[0][0] == token and len(entries) == 3
        assert entries[0][1] == pytest.approx(max(lp for _, lp in entries[1:]))  # greedy = top-1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        LLMEngine.from_kwargs(model=tiny_model_dir, device="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        LLMEngine.from_kwargs(model=tiny_model_dir, device="tpu")


def test_explicit_cpu_device(tiny):
    llm = make_llm(tiny)
    assert llm.engine.executor.kv_cache.device.type == "cpu"  # type: ignore[attr-defined]
    assert tiny.model.device.type == "cpu"


def test_final_only_outputs_come_once_with_the_whole_result(tiny):
    """RequestOutputKind.FINAL_ONLY (what generate() and the benchmarks use): no output per
    token, one at the end that equals the streamed request's last output."""
    from chunkserve.sampling_params import RequestOutputKind

    engine = make_llm(tiny).engine
    engine.add_request("stream", PROMPT, greedy(5, logprobs=1))
    engine.add_request("final", PROMPT, greedy(5, logprobs=1,
                                              output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"stream": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            seen[out.request_id].append(out)
    assert len(seen["stream"]) == 5 and len(seen["final"]) == 1
    last, final = seen["stream"][-1], seen["final"][0]
    assert final.finished and final.outputs[0].token_ids == last.outputs[0].token_ids
    assert final.outputs[0].text == last.outputs[0].text and final.outputs[0].delta_text == \
        final.outputs[0].text
    assert len(final.outputs[0].logprobs) == 5 and len(final.metrics.token_times) == 5
