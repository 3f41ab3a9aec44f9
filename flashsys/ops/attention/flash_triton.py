"""FlashAttention-2 with Triton kernels as `torch.autograd.Function`s: `FlashAttention2Triton` over dense batches and
`FlashAttentionVarlenTriton` over packed variable-length sequences, the Triton twins of `flash_torch`'s Functions.

An eager call of a signature seen before replays its plan (`replay.plans`), or runs from C++ altogether once the
native launcher is built (`replay.native`); a first call takes the full path (validation, `dispatch`'s choices,
autotuning) through `launcher`. Traced calls (torch.compile) run `library_ops`' ops. Which kernels run is
`dispatch`'s decision; the kernels are in `triton/` (`tl`) and `gluon/` (Hopper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import calls, launcher, library_ops
from .replay import native, plans
from .validation import (
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_varlen_inputs,
    normalize_window,
    refuse_double_backward,
)


class _FlashAttention2TritonFunction(torch.autograd.Function):
    """The Python path of `FlashAttention2Triton` (first calls of a signature, traced calls, and every call the
    native launcher does not take): validation, autotuning, eager plans, the ops Inductor launches."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O, shaped and typed like q."""
        key = plans.forward_key(q, k, v, is_causal, softmax_scale, window_size)
        plan = plans.forward_plans.get(key)
        if plan is not None and plans.on_current_device(q):  # a repeated eager call: allocate and launch
            o, lse = plan.launch(q, k, v)
            native.offer_forward(plan, q, k, v, is_causal, softmax_scale, window_size)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.window, ctx.scale, ctx.planned = plan.window, plan.scale, True
            return o
        op = "FlashAttention2Triton"
        scale = check_attention_inputs(q, k, v, is_causal, softmax_scale, op=op, max_head_dim=MAX_HEAD_DIM)
        window = normalize_window(window_size, bool(is_causal), op, q.shape[-2], k.shape[-2])
        calls.check_device(q, op)
        eager = calls.eager(q, k, v)
        planned_path = eager and calls.plannable(q)
        if planned_path:
            with calls.on_device(q):
                o, lse, plan = launcher.forward(q, k, v, window, scale)
            plans.forward_plans.remember(key, plan)
            if plan is not None and q.device.type == "cuda":
                native.start_build()  # once per process; until it is ready, plans are offered on replay
            native.offer_forward(plan, q, k, v, is_causal, softmax_scale, window_size)
        elif eager:
            o, lse = calls.forward(q, k, v, window, scale)
        else:
            o, lse = library_ops.traced_forward(q, k, v, window)(q, k, v, *window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        # The backward has plans of its own: it replays one even where this forward has none (the Gluon forward,
        # or a first call that autotuned), so an eager Gluon forward's backward does not take the full path.
        ctx.window, ctx.scale, ctx.planned = window, scale, planned_path
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """(dQ, dK, dV, None, None, None) from the dQ kernel, then the dK/dV kernel; dO may have any strides."""
        refuse_double_backward("FlashAttention2Triton")
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.planned:  # an eager forward on the planned path: replay a backward plan, or make one
            grads = calls.planned_backward(q, k, v, o, lse, launcher.dense_do(do, q.dtype), ctx.window, ctx.scale)
            if grads is not None:
                return (*grads, None, None, None)
        if calls.eager(q, do):
            with calls.on_device(q):
                dq, dk, dv = calls.backward(q, k, v, o, lse, do, ctx.window, ctx.scale)
        else:
            dq, dk, dv = library_ops.traced_backward(q, k, v, ctx.window)(q, k, v, o, lse, do, *ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None


class FlashAttention2Triton(_FlashAttention2TritonFunction):
    """FlashAttention-2 with Triton forward and backward kernels (CUDA; CPU under TRITON_INTERPRET=1).

    `FlashAttention2Triton.apply(q, k, v, is_causal=False, softmax_scale=None, window_size=None)`; arguments,
    masks, grouped-query K/V and errors as in `flashsys.ops.flash_attention`, head_dim up to 256. Saves q, k, v, O
    and the float32 natural-log logsumexp L. `torch.compile(FlashAttention2Triton.apply)` works: under compile the
    kernels run through triton_ops that Inductor launches itself. Repeated eager calls of a signature run from C++
    (`replay.native`) once its extension is built; the first calls, and every call it cannot take, run in Python.
    """

    @classmethod
    def apply(cls, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None,
              window_size: tuple[int, int] | None = None) -> Tensor:
        # Dynamo takes `X.apply` in traced code for autograd.Function.apply and does not run this; where it traces
        # this frame itself (torch.compile(FlashAttention2Triton.apply)) it reaches the Function's apply through
        # the base class by name (not super(), which it cannot follow here).
        if not torch.compiler.is_compiling():
            o = native.forward(q, k, v, is_causal, softmax_scale, window_size)
            if o is not None:
                return o
        return _FlashAttention2TritonFunction.apply(q, k, v, is_causal, softmax_scale, window_size)


class FlashAttentionVarlenTriton(torch.autograd.Function):
    """Packed variable-length FlashAttention-2 with the Triton kernels: one program grid over every sequence's tiles
    (no padding, no per-sequence launches).

    `FlashAttentionVarlenTriton.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    is_causal=False, softmax_scale=None, window_size=None)`, as `flashsys.ops.flash_attention_varlen`. Saves q, k, v,
    O, the logsumexp L (Hq, total_q) float32 (flash-attn's varlen layout) and the two offset tensors. Eager only:
    under torch.compile, `flash_attention_varlen` runs outside the graph.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O (total_q, Hq, D), typed like q."""
        op = "FlashAttentionVarlenTriton"
        scale = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                    softmax_scale, op=op, max_head_dim=MAX_HEAD_DIM)
        window = normalize_window(window_size, bool(is_causal), op, q.shape[0], k.shape[0])
        calls.check_device(q, op)
        lengths = (max_seqlen_q, max_seqlen_k)
        with calls.on_device(q):
            o, lse = launcher.varlen_forward(*calls.interpreter_upcast(q, k, v),
                                             launcher.Offsets(cu_seqlens_q, cu_seqlens_k), lengths, window, scale)
        o = calls.same_dtype((o,), (q,))[0]
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.lengths, ctx.window, ctx.scale = lengths, window, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """Gradients for q, k, v from the dQ, then the dK/dV kernel; None for the rest."""
        refuse_double_backward("FlashAttentionVarlenTriton")
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        up_q, up_k, up_v, up_o, up_do = calls.interpreter_upcast(q, k, v, o, do)
        with calls.on_device(q):
            grads = launcher.varlen_backward(up_q, up_k, up_v, up_o, lse, up_do, launcher.Offsets(cu_q, cu_k),
                                             ctx.lengths, ctx.window, ctx.scale)
        dq, dk, dv = calls.same_dtype(grads, (q, k, v))
        return dq, dk, dv, None, None, None, None, None, None, None
