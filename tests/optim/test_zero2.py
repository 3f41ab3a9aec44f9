"""ZeRO2Optimizer on BucketedDDP: bit-exact against the unsharded optimizer on the averaged gradients, memory per
rank, state dicts, clipping, bad input (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashsys.dist import BucketedDDP, spawn
from flashsys.optim import ShardedOptimizer, ZeRO2Optimizer

from .test_sharded import _batches, _net, consolidated_round_trip

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
}


def _groups(model, no_decay_lr=None):
    """Two groups, as LM training uses: matrices with decay, vectors without (and another lr)."""
    params = [p for p in model.parameters() if p.requires_grad]
    vectors = [p for p in params if p.dim() == 1]
    return [{"params": [p for p in params if p.dim() > 1]},
            {"params": vectors, "weight_decay": 0.0, **({"lr": no_decay_lr} if no_decay_lr else {})}]


def _backward(ddp, opt, x, y, rank, accumulate=False):
    mine = slice(rank * 4, rank * 4 + 4)
    opt.zero_grad(set_to_none=True)
    if accumulate:  # two micro-batches, reduced once
        with ddp.no_sync():
            (F.mse_loss(ddp(x[mine][:2]), y[mine][:2]) / 2).backward()
        (F.mse_loss(ddp(x[mine][2:]), y[mine][2:]) / 2).backward()
    else:
        F.mse_loss(ddp(x[mine]), y[mine]).backward()


def _step(ddp, opt, x, y, rank, accumulate=False):
    _backward(ddp, opt, x, y, rank, accumulate)
    opt.step()


def _gathered_gradients(opt):
    """The full averaged gradients, all-gathered from every rank's shards: what an unsharded optimizer would see."""
    grads = {}
    for b, used in zip(opt.ddp.buckets, opt.ddp.gradients_used()):
        full = torch.empty(b.params_flat.numel(), dtype=b.grad_shard.dtype, device=b.grad_shard.device)
        dist.all_gather_into_tensor(full, b.grad_shard)
        for p, g, u in zip(b.params, b.layout.views(full), used):
            grads[id(p)] = g.clone() if u else None
    return grads


def _parity_worker(rank, world, device, opt_name, bucket_mb, overlap=False):
    cls, kw = OPTIMIZERS[opt_name]
    model, plain, replicated = _net(device), _net(device), _net(device)
    ddp = BucketedDDP(model, bucket_size_mb=bucket_mb)
    ddp_replicated = BucketedDDP(replicated, bucket_size_mb=bucket_mb)
    opt = ZeRO2Optimizer(_groups(model, 3e-3), cls, overlap_all_gather=overlap, **kw)
    plain_opt, replicated_opt = cls(_groups(plain, 3e-3), **kw), cls(_groups(replicated, 3e-3), **kw)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, plain_opt, replicated_opt)]
    g = torch.Generator().manual_seed(5)
    for step in range(8):
        x, y = torch.randn(4 * world, 12, generator=g).to(device), torch.randn(4 * world, 24, generator=g).to(device)
        _backward(ddp, opt, x, y, rank, accumulate=step % 3 == 2)
        # The unsharded optimizer on the same averaged gradients: bit-exact for any world size.
        grads = _gathered_gradients(opt)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            q.grad = grads.get(id(p))
        opt.step()
        plain_opt.step()
        # BucketedDDP + the unsharded optimizer: all-reduce and reduce-scatter add 2 ranks in the same order;
        # with 3, gloo's two algorithms may round the sum differently.
        _step(ddp_replicated, replicated_opt, x, y, rank, accumulate=step % 3 == 2)
        for s in scheds:
            s.step()
        opt.wait_for_parameters()  # with overlap_all_gather, reading .data needs it (forward would wait by itself)
        for (name, p), q, r in zip(model.named_parameters(), plain.parameters(), replicated.parameters()):
            assert torch.equal(p, q), f"{opt_name}: step {step}, {name} differs from the unsharded optimizer"
            if world == 2:
                assert torch.equal(p, r), f"{opt_name}: step {step}, {name} differs from BucketedDDP + {opt_name}"
            else:
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            assert p.grad is None, f"{name}: ZeRO-2 keeps no full gradient"
    assert model.unused.weight.grad is None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bit_exact_against_the_unsharded_optimizer_on_averaged_gradients(world, opt_name):
    # 1e-4 MiB: a bucket per parameter or two (slices inside parameters); None: one bucket, cut across parameters.
    for bucket_mb in (1e-4, None):
        spawn(_parity_worker, world, opt_name, bucket_mb, backend="gloo", timeout_s=120)


def test_all_gather_overlapped_with_the_next_forward_is_still_bit_exact():
    spawn(_parity_worker, 2, "AdamW", 1e-4, True, backend="gloo", timeout_s=120)


