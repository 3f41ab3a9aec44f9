"""The torch.library ops a compiled graph calls: what `torch.compile` sees of the Triton attention op.

- `flashsys::flash_attention_forward` / `_backward`: `torch.library.triton_op`s. Their bodies are traced, not hidden:
  each `wrap_triton` launch becomes a node that Inductor compiles and launches from its generated code (no Python at
  run time; CUDA graphs capture it), with the kernel's source re-emitted.
- Opaque ops, for what Inductor cannot re-emit: the Gluon kernels on Hopper (`*_gluon`) and the interpreter's
  kernels on a CPU (`*_interpreted`). Their bodies check what a traced call cannot (the tensors' addresses), run the
  `tl` kernels where the Gluon ones do not take the call, and replay a plan per signature as a repeated eager call
  does: a compiled graph calls them with one signature every step. The native launcher (`replay.native`) replays
  those plans from C++ once it holds them, so that an opaque call costs the host about what an eager one does.

Eager calls skip the op dispatch altogether (`flash_triton`): it costs host time on every call.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from . import calls, dispatch, launcher
from .layout import empty_output
from .op_library import define_op
from .replay import native, plans

Window = tuple[int, int]


@triton_op("flashsys::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, window_left: int, window_right: int,
                               softmax_scale: float) -> tuple[Tensor, Tensor]:
    return calls.forward(q, k, v, (window_left, window_right), softmax_scale, traced=True)


@triton_op("flashsys::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window_left: int, window_right: int,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return calls.backward(q, k, v, o, lse, do, (window_left, window_right), softmax_scale, traced=True)


def opaque_forward(q: Tensor, k: Tensor, v: Tensor, window_left: int, window_right: int, softmax_scale: float
                    ) -> tuple[Tensor, Tensor]:
    """An opaque forward op's body (its schema's arguments): replay this signature's plan, or take the full path and
    make one."""
    window, scale = (window_left, window_right), softmax_scale
    outputs = native.op_forward(window, scale, q, k, v)
    if outputs is not None:
        return outputs
    key = plans.signature_key(window, scale, q, k, v) if calls.plannable(q) else None
    plan = plans.op_forward_plans.get(key)
    if plan is not None and plans.on_current_device(q):
        outputs = plan.launch(q, k, v)
    else:
        with calls.on_device(q):
            if key is None:
                return calls.forward(q, k, v, window, scale)
            *outputs, plan = launcher.forward(q, k, v, window, scale)
        plans.op_forward_plans.remember(key, plan)
        if plan is not None and q.device.type == "cuda":
            native.start_build()  # a compiled model may make no eager call that would start it
    native.offer_op_forward(plan, window, scale, q, k, v)
    return tuple(outputs)


def opaque_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window_left: int,
                     window_right: int, softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """An opaque backward op's body (its schema's arguments): replay this signature's plan (the eager backward's
    table), or make one."""
    window, scale = (window_left, window_right), softmax_scale
    grads = native.op_backward(window, scale, q, k, v, o, lse, do)
    if grads is not None:
        return grads
    grads = (calls.planned_backward(q, k, v, o, lse, launcher.dense_do(do, q.dtype), window, scale)
             if calls.plannable(q) else None)
    if grads is not None:
        return grads
    with calls.on_device(q):
        return calls.backward(q, k, v, o, lse, do, window, scale)


# The opaque ops are defined on a torch.library.Library (`op_library.define_op`) rather than by
# torch.library.custom_op: a custom_op's call passes through a Python autograd kernel and wrappers before its body,
# which cost a compiled graph host time on every call. The fake kernels give torch.compile the output shapes.
_FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, int window_left, int window_right, float softmax_scale) "
                   "-> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, int window_left, "
                    "int window_right, float softmax_scale) -> (Tensor, Tensor, Tensor)")


def _forward_fake(q, k, v, window_left, window_right, softmax_scale):
    return empty_output(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _backward_fake(q, k, v, o, lse, do, window_left, window_right, softmax_scale):
    return empty_output(q), empty_output(k), empty_output(v)


gluon_forward_op = define_op("flash_attention_forward_gluon", _FORWARD_SCHEMA, opaque_forward, _forward_fake)
interpreted_forward_op = define_op("flash_attention_forward_interpreted", _FORWARD_SCHEMA, opaque_forward,
                                   _forward_fake)
gluon_backward_op = define_op("flash_attention_backward_gluon", _BACKWARD_SCHEMA, opaque_backward, _backward_fake)
interpreted_backward_op = define_op("flash_attention_backward_interpreted", _BACKWARD_SCHEMA, opaque_backward,
                                    _backward_fake)


def traced_forward(q: Tensor, k: Tensor, v: Tensor, window: Window):
    """The op a traced (torch.compile) forward call runs: the interpreter's on a CPU, the Gluon one where
    `dispatch.forward_problem` finds nothing, else the triton_op that Inductor re-emits."""
    if q.device.type != "cuda":
        return interpreted_forward_op
    return (gluon_forward_op if dispatch.forward_problem(q, k, v, window) is None
            else flash_attention_forward_op)


def traced_backward(q: Tensor, k: Tensor, v: Tensor, window: Window):
    """The op a traced backward runs: as `traced_forward`, for the Gluon backward kernels (the Gluon op's body
    checks O, dO and the addresses, and runs the `tl` kernels where they fail)."""
    if q.device.type != "cuda":
        return interpreted_backward_op
    return (gluon_backward_op if dispatch.backward_problem(q, k, v, window) is None
            else flash_attention_backward_op)
