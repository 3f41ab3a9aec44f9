"""The op contract (README "Using it"): saved tensors, strides, torch.compile, dispatch, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashsys.ops.attention import (
    FlashAttention2Torch,
    FlashAttention2Triton,
    attention_reference,
    flash_attention,
)

from .attention_checks import assert_matches_reference, eager_then_compiled, make_qkv, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OPS = [FlashAttention2Torch, FlashAttention2Triton]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
@pytest.mark.parametrize("rank4", [False, True])
def test_saved_tensors_are_q_k_v_o_and_float32_logsumexp(op, rank4):
    q, k, v, _ = make_qkv(2, 3 if rank4 else None, 40, 24, 32, torch.float16, DEVICE, seed=1)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = op.apply(q, k, v, True)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5
    assert saved[0] is q and saved[1] is k and saved[2] is v
    assert saved[3].data_ptr() == o.data_ptr() and saved[3].shape == o.shape
    lse = saved[4]
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    assert sum(t.shape == q.shape[:-1] for t in saved) == 1, "L must be the only saved tensor of its shape"
    _, lse_ref = attention_reference(q.double(), k.double(), v.double(), True)
    assert torch.allclose(lse.double(), lse_ref, atol=1e-4)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_stride_zero_grad_and_noncontiguous_views(op):
    """The leaderboard's inputs: views of one tensor, dO = ones with stride 0 from o.sum()."""
    qkv = torch.randn(3, 2, 37, 2, 32, device=DEVICE).transpose(2, 3)  # (3, B, H, N, D), non-contiguous
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(0))
    assert not q.is_contiguous()
    op.apply(q, k, v, True).sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    attention_reference(*ref, causal=True)[0].sum().backward()
    for ours, exact in zip((q, k, v), ref):
        assert rel_err(ours.grad, exact.grad) < 1e-5


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_rows_that_see_no_key_give_zero_output_and_gradient(op):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key (bottom-right alignment)."""
    q, k, v, do = make_qkv(1, 2, 50, 20, 16, torch.float32, DEVICE, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = op.apply(q, k, v, True)
    lse = o.grad_fn.saved_tensors[4]
    o.backward(do)
    assert torch.all(o[..., :30, :] == 0) and torch.all(torch.isinf(lse[..., :30]))
    assert torch.all(q.grad[..., :30, :] == 0)
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize("n_q,n_k", [(0, 24), (0, 600), (16, 0), (0, 0)])
@pytest.mark.parametrize("mask", [{"causal": False}, {"causal": True}, {"causal": True, "window_size": (5, 0)}],
                         ids=["full", "causal", "window"])
def test_empty_query_or_key_sequences_give_sdpa_s_result(backend, n_q, n_k, mask):
    """As SDPA: no queries give an empty output; no keys give zeros (rows that see no key, as in a masked row),
    a logsumexp of -inf and zero gradients. GQA, rank 4, on whichever device the suite runs; 600 keys are what
    a few queries would take to the decode kernels."""
    q, k, v, do = make_qkv(2, 4, n_q, n_k, 64, torch.bfloat16 if CUDA else torch.float32, DEVICE, seed=5,
                           kv_heads=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, backend=backend, **mask)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert not o.any()
    if backend != "auto":
        lse = o.grad_fn.saved_tensors[4]
        assert lse.shape == q.shape[:-1] and torch.all(lse == float("-inf"))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    for x, g in ((q, dq), (k, dk), (v, dv)):
        assert g.shape == x.shape and not g.any()


def test_the_row_and_cache_ops_take_empty_sequences_too():
    """Rows of no tokens split into no documents (packed, padded) and an empty query block reads no cache (decode):
    each gives the empty output flash_attention gives, after checking its other arguments."""
    from flashsys.ops import flash_attention_decode, flash_attention_packed, flash_attention_padded

    q, k, v, _ = make_qkv(2, 4, 0, 0, 16, torch.float32, DEVICE, seed=6, kv_heads=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    calls = {
        "packed by position": lambda: flash_attention_packed(q, k, v, torch.zeros(2, 0, dtype=torch.long,
                                                                                  device=DEVICE), causal=True),
        "packed by offsets": lambda: flash_attention_packed(
            q, k, v, cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device=DEVICE), causal=True),
        "padded": lambda: flash_attention_padded(q, k, v, torch.ones(2, 0, dtype=torch.bool, device=DEVICE)),
    }
    for name, call in calls.items():
        o = call()
        assert o.shape == q.shape, name
        o.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape, name
    cache = torch.randn(2, 2, 40, 16, device=DEVICE)
    assert flash_attention_decode(q.detach(), cache, cache).shape == q.shape
    with pytest.raises(ValueError, match="key_mask"):
        flash_attention_decode(q.detach(), cache, cache, key_mask=torch.ones(2, 39, dtype=torch.bool, device=DEVICE))


def test_float64_torch_op_is_exact():
    q, k, v, do = make_qkv(2, None, 70, 90, 24, torch.float64, "cpu", seed=4)
    assert_matches_reference(FlashAttention2Torch, q, k, v, do, True, 0.3)


def test_functional_dispatch_and_forced_backends():
    q, k, v, _ = make_qkv(1, 2, 20, 20, 16, torch.float32, DEVICE, seed=5)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), True)
    for backend in ("auto", "torch", "triton"):
        out = flash_attention(q, k, v, causal=True, backend=backend)
        assert rel_err(out, ref) < 1e-5
    auto = flash_attention(q, k, v, causal=True)
    assert auto.grad_fn is None  # no grad asked
    q.requires_grad_()
    expected = "FlashAttention2Triton" if CUDA else "FlashAttention2Torch"
    assert expected in type(flash_attention(q, k, v).grad_fn).__name__
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, k, v, backend="cuda")


def test_torch_compile_of_torch_op_matches_eager():
    q, k, v, do = make_qkv(1, 2, 40, 40, 16, torch.float32, DEVICE, seed=6)
    compiled = torch.compile(FlashAttention2Torch.apply, fullgraph=False)
    grads = []
    for fn in (FlashAttention2Torch.apply, compiled):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = fn(qq, kk, vv, True)
        o.backward(do)
        grads.append((o.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_inductor_sees_each_kernel_write_only_its_outputs():
    """Under torch.compile Inductor functionalizes each kernel launch from its analysis of the kernel's TTIR: an
    argument it counts as written is copied back after the launch, and a leaf that requires grad cannot be, so
    `torch.compile(FlashAttention2Triton.apply)` on leaf inputs failed when the dense kernels passed q as the
    unused varlen offsets into a helper. Runs on CPU too (TTIR for an sm_90 target, no interpreter)."""
    pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.ops.inductor_writes"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
    written = json.loads(r.stdout.strip().splitlines()[-1])
    outputs = {"fwd": ["L", "O"], "dq": ["DQ", "LseDelta"], "dkdv": ["DK", "DV"]}
    assert len(written) == 9
    for launch, names in written.items():
        assert names == outputs[launch.split()[0]], launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if CUDA else [torch.float32])
def test_torch_compile_of_triton_op_matches_eager(dtype):
    """Static shapes, eager first (as the leaderboard runs it): the compiled graph launches the config eager chose,
    so bf16 results are equal bit for bit. The reset drops other tests' compiles of the same Function, after
    which Dynamo would mark the lengths dynamic (and Inductor would autotune on its own)."""
    torch._dynamo.reset()
    n = 1000 if CUDA else 40
    q, k, v, _ = make_qkv(2, 4 if CUDA else 2, n, n, 64 if CUDA else 16, dtype, DEVICE, seed=7)
    for a, b in zip(*eager_then_compiled(FlashAttention2Triton, q, k, v, True)):
        if dtype == torch.float32:  # bf16 matches bit for bit; fp32 gradients differ at rounding level (~1e-8)
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(a, b)


def test_eager_calls_skip_the_custom_ops_and_traced_calls_use_them():
    """Eager calls launch directly (the custom-op dispatch is host time); fake tensors must go through the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashsys.ops.attention import calls

    plain = torch.randn(2, 3)
    assert calls.eager(plain, torch.nn.Parameter(torch.randn(2)))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(plain)
    assert not calls.eager(plain, fake)


