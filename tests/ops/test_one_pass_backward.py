"""The one-pass backward's switch and its `tl` helper kernels, on any machine (the kernels under Triton's interpreter
without a GPU); the Gluon kernel itself is checked against float64 on an sm_90 GPU in test_gluon_backward, and
compiled for sm_90 on a CPU in test_gluon_forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashsys.ops as ops
from flashsys.ops.attention import determinism, window_mask
from flashsys.ops.attention.layout import empty_output

from .attention_checks import make_qkv, run_reference

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashsys.ops.attention import dispatch, launcher, replay  # noqa: E402
from flashsys.ops.attention.gluon import launch as gluon_launch  # noqa: E402
from flashsys.ops.attention.replay import plans  # noqa: E402
from flashsys.ops.attention.triton import kernels, tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _deterministic_after():
    yield
    determinism.set_deterministic_backward(True)
    torch.use_deterministic_algorithms(False)


def test_the_backward_is_deterministic_unless_asked_and_torch_can_insist():
    assert ops.deterministic_backward()  # the default
    ops.set_deterministic_backward(False)
    assert not ops.deterministic_backward()
    torch.use_deterministic_algorithms(True)
    assert ops.deterministic_backward()  # torch's switch overrides ours
    torch.use_deterministic_algorithms(False)
    assert not ops.deterministic_backward()
    with pytest.raises(TypeError, match="must be a bool"):
        ops.set_deterministic_backward(0)


def test_changing_the_switch_drops_the_launch_plans():
    """A plan made under one setting must not replay under the other: the tables are emptied on a change only."""
    plans.backward_plans.remember(("a key",), "a plan")
    ops.set_deterministic_backward(True)  # no change
    assert plans.backward_plans.get(("a key",)) == "a plan"
    ops.set_deterministic_backward(False)
    assert plans.backward_plans.get(("a key",)) is None


def _prologue(o4, do4, lse, pairs, acc, sem, zero_all, rows=64, block_d=64):
    """Run the one pass's prologue kernel (one program per `rows` query rows of each (batch, head))."""
    batch, heads, n = o4.shape[:3]
    kernels.one_pass_prologue_kernel[(triton.cdiv(n, rows), batch * heads)](
        o4, do4, lse, pairs, acc, sem, *o4.stride(), *do4.stride(), heads, n, acc.shape[2], HEAD_DIM=o4.shape[-1],
        BLOCK_D=block_d, ROWS=rows, ZERO_ALL=zero_all)


def _sum_of(n):
    """Where query rows 0..n-1 lie in the one pass's float32 dQ sum (`gluon.launch.dq_sum_row`), as an index."""
    return gluon_launch.dq_sum_row(torch.arange(n))


