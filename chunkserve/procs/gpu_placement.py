"""Which GPU each process of a node computes on (issue 30): arithmetic, testable without one.

A node's GPUs are handed out in order, as vLLM does: its data-parallel engine i takes GPUs
i*tp .. i*tp+tp-1, given to it as CUDA_VISIBLE_DEVICES (its tensor-parallel workers inherit
it), and within an engine, tensor-parallel rank r of this node computes on cuda:r. NCCL needs
one GPU per rank: two ranks on one GPU are refused here, not left to fail inside NCCL.
"""
from __future__ import annotations

import torch

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def engine_gpus(local_index: int, tp: int, num_engines: int, device_count: int,
                visible: str | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES value of this node's engine `local_index` (of `num_engines`,
    each of `tp` ranks), picked from `visible` (the node's own CUDA_VISIBLE_DEVICES, where
    set) or from GPUs 0..device_count-1."""
    gpus = ([g.strip() for g in visible.split(",") if g.strip()] if visible
            else [str(i) for i in range(device_count)])
    needed = num_engines * tp
    if needed > len(gpus):
        raise ValueError(f"{num_engines} data-parallel engine(s) of {tp} tensor-parallel "
                         f"rank(s) need {needed} GPUs on this node; it has {len(gpus)}")
    return ",".join(gpus[local_index * tp:(local_index + 1) * tp])


def rank_device(local_rank: int, ranks_on_node: int, device_count: int) -> torch.device:
    """The GPU of tensor-parallel rank `local_rank` of this node's `ranks_on_node`."""
    if ranks_on_node > device_count:
        raise ValueError(f"{ranks_on_node} tensor-parallel ranks on this node need a GPU "
                         f"each (NCCL), and torch sees {device_count}")
    return torch.device("cuda", local_rank)