def test_launches_after_the_first_reuse_the_chosen_config_bit_for_bit():
    """The first call goes through Triton's autotuner, later ones launch its choice directly: same numbers."""
    from flashsys.ops.attention.triton import launch

    q, k, v, do = make_qkv(1, 2, 48, 40, 32, torch.float16, DEVICE, seed=9)
    launch.forget_configs()
    results = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = FlashAttention2Triton.apply(qq, kk, vv, True)
        o.backward(do)
        results.append((o.detach(), qq.grad, kk.grad, vv.grad))
        if not launch.chosen_configs():
            pytest.fail("no launch config was recorded after the first call")
    assert {key[0] for key in launch.chosen_configs()} == {"fwd", "dkdv", "dq"}
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_memory_grows_linearly_in_sequence_length_gpu():
    """Peak extra memory of forward + backward: x4 in N gives about x4 in memory (an N^2 op would give x16)."""
    peaks = {}
    for n in (4096, 16384):
        q, k, v, do = make_qkv(1, 8, n, n, 64, torch.bfloat16, "cuda", seed=8)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        FlashAttention2Triton.apply(q, k, v, True).backward(do)
        torch.cuda.synchronize()
        peaks[n] = torch.cuda.max_memory_allocated() - base
        del q, k, v, do
    ratio = peaks[16384] / peaks[4096]
    assert ratio < 5.0, f"peak memory grew x{ratio:.1f} for x4 sequence length: {peaks}"


