"""Data-parallel wrappers against a single-process model on the full batch (gloo on CPU, NCCL on 2 GPUs)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashsys.dist import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, optimal_bucket_bytes, spawn
from flashsys.dist.cost_model import fit_allreduce_cost
from flashsys.nn import TransformerLM

from .toy import AwkwardModel, assert_params_close, loss_fn, make_batches, make_model

VARIANTS = {
    "naive": lambda m: NaiveDDP(m),
    "flat": lambda m: FlatDDP(m),
    "overlap": lambda m: OverlapDDP(m),
    "bucketed-tiny": lambda m: BucketedDDP(m, bucket_size_mb=1e-6),  # every tensor its own bucket
    "bucketed-medium": lambda m: BucketedDDP(m, bucket_size_mb=600 / 2**20),
    "bucketed-unlimited": lambda m: BucketedDDP(m, bucket_size_mb=None),
    "bucketed-auto": lambda m: BucketedDDP(m, bucket_size_mb="auto"),
    # .grad are views into the buckets: no copy in or out
    "bucketed-view": lambda m: BucketedDDP(m, bucket_size_mb=600 / 2**20, gradient_as_bucket_view=True),
}
STEPS, PER_RANK = 6, 4


def _parity_worker(rank, world, device, variant_names, explicit_finish=True):
    batches = make_batches(STEPS, PER_RANK * world, device)
    for name in variant_names:
        model = make_model(seed=100 + rank, device=device)  # different on every rank: the broadcast must fix it
        model.scale.mul_(rank + 1)
        ddp = VARIANTS[name](model)
        ref = make_model(seed=100, device=device)  # rank 0's initial weights
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        if explicit_finish:
            ddp.finish_gradient_synchronization()  # before any backward: a no-op
        for step, (x, y) in enumerate(batches):
            shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            opt.zero_grad(set_to_none=True)
            if step < STEPS // 2:
                loss_fn(ddp(x[shard]), y[shard]).backward()
            else:  # gradient accumulation over 2 micro-batches: reduce only on the second
                half = PER_RANK // 2
                xs, ys = x[shard], y[shard]
                with ddp.no_sync():
                    (loss_fn(ddp(xs[:half]), ys[:half]) / 2).backward()
                (loss_fn(ddp(xs[half:]), ys[half:]) / 2).backward()
            if explicit_finish:  # backward has finished it already: both calls are no-ops, not more averaging
                ddp.finish_gradient_synchronization()
                ddp.finish_gradient_synchronization()
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            assert model.unused.weight.grad is None, f"{name}: unused parameter got a gradient"
            assert model.frozen.weight.grad is None
            assert torch.equal(model.scale, ref.scale), f"{name}: buffer not broadcast"
            assert_params_close(model, ref, step, name)


@pytest.mark.parametrize("world", [2, 3])
def test_every_wrapper_matches_single_process_training_gloo(world):
    spawn(_parity_worker, world, list(VARIANTS), backend="gloo", timeout_s=120)


def test_backward_alone_synchronises_as_torch_ddp_does_gloo():
    """A loop written for torch DDP (no finish_gradient_synchronization() call) trains the same."""
    spawn(_parity_worker, 2, list(VARIANTS), False, backend="gloo", timeout_s=120)


@pytest.mark.multigpu
def test_every_wrapper_matches_single_process_training_nccl():
    spawn(_parity_worker, 2, list(VARIANTS), backend="nccl", timeout_s=120)


def _torch_ddp_worker(rank, world, device):
    def lm():
        torch.manual_seed(0)
        return TransformerLM(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64).to(device)

    ours = BucketedDDP(lm(), bucket_size_mb=0.01)
    theirs = torch.nn.parallel.DistributedDataParallel(lm(), bucket_cap_mb=0.01, device_ids=[device.index] if device.type == "cuda" else None)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        ids = torch.randint(0, 50, (2, 16), generator=g).to(device)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=True)
            logits = model(ids[:, :-1])
            F.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
            if model is ours:
                ours.finish_gradient_synchronization()
            opt.step()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bucketed_matches_torch_ddp_on_a_transformer_lm():
    spawn(_torch_ddp_worker, 2, backend="gloo", timeout_s=120)


@pytest.mark.multigpu
def test_bucketed_matches_torch_ddp_on_a_transformer_lm_nccl():
    spawn(_torch_ddp_worker, 2, backend="nccl", timeout_s=120)


def _misuse_worker(rank, world, device):
    # Models that differ between ranks: a clear error on every rank, not a hang.
    model = make_model(0, device)
    if rank == 1:
        model.extra = torch.nn.Linear(3, 3).to(device)
    for wrapper in (NaiveDDP, BucketedDDP):
        with pytest.raises(ValueError, match="model differs between ranks"):
            wrapper(model)
    # Wrapping a model that a live wrapper still holds: its gradients would be reduced twice.
    model = make_model(0, device)
    first = BucketedDDP(model)
    for wrapper in (NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP):
        with pytest.raises(RuntimeError, match="already wrapped by a live BucketedDDP"):
            wrapper(model)
    first.remove_hooks()
    OverlapDDP(model)  # fine once the first wrapper let go
    # comm_dtype must be a floating dtype.
    for bad in (torch.int32, "bf16"):
        with pytest.raises(ValueError, match="comm_dtype must be one of"):
            BucketedDDP(make_model(0, device), comm_dtype=bad)


def test_mismatched_models_and_misuse_are_clear_errors():
    spawn(_misuse_worker, 2, backend="gloo", timeout_s=60)


def _dead_rank_worker(rank, world, device):
    if rank == 1:
        os._exit(0)  # dies without a word
    start = time.monotonic()
    with pytest.raises(Exception):
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.all_reduce(t)
    assert time.monotonic() - start < 60
    dist.destroy_process_group()  # the group is broken: tear down here, no final barrier


def test_a_dead_rank_makes_the_others_fail_not_hang():
    spawn(_dead_rank_worker, 2, backend="gloo", timeout_s=10)


def _world_one_worker(rank, world, device):
    for name, make in VARIANTS.items():
        model = make_model(0, device)
        ref = make_model(0, device)
        ddp = make(model)
        x, y = make_batches(1, 4, device)[0]
        loss_fn(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        loss_fn(ref(x), y).backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)


def test_world_size_one():
    spawn(_world_one_worker, 1, backend="gloo")


def _layout_worker(rank, world, device):
    model = AwkwardModel()
    one_each = BucketedDDP(model, bucket_size_mb=1e-6)
    grad_params = [p for p in model.parameters() if p.requires_grad]
    assert len(one_each.bucket_sizes_bytes) == len(grad_params)
    assert [b.params[0] for b in one_each._buckets] == list(reversed(grad_params))  # reverse registration order
    one_each.remove_hooks()
    single = BucketedDDP(model, bucket_size_mb=None)
    assert len(single._buckets) == 2  # one per dtype: fp32 and bf16
    assert {b.buffer.dtype for b in single._buckets} == {torch.float32, torch.bfloat16}
    # 600 bytes: hidden.weight (1024 B) exceeds the cap and gets its own bucket; small ones share.
    single.remove_hooks()
    medium = BucketedDDP(model, bucket_size_mb=600 / 2**20)
    for b in medium._buckets:
        sizes = [p.numel() * p.element_size() for p in b.params]
        assert len(b.params) == 1 or sum(sizes[:-1]) < 600
    with pytest.raises(ValueError, match="bucket_size_mb"):
        BucketedDDP(model, bucket_size_mb=-1)


def test_bucket_layout():
    spawn(_layout_worker, 1, backend="gloo")


def test_plan_buckets_closes_at_the_cap_keeps_keys_apart_and_never_splits():
    from flashsys.dist import plan_buckets

    items = [("fp32", 3), ("bf16", 5), ("fp32", 3), ("fp32", 10), ("bf16", 1), ("fp32", 2)]
    # bf16 5 reaches the cap of 5 and closes, then fp32 3+3; 10 B is over the cap, alone; the rest stay open.
    assert plan_buckets(items, 5) == [[1], [0, 2], [3], [5], [4]]  # open ones last, in order of first use of their key
    assert plan_buckets(items, float("inf")) == [[0, 2, 3, 5], [1, 4]]
    assert plan_buckets(items, 0.5) == [[i] for i in range(len(items))]


def test_optimal_bucket_size_formula():
    s, o, w = 1e9, 50e-6, 50e9
    b = optimal_bucket_bytes(int(s), o, w)
    assert abs(b - (s * o * w) ** 0.5) < 2
    cost = lambda x: s / x * o + x / w  # noqa: E731
    assert cost(b) <= min(cost(b / 2), cost(b * 2))
    assert optimal_bucket_bytes(10, 1.0, 1e12) == 2**20  # clamped to at least 1 MiB
    assert optimal_bucket_bytes(int(s), 1.0, 1e12) == int(s / 4)  # and to at most a quarter: four buckets


def test_allreduce_cost_fit_survives_a_slow_small_call():
    """The fit behind "auto": a 4 KiB all-reduce that happened to be slower than the 16 MiB one must not give an
    infinite bandwidth (it once put all 7.6 GB of xl gradients in one bucket)."""
    sizes = (4096, 16 * 2**20)
    o, w = fit_allreduce_cost(20e-6, 20e-6 + sizes[1] / 100e9, sizes)
    assert abs(w - (sizes[1] - sizes[0]) / (sizes[1] / 100e9)) < 1 and abs(o - (20e-6 - sizes[0] / w)) < 1e-12
    o, w = fit_allreduce_cost(500e-6, 200e-6, sizes)  # degenerate: bounded by the big call alone
    assert w == sizes[1] / 200e-6 and o == 500e-6 - sizes[0] / w
    assert optimal_bucket_bytes(int(7.6e9), o, w) <= 7.6e9 / 4


def _rewrap_worker(rank, world, device):
    """Wrapping the same model again: the first wrapper's hooks must not act any more."""
    model = make_model(0, device)
    ref = make_model(0, device)
    first = OverlapDDP(model)
    first.remove_hooks()
    second = BucketedDDP(model, bucket_size_mb=1e-6)
    del first
    x, y = make_batches(1, 4, device)[0]
    loss_fn(second(x), y).backward()
    second.finish_gradient_synchronization()
    loss_fn(ref(x), y).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    second.remove_hooks()
    dropped = NaiveDDP(model)  # dropped without remove_hooks: its weak hooks go quiet, and the model is free again
    del dropped
    third = FlatDDP(model)
    model.zero_grad(set_to_none=True)
    loss_fn(third(x), y).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_wrapping_the_same_model_again():
    spawn(_rewrap_worker, 2, backend="gloo")


