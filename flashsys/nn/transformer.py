"""A pre-norm Transformer language model (RMSNorm, SwiGLU, RoPE, untied embeddings, no biases) with size presets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import MultiHeadSelfAttention, check_backend


@dataclass(frozen=True)
class Preset:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int


PRESETS: dict[str, Preset] = {
    "small": Preset(768, 3072, 12, 12),
    "medium": Preset(1024, 4096, 24, 16),
    "large": Preset(1280, 5120, 36, 20),
    "xl": Preset(1600, 6400, 48, 25),
    "2.7B": Preset(2560, 10240, 32, 32),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """W2 (silu(W1 x) * W3 x)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        for lin in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, std=math.sqrt(2.0 / (lin.in_features + lin.out_features)))

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, d_model, num_heads, d_ff, context_length, rope_theta, attention_backend, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = MultiHeadSelfAttention(d_model, num_heads, True, rope_theta, context_length, attention_backend,
                                           device=device, dtype=dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    """Token embedding, pre-norm blocks, final RMSNorm, untied LM head. Returns logits (B, N, vocab)."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float | None = 10000.0,
        attention_backend: str = "flash",
        checkpoint_blocks: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("context_length", context_length), ("d_model", d_model),
                            ("num_layers", num_layers), ("num_heads", num_heads), ("d_ff", d_ff)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if rope_theta is not None and (d_model // num_heads) % 2:
            raise ValueError(f"RoPE needs an even head_dim; d_model/num_heads = {d_model // num_heads}")
        self.vocab_size, self.context_length = vocab_size, context_length
        self.checkpoint_blocks = checkpoint_blocks
        self.token_embeddings = nn.Embedding(vocab_size, d_model, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.token_embeddings.weight, std=1.0, a=-3.0, b=3.0)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, context_length, rope_theta, check_backend(attention_backend),
                             device=device, dtype=dtype)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.lm_head.weight, std=math.sqrt(2.0 / (d_model + vocab_size)))

    @classmethod
    def from_preset(cls, name: str, vocab_size: int = 10_000, context_length: int = 512, **kwargs) -> "TransformerLM":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {list(PRESETS)}")
        p = PRESETS[name]
        return cls(vocab_size, context_length, p.d_model, p.num_layers, p.num_heads, p.d_ff, **kwargs)

    def set_attention_backend(self, backend: str) -> None:
        """Switch every block's attention implementation (same weights, same function)."""
        for layer in self.layers:
            layer.attn.attention_backend = check_backend(backend)

    def forward(self, token_ids: Int[Tensor, "B N"]) -> Float[Tensor, "B N vocab"]:
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must have shape (batch, seq), got {tuple(token_ids.shape)}")
        if token_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
        n = token_ids.shape[1]
        if n > self.context_length:
            raise ValueError(f"sequence length {n} exceeds context_length {self.context_length}")
        if not torch.compiler.is_compiling() and token_ids.device.type != "meta" and token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got values in [{lo}, {hi}]")
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpoint_blocks and self.training else layer(x)
        return self.lm_head(self.ln_final(x))
