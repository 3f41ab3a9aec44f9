"""The split-key decode path (a few queries against a long cache): the same O, L and gradients as float64 reference
math, with GQA, windows and bottom-right causal alignment, and taken only where it should be; and
`flash_attention_decode` over left-padded caches (`cache_start`) on both backends."""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import FlashAttention2Triton, attention_reference, flash_attention_decode
from flashsys.ops.attention.triton import decode

from .attention_checks import assert_matches_reference, make_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture
def decode_calls(monkeypatch):
    """Every decode launch (the full path's: replays of its plan are not counted) as (q's shape, whether it split
    the keys), with the path taken from 64 keys so that float64 reference math checks it at small sizes."""
    calls = []
    forward = decode.forward

    def recorded(*args, **kwargs):
        launches, scratch = forward(*args, **kwargs)
        calls.append((args[0].shape, bool(scratch)))
        return launches, scratch

    monkeypatch.setattr(decode, "forward", recorded)
    monkeypatch.setattr(decode, "MIN_KEYS", 64)
    return calls


def _pin_split_path(splits: bool, request, monkeypatch) -> None:
    """Make the decode kernels take one path at any size: a GPU of one program (every call in one split, written
    directly) or of 64 with splits of 64 keys or more (the keys split, then combined). Plans made under the other
    are forgotten before and after."""
    from flashsys.ops.attention import replay

    monkeypatch.setattr(decode, "program_target", lambda device: 64 if splits else 1)
    monkeypatch.setattr(decode, "SPLIT_MIN_KEYS", 64)
    replay.clear()
    request.addfinalizer(replay.clear)


@pytest.fixture(params=["one split", "splits"])
def split_path(request, monkeypatch):
    """Both decode paths (`_pin_split_path`); the value: whether the keys are split."""
    _pin_split_path(request.param == "splits", request, monkeypatch)
    return request.param == "splits"


