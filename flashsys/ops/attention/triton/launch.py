"""Launching the `tl` kernels: arguments built by name, the call's geometry, the autotuner's choice, and the cheap
paths that repeated launches take.

A kernel's runtime arguments are built from named tensors and scalars (`positional`): every stride is derived from
its tensor, so none can land in another's slot. Eager launches go through Triton's autotuner on a key's first call,
then launch the JIT kernel with the chosen config, then (for the same signature) the compiled kernel directly:
Triton's `Autotuner.run` and `JITFunction.run` rebind and specialise every argument on each call, which costs more
host time than a short kernel runs. Traced launches (inside a `torch.library.triton_op`) go through `wrap_triton`,
so that Inductor emits the launch itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.compiler import CompiledKernel

from ..replay.plans import Recorded
from .configs import LONG_SEQ, handle_for

Window = tuple[int, int]


def strides4(t: Tensor) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides; a rank-3 tensor is one head per batch entry."""
    return t.stride() if t.dim() == 4 else (t.stride(0), 0, t.stride(1), t.stride(2))


class ArgumentPlan(NamedTuple):
    """How to build a kernel's runtime arguments from the tensors and scalars a launcher names."""

    slots: tuple[tuple[str, int | None], ...]  # per argument: (name, None) or (tensor name, stride axis)
    named: frozenset[str]  # the names a launcher must pass
    strided: tuple[str, ...]  # the tensors whose strides are arguments
    constexprs: tuple[str, ...]  # the compile-time parameters, in signature order (they come last)
    tensors: tuple[str, ...]  # the pointer arguments: the leading ones, named in capitals (Q, LseDelta, CU_Q)


@functools.cache
def argument_plan(kernel) -> ArgumentPlan:
    """The plan of `kernel`'s runtime arguments, in signature order: a `stride_<tensor><b|h|n|d>` argument is
    derived from that tensor, every other one is passed by name. Constexprs and N_BUCKET (appended by the
    launcher) are left out. `.fn` is the Python function under both a JITFunction and the interpreter's
    InterpretedFunction."""
    slots, constexprs = [], []
    for p in inspect.signature(kernel.fn).parameters.values():
        if "constexpr" in str(p.annotation):
            constexprs.append(p.name)
            continue
        if constexprs:  # the fast launch appends the constexprs after the runtime arguments
            raise TypeError(f"{kernel.fn.__name__}: runtime argument {p.name} follows a constexpr")
        if p.name == "N_BUCKET":
            continue
        if p.name.startswith("stride_"):
            slots.append((p.name[len("stride_"):-1].upper(), "bhnd".index(p.name[-1])))
        else:
            slots.append((p.name, None))
    named = frozenset(name for name, axis in slots if axis is None)
    strided = tuple(dict.fromkeys(name for name, axis in slots if axis is not None))
    n_pointers = next((i for i, (name, axis) in enumerate(slots) if axis is not None or not name[0].isupper()),
                      len(slots))
    tensors = tuple(name for name, _ in slots[:n_pointers])
    return ArgumentPlan(tuple(slots), named, strided, tuple(constexprs), tensors)


def positional(kernel, named: dict) -> tuple:
    """The runtime arguments of `kernel` in its signature's order: tensors and scalars taken from `named` by name,
    every stride derived from its tensor. Nothing is placed by position at a call site, so no stride can land
    in another's slot; the result is passed positionally, the cheapest way through Triton's launcher."""
    plan = argument_plan(kernel)
    if named.keys() != plan.named:  # a launcher out of step with its kernel: fail here, not with wrong numbers
        raise TypeError(f"{kernel.fn.__name__}: launch arguments missing {sorted(plan.named - named.keys())}, "
                        f"unexpected {sorted(named.keys() - plan.named)}")
    strides = {name: strides4(named[name]) for name in plan.strided}
    return tuple([named[name] if axis is None else strides[name][axis] for name, axis in plan.slots])


