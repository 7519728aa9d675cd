"""Hyper-parameters of a decoder-only model, under HF `config.json` names, whatever the
architecture: what differs *between* architectures is declared by their classes (llama.py and
its variants), not here."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from chunkserve.model.layers.rope_scaling import check_rope_scaling

DEFAULT_ARCHITECTURE = "LlamaForCausalLM"

logger = logging.getLogger(__name__)


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.
    rope_scaling: dict[str, Any] | None = None
    # Phi-4-mini rotates only the first 3/4 of each head's dimensions.
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The HF class name of the architecture (models/registry.py maps it to ours).
    architecture: str = DEFAULT_ARCHITECTURE
    # The sliding attention window (limit_to_window): of the `layer_types` layers that slide,
    # or of every layer, then also the context's cap. None: full attention.
    sliding_window: int | None = None
    # Fields only some architectures read (their `configure` sets them; HF's names):
    # each layer's attention, "full_attention" or "sliding_attention" (Gemma 3); None: all full.
    layer_types: list[str] | None = None
    # RoPE base of the sliding-window layers (Gemma 3's local layers); None: rope_theta.
    rope_local_base_freq: float | None = None
    # Softmax scale query_pre_attn_scalar^-0.5 instead of head_dim^-0.5 (Gemma 3).
    query_pre_attn_scalar: float | None = None
    # logits = cap * tanh(logits / cap) (Gemma 2/3 configs may set it).
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates (all but for partial rotary)."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    def set_rope_scaling(self, scaling: dict[str, Any] | None,
                         original_max_position_embeddings: int | None = None) -> None:
        """`scaling` (HF's dict, from a config.json or rebuilt from GGUF metadata) checked and
        normalized: a type that is not built is refused when the model is read, not run."""
        self.rope_scaling = check_rope_scaling(scaling, self.max_position_embeddings,
                                               original_max_position_embeddings, self.rotary_dim)

    def limit_to_window(self, window: int | None) -> None:
        """A sliding attention window. A model that says which layers slide (`layer_types`:
        Gemma 3) keeps its whole context: those layers' KV is a sliding-window KV-cache group
        (core/kv_groups.py). One that does not (a window on every layer, or a rule we do not
        model, as Qwen2's max_window_layers) is capped at the window instead: up to the window,
        sliding-window attention is full attention, so the model stays exact."""
        if window is None:
            return
        if window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {window}.")
        self.sliding_window = int(window)
        if self.layer_types and "sliding_attention" in self.layer_types:
            return
        if window < self.max_position_embeddings:
            logger.info("%s: context capped at the sliding window, %d tokens (from %d): up to "
                        "the window, full attention is exact.", self.architecture, window,
                        self.max_position_embeddings)
            self.max_position_embeddings = int(window)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], architecture: str = DEFAULT_ARCHITECTURE
                     ) -> DecoderConfig:
        """The fields of a config.json (KeyError for a missing required one). The rope settings
        are taken as written; models/registry.py checks them and applies what an architecture
        declares (config_from_hf)."""
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # transformers >= 5 writes rope settings under "rope_parameters" instead.
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            partial_rotary_factor=d.get("partial_rotary_factor",
                                        rope_params.get("partial_rotary_factor", 1.0)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=architecture,
        )
