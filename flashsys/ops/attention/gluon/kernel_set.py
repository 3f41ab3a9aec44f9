"""Every Gluon kernel in one module: what `gluon.kernels()` returns. Importing it needs a Triton with Gluon's Hopper
API. A module, not a namespace object built on first use: Dynamo may trace that first use (under torch.compile),
and it cannot trace building an object out of kernel functions."""

from triton.experimental.gluon import language as gl

from .backward import attention_backward_dkdv, attention_backward_dq
from .forward import attention_forward, attention_forward_persistent, attention_forward_pingpong
from .one_pass import attention_backward_one_pass

__all__ = [
    "attention_backward_dkdv",
    "attention_backward_dq",
    "attention_backward_one_pass",
    "attention_forward",
    "attention_forward_persistent",
    "attention_forward_pingpong",
    "gl",
]
