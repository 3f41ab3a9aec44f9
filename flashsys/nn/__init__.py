"""Drop-in modules built on flashsys ops: FlashAttention, attention blocks and a Transformer LM with presets."""

from .attention import ATTENTION_BACKENDS, FlashAttention, MultiHeadSelfAttention, RotaryEmbedding, attend
from .transformer import PRESETS, RMSNorm, SwiGLU, TransformerBlock, TransformerLM

__all__ = [
    "ATTENTION_BACKENDS",
    "FlashAttention",
    "MultiHeadSelfAttention",
    "PRESETS",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerBlock",
    "TransformerLM",
    "attend",
]
