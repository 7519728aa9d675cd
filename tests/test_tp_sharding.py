"""Tensor-parallel sharding (chunkserve/model/parallel.py) on tiny random transformers models of
every architecture: each rank's shards, run and combined as the engine will (concatenate
column-parallel outputs, sum row-parallel ones, sum masked embedding lookups, concatenate
logits), give the full model's outputs; plus the local configs and the refusals."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from arch_models import hf_model
from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import architecture
from chunkserve.model.parallel import (
    TPShard, assemble_logits, partial_embedding, shard_config, shard_weights, tp_shard,
    valid_tp_sizes, vocab_rows_per_rank)

# name -> tensor-parallel sizes its tiny config allows (heads: llama/phi3/gemma3 2 q + 1 kv,
# qwen2/qwen3 4 q + 2 kv, so 4 replicates each KV head on two ranks).
CASES = [("llama", 2), ("qwen2", 2), ("qwen2", 4), ("qwen3", 2), ("qwen3", 4), ("phi3", 2),
         ("gemma3", 2), ("mistral", 2)]
T = 7  # tokens


def _config(model) -> DecoderConfig:
    c = model.config
    return DecoderConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None), tie_word_embeddings=c.tie_word_embeddings,
        architecture=type(model).__name__)


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[DecoderConfig, dict[str, torch.Tensor]]]:
    out = {}
    for name in sorted({n for n, _ in CASES}):
        model = hf_model(name)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        out[name] = (_config(model), state)
    return out


def _shards(models, name: str, tp: int) -> tuple[DecoderConfig, dict, list[TPShard], list[dict]]:
    config, full = models[name]
    arch = architecture(config.architecture)
    plans = [tp_shard(config, tp, r) for r in range(tp)]
    return config, full, plans, [shard_weights(full, config, arch, tp, r) for r in range(tp)]


def _qkv(w: dict, p: str, cfg: DecoderConfig, heads: int, kv_heads: int, x: torch.Tensor):
    """q, k, v as [T, heads, head_dim] from a weights dict (fused on disk or not)."""
    hd = cfg.head_dim
    if f"{p}qkv_proj.weight" in w:
        out = x @ w[f"{p}qkv_proj.weight"].T
        q, k, v = out.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    else:
        q, k, v = (F.linear(x, w[f"{p}{n}_proj.weight"], w.get(f"{p}{n}_proj.bias"))
                   for n in "qkv")
    return q.view(T, heads, hd), k.view(T, kv_heads, hd), v.view(T, kv_heads, hd)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention, [T, heads * head_dim]: query head h reads KV head h // group."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)
    return out.transpose(0, 1).reshape(T, -1)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("name,tp", CASES)
def test_attention_reassembles(models, name, tp):
    """Per layer: each rank's q heads (with its own KV heads) concatenate to the full q; its
    attention over its KV heads, through its o_proj columns, sums to the full o_proj output."""
    config, full, plans, shards = _shards(models, name, tp)
    x = torch.randn(T, config.hidden_size)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v = _qkv(full, p, config, config.num_attention_heads, config.num_key_value_heads, x)
        ref = _attention(q, k, v) @ full[f"{p}o_proj.weight"].T
        partial_sum, local_qs = torch.zeros_like(ref), []
        for s, w in zip(plans, shards):
            lq, lk, lv = _qkv(w, p, config, s.num_heads, s.num_kv_heads, x)
            local_qs.append(lq)
            kv = slice(s.kv_head_start, s.kv_head_start + s.num_kv_heads)
            _close(lk, k[:, kv])
            _close(lv, v[:, kv])
            partial_sum += _attention(lq, lk, lv) @ w[f"{p}o_proj.weight"].T
        _close(torch.cat(local_qs, dim=1), q)
        _close(partial_sum, ref)


@pytest.mark.parametrize("name,tp", CASES)
def test_mlp_reassembles(models, name, tp):
    """gate/up outputs concatenate to the full ones; down's partial outputs sum to the full."""
    config, full, plans, shards = _shards(models, name, tp)
    x = torch.randn(T, config.hidden_size)

    def gate_up(w: dict, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        if f"{p}gate_up_proj.weight" in w:
            return (x @ w[f"{p}gate_up_proj.weight"].T).chunk(2, dim=-1)
        return x @ w[f"{p}gate_proj.weight"].T, x @ w[f"{p}up_proj.weight"].T

    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        gate, up = gate_up(full, p)
        ref = (F.silu(gate) * up) @ full[f"{p}down_proj.weight"].T
        parts = [gate_up(w, p) for w in shards]
        _close(torch.cat([g for g, _ in parts], dim=-1), gate)
        _close(torch.cat([u for _, u in parts], dim=-1), up)
        total = sum((F.silu(g) * u) @ w[f"{p}down_proj.weight"].T
                    for (g, u), w in zip(parts, shards))
        _close(total, ref)


@pytest.mark.parametrize("name,tp", CASES)
def test_vocab_parallel_embedding_and_logits(models, name, tp):
    """Masked lookups summed over ranks are the embedding; the ranks' logits concatenated and
    cut to the vocabulary are the full logits (tied models: from the embedding's shard)."""
    config, full, plans, shards = _shards(models, name, tp)
    embed = full["model.embed_tokens.weight"]
    ids = torch.tensor([0, 1, config.vocab_size - 1, 37, 300, 511, 256, 255])
    total = sum(partial_embedding(w["model.embed_tokens.weight"], ids, s)
                for s, w in zip(plans, shards))
    assert torch.equal(total, embed[ids])
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    hidden = torch.randn(T, config.hidden_size)
    ref = hidden @ full.get("lm_head.weight", embed).T
    rank_logits = [hidden @ w.get(head_name, w["model.embed_tokens.weight"]).T for w in shards]
    assert all(lg.shape == (T, plans[0].vocab_per_rank) for lg in rank_logits)
    _close(assemble_logits(rank_logits, config.vocab_size), ref)


@pytest.mark.parametrize("name,tp", CASES)
def test_shards_have_the_local_configs_shapes(models, name, tp):
    """Every sharded tensor has the shape a checkpoint of the rank's config would have (the
    vocabulary rows aside: vocab_per_rank); norms and q/k norms are the same tensors."""
    config, full, plans, shards = _shards(models, name, tp)
    for r, (s, w) in enumerate(zip(plans, shards)):
        local = shard_config(config, tp, r)
        expected = expected_shapes(dataclasses.replace(local, vocab_size=s.vocab_per_rank))
        assert set(w) >= set(expected)
        for key, shape in expected.items():
            assert tuple(w[key].shape) == shape, key
            if key.endswith("norm.weight"):
                assert w[key] is full[key]


def test_local_configs_head_counts() -> None:
    cfg = DecoderConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)
    local = shard_config(cfg, 2, 1)
    assert (local.num_attention_heads, local.num_key_value_heads) == (4, 2)
    assert (local.intermediate_size, local.head_dim, local.hidden_size) == (512, 64, 512)
    assert local.vocab_size == 1000  # the gathered logits' width stays global
    s = tp_shard(cfg, 2, 1)
    assert (s.q_head_start, s.kv_head_start, s.kv_head_replicas) == (4, 2, 1)
    # 1000 ids, 2 ranks: 500 each, padded to 512; rank 1 holds 512..999 and 24 zero rows.
    assert (s.vocab_per_rank, s.vocab_start, s.vocab_end) == (512, 512, 1000)
    assert vocab_rows_per_rank(1000, 3) == 384 and vocab_rows_per_rank(64, 4) == 64