class Geometry(NamedTuple):
    """What the launchers derive from q and k: grid sizes, the padded head dim and the autotune keys."""

    n_heads: int  # query heads
    n_bh: int  # batch * query heads: the query-tile grids
    kv_group: int  # query heads per K/V head (grouped-query attention; 1 otherwise)
    n_bh_kv: int  # batch * K/V heads: the key-tile grid
    n_q: int
    n_k: int
    d: int
    block_d: int  # head dim padded to a power of two (at least 16)
    head_dim_class: int  # 64 (for d <= 64), 128 or 256: which tile table, and so which autotuned handle
    fp32: bool  # fp32 inputs: exact-fp32 dots and their own small tiles
    varlen: bool  # packed sequences: n_q, n_k are the packed totals, grid_q, grid_k the longest sequences
    grid_q: int  # query rows a query-tile grid covers (n_q, or the longest packed sequence)
    grid_k: int  # key rows the key-tile grid covers
    long_seq: bool  # max(Nq, Nk) rounds up to LONG_SEQ or more: the long-sequence tiles
    bucket: int | None  # sequence-length bucket of the autotune key; None for symbolic (torch.compile) lengths
    dtype: torch.dtype


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def make_geometry(batch, n_heads, kv_heads, n_q, n_k, d, dtype: torch.dtype, varlen: bool = False,
                  grid_q=None, grid_k=None) -> Geometry:
    """Under torch.compile with dynamic shapes the lengths are SymInts: they stay symbolic (the comparisons become
    guards), and only the head dim, a constexpr, is made concrete."""
    grid_q = n_q if grid_q is None else grid_q
    grid_k = n_k if grid_k is None else grid_k
    d = int(d)
    block_d = max(16, _next_power_of_2(d))
    half = LONG_SEQ // 2  # next_power_of_2(n) >= LONG_SEQ exactly when n > LONG_SEQ / 2
    long_seq = bool(grid_q > half or grid_k > half)
    concrete = type(grid_q) is int and type(grid_k) is int
    bucket = min(_next_power_of_2(max(grid_q, grid_k)), 1 << 16) if concrete else None
    kv_group = n_heads // kv_heads if kv_heads else 1  # no heads at all: an empty output, as SDPA's
    return Geometry(n_heads=n_heads, n_bh=batch * n_heads, kv_group=kv_group, n_bh_kv=batch * kv_heads,
                    n_q=n_q, n_k=n_k, d=d, block_d=block_d, head_dim_class=64 if block_d <= 64 else block_d,
                    fp32=dtype == torch.float32, varlen=varlen, grid_q=grid_q, grid_k=grid_k, long_seq=long_seq,
                    bucket=bucket, dtype=dtype)


def geometry_of(q_shape, k_shape, dtype: torch.dtype) -> Geometry:
    """The geometry of dense (B, N, D) or (B, H, N, D) q, k shapes."""
    rank4 = len(q_shape) == 4
    return make_geometry(q_shape[0], q_shape[1] if rank4 else 1, k_shape[1] if rank4 else 1, q_shape[-2],
                         k_shape[-2], q_shape[-1], dtype)


# Eager calls look the geometry up by shape: computing it costs more host time than a short kernel's launch.
cached_geometry = functools.lru_cache(maxsize=4096)(geometry_of)


class LaunchKey(NamedTuple):
    """Everything the autotuner's own key depends on (Triton adds the dtype to N_BUCKET, HEAD_DIM and the bounds)."""

    kernel: str  # "fwd", "dq" or "dkdv"
    head_dim_class: int
    fp32: bool
    bucket: int
    head_dim: int
    bound_right: bool  # causal, or a right window bound
    bound_left: bool  # a left window bound (sliding window)
    varlen: bool
    dtype: torch.dtype


# After the autotuner has chosen a config for a key, later calls launch the JIT kernel with it directly. This reads
# two attributes of Triton's Autotuner that are not documented API: `.fn` (the JITFunction it wraps) and
# `.best_config` (set by its run); a Triton that renames them fails on the first launch, loudly.
_chosen_configs: dict[LaunchKey, dict] = {}


def chosen_configs() -> dict[LaunchKey, dict]:
    """{LaunchKey: launch config (BLOCK_M, BLOCK_N, num_warps, num_stages)} chosen so far."""
    return dict(_chosen_configs)


def forget_configs() -> None:
    """Forget the autotuner's choices and the compiled launches cached after them: each key is tuned again on its
    next eager call. Plans replay the old launches until `replay.clear()`."""
    _chosen_configs.clear()
    _fast_launches.clear()


def fast_launch_count() -> int:
    """How many compiled launches repeated eager calls currently reach directly (past Triton's JITFunction.run)."""
    return len(_fast_launches)


