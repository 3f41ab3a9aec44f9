"""Attention modules: the drop-in FlashAttention module, rotary embeddings, and multi-head self-attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..ops.attention import (
    CORE_BACKENDS,
    FLASH_ALIASES,
    FLASH_SHORT_NAMES,
    flash_attention,
    flash_attention_varlen,
    get_backend,
)
from ..ops.attention.validation import normalize_window

# The implementations a model chooses between (the registry's core entries); see flashsys.ops.attention.backends.
ATTENTION_BACKENDS = CORE_BACKENDS


def check_rope_theta(theta: object) -> None:
    """RoPE's base must be a positive finite number: a negative one gives NaN tables, 0 silently turns RoPE off."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive finite number (or None for no RoPE), got {theta!r}")


def attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None, backend: str,
           window_size: tuple[int, int] | None = None) -> Tensor:
    """Run one attention call through the registered backend called `backend`; all compute the same function."""
    return get_backend(backend).fn(q, k, v, causal, softmax_scale, window_size)


class FlashAttention(nn.Module):
    """Drop-in for `F.scaled_dot_product_attention` on (B, H, N, D) tensors: the same call, the same results for
    everything it supports, FlashAttention-2 underneath.

    `module(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=None, scale=None, enable_gqa=False)`.
    A call's explicit `is_causal` (True or False) and `scale` win over the constructor's defaults.
    Under `torch.autocast`, q, k and v are cast to the autocast dtype first (the kernels take one dtype).

    Args:
        causal: a default causal mask, bottom-right aligned as in FlashAttention-2 (`flashsys.ops.flash_attention`),
            for calls that do not pass is_causal.
        softmax_scale: the default scale for calls that do not pass one; 1/sqrt(head_dim) otherwise.
        backend: "auto", "triton" or "torch", as in `flash_attention`.
        window_size: (left, right) sliding window, flash-attn's semantics (see `flash_attention`); None for none.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, backend: str = "auto",
                 window_size: tuple[int, int] | None = None) -> None:
        super().__init__()
        if backend not in FLASH_ALIASES:
            raise ValueError(f"FlashAttention: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
        normalize_window(window_size, causal, "FlashAttention")  # a bad window fails here, not at the first call
        self.causal, self.softmax_scale, self.backend, self.window_size = causal, softmax_scale, backend, window_size

    def forward(
        self,
        query: Float[Tensor, "B Hq Nq D"],
        key: Float[Tensor, "B Hkv Nk D"],
        value: Float[Tensor, "B Hkv Nk D"],
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Float[Tensor, "B Hq Nq D"]:
        """Attention output of query over key, value, shaped like query (in the autocast dtype under autocast).

        Raises:
            TypeError: for an is_causal that is not a bool (as SDPA) or a scale that is not a number.
            ValueError: for an attn_mask or dropout (not supported: the message says what to use instead), for
                is_causal with Nq != Nk (SDPA aligns that mask top-left, flashsys bottom-right: construct the module
                with causal=True to mean bottom-right), and for differing head counts without enable_gqa=True.
        """
        if attn_mask is not None:
            raise ValueError("FlashAttention: attn_mask is not supported; express the mask as causal=True, a "
                             "window_size=(left, right), or packed sequences (flashsys.ops.flash_attention_varlen)")
        if dropout_p != 0.0:
            raise ValueError(f"FlashAttention: dropout_p={dropout_p} is not supported (attention dropout is not "
                             "implemented); apply dropout to the output instead, or use 0.0")
        if is_causal is None:
            causal = self.causal
        elif isinstance(is_causal, bool):
            causal = is_causal
        else:  # SDPA refuses a non-bool too; bool("False") would silently mean causal
            raise TypeError(f"FlashAttention: is_causal must be True, False or None (the module's default), got "
                            f"{type(is_causal).__name__} {is_causal!r}")
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise TypeError(f"FlashAttention: scale must be a float or None, got {type(scale).__name__} {scale!r}")
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"FlashAttention: scale must be a positive finite number, got {scale}")
        if is_causal and query.shape[-2] != key.shape[-2]:
            raise ValueError("FlashAttention: is_causal=True with Nq != Nk is aligned top-left by SDPA and "
                             "bottom-right by FlashAttention-2; construct FlashAttention(causal=True) for the latter")
        if query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
            raise ValueError(f"FlashAttention: query has {query.shape[1]} heads and key {key.shape[1]}; pass "
                             "enable_gqa=True for grouped-query attention (as with SDPA)")
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return flash_attention(query, key, value, causal=causal,
                               softmax_scale=self.softmax_scale if scale is None else scale,
                               window_size=self.window_size, backend=self.backend)

    def extra_repr(self) -> str:
        window = f", window_size={self.window_size}" if self.window_size is not None else ""
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend!r}{window}"


@dataclass(frozen=True)
class PackedSequences:
    """Segments packed into the rows of a (B, N) batch, in flash-attn's form over the B*N flattened tokens.

    Args:
        cu_seqlens: int32 (segments + 1,) offsets into the flattened tokens, from 0 to B*N.
        max_seqlen: the longest segment.
        positions: (B*N,) each token's position within its segment (RoPE restarts at every segment).
    """

    cu_seqlens: Tensor
    max_seqlen: int
    positions: Tensor

    @classmethod
    def from_offsets(cls, cu_seqlens: Tensor, max_seqlen: int, n_tokens: int) -> PackedSequences:
        """With the positions derived from the offsets; n_tokens (= B*N) sizes them without reading the offsets back."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=n_tokens)
        return cls(cu_seqlens, max_seqlen, torch.arange(n_tokens, device=cu_seqlens.device) - starts)


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

    def forward(self, x: Float[Tensor, "... D"], positions: Int[Tensor, "N"] | None = None,
                seq_dim: int = -2) -> Float[Tensor, "... D"]:
        """x rotated for positions 0..N-1 along `seq_dim` (any dim but the last: -2 for (..., N, D), 1 for a
        projection's (B, N, H, D) view), or for `positions` when given; same shape and dtype as x, dense in that
        shape (so rotating (B, N, H, D) keeps the heads inside the sequence, the layout attention outputs follow).

        Raises:
            ValueError: for a seq_dim that is not a dim of x before the last.
        """
        dim = seq_dim - x.dim() if seq_dim >= 0 else seq_dim
        if not -x.dim() <= dim <= -2:
            raise ValueError(f"RotaryEmbedding: seq_dim {seq_dim} is not a dim before the last of a {x.dim()}-D input")
        n = x.shape[dim]
        cos, sin = (self.cos[:n], self.sin[:n]) if positions is None else (self.cos[positions], self.sin[positions])
        if dim != -2:  # broadcast over the dims between the sequence and the features
            cos, sin = (t.view(n, *[1] * (-dim - 2), t.shape[-1]) for t in (cos, sin))
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)


