"""Naive attention math: the ground truth every flashsys attention op is tested against.

It materialises the full score matrix, so it is O(N^2) in memory: use it in float64 on small shapes
as the reference, or in a low precision as "what plain PyTorch gets" when setting tolerances.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean (Nq, Nk) mask, True where query i may see key j.

    Aligned to the bottom-right corner as in FlashAttention-2: query i sees keys j <= i + (Nk - Nq).
    With Nq > Nk the first Nq - Nk queries see no key at all.

    Args:
        n_queries, n_keys: Nq and Nk.
        device: where to build the mask.

    Returns:
        A bool tensor of shape (n_queries, n_keys).
    """
    i = torch.arange(n_queries, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    return j <= i + (n_keys - n_queries)


def window_mask(n_queries: int, n_keys: int, left: int, right: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean (Nq, Nk) mask of a (left, right) window, flash-attn's semantics: with off = Nk - Nq, query i sees
    key j iff i + off - left <= j <= i + off + right; -1 leaves that side unbounded. (-1, 0) is `causal_mask`.
    A bound as wide as the sequence bounds nothing (and is not added to the indices, where it could overflow)."""
    i = torch.arange(n_queries, device=device)[:, None] + (n_keys - n_queries)
    j = torch.arange(n_keys, device=device)[None, :]
    visible = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    if 0 <= left < n_keys:
        visible &= j >= i - left
    if 0 <= right < n_queries:
        visible &= j <= i + right
    return visible


def attention_reference(
    q: Float[Tensor, "*batch Hq Nq D"],
    k: Float[Tensor, "*batch Hkv Nk D"],
    v: Float[Tensor, "*batch Hkv Nk D"],
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
) -> tuple[Float[Tensor, "*batch Hq Nq D"], Float[Tensor, "*batch Hq Nq"]]:
    """The attention output and logsumexp, computed naively (the whole score matrix in memory).

    Args:
        q, k, v: as for `flash_attention`; any floating dtype, float64 included. Rank-4 k, v may have fewer heads
            than q (grouped-query attention): query head h reads K/V head h // (Hq // Hkv).
        causal: bottom-right aligned causal mask (`causal_mask`); the same as a right window bound of 0.
        softmax_scale: default 1/sqrt(head_dim).
        window_size: (left, right) as in `window_mask`; None (or (-1, -1)) for no window.

    Returns:
        (O, L): O shaped like q, and L = logsumexp of the scaled scores in natural log, shaped q.shape[:-1],
        both in the inputs' dtype and differentiable. A query row that sees no key (causal with Nq > Nk, or a
        window off the keys) gets O = 0 and L = -inf, the same convention as the flash ops.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if q.dim() == 4 and k.shape[1] != q.shape[1]:  # grouped-query attention: the reference may copy K and V
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        s = s.masked_fill(~window_mask(q.shape[-2], k.shape[-2], left, right, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # exp(s - lse) with a safe lse for rows that see nothing, so they give 0 instead of NaN.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])
    return torch.matmul(p, v), lse