@pytest.mark.gpu
def test_more_batch_heads_than_a_grid_dimension_holds_gpu():
    """B * H and B * H_kv past 65535, the most a CUDA grid's y dimension holds: the kernels' 1-D grids run them all
    (with batch * head on y, the launch failed)."""
    q, k, v, do = make_qkv(33000, 4, 24, 24, 16, torch.float16, "cuda", seed=21, kv_heads=2)
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, 0.25)


# ---------------------------------------------------------------------------------------------------
# Bad input: a clear ValueError/TypeError naming the argument, never a crash or a compile error.
# ---------------------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32, device=DEVICE):
    if dtype.is_floating_point:
        return torch.randn(*shape, device=device).to(dtype)
    return torch.ones(*shape, dtype=dtype, device=device)


BAD_INPUTS = [
    ("head dims", lambda: (_t(2, 8, 16), _t(2, 8, 32), _t(2, 8, 32)), ValueError, "head_dim"),
    ("batch dims", lambda: (_t(2, 8, 16), _t(3, 8, 16), _t(3, 8, 16)), ValueError, "batch"),
    ("head count", lambda: (_t(2, 4, 8, 16), _t(2, 3, 8, 16), _t(2, 3, 8, 16)), ValueError,
     "multiple of the key/value heads"),
    ("dtypes", lambda: (_t(2, 8, 16), _t(2, 8, 16, dtype=torch.float16), _t(2, 8, 16)), TypeError, "dtype"),
    ("k/v lengths", lambda: (_t(2, 8, 16), _t(2, 8, 16), _t(2, 9, 16)), ValueError, "sequence length"),
    ("rank 2", lambda: (_t(8, 16), _t(8, 16), _t(8, 16)), ValueError, "rank 2"),
    ("rank 5", lambda: (_t(1, 2, 2, 8, 16),) * 3, ValueError, "rank 5"),
    ("mixed ranks", lambda: (_t(1, 8, 16), _t(1, 1, 8, 16), _t(1, 1, 8, 16)), ValueError, "rank"),
    ("integers", lambda: (_t(2, 8, 16, dtype=torch.int64),) * 3, TypeError, "int64"),
    ("not a tensor", lambda: ([[1.0]], _t(2, 8, 16), _t(2, 8, 16)), TypeError, "torch.Tensor"),
    ("empty head_dim", lambda: (_t(2, 8, 0), _t(2, 8, 0), _t(2, 8, 0)), ValueError, "head_dim must be positive"),
]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
@pytest.mark.parametrize("name,make,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_clear_error(op, name, make, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        op.apply(q, k, v, False)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_bad_scale_and_causal_flag(op):
    q = _t(1, 8, 16)
    with pytest.raises(ValueError, match="softmax_scale"):
        op.apply(q, q, q, False, float("nan"))
    with pytest.raises(ValueError, match="softmax_scale"):
        op.apply(q, q, q, False, -1.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        op.apply(q, q, q, False, "0.5")
    with pytest.raises(TypeError, match="is_causal"):
        op.apply(q, q, q, "yes")


def test_triton_rejects_head_dim_above_its_maximum():
    q = _t(1, 8, 512)
    with pytest.raises(ValueError, match="head_dim 512"):
        FlashAttention2Triton.apply(q, q, q, False)


def test_mismatched_devices_are_named():
    if not CUDA:
        meta = torch.empty(1, 8, 16, device="meta")
        cpu = _t(1, 8, 16, device="cpu")
        with pytest.raises(ValueError, match="one device"):
            FlashAttention2Torch.apply(cpu, meta, meta, False)
    else:
        with pytest.raises(ValueError, match="one device"):
            FlashAttention2Triton.apply(_t(1, 8, 16), _t(1, 8, 16, device="cpu"), _t(1, 8, 16), False)


def test_triton_op_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = _t(1, 8, 16, device="cpu")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        FlashAttention2Triton.apply(q, q, q, False)


@pytest.mark.gpu
def test_repeated_and_misaligned_calls_through_the_fast_launch_gpu():
    """The third call of a shape launches the compiled kernel directly (no JITFunction.run). Fresh inputs each time,
    and then inputs at an address that is not 16-byte aligned: the kernel compiled for aligned pointers must not be
    reused for them (Triton specialises on alignment), so the results must match the reference in every case."""
    from flashsys.ops.attention.triton import launch

    launch.forget_configs()
    for seed in range(4):
        q, k, v, do = make_qkv(2, 3, 72, 72, 64, torch.bfloat16, "cuda", seed=20 + seed)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
    assert launch.fast_launch_count(), "repeated calls never reached the fast launch"
    for batch in (3, 1):  # the same strides as batch 2, other grids: a replay must not keep the first call's grid
        q, k, v, do = make_qkv(batch, 3, 72, 72, 64, torch.bfloat16, "cuda", seed=30 + batch)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
    n = 2 * 3 * 72 * 64
    for seed in range(3):
        base = torch.randn(3 * n + 8, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        q, k, v = (base[1 + i * n: 1 + (i + 1) * n].view(2, 3, 72, 64) for i in range(3))  # 2-byte offset
        assert q.data_ptr() % 16
        do = torch.randn(2, 3, 72, 64, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)


@pytest.mark.gpu
def test_compiled_call_before_any_eager_call_matches_the_reference_gpu():
    """Compiled first, so no eager config exists for the key: Inductor autotunes the same candidates itself."""
    torch._dynamo.reset()
    from flashsys.ops.attention.triton import launch

    q, k, v, do = make_qkv(1, 4, 333, 333, 128, torch.bfloat16, "cuda", seed=31)
    assert not any(key.bucket == 512 and key.head_dim == 128 for key in launch.chosen_configs())
    assert_matches_reference(_Compiled(), q, k, v, do, True, None)


class _Compiled:
    """`apply` of the compiled Function, so the reference check can run it like an op."""

    def __init__(self):
        self.apply = torch.compile(FlashAttention2Triton.apply, fullgraph=True)
