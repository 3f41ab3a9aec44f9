"""The host side of one Triton attention call: which kernels a forward or a backward launches, in what order, and
the plan that replays them.

- Forward: the Gluon forward where `dispatch` gives it the call (Hopper, large calls), else the `tl` forward.
- Backward: where `dispatch` gives it the Gluon path, the one pass or the two passes (a timed choice); the two
  passes run the dQ kernel first (it writes the (-L * log2 e, D) pairs), then dK/dV, each stage the Gluon kernel or
  the `tl` one as timed. Elsewhere the two `tl` passes.
- Varlen: the `tl` kernels over packed sequences (one grid over every sequence's tiles).

Eager calls return what ran as `replay.plans` records it, so that the next call of the same signature replays it;
traced calls (`traced=True`, inside a `torch.library.triton_op`) launch the `tl` kernels through `wrap_triton`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from . import dispatch, timed_choice
from .determinism import deterministic_backward
from .gluon import launch as gluon_launch
from .gluon.launch import DkdvTensors, DqTensors, ForwardTensors, OnePassTensors, Variant, rank4
from .layout import empty_output
from .replay import plans
from .replay.plans import Recorded
from .triton import decode, launch
from .triton.kernels import one_pass_epilogue_kernel, one_pass_prologue_kernel
from .triton.launch import Geometry
from .triton.tiles import LOG2E

Window = tuple[int, int]


class BackwardTensors(NamedTuple):
    """A backward's tensors: the forward's q, k, v, O, L, the dense dO, the gradients it writes (shaped like q, k, v,
    laid out by `layout.empty_output`), and the (-L * log2 e, D) pairs ((*q.shape[:-1], 2) float32) its dQ kernel or prologue writes."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    lse: Tensor
    do: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    lse_delta: Tensor


class Offsets(NamedTuple):
    """The varlen offsets the kernels take (`cu_seqlens_q`, `cu_seqlens_k`); for a dense batch any tensors (q, k),
    which its kernels never read."""

    q: Tensor
    k: Tensor


class BackwardLaunches(NamedTuple):
    """A backward's launches as a plan records them, and the scratch tensors they use beyond the call's gradients
    and (L, D) pairs (the one pass's dQ sum and semaphores), which a replay allocates anew."""

    recorded: list[Recorded | None]
    scratch: tuple[Tensor, ...] = ()


def choose_variant(key: dispatch.ChoiceKey, run: Callable[[Variant], object]) -> Variant | None:
    """`key`'s variant: the one chosen before (`dispatch.chosen`), or the fastest of its candidates timed now on this
    call's tensors (`run(variant)` launches one) and remembered. None where none runs on this GPU: the Gluon path is
    then off for the process, with a RuntimeWarning naming each candidate's error."""
    variant = dispatch.chosen(key)
    if variant is not None:
        return variant
    best, errors = timed_choice.fastest(key.candidates(), run, dispatch.CHOICE_ROUNDS, dispatch.CHOICE_REP_MS)
    if best is None:
        dispatch.disable("no variant ran: " + "; ".join(f"{v.label()}: {type(e).__name__}: {e}"
                                                          for v, e in errors.items()))
        return None
    return dispatch.remember(key, best)


# ----------------------------------------------------------------------------------------------------- forward


def forward_arguments(g: Geometry, t: ForwardTensors, cu: Offsets, window: Window, scale: float) -> dict:
    """The `tl` forward kernel's runtime arguments by name (strides excepted)."""
    return dict(Q=t.q, K=t.k, V=t.v, O=t.o, L=t.lse, CU_Q=cu.q, CU_K=cu.k, n_bh=g.n_bh, **launch.sizes(g, window),
                qk_scale=scale * LOG2E)


def _tl_forward(g: Geometry, t: ForwardTensors, cu: Offsets, window: Window, scale: float, traced: bool
                ) -> list[Recorded | None]:
    return [launch.run("fwd", g, window, launch.tile_grid(g.grid_q, "BLOCK_M", g.n_bh),
                       forward_arguments(g, t, cu, window, scale), traced)]


