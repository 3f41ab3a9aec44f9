"""The host side of the Gluon kernels: kernel configurations (`Variant`), TMA descriptors, each kernel's launch
arguments, and the replay of a launch on new tensors.

Every launch takes a call's tensors as one of the small structures below (`ForwardTensors`, `DkdvTensors`,
`DqTensors`, `OnePassTensors`), in any rank-3 or rank-4 layout TMA can address, and returns the launch as a plan
records it. Which variant runs is `..dispatch`'s decision; this module only launches what it is given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from .. import device_limits
from ..layout import empty_output
from ..replay.plans import Recorded
from ..triton.tiles import LOG2E
from . import kernels

Window = tuple[int, int]
# The shared memory one program may take on sm_90 (227 KB): a variant's kernel must fit it, or its launch fails.
SM90_SHARED_BYTES = 232_448


class Variant(NamedTuple):
    """One kernel configuration: a forward's "plain" (one warpgroup), "pingpong" (producer warp + `warpgroups`
    consumer warpgroups, 2 or 3, of block_m // warpgroups rows with `regs` registers per thread) or "persistent" (the
    ping-pong kernel, one program per SM), a
    backward's "dkdv", "dq", "one_pass" or "one_pass_det" (the whole backward, warp-specialised as the ping-pong),
    or "tl" (the `tl` kernels a Gluon choice times its variants against)."""

    kind: str
    block_m: int
    block_n: int
    nbuf: int  # K/V buffers in flight
    regs: int = 0
    stages: int = 1  # the one pass's sets of dQ staging boxes
    alternate: int = 0  # 1: the one pass's consumers take turns at each query tile's whole dQ (needs stages 2)
    warpgroups: int = 2  # the forward ping-pong kernels' consumer warpgroups

    def label(self) -> str:
        if self.kind == "tl":
            return "tl kernel"
        extra = f" {self.regs} regs" if self.regs else ""
        extra += f" {self.stages} stages" if self.stages > 1 else ""
        extra += " dQ alternating" if self.alternate else ""
        extra += f" {self.warpgroups} warpgroups" if self.warpgroups != 2 else ""
        return f"{self.kind} {self.block_m}x{self.block_n} {self.nbuf}buf{extra}"


# TL_KERNEL stands for the `tl` kernel of whichever choice it is a candidate of (the two passes, in the one-pass
# choice).
TL_KERNEL = Variant("tl", 0, 0, 0)


class ForwardTensors(NamedTuple):
    """A forward's tensors: O dense and shaped like q, L float32 (q.shape[:-1]) dense."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    lse: Tensor


class DkdvTensors(NamedTuple):
    """The dK/dV kernel's tensors: dK, dV dense and shaped like k, v; the (-L * log2 e, D) pairs a dQ kernel wrote,
    (*q.shape[:-1], 2) float32 dense."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    dk: Tensor
    dv: Tensor
    lse_delta: Tensor


class DqTensors(NamedTuple):
    """The dQ kernel's tensors: dQ dense and shaped like q; L as the forward wrote it; the pairs it writes."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    o: Tensor
    dq: Tensor
    lse: Tensor
    lse_delta: Tensor


class OnePassTensors(NamedTuple):
    """The one-pass kernel's tensors: dK, dV as in `DkdvTensors`; dq_acc, dQ's float32 sum (`dq_sum_shape`, rows in
    `dq_sum_row`'s order); the pairs the prologue wrote; `semaphores` (`semaphore_count` zeroed int32s; any int32
    tensor, or None, for the unordered kind); dq, shaped like q (written only where `folds_dq`)."""

    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    dk: Tensor
    dv: Tensor
    dq_acc: Tensor
    lse_delta: Tensor
    semaphores: Tensor | None
    dq: Tensor