class Prepared(NamedTuple):
    """One launch, prepared: the autotuned handle, its runtime arguments (N_BUCKET last), constexprs, key."""

    handle: object
    args: tuple
    constexprs: dict
    key: LaunchKey | None  # None for symbolic lengths (no bucket)


def prepare(kernel: str, g: Geometry, window: Window, named: dict) -> Prepared:
    """The launch of `kernel` ("fwd", "dq" or "dkdv") for this geometry and window, with `named`'s arguments."""
    handle = handle_for(kernel, g.head_dim_class, g.fp32, g.long_seq)
    # N_BUCKET is only the autotuner's key; a symbolic length stands in for it under dynamic shapes.
    args = (*positional(handle.fn, named), g.bucket if g.bucket is not None else g.grid_q)
    bound_left, bound_right = window[0] >= 0, window[1] >= 0
    constexprs = dict(HEAD_DIM=g.d, BLOCK_D=g.block_d, BOUND_RIGHT=bound_right, BOUND_LEFT=bound_left,
                      VARLEN=g.varlen, FP32_IEEE=g.fp32)
    key = None if g.bucket is None else LaunchKey(kernel, g.head_dim_class, g.fp32, g.bucket, g.d, bound_right,
                                                  bound_left, g.varlen, g.dtype)
    return Prepared(handle, args, constexprs, key)


# Compiled kernels by their exact launch signature, so that repeated calls skip Triton's JITFunction.run. Triton
# specialises a kernel on its constexprs, its tensors' dtypes and 16-byte alignment, and its integers' values (== 1,
# divisible by 16, 32 or 64 bits): the signature below holds all of those, so a hit is the kernel JITFunction.run
# would pick. `CompiledKernel[grid](*args)` is Triton's own launch of a compiled kernel (all parameters in signature
# order, constexprs included).
_fast_launches: dict[tuple, tuple] = {}
_FAST_LAUNCHES_MAX = 4096


def _launch_signature(prepared: Prepared, device_index: int, grid_xyz: tuple[int, int, int]) -> tuple:
    # The grid is part of it: the arguments do not fix it (the batch size, or a varlen batch's longest sequence,
    # is no kernel argument), and a cached launch replays its grid.
    return (prepared.key, device_index, grid_xyz,
            *[a.data_ptr() % 16 == 0 if isinstance(a, Tensor) else a for a in prepared.args])


