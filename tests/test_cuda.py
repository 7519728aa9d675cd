"""On a CUDA GPU: parity with HF transformers, token identity, CUDA graphs vs eager.

Skipped without a GPU (the `cuda` marker); `benchmarks/gpu/gpu_check.py` runs them on one. They
need no model file: a tiny random Llama is built with transformers and saved with the
tokenizer bundled in chunkserve, so they run on a machine that has only this repository.
"""
from __future__ import annotations

import gzip
import os
import shutil

import pytest
import torch

from chunkserve import LLM, SamplingParams

pytestmark = pytest.mark.cuda

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "..", "chunkserve", "data", "tokenizer")


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7919 * (i + 1) + 104729 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(lengths)]


PROMPTS = _prompts([5, 23, 40, 70, 150, 9, 31, 64])
CROWDED = _prompts([31, 31, 31, 31, 31, 31, 47, 15])  # see test_token_identity.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-cuda")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    with gzip.open(os.path.join(TOKENIZER_DIR, "tokenizer.json.gz"), "rb") as src:
        (path / "tokenizer.json").write_bytes(src.read())
    shutil.copy(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), path)
    return str(path)


@pytest.fixture(scope="module")
def hf_reference(tiny_dir: str) -> list[tuple[list[int], list[float]]]:
    """HF transformers' greedy tokens and their logprobs, on the same GPU, in fp32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).cuda().eval()
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            tokens = out.sequences[0, len(p):].tolist()
            logprobs = [float(s[0].float().log_softmax(-1)[t]) for s, t in zip(out.scores, tokens)]
            ref.append((tokens, logprobs))
    return ref


def _run(tiny_dir: str, prompts: list[list[int]], **kwargs: object) -> tuple[list, list, LLM]:
    llm = LLM(model=tiny_dir, dtype="float32", device="cuda", max_model_len=256, **kwargs)
    outs = llm.generate(prompts, GREEDY)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[0][1] for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, llm


@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=4096),
    dict(max_num_batched_tokens=64, scheduler="vllm-v1"),
    dict(scheduler="prefill-first"),
    dict(scheduler="orca"),
    dict(max_num_batched_tokens=64, enforce_eager=True),
    dict(max_num_batched_tokens=64, attention_backend="torch"),
])
def test_matches_hf_transformers(tiny_dir, hf_reference, kwargs):
    tokens, logprobs, llm = _run(tiny_dir, PROMPTS, **kwargs)
    assert tokens == [t for t, _ in hf_reference]
    for ours, theirs in zip(logprobs, hf_reference):
        assert ours == pytest.approx(theirs[1], abs=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_tokens(tiny_dir, mode):
    alone = [_run(tiny_dir, [p], max_num_batched_tokens=4096)[0][0] for p in CROWDED]
    tokens, _, llm = _run(tiny_dir, CROWDED, max_num_batched_tokens=32, num_kv_blocks=16,
                          preemption_mode=mode)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == alone


def test_graphs_replay_decode_steps_and_match_eager(tiny_dir):
    graph_tokens, _, graphed = _run(tiny_dir, PROMPTS, max_num_batched_tokens=64)
    eager_tokens, _, eager = _run(tiny_dir, PROMPTS, max_num_batched_tokens=64,
                                  enforce_eager=True)
    assert graphed.engine.executor.graphs is not None and eager.engine.executor.graphs is None
    assert graphed.engine.executor.graphs.num_replays > 0
    assert graph_tokens == eager_tokens


def test_triton_is_the_default_backend_on_cuda(tiny_dir):
    _, _, llm = _run(tiny_dir, PROMPTS[:1])
    assert llm.engine.executor.model.attn.name == "triton"


def test_seeded_sampling_repeats(tiny_dir):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=tiny_dir, dtype="float32", device="cuda", max_model_len=256)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)])
    assert runs[0] == runs[1]


def test_bf16_preset_runs_with_graphs():
    llm = LLM(model="tiny-llama", device="cuda", max_model_len=512)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.executor.graphs.num_replays > 0


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi3", "phi3-partial-rotary"])
def test_every_architecture_matches_eager_and_transformers_with_graphs(tmp_path, name):
    """The other architectures (tests/arch_models.py) on the GPU path: triton attention at head
    sizes 64/128/96, CUDA graphs for decode steps, logits against transformers on the GPU."""
    from arch_models import hf_model, save_hf_folder

    folder = str(save_hf_folder(hf_model(name), tmp_path / name))
    prompts = [[(37 * i + 11 * j) % 500 + 3 for i in range(n)] for j, n in enumerate((9, 40, 70))]
    graphed = LLM(model=folder, dtype="float32", device="cuda", max_model_len=256,
                  max_num_batched_tokens=32)
    eager = LLM(model=folder, dtype="float32", device="cuda", max_model_len=256,
                max_num_batched_tokens=32, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)]
              for llm in (graphed, eager)]
    assert graphed.engine.executor.graphs.num_replays > 0
    assert tokens[0] == tokens[1]
    model = hf_model(name).cuda()
    with torch.no_grad():
        for prompt, ours in zip(prompts, tokens[0]):
            out = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
            assert out[0, len(prompt):].tolist() == ours


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="tensor parallelism over NCCL needs a GPU a rank")


@two_gpus
@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(max_num_batched_tokens=32, num_kv_blocks=16, preemption_mode="recompute"),
], ids=["budget16", "budget64", "recompute"])
def test_two_gpus_give_one_gpus_tokens(tiny_dir, kwargs):
    """-tp 2 on CUDA: a rank a GPU (cuda:0, cuda:1), the model's collectives over NCCL (the
    tiny Llama: 4 query heads, 2 KV heads, one KV head a rank), eager decode steps."""
    one, one_logprobs, _ = _run(tiny_dir, PROMPTS, **kwargs)
    two, two_logprobs, llm = _run(tiny_dir, PROMPTS, tensor_parallel_size=2, **kwargs)
    executor = llm.engine.executor
    try:
        assert two == one
        for ours, theirs in zip(two_logprobs, one_logprobs):
            assert ours == pytest.approx(theirs, abs=1e-4)  # float32 all-reduce rounding
        assert executor.runner.model.device == torch.device("cuda", 0)
        assert executor.group.tensor_pg is not executor.group.pg  # NCCL's, beside gloo's
    finally:
        llm.engine.close()
    assert [w.exitcode for w in executor.workers] == [0]
