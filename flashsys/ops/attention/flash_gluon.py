"""The Gluon kernels on Hopper: which calls they take, their variants, how one is chosen, and their launch.

The forward kernels (`gluon_kernels.py`) overlap each tile's softmax with the tensor cores, which the `tl` forward
cannot express; on an H100 they run 10-20% faster than it (benchmarks/results/kernel_experiments.md). They need an
sm_90 GPU, a Triton with Gluon's Hopper API (3.6 or later) and TMA-friendly tensors, so they take a call only where
all of that holds and the `tl` forward (flash_triton) runs every other call: CPUs and the interpreter, other GPUs,
varlen batches, fp32, head dims other than 64 and 128, strides TMA cannot address. Both write the same O and L.

Both backward kernels have Gluon versions too, taken where `takes_backward` holds: dQ (D 64 and 128), timed against
the `tl` dQ kernel since neither wins every cell, and dK/dV (D 128 only; at D 64 the `tl` one was faster). Either
dQ kernel writes the (L, D) pairs that both dK/dV kernels read after it.

`takes(q, k, v, window)` says whether a forward goes here; `FLASHSYS_GLUON=0` turns the path off (for A/B timings).
Each (kernel, head dim, dtype, window bounds, length bucket) picks its variant by timing the candidates on its first
call, as Triton's autotuner does for the `tl` kernels; `FLASHSYS_TRITON_AUTOTUNE=0` takes the first candidate.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import statistics
import warnings
from typing import Callable, NamedTuple

import torch
import triton
from torch import Tensor

from .eager_plans import Recorded
from .triton_env import autotune_enabled, env_switch

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
# The shared memory one program may take on sm_90 (227 KB): a variant's kernel must fit it, or its launch fails.
SM90_SHARED_BYTES = 232_448
_DTYPES = (torch.float16, torch.bfloat16)
# The work (`call_work`: B * H * D * the query-key pairs the call's kernels visit) below which a call keeps the `tl`
# kernels. Repeated eager calls replay the Gluon launches from plans (GluonReplay): 46-86 µs of host time a forward
# against the `tl` forward's 14-60, and a forward + backward 214-330 µs at D 64, 401-503 µs at D 128 (its dK/dV replay
# takes the GIL on the autograd thread), against 133-277 (H100, B 1, H 16:
# benchmarks/results/kernel_configs/probe_gluon_host_final_h100.txt). The GPU's time follows the pairs visited, not
# Nq * Nk: the old bar, B*H*Nq*Nk*D >= 2^35, kept full-mask calls of ~0.7 ms of GPU time on the `tl` kernels with
# causal ones of half that. Counted on the visible pairs at 2^34 the causal calls split where they did, and the
# full-mask D 64 N 1024 (B 16) and D 128 N 1024 (B 8) calls run the Gluon kernels, 2-5% and 11-16% faster; causal
# D 128 N 1024 B 8 (2^33), run on them, read 0.90x and 1.47x cuDNN's in two rounds, host-bound, and stays below
# (kernel_configs/probe_min_work_visible_h100.md).
MIN_WORK = 1 << 34


class Variant(NamedTuple):
    """One kernel configuration: a forward's "plain" (one warpgroup), "pingpong" (producer warp + two consumer
    warpgroups with `regs` registers per thread) or "persistent" (the ping-pong kernel, one program per SM), a
    backward's "dkdv", "dq", "one_pass" or "one_pass_det" (the whole backward, warp-specialised as the ping-pong),
    or "tl" (the `tl` kernels a Gluon choice times its variants against)."""

    kind: str
    block_m: int
    block_n: int
    nbuf: int  # K/V buffers in flight
    regs: int = 0
    stages: int = 1  # the one pass's sets of dQ staging boxes
    alternate: int = 0  # 1: the one pass's consumers take turns at each query tile's whole dQ (needs stages 2)

    def label(self) -> str:
        if self.kind == "tl":
            return "tl kernel"
        extra = f" {self.regs} regs" if self.regs else ""
        extra += f" {self.stages} stages" if self.stages > 1 else ""
        extra += " dQ alternating" if self.alternate else ""
        return f"{self.kind} {self.block_m}x{self.block_n} {self.nbuf}buf{extra}"


# Candidates per head dim, best single choice first: each won some cells of the H100 sweep
# (kernel_configs/probe_gluon_forward_sweep_h100.txt), and none of the others won any. "persistent": the ping-pong
# kernel with one program per SM over pairs of query tiles; on an H100 1-8% faster than the best of the others in
# most cells of N 1024-16384, at D 128 full N 16384 up to 5% slower (kernel_configs/probe_gluon_variants_persistent_
# h100.txt), so the choice keeps timing all of them. The choice's first call with no timing takes the first. At
# D 128 the 128x128 kernels with two buffers lead since K and V are handed back apart (stop 43; on an H200 the best
# in every cell of N 1024-16384, kernel_configs/probe_gluon_forward_d128_3buf_h200.txt); the others won cells of
# H100 sweeps before that and stay timed.
VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (Variant("plain", 64, 128, 3), Variant("plain", 128, 64, 3), Variant("pingpong", 128, 128, 3, 240),
         Variant("persistent", 128, 128, 3, 240)),
    128: (Variant("persistent", 128, 128, 2, 240), Variant("pingpong", 128, 128, 2, 240),
          Variant("pingpong", 128, 64, 4, 240), Variant("plain", 64, 64, 3), Variant("persistent", 128, 64, 4, 240)),
}


# The dK/dV kernel's candidates ("dkdv": block_m query rows streamed through nbuf buffers, block_n key rows held
# by block_n // 16 warps). D 128 only: at D 64 every variant ran 0-8% slower than the `tl` dK/dV kernel on an H100,
# at D 128 up to 6% faster (kernel_configs/probe_gluon_backward_h100.txt); a third buffer was slower everywhere.
DKDV_VARIANTS: dict[int, tuple[Variant, ...]] = {
    128: (Variant("dkdv", 64, 64, 2), Variant("dkdv", 64, 128, 2)),
}

# The dQ kernel's candidates ("dq": block_m query rows held by block_m // 16 warps, block_n key rows streamed through
# nbuf buffers), and the `tl` dQ kernel itself: neither wins every cell. On an H100 the best Gluon variant ran
# 0.90-1.02x the `tl` kernel's time in causal cells and 0.98-1.07x in full ones, over three runs
# (kernel_configs/probe_gluon_dq_h100.txt, probe_gluon_dq_choice_h100.txt), so the `tl` kernel is timed beside
# them and is the choice without timings. Each listed variant won some cell; 128x128 at D 64 and a third buffer
# won none. TL_KERNEL stands for the `tl` kernel of whichever pass it is a candidate of (the backward probe also
# forces it as dK/dV's, to time the Gluon dK/dV variants against it in a whole backward).
TL_KERNEL = Variant("tl", 0, 0, 0)
DQ_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("dq", 64, 128, 2), Variant("dq", 64, 64, 2), Variant("dq", 128, 64, 2)),
    128: (TL_KERNEL, Variant("dq", 64, 64, 2), Variant("dq", 128, 128, 2)),
}


# The one-pass backward's candidates (`deterministic_backward()` off only: dQ's float32 sums are added in no fixed
# order). "one_pass": a producer warp streams block_m query rows through nbuf buffers to two consumer warpgroups of
# block_n // 2 key rows at `regs` registers, each adding half of dQ (its columns; with 128-row query tiles its rows)
# by a TMA reduce-add. TL_KERNEL stands
# for the two passes, which stay a candidate: on an H100 (16k tokens, bf16, whole backwards) the one pass ran
# 0.84-0.98x the two passes' time at D 128 and 0.94-0.96x at D 64 N 16384, but 0.99-1.03x at D 64 N 4096
# (kernel_configs/probe_one_pass_backward_*_h100.txt). At D 64, 128-row query tiles (half the tiles a program
# visits, and its products twice as wide) ran 2-5% faster than 64-row ones in every cell of N 4096 and 16384 but the
# deterministic causal N 16384, where they tied (kernel_configs/probe_one_pass_block_m128_h100.txt), and splitting
# dQ by rows took 2-6% more off (probe_one_pass_dq_rows_h100.txt); at D 128 their accumulators do not fit in the
# registers. With two Q/dO buffers they fit a second set of dQ staging boxes (231,984 bytes of shared memory), which
# gives the writer a tile more of slack: 0.7-5% faster than one set unordered, 1-2% deterministic (a tie at full N
# 16384) in the four D 64 cells of N 4096 and 16384 (kernel_configs/probe_one_pass_d64_two_stages_h100.txt). At D 128
# two sets fit beside two 64-row Q/dO buffers; since the pairs are read from shared memory they run 5-7% faster than
# one under full masks deterministic, 1-4% unordered, and 1-2% slower under causal ones
# (kernel_configs/probe_one_pass_d128_two_stages_h100.txt): the timed choice takes either. A D 64 128-row kernel
# with three buffers no longer fits (233,024 bytes with the pairs' buffers); it had timed 5-7% slower than the
# two-buffer one with two sets (kernel_configs/choice_timings_stop44_h100.txt) and was dropped (stop 45). The D 64
# 128-row kernel's consumers take turns at each tile's whole dQ product (alternate=1): 1-4% faster than each
# computing half of it in all six cells of N 2048-16384, here and deterministic (kernel_configs/
# probe_one_pass_dq_alternating_h100.txt); at D 128 the turns were 9-18% slower (an H200, kernel_configs/
# probe_one_pass_dq_alternating_first_h200.txt) and are not candidates.
ONE_PASS_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("one_pass", 64, 128, 3, 240, 2), Variant("one_pass", 128, 128, 2, 240, 2, 1)),
    128: (TL_KERNEL, Variant("one_pass", 64, 128, 2, 240), Variant("one_pass", 64, 128, 2, 240, 2),
          Variant("one_pass", 64, 128, 3, 240)),
}

# The deterministic one pass's candidates (the default, `deterministic_backward()` on): "one_pass_det" is the one
# pass with dQ's adds into each query tile made in a fixed order, each waiting for its turn on a semaphore
# (gluon_kernels.py says how the turns are ordered). TL_KERNEL stands for the two passes, as above. On an H100
# (16k tokens, bf16, whole backwards) it ran 0.89-0.98x the two passes' time at D 128 and 1.03-1.10x at D 64 with
# 64-row query tiles (kernel_configs/probe_one_pass_det_h100.txt); with 128-row ones and dQ split by rows 0.88-0.97x
# at D 64 (kernel_configs/probe_one_pass_dq_rows_h100.txt), where the choice now takes it; its 128-row two-buffer
# kernel takes two staging sets and alternates at dQ, as above.
DETERMINISTIC_ONE_PASS_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("one_pass_det", 64, 128, 3, 240, 2), Variant("one_pass_det", 128, 128, 2, 240, 2, 1)),
    128: (TL_KERNEL, Variant("one_pass_det", 64, 128, 2, 240), Variant("one_pass_det", 64, 128, 2, 240, 2),
          Variant("one_pass_det", 64, 128, 3, 240)),
}

# Under full masks (the ring of turns) the deterministic D 128 one pass's candidates are the two passes and the
# kernel with two dQ staging sets alone. On an H100 it ran 2.2-5.3% faster than the one-set kernel and 3.0-6.3%
# faster than the three-buffer one in all four full-mask cells of N 2048-16384 (5 interleaved rounds,
# kernel_configs/probe_one_pass_det_d128_candidates_h100.txt; 5-7% in stop 45's), yet a choice timed among them on
# a call's first run took the one-set kernel at N 16384 in one of two sweeps (its backward 4% slower than the
# other sweep's). Under causal masks the three are within 0.5-2.4% of each other and the choice times them all.
DETERMINISTIC_ONE_PASS_FULL_MASK_VARIANTS: dict[int, tuple[Variant, ...]] = {
    128: (TL_KERNEL, Variant("one_pass_det", 64, 128, 2, 240, 2)),
}


def gluon_variants(head_dim: int) -> tuple[Variant, ...]:
    """Every Gluon kernel variant at this head dim: the forward's, dK/dV's, dQ's and the one pass's (the `tl`
    candidates left out)."""
    tables = (VARIANTS, DKDV_VARIANTS, DQ_VARIANTS, ONE_PASS_VARIANTS, DETERMINISTIC_ONE_PASS_VARIANTS)
    return tuple(v for table in tables for v in table.get(head_dim, ()) if v.kind != "tl")


# Why this path is off in this process, once it found out: the kernels do not import (a Triton without Gluon's
# Hopper API, or one whose API moved) or no variant compiles and runs on this GPU. The `tl` kernels run instead.
_broken: str | None = None


# The checks below run under torch.compile too (Dynamo traces `problem` to pick the op), so they cache in plain
# module state: Dynamo warns about every functools cache it traces through ("silent incorrectness is a potential
# risk"), and a user compiling a model would see that twice per process.
_imported: list = []  # [the kernel module or None], once tried


def _kernels():
    """The kernel module, or None where it does not import here (imported once, on first use; `_broken` says why)."""
    global _broken
    if not _imported:
        try:
            from . import gluon_kernels
        except (ImportError, AttributeError, TypeError) as exc:  # no Gluon, or an API that moved since Triton 3.9
            _broken = f"the Gluon kernels do not import with this Triton ({type(exc).__name__}: {exc})"
            gluon_kernels = None
        _imported.append(gluon_kernels)
    return _imported[0]


ENV = "FLASHSYS_GLUON"


def enabled() -> bool:
    """FLASHSYS_GLUON, an on/off switch (triton_env.env_switch: a value other than on or off raises)."""
    return env_switch(ENV)


_is_hopper: dict[int, bool] = {}  # device index -> sm_90 (see `_imported` on why not functools.cache)


def _hopper(device_index: int) -> bool:
    if device_index not in _is_hopper:
        _is_hopper[device_index] = torch.cuda.get_device_capability(device_index) == (9, 0)
    return _is_hopper[device_index]


def _tma_strides_ok(t: Tensor) -> bool:
    """Every stride TMA reads is a positive multiple of 16 bytes (and known: not symbolic), the last is 1 (dims of size
    1 are never strided)."""
    if t.stride(-1) != 1:
        return False
    return all(size == 1 or (type(stride) is int and stride > 0 and stride % 8 == 0)
               for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def _ramp_sum(x: int) -> int:
    """The sum of max(t, 0) over the integers t < x."""
    return x * (x - 1) // 2 if x > 0 else 0


def _keys_below(n_q: int, first: int, n_k: int) -> int:
    """The sum over rows i < n_q of clamp(first + i, 0, n_k): the keys below a bound that moves down the rows."""
    return _ramp_sum(first + n_q) - _ramp_sum(first) - _ramp_sum(first + n_q - n_k) + _ramp_sum(first - n_k)


def visible_pairs(n_q: int, n_k: int, window: tuple[int, int]) -> int:
    """How many (query, key) pairs a (left, right) window leaves visible (-1: unbounded; bottom-right aligned, query i
    sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right), in constant time: row i sees the keys below its
    right bound but not below its left one. The window is one `validation.normalize_window` returned: the library's
    callers validated it already, so it is not checked again on this path."""
    left, right = window
    offset = n_k - n_q
    below_right = n_q * n_k if right < 0 else _keys_below(n_q, offset + right + 1, n_k)
    below_left = 0 if left < 0 else _keys_below(n_q, offset - left, n_k)
    return below_right - below_left


def call_work(q_shape: tuple[int, ...], k_shape: tuple[int, ...], window: tuple[int, int]) -> int:
    """B * H * D * the query-key pairs the kernels visit, the size MIN_WORK bars: the visible pairs under a full or
    causal mask (right bound only), all Nq * Nk under a window with a left bound. Windows are not barred on their
    visible pairs: on an H100 the Gluon kernels ran every windowed call of N 2048-16384 (D 64 and 128, windows of
    127-1023 keys) 3-30% faster than the `tl` kernels, 24 of those 32 cells below 2^34 of visible work
    (kernel_configs/probe_window_bar_h100.md)."""
    heads = q_shape[0] * (q_shape[1] if len(q_shape) == 4 else 1)
    n_q, n_k = q_shape[-2], k_shape[-2]
    pairs = n_q * n_k if window[0] >= 0 else visible_pairs(n_q, n_k, window)
    return heads * q_shape[-1] * pairs


def problem(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]) -> str | None:
    """None when the Gluon forward takes these (validated, dense) inputs, else why not. Cheapest checks first: an
    eager call on the Python path asks this every time, and most small calls stop at the size bar before any stride
    is read."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (takes float16, bfloat16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (takes {HEAD_DIMS})"
    if not enabled():
        return f"{ENV}={os.environ[ENV]}"
    if not _hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "not an sm_90 (Hopper) GPU"
    if _kernels() is None or _broken is not None:
        return _broken
    if any(type(n) is not int for n in (*q.shape, *k.shape)):  # v is shaped like k (validated)
        return "symbolic shapes (torch.compile with dynamic shapes)"
    work = call_work(q.shape, k.shape, window)
    if work < MIN_WORK:
        return (f"B*H*D*(query-key pairs) = {work} < {MIN_WORK} (host-bound there: the native launcher's `tl` "
                "forward costs less)")
    if not all(_tma_strides_ok(t) for t in (q, k, v)):
        return "strides TMA cannot address (each must be a multiple of 16 bytes, the last 1)"
    return None


