"""The tensors of a checkpoint, by HF name and shape, as its config and its architecture's
declarations imply them.

Its own module because both ends need it: the loaders check a real checkpoint against it and
the dummy loader builds random weights from it.
"""
from __future__ import annotations

from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import architecture


def _linear_shapes(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    """Every linear of a layer as the Llama decoder names them unfused: (out, in)."""
    assert config.head_dim is not None  # set by DecoderConfig.__post_init__
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    return {
        "self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def _layer_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """One layer's tensors (names within the layer) as its architecture stores them."""
    arch = architecture(config.architecture)
    linears = _linear_shapes(config)
    on_disk: dict[str, tuple[int, int]] = {}
    for fused, parts in arch.packed_modules_mapping.items():
        if arch.checkpoint_parts(fused) == (fused,):  # stored fused: the parts stacked
            on_disk[fused] = (sum(linears[p][0] for p in parts), linears[parts[0]][1])
            for p in parts:
                del linears[p]
    on_disk.update(linears)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (config.hidden_size,),
        "post_attention_layernorm.weight": (config.hidden_size,),
        **{f"{norm}.weight": (config.hidden_size,) for norm in arch.extra_layer_norms},
    }
    for name, shape in on_disk.items():
        shapes[f"{name}.weight"] = shape
        if name in arch.bias_linears:
            shapes[f"{name}.bias"] = (shape[0],)
    if arch.qk_norm:
        assert config.head_dim is not None
        shapes["self_attn.q_norm.weight"] = shapes["self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def expected_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config needs, with its HF shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    layer = _layer_shapes(config)
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes
