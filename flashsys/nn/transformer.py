"""A pre-norm Transformer language model (RMSNorm, SwiGLU, RoPE, untied embeddings, no biases) with size presets."""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..ops.attention import get_backend
from ..ops.attention.validation import check_offsets
from .attention import MultiHeadSelfAttention, PackedSequences
from .config import ModelConfig, preset


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the input dtype (low-precision sums of squares overflow)."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise over the last dimension; same dtype as x."""
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
        """The gated feed-forward over the last dimension."""
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        c = config
        self.ln1 = RMSNorm(c.d_model, device=device, dtype=dtype)
        self.attn = MultiHeadSelfAttention(
            d_model=c.d_model, num_heads=c.num_heads, causal=True, rope_theta=c.rope_theta,
            context_length=c.context_length, attention_backend=c.attention_backend, device=device, dtype=dtype,
            num_kv_heads=c.num_kv_heads, attention_window=c.attention_window,
        )
        self.ln2 = RMSNorm(c.d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(c.d_model, c.d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor, packed: PackedSequences | None = None) -> Tensor:
        """One pre-norm block over (B, N, d_model); `packed` keeps attention within its segments."""
        x = x + self.attn(self.ln1(x), packed)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    """Token embedding, pre-norm blocks, final RMSNorm, untied LM head. Returns logits (B, N, vocab).

    Build it from a config (`TransformerLM.from_config(preset("small", context_length=1024))`), a preset name
    (`TransformerLM.from_preset("small")`), or the config's fields as arguments, in the order below.

    Args:
        vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta, attention_backend,
        checkpoint_blocks: the fields of `ModelConfig`, which documents them.
        device, dtype: where and in what dtype to create the parameters.
        num_kv_heads, attention_window: grouped-query attention and a sliding window (`ModelConfig`).

    Raises:
        ValueError: naming the first field that cannot build a model.
    """

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
        num_kv_heads: int | None = None,
        attention_window: int | None = None,
    ) -> None:
        super().__init__()
        self.config = c = ModelConfig(
            d_model=d_model, num_layers=num_layers, num_heads=num_heads, d_ff=d_ff, vocab_size=vocab_size,
            context_length=context_length, rope_theta=rope_theta, attention_backend=attention_backend,
            checkpoint_blocks=checkpoint_blocks, num_kv_heads=num_kv_heads, attention_window=attention_window,
        ).validate()
        self.vocab_size, self.context_length = c.vocab_size, c.context_length
        self.checkpoint_blocks = c.checkpoint_blocks
        self.token_embeddings = nn.Embedding(c.vocab_size, c.d_model, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.token_embeddings.weight, std=1.0, a=-3.0, b=3.0)
        self.layers = nn.ModuleList(TransformerBlock(c, device=device, dtype=dtype) for _ in range(c.num_layers))
        self.ln_final = RMSNorm(c.d_model, device=device, dtype=dtype)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.lm_head.weight, std=math.sqrt(2.0 / (c.d_model + c.vocab_size)))

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> TransformerLM:
        """A model of the shape `config` describes, parameters on `device` in `dtype`."""
        return cls(
            vocab_size=config.vocab_size, context_length=config.context_length, d_model=config.d_model,
            num_layers=config.num_layers, num_heads=config.num_heads, d_ff=config.d_ff, rope_theta=config.rope_theta,
            attention_backend=config.attention_backend, checkpoint_blocks=config.checkpoint_blocks,
            device=device, dtype=dtype, num_kv_heads=config.num_kv_heads, attention_window=config.attention_window,
        )

    @classmethod
    def from_preset(cls, name: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    **changes: Any) -> TransformerLM:
        """A model of the named preset (`PRESETS`), with any `ModelConfig` field changed by keyword,
        e.g. `from_preset("xl", vocab_size=50_257, context_length=1024, attention_backend="sdpa")`."""
        return cls.from_config(preset(name, **changes), device=device, dtype=dtype)

    def set_attention_backend(self, backend: str) -> None:
        """Switch every block's attention implementation (same weights, same function)."""
        name = get_backend(backend).name
        for layer in self.layers:
            layer.attn.attention_backend = name
        self.config = self.config.replace(attention_backend=name)

    def forward(self, token_ids: Int[Tensor, "B N"], cu_seqlens: Int[Tensor, "S_plus_1"] | None = None,
                max_seqlen: int | None = None) -> Float[Tensor, "B N vocab"]:
        """Next-token logits for every position of every sequence.

        With `cu_seqlens` (int32 offsets into the B*N flattened tokens, flash-attn's form, and `max_seqlen`, the
        longest segment) the rows hold packed documents: attention stays within each segment and RoPE positions
        restart at each one (a flash attention backend is needed).

        Token ids are range-checked where that is free: on CPU tensors, outside torch.compile. Checking a GPU tensor
        means reading values back, which stalls the host until the GPU is idle; call `check_token_ids` for that
        (the trainer checks its data once, on the CPU). An out-of-range id on a GPU fails in the embedding's
        device-side assert instead.

        Raises:
            ValueError, TypeError: for a wrong rank or dtype, a sequence longer than `context_length`, or (CPU)
                token ids outside [0, vocab_size).
        """
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must have shape (batch, seq), got {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
        if token_ids.dtype not in (torch.int64, torch.int32):  # the embedding takes only these index types
            token_ids = token_ids.long()
        n = token_ids.shape[1]
        if n > self.context_length:
            raise ValueError(f"sequence length {n} exceeds context_length {self.context_length}")
        if token_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            self.check_token_ids(token_ids)
        packed = None
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("cu_seqlens needs max_seqlen, the longest segment")
            if not torch.compiler.is_compiling():  # the offsets sized below must be valid; the check is cached
                check_offsets(cu_seqlens, token_ids.numel(), max_seqlen, token_ids.device, name="cu_seqlens",
                              op="TransformerLM")
            packed = PackedSequences.from_offsets(cu_seqlens, max_seqlen, token_ids.numel())
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            if self.checkpoint_blocks and self.training:
                x = checkpoint(layer, x, packed, use_reentrant=False)
            else:
                x = layer(x, packed)
        return self.lm_head(self.ln_final(x))

    def check_token_ids(self, token_ids: Tensor) -> None:
        """Raise ValueError unless every id lies in [0, vocab_size). On a GPU tensor this waits for the GPU.

        Raises:
            ValueError: giving the range of the ids found.
        """
        if token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got values in [{lo}, {hi}]")
