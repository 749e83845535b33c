"""The trainer's weight-update group meets SGLang's engine end at the same store keys.

SGLang's engines join with a ``tcp://`` rendezvous, ``PrefixStore(group_name, store)`` and
torch's process-group helper (``init_custom_process_group``). This test builds that end
here, with torch only (SGLang needs CUDA), in two real processes with TP ranks 1 and 2 of
one engine, and has :class:`DistributedWeightSender` (rank 0) broadcast to them over gloo.
"""

import datetime

import pytest
import torch
from test_security import listening_address

pytestmark = pytest.mark.integration
GROUP = "weight_update_group_test"


def sglang_style_engine_rank(rank: int, port: int, queue) -> None:
    """One TP rank of an engine, joining as SGLang 0.5.15's model runner does."""
    import inspect

    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=120)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, 3, timeout=timeout))
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        "gloo",
        PrefixStore(GROUP, store),
        group_name=GROUP,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # as SGLang registers it
    buffers = [torch.empty(2, 3), torch.empty(1, dtype=torch.int64)]
    for buffer in buffers:
        torch.distributed.broadcast(buffer, src=0, group=group)
    queue.put([b.tolist() for b in buffers])
    # gloo's threads must stop before the interpreter does (an abort at exit otherwise)
    torch.distributed.destroy_process_group(group)


def test_sender_and_sglang_style_engine_ranks_share_one_group():
    import torch.multiprocessing as mp

    from rl_sglang.process import free_port
    from rl_sglang.transports import DistributedWeightSender

    context, port = mp.get_context("spawn"), free_port()
    queue = context.Queue()
    engine_ranks = [
        context.Process(target=sglang_style_engine_rank, args=(rank, port, queue))
        for rank in (1, 2)
    ]
    for proc in engine_ranks:
        proc.start()
    # one engine of TP size 2: ranks 1 and 2 (no HTTP here: the group is what is tested)
    sender = DistributedWeightSender([None], master_port=port, group_name=GROUP, tp_size=2)
    assert sender.world_size == 3
    sender.group = sender._create_group()
    # its store listens where it was told only (torch's own binds every interface)
    assert listening_address(sender.master_port) == "127.0.0.1"
    sender._broadcast([torch.arange(6.0).view(2, 3), torch.tensor([7])])
    received = [queue.get(timeout=120) for _ in engine_ranks]
    for proc in engine_ranks:
        proc.join(60)
    assert [proc.exitcode for proc in engine_ranks] == [0, 0]
    assert received == [[[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [7]]] * 2