class LaunchParts(NamedTuple):
    """One launch, prepared: the kernel, its grid, its positional arguments and keywords, and the call's tensors that its
    leading parameters (descriptors or tensors) are made from, in order (what a replay rebases)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    sources: tuple[Tensor, ...]

    def parameters(self) -> tuple:
        """Every parameter's value in the kernel's order, constexprs included: the arguments, then the keywords."""
        return (*self.args, *(self.kwargs[name] for name in self.kernel.arg_names[len(self.args):]))


def rank4(t: Tensor) -> Tensor:
    """A rank-3 (B, N, D) tensor as (B, 1, N, D); a rank-4 one as it is."""
    return t if t.dim() == 4 else t.unsqueeze(1)


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    gl = kernels().gl
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], {torch.bfloat16: gl.bfloat16,
                                                                        torch.float16: gl.float16}[dtype])


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


def _bounds(window: Window) -> dict:
    return dict(BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0)


def _query_rows(variant: Variant) -> int:
    """The rows of a forward's query (and output) boxes: the whole tile for "plain", one consumer warpgroup's share
    for the ping-pong kinds, which take two or three warpgroups of a multiple of 64 rows (a wgmma's M)."""
    if variant.kind == "plain":
        return variant.block_m
    if variant.warpgroups not in (2, 3) or variant.block_m % (64 * variant.warpgroups):
        raise ValueError(f"{variant.label()}: warpgroups must be 2 or 3 and block_m a multiple of 64 * warpgroups, "
                         f"got warpgroups={variant.warpgroups}, block_m={variant.block_m}")
    return variant.block_m // variant.warpgroups


def heads_per_section(k4: Tensor, n_bh: int, kv_group: int, window: Window) -> int:
    """The (batch, head) pairs a forward grid of one program per query tile runs at a time (`tiles.program_start`'s
    sections): where the heaviest query tiles start first (a right bound), as many K/V heads as the GPU's L2 holds
    the K and V of, rounded down to a power of two, times the query heads that share each (FlashAttention-3's and
    -4's longest-processing-time-first schedule); one pair without a right bound, whose tiles all weigh the same."""
    if not _bounds(window)["BOUND_RIGHT"]:
        return 1
    kv_bytes = 2 * k4.shape[2] * k4.shape[3] * k4.element_size()
    kv_heads = max(1, device_limits.l2_cache_bytes(k4.device, stand_in=50 << 20) // kv_bytes)
    return min(n_bh, (1 << (kv_heads.bit_length() - 1)) * kv_group)


def _forward_parts(variant: Variant, t: ForwardTensors, window: Window, scale: float) -> LaunchParts:
    """The forward kernels' launch ("plain", "pingpong", "persistent")."""
    q4, k4, v4, o4 = (rank4(x) for x in (t.q, t.k, t.v, t.o))
    batch, n_heads, n_q, d = q4.shape
    kv_group = n_heads // k4.shape[1]
    q_rows = _query_rows(variant)
    n_programs = triton.cdiv(n_q, variant.block_m) * batch * n_heads
    leading = (_descriptor(q4, q_rows), _descriptor(k4, variant.block_n), _descriptor(v4, variant.block_n),
               _descriptor(o4, q_rows), t.lse, batch * n_heads, n_heads, kv_group)
    sizes = (n_q, k4.shape[2], window[0], window[1], scale * LOG2E)
    # The kernels of one program per query tile take the grid's sections after kv_group; the persistent one orders
    # its tiles itself.
    args = (*leading, heads_per_section(k4, batch * n_heads, kv_group, window), *sizes)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, **_bounds(window), NBUF=variant.nbuf,
                  num_warps=4)
    sources = tuple(t)
    if variant.kind == "plain":
        return LaunchParts(kernels().attention_forward, (n_programs,), args, kwargs, sources)
    kwargs.update(CONSUMER_REGS=variant.regs, WGS=variant.warpgroups)
    if variant.kind == "persistent":  # one program per SM, over pairs of query tiles (the kernel's units)
        n_units = (triton.cdiv(n_q, variant.block_m) + 1) // 2 * batch * n_heads
        return LaunchParts(kernels().attention_forward_persistent, (min(n_units, usable_sms(q4)),),
                           (*leading, *sizes), kwargs, sources)
    return LaunchParts(kernels().attention_forward_pingpong, (n_programs,), args, kwargs, sources)


def _dkdv_parts(variant: Variant, t: DkdvTensors, window: Window, scale: float) -> LaunchParts:
    """The dK/dV kernel's launch."""
    q4, k4, v4, do4, dk4, dv4 = (rank4(x) for x in (t.q, t.k, t.v, t.do, t.dk, t.dv))
    batch, n_heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    m, n = variant.block_m, variant.block_n
    args = (_descriptor(q4, m), _descriptor(k4, n), _descriptor(v4, n), _descriptor(do4, m), _descriptor(dk4, n),
            _descriptor(dv4, n), t.lse_delta, batch * kv_heads, n_heads, n_heads // kv_heads, n_q, n_k, window[0],
            window[1], scale * LOG2E, scale)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, **_bounds(window), NBUF=variant.nbuf, num_warps=n // 16)
    return LaunchParts(kernels().attention_backward_dkdv, (triton.cdiv(n_k, n) * batch * kv_heads,), args, kwargs,
                       tuple(t))


def _dq_parts(variant: Variant, t: DqTensors, window: Window, scale: float) -> LaunchParts:
    """The dQ kernel's launch."""
    q4, k4, v4, do4, o4, dq4 = (rank4(x) for x in (t.q, t.k, t.v, t.do, t.o, t.dq))
    batch, n_heads, n_q, d = q4.shape
    kv_heads, n_k = k4.shape[1], k4.shape[2]
    m, n = variant.block_m, variant.block_n
    args = (_descriptor(q4, m), _descriptor(k4, n), _descriptor(v4, n), _descriptor(do4, m), _descriptor(o4, m),
            _descriptor(dq4, m), t.lse, t.lse_delta, batch * n_heads, n_heads, n_heads // kv_heads, n_q, n_k,
            window[0], window[1], scale * LOG2E, scale)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, **_bounds(window), NBUF=variant.nbuf, num_warps=m // 16)
    return LaunchParts(kernels().attention_backward_dq, (triton.cdiv(n_q, m) * batch * n_heads,), args, kwargs,
                       tuple(t))


def semaphore_count(variant: Variant, q4: Tensor) -> int:
    """How many int32 semaphores `variant` of the one pass needs for these queries, zeroed before its launch: one
    per (batch, head, query tile) for "one_pass_det", none for the other."""
    if variant.kind != "one_pass_det":
        return 0
    batch, n_heads, n_q, _ = q4.shape
    return batch * n_heads * triton.cdiv(n_q, variant.block_m)


def rotates(variant: Variant, q4: Tensor, k4: Tensor, window: Window) -> bool:
    """Whether the deterministic one pass starts each program at a different query tile (ROTATE): full masks only,
    with at least as many query tiles as key tiles, and only where one (batch, K/V head)'s programs can all run at
    once (one per SM): the ring of turns waits on programs launched later, which must not be left waiting for an
    SM that a waiting program holds. Elsewhere the programs go in order, which needs none of that."""
    if variant.kind != "one_pass_det" or window != (-1, -1):
        return False
    n_k_tiles = triton.cdiv(k4.shape[2], variant.block_n)
    if triton.cdiv(q4.shape[2], variant.block_m) < n_k_tiles:
        return False
    return n_k_tiles <= usable_sms(q4)


def passes_turns_late(variant: Variant, q4: Tensor, k4: Tensor, window: Window) -> bool:
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


def folds_dq(variant: Variant, q4: Tensor, k4: Tensor, window: Window, dq4: Tensor) -> bool:
    """Whether the deterministic one pass writes dQ itself (FOLD_DQ), so that no epilogue kernel reads the whole
    float32 sum back after it: a program scales and casts the sums at the query tiles where its key tile took the last
    turn, for a pair `fold_lag` back. Where it rotates (full masks) only: the ring spreads the last turns over every
    key tile, `stride` query tiles each, where the other orders give key tile 0 the last turn at every tile it visits
    (a head's whole dQ left to one program, the heaviest under a causal mask), so the epilogue kernel stays there.
    And only into a dense (B, H, Nq, D) dq, which is all the fold indexes; the epilogue takes any strides."""
    return rotates(variant, q4, k4, window) and dq4.is_contiguous()


def fold_lag(variant: Variant, q4: Tensor, k4: Tensor, window: Window, dq4: Tensor) -> int:
    """Where `folds_dq`, how many (batch, K/V head) pairs back a program writes dQ for at its start, while its own K
    and V load (FOLD_DQ), else 0: enough that those pairs' programs launched two waves of the SMs before it, so that
    their sums are whole and its wait for them passes at once. At the end of the program the wait for its own adds
    to complete would lie on its path (and the code after its loop spilled). The grid holds this many pairs' programs
    more, which only fold the last pairs."""
    if not folds_dq(variant, q4, k4, window, dq4):
        return 0
    return triton.cdiv(2 * usable_sms(q4), triton.cdiv(k4.shape[2], variant.block_n))


def paired_heads(variant: Variant, q4: Tensor, k4: Tensor, window: Window) -> int:
    """How many (batch, K/V head) pairs make a group of the one pass's paired order (PAIRED,
    `tiles.paired_key_program`), or 0 where it keeps one head after another: masks with a right bound and no left
    one (causal), whose key tiles' work falls from the first to the last. A group's programs about fill the SMs, one
    per SM: an odd group's heaviest programs then start as the even group's lightest end, and each SM's two take
    about the same time. Either kind: the deterministic one's turns are ordered to match (`tiles.one_pass_turn`'s
    `down`), and every program waits only for programs launched before it."""
    if variant.kind not in ("one_pass", "one_pass_det") or window[1] < 0 or window[0] >= 0:
        return 0
    return max(1, usable_sms(q4) // triton.cdiv(k4.shape[2], variant.block_n))


def usable_sms(t: Tensor) -> int:
    """The SMs this process's kernels can run on at once (`device_limits.usable_sms`: MPS's share counted), 132
    for a CPU tensor (an H100's, for compiling without a GPU)."""
    return device_limits.usable_sms(t.device, stand_in=132)


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
    box's 128-byte swizzle, where in row order rows r and r ^ 1 would take the same banks (a 2-way conflict on every
    store). The kernels' copies: `tiles.dq_sum_row` (`tl`) and `one_pass._sum_row` (Gluon), which permutes a share
    with `_in_sum_order`."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)


def _one_pass_parts(variant: Variant, t: OnePassTensors, window: Window, scale: float) -> LaunchParts:
    """The one-pass kernel's launch ("one_pass", "one_pass_det"). Each consumer warpgroup computes half of dQ: with
    128-row query tiles half its rows (dq_desc's boxes (64, D)), from all of K's tile in shared memory; else half its
    columns (boxes (block_m, D / 2)), from a column half of K's tile, which at D 64 is 64 bytes wide, so K's tile then
    takes a 64-byte swizzle (the default's 128 bytes would cut a swizzle row in two). Kind "one_pass_det" adds in a
    fixed order; where `folds_dq`, it also writes dq from the sum, else dq is not touched (the epilogue kernel
    writes it).

    Raises:
        ValueError: for semaphores, a sum or a dq that the variant cannot use.
    """
    q4, k4, v4, do4, dk4, dv4, dq4 = (rank4(x) for x in (t.q, t.k, t.v, t.do, t.dk, t.dv, t.dq))
    dq_acc, semaphores = t.dq_acc, t.semaphores
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
    lag = fold_lag(variant, q4, k4, window, dq4)
    if lag and (dq4.shape != q4.shape or not dq_acc.is_contiguous()):
        raise ValueError(f"{variant.label()} writes dQ from its sum as dense (B, H, Nq, D) tensors: got dq "
                         f"{tuple(dq4.shape)} strides {dq4.stride()}, the sum strides {dq_acc.stride()}, q "
                         f"{tuple(q4.shape)}")
    gl = kernels().gl
    dq_desc = _descriptor(dq_acc, dq_rows, dq_cols,
                          gl.NVMMASharedLayout.get_default_for([1, 1, dq_rows, dq_cols], gl.float32))
    half_bytes = dq_cols * k4.element_size()
    k_layout = (gl.NVMMASharedLayout(swizzle_byte_width=half_bytes, element_bitwidth=8 * k4.element_size(), rank=4)
                if half_bytes < 128 else None)
    args = (_descriptor(q4, m), _descriptor(k4, n, layout=k_layout), _descriptor(v4, n), _descriptor(do4, m),
            _descriptor(dk4, n // 2), _descriptor(dv4, n // 2), dq_desc, t.lse_delta,
            semaphores, dq_acc, dq4, batch * kv_heads, n_heads, n_heads // kv_heads, n_q, n_k, window[0],
            window[1], scale * LOG2E, scale, max(1, group_heads), lag)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, **_bounds(window), NBUF=variant.nbuf, CONSUMER_REGS=variant.regs,
                  DETERMINISTIC=deterministic, ROTATE=rotates(variant, q4, k4, window),
                  PASS_LATE=passes_turns_late(variant, q4, k4, window), PAIRED=group_heads > 0,
                  NSTAGE=variant.stages, DQ_ALTERNATE=bool(variant.alternate), FOLD_DQ=lag > 0, num_warps=4)
    sources = (t.q, t.k, t.v, t.do, t.dk, t.dv, dq_acc, t.lse_delta, semaphores, dq_acc, t.dq)
    return LaunchParts(kernels().attention_backward_one_pass, (triton.cdiv(n_k, n) * (batch * kv_heads + lag),),
                       args, kwargs, sources)


_PARTS = {"plain": _forward_parts, "pingpong": _forward_parts, "persistent": _forward_parts, "dkdv": _dkdv_parts,
          "dq": _dq_parts, "one_pass": _one_pass_parts, "one_pass_det": _one_pass_parts}
_TENSORS = {"plain": ForwardTensors, "pingpong": ForwardTensors, "persistent": ForwardTensors, "dkdv": DkdvTensors,
            "dq": DqTensors, "one_pass": OnePassTensors, "one_pass_det": OnePassTensors}


def launch_parts(variant: Variant, tensors: NamedTuple, window: Window, scale: float) -> LaunchParts:
    """The launch `variant` would make on these tensors (the structure its kind takes), without launching it: what
    `launch` and `compile_only` run, and what a check of the arguments reads.

    Raises:
        TypeError: for tensors of another kind's structure; ValueError: as `_one_pass_parts`.
    """
    expected = _TENSORS[variant.kind]
    if not isinstance(tensors, expected):
        raise TypeError(f"{variant.label()} takes {expected.__name__}, got {type(tensors).__name__}")
    return _PARTS[variant.kind](variant, tensors, window, scale)


class GluonReplay:
    """A Gluon launch replayed on new tensors of the signature it was made for (a plan's `run`): the compiled kernel
    launched directly, each TMA descriptor a copy of the first call's with the new tensor as its base. Shapes,
    strides, dtype, device and alignment are the plan's key, so nothing else about a descriptor changes.

    Why: the first call's path (checks, descriptors built and validated, Triton's JIT dispatch) costs several times
    a replay's host time; this costs what Triton's launcher does (it encodes each descriptor for the GPU). The native
    launcher calls it (under the GIL) only for descriptors it cannot describe; otherwise it encodes them itself from
    `templates` (`replay.native.cuda_launch_spec`) and launches `compiled` on `grid` without the GIL."""

    __slots__ = ("compiled", "grid", "templates", "rest", "_launch")

    def __init__(self, compiled, grid: tuple[int, ...], params: tuple, n_tensors: int):
        self.compiled = compiled
        self.grid = (*grid, 1, 1)[:3]
        self._launch = compiled[self.grid]
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
        self.templates = tuple(templates)
        self.rest = params[n_tensors:]  # every later parameter, constexprs included, in the kernel's order

    @staticmethod
    def recordable(params: tuple, n_tensors: int) -> bool:
        """Whether this Triton's descriptors can be re-based as `__call__` does (a dataclass with a `base`)."""
        return all(isinstance(p, Tensor) or (dataclasses.is_dataclass(p) and hasattr(p, "base"))
                   for p in params[:n_tensors])

    def __call__(self, *tensors: Tensor, stream=None) -> None:
        args = []
        for t, template in zip(tensors, self.templates):
            if template is None:
                args.append(t)
            else:
                descriptor = copy.copy(template)  # no __post_init__: the template passed its checks
                object.__setattr__(descriptor, "base", rank4(t))
                args.append(descriptor)
        self._launch(*args, *self.rest, stream=stream)


def launch(variant: Variant, tensors: NamedTuple, window: Window, scale: float, record: bool = True
           ) -> Recorded | None:
    """Launch `variant` on a call's tensors (the structure its kind takes: `ForwardTensors` for a forward, ...) and
    return the launch as a plan records it; None without `record` (a timing's launches), or where it cannot be
    replayed (inside a CUDA graph capture, or a Triton whose descriptors cannot be re-based)."""
    parts = launch_parts(variant, tensors, window, scale)
    compiled = parts.kernel[parts.grid](*parts.args, **parts.kwargs)
    if not record:
        return None
    params = parts.parameters()
    n_tensors = len(parts.sources)
    capturing = parts.sources[0].is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or not GluonReplay.recordable(params, n_tensors):
        return None
    return Recorded(GluonReplay(compiled, parts.grid, params, n_tensors), parts.sources, ())


def compile_only(variant: Variant, q: Tensor, k: Tensor, v: Tensor, window: Window, scale: float):
    """Compile `variant` for these inputs' shapes without launching it (Triton's `warmup`; on a CPU machine under a
    stand-in driver that names sm_90, as the CPU tests do). Returns the compiled kernel."""
    parts = parts_for_compile(variant, q, k, v, window, scale)
    return parts.kernel.warmup(*parts.args, **parts.kwargs, grid=(1,))


def parts_for_compile(variant: Variant, q: Tensor, k: Tensor, v: Tensor, window: Window, scale: float
                      ) -> LaunchParts:
    """The launch `variant` would make for these inputs, its outputs and scratch allocated as a call would (their
    values unset): what `compile_only` compiles."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
    if variant.kind == "dkdv":
        tensors = DkdvTensors(q, k, v, q, torch.empty_like(k), torch.empty_like(v), lse_delta)
    elif variant.kind.startswith("one_pass"):
        dq_acc = torch.empty(dq_sum_shape(rank4(q)), dtype=torch.float32, device=q.device)
        semaphores = torch.empty(semaphore_count(variant, rank4(q)), dtype=torch.int32, device=q.device)
        dq = empty_output(q)  # as the backward allocates it
        tensors = OnePassTensors(q, k, v, q, torch.empty_like(k), torch.empty_like(v), dq_acc, lse_delta, semaphores,
                                 dq)
    elif variant.kind == "dq":
        tensors = DqTensors(q, k, v, q, o, torch.empty_like(q), lse, lse_delta)
    else:
        tensors = ForwardTensors(q, k, v, o, lse)
    return launch_parts(variant, tensors, window, scale)