def forward(q: Tensor, k: Tensor, v: Tensor, window: Window, scale: float, traced: bool = False,
            key_start: Tensor | None = None, key_mask: Tensor | None = None
            ) -> tuple[Tensor, Tensor, plans.ForwardPlan | None]:
    """(O like q, L float32 of shape q.shape[:-1], the plan that replays this call or None): the forward of rank-3/4
    q, k, v (k, v may have fewer heads: grouped-query). `window` is (left, right), -1 unbounded (causal: (-1, 0)).
    With `traced` (inside a triton_op) the `tl` kernel is launched through wrap_triton and no plan is made; eager
    calls make one once compiled kernels ran (None while the autotuner runs). `key_start` (int32, one per batch row:
    `flash_attention_decode`'s cache starts) and `key_mask` (uint8 (batch, Nk): its key mask) send the call to the
    decode kernels and are the plan's inputs after O and L, in that order."""
    o = empty_output(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    t = ForwardTensors(q, k, v, o, lse)
    inputs = tuple(x for x in (key_start, key_mask) if x is not None)
    recorded, scratch = None, ()
    if inputs or dispatch.takes_decode(q, k):
        recorded, scratch = decode.forward(q, k, v, o, lse, window, scale, traced, key_start, key_mask)
    elif not traced and dispatch.takes_forward(q, k, v, window):
        key = dispatch.ChoiceKey.of(q, k, window, "forward")
        variant = choose_variant(key, lambda var: gluon_launch.launch(var, t, window, scale, record=False))
        if variant is not None:
            recorded = [gluon_launch.launch(variant, t, window, scale)]
    if recorded is None:
        g = launch.geometry_of(q.shape, k.shape, q.dtype) if traced else launch.cached_geometry(q.shape, k.shape,
                                                                                                q.dtype)
        recorded = _tl_forward(g, t, Offsets(q, k), window, scale, traced)
    replays = None if traced else plans.replays(recorded, (*t, *inputs, *scratch))
    plan = None if replays is None else plans.ForwardPlan(window, scale, tuple(lse.shape), replays,
                                                          tuple((tuple(s.shape), s.dtype) for s in scratch))
    return o, lse, plan


# ---------------------------------------------------------------------------------------------------- backward


def dense_do(do: Tensor, dtype: torch.dtype) -> Tensor:
    """dO as the backward kernels read it: in the inputs' dtype, its last dim dense. `o.sum().backward()` hands over a
    stride-0 dO; the kernels read it correctly, but with scalar instead of vector loads, and one dense copy costs far
    less than that."""
    if do.dtype != dtype:
        do = do.to(dtype)
    if do.stride(-1) != 1:
        do = do.contiguous()
    return do


def backward_tensors(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor) -> BackwardTensors:
    """A backward's tensors with its outputs allocated (dO must be dense already: `dense_do`)."""
    dq, dk, dv = (empty_output(x) for x in (q, k, v))
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
    return BackwardTensors(q, k, v, o, lse, do, dq, dk, dv, lse_delta)


def backward_arguments(g: Geometry, t: BackwardTensors, cu: Offsets, window: Window, scale: float
                        ) -> tuple[dict, dict]:
    """The `tl` dQ kernel's and dK/dV kernel's runtime arguments by name (strides excepted)."""
    shared = dict(Q=t.q, K=t.k, V=t.v, DO=t.do, LseDelta=t.lse_delta, CU_Q=cu.q, CU_K=cu.k, **launch.sizes(g, window),
                  qk_scale=scale * LOG2E, softmax_scale=scale)
    return dict(shared, L=t.lse, DQ=t.dq, O=t.o, n_bh=g.n_bh), dict(shared, DK=t.dk, DV=t.dv, n_bh=g.n_bh_kv)


def two_pass_backward(g: Geometry, t: BackwardTensors, cu: Offsets, window: Window, scale: float, traced: bool,
                      gluon: bool = False) -> BackwardLaunches:
    """The dQ pass (it writes the (-L * log2 e, D) pairs), then the dK/dV pass: with `gluon` (`dispatch.takes_backward`
    held) each stage runs the variant its choice took, a Gluon kernel or the `tl` one, else the `tl` kernels."""
    dq_named, dkdv_named = backward_arguments(g, t, cu, window, scale)

    def tl_dq() -> Recorded | None:
        return launch.run("dq", g, window, launch.tile_grid(g.grid_q, "BLOCK_M", g.n_bh), dq_named, traced)

    dq_launch = None
    dq_key = dispatch.ChoiceKey.of(t.q, t.k, window, "dq")
    if gluon and dq_key.candidates():
        tensors = DqTensors(t.q, t.k, t.v, t.do, t.o, t.dq, t.lse, t.lse_delta)

        def run_dq(var: Variant):
            return tl_dq() if var.kind == "tl" else gluon_launch.launch(var, tensors, window, scale, record=False)

        variant = choose_variant(dq_key, run_dq)
        if variant is not None and variant.kind != "tl":
            dq_launch = [gluon_launch.launch(variant, tensors, window, scale)]
    dq_launch = dq_launch or [tl_dq()]
    dkdv_key = dispatch.ChoiceKey.of(t.q, t.k, window, "dkdv")
    if gluon and dkdv_key.candidates():
        tensors = DkdvTensors(t.q, t.k, t.v, t.do, t.dk, t.dv, t.lse_delta)
        variant = choose_variant(dkdv_key, lambda var: gluon_launch.launch(var, tensors, window, scale, record=False))
        if variant is not None:
            return BackwardLaunches([*dq_launch, gluon_launch.launch(variant, tensors, window, scale)])
    # One dK/dV program per key tile and K/V head: it sums the query heads of its group itself.
    dkdv_launch = launch.run("dkdv", g, window, launch.tile_grid(g.grid_k, "BLOCK_N", g.n_bh_kv), dkdv_named, traced)
    return BackwardLaunches([*dq_launch, dkdv_launch])


def one_pass_backward(variant: Variant, t: BackwardTensors, window: Window, scale: float) -> BackwardLaunches:
    """The one-pass backward `variant` on rank-3/4 tensors: the prologue kernel writes the (L, D) pairs and zeroes the
    semaphores and dQ's float32 sum (rows in `gluon.launch.dq_sum_row`'s order, padded to `dq_sum_rows`; the
    deterministic kind: only the rows that see no key, as its first share at each tile is stored), the Gluon kernel
    adds into the sum, the epilogue scales and casts it into dq (or, where `gluon.launch.folds_dq`, the kernel
    itself: no epilogue). Rank-3 tensors go to the `tl` kernels as they are (`launch.strides4`)."""
    q4 = rank4(t.q)
    batch, n_heads, n_q, d = q4.shape
    dq_acc = torch.empty(gluon_launch.dq_sum_shape(q4), dtype=torch.float32, device=t.q.device)
    n_sum = dq_acc.shape[2]
    n_tiles = triton.cdiv(n_q, variant.block_m)  # one prologue program per query tile: it zeroes its semaphore
    semaphores = torch.empty(batch * n_heads * n_tiles, dtype=torch.int32, device=t.q.device)
    block_d = triton.next_power_of_2(d)
    prologue = launch.run_fixed(one_pass_prologue_kernel, (n_tiles, batch * n_heads, 1),
                                dict(O=t.o, DO=t.do, L=t.lse, LseDelta=t.lse_delta, DqAcc=dq_acc, Sem=semaphores,
                                     n_heads=n_heads, n_q=n_q, n_sum=n_sum),
                                dict(HEAD_DIM=d, BLOCK_D=block_d, ROWS=variant.block_m,
                                     ZERO_ALL=variant.kind != "one_pass_det"))
    tensors = OnePassTensors(t.q, t.k, t.v, t.do, t.dk, t.dv, dq_acc, t.lse_delta, semaphores, t.dq)
    kernel = gluon_launch.launch(variant, tensors, window, scale)
    if gluon_launch.fold_lag(variant, q4, rank4(t.k), window, rank4(t.dq)):
        return BackwardLaunches([prologue, kernel], (dq_acc, semaphores))
    n_rows = batch * n_heads * n_q
    epilogue = launch.run_fixed(one_pass_epilogue_kernel, (triton.cdiv(n_rows, 64), 1, 1),
                                dict(DqAcc=dq_acc, DQ=t.dq, n_rows=n_rows, n_heads=n_heads, n_q=n_q, n_sum=n_sum,
                                     softmax_scale=scale),
                                dict(HEAD_DIM=d, BLOCK_D=block_d, ROWS=64))
    return BackwardLaunches([prologue, kernel, epilogue], (dq_acc, semaphores))


def backward_launches(g: Geometry, t: BackwardTensors, window: Window, scale: float, gluon: bool
                      ) -> BackwardLaunches:
    """A dense backward's launches: with `gluon`, the one pass where its choice (timed against the two passes) takes
    it, else the two passes. Whichever one pass the plan records depends on `deterministic_backward()`: no plan of
    the unordered one pass replays where determinism is asked for (changing flashsys's switch drops every plan, and
    the plans key on torch's)."""
    cu = Offsets(t.q, t.k)
    if gluon:
        key = dispatch.one_pass_key(t.q, t.k, window, deterministic_backward())
        if key.candidates():
            def run(var: Variant) -> BackwardLaunches:
                if var.kind == "tl":
                    return two_pass_backward(g, t, cu, window, scale, False, gluon)
                return one_pass_backward(var, t, window, scale)

            variant = choose_variant(key, run)
            if variant is not None and variant.kind != "tl":
                return one_pass_backward(variant, t, window, scale)
    return two_pass_backward(g, t, cu, window, scale, traced=False, gluon=gluon)


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: Window, scale: float,
             traced: bool = False) -> tuple[Tensor, Tensor, Tensor, plans.BackwardPlan | None]:
    """(dQ, dK, dV, the plan that replays this call or None) for a dense dO (`dense_do`). Eager calls take the Gluon
    backward where `dispatch.takes_backward` holds; traced calls the `tl` kernels through wrap_triton."""
    t = backward_tensors(q, k, v, o, lse, do)
    if traced:
        two_pass_backward(launch.geometry_of(q.shape, k.shape, q.dtype), t, Offsets(q, k), window, scale, True)
        return t.dq, t.dk, t.dv, None
    gluon = dispatch.takes_backward(q, k, v, o, do, window)
    recorded, scratch = backward_launches(launch.cached_geometry(q.shape, k.shape, q.dtype), t, window, scale, gluon)
    replays = plans.replays(recorded, (*t, *scratch))
    plan = None if replays is None else plans.BackwardPlan(
        tuple(t.lse_delta.shape), replays, tuple((tuple(x.shape), x.dtype) for x in scratch))
    return t.dq, t.dk, t.dv, plan


