"""Bad configurations and inputs of the modules are clear errors, never NaN tables or errors from inside torch."""

from __future__ import annotations

import pytest
import torch

from flashsys.nn import MultiHeadSelfAttention, RotaryEmbedding, TransformerLM


@pytest.mark.parametrize("theta", [-1.0, 0.0, float("inf"), float("nan"), True])
def test_rope_theta_must_be_positive_and_finite(theta):
    with pytest.raises(ValueError, match="rope_theta must be a positive finite number"):
        RotaryEmbedding(8, 16, theta=theta)
    with pytest.raises(ValueError, match="rope_theta"):
        TransformerLM(10, 8, 8, 1, 2, 16, rope_theta=theta)


def test_rope_off_is_none_not_zero():
    model = TransformerLM(10, 8, 8, 1, 2, 16, rope_theta=None)
    assert model.layers[0].attn.rope is None
    assert torch.isfinite(RotaryEmbedding(8, 16, theta=500.0).cos).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=-8, num_heads=2), "d_model must be a positive integer"),
    (dict(d_model=16, num_heads=0), "num_heads must be a positive integer"),
    (dict(d_model=16, num_heads=3), "divisible"),
])
def test_mhsa_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadSelfAttention(**kwargs)


@pytest.mark.parametrize("x,exc,match", [
    (torch.randn(2, 4), ValueError, r"shape \(batch, seq, 16\)"),
    (torch.randn(1, 4, 12), ValueError, r"shape \(batch, seq, 16\)"),
    (torch.randint(0, 3, (1, 4, 16)), TypeError, "floating-point"),
    (torch.randn(1, 9, 16), ValueError, "exceeds the RoPE tables' context_length 8"),
], ids=["rank2", "width", "int", "too-long"])
def test_mhsa_bad_input(x, exc, match):
    mhsa = MultiHeadSelfAttention(16, 2, rope_theta=10000.0, context_length=8)
    with pytest.raises(exc, match=match):
        mhsa(x)
