"""The Gluon forward (Hopper): which calls it takes, that every variant (and every `tl` kernel) compiles (on CPU too,
for sm_90), and on an sm_90 GPU that every variant matches float64 reference math for every feature the `tl` forward
has, alone and through the op, eager and compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashsys.ops.attention import attention_reference, window_mask

from .attention_checks import (
    FLOOR,
    assert_matches_reference,
    compile_without_cache_warnings,
    eager_then_compiled,
    make_qkv,
    rel_err,
)

pytest.importorskip("triton")
from flashsys.ops.attention import device_limits, dispatch, gluon, launcher, library_ops  # noqa: E402
from flashsys.ops.attention.gluon import launch as gluon_launch  # noqa: E402

from . import kernel_compile  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER or gluon.kernels() is None,
                                 reason="needs an sm_90 GPU and a Triton with Gluon's Hopper API")


def test_tma_stride_rules():
    """TMA addresses strides that are positive multiples of 16 bytes with a unit last stride; a dim of size 1 is
    never strided. The common layouts pass, the rest go to the `tl` forward."""
    x = torch.randn(2, 8, 64, 64, dtype=torch.bfloat16)
    assert dispatch.tma_addressable(x)
    assert dispatch.tma_addressable(torch.randn(2, 64, 8, 64, dtype=torch.bfloat16).transpose(1, 2))  # (B, N, H, D)
    assert dispatch.tma_addressable(torch.randn(2, 64, 72, dtype=torch.bfloat16)[..., :64])  # padded rows
    assert dispatch.tma_addressable(torch.randn(1, 64, 64, dtype=torch.bfloat16).unsqueeze(1))
    assert not dispatch.tma_addressable(x.transpose(-1, -2))  # last stride not 1
    assert not dispatch.tma_addressable(x[:, :1].expand(2, 8, 64, 64))  # heads by a stride of 0
    assert not dispatch.tma_addressable(torch.randn(2, 64, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte rows


@settings(max_examples=300, deadline=None)
@given(n_q=st.integers(1, 70), n_k=st.integers(1, 70), left=st.integers(-1, 80), right=st.integers(-1, 80))
def test_visible_pairs_counts_the_window_masks_true_entries(n_q, n_k, left, right):
    """The size bar counts the work a mask leaves (B*H*D times the visible pairs), in constant time: it must equal
    the reference mask's count for every shape and window, rows that see no key (Nq > Nk) included."""
    expected = int(window_mask(n_q, n_k, left, right).sum())
    assert dispatch.visible_pairs(n_q, n_k, (left, right)) == expected


def test_the_size_bar_counts_the_pairs_the_kernels_visit():
    """Causal calls cross the bar at twice the B*H*N^2*D of full-mask ones; a window with a left bound counts all of
    N^2 (the Gluon kernels ran every windowed cell measured faster, most of them below the bar by their visible
    pairs). D 128 has a lower bar of its own, and so do D 64's full-mask calls (eager and compiled calls alike; a
    right or left bound keeps D 64 at MIN_WORK); MIN_WORK, set to 0, lowers every head dim's. The GPU test below asks
    `forward_problem` the same."""
    assert set(dispatch.SIZE_BARS) == {(d, m) for d in dispatch.HEAD_DIMS for m in ("full", "bounded")}
    bar = dispatch.MIN_WORK
    assert bar == max(dispatch.SIZE_BARS.values()) == 1 << 34
    full, causal, window = (-1, -1), (-1, 0), (255, 0)
    assert dispatch.min_work(64, causal) == dispatch.min_work(64, window) == dispatch.min_work(64, (-1, 7)) == bar
    assert dispatch.min_work(64, full) == dispatch.min_work(64) == bar >> 1
    assert all(dispatch.min_work(128, w) == bar >> 3 for w in (full, causal, window))
    assert dispatch.size_bars() == "2^34 (D 64; full masks 2^33), 2^31 (D 128)"
    assert dispatch.call_work((16, 16, 1024, 64), (16, 16, 1024, 64), full) == bar
    assert bar // 2 < dispatch.call_work((16, 16, 1024, 64), (16, 16, 1024, 64), causal) < bar
    assert dispatch.call_work((16, 16, 1024, 128), (16, 16, 1024, 128), causal) >= bar
    assert dispatch.call_work((8, 16, 1024, 128), (8, 16, 1024, 128), causal) < bar
    assert dispatch.call_work((2, 16, 1024, 128), (2, 16, 1024, 128), causal) >= dispatch.min_work(128)
    assert dispatch.call_work((1, 16, 1024, 128), (1, 16, 1024, 128), causal) < dispatch.min_work(128)
    big = (1, 16, 8192, 64)
    assert dispatch.call_work(big, big, window) == 16 * 64 * 8192 ** 2 >= bar
    assert dispatch.call_work(big[1:], big[1:], full) == 16 * 64 * 8192 ** 2  # rank 3: (B*H, N, D)
    assert dispatch.call_work((1, 16, 2048, 64), (1, 16, 2048, 64), full) < bar
    assert dispatch.visible_pairs(16384, 16384, window) == 16384 * 256 - 255 * 256 // 2