def takes(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]) -> bool:
    """Whether the Gluon forward runs this call (real tensors: their addresses must be 16-byte aligned too)."""
    return problem(q, k, v, window) is None and all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def backward_problem(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]) -> str | None:
    """As `problem`, for the Gluon backward kernels: the forward's conditions and a head dim one of them has variants
    for (dQ at D 64 and 128, dK/dV at D 128)."""
    if q.shape[-1] not in DKDV_VARIANTS and q.shape[-1] not in DQ_VARIANTS:
        return f"head dim {q.shape[-1]} (the Gluon backward kernels take {tuple(DQ_VARIANTS)})"
    return problem(q, k, v, window)


def takes_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, window: tuple[int, int]) -> bool:
    """Whether the Gluon backward kernels may run this backward (`backward_dq` and `backward_dkdv` then say whether
    each did): where `backward_problem` finds nothing, with 16-byte-aligned tensors and an O and a dO that TMA can
    read."""
    return (backward_problem(q, k, v, window) is None and _tma_strides_ok(do) and _tma_strides_ok(o)
            and all(t.data_ptr() % 16 == 0 for t in (q, k, v, o, do)))


# ----------------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------------


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    gl = _kernels().gl
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], {torch.bfloat16: gl.bfloat16,
                                                                        torch.float16: gl.float16}[dtype])


