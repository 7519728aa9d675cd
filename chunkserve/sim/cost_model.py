"""How long a step takes, from its shape alone: the simulator's stand-in for the model.

Two models behind one interface, both returning a per-term breakdown whose sum is the step time:

- `RooflineCostModel` (a GPU from its datasheet, a model from its config):
    linear   = L · max(FLOPs(T_pad) / (peak · eff(T_pad)), weight bytes / (BW · bw_eff))
               with T_pad = T rounded up to the GEMM tile (to 16 below one tile) and
               eff(T) = e_max · T / (T + T_half)
    launch   = L · kernels_per_layer · launch_us
    attn     = prefill: Σ_layers Σ 4 · H · d · pairs_W(chunk, cached) / (peak · attn_eff)
               decode:  Σ_layers Σ min(context, W) · KV bytes/token/layer / (BW · bw_eff)
               with pairs_W(n, c) = ∫_c^{c+n} min(x, W) dx (= n · (c + n/2) below the window)
               and W a sliding-window layer's window (∞ for full attention: Gemma 3's global
               layers attend the whole context, its local ones at most W keys)
               mixed:   fused backend: +penalty · (prefill + decode) when both share the call;
                        split: none; pod: prefill and decode overlap, max() instead of sum
    lm_head  = max(2 · S · V · h / (peak · eff(S)), V · h · bytes / BW) for S sampled tokens
    comm     = 2 · L · (T · h · bytes · 2(tp−1)/tp / link + latency) when tp > 1
    overhead = step_overhead + request_overhead · requests
- `LinearCostModel` (a machine calibrated by `chunkserve profile`): the same terms as a sum of
  fitted coefficient × feature, which is what the CPU's step times follow. Its attention
  features are per layer, averaged over the layers (`attention_layers`; unchanged without
  windows), so one coefficient still prices a token pair whichever layer attends it.

KV capacity (`RooflineCostModel.kv_cache_blocks`): a block id holds `group_size` layers when the
model's layers are in KV-cache groups (core/kv_groups.py), every layer otherwise.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from chunkserve.core.chunk_budget import PlannedStep, StepTimeFn
from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
from chunkserve.sim.specs import AttentionLayers, HardwareSpec, ModelSpec

ATTENTION_BACKENDS = ("fused", "split", "pod")


@dataclass
class StepShape:
    """What a cost model sees of a step."""

    prefill: list[tuple[int, int]] = field(default_factory=list)  # (chunk tokens, cached before)
    decode_contexts: list[int] = field(default_factory=list)  # KV length each decode attends to
    num_sampled: int = 0

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> StepShape:
        return cls.from_scheduled(out.scheduled)

    @classmethod
    def from_scheduled(cls, scheduled: Sequence[ScheduledRequest]) -> StepShape:
        shape = cls()
        for sr in scheduled:
            if sr.is_decode:
                shape.decode_contexts.append(sr.start + 1)
            else:
                shape.prefill.append((sr.num_new_tokens, sr.start))
            shape.num_sampled += int(sr.samples)
        return shape

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + len(self.decode_contexts)

    @property
    def num_requests(self) -> int:
        return len(self.prefill) + len(self.decode_contexts)

    @property
    def prefill_attention_work(self) -> float:
        """Σ chunk · (cached + chunk/2): query-key pairs of causal chunked prefill."""
        return float(sum(n * (c + n / 2) for n, c in self.prefill))

    @property
    def decode_context(self) -> int:
        return sum(self.decode_contexts)

    def prefill_attention_work_within(self, window: int | None) -> float:
        """`prefill_attention_work` for a layer that attends at most `window` keys (None: full
        attention): the same continuous approximation, the key count capped at the window."""
        if window is None:
            return self.prefill_attention_work
        return float(sum(_windowed_pairs(n, c, window) for n, c in self.prefill))

    def decode_context_within(self, window: int | None) -> int:
        """`decode_context` for a layer that attends at most `window` keys (None: full)."""
        if window is None:
            return self.decode_context
        return sum(min(ctx, window) for ctx in self.decode_contexts)

    @property
    def is_mixed(self) -> bool:
        return bool(self.prefill) and bool(self.decode_contexts)


def _windowed_pairs(n: int, cached: int, window: int) -> float:
    """∫_c^{c+n} min(x, W) dx: query-key pairs of a chunk of n tokens after c cached, each query
    attending at most W keys (n · (c + n/2) when the chunk ends inside the window)."""
    end = cached + n
    if end <= window:
        return n * (cached + n / 2)
    if cached >= window:
        return float(n * window)
    return (window * window - cached * cached) / 2 + (end - window) * window


def mean_over_layers(value: Callable[[int | None], float], layers: AttentionLayers | None
                     ) -> float:
    """A per-layer attention quantity averaged over the layers, `value(window)` for each kind;
    `value(None)` itself without windows (so models without them keep their exact numbers)."""
    if layers is None:
        return value(None)
    total = sum(n for _, n in layers)
    return sum(n * value(window) for window, n in layers) / total


class CostModel(Protocol):
    def breakdown(self, shape: StepShape) -> dict[str, float]: ...


@dataclass
class ScaledCostModel:
    """Another cost model's steps, every term `factor`× as long: the machine slower (or faster)
    than its profile says, as a shared or drifting host often is."""

    base: CostModel
    factor: float

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        return {k: v * self.factor for k, v in self.base.breakdown(shape).items()}


def step_time(model: CostModel, shape: StepShape) -> float:
    return sum(model.breakdown(shape).values())


def planned_shape(step: PlannedStep) -> StepShape:
    """A planned step as a shape: decode context spread evenly (a model without windows only
    sums it; a sliding window caps each context, and min(·, W) of the mean is at least the mean
    of min(·, W): a windowed model's plan errs long, the safe side), the chunk as one prefill
    that samples (the dearer case: it may finish its prompt)."""
    n = step.num_decodes
    contexts = [step.decode_context // n + (i < step.decode_context % n) for i in range(n)]
    prefill = [(step.num_prefill_tokens, step.prefill_context)] if step.num_prefill_tokens else []
    return StepShape(prefill, contexts, n + int(bool(prefill)))


def planned_step_time(model: CostModel) -> StepTimeFn:
    """The scheduler's step-time callable (core/chunk_budget.py) for a cost model."""
    return lambda step: step_time(model, planned_shape(step))


@dataclass
class RooflineCostModel:
    hw: HardwareSpec
    model: ModelSpec
    tensor_parallel_size: int = 1
    attention_backend: str = "fused"

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        tp = self.tensor_parallel_size
        if self.model.num_key_value_heads % tp and tp % self.model.num_key_value_heads:
            raise ValueError(f"{self.model.num_key_value_heads} KV heads do not shard over tp={tp}")

    def _gemm_time(self, rows: int, params: float) -> float:
        """One GEMM of `rows` tokens against `params` weights, compute- or bandwidth-bound."""
        if rows <= 0:
            return 0.0
        hw = self.hw
        # A partial tile costs a whole one. Small GEMMs (decode batches) run kernels with small
        # M tiles, so below one tile only the MMA granule of 16 rows is padded.
        tile = hw.gemm_tile if rows > hw.gemm_tile else 16
        padded = math.ceil(rows / tile) * tile
        eff = hw.gemm_efficiency * padded / (padded + hw.gemm_half_tokens)
        compute = 2.0 * padded * params / (hw.peak_flops * eff)
        memory = params * self.model.dtype_bytes / (hw.bandwidth * hw.bandwidth_efficiency)
        return max(compute, memory)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        hw, m, tp = self.hw, self.model, self.tensor_parallel_size
        L = m.num_hidden_layers
        T = shape.num_tokens
        heads = m.num_attention_heads / tp
        kv_shards = min(tp, m.num_key_value_heads)
        bw = hw.bandwidth * hw.bandwidth_efficiency
        # Each kind of layer (full, or one window) for its own key counts; a model without
        # windows is one kind of L layers, the same products in the same order as before.
        kinds = m.attention_layers
        prefill_attn = sum(
            4.0 * heads * m.dim * shape.prefill_attention_work_within(window) * n
            for window, n in kinds
        ) / (hw.peak_flops * hw.attention_efficiency)
        decode_attn = sum(
            shape.decode_context_within(window) * (m.kv_bytes_per_token_of(n) / kv_shards)
            for window, n in kinds
        ) / bw
        if self.attention_backend == "pod":
            attention, mixed = max(prefill_attn, decode_attn), 0.0
        else:
            attention = prefill_attn + decode_attn
            penalty = hw.mixed_batch_penalty if self.attention_backend == "fused" else 0.0
            mixed = penalty * attention if shape.is_mixed else 0.0
        comm = 0.0
        if tp > 1 and T:
            volume = T * m.hidden_size * m.dtype_bytes * 2 * (tp - 1) / tp
            comm = 2 * L * (volume / (hw.link_gbps * 1e9) + hw.allreduce_latency_us * 1e-6)
        return {
            "linear": L * self._gemm_time(T, m.layer_params / tp),
            "launch": L * hw.kernels_per_layer * hw.launch_us * 1e-6 if T else 0.0,
            "attention": attention,
            "mixed_penalty": mixed,
            "lm_head": self._gemm_time(shape.num_sampled, m.head_params / tp),
            "communication": comm,
            "overhead": (hw.step_overhead_ms * 1e-3 + hw.request_overhead_us * 1e-6
                         * shape.num_requests) if T else 0.0,
        }

    def kv_cache_blocks(self, block_size: int, groups: KVCacheGroups | None = None) -> int:
        """(memory · utilization − weights − activations) / bytes per block. A block id holds
        K and V of `block_size` tokens for `groups.group_size` layers (a sliding-window model's
        groups, as the engine's runner allocates them), for every layer without groups."""
        hw, m, tp = self.hw, self.model, self.tensor_parallel_size
        gib = 1 << 30
        free = hw.memory_gib * gib * hw.gpu_memory_utilization
        free -= m.weight_bytes / tp + hw.activation_reserve_gib * gib
        layers = m.num_hidden_layers if groups is None else groups.group_size
        per_token = m.kv_bytes_per_token_of(layers) / min(tp, m.num_key_value_heads)
        blocks = int(free // (per_token * block_size))
        if blocks < 1:
            raise ValueError(f"{m.name} does not fit on {hw.name} with tp={tp}: no room for KV")
        return blocks


# The features of a calibrated model, in the order calibration fits them.
LINEAR_FEATURES = (
    "step", "request", "token", "small_gemm", "prefill_attention", "chunk_attention",
    "decode_context", "sampled", "mixed",
)
# GEMMs of few rows run below peak efficiency: the first SMALL_GEMM_ROWS tokens of a step each
# pay an extra `small_gemm` cost (a piecewise-linear stand-in for the roofline's eff(T)).
SMALL_GEMM_ROWS = 256


def linear_features(shape: StepShape, layers: AttentionLayers | None = None
                    ) -> dict[str, float]:
    """The calibrated model's features of a step. `layers`: a sliding-window model's kinds of
    layer (ModelSpec.attention_layers); its attention features are then the mean over layers of
    each one's windowed work. None: every layer full, the features as they always were."""
    if not shape.num_tokens:
        return dict.fromkeys(LINEAR_FEATURES, 0.0)
    first = StepShape(prefill=[p for p in shape.prefill if p[1] == 0])
    chunks = StepShape(prefill=[p for p in shape.prefill if p[1] > 0])
    decode = float(mean_over_layers(shape.decode_context_within, layers))
    return {
        "step": 1.0,
        "request": float(shape.num_requests),
        "token": float(shape.num_tokens),
        "small_gemm": float(min(shape.num_tokens, SMALL_GEMM_ROWS)),
        # A chunk after cached context needs an explicit mask (the CPU's fused kernel is slower
        # that way than with is_causal), so the two kinds of prefill get separate coefficients.
        "prefill_attention": mean_over_layers(first.prefill_attention_work_within, layers),
        "chunk_attention": mean_over_layers(chunks.prefill_attention_work_within, layers),
        "decode_context": decode,
        "sampled": float(shape.num_sampled),
        # Mixed steps' extra attention cost, if the backend has any.
        "mixed": decode if shape.is_mixed else 0.0,
    }


@dataclass
class LinearCostModel:
    coefficients: dict[str, float]  # seconds per unit of each feature
    name: str = "calibrated"
    # The features' kinds of layer (linear_features); must be what the fit used. None: full.
    attention_layers: AttentionLayers | None = None

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        feats = linear_features(shape, self.attention_layers)
        return {k: self.coefficients.get(k, 0.0) * v for k, v in feats.items()}
