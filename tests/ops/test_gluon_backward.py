"""The Gluon dQ and dK/dV kernels (Hopper): which backward calls they take, and on an sm_90 GPU that every variant's
gradients match float64 reference math for every feature the `tl` kernels have (the dK/dV kernel after the `tl` dQ
kernel, which writes the pairs it reads; the dQ kernel's pairs against the `tl` kernel's), alone and through the op,
eager and compiled. Their compile check for sm_90 on CPU is in test_gluon_forward (one subprocess compiles every
Gluon variant)."""

from __future__ import annotations

import pytest
import torch

from .attention_checks import FLOOR, assert_matches_reference, eager_then_compiled, make_qkv, rel_err, run_reference

triton = pytest.importorskip("triton")
from flashsys.ops.attention import dispatch, launcher, library_ops, replay  # noqa: E402
from flashsys.ops.attention.gluon import launch as gluon_launch  # noqa: E402
from flashsys.ops.attention.layout import empty_output  # noqa: E402

from .test_gluon_forward import CASES, _inputs, hopper_only  # noqa: E402


@pytest.fixture(autouse=True)
def _no_choices_or_plans_from_other_tests():
    """Each test starts with no kernel choice and no launch plan, and leaves none. A plan that an earlier test
    recorded, with the choices since cleared, replays its kernels in an eager call while a compiled call makes a new
    choice: the eager backward would replay the two passes while the compiled one chose the one pass, and their dQ
    differ in the last bits."""
    def forget():
        dispatch.forget_choices()
        replay.clear()

    forget()
    yield
    forget()


def _tl_backward_case(case, d, input_seed, do_seed):
    """One masked case at head dim d, run through the `tl` kernels: ((q, k, v, dO, O, L), (dQ, dK, dV), the
    (-L·log2 e, D) pairs), what a Gluon backward kernel launched alone reads and is checked against."""
    from flashsys.ops.attention.triton import launch

    batch, heads, kv_heads, n_q, n_k, window, layout, dtype = case
    q, k, v = _inputs(batch, heads, kv_heads, n_q, n_k, d, layout, dtype, seed=input_seed)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(do_seed)).to(q.device, dtype)
    scale = d ** -0.5
    o, lse, _ = launcher.forward(q, k, v, window, scale)
    t = launcher.backward_tensors(q, k, v, o, lse, do)
    g = launch.geometry_of(q.shape, k.shape, q.dtype)
    launcher.two_pass_backward(g, t, launcher.Offsets(q, k), window, scale, traced=False)
    return (q, k, v, do, o, lse), (t.dq, t.dk, t.dv), t.lse_delta


def test_backward_takes_what_the_forward_takes_and_a_tma_ready_do():
    """The backward's O and dO must be TMA-addressable too, and its head dim one a kernel has variants for; every
    other condition is the forward's. The dQ choice times the `tl` kernel beside the Gluon ones, and takes it where
    nothing is timed."""
    q = torch.randn(1, 2, 64, 128)
    assert not dispatch.takes_backward(q, q, q, q, q, (-1, 0))  # a CPU tensor: the forward's reasons apply
    key = dispatch.ChoiceKey.of(q.to(torch.bfloat16), q, (-1, 0), "dkdv")
    assert key.candidates() == dispatch.DKDV_VARIANTS[128] and key.bound_right and not key.bound_left
    assert 64 not in dispatch.DKDV_VARIANTS  # there the `tl` dK/dV kernel is faster
    for d in (64, 128):
        dq_key = dispatch.ChoiceKey.of(torch.randn(1, 2, 64, d), q, (-1, -1), "dq")
        assert dq_key.candidates()[0] == gluon_launch.TL_KERNEL and len(dq_key.candidates()) > 1
    assert gluon_launch.TL_KERNEL not in dispatch.gluon_variants(64)
    assert "head dim 96" in dispatch.backward_problem(*(torch.randn(1, 2, 64, 96),) * 3, (-1, 0))
    assert dispatch.backward_problem(q, q, q, (-1, 0)) == "not a CUDA tensor"


