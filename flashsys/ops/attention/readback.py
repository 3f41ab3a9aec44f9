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

# (id, what was read) -> (weak reference, storage address, version, result). The weak reference proves the same live
# tensor (an id can be reused once a tensor dies); the version counter changes with every in-place write through
# torch. CPU tensors are not cached: a numpy view writes them without bumping the version, and reading them back
# costs no device wait.
_known: dict[tuple[int, str], tuple[weakref.ref, int, int, object]] = {}


def cacheable(t: torch.Tensor) -> bool:
    """Whether a reading of `t` is remembered: on a GPU, where reading waits for the device."""
    return t.device.type != "cpu"


def read_once(t: torch.Tensor, kind: str, read: Callable[[torch.Tensor], T]) -> T:
    """read(t), computed once per unchanged GPU tensor and `kind` of reading. `kind` must name everything besides
    the tensor's values that the result depends on (the sizes it is read for); `read` may raise on a bad tensor, and
    then nothing is remembered."""
    cached = cacheable(t)
    known = _known.get((id(t), kind)) if cached else None
    if known is not None and known[0]() is t and known[1:3] == (t.data_ptr(), t._version):
        return known[3]
    result = read(t)
    if cached:
        if len(_known) >= 32:  # results can be device tensors (plans): keep none for tensors that died
            for key in [key for key, entry in _known.items() if entry[0]() is None]:
                del _known[key]
        if len(_known) >= 1024:
            _known.clear()
        _known[(id(t), kind)] = (weakref.ref(t), t.data_ptr(), t._version, result)
    return result
