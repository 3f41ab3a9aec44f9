"""Nothing silently wrong in the ops: NaN propagates as in the reference, double backward is refused with a
clear error, and flags that only look like bools or floats are rejected."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

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


HUGE_WINDOWS = [(-1, 2**31 - 1), (2**31 - 1, 0), (2**31, 2**31), (sys.maxsize, sys.maxsize), (sys.maxsize, -1)]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
@pytest.mark.parametrize("window", HUGE_WINDOWS, ids=str)
def test_window_bounds_wider_than_the_sequence_bound_nothing(op, window):
    """Bounds near or past the integer limits are no bound: the same output as the unbounded side, not a 32-bit
    overflow into a mask that hides every key (an all-zero output)."""
    q, k, v, _ = make_qkv(1, 2, 24, 40, 16, torch.float32, DEVICE, seed=11)
    left, right = window
    unbounded = (-1, 0 if right == 0 else -1)
    expected = attention_reference(q.double(), k.double(), v.double(), False, None, unbounded)[0]
    torch.testing.assert_close(attention_reference(q.double(), k.double(), v.double(), False, None, window)[0],
                               expected)
    torch.testing.assert_close(op.apply(q, k, v, False, None, window).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_window_bounds_beyond_64_bits_are_refused(op):
    q, k, v, _ = make_qkv(1, 2, 8, 8, 16, torch.float32, DEVICE, seed=12)
    with pytest.raises(ValueError, match="fit in 64 bits"):
        op.apply(q, k, v, False, None, (2**63 + 5, -1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_huge_window_bounds_in_packed_sequences(backend):
    from flashsys.ops import flash_attention_varlen

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(30, 2, 16, generator=g).to(DEVICE) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    for window in HUGE_WINDOWS:
        out = flash_attention_varlen(q, k, v, cu, cu, 20, 20, window_size=window, backend=backend)
        causal = window[1] == 0
        full = flash_attention_varlen(q, k, v, cu, cu, 20, 20, causal=causal, backend=backend)
        torch.testing.assert_close(out, full)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_no_heads_gives_an_empty_output_as_sdpa(op):
    q, k, v = (torch.randn(2, 0, 8, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    out = op.apply(q, k, v, True)
    assert out.shape == F.scaled_dot_product_attention(q, k, v).shape == (2, 0, 8, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        op.apply(torch.randn(2, 2, 8, 16, device=DEVICE), k, v)
