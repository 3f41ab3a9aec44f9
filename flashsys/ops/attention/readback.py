"""Small index tensors read back to the host (offsets, cache starts, padding masks, position ids): once per unchanged
tensor, not once per call. Every layer of a model gets the same such tensors, and on a GPU each reading waits for the
device to finish the work queued before it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# (what was read, the memory read: device, address, dtype, shape, strides) -> (weak reference to the tensor read,
# its version then, result). Keyed by the memory, not the tensor object: autograd hands a backward a new tensor
# object for a saved one. The weak reference keeps the entry valid only while that tensor lives (its memory cannot be
# reused meanwhile); its version counter, shared by its views, changes with every in-place write through torch. CPU
# tensors are not cached: a numpy view writes them without bumping the version, and reading them back costs no device
# wait.
_known: dict[tuple, tuple[weakref.ref, int, object]] = {}


def cacheable(t: torch.Tensor) -> bool:
    """Whether a reading of `t` is remembered: on a GPU, where reading waits for the device."""
    return t.device.type != "cpu"


def read_once(t: torch.Tensor, kind: str, read: Callable[[torch.Tensor], T]) -> T:
    """read(t), computed once per unchanged GPU memory and `kind` of reading (the same tensor, or another view of the
    same memory, as a backward gets its saved tensors). `kind` must name everything besides the tensor's values that
    the result depends on (the sizes it is read for); `read` may raise on a bad tensor, and then nothing is
    remembered."""
    cached = cacheable(t)
    key = (kind, t.device, t.data_ptr(), t.dtype, t.shape, t.stride()) if cached else None
    known = _known.get(key) if cached else None
    if known is not None:
        first = known[0]()
        if first is not None and first._version == known[1]:
            return known[2]
    result = read(t)
    if cached:
        if len(_known) > 1024:
            _known.clear()
        _known[key] = (weakref.ref(t), t._version, result)
    return result
