"""chunkserve: an LLM serving engine built around chunked prefill with decode-maximal batching."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import chunkserve.core` (pure Python) does not pull in torch.
    if name == "LLM":
        from chunkserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from chunkserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from chunkserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from chunkserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'chunkserve' has no attribute {name!r}")
