"""The single-pass backward (`deterministic=False`): dK/dV and atomic dQ in one kernel. It must compute what the
two-pass backward computes for every feature (GQA, windows, causal, Nq != Nk, varlen, every dtype), and the default
must stay the deterministic two-pass one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashsys.ops import flash_attention
from flashsys.ops.attention import FlashAttention2Triton
from flashsys.ops.attention import flash_triton as ft

from .attention_checks import SinglePassTriton, assert_matches_reference, make_qkv
from .test_attention_properties import TRITON_DTYPES, grouped_window_case

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@settings(max_examples=12 if CUDA else 6)
@given(data=st.data())
def test_single_pass_matches_reference(dtype, data):
    case = data.draw(
        grouped_window_case(max_len=1024, head_dims=[16, 64, 80, 128], dtypes=[dtype])
        if CUDA
        else grouped_window_case(max_len=150, head_dims=[16, 24, 32], dtypes=[dtype])
    )
    q, k, v, do = make_qkv(case["batch"], case["heads"], case["n_q"], case["n_k"], case["d"], case["dtype"], DEVICE,
                           seed=case["seed"], kv_heads=case["kv_heads"])
    assert_matches_reference(SinglePassTriton, q, k, v, do, case["causal"], case["scale"], case["window"])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_single_pass_long_sequences_gpu(d, causal):
    q, k, v, do = make_qkv(2, 4, 4096, 4096, d, torch.bfloat16, "cuda", seed=d)
    assert_matches_reference(SinglePassTriton, q, k, v, do, causal, None)


def _grads(deterministic, q, k, v, do, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, backend="triton", deterministic=deterministic, **kwargs).backward(do)
    return [t.grad for t in leaves]


def test_the_default_backward_is_two_passes_and_bit_for_bit_repeatable():
    """deterministic=True is the default: it launches the dQ kernel (never the atomic one) and repeats exactly."""
    q, k, v, do = make_qkv(2, 4, 96, 80, 32, torch.float16, DEVICE, seed=11, kv_heads=2)
    ft._chosen_configs.clear()
    first = _grads(True, q, k, v, do, causal=True)
    assert {key.kernel for key in ft.chosen_configs()} == {"fwd", "dq", "dkdv"}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    FlashAttention2Triton.apply(*leaves, True).backward(do)  # no flag: the default
    for a, b in zip(first, [t.grad for t in leaves]):
        assert torch.equal(a, b)
    single = _grads(False, q, k, v, do, causal=True)
    assert {"delta", "dkdv+dq"} <= {key.kernel for key in ft.chosen_configs()}
    for a, b in zip(first, single):  # same math, another summation order for dQ
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_deterministic_must_be_a_bool():
    q, k, v, _ = make_qkv(1, 2, 16, 16, 16, torch.float32, DEVICE, seed=1)
    for bad in ("no", None, 0):
        with pytest.raises(TypeError, match="deterministic must be True or False"):
            flash_attention(q, k, v, backend="triton", deterministic=bad)
        with pytest.raises(TypeError, match="deterministic must be True or False"):
            FlashAttention2Triton.apply(q, k, v, False, None, None, bad)


def test_torch_backend_takes_the_flag_and_stays_exact():
    """The tiled PyTorch op has one (deterministic) backward: the flag is accepted and changes nothing."""
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, torch.float64, DEVICE, seed=2)
    grads = []
    for deterministic in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, causal=True, backend="torch", deterministic=deterministic).backward(do)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_torch_compile_of_the_single_pass_matches_eager():
    torch._dynamo.reset()
    q, k, v, do = make_qkv(1, 2, 64 if not CUDA else 512, 64 if not CUDA else 512, 16 if not CUDA else 64,
                           torch.float32, DEVICE, seed=4)
    compiled = torch.compile(lambda q, k, v: FlashAttention2Triton.apply(q, k, v, True, None, None, False),
                             dynamic=False)
    results = []
    for fn in (lambda q, k, v: FlashAttention2Triton.apply(q, k, v, True, None, None, False), compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        o.backward(do)
        results.append([o.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