def _rank4(t: Tensor) -> Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)


def _descriptor(t: Tensor, rows: int, cols: int | None = None, layout=None):
    """A TMA descriptor of rank-4 t copying (1, 1, rows, cols) boxes (cols: all of D by default) into shared memory
    laid out as `layout` (by default the 16-bit tiles' `_smem_layout`). A dim of size 1 gets the stride it would have
    if t were dense over the dims inside it (its own may be anything; TMA checks every stride)."""
    shape, strides = list(t.shape), list(t.stride())
    for axis in (2, 1, 0):
        if shape[axis] == 1:
            strides[axis] = shape[axis + 1] * strides[axis + 1]
    cols = shape[3] if cols is None else cols
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, shape, strides, [1, 1, rows, cols], layout or _smem_layout(rows, cols, t.dtype))


def _launch_parts(variant: Variant, q4: Tensor, k4: Tensor, v4: Tensor, o4: Tensor, lse: Tensor,
                  window: tuple[int, int], scale: float) -> tuple:
    """(kernel, grid, positional arguments, keyword arguments) of one launch on rank-4 tensors."""
    kernels = _kernels()
    batch, n_heads, n_q, d = q4.shape
    q_rows = variant.block_m if variant.kind == "plain" else variant.block_m // 2
    n_programs = triton.cdiv(n_q, variant.block_m) * batch * n_heads
    args = (_descriptor(q4, q_rows), _descriptor(k4, variant.block_n), _descriptor(v4, variant.block_n),
            _descriptor(o4, q_rows), lse, batch * n_heads, n_heads, n_heads // k4.shape[1], n_q, k4.shape[2], window[0],
            window[1], scale * LOG2E)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BOUND_RIGHT=window[1] >= 0,
                  BOUND_LEFT=window[0] >= 0, NBUF=variant.nbuf, num_warps=4)
    if variant.kind == "plain":
        return kernels.attention_forward, (n_programs,), args, kwargs
    kwargs["CONSUMER_REGS"] = variant.regs
    if variant.kind == "persistent":  # one program per SM, over pairs of query tiles (gluon_kernels' units)
        n_units = (triton.cdiv(n_q, variant.block_m) + 1) // 2 * batch * n_heads
        return kernels.attention_forward_persistent, (min(n_units, _usable_sms(q4)),), args, kwargs
    return kernels.attention_forward_pingpong, (n_programs,), args, kwargs


