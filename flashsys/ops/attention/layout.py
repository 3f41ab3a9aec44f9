"""The memory layout of the tensors a dense attention call allocates for its caller (O, and dQ, dK, dV): one rule,
which every path that allocates them follows (the eager launches, their replays, the native launcher, the compiled
ops' fake kernels), so that a replay or a compiled graph sees the strides the first call produced.

A rank-4 (B, H, N, D) output takes (B, N, H, D) memory where its input keeps the heads inside the sequence
dimension (stride(1) < stride(2): the view a model gets by splitting a projection's output into heads and
transposing), and dense (B, H, N, D) memory otherwise. Why: the model transposes O straight back to (B, N, H * D),
and autograd hands dQ, dK, dV to the projections' views; in (B, N, H, D) memory those reshapes are views, where
dense (B, H, N, D) outputs cost four copies a layer. SDPA's flash and cuDNN kernels return (B, N, H, D) memory too.
Every kernel takes its outputs' strides (the `tl` ones as arguments, the Gluon ones through TMA descriptors).
"""

from __future__ import annotations

import torch
from torch import Tensor


def heads_inside(t: Tensor) -> bool:
    """Whether `t` is rank 4 with its heads laid out inside its sequence dimension ((B, N, H, D) memory)."""
    return t.dim() == 4 and t.stride(1) < t.stride(2)


def empty_output(t: Tensor) -> Tensor:
    """An uninitialised tensor shaped like `t`, of its dtype and device, laid out by this module's rule."""
    if heads_inside(t):
        b, h, n, d = t.shape
        return t.new_empty((b, n, h, d)).transpose(1, 2)
    return torch.empty_like(t, memory_format=torch.contiguous_format)  # the cheapest allocation call


def laid_out(t: Tensor, like: Tensor) -> Tensor:
    """A result shaped like `like` in `empty_output(like)`'s layout: `t` itself where it has it, else a copy (a path
    that computes in another layout, under an op whose fake kernel promises this one)."""
    if heads_inside(like):
        out = empty_output(like)
        return t if t.stride() == out.stride() else out.copy_(t)
    return t.contiguous()
