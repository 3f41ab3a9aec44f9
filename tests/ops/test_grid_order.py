"""Which program runs which query tile (`tiles.program_start`, run by the kernels' own helper under Triton's
interpreter on a CPU) and how many (batch, head) pairs a Gluon forward's grid runs at a time (`heads_per_section`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashsys.ops.attention.gluon import launch as gluon_launch  # noqa: E402
from flashsys.ops.attention.triton import tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _order_kernel(Order, n_bh, n_heads, section, HEAVIEST_LAST: tl.constexpr):
    """Order[pid] = (tile, flat batch*head, batch, head) of program pid, from the kernels' own helper."""
    pid = tl.program_id(0)
    tile, bh, b, h = tiles.program_start(n_bh, n_heads, section, HEAVIEST_LAST)
    tl.store(Order + pid * 4, tile)
    tl.store(Order + pid * 4 + 1, bh)
    tl.store(Order + pid * 4 + 2, b.to(tl.int32))
    tl.store(Order + pid * 4 + 3, h.to(tl.int32))


def _order(n_bh: int, n_heads: int, n_tiles: int, section: int, heaviest_last: bool) -> list[tuple[int, ...]]:
    order = torch.full((n_bh * n_tiles, 4), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(n_bh * n_tiles,)](order, n_bh, n_heads, section, heaviest_last)
    return [tuple(row) for row in order.cpu().tolist()]


@pytest.mark.parametrize("n_bh,n_heads,n_tiles,section", [(6, 3, 4, 4), (5, 5, 3, 2), (4, 2, 5, 8), (3, 3, 1, 2),
                                                          (7, 7, 3, 1)])
@pytest.mark.parametrize("heaviest_last", [False, True])
def test_sections_run_tile_by_tile_across_their_pairs_each_tile_once(n_bh, n_heads, n_tiles, section,
                                                                      heaviest_last):
    """Every (pair, tile) once; the pairs in sections of `section` (the last one short where they do not divide),
    a section's programs tile by tile across its pairs, the tiles from the last down with HEAVIEST_LAST; batch and
    head are the flat pair's."""
    order = _order(n_bh, n_heads, n_tiles, section, heaviest_last)
    assert sorted((bh, tile) for tile, bh, _, _ in order) == [(bh, t) for bh in range(n_bh) for t in range(n_tiles)]
    tiles_in_order = range(n_tiles - 1, -1, -1) if heaviest_last else range(n_tiles)
    expected = [(tile, bh) for first in range(0, n_bh, section) for tile in tiles_in_order
                for bh in range(first, min(n_bh, first + section))]
    assert [(tile, bh) for tile, bh, _, _ in order] == expected
    assert all((b, h) == divmod(bh, n_heads) for _, bh, b, h in order)


def test_sections_of_one_pair_are_one_pair_after_another():
    """`section` 1, the `tl` kernels' grids and the Gluon ones without a right bound: each pair's tiles in turn."""
    order = _order(3, 3, 4, 1, True)
    assert [(tile, bh) for tile, bh, _, _ in order] == [(t, bh) for bh in range(3) for t in (3, 2, 1, 0)]


def test_a_section_holds_the_heads_whose_keys_and_values_fit_in_l2():
    """With a right bound: K/V heads whose K and V fit in the L2 (an H100's 50 MiB stands in on a CPU), rounded down
    to a power of two, times the query heads that share each, at most all the pairs; without one, one pair."""
    def section(batch, heads, kv_heads, n_k, d, window=(-1, 0), dtype=torch.bfloat16):
        k4 = torch.empty(batch, kv_heads, n_k, d, dtype=dtype)
        return gluon_launch.heads_per_section(k4, batch * heads, heads // kv_heads, window)

    assert section(1, 16, 16, 16384, 64) == 8  # 4 MiB of K and V a head: 12 fit, 8 the power of two
    assert section(1, 16, 16, 16384, 128) == 4  # 8 MiB: 6 fit
    assert section(1, 32, 8, 16384, 128) == 16  # 4 K/V heads of 4 query heads each
    assert section(2, 16, 16, 65536, 128) == 1  # 32 MiB: one
    assert section(1, 1, 1, 1 << 20, 128) == 1  # 512 MiB: still one
    assert section(8, 16, 16, 2048, 64) == 64  # 512 KiB: 100 fit, 64 of the 128 pairs
    assert section(4, 16, 16, 1024, 64) == 64  # 256 KiB: 200 fit, more than the 64 pairs: one section
    assert section(1, 16, 16, 16384, 64, window=(-1, -1)) == 1  # full masks: every tile weighs the same
    assert section(1, 16, 16, 16384, 64, window=(255, 0)) == 8  # a right bound: the heaviest first
    assert section(1, 16, 16, 16384, 64, dtype=torch.float32) == 4