def test_calls_it_does_not_take_say_why():
    q = torch.randn(1, 2, 64, 64)
    assert dispatch.forward_problem(q, q, q, (-1, -1)) == "not a CUDA tensor"
    if torch.cuda.is_available():
        assert "dtype" in dispatch.forward_problem(q.cuda(), q.cuda(), q.cuda(), (-1, -1))
        assert "head dim" in dispatch.forward_problem(*(torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.float16),) * 3,
                                                (-1, -1))


def _compile_group(group: str) -> dict[str, str]:
    """{label: verdict} of one group of tests/ops/kernel_compile.py, compiled in a subprocess (it installs a stand-in
    driver for the whole process, and needs Triton's compiler, not the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, "-m", "tests.ops.kernel_compile", "--group", group], capture_output=True,
                       text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("group", [g for g in kernel_compile.groups() if g != "tl"])
def test_every_gluon_variant_compiles_for_hopper(group):
    """Every Gluon variant of a (head dim, stage), causal, and the stage's first variant of each kind under a full
    mask and a window too (the code paths those masks select), the forward's variants on trial under a full mask,
    with grouped-query K/V and ragged lengths, compiles for sm_90 on this machine's Triton (CI's newest one; a CPU
    needs no GPU to compile), fits sm_90's shared memory and passes the forward's SASS checks (`verdict`). One
    group a test, so that a run shows its progress."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    if gluon.kernels() is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    compiled = _compile_group(group)
    _, d, stage = group.split(" ")
    variants = [v for v in dispatch.gluon_variants(int(d)) if v.kind in kernel_compile._STAGES[stage]]
    kinds = {v.kind for v in variants}
    firsts = [next(v for v in variants if v.kind == kind) for kind in sorted(kinds)]
    expected = {f"D {d} causal {v.label()}" for v in variants}
    expected |= {f"D {d} {mask} {v.label()}" for mask in ("full", "window") for v in firsts}
    if stage == "forward":
        expected |= {f"D {d} full {v.label()}" for v in dispatch.FORWARD_TRIALS.get(int(d), ())}
    assert set(compiled) == expected
    failed = {label: why for label, why in compiled.items() if why != "ok"}
    assert not failed, failed


def test_every_tl_kernel_compiles_for_hopper():
    """The `tl` kernels (forward, dQ, dK/dV, the one pass's prologue and epilogue, the decode kernels in each of
    their tilings) compile for sm_90 through this machine's Triton, with the specialisation a launch gives them, and
    fit sm_90's shared memory: the interpreter runs their code, but only a compile finds a construct the compiler
    stopped accepting."""
    compiled = _compile_group("tl")
    assert any("decode split" in label for label in compiled) and any("epilogue" in label for label in compiled)
    failed = {label: why for label, why in compiled.items() if why != "ok"}
    assert not failed, failed


def test_every_variant_is_in_a_compile_group():
    """The groups cover every stage that has Gluon variants, at every head dim."""
    covered = {(int(g.split(" ")[1]), kind) for g in kernel_compile.groups() if g != "tl"
               for kind in kernel_compile._STAGES[g.split(" ")[2]]}
    assert {(d, v.kind) for d in dispatch.HEAD_DIMS for v in dispatch.gluon_variants(d)} <= covered


