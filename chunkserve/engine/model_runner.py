"""Scheduler output → tensors → tokens. Owns the model, the paged KV tensors and the swap pool."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.engine.sampler import Sampler, SamplingRow
from chunkserve.model.attention import AttentionMetadata, SeqSpan, block_runs, causal_mask
from chunkserve.model.llama import LlamaModel


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    elem = torch.empty((), dtype=model.kv_dtype).element_size()
    per_token = 2 * len(model.layers) * model.num_kv_heads * model.head_dim * elem
    return per_token * block_size


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    # request id -> [(sampled token, logprob), *top-k (token, logprob)], only when asked for
    logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_kv_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        shape = (len(model.layers), 2, num_kv_blocks, block_size, model.num_kv_heads, model.head_dim)
        # torch.empty leaves pages untouched until written: a large pool costs nothing up front.
        self.device = model.device
        self.kv_cache = torch.empty(shape, dtype=model.kv_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])]
        swap_shape = (shape[0], 2, num_swap_blocks) + shape[3:]
        # The swap pool is host memory whatever the device (pinned on CUDA for fast copies).
        pin = self.device.type == "cuda"
        self.swap_cache = (
            torch.empty(swap_shape, dtype=model.kv_dtype, pin_memory=pin)
            if num_swap_blocks else None
        )
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one step; returns the sampled token of every request that caught up."""
        for rid in out.finished_req_ids:
            self._generators.pop(rid, None)
        self._swap(out)
        if not out.scheduled:
            return RunnerOutput()

        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqSpan] = []
        sample_rows: list[int] = []  # flat index of the last token of each sampling request
        bs = self.block_size
        for sr in out.scheduled:
            n, start = sr.num_new_tokens, sr.start
            table = sr.block_table
            q_start = len(token_ids)
            token_ids += sr.token_ids
            pos = range(start, start + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            ctx = start + n
            mask = causal_mask(start, n, self.device) if n > 1 and start > 0 else None
            seqs.append(SeqSpan(q_start, n, ctx, block_runs(table, -(-ctx // bs)), mask))
            if sr.samples:
                sample_rows.append(q_start + n - 1)

        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), seqs)
        hidden = self.model.forward(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        samplers = [sr for sr in out.scheduled if sr.samples]
        if not samplers:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[sample_rows])
        rows = [self._row(sr.request) for sr in samplers]
        result = self.sampler(logits, rows)
        ids = [sr.request.request_id for sr in samplers]
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs)

    def _row(self, req) -> SamplingRow:  # type: ignore[no-untyped-def]
        params = req.sampling_params
        gen = None
        if params.seed is not None and not params.greedy:
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator().manual_seed(params.seed)
                self._generators[req.request_id] = gen
        return SamplingRow(params, gen, req.num_output_tokens, req.eos_token_ids)

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
