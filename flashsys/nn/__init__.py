"""Drop-in modules built on flashsys ops: FlashAttention, attention blocks and a Transformer LM with presets."""

from .attention import ATTENTION_BACKENDS, FlashAttention, MultiHeadSelfAttention, RotaryEmbedding, attend
from .config import PRESETS, ModelConfig, preset
from .transformer import RMSNorm, SwiGLU, TransformerBlock, TransformerLM

__all__ = [
    "ATTENTION_BACKENDS",
    "FlashAttention",
    "ModelConfig",
    "MultiHeadSelfAttention",
    "PRESETS",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerBlock",
    "TransformerLM",
    "attend",
    "preset",
]
