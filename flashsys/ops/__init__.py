"""Autograd ops. Each op family has its reference math, a pure-PyTorch version and a Triton version."""

from .attention import (
    FlashAttention2Torch,
    attention_reference,
    deterministic_backward,
    flash_attention,
    flash_attention_decode,
    flash_attention_packed,
    flash_attention_padded,
    flash_attention_varlen,
    set_deterministic_backward,
)

__all__ = ["FlashAttention2Torch", "FlashAttention2Triton", "attention_reference", "deterministic_backward",
           "flash_attention", "flash_attention_decode", "flash_attention_packed", "flash_attention_padded",
           "flash_attention_varlen", "set_deterministic_backward"]


def __getattr__(name: str):
    # The Triton op (and Triton itself) is imported only when asked for: see flashsys.ops.attention.triton_op.
    if name == "FlashAttention2Triton":
        from .attention import triton_op

        return triton_op()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
