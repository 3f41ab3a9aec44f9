"""The Gluon names that moved between Triton versions, in one place: the kernels run on Triton 3.6 (the GPU
machines) and compile on the newest Triton (CI), and call these instead of either version's spelling.

Importing this module needs a Triton with Gluon's Hopper API (3.6 or later): `gluon.kernels()` imports it only where
that holds.
"""

from __future__ import annotations

import triton.language.core as _tl_core
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# TMA copies: Triton 3.6 names them async_copy_*; later Tritons renamed them async_load / async_store.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# cp.async copies (global to shared, per thread): Triton 3.6 names them async_copy_global_to_shared, later Tritons
# async_load.
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# Structures of values that travel through a kernel together: `gluon.aggregate` in later Tritons,
# `triton.language.core._aggregate` in 3.6.
aggregate = getattr(gluon, "aggregate", None) or _tl_core._aggregate


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add (cp.reduce.async.bulk.tensor) of a shared-memory tile into global memory. Triton 3.6's
    Gluon builds the op but has no Python name for it; later Tritons call it tma.async_atomic_add."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36
# A barrier over the calling partition's threads: Triton 3.6 calls it thread_barrier, later Tritons barrier.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def reinterpret_smem(smem, dtype, shape, layout, _semantic=None):
    """`smem` viewed as another dtype, shape and layout (Triton 3.6 names the method _reinterpret, later Tritons
    reinterpret)."""
    method = getattr(smem, "reinterpret", None) or smem._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)
