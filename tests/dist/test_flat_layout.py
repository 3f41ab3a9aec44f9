"""FlatLayout: tensors packed back to back in one buffer, and views into it."""

from __future__ import annotations

import torch

from flashsys.dist import FlatLayout


def test_pack_views_and_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 1, 3, generator=g)]
    layout = FlatLayout(tensors)
    assert layout.numel == 12 + 5 + 6 and layout.offsets == [0, 12, 17]
    flat = layout.pack(tensors)
    for view, t in zip(layout.views(flat), tensors):
        assert view.shape == t.shape and torch.equal(view, t)
    layout.view(flat, 1).mul_(2)  # a view writes through to the buffer
    assert torch.equal(flat[12:17], tensors[1] * 2)
    out = [torch.empty_like(t) for t in tensors]
    layout.unpack(flat, out)
    assert torch.equal(out[0], tensors[0]) and torch.equal(out[1], tensors[1] * 2) and torch.equal(out[2], tensors[2])


def test_views_ignore_trailing_elements():
    layout = FlatLayout([torch.zeros(2), torch.zeros(3)])
    buffer = torch.arange(7.0)  # BucketedDDP keeps per-parameter flags after the gradients
    assert [v.tolist() for v in layout.views(buffer)] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
