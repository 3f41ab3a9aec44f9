"""The Gluon dK/dV kernel (Hopper): which backward calls it takes, and on an H100 that every variant's dK and dV
match float64 reference math for every feature the `tl` dK/dV kernel has (after the `tl` dQ kernel, which writes
the pairs it reads), alone and through the op, eager and compiled. Its compile check for sm_90 on CPU is in
test_gluon_forward (one subprocess compiles every Gluon variant)."""

from __future__ import annotations

import pytest
import torch

from .attention_checks import FLOOR, assert_matches_reference, eager_then_compiled, make_qkv, rel_err, run_reference

pytest.importorskip("triton")
from flashsys.ops.attention import flash_gluon  # noqa: E402

from .test_gluon_forward import CASES, _inputs, hopper_only  # noqa: E402


def test_backward_takes_what_the_forward_takes_and_a_tma_ready_do():
    """The backward's dO must be TMA-addressable too, and its head dim one the kernel has variants for; every other
    condition is the forward's."""
    q = torch.randn(1, 2, 64, 128)
    assert not flash_gluon.takes_backward(q, q, q, q)  # a CPU tensor: the forward's reasons apply
    key = flash_gluon.ChoiceKey.of(q.to(torch.bfloat16), q, (-1, 0), "dkdv")
    assert key.candidates() == flash_gluon.DKDV_VARIANTS[128] and key.bound_right and not key.bound_left
    assert 64 not in flash_gluon.DKDV_VARIANTS  # there the `tl` dK/dV kernel is faster
    assert "head dim 64" in flash_gluon.backward_problem(*(torch.randn(1, 2, 64, 64),) * 3)
    assert flash_gluon.backward_problem(q, q, q) == "not a CUDA tensor"


@hopper_only
@pytest.mark.gpu
def test_compiled_backward_at_d64_stays_with_inductor_gpu(monkeypatch):
    """At D 64 (no Gluon dK/dV variants) a traced backward keeps the triton_op that Inductor launches itself."""
    from flashsys.ops.attention import flash_triton

    monkeypatch.setattr(flash_gluon, "MIN_WORK", 0)
    q = torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_triton._traced_forward(q, q, q) is flash_triton._gluon_forward_op
    assert flash_triton._traced_backward(q, q, q) is flash_triton.flash_attention_backward_op


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for d, vs in flash_gluon.DKDV_VARIANTS.items() for v in vs],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_each_dkdv_variant_matches_reference_gpu(variant, case):
    """dK and dV of the variant, launched alone after the `tl` backward wrote the pairs, against float64 (within
    twice plain PyTorch's own error), on the forward's masked cases: ragged tiles, GQA, Nq != Nk with rows that see
    no key, windows, (B, N, H, D) strides, rank 3."""
    from flashsys.ops.attention import flash_triton

    d, var = variant
    batch, heads, kv_heads, n_q, n_k, window, layout, dtype = case
    q, k, v = _inputs(batch, heads, kv_heads, n_q, n_k, d, layout, dtype, seed=n_q + d)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(d)).to("cuda", dtype)
    scale = d ** -0.5
    o, lse = flash_triton.flash_forward_triton(q, k, v, window, scale)
    g = flash_triton._geometry_of(q.shape, k.shape, q.dtype)
    dq, dk_tl, dv_tl = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device="cuda")
    flash_triton._launch_backward(g, q, k, v, o, lse, do, dq, dk_tl, dv_tl, lse_delta, q, k, window, scale, False)
    dk, dv = (torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in (k, v))
    flash_gluon._launch(var, *(flash_gluon._rank4(t) for t in (q, k, v, do, dk, dv)), lse_delta, window, scale)
    *_, dk_ref, dv_ref = run_reference(q, k, v, do, False, scale, torch.float64, window)
    *_, dk_plain, dv_plain = run_reference(q, k, v, do, False, scale, dtype, window)
    for name, ours, ref, plain, tl_result in (("dK", dk, dk_ref, dk_plain, dk_tl), ("dV", dv, dv_ref, dv_plain, dv_tl)):
        err, base, tl_err = rel_err(ours, ref), rel_err(plain, ref), rel_err(tl_result, ref)
        assert err <= 2 * max(base, tl_err) + FLOOR[dtype], f"{name}: {err:.3g} vs PyTorch {base:.3g}, tl {tl_err:.3g}"


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_op_takes_gluon_backward_and_trains_gpu(causal, monkeypatch):
    """Through FlashAttention2Triton a large enough call runs the Gluon dK/dV kernel (its choice is recorded), and
    every output and gradient matches float64."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(flash_gluon, "MIN_WORK", 0)
    q, k, v, do = make_qkv(1, 16, 2048, 2048, 128, torch.bfloat16, "cuda", seed=4, kv_heads=4)
    flash_gluon._chosen.clear()
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, causal, None)
    assert any(key.kernel == "dkdv" for key in flash_gluon.chosen_variants()), "the Gluon dK/dV kernel did not run"


@hopper_only
@pytest.mark.gpu
def test_compiled_op_runs_the_gluon_backward_bit_for_bit_gpu(monkeypatch):
    """torch.compile's backward calls the Gluon kernels through their custom op: equal to eager, bit for bit."""
    from flashsys.ops.attention import FlashAttention2Triton, flash_triton

    torch._dynamo.reset()
    monkeypatch.setattr(flash_gluon, "MIN_WORK", 0)
    q, k, v, _ = make_qkv(1, 16, 4096, 4096, 128, torch.bfloat16, "cuda", seed=6)
    assert flash_triton._traced_backward(q, k, v) is flash_triton._gluon_backward_op
    for a, b in zip(*eager_then_compiled(FlashAttention2Triton, q, k, v, True)):
        assert torch.equal(a, b)


@hopper_only
@pytest.mark.gpu
def test_stride_zero_do_and_unaligned_do_gpu(monkeypatch):
    """`o.sum().backward()` hands over a stride-0 dO (made dense before the kernels); a dO TMA cannot read keeps the
    `tl` dK/dV kernel. Both give the reference gradients."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(flash_gluon, "MIN_WORK", 0)
    q, k, v, _ = make_qkv(1, 8, 1024, 1024, 128, torch.bfloat16, "cuda", seed=8)
    unaligned = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    assert flash_gluon.takes(q, k, v) and not flash_gluon.takes_backward(q, k, v, unaligned)
    stride_zero = torch.ones((), device="cuda", dtype=q.dtype).expand(q.shape)
    assert_matches_reference(FlashAttention2Triton, q, k, v, stride_zero, True, None)
    assert_matches_reference(FlashAttention2Triton, q, k, v, unaligned, True, None)
