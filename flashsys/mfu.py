"""Model FLOPs utilisation: the FLOPs a training step of the model needs, per second, over the device's peak.

Counted as nanoGPT does (after the PaLM paper, appendix B): 6 FLOPs per parameter per token for the matmuls of
forward and backward, plus 12 · layers · d_model · context for the attention scores and their weighting, with no
discount for the causal mask. The token embedding is a lookup, not a matmul, so its parameters are left out;
the LM head is counted. Recomputation (activation checkpointing) is not model FLOPs and is not counted.
"""

from __future__ import annotations

import torch

from .nn.config import ModelConfig

# Dense (no sparsity) peak tensor-core throughput per dtype, from the vendors' data sheets, in FLOP/s.
# float32 is the plain-fp32 peak: PyTorch does not use TF32 for matmuls unless asked to.
PEAK_FLOPS = {
    "H100 PCIe": {"bfloat16": 756e12, "float32": 51e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},  # SXM
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
}


def model_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs (forward + backward) per token of `config` at its context length."""
    c = config
    kv_width = c.head_dim * (c.num_kv_heads or c.num_heads)
    attention = 2 * c.d_model**2 + 2 * c.d_model * kv_width  # Q and O, and the (grouped) K and V projections
    per_layer = attention + 3 * c.d_model * c.d_ff + 2 * c.d_model  # + SwiGLU + the two RMSNorm weights
    matmul_params = c.num_layers * per_layer + c.d_model + c.d_model * c.vocab_size  # + final norm + LM head
    return 6 * matmul_params + 12 * c.num_layers * c.d_model * c.context_length


def peak_flops(device: torch.device | str, dtype: str) -> float | None:
    """The device's dense peak FLOP/s for `dtype` ("bfloat16" or "float32"), or None where it is not in the table
    (a CPU, or a GPU not listed in PEAK_FLOPS)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, peaks in PEAK_FLOPS.items():  # "H100 PCIe" is listed before "H100"
        if model in name:
            return peaks.get(dtype)
    return None


def mfu(tokens_per_s: float, config: ModelConfig, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a peak."""
    if peak is None or tokens_per_s <= 0:
        return None
    return tokens_per_s * model_flops_per_token(config) / peak
