"""Tensor-parallel sharding: which part of a model each of `tp_size` ranks holds, as a pure
function of the config and the HF-named weights dict a loader returns. No process groups and
no communication here: the engine's ranks each call `shard_weights` on the full dict (or its
own loader's) and build an ordinary decoder from the result with `shard_config`'s config.

The split is Megatron's, with vLLM's rules:

- column-parallel (each rank computes some output features, nothing to combine):
  q_proj by query heads, k_proj/v_proj by KV heads, gate_proj/up_proj by intermediate rows;
  Phi-3's fused qkv_proj and gate_up_proj are split part by part and re-fused, so each rank's
  fused matrix is [its q | its k | its v] and [its gate | its up], as the decoder expects.
  Biases (Qwen2's q/k/v) go with their rows.
- attention is split by KV-head groups so a rank's query heads attend only to its own KV heads.
  With fewer KV heads than ranks (tp_size % kv_heads == 0), each KV head is replicated on
  tp_size / kv_heads consecutive ranks: rank r holds KV head r // replicas, the one its query
  heads use (query heads are split contiguously, and a KV group's query heads are contiguous).
- row-parallel (each rank holds some input features, outputs are partial sums -> all-reduce):
  o_proj by the columns of the rank's query heads, down_proj by its intermediate columns.
  A bias on one (no architecture here has it) stays on rank 0 only, so the sum adds it once.
- vocab-parallel: embed_tokens and lm_head rows split into contiguous ranges of equal length,
  the vocabulary zero-padded at its end so every rank holds `vocab_per_rank` rows (a multiple
  of VOCAB_PAD, as vLLM pads to 64). Padding sits only after the last real id, so the ranks'
  logits concatenated in rank order and cut to vocab_size are the full logits.
- replicated: every norm (q/k norms included) and the rope tensors.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.llama import ROW_ABSMAX, LlamaForCausalLM, Weights

# Rows per rank are rounded up to this (vLLM's DEFAULT_VOCAB_PADDING_SIZE): aligned GEMM shapes.
VOCAB_PAD = 64
# Tensors every rank holds whole (besides "...norm.weight"): the loaders' rope tensors.
_REPLICATED_SUFFIXES = ("norm.weight", "rotary_emb.inv_freq", "rope_freqs.weight",
                        "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Unfused checkpoint linears: how each is split ("q", "kv", "mlp": rows; "o", "down": columns).
_SPLITS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
           "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp",
           "self_attn.o_proj": "o", "mlp.down_proj": "down"}
_ROW_PARALLEL = ("o", "down")  # the kinds split by input columns, summed by an all-reduce
# Quantize, then shard: beside a row-parallel weight's shard goes its full rows' largest |w|
# (models/llama.py, ROW_ABSMAX). Group formats (int8 and int4 in groups of 32) need nothing:
# the splits fall on group boundaries.


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `tp_size` holds. Head and row indices are global (unsharded)."""
    tp_size: int
    rank: int
    head_dim: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_replicas: int  # ranks holding each KV head (1: KV heads are split, not replicated)
    intermediate_size: int  # MLP rows (gate, up) / columns (down) on this rank
    vocab_size: int  # the real, global vocabulary
    vocab_per_rank: int  # embedding / LM-head rows on every rank, padding included

    @property
    def q_head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def kv_head_start(self) -> int:
        return (self.rank // self.kv_head_replicas) * self.num_kv_heads

    @property
    def intermediate_start(self) -> int:
        return self.rank * self.intermediate_size

    @property
    def vocab_start(self) -> int:
        """The global id of this rank's first embedding / LM-head row."""
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """One past the last *real* id this rank holds (== vocab_start: only padding)."""
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)


def valid_tp_sizes(config: DecoderConfig) -> list[int]:
    """Every tensor-parallel size this config can be split into (vLLM's rules)."""
    heads, kv, inter = (config.num_attention_heads, config.num_key_value_heads,
                        config.intermediate_size)
    return [t for t in range(1, heads + 1)
            if heads % t == 0 and (kv % t == 0 or t % kv == 0) and inter % t == 0]


