"""A Hugging Face folder (bf16 safetensors, config.json, tokenizer) of a model shipped as GGUF, so
that a peer that reads HF folders (vLLM) and chunkserve serve the same weights (issue 53).

transformers reads the GGUF (its own metadata parse, gguf-py's dequantization, its q/k
un-permutation), but refuses to save a GGUF-loaded model as it is; so the tensors are written
with safetensors and the config from the preset (the model's own config.json). A benchmark
helper, not a runtime path: it needs transformers, a test/benchmark dependency.

    .venv/bin/python benchmarks/common/hf_folder.py --model smollm2-135m --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DONE = "chunkserve-hf-folder.json"  # written last: a folder without it is rewritten


def write_hf_folder(model: str, out: str) -> str:
    """`out` holding `model`'s GGUF as a bf16 HF folder (written once; reused after)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from chunkserve.model.loaders.source import resolve_model_path
    from chunkserve.presets import model_preset

    if os.path.exists(os.path.join(out, DONE)):
        return out
    gguf = resolve_model_path(model)
    preset = model_preset(model)
    if preset.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{model}: only Llama-architecture GGUFs are converted here")
    os.makedirs(out, exist_ok=True)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**preset))
    checkpoint = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=skeleton,
                                      torch_dtype=torch.float32)
    tensors = {name: t.to(torch.bfloat16).contiguous()
               for name, t in checkpoint["tensors"].items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    LlamaConfig(**preset, torch_dtype="bfloat16").save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                              gguf_file=os.path.basename(gguf))
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, DONE), "w") as f:
        json.dump({"from": os.path.basename(gguf), "model": model, "dtype": "bfloat16",
                   "tensors": len(tensors)}, f)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    print(write_hf_folder(args.model, args.out))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