def test_a_tl_dq_choice_runs_the_tl_kernel_once_and_its_timing_runs_each_candidate(monkeypatch):
    """Where the `tl` dQ kernel is the dQ choice, the two passes launch it once and no Gluon dQ kernel; the choice's
    timing launches the `tl` kernel beside each Gluon variant; a head dim without Gluon dQ variants times nothing."""
    from flashsys.ops.attention import timed_choice
    from flashsys.ops.attention.triton import launch

    launched = []
    monkeypatch.setattr(gluon_launch, "launch", lambda var, t, window, scale, record=True: launched.append(var))
    monkeypatch.setattr(launch, "run", lambda kernel, *args: launched.append(f"tl {kernel}"))
    monkeypatch.setattr(dispatch, "autotune_enabled", lambda: True)  # CPU CI runs the interpreter, which is off
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU builds of torch raise

    def backward(d):
        q = torch.randn(1, 2, 64, d)
        t = launcher.backward_tensors(q, q, q, q, q[..., 0], q)
        launcher.two_pass_backward(launch.geometry_of(q.shape, q.shape, q.dtype), t, launcher.Offsets(q, q), (-1, 0),
                                   0.125, traced=False, gluon=True)
        return q

    q = torch.randn(1, 2, 64, 64)
    dispatch.remember(dispatch.ChoiceKey.of(q, q, (-1, 0), "dq"), gluon_launch.TL_KERNEL)
    backward(64)
    assert launched == ["tl dq", "tl dkdv"]  # D 64 has no Gluon dK/dV kernel either
    launched.clear()
    dispatch.forget_choices()
    timings = []

    def first_of(candidates, run, rounds, rep_ms):
        timings.append(candidates)
        for candidate in candidates:
            run(candidate)
        return candidates[0], {}

    monkeypatch.setattr(timed_choice, "fastest", first_of)
    backward(64)
    assert launched == ["tl dq", *dispatch.DQ_VARIANTS[64][1:], "tl dq", "tl dkdv"]
    launched.clear()
    backward(96)
    assert launched == ["tl dq", "tl dkdv"] and len(timings) == 1