def test_the_compile_check_fails_a_variant_past_sm90_shared_memory():
    """A kernel can compile for sm_90 and still fail to launch there: one that needs more shared memory than a program
    gets (a kernel a few hundred bytes past the limit compiles). The compile check reports it."""
    from types import SimpleNamespace

    from tests.ops.kernel_compile import verdict

    def kernel(shared):
        return SimpleNamespace(metadata=SimpleNamespace(shared=shared), asm={"sass": "", "ptx": ""})

    assert verdict(kernel(gluon_launch.SM90_SHARED_BYTES)) == "ok"
    past = verdict(kernel(gluon_launch.SM90_SHARED_BYTES + 576))
    assert past == f"needs {gluon_launch.SM90_SHARED_BYTES + 576} bytes of shared memory, sm_90 allows 232448"
    assert verdict(ValueError("no layout")) == "ValueError: no layout"


def test_the_compile_check_fails_a_forward_whose_softmax_waits_for_p_v():
    """The forward's softmax must run while its P V product is on the tensor cores; ptxas hoists a wait to the start
    of its basic block, so a source change can undo that without changing a result. The check counts the
    exponentials between the wait for S (one product left running) and the wait for P V in the SASS: a kernel
    with them after the P V wait fails, one with them before passes, and a kernel of another kind is not asked."""
    from types import SimpleNamespace

    from tests.ops.kernel_compile import MIN_EXPONENTIALS_UNDER_PV, exponentials_under_pv, verdict

    exps = "\n".join(f"/*{i:04x}*/ MUFU.EX2 R{i}, R{i};" for i in range(MIN_EXPONENTIALS_UNDER_PV))
    under = f"HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ;\nWARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n{exps}\n" \
            "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\nFMUL R88, R88, R3;"
    after = under.replace(exps, "FMNMX R7, R24, R25, !PT;").replace("FMUL R88", f"{exps}\nFMUL R88")
    assert exponentials_under_pv(under * 2) == [MIN_EXPONENTIALS_UNDER_PV] * 2
    assert exponentials_under_pv(after) == [0]

    def kernel(sass):
        return SimpleNamespace(metadata=SimpleNamespace(shared=1024), asm={"sass": sass, "ptx": ""})

    assert verdict(kernel(under), "D 64 causal pingpong 128x128 3buf 240 regs") == "ok"
    assert "does not run under P V" in verdict(kernel(after), "D 64 causal pingpong 128x128 3buf 240 regs")
    assert "does not run under P V" in verdict(kernel(""), "D 128 full plain 64x64 3buf")
    assert verdict(kernel(after), "D 64 causal dq 64x128 2buf") == "ok"


def test_the_compile_check_fails_a_forward_that_spills_in_its_softmax():
    """A forward whose registers do not hold its softmax's state spills it to local memory in every key tile (a
    float32 P carried from one tile to the next did so at 160 registers a consumer: 125-185 loads and stores each
    softmax). The check counts them between the wait for S and the wait for P V and fails more than a few."""
    from types import SimpleNamespace

    from tests.ops.kernel_compile import (
        MAX_LOCAL_MEMORY_UNDER_PV,
        MIN_EXPONENTIALS_UNDER_PV,
        local_memory_under_pv,
        verdict,
    )

    exps = "\n".join(f"--:-:-:-:1\tMUFU.EX2 R{i}, R{i};" for i in range(MIN_EXPONENTIALS_UNDER_PV))

    def softmax(spills):
        body = "\n".join([exps] + [f"02:1:-:-:1\tSTL [R1+{4 * i:#x}], R2;" for i in range(spills)])
        return f"--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x1;\n{body}\n--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x0;\n"

    few, many = softmax(MAX_LOCAL_MEMORY_UNDER_PV), softmax(MAX_LOCAL_MEMORY_UNDER_PV + 1)
    prologue = "--:-:2:-:1\tLDL.LU R20, [R1+0x4];\n" * 40  # outside every softmax: not counted
    assert local_memory_under_pv(prologue + few + many) == [MAX_LOCAL_MEMORY_UNDER_PV, MAX_LOCAL_MEMORY_UNDER_PV + 1]

    def kernel(sass):
        return SimpleNamespace(metadata=SimpleNamespace(shared=1024), asm={"sass": sass, "ptx": ""})

    label = "D 64 full pingpong 192x128 2buf 160 regs 3 warpgroups"
    assert verdict(kernel(prologue + few + few), label) == "ok"
    assert "spills in the softmax" in verdict(kernel(few + many), label)
    assert verdict(kernel(few + many), "D 64 causal dq 64x128 2buf") == "ok"


