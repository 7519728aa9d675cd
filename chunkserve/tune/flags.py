"""The pick as ready command lines: `chunkserve serve ...` and `vllm serve ...`.

vLLM has neither chunkserve's decode-first scheduler (its V1 scheduler is `vllm-v1` here) nor
the adaptive policy, so its line gives the nearest static setting and says so.
"""
from __future__ import annotations

from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.tune.space import kind

# The Hugging Face repositories of the model presets (chunkserve/data/models.toml).
HF_IDS = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def chunkserve_line(point: SweepPoint, model: str, cost_model: str, max_num_seqs: int) -> str:
    flags = [f"chunkserve serve {model}"]
    if point.auto:  # the default: no chunking flag (--target-itl-ms for another target)
        if point.target_itl_ms is not None:
            flags.append(f"--target-itl-ms {point.target_itl_ms:g}")
        flags.append(f"--max-num-seqs {max_num_seqs}")
        return " ".join(flags)
    if point.chunk_size is None:
        flags.append(f"--no-enable-chunked-prefill --scheduler {point.scheduler}")
    else:
        flags.append(f"--enable-chunked-prefill --scheduler {point.scheduler} "
                     f"--max-num-batched-tokens {point.chunk_size}")
    if point.long_prefill_token_threshold:
        flags.append(f"--long-prefill-token-threshold {point.long_prefill_token_threshold}")
    if point.adaptive:
        flags.append(f"--chunk-policy adaptive --target-itl-ms {point.target_itl_ms:g} "
                     f"--min-chunk-tokens {point.min_chunk_tokens} --cost-model {cost_model}")
    flags.append(f"--max-num-seqs {max_num_seqs}")
    return " ".join(flags)


def vllm_line(point: SweepPoint, budget: int | None, model: str, max_model_len: int,
              max_num_seqs: int) -> tuple[str, str | None]:
    """(the line, a note when vLLM cannot run the pick as it is)."""
    flags = [f"vllm serve {HF_IDS.get(model, model)}"]
    note = None
    if point.no_chunk:
        flags.append(f"--no-enable-chunked-prefill --max-num-batched-tokens {max_model_len}")
    else:
        flags.append(f"--enable-chunked-prefill --max-num-batched-tokens {budget}")
    if point.long_prefill_token_threshold:
        flags.append(f"--long-prefill-token-threshold {point.long_prefill_token_threshold}")
    flags.append(f"--max-num-seqs {max_num_seqs}")
    k = kind(point)
    if k in ("adaptive", "auto"):
        note = (f"vLLM has no adaptive chunk policy: {budget} is the median budget it chose per "
                "step")
    elif point.scheduler == "decode-first":
        note = ("vLLM's scheduler is chunkserve's vllm-v1 (prefills in admission order, not "
                "decodes first); the ranking lists vllm-v1 separately")
    return " ".join(flags), note
