"""Scheduler output → tensors → tokens. Owns the model, the paged KV tensors and the swap pool."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from chunkserve.config import DEFAULT_KV_CACHE_GIB, EngineConfig
from chunkserve.core.kv_groups import KVCacheGroups, group_layers, single_group
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
from chunkserve.engine.cuda_graph import CUDAGraphRunner, capture_sizes
from chunkserve.engine.executor import RunnerOutput
from chunkserve.engine.input_batch import build_layout, sample_rows
from chunkserve.engine.sampler import Sampler, SamplingRow, logprob_entries
from chunkserve.model.attention.backend import KV_DTYPE_BY_NAME
from chunkserve.model.batch import BatchLayout, BatchTensors, DeviceStager, PerLayer
from chunkserve.model.fused_decode import FusedDecodeStack
from chunkserve.model.models.interface import CausalLM

logger = logging.getLogger(__name__)


def kv_cache_dtype(model: CausalLM, name: str = "auto") -> torch.dtype:
    """The KV cache's torch dtype for `--kv-cache-dtype name`; a ValueError where the model's
    attention backend cannot read it."""
    if name == "auto":
        return model.kv_dtype
    dtype = KV_DTYPE_BY_NAME[name]
    if dtype is not model.kv_dtype and not model.attn.supports_narrow_kv_cache:
        raise ValueError(f"--kv-cache-dtype {name} is not supported by the {model.attn.name!r} "
                         "attention backend; use --attention-backend cpu or torch, or "
                         "--kv-cache-dtype auto.")
    return dtype


def kv_cache_groups(model: CausalLM, hybrid: bool = True) -> KVCacheGroups:
    """The model's layers in KV-cache groups, by attention window (core/kv_groups.py); one
    group for all when not `hybrid` (--disable-hybrid-kv-cache-manager)."""
    return group_layers(model.layer_windows()) if hybrid else single_group(len(model.layers))


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype | None = None,
                       hybrid: bool = True) -> int:
    """Bytes of one block id of the pool: K and V of `block_size` tokens for a group's layers
    (every layer, for a model that is one group)."""
    elem = torch.empty((), dtype=dtype or model.kv_dtype).element_size()
    layers = kv_cache_groups(model, hybrid).group_size
    return 2 * layers * model.num_kv_heads * model.head_dim * elem * block_size


GiB = 1 << 30


class ModelRunner:
    """The real model as the engine's `Executor`."""

    def __init__(
        self,
        model: CausalLM,
        num_kv_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        *,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
        hybrid_kv_cache: bool = True,
    ) -> None:
        """`kv_dtype`: the KV cache's (kv_cache_dtype()); None: the model's. `hybrid_kv_cache`:
        sliding-window layers in their own KV-cache groups (else one table for all layers)."""
        self.model = model
        self.kv_dtype = kv_dtype or model.kv_dtype
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.num_swap_blocks = num_swap_blocks
        self.kv_cache_groups = kv_cache_groups(model, hybrid_kv_cache)
        # One tensor pair per slot of a page: the layers of different groups share them, each
        # group in the block ids it was given, so a block id costs `group_size` layers' KV.
        shape = (self.kv_cache_groups.group_size, 2, num_kv_blocks, block_size,
                 model.num_kv_heads, model.head_dim)
        # torch.empty leaves pages untouched until written: a large pool costs nothing up front.
        self.device = model.device
        self.kv_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        slots = self.kv_cache_groups.slot_of_layer()
        # Each layer's attention metadata is that of its (group, window): the group says where
        # its K/V live, the window how far back it reads (the same unless one group for all).
        self.layer_attention = [(slots[i][0], w) for i, w in enumerate(model.layer_windows())]
        # The distinct (group, window) pairs, each one build_metadata a step; [(0, None)] for a
        # model of one full-attention group (every model but the sliding-window ones).
        self._attention_kinds = list(dict.fromkeys(self.layer_attention))
        self.kv_caches = [(self.kv_cache[slots[i][1], 0], self.kv_cache[slots[i][1], 1])
                          for i in range(len(model.layers))]
        swap_shape = (shape[0], 2, num_swap_blocks) + shape[3:]
        # The swap pool is host memory whatever the device (pinned on CUDA for fast copies).
        pin = self.device.type == "cuda"
        self.swap_cache = (
            torch.empty(swap_shape, dtype=self.kv_dtype, pin_memory=pin)
            if num_swap_blocks else None
        )
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.stager = DeviceStager(self.device)
        self.graphs = self._capture_graphs(enforce_eager, max_num_seqs, max_model_len)
        # The CPU's counterpart: a decode step's layers as one C call, where the model allows
        # (all layers on one block table and window: one attention metadata a step).
        self.fused_decode = (None if enforce_eager or self.device.type != "cpu"
                             or len(self._attention_kinds) != 1
                             else FusedDecodeStack.build(model, self.kv_caches))

    @classmethod
    def from_config(cls, model: CausalLM, config: EngineConfig) -> ModelRunner:
        """Sizes the KV pool (and the swap pool) from the cache config and the model's shape."""
        cc = config.cache_config
        kv_dtype = kv_cache_dtype(model, cc.kv_cache_dtype)
        hybrid = not cc.disable_hybrid_kv_cache_manager
        block_bytes = kv_bytes_per_block(model, cc.block_size, kv_dtype, hybrid)
        kv_gib = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_KV_CACHE_GIB
        num_blocks = cc.num_kv_blocks or int(kv_gib * GiB // block_bytes)
        num_swap = int(cc.swap_space * GiB // block_bytes) if cc.preemption_mode == "swap" else 0
        return cls(
            model, num_blocks, cc.block_size, num_swap,
            enforce_eager=config.model_config.enforce_eager,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=config.max_model_len,
            kv_dtype=kv_dtype, hybrid_kv_cache=hybrid,
        )

    def commit_kv_memory(self) -> None:
        """Writes the KV pools once, so all their memory is resident from now on.

        The pools are allocated untouched (free until used, right for a short benchmark), and
        block placement walks the whole pool over time, so a long-running server's RSS climbed
        by up to the pool's size (2 GiB by default) for as long as it served: indistinguishable
        from a leak, and an out-of-memory that hits hours in rather than at startup.
        """
        for pool in (self.kv_cache, self.swap_cache):
            if pool is not None:
                pool.zero_()

    def close(self) -> None:
        pass  # tensors only: freed with the runner

    def _capture_graphs(
        self, enforce_eager: bool, max_num_seqs: int, max_model_len: int | None
    ) -> CUDAGraphRunner | None:
        """CUDA graphs for decode steps, where they can run: on CUDA, with a graph-safe
        attention backend, unless --enforce-eager (the CPU's counterpart: fused_decode)."""
        if enforce_eager or self.device.type != "cuda" or not self.model.attn.supports_cuda_graphs:
            return None
        if self._attention_kinds != [(0, None)]:
            return None  # the graphs are captured over one block table, without a window
        if getattr(self.model, "tp_shard", None) is not None:  # set by tp_layers.parallelize
            # NCCL's collectives inside a captured graph have not been run on GPUs here yet.
            logger.info("CUDA graphs off under tensor parallelism: decode steps run eagerly")
            return None
        max_len = max_model_len or self.model.rope.max_positions
        graphs = CUDAGraphRunner(
            self.model, self.kv_caches, self.stager, capture_sizes(max_num_seqs),
            -(-max_len // self.block_size), self.block_size,
        )
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one step; returns the sampled token of every request that caught up."""
        for rid in out.finished_req_ids:
            self._generators.pop(rid, None)
        self._swap(out)
        if not out.scheduled:
            return RunnerOutput()
        layout = build_layout(out.scheduled, self.block_size)
        hidden = self._forward(out.scheduled, layout)
        prompt_logprobs = self._prompt_logprobs(out, layout, hidden)
        samplers = [sr for sr in out.scheduled if sr.samples]
        if not samplers:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        rows = torch.from_numpy(sample_rows(out.scheduled, layout)).to(self.device)
        logits = self.model.compute_logits(hidden[rows])
        masks = out.grammar_bitmask
        result = self.sampler(logits, [self._row(sr.request, masks.get(sr.request.request_id))
                                       for sr in samplers])
        ids = [sr.request.request_id for sr in samplers]
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp}
        failed = {ids[i]: error for i, error in result.failed.items()}
        sampled = {rid: t for i, (rid, t) in enumerate(zip(ids, result.token_ids))
                   if i not in result.failed}
        return RunnerOutput(sampled, logprobs, prompt_logprobs, result.grammar_time, failed)

    # Rows of full-vocab logits computed at once for prompt logprobs: bounds a long chunk's memory.
    PROMPT_LOGPROBS_ROWS = 512

    def _prompt_logprobs(
        self, out: SchedulerOutput, layout: BatchLayout, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[list[tuple[int, float]]]]]:
        """Prompt logprobs of this step's prefill chunks that asked (vLLM's prompt_logprobs).

        The hidden state at prompt position p predicts prompt token p + 1, so a chunk over
        positions [s, e) yields the entries of tokens s+1 .. min(e, num_prompt_tokens - 1).
        Only requests with no output token yet: one that has any had every prompt position
        recorded already (a recompute after preemption would only redo them). Other requests
        cost nothing: no logits beyond their sampling row.
        """
        spans: list[tuple[str, int, int, int]] = []  # (request id, first token, rows, top-k)
        rows: list[np.ndarray] = []
        targets: list[int] = []
        for i, sr in enumerate(out.scheduled):
            req = sr.request
            k = req.sampling_params.prompt_logprobs
            if k is None or req.output_token_ids:
                continue
            end = min(sr.start + sr.num_new_tokens, req.num_prompt_tokens - 1)
            if end <= sr.start:
                continue
            first_row = int(layout.query_start_loc[i])
            rows.append(np.arange(first_row, first_row + end - sr.start))
            targets += req.prompt_token_ids[sr.start + 1 : end + 1]
            spans.append((req.request_id, sr.start + 1, end - sr.start, k))
        if not spans:
            return {}
        all_rows = torch.from_numpy(np.concatenate(rows)).to(self.device)
        top_ks = [k for _, _, count, k in spans for _ in range(count)]
        entries: list[list[tuple[int, float]]] = []
        step = self.PROMPT_LOGPROBS_ROWS
        for lo in range(0, len(targets), step):
            logits = self.model.compute_logits(hidden[all_rows[lo : lo + step]])
            entries += logprob_entries(logits, targets[lo : lo + step], top_ks[lo : lo + step])
        result = {}
        pos = 0
        for rid, first, count, _ in spans:
            result[rid] = (first, entries[pos : pos + count])
            pos += count
        return result

    def hidden_states(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The final-norm hidden states of a step, without sampling (tests, references)."""
        return self._forward(scheduled, build_layout(scheduled, self.block_size))

    def _forward(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> torch.Tensor:
        if self.graphs is not None:
            hidden = self.graphs.run(layout)
            if hidden is not None:
                return hidden
        batch = self.stager.to_device(layout)
        if self._attention_kinds == [(0, None)]:
            meta = self.model.attn.build_metadata(batch)
        else:
            by_kind = {(g, w): self.model.attn.build_metadata(
                self._group_batch(scheduled, batch, g), w) for g, w in self._attention_kinds}
            meta = PerLayer(by_kind[kind] for kind in self.layer_attention)
        if self.fused_decode is not None:
            hidden = self.fused_decode.run(batch.input_ids, batch.positions, meta)
            if hidden is not None:
                return hidden
        return self.model.forward(batch.input_ids, batch.positions, self.kv_caches, meta)

    def _group_batch(self, scheduled: list[ScheduledRequest], batch: BatchTensors,
                     group: int) -> BatchTensors:
        """The step's tensors with KV-cache group `group`'s block tables and slot mapping.
        Plain copies, not the stager's: its one pinned buffer may still be in flight."""
        if group == 0:
            return batch
        layout = build_layout(scheduled, self.block_size, group)
        return replace(batch, layout=layout, packed=None,
                       slot_mapping=torch.from_numpy(layout.slot_mapping).to(self.device),
                       block_table=torch.from_numpy(layout.block_table).to(self.device))

    def _row(self, req, allowed=None) -> SamplingRow:  # type: ignore[no-untyped-def]
        params = req.sampling_params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator().manual_seed(params.seed)
                self._generators[req.request_id] = gen
        return SamplingRow(params, gen, req.num_output_tokens, req.eos_token_ids,
                           req.prompt_token_ids, req.output_token_ids, allowed)

    def _swap(self, out: SchedulerOutput) -> None:
        if not (out.blocks_to_swap_out or out.blocks_to_swap_in):
            return
        assert self.swap_cache is not None, "swap requested without a swap pool"
        # Out before in: a block freed by a swap-out may be the target of a swap-in.
        if out.blocks_to_swap_out:
            dev, host = zip(*out.blocks_to_swap_out)
            self.swap_cache[:, :, list(host)] = self.kv_cache[:, :, list(dev)].cpu()
        if out.blocks_to_swap_in:
            host, dev = zip(*out.blocks_to_swap_in)
            self.kv_cache[:, :, list(dev)] = self.swap_cache[:, :, list(host)].to(self.device)
