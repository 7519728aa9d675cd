"""Which GPU each process computes on (procs/gpu_placement.py, issue 30): the arithmetic and
its refusals, on any machine. The NCCL runs themselves are tests/test_cuda.py's, on two GPUs."""
from __future__ import annotations

import threading

import pytest
import torch

from chunkserve.config import EngineConfig
from chunkserve.procs.gpu_placement import engine_gpus, rank_device
from chunkserve.engine.tp.group import Rendezvous, TPGroup
from chunkserve.engine import core_proc as engine_proc


def test_engines_take_the_nodes_gpus_in_order() -> None:
    assert [engine_gpus(i, 2, 2, 4) for i in range(2)] == ["0,1", "2,3"]
    assert [engine_gpus(i, 1, 3, 8) for i in range(3)] == ["0", "1", "2"]
    # The node's own CUDA_VISIBLE_DEVICES is what is handed out, in its order.
    assert [engine_gpus(i, 2, 2, 4, visible="6, 7,4,5") for i in range(2)] == ["6,7", "4,5"]


def test_too_few_gpus_for_the_engines_is_refused() -> None:
    with pytest.raises(ValueError, match="2 data-parallel engine.* 2 tensor-parallel .* need 4 "
                                         "GPUs on this node; it has 3"):
        engine_gpus(0, 2, 2, 3)
    with pytest.raises(ValueError, match="need 2 GPUs on this node; it has 1"):
        engine_gpus(0, 1, 2, 8, visible="3")


def test_each_rank_its_own_gpu() -> None:
    assert rank_device(1, 2, 2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 tensor-parallel ranks on this node need a GPU each "
                                         r"\(NCCL\), and torch sees 1"):
        rank_device(0, 2, 1)


@pytest.mark.parametrize("nnodes, local_ranks", [(1, (0, 1)), (2, (0, 0))])
def test_group_knows_its_node_rank_and_stays_on_gloo_on_the_cpu(nnodes: int,
                                                                  local_ranks: tuple) -> None:
    """Two ranks on one node are GPUs 0 and 1 of it; over two nodes, each its node's first.
    On the CPU the model's collectives stay on gloo's group; asked for CUDA where there are
    too few GPUs, a clear refusal."""
    store = TPGroup.host_store("127.0.0.1", 2)
    rendezvous = Rendezvous("127.0.0.1", store.port, 2, nnodes)
    other: dict[str, TPGroup] = {}
    thread = threading.Thread(target=lambda: other.setdefault("g", TPGroup(rendezvous, 1)))
    thread.start()
    group = TPGroup(rendezvous, 0, store)
    thread.join(30)
    assert (group.local_rank, other["g"].local_rank) == local_ranks
    assert group.use_device(torch.device("cpu")) == torch.device("cpu")
    assert group.tensor_pg is group.pg
    if nnodes == 1 and torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="need a GPU each"):
            group.use_device(torch.device("cuda"))


def test_data_parallel_engines_on_the_cpu_get_no_gpus() -> None:
    config = EngineConfig.from_kwargs(model="tiny-llama", device="cpu", data_parallel_size=2)
    assert [s.gpus for s in engine_proc.engine_specs(config)] == [None, None]


def test_data_parallel_engines_on_gpus_get_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a node of 4 GPUs would hand them out (its device count stood in for)."""
    from chunkserve.model import factory

    monkeypatch.setattr(factory, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = EngineConfig.from_kwargs(model="tiny-llama", data_parallel_size=2,
                                      tensor_parallel_size=2)
    assert engine_proc.engine_gpu_lists(config, 2) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="need 6 GPUs"):
        engine_proc.engine_gpu_lists(config, 3)


def test_on_cuda_the_models_collectives_move_to_an_nccl_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring, with NCCL and two GPUs stood in for (this torch build has neither): rank 1
    of a node takes cuda:1, and its tensors' group is NCCL's, on the store under its own
    prefix, with the collective timeout; gloo's group stays for the scheduler's output."""
    import torch.distributed as dist

    from chunkserve.engine.tp import group as tp_group

    made: dict[str, object] = {}

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store: object, rank: int, size: int, options: object) -> None:
            made.update(store=store, rank=rank, size=size, options=options)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.setdefault("set", d))
    store = TPGroup.host_store("127.0.0.1", 2)
    rendezvous = Rendezvous("127.0.0.1", store.port, 2)
    other: dict[str, TPGroup] = {}
    thread = threading.Thread(target=lambda: other.setdefault("g", TPGroup(rendezvous, 0, store)))
    thread.start()
    group = TPGroup(rendezvous, 1)
    thread.join(30)
    assert group.use_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert made["set"] == torch.device("cuda", 1)
    assert isinstance(group.tensor_pg, FakeNCCL) and group.tensor_pg is not group.pg
    assert (made["rank"], made["size"]) == (1, 2)
    assert isinstance(made["store"], dist.PrefixStore)
    assert made["options"]._timeout == tp_group.TIMEOUT  # type: ignore[attr-defined]


def test_nccl_missing_from_the_torch_build_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from chunkserve.engine.tp import group as tp_group

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="needs NCCL, which this torch build lacks"):
        tp_group._nccl_group(None, 0, 2)  # type: ignore[arg-type]