@hopper_only
@pytest.mark.gpu
def test_compiled_backward_takes_the_gluon_op_at_both_head_dims_gpu(monkeypatch):
    """At D 64 (a Gluon dQ kernel, no Gluon dK/dV one) and D 128 a traced backward runs the Gluon op, whose body
    makes the choices; at a head dim without Gluon kernels it keeps the triton_op Inductor launches itself."""
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    for d in (64, 128):
        q = torch.randn(1, 4, 1024, d, device="cuda", dtype=torch.bfloat16)
        assert library_ops.traced_forward(q, q, q, (-1, 0)) is library_ops.gluon_forward_op
        assert library_ops.traced_backward(q, q, q, (-1, 0)) is library_ops.gluon_backward_op
    q = torch.randn(1, 4, 1024, 32, device="cuda", dtype=torch.bfloat16)
    assert library_ops.traced_backward(q, q, q, (-1, 0)) is library_ops.flash_attention_backward_op


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for d, vs in dispatch.DKDV_VARIANTS.items() for v in vs],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_each_dkdv_variant_matches_reference_gpu(variant, case):
    """dK and dV of the variant, launched alone after the `tl` backward wrote the pairs, against float64 (within
    twice plain PyTorch's own error), on the forward's masked cases: ragged tiles, GQA, Nq != Nk with rows that see
    no key, windows, (B, N, H, D) strides, rank 3."""
    d, var = variant
    window, dtype, scale = case[5], case[7], d ** -0.5
    (q, k, v, do, _, _), (_, dk_tl, dv_tl), lse_delta = _tl_backward_case(case, d, case[3] + d, d)
    dk, dv = (torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in (k, v))
    gluon_launch.launch(var, gluon_launch.DkdvTensors(q, k, v, do, dk, dv, lse_delta), window, scale)
    *_, dk_ref, dv_ref = run_reference(q, k, v, do, False, scale, torch.float64, window)
    *_, dk_plain, dv_plain = run_reference(q, k, v, do, False, scale, dtype, window)
    for name, ours, ref, plain, tl_result in (("dK", dk, dk_ref, dk_plain, dk_tl), ("dV", dv, dv_ref, dv_plain, dv_tl)):
        err, base, tl_err = rel_err(ours, ref), rel_err(plain, ref), rel_err(tl_result, ref)
        assert err <= 2 * max(base, tl_err) + FLOOR[dtype], f"{name}: {err:.3g} vs PyTorch {base:.3g}, tl {tl_err:.3g}"


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for d in dispatch.DQ_VARIANTS for v in dispatch.gluon_variants(d)
                                     if v.kind == "dq"], ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_each_dq_variant_matches_reference_and_writes_the_pairs_gpu(variant, case):
    """dQ of the variant, launched alone, against float64 (within twice plain PyTorch's own error) on the forward's
    masked cases, and its (-L·log2 e, D) pairs against the `tl` dQ kernel's: the dK/dV kernels read them."""
    d, var = variant
    window, dtype, scale = case[5], case[7], d ** -0.5
    (q, k, v, do, o, lse), (dq_tl, _, _), pairs_tl = _tl_backward_case(case, d, case[3] + 3 * d, d + 1)
    dq = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    pairs = torch.full_like(pairs_tl, float("nan"))
    gluon_launch.launch(var, gluon_launch.DqTensors(q, k, v, do, o, dq, lse, pairs), window, scale)
    dq_ref, *_ = run_reference(q, k, v, do, False, scale, torch.float64, window)
    dq_plain, *_ = run_reference(q, k, v, do, False, scale, dtype, window)
    err, base, tl_err = rel_err(dq, dq_ref), rel_err(dq_plain, dq_ref), rel_err(dq_tl, dq_ref)
    assert err <= 2 * max(base, tl_err) + FLOOR[dtype], f"dQ: {err:.3g} vs PyTorch {base:.3g}, tl {tl_err:.3g}"
    # -L·log2 e is the same product in both kernels; D sums dO·O over the head dim in another order.
    torch.testing.assert_close(pairs[..., 0], pairs_tl[..., 0], rtol=0, atol=0)
    torch.testing.assert_close(pairs[..., 1], pairs_tl[..., 1], rtol=1e-5, atol=1e-5)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_op_runs_each_gluon_dq_variant_and_matches_reference_gpu(d, monkeypatch):
    """Through FlashAttention2Triton, with each Gluon dQ variant made the choice in turn (and the `tl` one), every
    output and gradient matches float64: the pairs it writes feed the dK/dV kernel that runs after it."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    q, k, v, do = make_qkv(1, 8, 1536, 1536, d, torch.bfloat16, "cuda", seed=d, kv_heads=2)
    key = dispatch.ChoiceKey.of(q, k, (-1, 0), "dq")
    for variant in dispatch.DQ_VARIANTS[d]:
        replay.clear()  # a plan would replay the previous variant's launch
        dispatch.forget_choices()
        dispatch.remember(key, variant)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
        assert dispatch.chosen_variants()[key] == variant


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_op_takes_gluon_backward_and_trains_gpu(causal, monkeypatch):
    """Through FlashAttention2Triton a large enough call runs the Gluon dK/dV kernel (its choice is recorded), and
    every output and gradient matches float64."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    q, k, v, do = make_qkv(1, 16, 2048, 2048, 128, torch.bfloat16, "cuda", seed=4, kv_heads=4)
    dispatch.forget_choices()
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, causal, None)
    assert any(key.kernel == "dkdv" for key in dispatch.chosen_variants()), "the Gluon dK/dV kernel did not run"