def _dkdv_launch_parts(variant: Variant, q4: Tensor, k4: Tensor, v4: Tensor, do4: Tensor, dk4: Tensor, dv4: Tensor,
                       lse_delta: Tensor, window: tuple[int, int], scale: float) -> tuple:
    """As `_launch_parts`, for the dK/dV kernel."""
    batch, n_heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    m, n = variant.block_m, variant.block_n
    args = (_descriptor(q4, m), _descriptor(k4, n), _descriptor(v4, n), _descriptor(do4, m), _descriptor(dk4, n),
            _descriptor(dv4, n), lse_delta, batch * kv_heads, n_heads, n_heads // kv_heads, n_q, n_k, window[0],
            window[1], scale * LOG2E, scale)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0,
                  NBUF=variant.nbuf, num_warps=n // 16)
    return _kernels().attention_backward_dkdv, (triton.cdiv(n_k, n) * batch * kv_heads,), args, kwargs


def _dq_launch_parts(variant: Variant, q4: Tensor, k4: Tensor, v4: Tensor, do4: Tensor, o4: Tensor, dq4: Tensor,
                     lse: Tensor, lse_delta: Tensor, window: tuple[int, int], scale: float) -> tuple:
    """As `_launch_parts`, for the dQ kernel."""
    batch, n_heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    m, n = variant.block_m, variant.block_n
    args = (_descriptor(q4, m), _descriptor(k4, n), _descriptor(v4, n), _descriptor(do4, m), _descriptor(o4, m),
            _descriptor(dq4, m), lse, lse_delta, batch * n_heads, n_heads, n_heads // kv_heads, n_q, n_k, window[0],
            window[1], scale * LOG2E, scale)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0,
                  NBUF=variant.nbuf, num_warps=m // 16)
    return _kernels().attention_backward_dq, (triton.cdiv(n_q, m) * batch * n_heads,), args, kwargs


def semaphore_count(variant: Variant, q4: Tensor) -> int:
    """How many int32 semaphores `variant` of the one pass needs for these queries, zeroed before its launch: one
    per (batch, head, query tile) for "one_pass_det", none for the other."""
    if variant.kind != "one_pass_det":
        return 0
    batch, n_heads, n_q, _ = q4.shape
    return batch * n_heads * triton.cdiv(n_q, variant.block_m)


def rotates(variant: Variant, q4: Tensor, k4: Tensor, window: tuple[int, int]) -> bool:
    """Whether the deterministic one pass starts each program at a different query tile (ROTATE): full masks only,
    with at least as many query tiles as key tiles, and only where one (batch, K/V head)'s programs can all run at
    once (one per SM): the ring of turns waits on programs launched later, which must not be left waiting for an
    SM that a waiting program holds. Elsewhere the programs go in order, which needs none of that."""
    if variant.kind != "one_pass_det" or window != (-1, -1):
        return False
    n_k_tiles = triton.cdiv(k4.shape[2], variant.block_n)
    if triton.cdiv(q4.shape[2], variant.block_m) < n_k_tiles:
        return False
    return n_k_tiles <= _usable_sms(q4)


def passes_turns_late(variant: Variant, q4: Tensor, k4: Tensor, window: tuple[int, int]) -> bool:
    """Whether the deterministic one pass's writer counts a tile's turn only after issuing the next tile's adds
    (PASS_LATE), which keeps the adds' completion off its path: only where each program's predecessor at a tile gets
    there two or more tiles before it. That is the ring's stride (query tiles per key tile) where it rotates, and
    the tiles' sizes elsewhere (key tile n + 1 starts BLOCK_N rows, BLOCK_N / BLOCK_M query tiles, further on). One
    tile ahead, a late count would make a ring of programs wait on each other's next waits (a deadlock: the GPU
    trapped) and chain a masked order's programs one hop behind another."""
    if variant.kind != "one_pass_det":
        return False
    if rotates(variant, q4, k4, window):
        return triton.cdiv(q4.shape[2], variant.block_m) // triton.cdiv(k4.shape[2], variant.block_n) >= 2
    return variant.block_n >= 2 * variant.block_m


