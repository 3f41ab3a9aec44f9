"""Packed variable-length attention (flash_attention_varlen) against float64 reference math per sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashsys.ops import flash_attention_varlen
from flashsys.ops.attention import attention_reference

from .attention_checks import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(sum(lengths_k), hkv, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    do = torch.randn(sum(lengths_q), hq, d, generator=g).to(DEVICE, dtype)
    return q, k, v, do


def _per_sequence_reference(q, k, v, do, cu_q, cu_k, causal, window):
    """O, dQ, dK, dV in float64, each sequence attending only within itself."""
    outs = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in (q, q, k, v)]
    bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))
    for q0, q1, k0, k1 in bounds:
        if q1 == q0 or k1 == k0:  # no queries, or queries that see no key: output and gradients 0
            continue
        qs, ks, vs = (t.double()[a:b].transpose(0, 1).unsqueeze(0).requires_grad_()
                      for t, (a, b) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1))))
        o, _ = attention_reference(qs, ks, vs, causal, None, window)
        grads = torch.autograd.grad(o, (qs, ks, vs), do.double()[q0:q1].transpose(0, 1).unsqueeze(0))
        for out, value, (a, b) in zip(outs, (o, *grads), ((q0, q1), (q0, q1), (k0, k1), (k0, k1))):
            out[a:b] = value[0].transpose(0, 1)
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15 if CUDA else 5)
@given(data=st.data())
def test_varlen_matches_per_sequence_reference(backend, data):
    n = data.draw(st.integers(1, 4))
    max_len = 300 if CUDA else 70
    lengths_q = data.draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    same = data.draw(st.booleans())
    lengths_k = lengths_q if same else data.draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    kv_heads = data.draw(st.sampled_from([1, 2]))
    hq = kv_heads * data.draw(st.sampled_from([1, 2]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])))
    causal = data.draw(st.booleans())
    bound = st.one_of(st.just(-1), st.integers(0, max_len))
    window = data.draw(st.one_of(st.none(), st.tuples(bound, bound)))
    d = data.draw(st.sampled_from([16, 64] if CUDA else [16]))
    q, k, v, do = _packed(lengths_q, lengths_k, hq, kv_heads, d, dtype, seed=data.draw(st.integers(0, 2**31 - 1)))
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, max(max(lengths_q), 1), max(max(lengths_k), 1), causal=causal,
                               window_size=window, backend=backend)
    ours = (o, *torch.autograd.grad(o, (q, k, v), do))
    exact = _per_sequence_reference(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, causal, window)
    tolerance = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in zip(("O", "dQ", "dK", "dV"), ours, exact):
        assert a.dtype == q.dtype and a.shape == b.shape, name
        if a.numel():  # every sequence may be empty
            assert rel_err(a, b) <= tolerance, f"{name}: {rel_err(a, b):.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_never_see_each_other(backend):
    """Changing one sequence's keys changes no other sequence's output."""
    q, k, v, _ = _packed([20, 30], [20, 30], 2, 2, 16, torch.float32, seed=1)
    cu = _offsets([20, 30])
    before = flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, backend=backend)
    k2 = k.clone()
    k2[20:] += 1.0
    after = flash_attention_varlen(q, k2, v, cu, cu, 30, 30, causal=True, backend=backend)
    assert torch.equal(before[:20], after[:20]) and not torch.equal(before[20:], after[20:])


BAD_OFFSETS = [
    ([1, 20, 50], "start at 0"),
    ([0, 30, 20, 50], "never decrease"),
    ([0, 20, 49], "end at the token count 50, got 49"),
]


@pytest.mark.parametrize("offsets,match", BAD_OFFSETS, ids=[m for _, m in BAD_OFFSETS])
def test_bad_offsets_are_clear_errors(offsets, match):
    q, k, v, _ = _packed([20, 30], [20, 30], 2, 2, 16, torch.float32, seed=2)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flash_attention_varlen(q, k, v, cu, _offsets([20, 30]), 30, 30)


def test_bad_varlen_arguments_are_clear_errors():
    q, k, v, _ = _packed([20, 30], [20, 30], 2, 2, 16, torch.float32, seed=3)
    cu = _offsets([20, 30])
    with pytest.raises(ValueError, match="int32"):
        flash_attention_varlen(q, k, v, cu.long(), cu, 30, 30)
    with pytest.raises(ValueError, match="longest sequence"):
        flash_attention_varlen(q, k, v, cu, cu, 29, 30)
    with pytest.raises(ValueError, match="same number of sequences"):
        flash_attention_varlen(q, k, v, cu, _offsets([10, 10, 30]), 30, 30)
    with pytest.raises(ValueError, match="total_tokens, heads, head_dim"):
        flash_attention_varlen(q[None], k, v, cu, cu, 30, 30)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        flash_attention_varlen(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu, cu, 30, 30)


@pytest.mark.gpu
def test_gpu_offsets_are_read_once_per_tensor_and_again_after_a_change(monkeypatch):
    """A model passes one offsets tensor to every layer: on a GPU it is read back (a device wait) once, and read
    again after an in-place change, which is then caught."""
    q, k, v, _ = _packed([20, 30], [20, 30], 2, 2, 16, torch.float32, seed=4)
    cu = _offsets([20, 30])
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or original(t))
    for _ in range(3):
        flash_attention_varlen(q, k, v, cu, cu, 30, 30, backend="triton")
    assert len(reads) == 1  # passed as both offsets, three times
    cu[1] = 60
    with pytest.raises(ValueError, match="never decrease"):
        flash_attention_varlen(q, k, v, cu, cu, 60, 60)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_offsets_edited_through_numpy_are_checked_again(backend):
    """A numpy view writes the offsets without bumping torch's version counter: CPU offsets are checked on every
    call, so a write that makes them decrease is refused, not computed as one sequence or read out of bounds."""
    if DEVICE != "cpu":
        pytest.skip("numpy views exist only for CPU tensors")
    q, k, v, _ = _packed([12, 8], [12, 8], 2, 2, 16, torch.float32, seed=5)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    flash_attention_varlen(q, k, v, cu, cu, 12, 12, backend=backend)
    cu.numpy()[2] = 8
    with pytest.raises(ValueError, match="never decrease"):
        flash_attention_varlen(q, k, v, cu, cu, 12, 12, backend=backend)


def test_head_dim_zero_is_named_as_such():
    q = torch.randn(20, 2, 0, device=DEVICE)
    cu = _offsets([20])
    with pytest.raises(ValueError, match="head_dim must be positive"):
        flash_attention_varlen(q, q, q, cu, cu, 20, 20)
