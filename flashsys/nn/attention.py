"""Attention modules: the drop-in FlashAttention module, rotary embeddings, and multi-head self-attention."""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..ops.attention import CORE_BACKENDS, FLASH_ALIASES, flash_attention, get_backend

# The implementations a model chooses between (the registry's core entries); see flashsys.ops.attention.backends.
ATTENTION_BACKENDS = CORE_BACKENDS


def check_rope_theta(theta: object) -> None:
    """RoPE's base must be a positive finite number: a negative one gives NaN tables, 0 silently turns RoPE off."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive finite number (or None for no RoPE), got {theta!r}")


def attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None, backend: str) -> Tensor:
    """Run one attention call through the registered backend called `backend`; all compute the same function."""
    return get_backend(backend).fn(q, k, v, causal, softmax_scale)


class FlashAttention(nn.Module):
    """Drop-in for `F.scaled_dot_product_attention(q, k, v, is_causal=...)` on (B, H, N, D) tensors.

    Under `torch.autocast`, q, k and v are cast to the autocast dtype first (the kernels take one dtype).

    Args:
        causal: bottom-right aligned causal mask (see `flashsys.ops.flash_attention`).
        softmax_scale: default 1/sqrt(head_dim).
        backend: "auto", "triton" or "torch", as in `flash_attention`.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, backend: str = "auto") -> None:
        super().__init__()
        if backend not in FLASH_ALIASES:
            raise ValueError(f"FlashAttention: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
        self.causal, self.softmax_scale, self.backend = causal, softmax_scale, backend

    def forward(
        self, q: Float[Tensor, "B H Nq D"], k: Float[Tensor, "B H Nk D"], v: Float[Tensor, "B H Nk D"]
    ) -> Float[Tensor, "B H Nq D"]:
        """Attention output of q over k, v, shaped like q (in the autocast dtype under autocast)."""
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return flash_attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, backend=self.backend)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend!r}"


class RotaryEmbedding(nn.Module):
    """RoPE: rotates pairs of head-dim features by position-dependent angles, so q·k depends only on the offset.

    Args:
        head_dim: the rotated width (even).
        context_length: positions the cos/sin tables cover.
        theta: the frequency base.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float = 10000.0, device=None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        check_rope_theta(theta)
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Float[Tensor, "... N D"], positions: Int[Tensor, "N"] | None = None) -> Float[Tensor, "... N D"]:
        """x rotated for positions 0..N-1, or for `positions` when given; same dtype as x."""
        n = x.shape[-2]
        cos, sin = (self.cos[:n], self.sin[:n]) if positions is None else (self.cos[positions], self.sin[positions])
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)


class MultiHeadSelfAttention(nn.Module):
    """Fused q/k/v projection, optional RoPE, attention through a chosen backend, output projection; no biases.

    Args:
        d_model: model width, split into `num_heads` heads.
        num_heads: attention heads.
        causal: causal self-attention.
        rope_theta: RoPE base, or None for no rotary embedding.
        context_length: longest sequence (sizes the RoPE tables).
        attention_backend: a name from the attention backend registry (`ATTENTION_BACKENDS` for models).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        causal: bool = True,
        rope_theta: float | None = None,
        context_length: int = 2048,
        attention_backend: str = "flash",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("context_length", context_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MultiHeadSelfAttention: {name} must be a positive integer, got {value!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.causal, self.attention_backend = causal, get_backend(attention_backend).name
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.output_proj = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(self.head_dim, context_length, rope_theta, device) if rope_theta is not None else None
        for lin in (self.qkv_proj, self.output_proj):
            nn.init.trunc_normal_(lin.weight, std=math.sqrt(2.0 / (lin.in_features + lin.out_features)))

    def forward(self, x: Float[Tensor, "B N d_model"]) -> Float[Tensor, "B N d_model"]:
        """Self-attention over the sequence dimension of x.

        Raises:
            ValueError, TypeError: for input that is not a floating (batch, seq, d_model) tensor, or a sequence
                longer than the RoPE tables' context_length.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"MultiHeadSelfAttention: x must have shape (batch, seq, {self.d_model}), got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"MultiHeadSelfAttention: x must be a floating-point tensor, got {x.dtype}")
        if self.rope is not None and x.shape[1] > self.rope.cos.shape[0]:
            raise ValueError(f"MultiHeadSelfAttention: sequence length {x.shape[1]} exceeds the RoPE tables' "
                             f"context_length {self.rope.cos.shape[0]}")
        q, k, v = rearrange(self.qkv_proj(x), "b n (three h d) -> three b h n d", three=3, h=self.num_heads).unbind(0)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        o = attend(q, k, v, causal=self.causal, softmax_scale=None, backend=self.attention_backend)
        return self.output_proj(rearrange(o, "b h n d -> b n (h d)"))