def folds_dq(variant: Variant, q4: Tensor, k4: Tensor, window: tuple[int, int]) -> bool:
    """Whether the deterministic one pass writes dQ itself (FOLD_DQ), so that no epilogue kernel reads the whole
    float32 sum back after it: a program scales and casts the sums at the query tiles where its key tile took the last
    turn, for a pair `fold_lag` back. Where it rotates (full masks) only: the ring spreads the last turns over every
    key tile, `stride` query tiles each, where the other orders give key tile 0 the last turn at every tile it visits
    (a head's whole dQ left to one program, the heaviest under a causal mask), so the epilogue kernel stays there."""
    return rotates(variant, q4, k4, window)


def fold_lag(variant: Variant, q4: Tensor, k4: Tensor, window: tuple[int, int]) -> int:
    """Where `folds_dq`, how many (batch, K/V head) pairs back a program writes dQ for at its start, while its own K
    and V load (FOLD_DQ), else 0: enough that those pairs' programs launched two waves of the SMs before it, so that
    their sums are whole and its wait for them passes at once. At the end of the program the wait for its own adds
    to complete would lie on its path (and the code after its loop spilled). The grid holds this many pairs' programs
    more, which only fold the last pairs."""
    if not folds_dq(variant, q4, k4, window):
        return 0
    return triton.cdiv(2 * _usable_sms(q4), triton.cdiv(k4.shape[2], variant.block_n))


