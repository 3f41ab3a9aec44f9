"""Autograd ops. Each op family has its reference math, a pure-PyTorch version and a Triton version."""

from .attention import (
    FlashAttention2Torch,
    FlashAttention2Triton,
    attention_reference,
    flash_attention,
)

__all__ = ["FlashAttention2Torch", "FlashAttention2Triton", "attention_reference", "flash_attention"]