def test_the_compile_check_fails_a_kernel_whose_own_barriers_reach_the_forwards_named_barriers():
    """The ping-pong forward passes its turns and K/V slots through named barriers (ids from
    `named_barriers.FIRST_ID`: turns of 256 threads, slots with the id in a register), beside the ones Triton
    numbers from 0 for its warp partitions (128 threads, or the whole program). A Triton that numbered one of its own
    into those ids would complete a turn early or hang it: the check names it, and passes the forward's own and
    Triton's low ids."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from types import SimpleNamespace

    from flashsys.ops.attention.gluon.named_barriers import FIRST_ID
    from tests.ops.kernel_compile import named_barrier_clashes, verdict

    ours = f"bar.sync {FIRST_ID}, 256;\n\tbar.arrive {FIRST_ID + 2}, 256;\n\tbar.arrive %r1070, 288;\n"
    triton = "bar.sync 0, 128;\n\tbarrier.sync 1;\n\tbar.sync 3, 128;\n"
    assert named_barrier_clashes(ours + triton) == []
    clash = f"bar.sync {FIRST_ID + 1}, 128;\n\tbarrier.sync.aligned {FIRST_ID};\n"
    assert named_barrier_clashes(ours + clash) == [f"id {FIRST_ID}, all threads", f"id {FIRST_ID + 1}, 128 threads"]
    # A turn's thread count at an id past the turns' (a slot's, say) is not one of the forward's own.
    assert named_barrier_clashes(ours + f"bar.sync {FIRST_ID + 3}, 256;\n") == [f"id {FIRST_ID + 3}, 256 threads"]

    def kernel(ptx):
        return SimpleNamespace(metadata=SimpleNamespace(shared=1024), asm={"sass": "", "ptx": ptx})

    assert verdict(kernel(ours + triton), "D 64 causal dq 64x128 2buf") == "ok"
    assert "reach the forward's" in verdict(kernel(clash), "D 64 causal dq 64x128 2buf")


@pytest.mark.parametrize("variant", [gluon_launch.Variant("pingpong", 256, 128, 2, 160, warpgroups=4),
                                     gluon_launch.Variant("persistent", 128, 128, 2, 240, warpgroups=1),
                                     gluon_launch.Variant("pingpong", 160, 128, 2, 160, warpgroups=3)],
                         ids=lambda v: v.label().replace(" ", "-"))
def test_a_pingpong_variant_of_the_wrong_shape_is_refused_naming_it(variant):
    """Two or three consumer warpgroups of a multiple of 64 rows each: another shape is refused before anything is
    compiled, where the kernels would otherwise split the tile into the wrong number of boxes."""
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"warpgroups must be 2 or 3 and block_m a multiple of 64 \* warpgroups") as e:
        gluon_launch.compile_only(variant, q, q, q, (-1, 0), 0.125)
    assert variant.label() in str(e.value)


def test_variants_on_trial_are_not_chosen():
    """A forward variant on trial compiles on every CI run and is tested and timed on a GPU, but the choice never
    takes it: no choice key's candidates hold it."""
    for d, trials in dispatch.FORWARD_TRIALS.items():
        assert d in dispatch.HEAD_DIMS and trials
        for bounds in ((True, False), (False, False), (True, True)):
            for dtype in (torch.float16, torch.bfloat16):
                key = dispatch.ChoiceKey(d, dtype, *bounds, 16384, "forward")
                assert key.candidates() and not set(trials) & set(key.candidates())


# (batch, heads, kv heads, Nq, Nk, window, rank-3 / (B, N, H, D) layout, dtype): each case masks something.
CASES = [
    (2, 4, 4, 1000, 1000, (-1, 0), "bhnd", torch.bfloat16),  # causal, ragged last tile
    (1, 4, 2, 300, 1000, (-1, -1), "bhnd", torch.float16),  # Nq < Nk, grouped-query
    (1, 2, 2, 1000, 300, (-1, 0), "bhnd", torch.bfloat16),  # Nq > Nk causal: the first 700 rows see no key
    (1, 8, 2, 1024, 1024, (128, 0), "bnhd", torch.bfloat16),  # sliding window, (B, N, H, D) strides, GQA
    (2, 2, 2, 777, 777, (64, 64), "bhnd", torch.float16),  # two-sided window
    (3, 1, 1, 512, 512, (-1, 0), "bnd", torch.bfloat16),  # rank 3
]


