"""Nothing silently wrong in the ops: NaN propagates as in the reference, double backward is refused with a
clear error, and flags that only look like bools or floats are rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashsys.ops.attention import FlashAttention2Torch, FlashAttention2Triton, attention_reference

from .attention_checks import make_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OPS = [FlashAttention2Torch, FlashAttention2Triton]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_propagates_like_the_reference(op, where, causal):
    q, k, v, _ = make_qkv(1, 2, 24, 24, 16, torch.float32, DEVICE, seed=5)
    {"q": q, "k": k, "v": v}[where][0, 1, 7, 3] = float("nan")
    out = op.apply(q, k, v, causal)
    ref = attention_reference(q.double(), k.double(), v.double(), causal)[0]
    assert torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN must reach exactly the outputs it reaches in the reference"


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_nan_input_gives_nan_gradients_not_finite_ones(op):
    q, k, v, do = make_qkv(1, 1, 16, 16, 16, torch.float32, DEVICE, seed=6)
    q[0, 0, 4, 0] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    op.apply(q, k, v, False).backward(do)
    assert torch.isnan(q.grad[0, 0, 4]).all() and torch.isnan(k.grad).any()


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_double_backward_is_refused_clearly(op):
    q, k, v, _ = make_qkv(1, 1, 8, 8, 16, torch.float32, DEVICE, seed=7)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = op.apply(q, k, v, True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    # First-order gradients still work after the refusal.
    out = op.apply(q, k, v, True)
    (g,) = torch.autograd.grad(out.square().sum(), q)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_flags_that_only_look_like_bools_or_floats_are_rejected(op):
    q, _, _, _ = make_qkv(1, 1, 8, 8, 16, torch.float32, DEVICE, seed=8)
    for bad in (2, 1, 0.5, "yes", None):
        with pytest.raises(TypeError, match="is_causal must be True or False"):
            op.apply(q, q, q, bad)
    with pytest.raises(TypeError, match="softmax_scale"):
        op.apply(q, q, q, False, True)
    out = op.apply(q, q, q, np.True_)  # numpy's bool is a bool
    torch.testing.assert_close(out, op.apply(q, q, q, True))
