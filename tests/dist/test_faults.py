"""Misuse of the data-parallel wrappers is a clear error on every rank, never a hang or a silent desync."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flashsys.dist import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, spawn

from .toy import loss_fn, make_batches, make_model

WRAPPERS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": lambda m, process_group=None: BucketedDDP(m, bucket_size_mb=1e-6, process_group=process_group),
}


def _unfreeze_worker(rank, world, device):
    for name, make in WRAPPERS.items():
        for change in ("unfreeze", "freeze"):
            model = make_model(0, device)
            ddp = make(model)
            x, y = make_batches(1, 4, device)[0]
            loss_fn(ddp(x), y).backward()
            ddp.finish_gradient_synchronization()
            if change == "unfreeze":
                model.frozen.requires_grad_(True)  # it used to get local, unsynchronised gradients
            else:
                model.hidden.requires_grad_(False)
            with pytest.raises(RuntimeError, match=r"requires_grad changed after wrapping for \['(frozen|hidden)"):
                ddp(x)
            ddp.remove_hooks()


def _replaced_parameter_worker(rank, world, device):
    for name, make in WRAPPERS.items():
        model = make_model(0, device)
        ddp = make(model)
        x, _ = make_batches(1, 4, device)[0]
        model.hidden.weight = nn.Parameter(model.hidden.weight.detach().clone())  # never hooked
        with pytest.raises(RuntimeError, match=r"parameters changed after wrapping \(new or replaced: \['hidden.weight'\]"):
            ddp(x)
        ddp.remove_hooks()
        model = make_model(0, device)
        ddp = make(model)
        model.extra = nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match=r"new or replaced: \['extra.weight', 'extra.bias'\]"):
            ddp(x)
        ddp.remove_hooks()


def test_parameters_replaced_or_added_after_wrapping_are_an_error():
    spawn(_replaced_parameter_worker, 2, backend="gloo", timeout_s=60)


def test_changing_requires_grad_after_wrapping_is_an_error():
    spawn(_unfreeze_worker, 2, backend="gloo", timeout_s=60)


def _bucket_size_worker(rank, world, device):
    with pytest.raises(ValueError, match="bucket layout differs between ranks"):
        BucketedDDP(make_model(0, device), bucket_size_mb=1e-6 if rank == 0 else None)
    # "auto" with nothing to train: no buckets, and synchronisation is a no-op (it used to fail on a NaN size).
    model = make_model(0, device).requires_grad_(False)
    ddp = BucketedDDP(model, bucket_size_mb="auto")
    assert ddp.bucket_sizes_bytes == []
    ddp.finish_gradient_synchronization()


def test_bucket_layouts_must_agree_and_auto_handles_no_trainable_parameters():
    spawn(_bucket_size_worker, 2, backend="gloo", timeout_s=60)


def _skipped_backward_worker(rank, world, device, name):
    # A group of its own with a short timeout: after the error, rank 0's gradient collectives stay pending there.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    ddp = WRAPPERS[name](make_model(0, device), process_group=group)
    x, y = make_batches(1, 4, device)[0]
    out = ddp(x)
    # Rank 0's backward finishes synchronisation by itself and raises there; rank 1 raises in the explicit call.
    with pytest.raises(RuntimeError, match=r"backward ran on ranks \[0\] but not on ranks \[1\]"):
        if rank == 0:
            loss_fn(out, y).backward()
        ddp.finish_gradient_synchronization()


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_backward_skipped_on_one_rank_is_an_error_not_a_hang(name):
    spawn(_skipped_backward_worker, 2, name, backend="gloo", timeout_s=60)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return self.b(self.a(x)) if use_b else self.a(x)


def _used_on_one_rank_worker(rank, world, device):
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    ddp = OverlapDDP(_Branchy(), process_group=group)
    with pytest.raises(RuntimeError, match="a parameter was used on some ranks only"):
        ddp(torch.randn(2, 4), use_b=rank == 0).sum().backward()  # the end of backward synchronises
    # BucketedDDP handles it: the unused parameter's gradient is rank 0's, averaged.
    torch.manual_seed(0)
    model = _Branchy()
    bucketed = BucketedDDP(model, bucket_size_mb=1e-6)
    bucketed(torch.ones(2, 4), use_b=rank == 0).sum().backward()
    bucketed.finish_gradient_synchronization()
    assert model.b.weight.grad is not None and torch.isfinite(model.b.weight.grad).all()


def test_overlap_with_a_parameter_used_on_one_rank_is_an_error_not_garbage():
    spawn(_used_on_one_rank_worker, 2, backend="gloo", timeout_s=60)


def _no_checks_worker(rank, world, device):
    model = make_model(0, device)
    ddp = BucketedDDP(model, cross_rank_checks=False)
    assert ddp._control_group is None
    x, y = make_batches(1, 4, device)[0]
    loss_fn(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()  # still averages; only the side-channel comparison is off
    assert model.hidden.weight.grad is not None


def test_cross_rank_checks_can_be_turned_off():
    spawn(_no_checks_worker, 2, backend="gloo", timeout_s=60)


def _dropped_wrapper_worker(rank, world, device):
    import gc

    from flashsys.optim import ZeRO2Optimizer

    model = make_model(0, device)
    x, y = make_batches(1, 4, device)[0]
    BucketedDDP(model)  # not kept: its hooks would no longer average anything
    gc.collect()
    with pytest.raises(RuntimeError, match="garbage-collected"):
        loss_fn(model(x * (rank + 1)), y).backward()
    with pytest.raises(ValueError, match="garbage-collected"):
        ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model.zero_grad()
    ddp = BucketedDDP(model)  # wrapping again takes over from the dropped wrapper's hooks
    loss_fn(ddp(x * (rank + 1)), y).backward()
    grads = [torch.empty_like(model.hidden.weight.grad) for _ in range(world)]
    dist.all_gather(grads, model.hidden.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])  # averaged: the same on both ranks though the inputs differ


def test_a_wrapper_that_is_not_kept_is_an_error_not_a_silent_desync():
    spawn(_dropped_wrapper_worker, 2, backend="gloo", timeout_s=60)


def _wedged_rank_worker(rank, world, device):
    import time

    from flashsys.dist.side_channel import group_timeout

    assert group_timeout() == datetime.timedelta(seconds=30)
    # A group of its own: after the error, rank 0's gradient collectives stay pending there.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    ddp = BucketedDDP(make_model(0, device), bucket_size_mb=None, process_group=group, broadcast_buffers=False)
    assert group_timeout(ddp._control_group) == datetime.timedelta(seconds=4)  # not torch's 30 minutes
    x, y = make_batches(1, 4, device)[0]
    if rank == 1:
        time.sleep(10)  # wedged: never reaches backward while rank 0 waits
        return
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not every rank reached the end of backward within .* 4 s"):
        loss_fn(ddp(x), y).backward()
    assert time.monotonic() - start < 9


def test_the_cross_rank_checks_honour_the_configured_timeout():
    spawn(_wedged_rank_worker, 2, backend="gloo", timeout_s=30)
