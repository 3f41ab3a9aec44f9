"""FlashAttention-2: reference math, the tiled PyTorch op, the Triton op, the backend registry and the
functional entry point."""

from __future__ import annotations

import functools
from typing import Literal

from jaxtyping import Float
from torch import Tensor

from .backends import ATTENTION_BACKENDS, CORE_BACKENDS, FLASH_ALIASES, AttentionBackend, backend_report, get_backend
from .flash_torch import FlashAttention2Torch
from .reference import attention_reference, causal_mask, window_mask
from .triton_env import interpreter_active
from .validation import MAX_HEAD_DIM


@functools.cache
def triton_op():
    """`FlashAttention2Triton`, importing Triton on first use (cached: `flash` calls it on every CUDA call).

    Raises:
        ImportError: naming what to install, where Triton is missing.
    """
    try:
        from .flash_triton import FlashAttention2Triton
    except ImportError as e:
        raise ImportError(f"FlashAttention2Triton needs Triton, which is not importable here ({e}). Install it "
                          "(pip install triton, on Linux), or use the tiled PyTorch op: "
                          "flash_attention(..., backend='torch') or FlashAttention2Torch") from e
    return FlashAttention2Triton


def __getattr__(name: str):
    # `from flashsys.ops.attention import FlashAttention2Triton` imports Triton only when asked for.
    if name == "FlashAttention2Triton":
        return triton_op()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

Backend = Literal["auto", "triton", "torch"]


def flash_attention(
    q: Float[Tensor, "*batch Nq D"],
    k: Float[Tensor, "*batch Nk D"],
    v: Float[Tensor, "*batch Nk D"],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "*batch Nq D"]:
    """FlashAttention-2: softmax(q kᵀ · softmax_scale) v without materialising the N×N scores.

    Args:
        q: queries, (batch, Nq, head_dim) or (batch, heads, Nq, head_dim); fp16, bf16 or fp32; any strides.
        k: keys, the same rank and batch as q, (…, Nk, head_dim). Nk may differ from Nq. Rank-4 k may have fewer
            heads than q, Hq a multiple of Hkv (grouped-query / multi-query attention): query head h reads K/V head
            h // (Hq // Hkv), as in SDPA's enable_gqa and flash-attn. K/V are not copied per query head.
        v: values, shaped like k.
        causal: mask future keys. With Nq != Nk the mask is aligned to the bottom-right corner, as in
            FlashAttention-2: query i sees key j iff j <= i + (Nk - Nq). For Nq = 2, Nk = 5 (1 = visible)::

                keys   0 1 2 3 4
                q0     1 1 1 1 0
                q1     1 1 1 1 1

            and for Nq = 5, Nk = 2 the first three queries see no key: their output is 0::

                keys   0 1
                q0     0 0
                q1     0 0
                q2     0 0
                q3     1 0
                q4     1 1

        softmax_scale: multiplies the scores before the softmax; default 1/sqrt(head_dim).
        window_size: (left, right), flash-attn's sliding window: query i sees key j iff
            i + off - left <= j <= i + off + right, off = Nk - Nq; -1 leaves a side unbounded; causal=True sets
            right to 0. Key tiles wholly outside the window are skipped (cost grows with N * window, not N²).
            A query that sees no key outputs 0.
        backend: "auto" (Triton on CUDA tensors, the tiled PyTorch op elsewhere), "triton" or "torch";
            the short names of the registry's "flash", "flash-triton" and "flash-torch".

    Returns:
        The attention output, shaped and typed like q. It is differentiable in q, k and v; the backward
        recomputes the scores from the saved logsumexp.

    Raises:
        ValueError, TypeError: for mismatched shapes, dtypes or devices, naming the argument.
    """
    if backend not in FLASH_ALIASES:
        raise ValueError(f"flash_attention: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
    return get_backend(backend).fn(q, k, v, causal, softmax_scale, window_size)


__all__ = [
    "ATTENTION_BACKENDS",
    "CORE_BACKENDS",
    "AttentionBackend",
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "MAX_HEAD_DIM",
    "attention_reference",
    "backend_report",
    "causal_mask",
    "flash_attention",
    "get_backend",
    "interpreter_active",
    "window_mask",
]