def _launch_eager(prepared: Prepared, grid, device: torch.device) -> Recorded | None:
    """Launch a prepared kernel on real tensors: through Triton's autotuner on the first call of a key, then the JIT
    kernel with the chosen config, then (same signature) the compiled kernel directly. Returns the launch as a plan
    records it, or None where the autotuner ran it."""
    handle, args, constexprs, key = prepared
    meta = _chosen_configs.get(key)
    if meta is None:
        handle[grid](*args, **constexprs)
        best = handle.best_config
        _chosen_configs[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
        return None
    grid_xyz = (*grid(meta), 1, 1)[:3]  # a compiled kernel's launcher takes all three grid dims
    signature = _launch_signature(prepared, device.index, grid_xyz) if device.type == "cuda" else None
    fast = _fast_launches.get(signature)
    if fast is not None:
        fast[0](*args, *fast[1])
    else:
        compiled = handle.fn[grid_xyz](*args, **constexprs, **meta)
        fast = _fast_launch(handle.fn, compiled, grid_xyz, args, {**constexprs, **meta})
        if fast is None:
            return None
        if signature is not None:
            if len(_fast_launches) >= _FAST_LAUNCHES_MAX:
                _fast_launches.clear()
            _fast_launches[signature] = fast
    return _recorded(handle.fn, fast, args, grid_xyz)


def _recorded(fn, fast: tuple, args: tuple, grid_xyz: tuple[int, int, int]) -> Recorded:
    n_tensors = len(argument_plan(fn).tensors)
    return Recorded(fast[0], args[:n_tensors], (*args[n_tensors:], *fast[1]), fast[2], grid_xyz)


def _fast_launch(fn, compiled, grid_xyz: tuple[int, int, int], args: tuple, constexprs: dict) -> tuple | None:
    """(launcher of `compiled` for the grid, the constexpr values in signature order, the compiled kernel or None),
    or None. On a GPU the launcher is Triton's own launch of a compiled kernel; under the interpreter (CPU
    tensors), which compiles nothing, it interprets the kernel again."""
    n_tensors = len(argument_plan(fn).tensors)
    if not all(isinstance(a, Tensor) for a in args[:n_tensors]) or any(isinstance(a, Tensor) for a in args[n_tensors:]):
        raise TypeError(f"{fn.fn.__name__}: its pointer arguments must come first, before the strides")
    trailing = tuple(constexprs[name] for name in argument_plan(fn).constexprs)
    if isinstance(compiled, CompiledKernel):
        return compiled[grid_xyz], trailing, compiled
    if args[0].device.type == "cpu":
        return functools.partial(_interpreted_launch, fn, grid_xyz), trailing, None
    return None


def _interpreted_launch(fn, grid_xyz: tuple[int, int, int], *args, stream=None) -> None:
    fn[grid_xyz](*args)


def _launch_traced(prepared: Prepared, grid) -> None:
    """Launch inside a torch.library.triton_op: under torch.compile, Inductor sees the kernel through `wrap_triton`
    and emits the launch itself (no Python at run time; CUDA graphs capture it).

    Where eager calls have already chosen a config for this key, the compiled graph uses that config, so compiled
    and eager results are equal bit for bit; otherwise Inductor autotunes over the same candidates."""
    handle, args, constexprs, key = prepared
    meta = _chosen_configs.get(key) if key is not None else None
    if meta is None:
        wrap_triton(handle)[grid](*args, **constexprs)
    else:
        wrap_triton(handle.fn)[grid(meta)](*args, **constexprs, **meta)


class RecordedLaunch(NamedTuple):
    """A launch `recording()` prepared instead of running: the kernel's name, its Prepared launch, and its grid
    (for a config's meta-parameters, the grid that launch would take)."""

    kernel: str
    prepared: Prepared
    grid: Callable[[dict], tuple]


# Set inside `recording()`: launches are prepared and appended here instead of run.
_recording: list[RecordedLaunch] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[RecordedLaunch]]:
    """Inside, `run` and `run_fixed` prepare each launch and record it (`RecordedLaunch`) instead of launching it:
    for tools that compile, analyse or time the kernels a call would launch without running the call (the CPU
    compile checks, Inductor's mutation analysis, scripts/tl_tiles.py). Launches run inside are neither timed nor
    recorded as plans."""
    global _recording
    before, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = before


def run(kernel: str, g: Geometry, window: Window, grid: Callable[[dict], tuple], named: dict, traced: bool
        ) -> Recorded | None:
    """Launch `kernel` ("fwd", "dq" or "dkdv") with `named`'s arguments over `grid`: traced (inside a triton_op)
    or eager. Returns an eager launch as a plan records it, or None where it cannot be replayed."""
    prepared = prepare(kernel, g, window, named)
    if _recording is not None:
        _recording.append(RecordedLaunch(kernel, prepared, grid))
        return None
    if traced:
        _launch_traced(prepared, grid)
        return None
    return _launch_eager(prepared, grid, named["Q"].device)


def run_fixed(kernel, grid_xyz: tuple[int, int, int], named: dict, constexprs: dict) -> Recorded | None:
    """Launch a kernel with fixed constexprs and no autotuning (the one pass's prologue and epilogue, the decode
    kernels) and return the launch as a plan records it, or None where it cannot be replayed (inside a CUDA graph
    capture, or inside `recording()`, which records it instead)."""
    args = positional(kernel, named)
    if _recording is not None:
        _recording.append(RecordedLaunch(kernel.fn.__name__, Prepared(kernel, args, constexprs, None),
                                         lambda meta: grid_xyz))
        return None
    compiled = kernel[grid_xyz](*args, **constexprs)
    if args[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    fast = _fast_launch(kernel, compiled, grid_xyz, args, constexprs)
    return None if fast is None else _recorded(kernel, fast, args, grid_xyz)


def sizes(g: Geometry, window: Window) -> dict:
    """The size and window arguments every kernel takes."""
    return dict(n_heads=g.n_heads, kv_group=g.kv_group, n_q=g.n_q, n_k=g.n_k, window_left=window[0],
                window_right=window[1])


def tile_grid(n: int, block: str, n_bh: int) -> Callable[[dict], tuple[int]]:
    """The 1-D grid of a kernel with one program per `block`-sized tile of n rows, per (batch, head); the kernel
    takes n_bh to split its index (`tiles.program_start`)."""
    return lambda meta: (triton.cdiv(n, meta[block]) * n_bh,)