def paired_heads(variant: Variant, q4: Tensor, k4: Tensor, window: tuple[int, int]) -> int:
    """How many (batch, K/V head) pairs make a group of the one pass's paired order (PAIRED,
    `flash_triton._paired_key_program`), or 0 where it keeps one head after another: masks with a right bound and
    no left one (causal), whose key tiles' work falls from the first to the last. A group's programs about fill
    the SMs, one per SM: an odd group's heaviest programs then start as the even group's lightest end, and each
    SM's two take about the same time. Either kind: the deterministic one's turns are ordered to match
    (`flash_triton._one_pass_turn`'s `down`), and every program waits only for programs launched before it."""
    if variant.kind not in ("one_pass", "one_pass_det") or window[1] < 0 or window[0] >= 0:
        return 0
    return max(1, _usable_sms(q4) // triton.cdiv(k4.shape[2], variant.block_n))


_sm_counts: dict[int, int] = {}


def _sm_count(device_index: int) -> int:
    """The SMs of this CUDA device, read once (reading the device's properties costs a few µs a launch)."""
    count = _sm_counts.get(device_index)
    if count is None:
        count = _sm_counts[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return count


def _usable_sms(t: Tensor) -> int:
    """The SMs this process's kernels can run on at once: the GPU's count (132 for a CPU tensor, an H100's, for
    compiling without a GPU), cut to MPS's share where CUDA_MPS_ACTIVE_THREAD_PERCENTAGE limits it."""
    sms = _sm_count(t.get_device()) if t.is_cuda else 132
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    try:
        return sms if share is None else max(1, int(sms * float(share) / 100))
    except ValueError:  # an unreadable share: assume the smallest
        return 1


def dq_sum_rows(n_q: int) -> int:
    """Rows a (batch, head) of the one pass's float32 dQ sum holds: Nq rounded up to a whole group of 8, the groups
    its rows are permuted in (`dq_sum_row`). Without the padding a row near a ragged end could be stored past Nq,
    where the TMA adds clip it."""
    return triton.cdiv(n_q, 8) * 8


def dq_sum_shape(q4: Tensor) -> tuple[int, int, int, int]:
    """The one pass's float32 dQ sum for rank-4 q (B, H, Nq, D): (B, H, `dq_sum_rows`(Nq), D), what the backward
    allocates and the launch checks."""
    batch, n_heads, n_q, d = q4.shape
    return batch, n_heads, dq_sum_rows(n_q), d


def dq_sum_row(r):
    """Where query row r (int or integer tensor) lies in the one pass's float32 dQ sum: row r of each group of 8 at
    2 * (r % 4) + (r // 4) % 2. The kernel stores a tile's share straight from its wgmma accumulator, whose half-warps
    hold rows 0-3 and 4-7 of each 8; in this order those four rows fall in four different phases of the staging
    box's 128-byte swizzle, where in row order rows r and r ^ 1 took the same banks (a 2-way conflict on every
    store; kernel_experiments.md, stop 54). `gluon_kernels._in_sum_order` permutes the share so."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)


def _one_pass_launch_parts(variant: Variant, q4: Tensor, k4: Tensor, v4: Tensor, do4: Tensor, dk4: Tensor,
                           dv4: Tensor, dq_acc: Tensor, lse_delta: Tensor, semaphores: Tensor | None, dq4: Tensor,
                           window: tuple[int, int], scale: float) -> tuple:
    """As `_launch_parts`, for the one-pass backward kernel: dq_acc is dQ's float32 sum, (B, H, `dq_sum_rows`(Nq),
    D) in `dq_sum_row`'s order, zeroed (for kind "one_pass_det" only its rows that see no key: it stores each tile's
    first share), and `semaphores`
    `semaphore_count` int32s, zeroed (the other kind reads none: any int32 tensor, or None). Each
    consumer warpgroup computes half of dQ: with 128-row query tiles half its rows (dq_desc's boxes (64, D)), from
    all of K's tile in shared memory; else half its columns (boxes (block_m, D / 2)), from a column half of K's tile,
    which at D 64 is 64 bytes wide, so K's tile then takes a 64-byte swizzle (the default's 128 bytes would cut a
    swizzle row in two). Kind "one_pass_det" adds in a fixed order; where `folds_dq`, it also writes dq4 (dense, shaped
    like q4) from the sum, else dq4 is not touched (the epilogue kernel writes it)."""
    batch, n_heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    m, n = variant.block_m, variant.block_n
    deterministic = variant.kind == "one_pass_det"
    if variant.alternate and variant.stages != 2:
        raise ValueError(f"{variant.label()}: the consumers take turns at dQ only with two staging sets, one each")
    if deterministic and (semaphores is None or semaphores.numel() < semaphore_count(variant, q4)):
        raise ValueError(f"semaphores: {variant.label()} needs {semaphore_count(variant, q4)} zeroed int32s, got "
                         f"{None if semaphores is None else semaphores.numel()}")
    if tuple(dq_acc.shape) != dq_sum_shape(q4):
        raise ValueError(f"dQ's float32 sum holds (B, H, dq_sum_rows(Nq), D) = {dq_sum_shape(q4)} (rows in "
                         f"dq_sum_row's order), got {tuple(dq_acc.shape)}")
    dq_rows, dq_cols = (m, d) if variant.alternate else (m // 2, d) if m >= 128 else (m, d // 2)
    group_heads = paired_heads(variant, q4, k4, window)
    lag = fold_lag(variant, q4, k4, window)
    if lag and (dq4.shape != q4.shape or not dq4.is_contiguous() or not dq_acc.is_contiguous()):
        raise ValueError(f"{variant.label()} writes dQ from its sum as dense (B, H, Nq, D) tensors: got dq "
                         f"{tuple(dq4.shape)} strides {dq4.stride()}, the sum strides {dq_acc.stride()}, q "
                         f"{tuple(q4.shape)}")
    gl = _kernels().gl
    dq_desc = _descriptor(dq_acc, dq_rows, dq_cols,
                          gl.NVMMASharedLayout.get_default_for([1, 1, dq_rows, dq_cols], gl.float32))
    half_bytes = dq_cols * k4.element_size()
    k_layout = (gl.NVMMASharedLayout(swizzle_byte_width=half_bytes, element_bitwidth=8 * k4.element_size(), rank=4)
                if half_bytes < 128 else None)
    args = (_descriptor(q4, m), _descriptor(k4, n, layout=k_layout), _descriptor(v4, n), _descriptor(do4, m),
            _descriptor(dk4, n // 2), _descriptor(dv4, n // 2), dq_desc, lse_delta,
            semaphores, dq_acc, dq4, batch * kv_heads, n_heads, n_heads // kv_heads, n_q, n_k, window[0],
            window[1], scale * LOG2E, scale, max(1, group_heads), lag)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0,
                  NBUF=variant.nbuf, CONSUMER_REGS=variant.regs, DETERMINISTIC=deterministic,
                  ROTATE=rotates(variant, q4, k4, window), PASS_LATE=passes_turns_late(variant, q4, k4, window),
                  PAIRED=group_heads > 0, NSTAGE=variant.stages, DQ_ALTERNATE=bool(variant.alternate),
                  FOLD_DQ=lag > 0, num_warps=4)
    return _kernels().attention_backward_one_pass, (triton.cdiv(n_k, n) * (batch * kv_heads + lag),), args, kwargs


_LAUNCH_PARTS = {"dkdv": _dkdv_launch_parts, "dq": _dq_launch_parts, "one_pass": _one_pass_launch_parts,
                 "one_pass_det": _one_pass_launch_parts}


def _launch(variant: Variant, *tensors_and_scalars):
    """Launch `variant`; returns (the compiled kernel, its grid, every parameter's value in signature order)."""
    parts = _LAUNCH_PARTS.get(variant.kind, _launch_parts)
    kernel, grid, args, kwargs = parts(variant, *tensors_and_scalars)
    compiled = kernel[grid](*args, **kwargs)
    return compiled, grid, (*args, *(kwargs[name] for name in kernel.arg_names[len(args):]))


class GluonReplay:
    """A Gluon launch replayed on new tensors of the signature it was made for (an eager plan's `run`): the
    compiled kernel launched directly, each TMA descriptor a copy of the first call's with the new tensor as its
    base. Shapes, strides, dtype, device and alignment are the plan's key, so nothing else about a descriptor changes.

    Why: the first call's path (checks, descriptors built and validated, Triton's JIT dispatch) costs 150-290 µs a
    launch on an H100; this costs what Triton's launcher does (it encodes each descriptor for the GPU). The native
    launcher calls it as it is, under the GIL: it cannot pass TMA descriptors itself."""

    __slots__ = ("_launch", "_templates", "_rest")

    def __init__(self, compiled, grid: tuple[int, ...], params: tuple, n_tensors: int):
        self._launch = compiled[(*grid, 1, 1)[:3]]
        # The first call's tensors are not kept (a plan lives as long as the process): a descriptor's template has
        # no base, and a tensor parameter is None.
        templates = []
        for p in params[:n_tensors]:
            if isinstance(p, Tensor):
                templates.append(None)
            else:
                p = copy.copy(p)
                object.__setattr__(p, "base", None)
                templates.append(p)
        self._templates = tuple(templates)
        self._rest = params[n_tensors:]

    @staticmethod
    def recordable(params: tuple, n_tensors: int) -> bool:
        """Whether this Triton's descriptors can be re-based as `__call__` does (a dataclass with a `base`)."""
        return all(isinstance(p, Tensor) or (dataclasses.is_dataclass(p) and hasattr(p, "base"))
                   for p in params[:n_tensors])

    def __call__(self, *tensors: Tensor, stream=None) -> None:
        args = []
        for t, template in zip(tensors, self._templates):
            if template is None:
                args.append(t)
            else:
                descriptor = copy.copy(template)  # no __post_init__: the template passed its checks
                object.__setattr__(descriptor, "base", _rank4(t))
                args.append(descriptor)
        self._launch(*args, *self._rest, stream=stream)


def compile_only(variant: Variant, q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int], scale: float):
    """Compile `variant` for these inputs' shapes without launching it (Triton's `warmup`; on a CPU machine under a
    stand-in driver that names sm_90, as the CPU tests do). Returns the compiled kernel."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
    if variant.kind == "dkdv":
        tensors = (q, k, v, q, torch.empty_like(k), torch.empty_like(v))
        kernel, _, args, kwargs = _dkdv_launch_parts(variant, *(_rank4(t) for t in tensors), lse_delta, window,
                                                     scale)
    elif variant.kind.startswith("one_pass"):
        tensors = (q, k, v, q, torch.empty_like(k), torch.empty_like(v))
        dq_acc = torch.empty(dq_sum_shape(_rank4(q)), dtype=torch.float32, device=q.device)
        semaphores = torch.empty(semaphore_count(variant, _rank4(q)), dtype=torch.int32, device=q.device)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)  # dense, as the backward allocates it
        kernel, _, args, kwargs = _one_pass_launch_parts(variant, *(_rank4(t) for t in tensors), dq_acc, lse_delta,
                                                         semaphores, _rank4(dq), window, scale)
    elif variant.kind == "dq":
        tensors = (q, k, v, q, o, torch.empty_like(q))
        kernel, _, args, kwargs = _dq_launch_parts(variant, *(_rank4(t) for t in tensors), lse, lse_delta, window,
                                                   scale)
    else:
        kernel, _, args, kwargs = _launch_parts(variant, *(_rank4(t) for t in (q, k, v, o)), lse, window, scale)
    return kernel.warmup(*args, **kwargs, grid=(1,))


class ChoiceKey(NamedTuple):
    head_dim: int
    dtype: torch.dtype
    bound_right: bool
    bound_left: bool
    bucket: int  # max(Nq, Nk) rounded up to a power of two
    kernel: str = "forward"  # or "dkdv", "dq", "one_pass", "one_pass_det"

    @classmethod
    def of(cls, q4: Tensor, k4: Tensor, window: tuple[int, int], kernel: str) -> ChoiceKey:
        bucket = 1 << (max(q4.shape[2], k4.shape[2]) - 1).bit_length()
        return cls(q4.shape[3], q4.dtype, window[1] >= 0, window[0] >= 0, bucket, kernel)

    def candidates(self) -> tuple[Variant, ...]:
        if self.kernel == "one_pass_det" and not (self.bound_right or self.bound_left):
            full = DETERMINISTIC_ONE_PASS_FULL_MASK_VARIANTS.get(self.head_dim)
            if full is not None:
                return full
        return {"forward": VARIANTS, "dkdv": DKDV_VARIANTS, "dq": DQ_VARIANTS, "one_pass": ONE_PASS_VARIANTS,
                "one_pass_det": DETERMINISTIC_ONE_PASS_VARIANTS}[self.kernel][self.head_dim]

    def label(self, variant: Variant) -> str:
        """`variant`'s label in this choice: in the one-pass choice TL_KERNEL stands for the two passes."""
        return "two passes" if self.kernel.startswith("one_pass") and variant.kind == "tl" else variant.label()


