"""ShardedOptimizer: bit-exact against the unsharded optimizer, state memory per rank, state dicts, bad input."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashsys.dist import BucketedDDP, spawn
from flashsys.optim import ShardedOptimizer

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
}


class Net(nn.Module):
    """Uneven parameter sizes, a tied weight, a frozen layer and a parameter unused in forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 12, bias=False)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(24, 12, bias=False)
        self.head = nn.Linear(12, 24, bias=False)
        self.head.weight = self.a.weight  # tied (24, 12)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        h = self.frozen(self.c(h))
        return self.head(h)


def _net(device):
    torch.manual_seed(0)
    return Net().to(device)


def _batches(device, steps=10):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 12, generator=g).to(device), torch.randn(8, 24, generator=g).to(device)) for _ in range(steps)]


def _train_step(model, opt, x, y, scheduler=None):
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()
    if scheduler is not None:
        scheduler.step()


def _parity_worker(rank, world, device, opt_name, with_scheduler):
    cls, kw = OPTIMIZERS[opt_name]
    model, ref = _net(device), _net(device)
    params = (p for p in model.parameters() if p.requires_grad)  # a one-shot generator
    opt = ShardedOptimizer(params, cls, **kw)
    opt.broadcast_chunk_bytes = 1500  # several chunks per owner, and parameters larger than a chunk
    ref_opt = cls([p for p in ref.parameters() if p.requires_grad], **kw)
    sched = ref_sched = None
    if with_scheduler:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    for step, (x, y) in enumerate(_batches(device)):
        _train_step(model, opt, x, y, sched)
        _train_step(ref, ref_opt, x, y, ref_sched)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{opt_name}: step {step} differs from the unsharded optimizer"
    # Optimizer state lives only on owners.
    for p in model.parameters():
        if p.requires_grad and p is not model.unused.weight:
            assert (p in opt.inner.state) == (opt.owner_of(p) == rank)
    assert model.unused.weight not in opt.inner.state


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bit_exact_against_the_unsharded_optimizer(world, opt_name):
    spawn(_parity_worker, world, opt_name, opt_name == "AdamW", backend="gloo", timeout_s=120)


def _state_bytes_worker(rank, world, device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(12)])
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    mine = sum(t.numel() * t.element_size() for s in opt.inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
    total = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # exp_avg + exp_avg_sq
    assert abs(mine - total / world) <= 0.05 * total / world, (mine, total / world)


@pytest.mark.parametrize("world", [2, 3])
def test_state_bytes_per_rank_are_total_over_world_size(world):
    spawn(_state_bytes_worker, world, backend="gloo")


def consolidated_round_trip(opt, expected_opt, model, rank) -> dict:
    """Consolidate `opt` on rank 0, check it equals the unsharded `expected_opt`'s state dict there, save model and
    optimizer as a checkpoint would, and return what every rank loads back."""
    opt.consolidate_state_dict(to=0)
    blob = [None]
    if rank == 0:
        sd, expected = opt.state_dict(), expected_opt.state_dict()
        assert sd["param_groups"] == expected["param_groups"]
        assert sd["state"].keys() == expected["state"].keys()
        for i in sd["state"]:
            for k in expected["state"][i]:
                assert torch.equal(sd["state"][i][k], expected["state"][i][k].cpu()), (i, k)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": sd}, buf)
        blob = [buf.getvalue()]
    dist.broadcast_object_list(blob, src=0)
    return torch.load(io.BytesIO(blob[0]), weights_only=False)


def _state_dict_worker(rank, world, device):
    batches = _batches(device, 8)
    # Uninterrupted unsharded reference.
    ref = _net(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        _train_step(ref, ref_opt, x, y)
    # Sharded: 4 steps, consolidate on rank 0, save, load everywhere into fresh objects, 4 more steps.
    model = _net(device)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref_half = _net(device)
    ref_half_opt = torch.optim.AdamW(ref_half.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches[:4]:
        _train_step(model, opt, x, y)
        _train_step(ref_half, ref_half_opt, x, y)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    saved = consolidated_round_trip(opt, ref_half_opt, model, rank)
    fresh = _net(device)
    fresh.load_state_dict(saved["model"])
    fresh_opt = ShardedOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    fresh_opt.load_state_dict(saved["optim"])
    for x, y in batches[4:]:
        _train_step(fresh, fresh_opt, x, y)
    for p, q in zip(fresh.parameters(), ref.parameters()):
        assert torch.equal(p, q), "training did not continue bit-identically after the state-dict round trip"
    # A state dict of another model, or without param_groups: refused at load, not inside a later step().
    with pytest.raises(ValueError, match="expected a dict with 'state' and 'param_groups'"):
        fresh_opt.load_state_dict({"state": saved["optim"]["state"]})
    wrong = {"state": {i: {k: (v[..., :1] if torch.is_tensor(v) and v.dim() else v) for k, v in s.items()}
                       for i, s in saved["optim"]["state"].items()},
             "param_groups": saved["optim"]["param_groups"]}
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape"):
        fresh_opt.load_state_dict(wrong)


def test_state_dict_round_trip_continues_bit_exactly():
    spawn(_state_dict_worker, 2, backend="gloo", timeout_s=120)


def _with_ddp_worker(rank, world, device, wrapper):
    batches = _batches(device, 5)
    model, ref = _net(device), _net(device)
    ddp = BucketedDDP(model, bucket_size_mb=1e-4) if wrapper == "bucketed" else \
        torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for x, y in batches:
        shard = slice(rank * 4, rank * 4 + 4)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x[shard]), y[shard]).backward()
        if wrapper == "bucketed":
            ddp.finish_gradient_synchronization()
        opt.step()
        _train_step(ref, ref_opt, x, y)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("wrapper", ["bucketed", "torch-ddp"])
def test_works_with_data_parallel_wrappers(wrapper):
    spawn(_with_ddp_worker, 2, wrapper, backend="gloo", timeout_s=120)


def _add_group_worker(rank, world, device):
    model, ref = _net(device), _net(device)
    first = [model.a.weight, model.a.bias]
    opt = ShardedOptimizer(first, torch.optim.AdamW, lr=1e-2)
    opt.add_param_group({"params": [model.b.weight, model.b.bias, model.c.weight], "lr": 3e-3})
    ref_opt = torch.optim.AdamW([ref.a.weight, ref.a.bias], lr=1e-2)
    ref_opt.add_param_group({"params": [ref.b.weight, ref.b.bias, ref.c.weight], "lr": 3e-3})
    assert len(opt.inner.param_groups) == 2 and opt.inner.param_groups[1]["lr"] == 3e-3
    for x, y in _batches(device, 4):
        _train_step(model, opt, x, y)
        _train_step(ref, ref_opt, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # A group that differs between ranks is caught.
    with pytest.raises(ValueError, match="differs between ranks"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3 + rank))]})


def test_add_param_group_and_mismatched_groups():
    spawn(_add_group_worker, 2, backend="gloo", timeout_s=60)


def _bad_input_worker(rank, world, device):
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer([nn.Parameter(torch.zeros(2))], nn.Linear)
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer([nn.Parameter(torch.zeros(2))], "AdamW")
    with pytest.raises(ValueError, match="one device"):
        ShardedOptimizer([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))], torch.optim.SGD, lr=0.1)


def test_bad_input_is_a_clear_error():
    spawn(_bad_input_worker, 1, backend="gloo")
