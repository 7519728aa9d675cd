"""The tensors of a Llama checkpoint, by HF name and shape, as its config implies them.

Its own module because both ends need it: the loader checks a real checkpoint against it and the
dummy loader builds random weights from it.
"""
from __future__ import annotations

from chunkserve.model.models.config import LlamaConfig


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama model with this config needs, with its HF shape."""
    assert config.head_dim is not None  # set by LlamaConfig.__post_init__
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    return shapes