# ------------------------------------------------------------------------------------------------------ varlen


def _packed_view(t: Tensor, n_seqs: int) -> Tensor:
    """A packed (total, H, D) tensor as the kernels' (sequences, H, total, D), batch stride 0: each sequence's
    program finds its rows through cu_seqlens, so every 'batch entry' is the same packed tensor."""
    return t.transpose(0, 1).unsqueeze(0).expand(n_seqs, -1, -1, -1)


def _varlen_geometry(q: Tensor, k: Tensor, cu_q: Tensor, max_q: int, max_k: int) -> Geometry:
    return launch.make_geometry(cu_q.numel() - 1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[-1],
                                q.dtype, varlen=True, grid_q=max_q, grid_k=max_k)


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu: Offsets, max_lengths: tuple[int, int], window: Window,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Packed sequences: q (total_q, Hq, D), k, v (total_k, Hkv, D), `max_lengths` the longest query and key
    sequences. Returns (O like q, L float32 (Hq, total_q))."""
    g = _varlen_geometry(q, k, cu.q, *max_lengths)
    n = cu.q.numel() - 1
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    t = ForwardTensors(*(_packed_view(x, n) for x in (q, k, v, o)), lse)
    _tl_forward(g, t, cu, window, scale, traced=False)
    return o, lse


def varlen_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, cu: Offsets,
                    max_lengths: tuple[int, int], window: Window, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The packed twin of `backward`; lse is (Hq, total_q) as `varlen_forward` wrote it."""
    g = _varlen_geometry(q, k, cu.q, *max_lengths)
    n = cu.q.numel() - 1
    do = dense_do(do, q.dtype)
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    lse_delta = torch.empty((q.shape[1], q.shape[0], 2), dtype=torch.float32, device=q.device)
    views = [_packed_view(x, n) for x in (q, k, v, o)]
    t = BackwardTensors(*views, lse, _packed_view(do, n), *(_packed_view(x, n) for x in (dq, dk, dv)), lse_delta)
    two_pass_backward(g, t, cu, window, scale, traced=False)
    return dq, dk, dv
