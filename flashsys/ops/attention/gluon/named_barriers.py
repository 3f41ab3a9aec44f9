"""The ping-pong forward's hand-offs as named hardware barriers (`bar.sync` / `bar.arrive`), not mbarriers in shared
memory: the consumer warpgroups' turns at issuing products (FlashAttention-3's and -4's warp scheduler barriers) and
the K/V slots they hand back to the producer warp.

A named barrier completes once its count of threads has come, some arriving (which does not block) and some
syncing (which waits for the completion), and then starts over. Passing a turn or a slot is one `bar.arrive` by
every thread of the warpgroup. An mbarrier took, to pass, a barrier over the warpgroup before one thread's arrive,
and to wait, a spin on its phase. A barrier that completes and starts over has no phase to track: an arrival for
round r + 1 cannot come before round r completes, because whoever arrives waits in between for something that round
r's syncing side does after it.

Ids: Triton numbers the named barriers of its warp partitions from 0 (0-4 in these kernels); the turns take
FIRST_ID.., the slots the ids after them, up to sm_90's 16. `tests/ops/kernel_compile.verdict` fails a kernel in
which one of Triton's own reaches FIRST_ID.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FIRST_ID = 8
TURN_THREADS = 256  # the warpgroup passing a turn and the one taking it
_MAX_WARPGROUPS = 3  # consumer warpgroups a ring of turns may have
_SLOT_FIRST = FIRST_ID + _MAX_WARPGROUPS  # after the turns
_SLOT_IDS: gl.constexpr = gl.constexpr(_SLOT_FIRST)
_IDS = 16  # sm_90's named barriers


def literal_barriers() -> set[tuple[int, int]]:
    """The (id, thread count) pairs of the barriers here whose id is a literal in the PTX: the turns (the slots'
    ids are registers)."""
    return {(FIRST_ID + wg, TURN_THREADS) for wg in range(_MAX_WARPGROUPS)}


@gluon.constexpr_function
def _turn_asm(op, wg):
    """A named-barrier `op` (sync, arrive) on warpgroup wg's turn barrier (TURN_THREADS). Inline asm returns a
    value, unused."""
    return f"bar.{op} {FIRST_ID + wg}, {TURN_THREADS};\n\tmov.u32 $0, 0;"


@gluon.jit
def wait_turn(WG: gl.constexpr):
    """Consumer warpgroup WG waits for its turn to issue products."""
    gl.inline_asm_elementwise(_turn_asm("sync", WG), "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pass_turn(WG: gl.constexpr, WGS: gl.constexpr):
    """Consumer warpgroup WG of WGS passes the turn to WG + 1, round the ring. Warpgroup 0 takes the first turn by
    passing it to itself, as the last one would (`pass_turn(WGS - 1, WGS)`, once, before its first wait): the
    barrier holds an arrival until the sync that completes it comes."""
    gl.inline_asm_elementwise(_turn_asm("arrive", (WG + 1) % WGS), "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.constexpr_function
def _slot_asm(op, wgs):
    """A named-barrier `op` on the slot barrier whose id is the asm's input: the producer warp (32 threads) and wgs
    consumer warpgroups."""
    return f"bar.{op} $1, {32 + 128 * wgs};\n\tmov.u32 $0, 0;"


@gluon.constexpr_function
def slot_barriers_fit(n):
    """Whether n slot barriers fit in the named barriers after the turns'."""
    return _SLOT_FIRST + n <= _IDS


@gluon.jit
def release_slot(index, WGS: gl.constexpr):
    """A consumer warpgroup of WGS hands slot barrier `index` back to the producer (its products that read it have
    completed)."""
    gl.inline_asm_elementwise(_slot_asm("arrive", WGS), "=r,r", [_SLOT_IDS + index], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def wait_for_slot(index, WGS: gl.constexpr):
    """The producer warp waits until all WGS consumer warpgroups have handed slot barrier `index` back."""
    gl.inline_asm_elementwise(_slot_asm("sync", WGS), "=r,r", [_SLOT_IDS + index], dtype=gl.int32, is_pure=False,
                              pack=1)
