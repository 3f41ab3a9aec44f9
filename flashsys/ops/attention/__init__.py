"""FlashAttention-2: reference math, the tiled PyTorch op, the Triton op, and the functional entry point."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .flash_torch import FlashAttention2Torch
from .flash_triton import MAX_HEAD_DIM, FlashAttention2Triton, interpreter_active
from .reference import attention_reference, causal_mask

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' picks Triton on CUDA and the tiled PyTorch op elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def flash_attention(
    q: Float[Tensor, "*batch Nq D"],
    k: Float[Tensor, "*batch Nk D"],
    v: Float[Tensor, "*batch Nk D"],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "*batch Nq D"]:
    """FlashAttention-2 over (B, N, D) or (B, H, N, D) inputs.

    `causal=True` with Nq != Nk aligns the mask to the bottom-right corner. `softmax_scale` defaults to
    1/sqrt(D). `backend` forces "triton" or "torch"; "auto" uses Triton on CUDA.
    """
    chosen = resolve_backend(backend, q.device if isinstance(q, Tensor) else torch.device("cpu"))
    fn = FlashAttention2Triton if chosen == "triton" else FlashAttention2Torch
    return fn.apply(q, k, v, causal, softmax_scale)


__all__ = [
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "MAX_HEAD_DIM",
    "attention_reference",
    "causal_mask",
    "flash_attention",
    "interpreter_active",
    "resolve_backend",
]
