"""Repeated eager calls replay a plan (flashsys.ops.attention.replay.plans): the replays must give the full path's
results for fresh inputs, and anything that changes the launch (shape, strides, alignment, dtype, flags, saved-tensor
hooks, dO's strides) must reach its own plan or the full path, never another signature's plan.

On a CPU these run under Triton's interpreter in fp32 (the only CPU dtype that is planned); on a GPU in bf16. Every
test runs with each launcher: the Python replays, and the native launcher's C++ node, which replays the same plans.
"""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import FlashAttention2Triton, calls, launcher, replay
from flashsys.ops.attention import flash_triton as ft
from flashsys.ops.attention.replay import plans

from .attention_checks import assert_matches_reference, make_qkv, refuse_calls, select_launcher

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture(autouse=True, params=["python", "native"])
def which_launcher(request, monkeypatch):
    select_launcher(request.param, request, monkeypatch)
    return request.param


@pytest.fixture(autouse=True)
def _fresh_plans(which_launcher):
    replay.clear()
    yield
    replay.clear()


@pytest.fixture
def no_full_path(monkeypatch):
    """After this, a call that does not replay a plan fails: the full path's validation raises."""
    def refuse():
        refuse_calls(monkeypatch, ft, "check_attention_inputs")
        refuse_calls(monkeypatch, launcher, "backward")

    return refuse


CASES = {
    "causal": dict(shape=(2, 2, 40, 40, 32), causal=True, window=None, kv_heads=None),
    "gqa, Nq != Nk, window": dict(shape=(1, 4, 24, 56, 16), causal=False, window=(8, 4), kv_heads=2),
    "rank 3, scale": dict(shape=(2, None, 33, 33, 16), causal=True, window=None, kv_heads=None, scale=0.3),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_replayed_calls_match_the_reference_on_fresh_inputs(case, no_full_path):
    batch, heads, n_q, n_k, d = case["shape"]
    scale = case.get("scale")
    for seed in range(2):  # the first call may autotune; the second makes the plans
        q, k, v, do = make_qkv(batch, heads, n_q, n_k, d, DTYPE, DEVICE, seed=seed, kv_heads=case["kv_heads"])
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, case["causal"], scale, case["window"])
    assert len(plans.forward_plans) == 1 and len(plans.backward_plans) == 1
    no_full_path()
    for seed in range(2, 4):
        q, k, v, do = make_qkv(batch, heads, n_q, n_k, d, DTYPE, DEVICE, seed=seed, kv_heads=case["kv_heads"])
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, case["causal"], scale, case["window"])


def test_a_forward_without_a_plan_still_replays_its_backward(monkeypatch):
    """A forward that ran but left nothing to replay (the Gluon forward under a CUDA graph capture, or with a Triton
    whose descriptors it cannot re-base) makes no forward plan. Its backward, the `tl` kernels', must still make and
    replay a plan of its own instead of taking the full path every call. The reference math stands in for the Gluon
    kernel here, writing O and L in place as it does."""
    from flashsys.ops.attention import attention_reference, dispatch
    from flashsys.ops.attention.gluon import launch as gluon_launch

    def forward_in_place(variant, t, window, scale, record=True):
        o_ref, lse_ref = attention_reference(t.q.double(), t.k.double(), t.v.double(), True, scale)
        t.o.copy_(o_ref)
        t.lse.copy_(lse_ref)
        return None  # ran, no replay

    monkeypatch.setattr(dispatch, "takes_forward", lambda q, k, v, window: True)
    monkeypatch.setattr(dispatch, "chosen", lambda key: dispatch.FORWARD_VARIANTS[64][0])
    monkeypatch.setattr(gluon_launch, "launch", forward_in_place)
    for seed in range(20, 22):  # the first backward may autotune; the second makes the plan
        q, k, v, do = make_qkv(2, 2, 40, 40, 32, DTYPE, DEVICE, seed=seed)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
    assert len(plans.forward_plans) == 0 and len(plans.backward_plans) == 1
    refuse_calls(monkeypatch, launcher, "backward")
    for seed in range(22, 24):
        q, k, v, do = make_qkv(2, 2, 40, 40, 32, DTYPE, DEVICE, seed=seed)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)


def _warm(q, k, v, do, causal=True):
    for _ in range(2):
        FlashAttention2Triton.apply(*(t.detach().requires_grad_() for t in (q, k, v)), causal).backward(do)


