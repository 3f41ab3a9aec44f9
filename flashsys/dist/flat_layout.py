"""Many tensors in one flat buffer: the layout FlatDDP, BucketedDDP and ShardedOptimizer pack gradients and
parameters into, so that one collective moves them all."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class FlatLayout:
    """Where each of a list of tensors lives in a 1-D buffer: back to back, in list order.

    Args:
        tensors: the tensors (only their shapes and element counts are kept).
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.offsets: list[int] = []
        n = 0
        for t in tensors:
            self.offsets.append(n)
            n += t.numel()
        self.numel = n  # elements of all tensors together

    def view(self, flat: Tensor, i: int) -> Tensor:
        """Tensor i's slice of `flat`, shaped like tensor i (a view: writes go to `flat`)."""
        shape = self.shapes[i]
        return flat[self.offsets[i] : self.offsets[i] + shape.numel()].view(shape)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Every tensor's view into `flat`, in order."""
        return [self.view(flat, i) for i in range(len(self.shapes))]

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        """A new flat buffer holding copies of `tensors` (which must match the layout)."""
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack(self, flat: Tensor, into: Sequence[Tensor]) -> None:
        """Copy each slice of `flat` into the matching tensor of `into`."""
        for dst, src in zip(into, self.views(flat)):
            dst.copy_(src)
