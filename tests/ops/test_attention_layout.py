"""The outputs' memory layout (`flashsys.ops.attention.layout`): O, dQ, dK, dV of a dense Triton call come back in
(B, N, H, D) memory where the inputs keep their heads inside the sequence dimension (a projection split into heads
and transposed, as models do), dense otherwise; eagerly, replayed, and under torch.compile, where the fake kernels
must promise the strides the real op returns."""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import FlashAttention2Triton, attention_reference
from flashsys.ops.attention.layout import empty_output, heads_inside

from .attention_checks import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _bnhd(batch: int, n: int, heads: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, heads, d, generator=g).to(DEVICE, DTYPE).transpose(1, 2)


def test_the_rule_follows_where_the_heads_lie():
    bnhd = torch.empty(2, 5, 3, 8).transpose(1, 2)
    qkv_slice = torch.empty(2, 5, 3 * 3 * 8)[..., :24].unflatten(-1, (3, 8)).transpose(1, 2)  # fused projection
    dense = torch.empty(2, 3, 5, 8)
    for t in (bnhd, qkv_slice):
        assert heads_inside(t)
        out = empty_output(t)
        assert out.shape == t.shape and out.transpose(1, 2).is_contiguous()
    for t in (dense, torch.empty(2, 5, 8), dense.transpose(2, 3).contiguous().transpose(2, 3)):
        assert not heads_inside(t)
        assert empty_output(t).is_contiguous() and empty_output(t).shape == t.shape
    assert empty_output(dense.to(torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("heads_first", [False, True], ids=["bnhd-inputs", "bhnd-inputs"])
def test_outputs_and_gradients_take_the_inputs_layout_and_stay_exact(heads_first):
    """GQA (4 query heads, 2 K/V heads), causal, a length no tile divides: O and every gradient the op returns
    (seen by hooks, before autograd lays a leaf's .grad out like the leaf) in the inputs' layout, twice (the second
    call replays the first one's plan), all within the float64 reference's tolerance."""
    n, d = (300, 64) if CUDA else (37, 16)
    bases = [_bnhd(2, n, h, d, seed) for h, seed in ((4, 1), (2, 2), (2, 3))]
    if heads_first:
        bases = [t.contiguous() for t in bases]
    do = _bnhd(2, n, 4, d, 4).contiguous()
    leaves = [t.detach().requires_grad_() for t in bases]
    exact = [t.detach().double().requires_grad_() for t in bases]
    attention_reference(*exact, causal=True)[0].backward(do.double())
    for _ in range(2):
        q, k, v = (t.view_as(t) for t in leaves)  # non-leaf views, so that hooks see the op's own gradients
        seen = {}
        for name, t in zip("qkv", (q, k, v)):
            t.register_hook(lambda grad, name=name: seen.__setitem__(name, grad))
        o = FlashAttention2Triton.apply(q, k, v, True)
        assert o.stride() == empty_output(q).stride()
        assert o.transpose(1, 2).is_contiguous() != heads_first
        o.backward(do)
        for name, like in zip("qkv", (q, k, v)):
            assert seen[name].stride() == empty_output(like).stride(), name
        tolerance = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
        for leaf, ref in zip(leaves, exact):
            assert rel_err(leaf.grad, ref.grad) < tolerance
            leaf.grad = None
        ref_o = attention_reference(*(t.detach().double() for t in bases), causal=True)[0]
        assert rel_err(o, ref_o) < tolerance


@pytest.mark.parametrize("heads_first", [False, True], ids=["bnhd-inputs", "bhnd-inputs"])
def test_the_compiled_ops_fake_kernels_promise_the_strides_the_ops_return(heads_first):
    """Inductor plans a graph around the fake kernels' strides (a reshape after the op becomes a view or a copy by
    them), so they must be the real op's, for O and for every gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashsys.ops.attention import library_ops

    forward_op, backward_op = ((library_ops.gluon_forward_op, library_ops.gluon_backward_op) if CUDA else
                               (library_ops.interpreted_forward_op, library_ops.interpreted_backward_op))
    n, d = (256, 64) if CUDA else (24, 16)
    q, k, v, do = (_bnhd(1, n, h, d, seed) for h, seed in ((4, 5), (2, 6), (2, 7), (4, 8)))
    if heads_first:
        q, k, v = (t.contiguous() for t in (q, k, v))
    o, lse = forward_op(q, k, v, -1, 0, d ** -0.5)
    grads = backward_op(q, k, v, o, lse, do, -1, 0, d ** -0.5)
    with FakeTensorMode() as mode:
        fq, fk, fv, fdo = (mode.from_tensor(t) for t in (q, k, v, do))
        fake_o, fake_lse = forward_op(fq, fk, fv, -1, 0, d ** -0.5)
        fake_grads = backward_op(fq, fk, fv, fake_o, fake_lse, fdo, -1, 0, d ** -0.5)
    assert (fake_o.stride(), fake_lse.stride()) == (o.stride(), lse.stride())
    assert [g.stride() for g in fake_grads] == [g.stride() for g in grads]
    assert o.transpose(1, 2).is_contiguous() != heads_first


def test_a_compiled_layer_matches_the_eager_one():
    """The op, then the reshape back to (B, N, H * D) a model does, compiled: the same numbers as eager."""
    torch._dynamo.reset()
    n, d = (256, 64) if CUDA else (24, 16)
    q, k, v = (_bnhd(1, n, 2, d, seed) for seed in (5, 6, 7))

    def layer(q, k, v):
        o = FlashAttention2Triton.apply(q, k, v, True)
        return o.transpose(1, 2).reshape(1, n, 2 * d) * 2

    eager = layer(q, k, v)
    compiled = torch.compile(layer, dynamic=False)(q, k, v)
    assert torch.equal(eager, compiled)