def test_kv_heads_replicated_when_fewer_than_ranks() -> None:
    """8 query heads, 2 KV heads on 8 ranks: each KV head on 4 ranks, the one its queries use."""
    cfg = DecoderConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    plans = [tp_shard(cfg, 8, r) for r in range(8)]
    assert all(s.num_heads == 1 and s.num_kv_heads == 1 and s.kv_head_replicas == 4
               for s in plans)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    assert [s.kv_head_start for s in plans] == [s.q_head_start // group for s in plans]
    assert shard_config(cfg, 8, 5).num_key_value_heads == 1


@pytest.mark.parametrize("heads,kv,inter,tp,valid", [
    (9, 3, 1536, 2, "(1 or 3)"),  # SmolLM2-135M
    (8, 4, 1024, 3, "(1 or 2 or 4 or 8)"),
    (12, 4, 1024, 6, "(1 or 2 or 4)"),  # 6 divides 12 but neither divides 4 nor is a multiple
    (8, 8, 1000, 16, "(1 or 2 or 4 or 8)"),
])
def test_refuses_sizes_that_do_not_split(heads, kv, inter, tp, valid) -> None:
    cfg = DecoderConfig(vocab_size=100, hidden_size=heads * 8, intermediate_size=inter,
                        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv)
    with pytest.raises(ValueError) as e:
        shard_config(cfg, tp, 0, model="SmolLM2-135M")
    msg = str(e.value)
    assert f"{heads} attention heads, {kv} KV heads" in msg and valid in msg
    assert f"--tensor-parallel-size {tp}" in msg and "SmolLM2-135M" in msg
    assert ", ".join(map(str, valid_tp_sizes(cfg))) == valid.strip("()").replace(" or ", ", ")


def test_refuses_bad_rank_and_unknown_tensors(models) -> None:
    config, full = models["llama"]
    with pytest.raises(ValueError, match="rank 2"):
        tp_shard(config, 2, 2)
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        shard_weights({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}, config,
                      architecture(config.architecture), 2, 0)


class _BuildOnly:
    """A rank's collectives that are never called: enough to build its shard of a model."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not run")

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise AssertionError("not run")


def test_per_channel_int8_shards_are_one_process_levels(tiny_model_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantize, then shard: with one scale per output channel (PyTorch's int8 kernel, where
    AVX512_BF16 is missing), each rank's o_proj and down_proj hold one process's int8 levels
    and scales for their input columns, not levels re-scaled over those columns alone."""
    from chunkserve.model.factory import load_model
    from chunkserve.model.layers import group_gemm
    from chunkserve.model.layers.linear import TorchInt8

    monkeypatch.setattr(group_gemm, "available", lambda: None)
    load = dict(dtype="float32", quantization="int8")
    one = load_model(tiny_model_dir, **load).model  # type: ignore[arg-type]
    ranks = [load_model(tiny_model_dir, tp_group=_BuildOnly(r, 2), **load).model  # type: ignore[arg-type]
             for r in range(2)]
    for attr in ("o", "down"):
        whole = getattr(one.layers[0], attr).kernel
        assert isinstance(whole, TorchInt8)
        parts = [getattr(m.layers[0], attr).kernel for m in ranks]
        assert torch.equal(torch.cat([p.qweight for p in parts], dim=1), whole.qweight), attr
        for p in parts:
            assert torch.equal(p.scales, whole.scales), attr


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_tensors_are_read_once_when_taken(tiny_model_dir: str, tp: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights load lazily (model/loaders/lazy.py): loading checks shapes from the files'
    index and reads nothing; building the model (or a rank's shard of it) reads each tensor
    once, so the whole checkpoint is never held beside the model."""
    from safetensors import safe_open

    from chunkserve.model.factory import load_model
    from chunkserve.model.loaders import safetensors as st
    from chunkserve.model.loaders.source import load_weights

    reads: list[str] = []
    real = st._read_float32
    monkeypatch.setattr(st, "_read_float32",
                        lambda handle, name: reads.append(name) or real(handle, name))
    load_weights(tiny_model_dir)
    assert reads == []
    group = _BuildOnly(0, tp) if tp > 1 else None
    load_model(tiny_model_dir, dtype="float32", quantization="none", tp_group=group)
    import glob
    stored = set()
    for file in glob.glob(f"{tiny_model_dir}/*.safetensors"):
        stored |= set(safe_open(file, framework="pt").keys())
    assert sorted(reads) == sorted(stored)  # every tensor, each once