def _drop_in_worker(rank, world, device):
    # Buffers are rank 0's at every training forward (not under no_sync, not without grad), as torch DDP's.
    model = make_model(0, device)
    ddp = BucketedDDP(model)
    x, y = make_batches(1, 4, device)[0]
    model.scale.fill_(float(rank + 1))
    with torch.no_grad():
        ddp(x)
    assert float(model.scale[0]) == rank + 1
    with ddp.no_sync():
        ddp(x)
    assert float(model.scale[0]) == rank + 1
    loss_fn(ddp(x), y).backward()
    assert float(model.scale[0]) == 1.0
    ddp.remove_hooks()
    model.scale.fill_(float(rank + 1))
    kept = BucketedDDP(model, broadcast_buffers=False)
    model.scale.fill_(float(rank + 1))
    kept(x)
    assert float(model.scale[0]) == rank + 1
    kept.remove_hooks()

    # gradient_as_bucket_view: every .grad lives in its bucket; zero_grad() keeps the views and zeroes them.
    model, ref = make_model(0, device), make_model(0, device)
    view = BucketedDDP(model, bucket_size_mb=600 / 2**20, gradient_as_bucket_view=True)
    def in_a_bucket(p):
        return any(b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.numel() * b.buffer.element_size()
                   for b in view._buckets)
    batches = make_batches(3, 4 * world, device)
    for x, y in batches:
        view.zero_grad()
        loss_fn(view(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
        ref.zero_grad()
        loss_fn(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.requires_grad:
                assert in_a_bucket(p), "a gradient is not a view into its bucket"
                torch.testing.assert_close(p.grad, q.grad if q.grad is not None else torch.zeros_like(p),
                                           atol=2e-2 if p.dtype == torch.bfloat16 else 1e-6, rtol=1e-5)
    view.remove_hooks()

    # comm_dtype=bf16: fp32 gradients reduced in bf16 are the average to bf16 precision, in fp32.
    model, ref = make_model(0, device), make_model(0, device)
    compressed = BucketedDDP(model, bucket_size_mb=600 / 2**20, comm_dtype=torch.bfloat16)
    x, y = batches[0]
    loss_fn(compressed(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4]).backward()
    loss_fn(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert p.grad.dtype == p.dtype
            torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=1e-2, rtol=2e-2, msg=name)
            if p.dtype == torch.float32:  # it really went through bf16: not the fp32 average
                assert not torch.equal(p.grad, q.grad) or p.grad.abs().max() == 0


def test_drop_in_options_broadcast_buffers_bucket_views_and_comm_dtype():
    spawn(_drop_in_worker, 2, backend="gloo", timeout_s=120)


@pytest.mark.multigpu
def test_drop_in_options_nccl():
    spawn(_drop_in_worker, 2, backend="nccl", timeout_s=120)


def _two_backwards_worker(rank, world, device):
    """Two synchronised backwards before one step (two losses): the gradients add up, averaged, as in one process."""
    model, ref = make_model(0, device), make_model(0, device)
    ddp = BucketedDDP(model, bucket_size_mb=600 / 2**20)
    (x, y), (x2, y2) = make_batches(2, 4 * world, device)
    mine = slice(rank * 4, (rank + 1) * 4)
    loss_fn(ddp(x[mine]), y[mine]).backward()
    loss_fn(ddp(x2[mine]), y2[mine]).backward()
    loss_fn(ref(x), y).backward()
    loss_fn(ref(x2), y2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=2e-2 if p.dtype == torch.bfloat16 else 1e-6,
                                       rtol=1e-5)


def test_two_backwards_before_a_step_add_up():
    spawn(_two_backwards_worker, 2, backend="gloo", timeout_s=60)