def test_the_dq_sum_holds_each_group_of_8_rows_permuted_as_the_kernel_stores_them():
    """`dq_sum_row` permutes rows within each group of 8 (so padding Nq to a multiple of 8, `dq_sum_rows`, keeps
    every row inside the sum), and the Gluon kernel's reshape and permutation of a share (`_in_sum_order`'s, written
    here as in the kernel) put row r at the same place: both sides of the sum (the kernel's stores and adds; the
    prologue, epilogue and fold) agree. The kernel itself is held to it by the GPU tests' dQ."""
    rows = torch.arange(128)
    where = gluon_launch.dq_sum_row(rows)
    assert torch.equal(where // 8, rows // 8) and torch.equal(torch.sort(where).values, rows)
    assert [gluon_launch.dq_sum_row(r) for r in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [gluon_launch.dq_sum_rows(n) for n in (1, 8, 77, 80, 1000)] == [8, 8, 80, 80, 1000]
    for n_rows in (64, 128):
        # the row held at each place of a stored share
        stored = torch.arange(n_rows).reshape(n_rows // 8, 2, 4, 1).permute(0, 2, 1, 3).reshape(n_rows)
        assert torch.equal(gluon_launch.dq_sum_row(stored), torch.arange(n_rows))


@pytest.mark.parametrize("rank", [3, 4])
def test_prologue_writes_the_pairs_and_zeroes_dq_and_epilogue_scales_it(rank):
    """The prologue's (-L·log2 e, rowsum(dO·O)) pairs from O and dO with any strides (here (B, N, H, D) ones), L = -inf
    rows giving 0; every row of dQ's float32 sum zeroed (it held garbage) for the unordered one pass, and every
    semaphore (one per 64 query rows); the epilogue's dQ = sum · scale, cast."""
    batch, heads, n, d = 2, 3, 77, 40  # a head dim that is no power of two, rows that are no multiple of 64
    g = torch.Generator().manual_seed(11)
    o = torch.randn(batch, n, heads, d, generator=g).to(DEVICE, torch.float16).transpose(1, 2)
    do = torch.randn(batch, n, heads, d, generator=g).to(DEVICE, torch.float16).transpose(1, 2)
    lse = torch.randn(batch, heads, n, generator=g).to(DEVICE)
    lse[0, 0, :5] = float("-inf")
    if rank == 3:
        o, do, lse, heads = o[:, 0], do[:, 0], lse[:, 0].contiguous(), 1  # L is dense, as the forward writes it
    pairs = torch.full((*lse.shape, 2), float("nan"), device=DEVICE)
    o4, do4 = (t if t.dim() == 4 else t.unsqueeze(1) for t in (o, do))
    acc = torch.full((batch, heads, gluon_launch.dq_sum_rows(n), d), float("nan"), device=DEVICE)  # 80 rows
    sem = torch.full((batch * heads * triton.cdiv(n, 64),), 7, dtype=torch.int32, device=DEVICE)
    _prologue(o4, do4, lse, pairs, acc, sem, zero_all=True)
    assert torch.equal(sem, torch.zeros_like(sem))
    want_neg = torch.where(torch.isinf(lse), torch.zeros_like(lse), -lse * tiles.LOG2E)
    torch.testing.assert_close(pairs[..., 0], want_neg)
    torch.testing.assert_close(pairs[..., 1], (o.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    in_sum = _sum_of(n).to(DEVICE)
    assert torch.equal(acc[:, :, in_sum], torch.zeros_like(o4, dtype=torch.float32))
    assert acc.isnan().sum() == batch * heads * 3 * d  # the padding's 3 rows a head: no query row's
    acc.normal_(generator=torch.Generator(DEVICE).manual_seed(12))
    rows = batch * heads * n
    dense = torch.full(o4.shape, float("nan"), device=DEVICE, dtype=torch.float16)
    bnhd = torch.full((batch, n, heads, d), float("nan"), device=DEVICE, dtype=torch.float16).transpose(1, 2)
    for dq in (dense, bnhd):  # any strides: the one pass writes dQ as `layout.empty_output` lays it out
        kernels.one_pass_epilogue_kernel[(triton.cdiv(rows, 64),)](acc, dq, *dq.stride(), rows, heads, n,
                                                                   acc.shape[2], 0.3, HEAD_DIM=d, BLOCK_D=64, ROWS=64)
        assert torch.equal(dq, (acc[:, :, in_sum] * 0.3).to(torch.float16))


def _one_pass_harness(monkeypatch, picked):
    """Stand in for the one-pass choice's timing, nothing chosen yet (it runs each of the key's candidates once, in
    order, as a timing would launch them, and picks `picked()`), and for the two backwards it chooses between:
    returns the list each launch appends to ("two passes", or the one-pass variant)."""
    from flashsys.ops.attention import dispatch, launcher, timed_choice

    launched = []
    monkeypatch.setattr(dispatch, "autotune_enabled", lambda: True)  # CPU CI runs the interpreter, which is off
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU builds of torch raise
    monkeypatch.setattr(dispatch, "_chosen", {})

    def fastest(candidates, run, rounds, rep_ms):
        for candidate in candidates:
            run(candidate)
        return picked(), {}

    monkeypatch.setattr(timed_choice, "fastest", fastest)
    monkeypatch.setattr(launcher, "two_pass_backward", lambda *a, **kw: launched.append("two passes"))
    monkeypatch.setattr(launcher, "one_pass_backward", lambda variant, *a: launched.append(variant))
    return launched


def _backward_launches(q, window, deterministic):
    """The dense backward's launches for q as its own k, v (the Gluon path taken)."""
    from flashsys.ops.attention import launcher
    from flashsys.ops.attention.triton import launch

    ops.set_deterministic_backward(deterministic)
    t = launcher.backward_tensors(q, q, q, q, q[..., 0], q)
    launcher.backward_launches(launch.geometry_of(q.shape, q.shape, q.dtype), t, window, 0.125, gluon=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_one_pass_choice_hands_back_to_the_two_passes(deterministic, monkeypatch):
    """The one-pass choice times the two passes beside its variants (the deterministic ones where determinism is
    asked for) and runs the winner; where the two passes win (or the head dim has no one-pass kernel) they run."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.gluon.launch import TL_KERNEL

    pick = []
    launched = _one_pass_harness(monkeypatch, lambda: pick[0])
    q = torch.randn(1, 2, 64, 128)
    table = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS if deterministic else dispatch.ONE_PASS_VARIANTS
    assert {v.kind for v in table[128][1:]} == {"one_pass_det" if deterministic else "one_pass"}
    for choice in (TL_KERNEL, table[128][1]):
        pick[:] = [choice]
        launched.clear()
        dispatch.forget_choices()
        _backward_launches(q, (-1, 0), deterministic)
        ran = "two passes" if choice.kind == "tl" else choice
        assert launched == ["two passes", *table[128][1:], ran]
    launched.clear()
    _backward_launches(torch.randn(1, 2, 64, 96), (-1, 0), deterministic)
    assert launched == ["two passes"]
    key = dispatch.one_pass_key(q, q, (-1, 0), deterministic)
    assert key.label(TL_KERNEL) == "two passes"  # what status lines call the two passes
    assert key._replace(kernel="dq").label(TL_KERNEL) == "tl kernel"


def test_the_deterministic_d128_one_pass_times_only_its_two_set_kernel_under_full_masks():
    """Under a full mask the D 128 deterministic choice times the two passes and the kernel with two dQ staging sets
    (faster than the others there); a causal mask or a window, and the unordered kind, time the whole table."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.gluon.launch import TL_KERNEL, Variant

    q = torch.randn(1, 2, 64, 128)
    two_sets = Variant("one_pass_det", 64, 128, 2, 240, 2)
    det_table = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[128]
    assert two_sets in det_table and len(det_table) > 2  # a subset of the table, not a kernel of its own
    for window, deterministic, want in (((-1, -1), True, (two_sets,)), ((-1, 0), True, det_table[1:]),
                                        ((64, 0), True, det_table[1:]), ((64, -1), True, det_table[1:]),
                                        ((-1, -1), False, dispatch.ONE_PASS_VARIANTS[128][1:])):
        key = dispatch.one_pass_key(q, q, window, deterministic)
        assert key.candidates() == (TL_KERNEL, *want), (window, deterministic)
    q64 = torch.randn(1, 2, 64, 64)  # D 64 keeps its table under full masks too
    assert dispatch.one_pass_key(q64, q64, (-1, -1), True).candidates() == dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[64]


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_backward_offers_the_one_pass_saying_whether_it_must_be_deterministic(deterministic, monkeypatch):
    """Where the Gluon path takes the call, the backward offers the one pass first, saying whether determinism is
    asked for (the choice then offers only the deterministic one); where it declines (here a head dim without a
    one-pass kernel), the two passes give the reference gradients."""
    from flashsys.ops.attention import dispatch, launcher
    from flashsys.ops.attention.triton import launch

    asked = []
    real = dispatch.one_pass_key
    monkeypatch.setattr(dispatch, "one_pass_key", lambda q, k, window, det: (asked.append((window, det)),
                                                                            real(q, k, window, det))[1])
    ops.set_deterministic_backward(deterministic)
    q, k, v, do = make_qkv(1, 2, 48, 48, 32, torch.float32, DEVICE, seed=5)
    scale = 32 ** -0.5
    o, lse, _ = launcher.forward(q, k, v, (-1, 0), scale)
    t = launcher.backward_tensors(q, k, v, o, lse, do)
    launcher.backward_launches(launch.geometry_of(q.shape, k.shape, q.dtype), t, (-1, 0), scale, gluon=True)
    assert asked == [((-1, 0), deterministic)]
    *_, dq_ref, dk_ref, dv_ref = run_reference(q, k, v, do, True, scale, torch.float64)
    for ours, ref in zip((t.dq, t.dk, t.dv), (dq_ref, dk_ref, dv_ref)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)


@triton.jit
def _turns_kernel(Turns, Visits, n_q, n_k, window_left, window_right, stride, down, MAX_M: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr,
                  ROTATE: tl.constexpr):
    """Turns[n, m]: key tile n's turn at query tile m; Visits[n, m]: whether the one pass's program n visits m (its
    query tiles are lo, lo + BLOCK_M, ... below hi, from the kernels' own `_query_tile_range`)."""
    n = tl.program_id(0)
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, _, _, hi = tiles.query_tile_range(n * BLOCK_N, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                          BOUND_LEFT)
    m = tl.arange(0, MAX_M)
    visits = (m * BLOCK_M >= lo) & (m * BLOCK_M < hi)
    turn = tiles.one_pass_turn(m, n, tl.cdiv(n_k, BLOCK_N), stride, right_offset, down, BLOCK_M, BLOCK_N,
                               BOUND_RIGHT, ROTATE)
    tl.store(Turns + n * MAX_M + m, turn, mask=m < tl.cdiv(n_q, BLOCK_M))
    tl.store(Visits + n * MAX_M + m, visits.to(tl.int32), mask=m < tl.cdiv(n_q, BLOCK_M))


def _turns(n_q: int, n_k: int, window: tuple[int, int], rotate: bool | None = None, block_m: int = 64,
           down: int = 0):
    """(query tiles, key tiles, whether it rotates (by default as the host would on 132 SMs), the rotation's
    stride, Turns, Visits) of the deterministic one pass with `block_m`-row query tiles and 128-row key tiles
    (`_turns_kernel`); `down` 1: the turns of programs that visit their query tiles from the last down."""
    block_n = 128
    n_m, n_t = triton.cdiv(n_q, block_m), triton.cdiv(n_k, block_n)
    if rotate is None:
        rotate = window == (-1, -1) and n_m >= n_t
    stride = max(n_m // n_t, 1)
    turns, visits = (torch.empty((n_t, 32), dtype=torch.int32, device=DEVICE) for _ in range(2))
    _turns_kernel[(n_t,)](turns, visits, n_q, n_k, window[0], window[1], stride, down, MAX_M=32, BLOCK_M=block_m,
                          BLOCK_N=block_n, BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0, ROTATE=rotate)
    return n_m, n_t, rotate, stride, turns.cpu(), visits.cpu()


_WINDOWS = [(-1, 0), (-1, -1), (-1, 37), (200, 0), (64, 16), (0, 0), (130, 300), (90, -1)]


@triton.jit
def _ring_last_kernel(Last, n_k_tiles, n_m_tiles, stride, MAX_M: tl.constexpr):
    """Last[n, m]: whether key tile n's program writes query tile m's dQ (FOLD_DQ), from `_ring_last_tiles`."""
    n = tl.program_id(0)
    m_lo, m_hi = tiles.ring_last_tiles(n, n_k_tiles, n_m_tiles, stride)
    m = tl.arange(0, MAX_M)
    tl.store(Last + n * MAX_M + m, ((m >= m_lo) & (m < m_hi)).to(tl.int32), mask=m < n_m_tiles)


def _ring_last(n_t: int, n_m: int, stride: int) -> list[list[int]]:
    """Per key tile, the query tiles where it takes the ring's last turn (`_ring_last_kernel`)."""
    last = torch.empty((n_t, 32), dtype=torch.int32, device=DEVICE)
    _ring_last_kernel[(n_t,)](last, n_t, n_m, stride, MAX_M=32)
    last = last.cpu()
    return [[m for m in range(n_m) if last[n, m]] for n in range(n_t)]


@settings(max_examples=40)
@given(n_q=st.integers(1, 1400), n_k=st.integers(1, 1400), block_m=st.sampled_from([64, 128]))
@example(n_q=1024, n_k=1024, block_m=64)  # stride 2
@example(n_q=1400, n_k=1024, block_m=64)  # 22 query tiles over 8 key tiles: key tile 0 takes the last 8
@example(n_q=100, n_k=100, block_m=64)  # one key tile, the only turn
def test_the_ring_folds_each_query_tile_once_where_its_last_turn_is_taken(n_q, n_k, block_m):
    """Under a rotated full mask each program writes dQ at the query tiles `_ring_last_tiles` gives it, once its adds
    there complete: every query tile must be written by exactly one program, the one holding its last turn
    (`_one_pass_turn`'s n_k_tiles - 1), whose add is the last to land; a tile given to another program would be
    written before its sum is whole, and a tile given to none would leave dQ unwritten."""
    n_m, n_t, rotate, stride, turns, _ = _turns(n_q, n_k, (-1, -1), block_m=block_m)
    if not rotate:
        return
    last = _ring_last(n_t, n_m, stride)
    for m in range(n_m):
        writers = [n for n in range(n_t) if m in last[n]]
        assert writers == [n for n in range(n_t) if turns[n, m] == n_t - 1] and len(writers) == 1, (m, writers)


_RIGHT_BOUND_ONLY = [w for w in _WINDOWS if w[1] >= 0 and w[0] < 0]  # the paired order's masks


@settings(max_examples=40)
@given(n_q=st.integers(1, 1400), n_k=st.integers(1, 1400), window=st.sampled_from(_RIGHT_BOUND_ONLY),
       block_m=st.sampled_from([64, 128]))
def test_programs_that_visit_downward_take_turns_from_key_tile_0_up(n_q, n_k, window, block_m):
    """The paired order's odd groups (`tiles.paired_key_program`) launch each head's key tiles from 0 up and
    visit their query tiles from the last down, so at every query tile key tile n - 1 (launched before n, and
    starting no later) goes before n: the visitors hold the turns 0 .. V-1 from the lowest key tile up, each once,
    and key tile 0, whose first share is stored (turn 0), visits every tile that any program visits."""
    n_m, n_t, rotate, _, turns, visits = _turns(n_q, n_k, window, block_m=block_m, down=1)
    assert not rotate
    for m in range(n_m):
        visitors = [n for n in range(n_t) if visits[n, m]]
        assert visitors == list(range(len(visitors))), (m, visitors)  # key tiles 0 .. V-1: no left bound
        assert [int(turns[n, m]) for n in visitors] == visitors, (m, turns[:, m].tolist())


@settings(max_examples=40)
@given(n_q=st.integers(1, 1400), n_k=st.integers(1, 1400), window=st.sampled_from(_WINDOWS),
       block_m=st.sampled_from([64, 128]))
def test_the_deterministic_one_pass_gives_each_add_its_own_turn_in_visiting_order(n_q, n_k, window, block_m):
    """The turns of the deterministic one pass (its adds into a query tile wait for 0, 1, ...), from the kernel's own
    helpers: at every query tile the key tiles that visit it hold the turns 0 .. V-1, each once (a missing or
    repeated turn would leave a wait that never ends); they come in the order the programs reach the tile; and
    outside a rotated full mask a program waits only for key tile n + 1, which launches before it (the grid runs from
    the last key tile down), so no wait can hold up the program it waits for."""
    n_m, n_t, rotate, stride, turns, visits = _turns(n_q, n_k, window, block_m=block_m)
    for m in range(n_m):
        visitors = [n for n in range(n_t) if visits[n, m]]
        if rotate:  # program n reaches tile m at its step (m - n * stride) mod n_m
            arrival = sorted(visitors, key=lambda n: (m - n * stride) % n_m)
        else:  # program n starts lower than n + 1 (or as low), so it reaches m later
            arrival = sorted(visitors, reverse=True)
            assert visitors == list(range(min(visitors, default=0), max(visitors, default=-1) + 1))
        assert [int(turns[n, m]) for n in arrival] == list(range(len(visitors))), (m, turns[:, m].tolist())


@settings(max_examples=30, deadline=None)
@given(n_q=st.integers(1, 700), n_k=st.integers(1, 700), window=st.sampled_from(_WINDOWS),
       block_m=st.sampled_from([64, 128]))
@example(n_q=700, n_k=300, window=(-1, 0), block_m=64)  # the first 400 queries see no key: tiles no program visits
@example(n_q=300, n_k=700, window=(0, 0), block_m=128)
def test_the_deterministic_prologue_zeroes_the_rows_no_first_share_stores(n_q, n_k, window, block_m):
    """The deterministic one pass stores each query tile's first share (turn 0) over the whole tile instead of adding
    it, so its prologue zeroes only the rows of dQ's sum that see no key, which it reads from L (-inf exactly there,
    the forward's contract that `attention_checks` holds every forward to): every tile that no program visits (from
    the kernel's own `_query_tile_range`) must consist of such rows, and every tile some program visits gets its
    turn 0 there (`_turns`). Rows that see a key are left as they were (NaN here), and the semaphores zeroed."""
    n_m, n_t, _, _, turns, visits = _turns(n_q, n_k, window, block_m=block_m)
    d = 16
    g = torch.Generator().manual_seed(n_q * 1000 + n_k)
    o, do = (torch.randn(1, 1, n_q, d, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    sees_no_key = ~window_mask(n_q, n_k, *window).any(1)
    lse = torch.randn(1, 1, n_q, generator=g).masked_fill(sees_no_key, float("-inf")).to(DEVICE)
    pairs = torch.empty((1, 1, n_q, 2), device=DEVICE)
    acc = torch.full((1, 1, gluon_launch.dq_sum_rows(n_q), d), float("nan"), device=DEVICE)
    sem = torch.full((n_m,), 7, dtype=torch.int32, device=DEVICE)
    _prologue(o, do, lse, pairs, acc, sem, zero_all=False, rows=block_m, block_d=d)
    by_row = acc[0, 0, _sum_of(n_q).to(DEVICE)]  # query row r's place in the sum, row r
    zeroed = (by_row == 0).all(1).cpu()
    assert torch.equal(zeroed, sees_no_key) and not (by_row == 0).any(1)[~zeroed].any()
    assert (acc[0, 0] == 0).sum() == zeroed.sum() * d  # nothing else, the padding included
    assert torch.equal(sem.cpu(), torch.zeros(n_m, dtype=torch.int32))
    for m in range(n_m):
        visitors = [n for n in range(n_t) if visits[n, m]]
        if visitors:
            assert [n for n in visitors if turns[n, m] == 0], f"tile {m}: no program stores the first share"
        else:
            assert zeroed[m * block_m:(m + 1) * block_m].all(), f"tile {m}: no program visits it, not zeroed"


def _runs_to_the_end(launches, sms: int, pass_late: bool = False) -> bool:
    """Whether programs that wait for their turns all finish on `sms` SMs, one program per SM, started in launch
    order as SMs free up. `launches`: per program (head, [(query tile, turn), ...] in visiting order). A step adds
    one program's share at one query tile, once as many shares as its turn have been counted there; the writer
    counts it at once, or with `pass_late` (PASS_LATE) only once it has taken its next turn (or has none left).
    A step (query tile, turn, head) adds nothing: it waits until `turn` shares have been counted at that head's tile
    (FOLD_DQ's wait for another pair's whole sum). False where every running program waits for a program that has
    not started or for a count that waits on it (a deadlock on the GPU)."""
    counted: dict[tuple[int, int], int] = {}
    queue, running = list(launches), []
    while queue or running:
        while queue and len(running) < sms:
            head, steps = queue.pop(0)
            running.append([head, list(steps), None])  # None: no share added and not yet counted
        moved = False
        for program in running:
            head, steps, pending = program
            while steps and len(steps[0]) == 3 and counted.get((steps[0][2], steps[0][0]), 0) == steps[0][1]:
                steps.pop(0)  # a fold's wait, passed
                moved = True
            while steps and len(steps[0]) == 2 and counted.get((head, steps[0][0]), 0) == steps[0][1]:
                if pending is not None:
                    counted[head, pending] += 1
                tile = steps.pop(0)[0]
                counted.setdefault((head, tile), 0)
                if pass_late:
                    pending = tile
                else:
                    counted[head, tile] += 1
                moved = True
            if not steps and pending is not None:
                counted[head, pending] += 1
                pending = None
                moved = True
            program[2] = pending
        running = [program for program in running if program[1] or program[2] is not None]
        if not moved and running:
            return False
    return True


@triton.jit
def _paired_order_kernel(Order, n_bh, n_k_tiles, group_heads):
    """Order[pid] = (key tile, flat head, down) of program pid in the paired order, from the kernel's own helper."""
    pid = tl.program_id(0)
    tile, bh, down = tiles.paired_key_program(n_bh, n_k_tiles, group_heads)
    tl.store(Order + pid * 3, tile)
    tl.store(Order + pid * 3 + 1, bh)
    tl.store(Order + pid * 3 + 2, down)


def _paired_order(n_bh: int, n_k_tiles: int, group_heads: int) -> list[tuple[int, int, int]]:
    """(key tile, flat head, down) of every program of the paired order, in launch order."""
    order = torch.full((n_bh * n_k_tiles, 3), -1, dtype=torch.int32, device=DEVICE)
    _paired_order_kernel[(n_bh * n_k_tiles,)](order, n_bh, n_k_tiles, group_heads)
    return [tuple(row) for row in order.cpu().tolist()]


def _launches(n_q, n_k, window, heads, rotate, last_first=None, block_m=64, group_heads=0, turns_down=True,
              fold_lag=0):
    """The deterministic one pass's programs in launch order (see `_runs_to_the_end`), with the kernel's turns and
    order: heads one after another; with `rotate` the ring, each head's key tiles from 0 up, else the masked order,
    from the last key tile down (`last_first` overrides that); with `group_heads` the paired order
    (`_paired_order`), whose downward programs take turns from key tile 0 up (unless not `turns_down`); with
    `fold_lag` (the ring's FOLD_DQ) each program first waits for the whole sums of head - fold_lag at the tiles
    `_ring_last_tiles` gives its key tile, and fold_lag heads' programs more do only that."""
    n_m, n_t, rotate, stride, turns, visits = _turns(n_q, n_k, window, rotate, block_m)
    if fold_lag:
        assert rotate
        folds = _ring_last(n_t, n_m, stride)
        ring = _launches(n_q, n_k, window, heads, rotate, last_first, block_m)
        ring += [(head, []) for head in range(heads, heads + fold_lag) for _ in range(n_t)]
        return [(head, [(m, n_t, head - fold_lag) for m in folds[i % n_t]] * (head >= fold_lag) + steps)
                for i, (head, steps) in enumerate(ring)]
    if group_heads:
        down_turns = _turns(n_q, n_k, window, rotate, block_m, down=1)[4] if turns_down else turns
        launches = []
        for n, head, down in _paired_order(heads, n_t, group_heads):
            tiles = [m for m in range(n_m) if visits[n, m]]
            if down:
                launches.append((head, [(m, int(down_turns[n, m])) for m in reversed(tiles)]))
            else:
                launches.append((head, [(m, int(turns[n, m])) for m in tiles]))
        return launches
    if last_first is None:
        last_first = not rotate
    programs = []
    for n in range(n_t):
        tiles = [m for m in range(n_m) if visits[n, m]]
        if rotate:  # `_one_pass_tile`: from tile n * stride on, wrapping around
            tiles = [(n * stride + j) % n_m for j in range(n_m)]
        programs.append([(m, int(turns[n, m])) for m in tiles])
    order = range(n_t - 1, -1, -1) if last_first else range(n_t)
    return [(head, programs[n]) for head in range(heads) for n in order]


@settings(max_examples=60, deadline=None)
@given(n_q=st.integers(1, 1400), n_k=st.integers(1, 1400), window=st.sampled_from(_WINDOWS),
       sms=st.integers(1, 14), block_m=st.sampled_from([64, 128]))
@example(n_q=1400, n_k=1400, window=(-1, -1), sms=5, block_m=64)  # a full mask whose head does not fit: no ring
@example(n_q=1400, n_k=1400, window=(-1, -1), sms=11, block_m=64)  # one that fits: the ring, stride 2
@example(n_q=1400, n_k=1400, window=(-1, -1), sms=11, block_m=128)  # the ring, stride 1
@example(n_q=700, n_k=1400, window=(-1, -1), sms=11, block_m=64)  # the ring, stride 1
@example(n_q=1400, n_k=1400, window=(-1, 0), sms=1, block_m=64)  # a causal mask on one SM
@example(n_q=1400, n_k=1400, window=(-1, 0), sms=12, block_m=64)  # paired, one head a group: odd groups
@example(n_q=1400, n_k=700, window=(-1, 37), sms=13, block_m=128)  # paired, two heads a group, the last one short
def test_the_deterministic_one_pass_cannot_deadlock_in_the_order_the_host_launches_it(n_q, n_k, window, sms,
                                                                                      block_m):
    """Programs spin until their turn, holding their SM. In the order the host launches them on a GPU of `sms` SMs
    (the ring where `rotates` says so, the paired order where `paired_heads` does, else the masked order, each
    head's key tiles from the last down), and counting turns late where `passes_turns_late` says so, and with the
    ring's fold of dQ (`fold_lag`: each program first waits for an earlier head's whole sums, the extra programs
    for the last heads'), five heads' programs all finish: a simulation with the kernel's own turns, paired order
    and fold tiles."""
    det = gluon_launch.Variant("one_pass_det", block_m, 128, 2, 240)
    q4, k4 = torch.empty(1, 2, n_q, 8), torch.empty(1, 2, n_k, 8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gluon_launch, "usable_sms", lambda t: sms)
        rotate = gluon_launch.rotates(det, q4, k4, window)
        late = gluon_launch.passes_turns_late(det, q4, k4, window)
        group_heads = gluon_launch.paired_heads(det, q4, k4, window)
        lag = gluon_launch.fold_lag(det, q4, k4, window, q4)
    launches = _launches(n_q, n_k, window, 5, rotate, block_m=block_m, group_heads=group_heads, fold_lag=lag)
    assert _runs_to_the_end(launches, sms, late)


def test_the_simulation_finds_the_deadlocks_the_host_avoids():
    """The ring's waits are on programs launched later: rotating 11 key tiles on 10 SMs deadlocks (so `rotates`
    declines there), on 11 it does not. A ring of stride 1 (each program one tile behind the one before it) that
    counts its turns late deadlocks on any number of SMs (so `passes_turns_late` declines there); one of stride 2
    does not. And why the masked order launches a head's key tiles from the last down,
    where the unordered one pass starts from key tile 0 (the heaviest under a causal mask): from 0 up, 11 causal
    key tiles on 10 SMs each wait for the tile above, which cannot start; from the last down they finish on one SM.
    (Where a head does fit, heaviest-first orders are slower on the GPU: the programs reach each query tile together
    and take their turns one after another.)"""
    ring = _launches(1400, 1400, (-1, -1), 2, rotate=True)
    assert not _runs_to_the_end(ring, 10) and _runs_to_the_end(ring, 11)
    assert _runs_to_the_end(ring, 11, pass_late=True)  # stride 2
    for tight_ring in (_launches(1400, 1400, (-1, -1), 2, rotate=True, block_m=128),
                       _launches(700, 1400, (-1, -1), 2, rotate=True)):
        assert _runs_to_the_end(tight_ring, 11) and not _runs_to_the_end(tight_ring, 40, pass_late=True)
    heaviest_first = _launches(1400, 1400, (-1, 0), 2, rotate=False, last_first=False)
    assert not _runs_to_the_end(heaviest_first, 10) and _runs_to_the_end(heaviest_first, 11)
    # The paired order's odd groups launch heaviest first too: with the masked order's turns (key tile n + 1 first)
    # they would deadlock the same way; their own (key tile 0 first) finish on one SM.
    assert not _runs_to_the_end(_launches(1400, 1400, (-1, 0), 2, False, group_heads=1, turns_down=False), 10)
    assert _runs_to_the_end(_launches(1400, 1400, (-1, 0), 2, False, group_heads=1), 1)
    for window in ((-1, 0), (-1, -1)):
        for block_m in (64, 128):
            for late in (False, True):
                assert _runs_to_the_end(_launches(1400, 1400, window, 2, rotate=False, block_m=block_m), 1, late)
    # The fold waits at a program's start for an earlier head's whole sums: for its own head's (a lag of 0) the
    # ring could not go round, as the program whose adds it waits for includes itself.
    folding = _launches(1400, 1400, (-1, -1), 5, rotate=True, fold_lag=2)
    assert _runs_to_the_end(folding, 11, pass_late=True)
    own = [(head, [(step[0], step[1], head if head < 5 else step[2]) if len(step) == 3 else step for step in steps])
           for head, steps in folding]
    assert not _runs_to_the_end(own, 11, pass_late=True)


def test_full_masks_rotate_only_where_one_heads_programs_fit_at_once(monkeypatch):
    """The rotated order's ring waits on programs launched later, so it is taken only where a (batch, K/V head)'s
    key tiles all fit on the SMs this process may use at once (132 stand in for a CPU tensor's GPU; MPS's
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE cuts them), for full masks with at least as many query tiles as key tiles."""
    det = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[128][1]
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)

    def rotates(n_q, n_k, window=(-1, -1), variant=det):
        return gluon_launch.rotates(variant, torch.empty(1, 2, n_q, 8), torch.empty(1, 2, n_k, 8), window)

    assert rotates(16384, 16384)  # 128 key tiles
    assert not rotates(132 * 128 + 1, 132 * 128 + 1)  # 133 key tiles
    assert not rotates(16384, 16384, (-1, 0)) and not rotates(16384, 16384, (64, 64))  # masks go in order
    assert not rotates(512, 4096)  # 8 query tiles, 32 key tiles
    assert not rotates(16384, 16384, variant=dispatch.ONE_PASS_VARIANTS[128][1])  # no turns to order
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert rotates(8192, 8192) and not rotates(16384, 16384)  # 64 and 128 key tiles against 66 SMs
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "most")
    assert not rotates(1024, 1024)


def test_only_the_rotated_full_mask_folds_dq_and_its_grid_holds_the_lagging_pairs(monkeypatch):
    """FOLD_DQ where the deterministic one pass rotates (full masks): there every key tile takes the last turn at
    `stride` query tiles, where elsewhere key tile 0 takes it at all of them. Its programs fold pairs fold_lag back,
    about two waves of the SMs (MPS's share counted), and the grid holds fold_lag pairs' programs more, which fold
    the last pairs; elsewhere the lag is 0 and the grid one program per key tile and pair."""
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    det = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[128][1]
    q, k = (torch.empty(2, h, 1024, 128, dtype=torch.bfloat16) for h in (8, 4))  # 8 key tiles, 8 pairs

    def launch(variant, window):
        acc, pairs = torch.empty(q.shape), torch.empty(*q.shape[:-1], 2)
        semaphores = torch.zeros(max(1, gluon_launch.semaphore_count(variant, q)), dtype=torch.int32)
        kernel, grid, args, kwargs, _ = gluon_launch.launch_parts(
            variant, gluon_launch.OnePassTensors(q, k, k, q, k, k, acc, pairs, semaphores, q), window, 0.1)
        return grid, args[kernel.arg_names.index("fold_lag")], kwargs["FOLD_DQ"]

    assert gluon_launch.folds_dq(det, q, k, (-1, -1), q) and gluon_launch.fold_lag(det, q, k, (-1, -1), q) == 33
    assert launch(det, (-1, -1)) == ((8 * (8 + 33),), 33, True)
    for variant, window in ((det, (-1, 0)), (det, (64, 64)), (dispatch.ONE_PASS_VARIANTS[128][1], (-1, -1))):
        assert not gluon_launch.folds_dq(variant, q, k, window, q)
        assert launch(variant, window) == ((8 * 8,), 0, False)
    assert not gluon_launch.folds_dq(det, q[:, :, :256], k, (-1, -1), q[:, :, :256])  # 4 query tiles: not rotated
    ragged = torch.empty(2, 8, 1001, 128, dtype=torch.bfloat16)  # its sum holds 1008 rows a head
    for rows in (1001, 1016):  # the sum's rows are dq_sum_rows(Nq): no fewer (the TMA would clip), no more
        with pytest.raises(ValueError, match="dQ's float32 sum holds"):
            gluon_launch.launch_parts(det, gluon_launch.OnePassTensors(
                ragged, k, k, ragged, k, k, torch.empty(2, 8, rows, 128), torch.empty(2, 8, 1001, 2),
                torch.zeros(1024, dtype=torch.int32), ragged), (-1, -1), 0.1)
    # The fold indexes dQ densely: a dq in (B, N, H, D) memory (q's, as `layout.empty_output` lays it out for such
    # a q) is left to the epilogue kernel, which takes any strides.
    bnhd = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gluon_launch.folds_dq(det, bnhd, k, (-1, -1), empty_output(bnhd))
    kernel, grid, args, kwargs, _ = gluon_launch.launch_parts(det, gluon_launch.OnePassTensors(
        bnhd, k, k, bnhd, k, k, torch.empty(q.shape), torch.empty(*q.shape[:-1], 2),
        torch.zeros(1024, dtype=torch.int32), empty_output(bnhd)), (-1, -1), 0.1)
    assert (grid, args[kernel.arg_names.index("fold_lag")], kwargs["FOLD_DQ"]) == ((8 * 8,), 0, False)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert gluon_launch.fold_lag(det, q, k, (-1, -1), q) == 17  # 66 SMs


def test_the_paired_order_groups_heads_to_about_fill_the_sms_under_causal_masks_only(monkeypatch):
    """`paired_heads`: causal masks (a right bound, no left one) only, for both kinds of the one pass; as many heads
    a group as fit their key tiles on the SMs (at least one); 0 (one head after another) for full masks, windows
    with a left bound and the two-pass kernels."""
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)

    def paired(n_k, window=(-1, 0), variant=dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[128][1]):
        return gluon_launch.paired_heads(variant, torch.empty(1, 2, 4096, 8), torch.empty(1, 2, n_k, 8), window)

    assert (paired(16384), paired(8192), paired(2048), paired(16384 * 4)) == (1, 2, 8, 1)  # 128, 64, 16, 512 tiles
    assert paired(8192, (-1, 37)) == 2 and paired(8192, variant=dispatch.ONE_PASS_VARIANTS[128][1]) == 2
    assert paired(8192, (-1, -1)) == paired(8192, (64, 0)) == paired(8192, (64, 64)) == 0
    assert paired(8192, variant=dispatch.DQ_VARIANTS[128][1]) == 0
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert paired(8192) == 1  # 64 key tiles against 66 SMs


@pytest.mark.parametrize("n_bh,n_k_tiles,group_heads", [(5, 4, 2), (3, 7, 1), (4, 3, 4), (2, 5, 3)])
def test_the_paired_order_launches_each_program_once_alternating_direction_by_group(n_bh, n_k_tiles, group_heads):
    """The kernel's own `_paired_key_program`: every (head, key tile) once; groups of `group_heads` heads in turn
    (the last may be short), key tile by key tile across a group's heads; even groups from the last key tile down
    visiting upward, odd groups from key tile 0 up visiting downward."""
    order = _paired_order(n_bh, n_k_tiles, group_heads)
    assert sorted((bh, n) for n, bh, _ in order) == [(bh, n) for bh in range(n_bh) for n in range(n_k_tiles)]
    pid = 0
    for group, first in enumerate(range(0, n_bh, group_heads)):
        heads = list(range(first, min(n_bh, first + group_heads)))
        tiles = range(n_k_tiles) if group % 2 else range(n_k_tiles - 1, -1, -1)
        expected = [(n, bh, group % 2) for n in tiles for bh in heads]
        assert order[pid:pid + len(expected)] == expected, group
        pid += len(expected)


def test_turns_are_counted_late_only_where_each_predecessor_is_two_tiles_ahead(monkeypatch):
    """PASS_LATE: in a ring only of stride 2 or more query tiles per key tile; in the masked order only where a key
    tile spans two query tiles or more (64-row query tiles against 128-row key tiles, not 128 against 128)."""
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)

    def late(n_q, n_k, window=(-1, -1), block_m=64, kind="one_pass_det"):
        variant = gluon_launch.Variant(kind, block_m, 128, 2, 240)
        return gluon_launch.passes_turns_late(variant, torch.empty(1, 2, n_q, 8), torch.empty(1, 2, n_k, 8), window)

    assert late(16384, 16384) and late(16384, 16384, (-1, 0)) and late(4096, 16384, (-1, 0))
    assert not late(8192, 16384) and not late(16320, 16384)  # rings of stride 1 (128 and 255 query tiles)
    assert late(132 * 128 + 1, 132 * 128 + 1)  # too many key tiles to rotate: the masked order
    assert not late(16384, 16384, block_m=128) and not late(16384, 16384, (-1, 0), block_m=128)
    assert not late(16384, 16384, kind="one_pass")  # no turns


def test_the_deterministic_one_pass_refuses_missing_or_short_semaphores():
    """Its launch needs one zeroed int32 per (batch, head, query tile): without them, or too few, it says so, naming
    the argument, before anything launches (a short table would let turns read past it and wait forever)."""
    det = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[128][1]
    q = torch.empty(2, 4, 300, 128)
    k = torch.empty(2, 2, 200, 128)
    assert gluon_launch.semaphore_count(det, q) == 2 * 4 * 5
    assert gluon_launch.semaphore_count(dispatch.ONE_PASS_VARIANTS[128][1], q) == 0
    acc, pairs = torch.empty(q.shape), torch.empty(2, 4, 300, 2)
    for semaphores in (None, torch.zeros(39, dtype=torch.int32)):
        with pytest.raises(ValueError, match="semaphores: .* needs 40 zeroed int32s"):
            gluon_launch.launch_parts(det, gluon_launch.OnePassTensors(q, k, k, q, k, k, acc, pairs, semaphores, q),
                                      (-1, 0), 0.1)


@pytest.mark.parametrize("stages", [1, 3])
def test_the_consumers_take_turns_at_dq_only_with_a_staging_set_each(stages):
    """Alternating at dQ, each consumer stages its shares in a set of its own, and waits on no other set (a phase's
    parity is ambiguous for a set it does not fill): with one set or three the launch says so before anything runs."""
    variant = gluon_launch.Variant("one_pass_det", 128, 128, 2, 240, stages, 1)
    q = torch.empty(1, 2, 256, 64)
    acc, pairs, semaphores = torch.empty(q.shape), torch.empty(1, 2, 256, 2), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="take turns at dQ only with two staging sets"):
        gluon_launch.launch_parts(variant, gluon_launch.OnePassTensors(q, q, q, q, q, q, acc, pairs, semaphores, q),
                                  (-1, -1), 0.1)


def test_the_d64_one_pass_kernels_with_128_row_tiles_alternate_at_dq():
    """They ran faster alternating in every cell measured: the tables hold only that form, labelled so."""
    for table in (dispatch.ONE_PASS_VARIANTS, dispatch.DETERMINISTIC_ONE_PASS_VARIANTS):
        wide = [v for v in table[64] if v.block_m == 128]
        assert wide and all(v.alternate and v.stages == 2 and v.label().endswith("dQ alternating") for v in wide)
        assert not any(v.alternate for v in table[128])  # slower there


class _StandInOnePass:
    """Stands in on a CPU for the compiled one-pass Gluon kernel (it needs an sm_90 GPU): called with that kernel's
    arguments (tensors where it takes descriptors), it makes the kernel's writes in float64 from the pairs the
    prologue wrote: dK, dV, and dQ's unscaled sum, after checking that the prologue zeroed the semaphores. As the
    deterministic kernel, it stores that sum (its first shares are stored, not added) over every query tile, all of
    which some program visits here (every row sees a key); where the launch folds dQ (`gluon.launch.folds_dq`, given
    as `fold`), it writes dQ from the sum too, as the kernel's last turns do. A launch indexes the kernel by its grid
    and a GluonReplay the compiled kernel: indexing and calling give the stand-in itself, whose arguments are all
    positional (no `arg_names` past them)."""

    arg_names = ()

    def __init__(self, causal: bool):
        self.causal, self.calls, self.fold = causal, 0, None

    def __getitem__(self, grid):
        return self

    def __call__(self, q, k, v, do, dk, dv, dq_acc, pairs, semaphores, dq_sum, dq, window, scale, stream=None):
        assert not semaphores.any(), "the one pass ran without its prologue"
        self.calls += 1
        q, k, v, do = (t.double() for t in (q, k, v, do))
        p = torch.exp2(q @ k.transpose(-1, -2) * (scale * tiles.LOG2E) + pairs[..., 0, None].double())
        if self.causal:
            p = p.tril()
        ds = p * (do @ v.transpose(-1, -2) - pairs[..., 1, None].double())
        assert dq_sum is dq_acc  # FOLD_DQ's pointer to the sum its descriptor adds into
        in_sum = _sum_of(q.shape[2]).to(q.device)
        assert dq_acc.shape[2] == gluon_launch.dq_sum_rows(q.shape[2])
        dq_acc[:, :, in_sum] = (ds @ k).to(dq_acc.dtype)  # each row where the kernel's stores put it
        if self.fold:
            dq.copy_(dq_acc[:, :, in_sum] * scale)
        dk.copy_(ds.transpose(-1, -2) @ q * scale)
        dv.copy_(p.transpose(-1, -2) @ do)
        return self


@pytest.mark.parametrize("which_launcher", ["python", "native"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_one_pass_backward_is_replayed_from_its_plan_with_fresh_scratch(which_launcher, causal, request,
                                                                          monkeypatch):
    """A backward that ran the one pass is recorded as a plan: prologue, kernel and epilogue (no epilogue under the
    full mask, where the kernel folds dQ: `gluon.launch.folds_dq`), with the dQ sum and semaphores allocated anew on
    each replay (the prologue zeroes them: the stand-in kernel checks). Replays, by
    the Python plans and by the native node, give the first call's bits and the float64 gradients without choosing
    again; a plan made with determinism off is not replayed once torch.use_deterministic_algorithms(True) asks for
    it, and is again once it no longer does."""
    from flashsys.ops.attention import FlashAttention2Triton
    from flashsys.ops.attention.replay import native

    from .attention_checks import run_op, select_launcher

    select_launcher(which_launcher, request, monkeypatch)
    replay.clear()
    request.addfinalizer(replay.clear)
    variant = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[64][1]
    stand_in, chosen = _StandInOnePass(causal), []

    def fake_parts(var, t, window, scale):
        q4, k4, v4, do4, dk4, dv4, dq4 = (gluon_launch.rank4(x) for x in (t.q, t.k, t.v, t.do, t.dk, t.dv, t.dq))
        stand_in.fold = gluon_launch.folds_dq(var, q4, k4, window, dq4)
        params = (q4, k4, v4, do4, dk4, dv4, t.dq_acc, t.lse_delta, t.semaphores, t.dq_acc, dq4, window, scale)
        sources = (t.q, t.k, t.v, t.do, t.dk, t.dv, t.dq_acc, t.lse_delta, t.semaphores, t.dq_acc, t.dq)
        return gluon_launch.LaunchParts(stand_in, (1,), params, {}, sources)

    real_key = dispatch.one_pass_key
    monkeypatch.setattr(dispatch, "takes_backward", lambda *a: True)
    monkeypatch.setattr(dispatch, "one_pass_key", lambda q, k, window, det: (chosen.append(det),
                                                                            real_key(q, k, window, det))[1])
    monkeypatch.setattr(launcher, "choose_variant", lambda key, run: variant)
    monkeypatch.setattr(gluon_launch, "launch_parts", fake_parts)
    batch, heads, n, d = 2, 2, 80, 64  # 80 rows: two query tiles of 64, the last ragged
    q, k, v, do = make_qkv(batch, heads, n, n, d, torch.float32, DEVICE, seed=21)

    runs = [run_op(FlashAttention2Triton, q, k, v, do, causal, None)[2:] for _ in range(4)]
    assert chosen == [True] and stand_in.calls == 4
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0]))
    (plan,) = plans.backward_plans.values()
    assert plan.scratch == (((batch, heads, n, d), torch.float32), ((batch * heads * 2,), torch.int32))
    assert stand_in.fold == (not causal) and len(plan.replays) == (3 if causal else 2)
    if which_launcher == "native":
        assert native.sizes() == (1, 1, 0)
    *_, dq_ref, dk_ref, dv_ref = run_reference(q, k, v, do, causal, d ** -0.5, torch.float64)
    for ours, ref in zip(runs[-1], (dq_ref, dk_ref, dv_ref)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)

    ops.set_deterministic_backward(False)  # drops the plans
    for _ in range(3):
        run_op(FlashAttention2Triton, q, k, v, do, causal, None)
    torch.use_deterministic_algorithms(True)
    for _ in range(3):
        run_op(FlashAttention2Triton, q, k, v, do, causal, None)
    torch.use_deterministic_algorithms(False)
    run_op(FlashAttention2Triton, q, k, v, do, causal, None)
    assert chosen == [True, False, True]