def _inputs(batch, heads, kv_heads, n_q, n_k, d, layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def draw(h, n):
        shape = (batch, n, h, d) if layout == "bnhd" else (batch, h, n, d)
        t = torch.randn(*shape, generator=g).to("cuda", dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t

    q, k, v = draw(heads, n_q), draw(kv_heads, n_k), draw(kv_heads, n_k)
    if layout == "bnd":
        q, k, v = (t[:, 0] for t in (q, k, v))
    return q, k, v


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for table in (dispatch.FORWARD_VARIANTS, dispatch.FORWARD_TRIALS)
                                     for d, vs in table.items() for v in vs],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_each_variant_matches_reference_gpu(variant, case):
    _check_variant(*variant, case)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-w{c[5]}-{c[6]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("variant", [(d, v) for d, vs in dispatch.FORWARD_VARIANTS.items() for v in vs
                                     if v.kind == "persistent"],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_persistent_programs_run_many_query_tiles_each_gpu(variant, case, monkeypatch):
    """The persistent forward with 5 programs: each runs query tiles of several heads (and of both ends of a causal
    head) one after another, its ring of buffers, turns and staging boxes carried from one to the next."""
    monkeypatch.setattr(gluon_launch, "usable_sms", lambda t: 5)
    _check_variant(*variant, case)


# Right-bounded cases whose grids, with an L2 that holds two K/V heads' K and V, run in several sections.
SECTIONED_CASES = [
    (2, 4, 4, 1000, 1000, (-1, 0), "bhnd", torch.bfloat16),  # four sections of two pairs
    (1, 5, 5, 700, 700, (-1, 0), "bhnd", torch.float16),  # two, two and a short one
    (2, 8, 2, 1000, 1000, (-1, 0), "bnhd", torch.bfloat16),  # grouped-query: two K/V heads are 8 pairs
    (3, 1, 1, 512, 512, (128, 0), "bnd", torch.bfloat16),  # rank 3, a window: two and one
]


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("case", SECTIONED_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-w{c[5]}-{c[6]}")
@pytest.mark.parametrize("variant", [(d, v) for d, vs in dispatch.FORWARD_VARIANTS.items() for v in vs
                                     if v.kind != "persistent"],
                         ids=lambda dv: f"d{dv[0]}-{dv[1].label().replace(' ', '-')}")
def test_a_grid_in_sections_computes_every_query_tile_once_gpu(variant, case, monkeypatch):
    """The forwards of one program per query tile run a right-bounded grid in sections (`tiles.program_start`);
    with the L2 read as holding two K/V heads' K and V, the sections hold fewer pairs than the grid: every query
    tile of every (batch, head) still comes out right (O starts as NaN, so a tile no program ran fails)."""
    d = variant[0]
    batch, heads, kv_heads, n_q, n_k, window, layout, dtype = case
    monkeypatch.setattr(device_limits, "_l2_bytes", lambda index: 2 * (2 * n_k * d * dtype.itemsize))
    k = torch.empty(batch, kv_heads, n_k, d, dtype=dtype, device="cuda")
    assert gluon_launch.heads_per_section(k, batch * heads, heads // kv_heads, window) < batch * heads
    _check_variant(*variant, case)


def _check_variant(d, var, case):
    """O and L of one variant's launch against float64, O within twice plain PyTorch's error."""
    batch, heads, kv_heads, n_q, n_k, window, layout, dtype = case
    q, k, v = _inputs(batch, heads, kv_heads, n_q, n_k, d, layout, dtype, seed=n_q + d)
    scale = d ** -0.5
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device="cuda")
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    gluon_launch.launch(var, gluon_launch.ForwardTensors(q, k, v, o, lse), window, scale)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), False, scale, window)  # repeats K/V
    o_plain, _ = attention_reference(q, k, v, False, scale, window)
    err, base = rel_err(o, o_ref), rel_err(o_plain, o_ref)
    assert err <= 2 * base + FLOOR[dtype], f"O: error {err:.3g} vs plain PyTorch {base:.3g}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "L: rows that see no key differ"
    finite = ~torch.isinf(lse_ref)
    assert (lse[finite].double() - lse_ref[finite]).abs().max().item() <= 1e-4 * (1 + lse_ref[finite].abs().max())
    assert (o[~finite] == 0).all(), "O of a row that sees no key is 0"


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_op_takes_gluon_forward_and_trains_gpu(causal, monkeypatch):
    """Through FlashAttention2Triton a large enough call runs the Gluon forward (its choice is recorded), and O, L
    and the gradients of the `tl` backward behind it match float64 as every other path must."""
    from flashsys.ops.attention import FlashAttention2Triton

    monkeypatch.setattr(dispatch, "MIN_WORK", 0)  # a shape float64 reference math can check in seconds
    q, k, v, do = make_qkv(1, 16, 2048, 2048, 64, torch.bfloat16, "cuda", seed=3, kv_heads=4)
    assert dispatch.takes_forward(q, k, v, (-1, 0) if causal else (-1, -1))
    dispatch.forget_choices()
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, causal, None)
    assert dispatch.chosen_variants(), "the Gluon forward did not run"


@hopper_only
@pytest.mark.gpu
def test_compiled_op_runs_the_gluon_forward_bit_for_bit_gpu(monkeypatch):
    """torch.compile's graph calls the Gluon forward through its custom op, with the variant eager chose: equal."""
    from flashsys.ops.attention import FlashAttention2Triton

    torch._dynamo.reset()
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    q, k, v, _ = make_qkv(1, 16, 4096, 4096, 128, torch.bfloat16, "cuda", seed=5)
    assert library_ops.traced_forward(q, k, v, (-1, 0)) is library_ops.gluon_forward_op
    for a, b in zip(*eager_then_compiled(FlashAttention2Triton, q, k, v, True)):
        assert torch.equal(a, b)


@hopper_only
@pytest.mark.gpu
def test_small_switched_off_and_unaligned_calls_take_the_tl_forward_gpu(monkeypatch):
    """Below the size bar (`dispatch.min_work`), for tensors TMA cannot address, once the path turned itself off, and
    with FLASHSYS_GLUON=0, the `tl` forward runs."""
    q = torch.randn(1, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)  # 2^30 full
    full = (-1, -1)
    assert "the size bar" in dispatch.forward_problem(q, q, q, full)
    wide = torch.randn(1, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)  # 2^31 full, half of it causal
    assert dispatch.forward_problem(wide, wide, wide, full) is None  # D 128's lower bar
    assert "the size bar" in dispatch.forward_problem(wide, wide, wide, (-1, 0))
    long = torch.randn(2, 16, 2048, 64, device="cuda", dtype=torch.bfloat16)  # 2^33 full, about half of it causal
    assert dispatch.forward_problem(long, long, long, full) is None  # D 64's full-mask bar
    assert "the size bar" in dispatch.forward_problem(long, long, long, (-1, 0))
    big = torch.randn(1, 16, 8192, 64, device="cuda", dtype=torch.bfloat16)
    assert dispatch.takes_forward(big, big, big, full) and dispatch.takes_forward(big, big, big, (-1, 0))
    assert dispatch.takes_forward(big, big, big, (255, 0))  # a window counts all of N^2 (`call_work`)
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    assert dispatch.takes_forward(q, q, q, full)
    unaligned = torch.randn(16 * 1024 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(1, 16, 1024, 64)
    assert dispatch.forward_problem(unaligned, unaligned, unaligned, full) is None
    assert not dispatch.takes_forward(unaligned, q, q, full)
    with pytest.warns(RuntimeWarning, match="Gluon kernels are off"):
        dispatch.disable("no variant ran: (a test)")
    try:
        assert dispatch.forward_problem(q, q, q, full) == "no variant ran: (a test)" and "off" in dispatch.status()
    finally:
        dispatch.forget_choices()
    monkeypatch.setenv("FLASHSYS_GLUON", "0")
    assert dispatch.forward_problem(q, q, q, full) == "FLASHSYS_GLUON=0"


def test_choice_takes_the_fastest_median_and_leaves_out_variants_that_fail(monkeypatch):
    """The first call of a key times every candidate in interleaved rounds of 100 ms each (shorter timings picked
    variants that ran slower over longer runs); the lowest median wins (one slow round does not decide), a candidate
    that raises is left out, and where all raise the path turns itself off for the process with a warning naming
    each error (the `tl` forward then runs)."""
    from flashsys.ops.attention import timed_choice

    d64 = dispatch.FORWARD_VARIANTS[64]
    draws = {d64[0]: iter([1.0, 9.0, 1.0, 1.0, 1.0]), d64[1]: iter([2.0, 0.5, 2.0, 2.0, 2.0])}
    current = {}
    reps = []

    def run(variant):
        current["v"] = variant

    def fake_bench(fn, rep_ms, flush):
        assert flush == "one buffer for the choice"
        reps.append(rep_ms)
        fn()
        variant = current["v"]
        if variant not in draws:
            raise RuntimeError("out of resources: shared memory")
        return next(draws[variant])

    monkeypatch.setattr(timed_choice, "gpu_ms", fake_bench)
    monkeypatch.setattr(timed_choice, "flush_buffer", lambda device=None: "one buffer for the choice")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU builds of torch raise
    monkeypatch.setattr(dispatch, "autotune_enabled", lambda: True)  # CPU CI runs the interpreter, which is off
    dispatch.forget_choices()
    try:
        key = dispatch.ChoiceKey(64, torch.bfloat16, True, False, 16384)
        assert dispatch.chosen(key) is None  # nothing chosen yet: the caller times the candidates
        assert launcher.choose_variant(key, run) == d64[0]
        assert dispatch.chosen_variants() == {key: d64[0]} and dispatch.chosen(key) == d64[0]
        # two candidates timed every round, each failing one once (not again)
        assert len(reps) == 2 * dispatch.CHOICE_ROUNDS + len(d64) - 2 and set(reps) == {dispatch.CHOICE_REP_MS}
        draws.clear()
        with pytest.warns(RuntimeWarning, match="Gluon kernels are off.*out of resources"):
            assert launcher.choose_variant(key._replace(bucket=1024), run) is None
        assert dispatch.unavailable_reason().startswith("no variant ran")
        with pytest.raises(ValueError, match="cannot run the 'forward' stage"):
            dispatch.remember(key, dispatch.DQ_VARIANTS[64][1])
    finally:
        dispatch.forget_choices()


def test_torch_compile_traces_the_path_checks_without_warnings(monkeypatch, recwarn):
    """Under torch.compile Dynamo traces the checks that pick the Gluon or `tl` op (`problem`). A functools cache on
    any of them made every compile on a Hopper GPU warn twice ("Dynamo detected a call to a functools.lru_cache-
    wrapped function ... Silent incorrectness is only a potential risk"). The checks trace without a warning and
    give what they give eagerly."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    expected = 1 + 2 * (gluon.kernels() is None)
    monkeypatch.setattr(dispatch, "_is_hopper", {})  # the first calls happen while tracing
    monkeypatch.setattr(gluon, "_loaded", [])

    def checks(x):
        return x + dispatch._hopper(0) + 2 * (gluon.kernels() is None)

    assert compile_without_cache_warnings(checks, torch.zeros(2), recwarn).tolist() == [expected] * 2
    assert dispatch._is_hopper == {0: True} and len(gluon._loaded) == 1  # cached as eagerly


def test_switches_take_only_on_or_off(monkeypatch):
    """FLASHSYS_GLUON and FLASHSYS_TRITON_AUTOTUNE read as the native launcher's switch does: 'false' is off (it
    used to read as on), and a value that is neither raises naming the variable."""
    from flashsys.ops.attention.triton_env import autotune_enabled

    monkeypatch.setenv("FLASHSYS_GLUON", "false")
    assert not dispatch.enabled()
    monkeypatch.setenv("FLASHSYS_GLUON", "yes")
    assert dispatch.enabled()
    monkeypatch.setenv("FLASHSYS_GLUON", "maybe")
    with pytest.raises(ValueError, match="FLASHSYS_GLUON='maybe'"):
        dispatch.enabled()
    monkeypatch.setenv("FLASHSYS_TRITON_AUTOTUNE", "off")
    assert not autotune_enabled()
    monkeypatch.setenv("FLASHSYS_TRITON_AUTOTUNE", "2")
    with pytest.raises(ValueError, match="FLASHSYS_TRITON_AUTOTUNE='2'"):
        autotune_enabled()


def test_a_gluon_replay_launches_copies_of_its_descriptors_on_the_new_tensors(recwarn):
    """An eager plan replays a Gluon launch by copying the first call's TMA descriptors onto the new tensors (rank 4,
    as the kernels take them) and passing every other argument as it was; it keeps none of the first call's tensors.
    The native launcher takes a replay of a kernel it cannot launch itself (this stand-in has no CUDA function) as a
    Python launch, without a warning."""
    import dataclasses

    from flashsys.ops.attention.replay import native, plans

    @dataclasses.dataclass
    class Descriptor:  # what the replay needs of Triton's: a dataclass with a base tensor
        base: torch.Tensor
        block_shape: list

    launches = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args, stream=None: launches.append((grid, args, stream))

    first = (torch.randn(2, 4, 8, 16), torch.randn(2, 8, 16))
    templates = (Descriptor(first[0], [1, 1, 8, 16]), Descriptor(first[1].unsqueeze(1), [1, 1, 8, 16]),
                 torch.zeros(3))
    params = (*templates, 7, 0.5, 64)
    assert gluon_launch.GluonReplay.recordable(params, 3)
    assert not gluon_launch.GluonReplay.recordable((object(), 1), 1)
    replay = gluon_launch.GluonReplay(Compiled(), (5,), params, 3)
    new = (torch.randn(2, 4, 8, 16), torch.randn(2, 8, 16), torch.randn(3))
    replay(*new, stream=9)
    (grid, args, stream), = launches
    assert grid == (5, 1, 1) and stream == 9 and args[3:] == (7, 0.5, 64) and args[2] is new[2]
    assert args[0].base is new[0] and args[0].block_shape == [1, 1, 8, 16]
    assert args[1].base.shape == (2, 1, 8, 16) and args[1].base.data_ptr() == new[1].data_ptr()
    assert templates[0].base is first[0] and templates[1].base.data_ptr() == first[1].data_ptr()
    # the replay (kept with its plan for the process's life) holds none of the first call's tensors
    assert not any(isinstance(x, torch.Tensor) or getattr(x, "base", None) is not None
                   for x in (*replay.templates, *replay.rest))
    spec = plans.Replay(replay, (0, 1, 2), (), None, None)
    assert native.launch_specs((spec,)) == [(replay, [0, 1, 2], ())] and not recwarn.list


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_repeated_gluon_calls_replay_plans_gpu(d, monkeypatch):
    """Repeated eager calls of a signature the Gluon kernels take (the forward and dQ; at D 128 the dK/dV kernel
    too) replay a plan: no checks, no variant choice, no descriptor validation, and the float64 reference's results
    on fresh inputs. Rank 3 and a window at D 64 (the replay makes rank-4 views), GQA and causal at D 128. A Gluon dQ
    variant is the only dQ candidate here (the `tl` one may win the timing), and the two passes the only backward
    (the deterministic one pass is not recorded as a plan)."""
    from flashsys.ops.attention import FlashAttention2Triton, flash_triton, replay
    from flashsys.ops.attention.replay import plans

    from .attention_checks import assert_matches_reference, make_qkv, refuse_calls

    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    monkeypatch.setitem(dispatch.DQ_VARIANTS, d, dispatch.DQ_VARIANTS[d][1:2])
    monkeypatch.setitem(dispatch.DETERMINISTIC_ONE_PASS_VARIANTS, d, (gluon_launch.TL_KERNEL,))
    dispatch.forget_choices()
    replay.clear()
    shape, window, kv_heads = ((2, None, 777, 777), (64, 0), None) if d == 64 else ((1, 8, 1024, 1024), None, 4)
    try:
        for seed in range(2):  # the first call chooses variants and autotunes; the second makes the plans
            q, k, v, do = make_qkv(*shape, d, torch.bfloat16, "cuda", seed=seed, kv_heads=kv_heads)
            assert_matches_reference(FlashAttention2Triton, q, k, v, do, window is None, None, window)
        assert len(plans.forward_plans) == 1 and len(plans.backward_plans) == 1
        chosen = {key.kernel: var for key, var in dispatch.chosen_variants().items()}
        assert chosen.pop("one_pass_det") == gluon_launch.TL_KERNEL  # the two passes, asked first
        want = {"forward", "dq"} if d == 64 else {"forward", "dq", "dkdv"}
        assert set(chosen) == want, "the Gluon kernels did not run"
        assert all(var.kind != "tl" for var in chosen.values())
        refuse_calls(monkeypatch, gluon_launch, "launch")
        refuse_calls(monkeypatch, flash_triton, "check_attention_inputs")
        refuse_calls(monkeypatch, launcher, "backward")
        for seed in range(2, 4):
            q, k, v, do = make_qkv(*shape, d, torch.bfloat16, "cuda", seed=seed, kv_heads=kv_heads)
            assert_matches_reference(FlashAttention2Triton, q, k, v, do, window is None, None, window)
    finally:
        replay.clear()
        dispatch.forget_choices()