def _overlap_waits_worker(rank, world, device):
    """With overlap_all_gather, a forward, model.state_dict() and the next step() see whole parameters without
    an explicit wait."""
    x, y = _batches(device, 1)[0]
    x, y = x.repeat(world, 1), y.repeat(world, 1)
    mine = slice(rank * 4, rank * 4 + 4)
    results = {}
    for overlap in (False, True):
        model = _net(device)
        ddp = BucketedDDP(model, bucket_size_mb=1e-4)
        opt = ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, overlap_all_gather=overlap)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        assert bool(opt._pending) == overlap
        state = {k: v.clone() for k, v in model.state_dict().items()}  # waits
        assert not opt._pending
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        out = ddp(x[mine])  # the forward waits bucket by bucket
        if overlap:  # every bucket the forward used was waited for; what is left holds only the unused layer
            left = {id(p) for b in opt._pending for p in ddp.buckets[b].params}
            assert left <= {id(model.unused.weight)}, "a bucket's all-gather was not waited for in forward"
        results[overlap] = (state, out.detach())
    for k in results[False][0]:
        assert torch.equal(results[False][0][k], results[True][0][k]), k
    assert torch.equal(results[False][1], results[True][1])


def test_overlapped_all_gathers_are_waited_for_where_parameters_are_read():
    spawn(_overlap_waits_worker, 2, backend="gloo", timeout_s=60)


@pytest.mark.multigpu
def test_bit_exact_against_the_unsharded_optimizer_on_averaged_gradients_nccl():
    spawn(_parity_worker, 2, "AdamW", 1e-4, backend="nccl", timeout_s=120)