@hopper_only
@pytest.mark.gpu
def test_compiled_op_runs_the_gluon_backward_bit_for_bit_gpu(monkeypatch):
    """torch.compile's backward calls the Gluon kernels through their custom op: equal to eager, bit for bit."""
    from flashsys.ops.attention import FlashAttention2Triton

    torch._dynamo.reset()
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    q, k, v, _ = make_qkv(1, 16, 4096, 4096, 128, torch.bfloat16, "cuda", seed=6)
    assert library_ops.traced_backward(q, k, v, (-1, 0)) is library_ops.gluon_backward_op
    for a, b in zip(*eager_then_compiled(FlashAttention2Triton, q, k, v, True)):
        assert torch.equal(a, b)


@hopper_only
@pytest.mark.gpu
def test_compiled_calls_take_the_eager_size_bars_gpu():
    """At the real bars (no MIN_WORK override): a D 128 call between its bar (2^31) and MIN_WORK (2^34) runs the Gluon
    ops inside a compiled graph as it does eagerly, so eager and compiled give the same bits; a D 64 call of the
    same work keeps the `tl` kernels, traced too."""
    from flashsys.ops.attention import FlashAttention2Triton

    torch._dynamo.reset()
    causal = (-1, 0)
    q, k, v, do = make_qkv(2, 16, 1024, 1024, 128, torch.bfloat16, "cuda", seed=11)
    assert dispatch.min_work(128) <= dispatch.call_work(q.shape, k.shape, causal) < dispatch.MIN_WORK
    assert library_ops.traced_forward(q, k, v, causal) is library_ops.gluon_forward_op
    assert library_ops.traced_backward(q, k, v, causal) is library_ops.gluon_backward_op
    for a, b in zip(*eager_then_compiled(FlashAttention2Triton, q, k, v, True)):
        assert torch.equal(a, b)
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)
    narrow = torch.randn(4, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    assert dispatch.call_work(narrow.shape, narrow.shape, causal) == dispatch.call_work(q.shape, k.shape, causal)
    assert library_ops.traced_forward(narrow, narrow, narrow, causal) is library_ops.flash_attention_forward_op
    assert library_ops.traced_backward(narrow, narrow, narrow, causal) is library_ops.flash_attention_backward_op


@hopper_only
@pytest.mark.gpu
def test_stride_zero_do_and_unaligned_do_gpu(monkeypatch):
    """`o.sum().backward()` hands over a stride-0 dO (made dense before the kernels); a dO TMA cannot read keeps the
    `tl` backward kernels. Both give the reference gradients."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    q, k, v, _ = make_qkv(1, 8, 1024, 1024, 128, torch.bfloat16, "cuda", seed=8)
    unaligned = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    assert dispatch.takes_forward(q, k, v, (-1, 0)) and not dispatch.takes_backward(q, k, v, q, unaligned, (-1, 0))
    stride_zero = torch.ones((), device="cuda", dtype=q.dtype).expand(q.shape)
    assert_matches_reference(FlashAttention2Triton, q, k, v, stride_zero, True, None)
    assert_matches_reference(FlashAttention2Triton, q, k, v, unaligned, True, None)


def _free_a_nan_block(q: torch.Tensor) -> None:
    """Allocate and free a NaN-filled float32 block the size of dQ's float32 sum for q, so that the one pass's
    torch.empty sum, allocated next, is that block (the caching allocator hands a freed block of the size back):
    a row of the sum its prologue should have zeroed, or its first shares should have stored, then shows as NaN. The
    sum is `gluon.launch.dq_sum_shape`."""
    torch.full(gluon_launch.dq_sum_shape(gluon_launch.rank4(q)), float("nan"), device=q.device, dtype=torch.float32)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for table in (dispatch.ONE_PASS_VARIANTS,
                                                          dispatch.DETERMINISTIC_ONE_PASS_VARIANTS)
                                     for d, vs in table.items() for v in vs if v.kind != "tl"],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_each_one_pass_variant_matches_reference_gpu(variant, case):
    """dQ, dK and dV of the one-pass backward (prologue, Gluon kernel, epilogue) against float64, within twice plain
    PyTorch's or the two passes' error, on the forward's masked cases; its prologue's pairs against the `tl` dQ
    kernel's. The deterministic variants give the same bits on a second run."""
    d, var = variant
    window, dtype, scale = case[5], case[7], d ** -0.5
    (q, k, v, do, o, lse), grads_tl, pairs_tl = _tl_backward_case(case, d, case[3] + 5 * d, d + 2)
    grads = tuple(torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in (q, k, v))
    pairs = torch.full_like(pairs_tl, float("nan"))
    _free_a_nan_block(q)
    launcher.one_pass_backward(var, launcher.BackwardTensors(q, k, v, o, lse, do, *grads, pairs), window, scale)
    _, _, *refs = run_reference(q, k, v, do, False, scale, torch.float64, window)
    _, _, *plains = run_reference(q, k, v, do, False, scale, dtype, window)
    for name, ours, ref, plain, tl_result in zip(("dQ", "dK", "dV"), grads, refs, plains, grads_tl):
        err, base, tl_err = rel_err(ours, ref), rel_err(plain, ref), rel_err(tl_result, ref)
        assert err <= 2 * max(base, tl_err) + FLOOR[dtype], f"{name}: {err:.3g} vs PyTorch {base:.3g}, tl {tl_err:.3g}"
    torch.testing.assert_close(pairs[..., 0], pairs_tl[..., 0], rtol=0, atol=0)
    torch.testing.assert_close(pairs[..., 1], pairs_tl[..., 1], rtol=1e-5, atol=1e-5)
    if var.kind == "one_pass_det":
        again = tuple(torch.full_like(t, float("nan")) for t in grads)
        _free_a_nan_block(q)
        launcher.one_pass_backward(var, launcher.BackwardTensors(q, k, v, o, lse, do, *again, pairs), window, scale)
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the deterministic one pass changed its bits"


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("n_q", [1024, 600])
@pytest.mark.parametrize("variant", [(d, v) for d, vs in dispatch.DETERMINISTIC_ONE_PASS_VARIANTS.items()
                                     for v in vs if v.kind != "tl"],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_the_deterministic_one_pass_ring_finishes_and_matches_reference_gpu(variant, n_q):
    """Full masks rotate each program's first query tile (a ring of turns). Against 1024 keys (8 key tiles), 1024
    queries in 64-row tiles give a ring of stride 2, where the writer counts its turns late; 600 queries, or
    128-row tiles, one of stride 1, where a late count deadlocked (the GPU trapped). All finish, match float64 and
    repeat their bits (with 128-row tiles 600 queries are 5 tiles, fewer than the key tiles: the masked order)."""
    d, var = variant
    case = (1, 2, 2, n_q, 1024, (-1, -1), "bhnd", torch.bfloat16)
    inputs, grads_tl, _ = _tl_backward_case(case, d, 17, 3)
    q, k = inputs[:2]
    assert gluon_launch.rotates(var, q, k, (-1, -1)) == (triton.cdiv(n_q, var.block_m) >= 8)
    assert gluon_launch.passes_turns_late(var, q, k, (-1, -1)) == (var.block_m == 64 and n_q == 1024)
    _full_mask_runs_match_reference(var, inputs, grads_tl, d)


def _full_mask_runs_match_reference(var, inputs, grads_tl, d):
    """Two backwards of the deterministic one pass `var` under the full mask, into NaN-filled gradients (and a
    NaN-filled dQ sum, `_free_a_nan_block`): the first within twice the two passes' error (grads_tl) of float64, the
    second the same bits. Returns each run's launches (`launcher.BackwardLaunches`)."""
    q, k, v, do, o, lse = inputs
    scale = d ** -0.5
    _, _, *refs = run_reference(q, k, v, do, False, scale, torch.float64, (-1, -1))
    runs, launches = [], []
    for _ in range(2):
        grads = tuple(torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in (q, k, v))
        pairs = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
        _free_a_nan_block(q)
        launches.append(launcher.one_pass_backward(var, launcher.BackwardTensors(q, k, v, o, lse, do, *grads, pairs),
                                                   (-1, -1), scale))
        runs.append(grads)
    for name, ours, ref, tl_result in zip(("dQ", "dK", "dV"), runs[0], refs, grads_tl):
        err, tl_err = rel_err(ours, ref), rel_err(tl_result, ref)
        assert err <= 2 * tl_err + FLOOR[torch.bfloat16], f"{name}: {err:.3g} vs the two passes' {tl_err:.3g}"
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "the deterministic one pass changed its bits"
    return launches


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)], ids=["causal", "full"])
def test_op_runs_the_one_pass_that_determinism_allows_gpu(d, window, monkeypatch):
    """Through FlashAttention2Triton: by default, with the deterministic one pass the choice, it runs and its
    gradients match float64 and keep their bits from call to call, eager and compiled (a full mask takes the rotated
    order); with set_deterministic_backward(False) the other one pass runs, and
    torch.use_deterministic_algorithms(True) brings back the deterministic one, with the same bits as before."""
    from flashsys.ops.attention import FlashAttention2Triton, set_deterministic_backward

    from .attention_checks import run_op

    torch._dynamo.reset()
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    one_pass_calls = []
    real = launcher.one_pass_backward
    monkeypatch.setattr(launcher, "one_pass_backward", lambda *a: (one_pass_calls.append(a[0]), real(*a))[1])
    causal = window == (-1, 0)
    q, k, v, do = make_qkv(1, 8, 2048, 2048, d, torch.bfloat16, "cuda", seed=d + 7, kv_heads=2)
    det_key, key = (dispatch.ChoiceKey.of(q, k, window, kind) for kind in ("one_pass_det", "one_pass"))

    def grads():
        return run_op(FlashAttention2Triton, q, k, v, do, causal, None)[2:]

    dispatch.remember(det_key, dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[d][1])
    dispatch.remember(key, dispatch.ONE_PASS_VARIANTS[d][1])
    try:
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, causal, None)
        first = grads()
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
        assert {v.kind for v in one_pass_calls} == {"one_pass_det"}
        (o_e, dq_e, dk_e, dv_e), (o_c, dq_c, dk_c, dv_c) = eager_then_compiled(FlashAttention2Triton, q, k, v, causal)
        assert all(torch.equal(a, b) for a, b in ((o_e, o_c), (dq_e, dq_c), (dk_e, dk_c), (dv_e, dv_c)))
        one_pass_calls.clear()
        set_deterministic_backward(False)
        assert_matches_reference(FlashAttention2Triton, q, k, v, do, causal, None)
        assert {v.kind for v in one_pass_calls} == {"one_pass"}
        one_pass_calls.clear()
        torch.use_deterministic_algorithms(True)
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
        assert {v.kind for v in one_pass_calls} == {"one_pass_det"}
    finally:  # the fixture forgets the choices and plans
        torch.use_deterministic_algorithms(False)
        set_deterministic_backward(True)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("variant", [(d, v) for d, vs in dispatch.DETERMINISTIC_ONE_PASS_VARIANTS.items()
                                     for v in vs if v.kind != "tl"],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_the_folding_one_pass_writes_every_dq_tile_once_its_sum_is_whole_gpu(variant):
    """Under a rotated full mask the deterministic one pass writes dQ itself (FOLD_DQ, no epilogue): each program
    at its start for the (batch, K/V head) fold_lag pairs before its own, and the programs past the last pair for
    the last fold_lag. 40 pairs against a lag of 33 (8 key tiles) take both ways; GQA, and 1000 queries (a ragged
    last tile). Every tile of a NaN-filled dQ is written, within the two passes' error of float64, the same bits on
    a rerun; dK and dV too (the extra programs' stores fall outside them)."""
    d, var = variant
    case = (5, 16, 8, 1000, 1024, (-1, -1), "bhnd", torch.bfloat16)
    inputs, grads_tl, _ = _tl_backward_case(case, d, 23, 4)
    q, k = inputs[:2]
    if not gluon_launch.folds_dq(var, q, k, (-1, -1), empty_output(q)):
        pytest.skip(f"{var.label()} does not rotate at 1000 queries: the masked order, with its epilogue")
    assert 0 < gluon_launch.fold_lag(var, q, k, (-1, -1), empty_output(q)) < 5 * 8
    launches = _full_mask_runs_match_reference(var, inputs, grads_tl, d)
    assert all(len(run.recorded) == 2 for run in launches)  # the prologue and the kernel: no epilogue


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("which_launcher", ["python", "native"])
@pytest.mark.parametrize("kind", ["one_pass_det", "one_pass"])
def test_a_backward_that_ran_the_one_pass_replays_it_from_its_plan_gpu(kind, which_launcher, causal, request,
                                                                        monkeypatch):
    """Where a one pass is the choice, the backward's plan records it (prologue, Gluon kernel, and the epilogue
    unless the kernel folds dQ, as the deterministic one does under the full mask; the dQ sum and semaphores
    allocated anew): later calls replay it, by the Python plans or by the native node, without the full path, with
    gradients within bf16's error of float64; the deterministic one's replays keep the first call's bits."""
    from flashsys.ops.attention import FlashAttention2Triton, set_deterministic_backward
    from flashsys.ops.attention.replay import native, plans

    from .attention_checks import refuse_calls, run_op, select_launcher

    select_launcher(which_launcher, request, monkeypatch)
    replay.clear()
    request.addfinalizer(replay.clear)
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    set_deterministic_backward(kind == "one_pass_det")
    request.addfinalizer(lambda: set_deterministic_backward(True))
    q, k, v, do = make_qkv(2, 8, 1024, 1024, 128, torch.bfloat16, "cuda", seed=31, kv_heads=4)
    table = dispatch.DETERMINISTIC_ONE_PASS_VARIANTS if kind == "one_pass_det" else dispatch.ONE_PASS_VARIANTS
    window = (-1, 0) if causal else (-1, -1)
    dispatch.remember(dispatch.ChoiceKey.of(q, k, window, kind), table[128][1])
    first = run_op(FlashAttention2Triton, q, k, v, do, causal, None)
    refuse_calls(monkeypatch, launcher, "two_pass_backward", "one_pass_backward")
    _, _, *refs = run_reference(q, k, v, do, causal, None, torch.float64)
    _, _, *plains = run_reference(q, k, v, do, causal, None, torch.bfloat16)
    for _ in range(3):
        again = run_op(FlashAttention2Triton, q, k, v, do, causal, None)
        if kind == "one_pass_det":
            assert all(torch.equal(a, b) for a, b in zip(first, again)), "a replay changed the bits"
        for name, ours, ref, plain in zip(("dQ", "dK", "dV"), again[2:], refs, plains):
            err, base = rel_err(ours, ref), rel_err(plain, ref)
            assert err <= 2 * base + FLOOR[torch.bfloat16], f"{name}: {err:.3g} vs PyTorch {base:.3g}"
    (plan,) = plans.backward_plans.values()
    folds = kind == "one_pass_det" and not causal
    assert gluon_launch.folds_dq(table[128][1], q, k, window, empty_output(q)) == folds
    assert len(plan.replays) == (2 if folds else 3)  # prologue, kernel (and epilogue)
    if which_launcher == "native":
        assert native.sizes() == (1, 1, 0)