def _check_as_given(q, k, v, do, causal, window=None):
    """The op on these very tensors (no copy: their strides and addresses are the point) against float64."""
    from flashsys.ops.attention import attention_reference

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = FlashAttention2Triton.apply(*leaves, causal, None, window)
    o.backward(do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_ref = attention_reference(*ref, causal, None, window)[0]
    o_ref.backward(do.double())
    tol = dict(rtol=3e-2, atol=3e-2) if CUDA else dict(rtol=1e-4, atol=1e-4)
    for got, want in zip([o, *(t.grad for t in leaves)], [o_ref, *(t.grad for t in ref)]):
        torch.testing.assert_close(got.double(), want, **tol)


def test_strides_alignment_and_flags_each_get_their_own_plan():
    q, k, v, do = make_qkv(2, 2, 40, 40, 32, DTYPE, DEVICE, seed=5)
    _warm(q, k, v, do)
    assert len(plans.forward_plans) == 1
    # the same shapes as (B, N, H, D) storage seen through a transpose: other strides
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    # inputs at an address that is not 16-byte aligned: Triton specialises kernels on alignment
    n = q.numel()
    base = torch.randn(3 * n + 1, generator=torch.Generator().manual_seed(6)).to(DEVICE, DTYPE)
    qm, km, vm = (base[1 + i * n: 1 + (i + 1) * n].view(q.shape) for i in range(3))
    assert qm.data_ptr() % 16
    variants = [((qt, kt, vt), True, None), ((qm, km, vm), True, None), ((q, k, v), False, None),
                ((q, k, v), False, (4, 4))]
    for tensors, causal, window in variants:
        for _ in range(2):  # a first call with new flags may autotune; the second makes the plan
            _check_as_given(*tensors, do, causal, window)
    assert len(plans.forward_plans) == 1 + len(variants)
    for tensors, causal, window in variants:  # every plan replayed once more, interleaved
        _check_as_given(*tensors, do, causal, window)
    assert len(plans.forward_plans) == 1 + len(variants)


def test_bad_input_after_a_plan_still_raises():
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=7)
    _warm(q, k, v, do)
    with pytest.raises(TypeError, match="one dtype"):
        FlashAttention2Triton.apply(q, k.to(torch.float16), v, True)
    with pytest.raises(ValueError):
        FlashAttention2Triton.apply(q, k[..., :8], v, True)
    with pytest.raises(ValueError):
        FlashAttention2Triton.apply(q, k, v, True, -1.0)


def test_saved_tensor_hooks_that_change_strides_reach_another_backward_plan():
    """A pack/unpack pair may hand the backward tensors with other strides than the forward saw (here: stored
    transposed): the backward is keyed on what it is handed, so it does not replay a plan made for the others."""
    q, k, v, do = make_qkv(2, 2, 40, 40, 32, DTYPE, DEVICE, seed=8)
    _warm(q, k, v, do)

    def pack(t):
        return t.transpose(-1, -2).contiguous() if t.dim() == 4 else t

    def unpack(t):
        return t.transpose(-1, -2) if t.dim() == 4 else t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        for seed in range(9, 12):
            q, k, v, do = make_qkv(2, 2, 40, 40, 32, DTYPE, DEVICE, seed=seed)
            assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
    assert len(plans.backward_plans) == 2


def test_a_stride_zero_grad_replays_correctly():
    q, k, v, _ = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=12)
    grads = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        FlashAttention2Triton.apply(*leaves, True).sum().backward()  # dO is an expanded (stride 0) scalar
        grads.append([t.grad for t in leaves])
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    from flashsys.ops.attention import attention_reference
    attention_reference(*ref, True)[0].sum().backward()
    for got in grads:
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.double(), r.grad, rtol=2e-2 if CUDA else 1e-4, atol=2e-2 if CUDA else 1e-4)
    assert len(plans.backward_plans) == 1


def test_keys_refuse_what_plans_do_not_cover():
    q = torch.randn(1, 2, 8, 16)
    assert plans.forward_key(q, q, q, True, None, None) is not None
    assert plans.forward_key(q, q, q, 1, None, None) is None  # a non-bool flag: the full path decides
    assert plans.forward_key(q, q, q, True, None, [4, 4]) is None
    assert plans.forward_key(q, q, q, True, torch.tensor(0.5), None) is None
    assert plans.forward_key(q, q, torch.nn.Parameter(q), True, None, None) is not None
    table = plans.PlanTable()
    for i in range(plans.MAX_PLANS + 5):
        table.remember(i, object())
    assert len(table) <= plans.MAX_PLANS


def test_a_compiled_graphs_opaque_ops_replay_plans(which_launcher, monkeypatch):
    """A compiled graph calls its opaque attention ops (the Gluon kernels' on Hopper, the interpreter's on a CPU)
    with one signature every step. From the second call on they replay a plan instead of taking the full path (its
    checks, TMA descriptors and Triton's dispatch), and give the reference's results on fresh inputs. With the
    native launcher the replays are its own: the Python plans' launches never run again."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.replay import native

    if CUDA:
        if dispatch.status().startswith("off"):
            pytest.skip("on a GPU only the Gluon ops are opaque (Hopper, a Triton with Gluon's Hopper API)")
        monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    shape = (1, 4, 256, 256, 64) if CUDA else (1, 2, 40, 40, 16)

    class Compiled:
        apply = staticmethod(torch.compile(FlashAttention2Triton.apply, backend="aot_eager", dynamic=False))

    torch._dynamo.reset()  # the plans start empty (`_fresh_plans`)
    try:
        for seed in range(2):
            q, k, v, do = make_qkv(*shape, DTYPE, DEVICE, seed=seed)
            assert_matches_reference(Compiled, q, k, v, do, True, None)
        assert len(plans.op_forward_plans) == 1 and len(plans.backward_plans) == 1
        refuse_calls(monkeypatch, launcher, "forward", "backward")
        refuse_calls(monkeypatch, calls, "forward", "backward")
        if which_launcher == "native":
            assert native.sizes() == (0, 1, 1)  # no eager forward plan: the graph's forward op has its own
            refuse_calls(monkeypatch, plans.ForwardPlan, "launch")
            refuse_calls(monkeypatch, plans.BackwardPlan, "launch")
        for seed in range(2, 4):
            q, k, v, do = make_qkv(*shape, DTYPE, DEVICE, seed=seed)
            assert_matches_reference(Compiled, q, k, v, do, True, None)
        replay.clear()
        assert native.sizes() == (0, 0, 0)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_a_plan_is_not_replayed_on_another_device_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    for device in ("cuda:0", "cuda:1", "cuda:1", "cuda:0"):
        q, k, v, do = make_qkv(1, 2, 64, 64, 64, torch.bfloat16, device, seed=13)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
