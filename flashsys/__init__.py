"""flashsys: FlashAttention-2 in PyTorch and Triton, data-parallel training and optimizer-state sharding."""

__version__ = "0.1.0"
