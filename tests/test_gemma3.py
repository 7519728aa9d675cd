"""Gemma 3 (text) from HF safetensors folders against transformers, on tiny random models
(tests/arch_models.py's WINDOWED, window 32) and prompts several windows long: logits on every
attention backend and both layer-op paths, bfloat16, greedy tokens under every scheduling
condition with the sliding-window KV-cache groups freeing blocks (and bounded while they do),
and clear refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from arch_models import WINDOWED_VARIANTS, hf_model, save_hf_folder
from chunkserve import LLM, SamplingParams
from chunkserve.core.kv_cache import NULL_BLOCK
from chunkserve.engine.model_runner import kv_cache_groups
from chunkserve.model.factory import LoadedModel, load_model
from chunkserve.model.layers.layer_ops import CpuLayerOps, TorchLayerOps
from chunkserve.layer_types import layer_types
from chunkserve.model.models.gemma3 import _rope_settings
from chunkserve.model.models.registry import config_from_hf
from test_model_parity import full_logits

WINDOW = 32  # arch_models' Gemma 3 window
BLOCK = 16
PROMPT = [(37 * i + 11) % 500 + 3 for i in range(3 * WINDOW + 7)]  # several windows long
NAMES = ["gemma3", *WINDOWED_VARIANTS, "gemma3-v4-config"]


def _v4_config(folder: Path) -> None:
    """The config.json as transformers 4 wrote it (and google/gemma-3-270m has it): top-level
    rope_theta / rope_local_base_freq / rope_scaling, the layer pattern as
    sliding_window_pattern. transformers 5 still reads it, so it stays the reference."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]  # [sliding, full, sliding]: every 2nd layer full
    config.update(sliding_window_pattern=2, rope_theta=rope["full_attention"]["rope_theta"],
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    out = {name: save_hf_folder(hf_model(name), root / name) for name in NAMES[:-1]}
    out["gemma3-v4-config"] = save_hf_folder(hf_model("gemma3-linear"), root / "v4")
    _v4_config(out["gemma3-v4-config"])
    return out


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, folder in folders.items():
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            refs[name] = hf(torch.tensor([PROMPT])).logits[0]
    return refs


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-4 of the largest logit, as tests/test_architectures.py."""
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def _ops(kind: str) -> TorchLayerOps | CpuLayerOps:
    return TorchLayerOps() if kind == "torch" else CpuLayerOps()


# (model, attention backend, layer ops): every model on both CPU paths; the Triton interpreter,
# slow, once per head size.
CASES = [(name, backend, ops) for name in NAMES for backend in ("torch", "cpu")
         for ops in ("c", "torch")] + [("gemma3", "triton", "torch"),
                                       ("gemma3-256", "triton", "torch")]


@pytest.mark.parametrize("name, backend, ops", CASES)
def test_logits_match_transformers(folders, references, name, backend, ops):
    """Chunks of 5 (a chunk after a cached prefix), then single-token decodes, through the C
    layer ops (1+w folded into every norm) and PyTorch's; head sizes 32 and 256; a prompt
    three windows long, so the sliding layers' windows move within chunks and decodes; linear
    RoPE scaling of the global layers; final logit softcapping; both config.json formats."""
    # The CPU paths on the CPU whatever the host; Triton where it runs (its interpreter here).
    device = "auto" if backend == "triton" else "cpu"
    loaded = load_model(str(folders[name]), "float32", device=device,
                        attention_backend=backend)
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    loaded.model.ops = _ops(ops)
    ref = references[name]
    _assert_close(full_logits(loaded.model, PROMPT, chunk=5), ref)
    decodes = 4 if backend == "triton" else len(PROMPT)
    _assert_close(full_logits(loaded.model, PROMPT[:decodes], chunk=1), ref[:decodes])


@pytest.mark.parametrize("ops", ["c", "torch"])
def test_bfloat16_tracks_float32(folders, references, ops):
    """bfloat16 weights and activations (the CPU default with AVX512_BF16): the embedding scale
    in bfloat16 as transformers does, the folded norms in float32, head size 256."""
    model = load_model(str(folders["gemma3-256"]), "bfloat16", device="cpu",
                       attention_backend="cpu").model
    model.ops = _ops(ops)
    for chunk in (8, 1):
        # Within the window: past it, transformers' own bfloat16 run drifts to a cosine of
        # 0.81 on these random weights, so the comparison would say nothing.
        got = full_logits(model, PROMPT[:WINDOW - 4], chunk=chunk)
        ref = references["gemma3-256"][:WINDOW - 4]
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert cos.min().item() > 0.98, (chunk, cos.min().item())


def test_sliding_layers_are_kv_cache_groups_and_the_context_is_whole(folders):
    """The window no longer caps the context: the sliding layers get their own KV-cache
    groups (layers [sliding, full, sliding]: three groups of one layer, the full one first)."""
    loaded = load_model(str(folders["gemma3"]), "float32")
    assert loaded.max_model_len == loaded.config.max_position_embeddings == 512
    assert loaded.config.sliding_window == WINDOW
    groups = kv_cache_groups(loaded.model)
    assert groups.windows == (None, WINDOW, WINDOW)
    assert groups.layers == ((1,), (0,), (2,)) and groups.group_size == 1


@pytest.mark.parametrize("context", [WINDOW, WINDOW - 12])
def test_a_window_as_long_as_the_context_or_longer_is_full_attention(folders, references,
                                                                     context):
    """A context no longer than the window never slides: one group, full attention, and the
    same logits as transformers."""
    loaded = load_model(str(folders["gemma3"]), "float32", max_model_len=context)
    groups = kv_cache_groups(loaded.model)
    assert groups.windows == (None,) and groups.num_groups == 1
    _assert_close(full_logits(loaded.model, PROMPT[:context], chunk=5),
                  references["gemma3"][:context])


@pytest.mark.parametrize("window", [0, -4])
def test_a_window_that_is_not_positive_is_refused(window):
    hf = json.loads(json.dumps(hf_model("gemma3").config.to_dict()))
    hf["sliding_window"] = window
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        config_from_hf(hf)


def test_only_full_attention_layers_keep_the_whole_context():
    hf = json.loads(json.dumps(hf_model("gemma3").config.to_dict()))
    hf["layer_types"] = ["full_attention"] * 3
    assert config_from_hf(hf).max_position_embeddings == 512


# ---- greedy tokens never depend on scheduling -------------------------------------------------
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tokens(loaded: LoadedModel, prompts: list[list[int]], **kwargs: object) -> tuple[list, LLM]:
    llm = LLM(loaded=loaded, dtype="float32", model=loaded.path, **kwargs)
    peak = watch_window_blocks(llm)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    budget = llm.engine.config.scheduler_config.max_num_batched_tokens
    if WINDOW in llm.engine.scheduler.kv.windows:
        assert 0 < peak[0] <= -(-(WINDOW - 1 + budget) // BLOCK) + 1, (peak, budget)
    return tokens, llm


def watch_window_blocks(llm: LLM) -> list[int]:
    """After every schedule(), the most blocks a sliding-window group's table of one request
    holds (its freed head is NULL_BLOCK holes): [peak], updated as the engine runs."""
    sched = llm.engine.scheduler
    schedule, peak = sched.schedule, [0]

    def checked():  # type: ignore[no-untyped-def]
        out = schedule()
        for tables in sched.kv.tables.values():
            for table, window in zip(tables, sched.kv.windows):
                if window is not None:
                    peak[0] = max(peak[0], sum(b != NULL_BLOCK for b in table))
        return out

    sched.schedule = checked  # type: ignore[method-assign]
    return peak


def test_greedy_tokens_identical_across_scheduling(folders):
    """Prompts up to ~4 windows long, a shared 48-token prefix (three blocks, more than a
    window) so prefix caching hits in every group; budgets below, at and above the window;
    preemption (recompute and swap) forced by a pool of 16 blocks for three groups; one table
    for all layers (--disable-hybrid-kv-cache-manager: the window masked, nothing freed); and
    the sliding groups' blocks bounded by ceil((W - 1 + chunk) / block_size) + 1 throughout."""
    loaded = load_model(str(folders["gemma3"]), "float32")
    prefix = [(53 * i + 7) % 500 + 3 for i in range(48)]
    prompts = [prefix + [5, 9, 40], prefix + [(29 * i) % 500 + 3 for i in range(60)],
               prefix + [5, 9, 40], [(31 * i + 2) % 500 + 3 for i in range(90)],
               [(41 * i + 2) % 500 + 3 for i in range(10)]]
    alone = [_tokens(loaded, [p], max_num_batched_tokens=256)[0][0] for p in prompts]
    short = dict(max_model_len=128, max_num_batched_tokens=8, num_kv_blocks=16)
    for kwargs in (dict(max_num_batched_tokens=8), dict(max_num_batched_tokens=WINDOW),
                   dict(max_num_batched_tokens=64),
                   dict(max_num_batched_tokens=8, enable_prefix_caching=False),
                   dict(max_num_batched_tokens=8, disable_hybrid_kv_cache_manager=True),
                   dict(short, preemption_mode="recompute"),
                   dict(short, preemption_mode="swap")):
        tokens, llm = _tokens(loaded, prompts, **kwargs)
        assert tokens == alone, kwargs
        sched = llm.engine.scheduler
        if "num_kv_blocks" in kwargs:
            assert sched.num_preemptions > 0
        if kwargs.get("enable_prefix_caching", True):
            assert sched.kv.prefix_stats.hits > 0, kwargs


def test_dummy_load_format_builds_gemma3(folders):
    """Random weights with unit norms as Gemma applies them (stored 0, since it scales by 1+w)."""
    loaded = load_model(str(folders["gemma3"]), "float32", load_format="dummy")
    assert torch.equal(loaded.model.norm, torch.ones(64))
    tokens, _ = _tokens(loaded, [PROMPT[:12]], max_num_batched_tokens=16)
    assert len(tokens[0]) == GREEDY.max_tokens


# ---- config.json fields -----------------------------------------------------------------------
def test_layer_pattern_and_rope_from_a_transformers_4_config():
    """google/gemma-3-270m's fields as its config.json has them."""
    hf = {"num_hidden_layers": 18, "sliding_window_pattern": 6, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "rope_scaling": None}
    types = layer_types(hf)
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17]
    assert _rope_settings(hf) == (1e6, None, 1e4)
    del hf["sliding_window_pattern"]  # transformers' default pattern is 6 too
    assert layer_types(hf) == types


@pytest.mark.parametrize("change, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping is not supported"),
    (dict(hidden_activation="gelu"),
     r"activation 'gelu' is not supported \(only gelu_pytorch_tanh\)"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    (dict(layer_types=["full_attention"]), "layer_types must list 3 entries"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "rope scaling on the sliding-window layers"),
])
def test_unbuilt_settings_are_refused(change, message):
    hf = json.loads(json.dumps(hf_model("gemma3").config.to_dict()))
    hf.update(change)
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_missing_feed_forward_norm_is_named(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gemma3"
    shutil.copytree(folders["gemma3"], folder)
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    tensors.pop("model.layers.2.post_feedforward_layernorm.weight")
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.2\."
                                         r"post_feedforward_layernorm\.weight'\]"):
        load_model(str(folder), "float32")