_chosen: dict[ChoiceKey, Variant] = {}


def chosen_variants() -> dict[ChoiceKey, Variant]:
    """{key: variant} chosen so far in this process."""
    return dict(_chosen)


def status() -> str:
    """One line for benchmark headers: whether this path runs on the current GPU, and the variants chosen so far
    ("causal" stands for any right bound without a left one, "window" for a left bound)."""
    if not enabled():
        return f"off ({ENV}={os.environ[ENV]})"
    if not torch.cuda.is_available() or not _hopper(torch.cuda.current_device()):
        return "off (not an sm_90 GPU)"
    if _kernels() is None or _broken is not None:
        return f"off ({_broken})"
    masks = {(True, False): "causal", (False, False): "full", (True, True): "window", (False, True): "window"}
    chosen = "; ".join(f"{k.kernel} D {k.head_dim} {str(k.dtype)[6:]} {masks[k.bound_right, k.bound_left]} "
                       f"N<={k.bucket}: {k.label(v)}" for k, v in sorted(_chosen.items(), key=str))
    bar = f"on where B*H*D*(query-key pairs, call_work) >= 2^{MIN_WORK.bit_length() - 1}"
    return bar + (f"; chose {chosen}" if chosen else "")


# The choice times every candidate in interleaved rounds and takes each one's median: on an H100 one process's
# timings of the same kernel drift by 5-15% (clocks, heat), and a single pass per candidate picked a variant 4-8%
# slower than the best (kernel_configs/probe_gluon_variants_h100.txt). Each timing spans 100 ms, as Triton's
# autotuner's do: timings of 10 ms picked the one-warpgroup kernel in 7 of 10 H100 cells where it ran 2-8% slower
# than a ping-pong one over 500 ms (D 128 N 2048-16384, D 64 N 16384), and warming the GPU first did not change
# that; at 100 ms both picks matched the 500-ms best in 9 cells, and one of two in the tenth (4% apart there;
# kernel_configs/probe_gluon_choice_settings_h100.txt). The cost: about one second on a key's first call.
_CHOICE_ROUNDS = 3
_CHOICE_REP_MS = 100


def _choose(key: ChoiceKey, run) -> Variant | None:
    """The variant for `key`: timed on this call's tensors the first time (each candidate by triton.testing.do_bench,
    in _CHOICE_ROUNDS interleaved rounds), then remembered. `run(variant)` launches one; a candidate that fails to
    compile or launch on this GPU is left out. None, with a RuntimeWarning that turns this path off for the
    process, where none runs: the `tl` kernel then takes the call (forward or dK/dV)."""
    chosen = _chosen.get(key)
    if chosen is not None:
        return chosen
    candidates = key.candidates()
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]  # not remembered: a later call outside the capture may still time them
    if not autotune_enabled():
        _chosen[key] = candidates[0]
        return candidates[0]
    from triton.testing import do_bench

    times: dict[Variant, list[float]] = {}
    errors = {}
    for _ in range(_CHOICE_ROUNDS):
        for variant in candidates:
            if variant in errors:
                continue
            try:
                times.setdefault(variant, []).append(do_bench(lambda: run(variant), warmup=2, rep=_CHOICE_REP_MS))
            except Exception as exc:  # noqa: BLE001  (out of shared memory or registers on this GPU)
                errors[variant] = exc
                times.pop(variant, None)
    if not times:
        global _broken
        _broken = "no variant ran: " + "; ".join(f"{v.label()}: {type(e).__name__}: {e}" for v, e in errors.items())
        warnings.warn(f"flashsys: the Gluon kernels are off in this process, the `tl` kernels run ({_broken})",
                      RuntimeWarning, stacklevel=4)
        return None
    _chosen[key] = min(times, key=lambda v: statistics.median(times[v]))
    return _chosen[key]


