"""The model's shape in one dataclass, and the preset registry.

Every place that builds a TransformerLM (the CLI, the trainer, the benchmarks) starts from a `ModelConfig`,
usually a preset with a few fields replaced: `preset("small", context_length=1024)`. Construction is by
keyword everywhere, so two fields of the same type can never be swapped silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..ops.attention.backends import get_backend
from .attention import check_rope_theta


@dataclass(frozen=True)
class ModelConfig:
    """Everything `TransformerLM` needs to know to build itself.

    Args:
        d_model: width of the residual stream.
        num_layers: number of Transformer blocks.
        num_heads: attention heads per block; `d_model` must split into heads of even size when RoPE is on.
        d_ff: hidden width of the SwiGLU feed-forward.
        vocab_size: number of token ids (the embedding and LM-head rows).
        context_length: the longest sequence the model accepts (RoPE tables are built for it).
        rope_theta: RoPE base; `None` turns rotary embeddings off.
        attention_backend: a name from `flashsys.ops.attention.ATTENTION_BACKENDS`.
        checkpoint_blocks: recompute each block in backward (activation checkpointing) while training.
        num_kv_heads: key/value heads (grouped-query attention, 1 = multi-query); None means num_heads.
        attention_window: each query sees itself and at most this many earlier tokens (sliding window); None: all.
    """

    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    vocab_size: int = 10_000
    context_length: int = 512
    rope_theta: float | None = 10000.0
    attention_backend: str = "flash"
    checkpoint_blocks: bool = False
    num_kv_heads: int | None = None
    attention_window: int | None = None

    @property
    def head_dim(self) -> int:
        """d_model // num_heads."""
        return self.d_model // self.num_heads

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the first field that cannot build a model; return self."""
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        for name in ("num_kv_heads", "attention_window"):
            value = getattr(self, name)
            low = 1 if name == "num_kv_heads" else 0
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name} must be None or an integer >= {low}, got {value!r}")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_theta is not None:
            check_rope_theta(self.rope_theta)
        if self.rope_theta is not None and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; d_model/num_heads = {self.head_dim}")
        get_backend(self.attention_backend)
        return self


# The size table of the course (GPT-2 small .. 2.7B), plus two small models that run on a CPU: "demo" is what
# `flashsys train` trains by default (byte-level, so vocab 256), "tiny" is the CPU scale of the benchmarks.
PRESETS: dict[str, ModelConfig] = {
    "demo": ModelConfig(d_model=128, num_layers=2, num_heads=4, d_ff=384, vocab_size=256, context_length=64),
    "tiny": ModelConfig(d_model=256, num_layers=4, num_heads=4, d_ff=1024),
    "small": ModelConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "medium": ModelConfig(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "large": ModelConfig(d_model=1280, num_layers=36, num_heads=20, d_ff=5120),
    "xl": ModelConfig(d_model=1600, num_layers=48, num_heads=25, d_ff=6400),
    "2.7B": ModelConfig(d_model=2560, num_layers=32, num_heads=32, d_ff=10240),
}


def preset(name: str, **changes) -> ModelConfig:
    """The named preset's config with `changes` applied, e.g. `preset("xl", context_length=1024)`.

    Raises:
        ValueError: for a name that is not in `PRESETS`.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {list(PRESETS)}")
    return PRESETS[name].replace(**changes)
