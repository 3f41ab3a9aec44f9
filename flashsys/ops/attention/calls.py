"""One call of the Triton attention op from Python, below the autograd Functions and the library ops: where its
kernels launch (the tensors' device), the interpreter's bf16 upcast, and the planned eager backward that both an
eager call and a compiled graph's opaque op replay.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import launcher
from .replay import native, plans
from .triton_env import check_interpreter, interpreter_active

Window = tuple[int, int]


def check_device(q: Tensor, op: str,
                 alternative: str = "FlashAttention2Torch or flash_attention(..., backend='torch')") -> None:
    """Raise unless the Triton kernels can run on q's device: CUDA, or a CPU under the interpreter. `alternative`:
    what the message offers instead (the PyTorch path of the caller's op).

    Raises:
        ValueError: naming the device and what to use instead.
        RuntimeError: CPU tensors under an interpreter that cannot run the kernels (`check_interpreter`).
    """
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and interpreter_active():
        check_interpreter(op, alternative)
        return
    raise ValueError(
        f"{op}: inputs are on {q.device}, but the Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1 set before flashsys is imported); "
        f"use {alternative} on this device"
    )


def interpreter_upcast(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as the kernels can take them: Triton's interpreter computes bf16 arithmetic wrongly (it has no
    bf16 support), so interpreted bf16 calls run in fp32. Only CPU tensors can be interpreted, so CUDA calls skip the
    environment lookup."""
    if tensors[0].device.type != "cpu" or not interpreter_active():
        return tensors
    return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)


def same_dtype(outputs: tuple[Tensor, ...], like: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Each output in the dtype of its counterpart in `like` (undoing `interpreter_upcast`)."""
    return tuple(o if o.dtype == x.dtype else o.to(x.dtype) for o, x in zip(outputs, like))


def forward(q: Tensor, k: Tensor, v: Tensor, window: Window, scale: float, traced: bool = False
            ) -> tuple[Tensor, Tensor]:
    """(O typed like q, L): the forward without a plan (`launcher.forward`), on any tensors the interpreter or a
    traced call hands over."""
    o, lse, _ = launcher.forward(*interpreter_upcast(q, k, v), window, scale, traced=traced)
    return same_dtype((o,), (q,))[0], lse


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: Window, scale: float,
             traced: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV) typed like q, k, v, without a plan; dO may have any strides."""
    up_q, up_k, up_v, up_o, up_do = interpreter_upcast(q, k, v, o, do)
    dq, dk, dv, _ = launcher.backward(up_q, up_k, up_v, up_o, lse, launcher.dense_do(up_do, up_q.dtype), window,
                                      scale, traced=traced)
    return same_dtype((dq, dk, dv), (q, k, v))


def eager(*tensors: Tensor) -> bool:
    """True for plain tensors outside torch.compile; traced (fake, functional) tensors need the library ops."""
    return not torch.compiler.is_compiling() and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors)


def plannable(q: Tensor) -> bool:
    """Eager calls are planned on CUDA, and on the CPU (interpreter) where no bf16 upcast is needed."""
    return q.device.type == "cuda" or q.dtype != torch.bfloat16


def on_device(q: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: switch to q's device when it is another one."""
    return contextlib.nullcontext() if plans.on_current_device(q) else torch.cuda.device(q.device)


def planned_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: Window,
                     scale: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """The backward of an eager forward on the planned path (with or without a plan of its own), or an opaque
    backward op's, for a dense dO: replay the backward's plan, or make one (and offer it to the native launcher);
    None where no plan applies (not eager now)."""
    key = plans.backward_key(window, scale, q, k, v, o, lse, do)
    if key is None:
        return None
    plan = plans.backward_plans.get(key)
    if plan is not None and plans.on_current_device(q):
        grads = plan.launch(q, k, v, o, lse, do)
    else:
        with on_device(q):
            *grads, plan = launcher.backward(q, k, v, o, lse, do, window, scale)
        plans.backward_plans.remember(key, plan)
    native.offer_backward(plan, window, scale, q, k, v, o, lse, do)
    return tuple(grads)


def _native_backward_fallback(q, k, v, o, lse, do, window_left, window_right, scale):
    """The backward of a native forward whose backward has no native plan yet (dO is already dense)."""
    grads = planned_backward(q, k, v, o, lse, do, (window_left, window_right), scale)
    if grads is None:
        with on_device(q):
            grads = backward(q, k, v, o, lse, do, (window_left, window_right), scale)
    return grads


native.set_backward_fallback(_native_backward_fallback)