class Launched(NamedTuple):
    """What `forward`, `backward_dq` and `backward_dkdv` did: whether a Gluon kernel ran, and if so the launch as
    eager_plans records it (a GluonReplay and the call's tensors it takes; None where it cannot be replayed)."""

    ran: bool
    recorded: Recorded | None = None


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, window: tuple[int, int],
            scale: float) -> Launched:
    """Write O (dense, shaped like q) and L (float32, q.shape[:-1], dense) for inputs `takes` accepted; window as
    the `tl` forward takes it ((left, right), -1 unbounded; causal (-1, 0)). Not `ran` where no variant runs here
    (the caller runs the `tl` forward)."""
    q4, k4, v4, o4 = (_rank4(t) for t in (q, k, v, o))
    return _run(ChoiceKey.of(q4, k4, window, "forward"), (q, k, v, o, lse), None, q4, k4, v4, o4, lse, window, scale)


def backward_dq(q: Tensor, k: Tensor, v: Tensor, do: Tensor, o: Tensor, dq: Tensor, lse: Tensor, lse_delta: Tensor,
                window: tuple[int, int], scale: float, run_tl: Callable[[], object]) -> Launched:
    """Write dQ (dense, shaped like q) and the (-L * log2 e, D) pairs ((*q.shape[:-1], 2) float32, dense) that the
    dK/dV kernels read, for inputs `takes_backward` accepted. Not `ran` where the `tl` dQ kernel is the choice or
    the head dim has no Gluon dQ kernel: the caller runs it. `run_tl()` launches the `tl` kernel on these tensors,
    for the choice's timings."""
    if q.shape[-1] not in DQ_VARIANTS:
        return Launched(False)
    q4, k4, v4, do4, o4, dq4 = (_rank4(t) for t in (q, k, v, do, o, dq))
    return _run(ChoiceKey.of(q4, k4, window, "dq"), (q, k, v, do, o, dq, lse, lse_delta), run_tl, q4, k4, v4, do4,
                o4, dq4, lse, lse_delta, window, scale)


def backward_dkdv(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse_delta: Tensor, dk: Tensor, dv: Tensor,
                  window: tuple[int, int], scale: float) -> Launched:
    """Write dK and dV (dense, shaped like k and v) for inputs `takes_backward` accepted, after a dQ kernel wrote
    lse_delta ((*q.shape[:-1], 2) float32, dense). Not `ran` where no variant runs here or the head dim has no
    Gluon dK/dV kernel (the caller runs the `tl` dK/dV kernel)."""
    if q.shape[-1] not in DKDV_VARIANTS:
        return Launched(False)
    q4, k4, v4, do4, dk4, dv4 = (_rank4(t) for t in (q, k, v, do, dk, dv))
    return _run(ChoiceKey.of(q4, k4, window, "dkdv"), (q, k, v, do, dk, dv, lse_delta), None, q4, k4, v4, do4, dk4,
                dv4, lse_delta, window, scale)


def choose_one_pass(q: Tensor, k: Tensor, window: tuple[int, int], run_one_pass: Callable[[Variant], object],
                    run_two_passes: Callable[[], object], deterministic: bool) -> Variant | None:
    """The one-pass variant to run for this key, where one is the choice (timed on the key's first call against the
    two passes, `run_two_passes()`); None where the two passes are the choice or the head dim has no one-pass
    kernel (the caller runs them). `run_one_pass(variant)` launches the prologue, the kernel and (unless the kernel
    folds dQ) the epilogue; the caller launches the chosen one (`backward_one_pass`). For inputs `takes_backward`
    accepted; `deterministic` (`deterministic_backward()`) picks the candidates whose dQ is the same bit for bit from
    run to run."""
    table = DETERMINISTIC_ONE_PASS_VARIANTS if deterministic else ONE_PASS_VARIANTS
    if q.shape[-1] not in table:
        return None
    key = ChoiceKey.of(_rank4(q), _rank4(k), window, "one_pass_det" if deterministic else "one_pass")
    variant = _choose(key, lambda var: run_two_passes() if var.kind == "tl" else run_one_pass(var))
    return None if variant is None or variant.kind == "tl" else variant


def backward_one_pass(variant: Variant, q: Tensor, k: Tensor, v: Tensor, do: Tensor, dk: Tensor, dv: Tensor,
                      dq_acc: Tensor, lse_delta: Tensor, semaphores: Tensor, dq: Tensor, window: tuple[int, int],
                      scale: float) -> Launched:
    """Launch the one-pass kernel `variant` (after the prologue: dq_acc, `_one_pass_launch_parts`' float32 sum, and
    `semaphores` zeroed, the deterministic kind's dq_acc only where no key is seen, lse_delta written): dK and dV
    (dense, shaped like k and v) written, dQ's unscaled float32 sum added into dq_acc (the deterministic kind: into
    what its first shares stored), and where `folds_dq` dq (dense, shaped like q) written from it."""
    q4, k4, v4, do4, dk4, dv4, dq4 = (_rank4(t) for t in (q, k, v, do, dk, dv, dq))
    return _launch_recorded(variant, (q, k, v, do, dk, dv, dq_acc, lse_delta, semaphores, dq_acc, dq), q4, k4, v4,
                            do4, dk4, dv4, dq_acc, lse_delta, semaphores, dq4, window, scale)


def _run(key: ChoiceKey, tensors: tuple[Tensor, ...], run_tl: Callable[[], object] | None,
         *tensors_and_scalars) -> Launched:
    """Launch `key`'s variant (chosen on the first call) on these arguments, whose first parameters (descriptors
    or tensors) are made from `tensors`, in order. `run_tl` launches the `tl` kernel where that is a candidate."""
    variant = _choose(key, lambda var: run_tl() if var.kind == "tl" else _launch(var, *tensors_and_scalars))
    if variant is None or variant.kind == "tl":
        return Launched(False)
    return _launch_recorded(variant, tensors, *tensors_and_scalars)


def _launch_recorded(variant: Variant, tensors: tuple[Tensor, ...], *tensors_and_scalars) -> Launched:
    """Launch `variant` and return the launch as eager_plans records it (`tensors`: the call's tensors its first
    parameters are made from, in order)."""
    compiled, grid, params = _launch(variant, *tensors_and_scalars)
    capturing = tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or not GluonReplay.recordable(params, len(tensors)):
        return Launched(True)  # a capture's variant is not the timed choice; an unknown descriptor type
    return Launched(True, Recorded(GluonReplay(compiled, grid, params, len(tensors)), tensors, ()))