CASES = [  # (n_q, n_k, heads, kv_heads, head_dim, window)
    (1, 300, 4, 2, 64, None),
    (1, 257, 8, 1, 32, (-1, 0)),
    (3, 200, 4, 1, 32, (50, 0)),
    (16, 130, 2, 2, 16, (-1, 0)),
    (2, 190, 8, 2, 40, (7, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"nq{c[0]}-nk{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-w{c[5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_the_reference(case, dtype, decode_calls, split_path):
    n_q, n_k, heads, kv_heads, d, window = case
    q, k, v, do = make_qkv(2, heads, n_q, n_k, d, dtype, DEVICE, seed=n_k, kv_heads=kv_heads)
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, False, None, window)
    assert decode_calls, "the decode kernels did not run"
    assert all(split == split_path for _, split in decode_calls)


def test_decode_writes_into_the_inputs_layout(decode_calls, split_path):
    """(B, N, H, D) inputs (a model's permuted projections) get a (B, N, H, D) output from either path."""
    q, k, v = (torch.randn(2, n, h, 32, device=DEVICE).transpose(1, 2) for n, h in ((2, 4), (150, 2), (150, 2)))
    out = FlashAttention2Triton.apply(q, k, v, True)
    assert out.stride(1) < out.stride(2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
        attn_mask=torch.ones(2, 150, dtype=torch.bool, device=DEVICE).tril(148))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert [split for _, split in decode_calls] == [split_path]


def test_splits_fill_one_wave():
    """As many splits as keep every program in one wave, at least SPLIT_MIN_KEYS keys each; one split where the
    programs alone fill more than half the wave."""
    assert decode.splits(32768, programs=8, target=132, block_n=128) == (16, 2048)
    assert decode.splits(1024, programs=8, target=132, block_n=128) == (4, 256)
    assert decode.splits(8192, programs=64, target=132, block_n=128) == (2, 4096)
    assert decode.splits(8192, programs=67, target=132, block_n=128) == (1, 8192)
    assert decode.splits(1000, programs=1, target=132, block_n=64) == (4, 256)
    for n_k, programs in ((777, 3), (5000, 20), (130, 1)):
        n_splits, split_len = decode.splits(n_k, programs, 132, 64)
        assert split_len % 64 == 0 and (n_splits - 1) * split_len < n_k <= n_splits * split_len
        assert programs * n_splits <= 132 or n_splits == 1


def test_tiling_shares_an_sm_where_short_programs_outnumber_them():
    """Whole-SM tiles (three stages of TILE_BYTES) while the programs fit one wave or read long caches; half-size
    tiles with three stages up to twice the SMs, two stages (less shared memory a program, more programs an SM)
    beyond."""
    assert decode.tiling(programs=132, target=132, n_k=1024, block_d=128, element_size=2) == (128, 3)
    assert decode.tiling(programs=133, target=132, n_k=1024, block_d=128, element_size=2) == (64, 3)
    assert decode.tiling(programs=264, target=132, n_k=4096, block_d=128, element_size=2) == (64, 3)
    assert decode.tiling(programs=512, target=132, n_k=1024, block_d=128, element_size=2) == (64, 2)
    assert decode.tiling(programs=512, target=132, n_k=4097, block_d=128, element_size=2) == (128, 3)
    assert decode.tiling(programs=512, target=132, n_k=1024, block_d=256, element_size=4) == (16, 2)
    assert decode.tiling(programs=8, target=132, n_k=1024, block_d=16, element_size=2) == (128, 3)


def test_tiling_fits_the_shared_memory_of_smaller_gpus():
    """The estimate covers what Triton allocates for sm_90 (launch-specialised, D 128 bf16, and D 64 at 128 keys:
    139,264 / 71,680 / 38,912 / 71,680 bytes); under a smaller limit the tiling drops stages, then halves its tiles,
    and on Hopper (227 KB) nothing changes."""
    compiled = {(128, 128, 3): 139_264, (64, 128, 3): 71_680, (64, 128, 2): 38_912, (128, 64, 3): 71_680}
    for (block_n, block_d, stages), used in compiled.items():
        assert used <= decode.shared_bytes(block_n, block_d, 2, stages) <= used + 2048
    whole = dict(programs=8, target=132, n_k=8192, block_d=128, element_size=2)
    assert decode.tiling(**whole, limit=232_448) == decode.tiling(**whole) == (128, 3)
    assert decode.tiling(**whole, limit=101_376) == (128, 2)  # sm_86 / sm_89
    assert decode.tiling(**whole, limit=60_000) == (64, 2)
    short = dict(programs=512, target=132, n_k=1024, block_d=128, element_size=2)
    assert decode.tiling(**short, limit=101_376) == decode.tiling(**short) == (64, 2)
    assert decode.shared_limit(torch.device("cpu")) is None


def test_rank3_inputs_and_strided_views(decode_calls):
    """(batch, seq, head_dim) inputs, and a cache read through a non-contiguous view, as a cache slice is."""
    q, k, v, do = make_qkv(3, 0, 2, 150, 32, torch.float32, DEVICE, seed=5)
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, 0.3)
    big_k, big_v = (torch.randn(2, 2, 400, 32, device=DEVICE) for _ in range(2))
    q, _, _, do = make_qkv(2, 4, 1, 150, 32, torch.float32, DEVICE, seed=6, kv_heads=2)
    assert_matches_reference(FlashAttention2Triton, q, big_k[:, :, 100:250], big_v[:, :, 100:250], do, True, None)
    assert len(decode_calls) >= 2


def test_the_decode_path_is_taken_only_for_a_few_queries_over_many_keys(decode_calls):
    for n_q, n_k, taken in ((17, 300, False), (1, 63, False), (16, 300, True)):
        decode_calls.clear()
        q, k, v, _ = make_qkv(1, 2, n_q, n_k, 16, torch.float32, DEVICE, seed=1)
        FlashAttention2Triton.apply(q, k, v, True)
        assert bool(decode_calls) == taken, (n_q, n_k)
    assert not decode.takes(4, 4096, kv_group=32, varlen=False)  # 128 rows: more than one program holds
    assert not decode.takes(1, 4096, kv_group=1, varlen=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n_k", [(1, 32768), (16, 4096), (64, 1024)])
def test_decode_at_serving_sizes_gpu(batch, n_k, decode_calls):
    q, k, v, do = make_qkv(batch, 32, 1, n_k, 128, torch.bfloat16, DEVICE, seed=batch, kv_heads=8)
    out = FlashAttention2Triton.apply(q, k, v, True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert decode_calls
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("which_launcher", ["python", "native"])
def test_repeated_decode_calls_replay_their_plan(decode_calls, split_path, which_launcher, request, monkeypatch):
    """A second call of the same signature replays the recorded launches, the split path's with fresh partials (the
    native node allocates them as the Python replay does): the same bits, no full path."""
    from flashsys.ops.attention.replay import native, plans

    from .attention_checks import select_launcher

    select_launcher(which_launcher, request, monkeypatch)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 1, 200, 32, torch.float32, DEVICE, seed=9, kv_heads=2)[:3])
    first = FlashAttention2Triton.apply(q, k, v, True)
    q2 = q + 1
    second = FlashAttention2Triton.apply(q2, k, v, True)
    third = FlashAttention2Triton.apply(q, k, v, True)
    assert len(decode_calls) == 1
    (plan,) = plans.forward_plans.values()
    assert len(plan.replays) == (2 if split_path else 1) and bool(plan.scratch) == split_path
    if which_launcher == "native":
        assert plan.native and native.sizes()[0] == 1
        assert type(third.grad_fn).__name__ == "FlashAttention2TritonNativeBackward"
    assert torch.equal(third, first)
    expected = torch.nn.functional.scaled_dot_product_attention(q2.double(), k.double().repeat_interleave(2, 1),
                                                                v.double().repeat_interleave(2, 1))
    torch.testing.assert_close(second.detach().double(), expected.detach(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ flash_attention_decode: left-padded caches


def _masked_reference(q, k, v, key_mask, causal, window, dtype):
    """softmax over the keys each row's key_mask holds and its window allows (bottom-right aligned over the whole
    cache), in `dtype`; a query that sees no key outputs 0."""
    rank3 = q.dim() == 3
    q, k, v = (t[:, None] if rank3 else t for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    q, k, v = q.to(dtype), k.repeat_interleave(group, 1).to(dtype), v.repeat_interleave(group, 1).to(dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    left, right = window if window is not None else (-1, 0 if causal else -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=q.device)[None, :]
    seen = key_mask[:, None, None, :].expand(-1, 1, n_q, -1)
    if right >= 0:
        seen = seen & (j <= i + right)
    if left >= 0:
        seen = seen & (j >= i - left)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s if dtype == torch.float64 else s.float(), -1).nan_to_num(0.0).to(dtype)
    out = p @ v
    return out[:, 0] if rank3 else out


def _per_row_reference(q, k, v, starts, causal, window, dtype):
    """Each batch row over its keys from its start on (positions stay cache indices: the queries are the last ones
    and the alignment is bottom-right), in `dtype`; a row that starts past its last key outputs 0."""
    keys = torch.arange(k.shape[-2], device=k.device)[None, :] >= starts.to(k.device)[:, None]
    return _masked_reference(q, k, v, keys, causal, window, dtype)


DECODE_CASES = [  # (n_q, n_k, heads, kv_heads, head_dim, causal, window)
    (1, 300, 4, 2, 64, True, None),
    (3, 200, 4, 1, 32, True, (50, 0)),
    (16, 130, 2, 2, 16, False, None),
    (2, 190, 8, 2, 40, False, (7, 3)),
    (1, 150, 0, 0, 32, True, None),  # rank 3: (batch, seq, head_dim)
]


@pytest.fixture(params=["torch", "triton-one-split", "triton-splits"])
def decode_backend(request, monkeypatch):
    """Each backend of `flash_attention_decode`, the Triton one on both split paths (`_pin_split_path`)."""
    if request.param != "torch":
        _pin_split_path(request.param == "triton-splits", request, monkeypatch)
    return request.param.split("-")[0]


def _assert_decoded(out, q, exact, plain, decode_calls, backend):
    """A decode call's output against float64 (`exact`), within twice the error of the reference in the inputs' dtype
    (`plain`); batch row 3 sees no key and outputs 0; the decode kernels ran on the Triton backend only."""
    assert out.dtype == q.dtype and out.shape == q.shape
    tolerance = 2 * (plain.double() - exact).abs().max().item() + 1e-6
    assert (out.double() - exact).abs().max().item() <= tolerance
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert bool(decode_calls) == (backend == "triton")


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"nq{c[0]}-nk{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-c{c[5]}-w{c[6]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_start_skips_each_rows_padding(case, dtype, decode_backend, decode_calls):
    n_q, n_k, heads, kv_heads, d, causal, window = case
    q, k, v, _ = make_qkv(4, heads, n_q, n_k, d, dtype, DEVICE, seed=n_k + n_q, kv_heads=kv_heads)
    # No padding; a row whose start falls past the first splits; one whose queries start exactly there; one that
    # sees no key at all.
    starts = torch.tensor([0, n_k - 70, n_k - n_q, n_k], device=DEVICE)
    out = flash_attention_decode(q, k, v, cache_start=starts, causal=causal, window_size=window,
                                 backend=decode_backend)
    exact = _per_row_reference(q, k, v, starts, causal, window, torch.float64)
    plain = _per_row_reference(q, k, v, starts, causal, window, dtype)
    _assert_decoded(out, q, exact, plain, decode_calls, decode_backend)


def test_without_cache_start_decoding_is_flash_attention(decode_backend):
    q, k, v, _ = make_qkv(2, 8, 2, 160, 32, torch.float32, DEVICE, seed=3, kv_heads=2)
    expected = attention_reference(q.double(), k.double(), v.double(), True)[0]
    out = flash_attention_decode(q, k, v, causal=True, backend=decode_backend)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_float64_runs_on_the_pytorch_path():
    q, k, v, _ = make_qkv(2, 4, 1, 50, 16, torch.float64, "cpu", seed=4, kv_heads=2)
    starts = torch.tensor([3, 20])
    out = flash_attention_decode(q, k, v, cache_start=starts, causal=True, backend="torch")
    expected = _per_row_reference(q, k, v, starts, True, None, torch.float64)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
def test_cache_starts_read_once_are_still_checked_against_each_calls_keys():
    """A GPU tensor's starts are read back once; a later call with fewer keys still refuses the ones past them."""
    q, k, v, _ = make_qkv(2, 4, 1, 600, 32, torch.float16, DEVICE, seed=2, kv_heads=2)
    starts = torch.tensor([0, 550], device=DEVICE)
    flash_attention_decode(q, k, v, cache_start=starts, causal=True)
    with pytest.raises(ValueError, match=r"in \[0, 500\]"):
        flash_attention_decode(q, k[:, :, :500], v[:, :, :500], cache_start=starts, causal=True)


@pytest.mark.parametrize("change,error,match", [
    (dict(q=(2, 4, 17, 16)), ValueError, "at most 16 queries"),
    (dict(q=(2, 64, 2, 16), kv_heads=1), ValueError, "64 rows per K/V head"),
    (dict(cache_start=torch.tensor([0, 1, 2])), ValueError, r"shape \(batch,\) = \(2,\)"),
    (dict(cache_start=torch.tensor([0.0, 1.0])), ValueError, "int32 or int64"),
    (dict(cache_start=torch.tensor([0, 61])), ValueError, r"in \[0, 60\]"),
    (dict(cache_start=torch.tensor([-1, 0])), ValueError, r"in \[0, 60\]"),
    (dict(grad=True), RuntimeError, "computes no gradients"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
], ids=["17-queries", "group-rows", "start-shape", "start-dtype", "start-past-the-keys", "start-negative", "grad",
        "backend"])
def test_decode_refuses_what_it_cannot_compute(change, error, match):
    q_shape = change.get("q", (2, 4, 1, 16))
    kv_heads = change.get("kv_heads", 2)
    q = torch.randn(q_shape)
    k, v = (torch.randn(2, kv_heads, 60, 16) for _ in range(2))
    if change.get("grad"):
        q.requires_grad_()
    with pytest.raises(error, match=match):
        flash_attention_decode(q, k, v, cache_start=change.get("cache_start", torch.tensor([0, 5])), causal=True,
                               backend=change.get("backend", "torch"))
    with torch.no_grad():  # without grad mode the same call runs
        if change.get("grad"):
            flash_attention_decode(q, k, v, causal=True, backend="torch")


def test_triton_backend_on_cpu_without_interpreter_names_the_ops_pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(2, 4, 1, 16)
    k, v = (torch.randn(2, 2, 600, 16) for _ in range(2))
    with pytest.raises(ValueError, match=r"need CUDA tensors.*flash_attention_decode\(\.\.\., backend='torch'\)"):
        flash_attention_decode(q, k, v, causal=True, backend="triton")


def test_repeated_decode_op_calls_replay_their_plan(decode_calls, split_path):
    """Every layer of every generation step calls with one signature: the first call records its launches, later
    ones replay them with their own cache starts (no full path), computing the same."""
    from flashsys.ops.attention.replay import plans

    q, k, v, _ = make_qkv(3, 4, 1, 200, 32, torch.float32, DEVICE, seed=9, kv_heads=2)
    starts, later = torch.tensor([0, 50, 120], device=DEVICE), torch.tensor([10, 0, 199], device=DEVICE)
    first = flash_attention_decode(q, k, v, cache_start=starts, causal=True, backend="triton")
    again = flash_attention_decode(q, k, v, cache_start=later, causal=True, backend="triton")
    assert torch.equal(flash_attention_decode(q, k, v, cache_start=starts, causal=True, backend="triton"), first)
    assert len(decode_calls) == 1 and len(plans.decode_plans) == 1
    (plan,) = plans.decode_plans.values()
    assert len(plan.replays) == (2 if split_path else 1) and bool(plan.scratch) == split_path
    expected = _per_row_reference(q, k, v, later, True, None, torch.float64)
    torch.testing.assert_close(again.double(), expected, atol=1e-5, rtol=1e-5)
    # A replayed signature still checks what can change between its calls.
    with pytest.raises(ValueError, match=r"in \[0, 200\]"):
        flash_attention_decode(q, k, v, cache_start=torch.tensor([0, 201, 5], device=DEVICE), causal=True,
                               backend="triton")
    with pytest.raises(RuntimeError, match="computes no gradients"):
        flash_attention_decode(q.requires_grad_(), k, v, cache_start=starts, causal=True, backend="triton")
    int32 = flash_attention_decode(q.detach(), k, v, cache_start=starts.int(), causal=True, backend="triton")
    assert torch.equal(int32, first) and len(decode_calls) == 2  # int32 starts (int64 above): a signature of its own


# ------------------------------------------------------------------ flash_attention_decode: key masks


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"nq{c[0]}-nk{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-c{c[5]}-w{c[6]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_key_mask_hides_each_rows_masked_keys(case, dtype, decode_backend, decode_calls):
    n_q, n_k, heads, kv_heads, d, causal, window = case
    q, k, v, _ = make_qkv(4, heads, n_q, n_k, d, dtype, DEVICE, seed=n_k + 2 * n_q, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(n_k)
    key_mask = torch.rand(4, n_k, generator=g) > 0.3  # holes anywhere
    key_mask[1, n_k - 80:] = False  # a static cache's empty slots
    key_mask[2] = True
    key_mask[3] = False  # a row that sees no key
    key_mask = key_mask.to(DEVICE)
    out = flash_attention_decode(q, k, v, key_mask=key_mask, causal=causal, window_size=window,
                                 backend=decode_backend)
    exact = _masked_reference(q, k, v, key_mask, causal, window, torch.float64)
    plain = _masked_reference(q, k, v, key_mask, causal, window, dtype)
    _assert_decoded(out, q, exact, plain, decode_calls, decode_backend)


def test_key_mask_and_cache_start_together(decode_backend):
    q, k, v, _ = make_qkv(3, 4, 1, 200, 32, torch.float32, DEVICE, seed=12, kv_heads=2)
    starts = torch.tensor([0, 40, 150], device=DEVICE)
    key_mask = (torch.rand(3, 200, generator=torch.Generator().manual_seed(5)) > 0.5).to(DEVICE)
    out = flash_attention_decode(q, k, v, cache_start=starts, key_mask=key_mask, causal=True, backend=decode_backend)
    both = key_mask & (torch.arange(200, device=DEVICE) >= starts[:, None])
    expected = _masked_reference(q, k, v, both, True, None, torch.float64)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_call_with_a_key_mask_is_one_op_in_one_graph(backend, decode_backend):
    """No host reading: the call stays in the graph (fullgraph) as `flashsys::flash_attention_decode`, with the
    eager call's result, and its output in the op's promised layout."""
    q, k, v, _ = make_qkv(2, 4, 1, 150, 16, torch.float32, DEVICE, seed=13, kv_heads=2)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's heads-inside view
    key_mask = (torch.rand(2, 150, generator=torch.Generator().manual_seed(6)) > 0.4).to(DEVICE)
    ops = []

    def counting(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward if backend == "aot_eager" else torch._inductor.compile(gm, inputs)

    def step(q, k, v, key_mask):
        return flash_attention_decode(q, k, v, key_mask=key_mask, causal=True, backend=decode_backend) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=counting if backend == "aot_eager" else "inductor")
    with torch.no_grad():
        out = compiled(q, k, v, key_mask)
        expected = step(q, k, v, key_mask)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    if backend == "aot_eager":
        assert any("flashsys.flash_attention_decode" in op for op in ops)


@pytest.mark.parametrize("key_mask,match", [
    (torch.ones(2, 60, dtype=torch.uint8), r"bool tensor of shape \(batch, Nk\) = \(2, 60\)"),
    (torch.ones(2, 59, dtype=torch.bool), r"bool tensor of shape \(batch, Nk\) = \(2, 60\)"),
    (torch.ones(60, 2, dtype=torch.bool).t(), "adjacent in memory"),
], ids=["dtype", "shape", "strides"])
def test_decode_refuses_a_bad_key_mask(key_mask, match):
    q = torch.randn(2, 4, 1, 16)
    k, v = (torch.randn(2, 2, 60, 16) for _ in range(2))
    with pytest.raises(ValueError, match=match):
        flash_attention_decode(q, k, v, key_mask=key_mask, causal=True, backend="torch")