def _memory_worker(rank, world, device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    ddp = BucketedDDP(model, bucket_size_mb=0.05)
    opt = ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ddp(torch.randn(4, 64)).sum().backward()
    opt.step()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    mine = opt.grad_and_state_bytes()  # gradient shard + exp_avg + exp_avg_sq slices (+ scalar steps)
    assert mine <= 1.05 * 3 * total / world, (mine, 3 * total / world)


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_and_state_bytes_per_rank_are_total_over_world_size(world):
    spawn(_memory_worker, world, backend="gloo")


def _state_dict_worker(rank, world, device):
    batches = _batches(device, 8)

    def wrapped():
        model = _net(device)
        return model, BucketedDDP(model, bucket_size_mb=None)

    ref, ref_ddp = wrapped()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.1)
    model, ddp = wrapped()
    opt = ZeRO2Optimizer(_groups(model), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for x, y in batches[:4]:
        x, y = x.repeat(world, 1), y.repeat(world, 1)
        _step(ddp, opt, x, y, rank)
        _step(ref_ddp, ref_opt, x, y, rank)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    saved = consolidated_round_trip(opt, ref_opt, model, rank)
    fresh, fresh_ddp = wrapped()
    fresh.load_state_dict(saved["model"])
    fresh_opt = ZeRO2Optimizer(_groups(fresh), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    fresh_opt.load_state_dict(saved["optim"])
    for x, y in batches[4:]:
        x, y = x.repeat(world, 1), y.repeat(world, 1)
        _step(fresh_ddp, fresh_opt, x, y, rank)
        _step(ref_ddp, ref_opt, x, y, rank)
    for p, q in zip(fresh.parameters(), ref.parameters()):
        assert torch.equal(p, q), "training did not continue bit-identically after the state-dict round trip"
    with pytest.raises(ValueError, match="expected a dict with 'state' and 'param_groups'"):
        fresh_opt.load_state_dict({"state": {}})


def test_state_dict_is_the_unsharded_layout_and_resumes_bit_exactly():
    spawn(_state_dict_worker, 2, backend="gloo", timeout_s=120)


def _clip_and_compress_worker(rank, world, device):
    x, y = _batches(device, 1)[0]
    x = x * (1 + torch.arange(x.shape[0])[:, None] / 8)
    mine = slice(rank * 4, rank * 4 + 4)
    # clip_grad_norm_ over the shards equals torch's over the full averaged gradients.
    model, ref = _net(device), _net(device)
    ddp, ref_ddp = BucketedDDP(model, bucket_size_mb=1e-4), BucketedDDP(ref, bucket_size_mb=1e-4)
    opt = ZeRO2Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    F.mse_loss(ref_ddp(x[mine]), y[mine]).backward()
    norm = opt.clip_grad_norm_(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
    assert norm > 0.05
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # comm_dtype=bf16: the reduce-scatter runs in bf16; the shards stay fp32, close to the fp32 average.
    model, ref = _net(device), _net(device)
    ddp = BucketedDDP(model, bucket_size_mb=1e-4, comm_dtype=torch.bfloat16)
    ref_ddp = BucketedDDP(ref, bucket_size_mb=1e-4)
    opt = ZeRO2Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
        F.mse_loss(d(x[mine]), y[mine]).backward()
        o.step()
    assert all(b.grad_shard.dtype == torch.float32 for b in ddp.buckets)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    # Two backwards before one step add up (two losses), as in one process.
    model, ref = _net(device), _net(device)
    ddp, ref_ddp = BucketedDDP(model, bucket_size_mb=None), BucketedDDP(ref, bucket_size_mb=None)
    opt = ZeRO2Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
        F.mse_loss(d(x[mine]), y[mine]).backward()
        F.mse_loss(d(x[mine] * 2), y[mine]).backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):  # a1 + (b1 + b2)/2 vs (2 a1 + b1 + b2)/2: rounding apart
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clipping_comm_dtype_and_two_backwards():
    spawn(_clip_and_compress_worker, 2, backend="gloo", timeout_s=120)


def _bad_input_worker(rank, world, device):
    with pytest.raises(ValueError, match="one live BucketedDDP"):
        ZeRO2Optimizer(_net(device).parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(TypeError, match="not known to update each element on its own"):
        ZeRO2Optimizer(_net(device).parameters(), torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer_cls"):
        ZeRO2Optimizer(_net(device).parameters(), "AdamW")
    model = _net(device)
    ddp = BucketedDDP(model, gradient_as_bucket_view=True)
    with pytest.raises(RuntimeError, match="gradient_as_bucket_view"):
        ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ddp.remove_hooks()
    model = _net(device)
    ddp = BucketedDDP(model)
    ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(RuntimeError, match="already sharded"):
        ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)  # ZeRO-1 needs no wrapper


def test_bad_input_is_a_clear_error():
    spawn(_bad_input_worker, 2, backend="gloo", timeout_s=60)


def _nothing_silent_worker(rank, world, device):
    x, y = _batches(device, 1)[0]
    mine = slice(rank * 4, rank * 4 + 4)
    # A discarded batch: the model's and the wrapper's zero_grad() drop the shards, as the optimizer's does.
    for clear in ("model", "wrapper"):
        model, ref = _net(device), _net(device)
        ddp, ref_ddp = BucketedDDP(model, bucket_size_mb=1e-4), BucketedDDP(ref, bucket_size_mb=1e-4)
        opt = ZeRO2Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
        F.mse_loss(ddp(x[mine] * 3), y[mine]).backward()
        (model if clear == "model" else ddp).zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        F.mse_loss(ref_ddp(x[mine]), y[mine]).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # Calls that would see no gradient (they are in the shards) raise instead of doing nothing.
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="sharded by ZeRO-2, so .grad is None"):
        other.step()
    with pytest.raises(RuntimeError, match="clip_grad_norm_\\(max_norm\\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # replicated gradients: torch's own, untouched
    # A model converted after the optimizer was built would no longer be stepped.
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="no longer live in their BucketedDDP bucket"):
        opt.step()
    # An optimizer that subclasses an elementwise one may not be elementwise itself.
    class LARS(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="comm_dtype must be one of"):
        BucketedDDP(_net(device), comm_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="bucket_size_mb must be"):
        BucketedDDP(_net(device), bucket_size_mb=True)
    model = _net(device)
    ddp = BucketedDDP(model)
    with pytest.raises(TypeError, match="LARS is not known to update each element"):
        ZeRO2Optimizer(model.parameters(), LARS, lr=0.1)
    ZeRO2Optimizer(model.parameters(), LARS, elementwise=True, lr=0.1)


def test_nothing_is_silently_ignored():
    spawn(_nothing_silent_worker, 2, backend="gloo", timeout_s=60)


def _one_rank_only_worker(rank, world, device, what, backend="gloo"):
    import datetime
    import time

    x, y = _batches(device, 1)[0]
    model = _net(device)
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=3))  # the world keeps a longer one
    ddp = BucketedDDP(model, bucket_size_mb=1e-4, process_group=group)
    if what == "zero1":
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
    else:
        opt = ZeRO2Optimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
    if rank == 1:
        time.sleep(8)  # never calls it
        return
    call = opt.consolidate_state_dict if what == "consolidate_state_dict" else opt.step
    name = f"{type(opt).__name__}.{'consolidate_state_dict' if what == 'consolidate_state_dict' else 'step'}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{name}: rank\(s\) \[1\] did not arrive within 3 s"):
        call()
    assert time.monotonic() - start < 7


@pytest.mark.parametrize("what", ["step", "consolidate_state_dict", "zero1"])
def test_a_collective_called_on_one_rank_names_the_rank_that_did_not_arrive(what):
    spawn(_one_rank_only_worker, 2, what, backend="gloo", timeout_s=30)


@pytest.mark.multigpu
@pytest.mark.parametrize("what", ["step", "consolidate_state_dict"])
def test_a_collective_called_on_one_rank_names_the_rank_that_did_not_arrive_nccl(what):
    spawn(_one_rank_only_worker, 2, what, "nccl", backend="nccl", timeout_s=30)
