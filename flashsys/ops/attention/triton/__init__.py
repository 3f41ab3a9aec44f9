"""The FlashAttention kernels in Triton's `tl` language and their launch: `tiles` (the tile bookkeeping every
kernel shares, Gluon's too), `kernels`, `configs` (tile candidates and autotuned handles) and `launch`."""
