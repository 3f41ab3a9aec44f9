"""Process-group tear-down: gloo's worker threads must be gone before the interpreter exits.

A group that outlives `shutdown()` keeps its worker threads until interpreter exit, where one that is still
releasing the last collective's tensors needs the GIL and aborts the process (SIGABRT, "terminate called
without an active exception") after all its work succeeded: a rare, load-dependent CI failure.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from flashsys.dist import BucketedDDP, shutdown, spawn

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while we listed
            pass
    return names


def _teardown_worker(rank, world, device):
    # The first optimizer imports torch._dynamo, and with it torch.distributed.nn.functional, after the
    # group exists: the import that used to pin the group. A reference cycle holds the group too.
    model = torch.nn.Linear(8, 8)
    ddp = BucketedDDP(model, process_group=dist.group.WORLD)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    cycle = {"ddp": ddp, "group": dist.group.WORLD}
    cycle["self"] = cycle
    ddp(torch.randn(4, 8)).sum().backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    dist.barrier()
    del model, ddp, opt, cycle
    assert any(n in GLOO_THREADS for n in _thread_names()), "gloo's threads are not named as expected"
    shutdown()
    left = [n for n in _thread_names() if n in GLOO_THREADS]
    assert not left, f"gloo threads still running after shutdown(): {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_shutdown_joins_gloo_worker_threads():
    spawn(_teardown_worker, 2, backend="gloo", timeout_s=60)


def _rank0_fails_late(rank, world, device):
    dist.barrier()
    if rank == 0:
        raise PermissionError("cannot write /proc/self/final_model.pt")
    dist.barrier()  # rank 1 waits here: its own error is only the closed connection


def test_the_launcher_reports_every_ranks_own_error_first_failure_first():
    from flashsys.dist import SpawnError

    with pytest.raises(SpawnError) as info:
        spawn(_rank0_fails_late, 2, backend="gloo", timeout_s=30)
    message = str(info.value)
    assert message.startswith("rank 0 failed first: PermissionError: cannot write /proc/self/final_model.pt")
    assert "Traceback" in message and "\nrank 1: " in message
    assert info.value.failures[0]["rank"] == 0


def _all_reduce_ranks(rank, world, device):
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2


def test_spawn_does_not_depend_on_a_port_chosen_before_rank_0_binds_it(monkeypatch):
    """A port picked by the launcher and bound later by rank 0 can be taken in between by any process on the
    machine (another test run, another job): the launch then failed with EADDRINUSE. Here the port such a
    launcher would pick is held by a listening socket for the whole launch."""
    import socket

    import flashsys.dist.process_group as process_group

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(process_group, "find_free_port", lambda: taken.getsockname()[1])
        spawn(_all_reduce_ranks, 2, backend="gloo", timeout_s=60)


@pytest.mark.gpu
def test_spawn_joins_an_nccl_group_through_the_published_port_gpu():
    spawn(_all_reduce_ranks, min(2, torch.cuda.device_count()), backend="nccl", timeout_s=120)


def test_a_rank_that_never_hears_rank_0s_port_fails_by_name(tmp_path):
    from flashsys.dist.process_group import _rendezvous_store

    with pytest.raises(TimeoutError, match="rank 1: rank 0 did not publish the rendezvous port within 0.2 s"):
        _rendezvous_store(1, 2, str(tmp_path), timeout_s=0.2)