class MultiHeadSelfAttention(nn.Module):
    """Fused q/k/v projection, optional RoPE, attention through a chosen backend, output projection; no biases.

    Args:
        d_model: model width, split into `num_heads` heads.
        num_heads: attention (query) heads.
        causal: causal self-attention.
        rope_theta: RoPE base, or None for no rotary embedding.
        context_length: longest sequence (sizes the RoPE tables).
        attention_backend: a name from the attention backend registry (`ATTENTION_BACKENDS` for models).
        num_kv_heads: key/value heads (grouped-query attention; 1 is multi-query); default num_heads. The K and V
            projections are num_kv_heads * head_dim wide.
        attention_window: each query sees itself and at most this many keys before it (a sliding window,
            flash-attn's window_size=(attention_window, 0)); None for no window.
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
        num_kv_heads: int | None = None,
        attention_window: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("d_model", d_model), ("num_heads", num_heads), ("context_length", context_length),
                            ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MultiHeadSelfAttention: {name} must be a positive integer, got {value!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if attention_window is not None and (not isinstance(attention_window, int) or isinstance(attention_window, bool)
                                             or attention_window < 0):
            raise ValueError(f"MultiHeadSelfAttention: attention_window must be None or an int >= 0, "
                             f"got {attention_window!r}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.num_kv_heads, self.attention_window = num_kv_heads, attention_window
        self.causal, self.attention_backend = causal, get_backend(attention_backend).name
        kv_width = num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(d_model, d_model + 2 * kv_width, bias=False, device=device, dtype=dtype)
        self.output_proj = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(self.head_dim, context_length, rope_theta, device) if rope_theta is not None else None
        for lin in (self.qkv_proj, self.output_proj):
            nn.init.trunc_normal_(lin.weight, std=math.sqrt(2.0 / (lin.in_features + lin.out_features)))

    def forward(self, x: Float[Tensor, "B N d_model"], packed: PackedSequences | None = None) -> Float[Tensor, "B N d_model"]:
        """Self-attention over the sequence dimension of x; with `packed`, within each of its segments only
        (documents packed into the rows: flash_attention_varlen over the flattened tokens, RoPE positions
        restarting at every segment).

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
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.d_model, kv_width, kv_width], dim=-1)
        window = None if self.attention_window is None else (self.attention_window, 0)
        if packed is not None:
            return self.output_proj(self._attend_packed(q, k, v, packed, window).reshape(x.shape))
        # (B, N, H, D) as the projection lays them out, rotated in that layout, and handed over as (B, H, N, D)
        # views: the Triton kernels write O (and the gradients) in the same layout, so the output projection reads O
        # as it is, where rotated (B, H, N, D)-dense copies made every layer copy O back.
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k, v = (t.unflatten(-1, (self.num_kv_heads, self.head_dim)) for t in (k, v))
        if self.rope is not None:
            q, k = self.rope(q, seq_dim=1), self.rope(k, seq_dim=1)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=self.causal, softmax_scale=None,
                   backend=self.attention_backend, window_size=window)
        return self.output_proj(o.transpose(1, 2).flatten(2))

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSequences, window) -> Tensor:
        flash = FLASH_SHORT_NAMES.get(self.attention_backend)
        if flash is None:
            raise ValueError(f"packed sequences need a flash attention backend (flash, flash-triton, flash-torch), "
                             f"not {self.attention_backend!r}")
        q = rearrange(q, "b n (h d) -> (b n) h d", h=self.num_heads)
        k, v = (rearrange(t, "b n (h d) -> (b n) h d", h=self.num_kv_heads) for t in (k, v))
        if self.rope is not None:
            q, k = (self.rope(t, packed.positions, seq_dim=0) for t in (q, k))
        o = flash_attention_varlen(q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_seqlen,
                                   packed.max_seqlen, causal=self.causal, window_size=window, backend=flash)
        return o.flatten(1)
