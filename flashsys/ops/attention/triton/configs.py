"""The `tl` kernels' tile candidates and their autotuned handles.

One autotuned handle per (kernel, head-dim class, fp32, long sequence), so every class only tries tiles that fit it
(at D 128 the D 64 tiles spill registers). The autotuner's key adds the sequence-length bucket, the window bounds
and varlen; Triton adds the tensors' dtypes by itself. Under the interpreter or FLASHSYS_TRITON_AUTOTUNE=0 each
handle keeps only its first candidate, the best single choice measured. docs/attention-kernels.md has the
measurements behind each list.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from ..triton_env import autotune_enabled
from .kernels import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_fwd_kernel

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# Best first. The D 128 lists keep only the candidates close to the best at N 16384, so that autotuning noise has
# little to pick from.
FWD_TILES: dict[int, list[Tile]] = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3),
         (64, 64, 4, 4), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
}
# dK/dV kernel: BLOCK_N key rows held in registers, BLOCK_M query rows streamed.
BWD_DKDV_TILES: dict[int, list[Tile]] = {
    64: [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
         (16, 128, 4, 4)],
    128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3)],
    256: [(32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2)],
}
# dQ kernel: BLOCK_M query rows held, BLOCK_N key rows streamed.
BWD_DQ_TILES: dict[int, list[Tile]] = {
    64: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 2)],
    256: [(64, 32, 4, 2), (64, 16, 4, 2), (32, 32, 4, 2)],
}
# fp32 inputs are the accuracy path, not the speed path: fp32 tiles take twice the shared memory and registers, and
# the fp16/bf16 tiles above make ptxas crawl or run out of resources. Small tiles for every kernel.
FP32_TILES: dict[int, list[Tile]] = {64: [(32, 32, 4, 2), (64, 32, 4, 2)], 128: [(32, 32, 4, 2)],
                                     256: [(16, 32, 4, 1)]}
# Long sequences (max(Nq, Nk) rounding up to LONG_SEQ or more) at D <= 64 get handles of their own with only the
# large tiles that won there in every sweep: with all candidates, timing noise let the autotuner pick a 64x64
# forward that is slower than 128x64 at N 16384.
LONG_SEQ = 8192
FWD_TILES_LONG: dict[int, list[Tile]] = {64: [(128, 64, 8, 3), (128, 64, 8, 4)]}
BWD_DKDV_TILES_LONG: dict[int, list[Tile]] = {64: [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5)]}
BWD_DQ_TILES_LONG: dict[int, list[Tile]] = {64: [(128, 64, 8, 4), (128, 64, 8, 3)]}
AUTOTUNE_KEY = ["N_BUCKET", "HEAD_DIM", "BOUND_RIGHT", "BOUND_LEFT", "VARLEN"]


class KernelTiles(NamedTuple):
    """One `tl` kernel and its tile candidates by head-dim class, the long-sequence handles' where it has them."""
    kernel: triton.runtime.jit.JITFunction
    by_class: dict[int, list[Tile]]
    long_by_class: dict[int, list[Tile]]


# Every kernel's tables, by the name its launches and its LaunchKey use.
TABLES: dict[str, KernelTiles] = {
    "fwd": KernelTiles(flash_fwd_kernel, FWD_TILES, FWD_TILES_LONG),
    "dkdv": KernelTiles(flash_bwd_dkdv_kernel, BWD_DKDV_TILES, BWD_DKDV_TILES_LONG),
    "dq": KernelTiles(flash_bwd_dq_kernel, BWD_DQ_TILES, BWD_DQ_TILES_LONG),
}


def tiles_for(kernel: str, head_dim_class: int, fp32: bool, long_seq: bool) -> list[Tile]:
    """Every tile candidate of `kernel`'s ("fwd", "dq" or "dkdv") handle for this class, best first, whether or not
    autotuning is on: the fp32 tiles for fp32, the long-sequence ones where the class has them."""
    _, table, long_table = TABLES[kernel]
    if fp32:
        return FP32_TILES[head_dim_class]
    if long_seq and head_dim_class in long_table:
        return long_table[head_dim_class]
    return table[head_dim_class]


def every_tile(kernel: str, head_dim_class: int) -> list[Tile]:
    """Every 16-bit tile of `kernel`'s tables for this class, its long-sequence handle's too, each once."""
    _, table, long_table = TABLES[kernel]
    return list(dict.fromkeys([*table[head_dim_class], *long_table.get(head_dim_class, [])]))


def _configs(tiles: list[Tile]) -> list[triton.Config]:
    chosen = tiles if autotune_enabled() else tiles[:1]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in chosen]


def _tuned(kernel: str) -> dict:
    """{(head-dim class, is_fp32, long_seq): autotuned kernel}; long_seq handles exist only where listed."""
    jit, table, long_table = TABLES[kernel]
    keys = [(d, fp32, False) for d in table for fp32 in (False, True)] + [(d, False, True) for d in long_table]
    return {key: triton.autotune(configs=_configs(tiles_for(kernel, *key)), key=AUTOTUNE_KEY)(jit)
            for key in keys}


# The autotuned handles of each kernel, by the name its launches and its LaunchKey use.
HANDLES: dict[str, dict] = {kernel: _tuned(kernel) for kernel in TABLES}


def handle_for(kernel: str, head_dim_class: int, fp32: bool, long_seq: bool):
    """The autotuned handle of `kernel` ("fwd", "dq" or "dkdv") for this class: the long-sequence one where it
    exists."""
    handles = HANDLES[kernel]
    return handles.get((head_dim_class, fp32, long_seq)) or handles[(head_dim_class, fp32, False)]