def check_tp_size(config: DecoderConfig, tp_size: int, model: str | None = None) -> None:
    """ValueError naming the counts and the sizes that would work, unless `tp_size` splits
    `config`. Query heads must split evenly; KV heads split evenly or are replicated on a whole
    number of ranks each; the MLP's intermediate rows split evenly."""
    if tp_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp_size}.")
    valid = valid_tp_sizes(config)
    if tp_size in valid:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    raise ValueError(
        f"{model or config.architecture} has {heads} attention heads, {kv} KV heads and "
        f"intermediate size {config.intermediate_size}: --tensor-parallel-size {tp_size} must "
        f"divide {heads} and {config.intermediate_size}, and divide {kv} or be a multiple of it "
        f"({' or '.join(map(str, valid))}).")


def vocab_rows_per_rank(vocab_size: int, tp_size: int, pad_to: int = VOCAB_PAD) -> int:
    """Rows each rank holds: an equal share of the vocabulary rounded up to `pad_to`, so the
    ranges are contiguous and equal (the last rank(s) hold the zero padding)."""
    share = -(-vocab_size // tp_size)
    return -(-share // pad_to) * pad_to


def tp_shard(config: DecoderConfig, tp_size: int, rank: int,
             model: str | None = None) -> TPShard:
    """Rank `rank`'s part of `config` split `tp_size` ways (ValueError if it does not split)."""
    check_tp_size(config, tp_size, model)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside tensor-parallel size {tp_size}.")
    kv = config.num_key_value_heads
    replicas = tp_size // kv if tp_size >= kv else 1
    assert config.head_dim is not None  # set by DecoderConfig.__post_init__
    return TPShard(
        tp_size=tp_size, rank=rank, head_dim=config.head_dim,
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=max(kv // tp_size, 1), kv_head_replicas=replicas,
        intermediate_size=config.intermediate_size // tp_size,
        vocab_size=config.vocab_size,
        vocab_per_rank=vocab_rows_per_rank(config.vocab_size, tp_size))


def shard_config(config: DecoderConfig, tp_size: int, rank: int,
                 model: str | None = None) -> DecoderConfig:
    """The config the rank's decoder is built with: its query heads, KV heads and intermediate
    size. hidden_size and head_dim stay whole (head_dim is written out, since hidden_size /
    local heads would be wrong). vocab_size stays the global vocabulary, which is what the
    gathered logits and the sampler see; the rank's rows are `tp_shard(...).vocab_start` to
    `vocab_end`, `vocab_per_rank` rows with padding."""
    shard = tp_shard(config, tp_size, rank, model)
    return dataclasses.replace(
        config, num_attention_heads=shard.num_heads, num_key_value_heads=shard.num_kv_heads,
        intermediate_size=shard.intermediate_size, head_dim=shard.head_dim)


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    # Cloned: a view would keep the whole unsharded tensor alive after the caller drops it.
    return t[start:start + count].clone()


def _cols(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[:, start:start + count].contiguous().clone()


def _split_rows(t: torch.Tensor, kind: str, s: TPShard) -> torch.Tensor:
    """A column-parallel linear's weight (or bias): the rank's output rows."""
    if kind == "q":
        return _rows(t, s.q_head_start * s.head_dim, s.num_heads * s.head_dim)
    if kind == "kv":
        return _rows(t, s.kv_head_start * s.head_dim, s.num_kv_heads * s.head_dim)
    assert kind == "mlp", kind
    return _rows(t, s.intermediate_start, s.intermediate_size)


def _split_row_parallel(t: torch.Tensor, kind: str, is_bias: bool, s: TPShard) -> torch.Tensor:
    """A row-parallel linear: the rank's input columns. Its bias, added after the all-reduce
    sums the ranks' partial outputs, must be counted once: rank 0 keeps it, others hold 0."""
    if is_bias:
        return t.clone() if s.rank == 0 else torch.zeros_like(t)
    if kind == "o":
        return _cols(t, s.q_head_start * s.head_dim, s.num_heads * s.head_dim)
    assert kind == "down", kind
    return _cols(t, s.intermediate_start, s.intermediate_size)


def _part_rows(config: DecoderConfig, part: str) -> int:
    """Rows of an unfused checkpoint linear, to cut a fused-on-disk tensor into its parts."""
    assert config.head_dim is not None
    kind = _SPLITS[part]
    if kind == "q":
        return config.num_attention_heads * config.head_dim
    if kind == "kv":
        return config.num_key_value_heads * config.head_dim
    return config.intermediate_size


def _shard_layer_tensor(name: str, t: torch.Tensor, config: DecoderConfig,
                        arch: type[LlamaForCausalLM], s: TPShard) -> torch.Tensor:
    """One tensor of a layer, `name` within the layer (e.g. "self_attn.q_proj.weight")."""
    if name.endswith(_REPLICATED_SUFFIXES):
        return t
    match = re.fullmatch(r"(.+)\.(weight|bias)", name)
    assert match is not None, name
    linear, is_bias = match.group(1), match.group(2) == "bias"
    if linear in arch.fused_on_disk:
        # Phi-3's qkv_proj / gate_up_proj: cut into the parts, split each, fuse again.
        parts = arch.packed_modules_mapping[linear]
        pieces = torch.split(t, [_part_rows(config, p) for p in parts])
        return torch.cat([_split_rows(piece, _SPLITS[p], s) for p, piece in zip(parts, pieces)])
    kind = _SPLITS.get(linear)
    if kind is None:
        # Refused, not replicated: a linear we do not know how to split would run wrong.
        raise ValueError(f"{arch.hf_architectures[0]}: no tensor-parallel rule for layer "
                         f"tensor {name!r}.")
    if kind in _ROW_PARALLEL:
        return _split_row_parallel(t, kind, is_bias, s)
    return _split_rows(t, kind, s)


def _shard_vocab(t: torch.Tensor, s: TPShard) -> torch.Tensor:
    """The rank's `vocab_per_rank` embedding / LM-head rows, zero rows past the vocabulary."""
    out = t.new_zeros((s.vocab_per_rank, *t.shape[1:]))
    real = s.vocab_end - s.vocab_start
    if real > 0:
        out[:real] = t[s.vocab_start:s.vocab_end]
    return out


def shard_weights(weights: Weights, config: DecoderConfig, arch: type[LlamaForCausalLM],
                  tp_size: int, rank: int) -> Weights:
    """Rank `rank`'s weights, under the same HF names, for a decoder built with
    `shard_config(config, tp_size, rank)`. `weights` (full, dense, as a loader returns them) is
    not changed; sharded tensors are copies, replicated ones the same objects.
    Tied embeddings: without lm_head.weight the decoder uses the embedding as its head, and the
    embedding's shard is the head's shard (the same rows), so nothing more is needed."""
    s = tp_shard(config, tp_size, rank)
    out: Weights = {}
    for name, t in weights.items():
        layer = _LAYER_TENSOR.match(name)
        if layer is not None:
            within = name[len(f"model.layers.{layer.group(1)}."):]
            out[name] = _shard_layer_tensor(within, t, config, arch, s)
            if _SPLITS.get(within.removesuffix(".weight")) in _ROW_PARALLEL:
                out[name.removesuffix(".weight") + ROW_ABSMAX] = t.float().abs().amax(dim=1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _shard_vocab(t, s)
        elif name.endswith(_REPLICATED_SUFFIXES):
            out[name] = t
        else:
            raise ValueError(f"{arch.hf_architectures[0]}: no tensor-parallel rule for "
                             f"tensor {name!r}.")
    return out


# ---- what the engine does around the collectives, as pure functions -------------------------
def local_token_ids(input_ids: torch.Tensor, s: TPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id in the rank's embedding shard, whether the rank holds it). Ids the rank
    does not hold look up row 0; the engine zeroes them with the mask before the all-reduce
    that sums the ranks' embeddings (each id is held by exactly one rank)."""
    held = (input_ids >= s.vocab_start) & (input_ids < s.vocab_end)
    return torch.where(held, input_ids - s.vocab_start, 0), held


def partial_embedding(embed_shard: torch.Tensor, input_ids: torch.Tensor,
                      s: TPShard) -> torch.Tensor:
    """The rank's share of the embedding lookup, [T, hidden]: its rows, zeros for ids other
    ranks hold. Summed over the ranks (all-reduce) it is the full lookup."""
    rows, held = local_token_ids(input_ids, s)
    return embed_shard[rows] * held.unsqueeze(-1).to(embed_shard.dtype)


def assemble_logits(rank_logits: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The full logits from each rank's [T, vocab_per_rank] (all-gathered, in rank order):
    concatenated, the padding rows' logits (all past the last real id) cut off."""
    return torch.cat(rank_logits, dim=-1)[..., :vocab_size]
