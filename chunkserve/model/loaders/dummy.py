"""Random weights of a model's shape (vLLM's `--load-format dummy`): serving benchmarks of models
whose weights are not here, or not worth reading, with the exact compute and memory of the real
ones."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.registry import architecture

# HF's initializer_range for Llama. With unit RMSNorm weights each layer adds O(1) to the
# float32 residual stream, so 80 layers stay far from bf16's range, and the logits (std ~1 for
# hidden 4096) are spread enough that greedy decoding is not a tie-break between equal values.
INIT_STD = 0.02


def dummy_tensors(
    config: DecoderConfig, seed: int, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor `expected_shapes(config)` lists, in its order, one at a time: unit norms,
    the rest normal(0, INIT_STD).

    Each tensor is drawn where it will live, in its final dtype: an 8B model in bf16 never
    passes through 32 GB of host float32. The same seed gives the same weights on the same kind
    of device (CPU and CUDA streams differ), so a file written from these tensors
    (model/writers/) holds the weights that `--model PRESET` runs with.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    # Unit norms as the model applies them: Gemma's scale by 1 + w, so its stored w is 0.
    unit_norm = 1.0 - architecture(config.architecture).norm_weight_offset
    for name, shape in expected_shapes(config).items():
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(unit_norm)
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        yield name, tensor


def dummy_weights(
    config: DecoderConfig, seed: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """All of `dummy_tensors` at once: the peak is the model itself."""
    return dict(dummy_tensors(config, seed, device, dtype))
