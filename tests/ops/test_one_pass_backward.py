"""The one-pass backward's switch and its `tl` helper kernels, on any machine (the kernels under Triton's interpreter
without a GPU); the Gluon kernel itself is checked against float64 on an H100 in test_gluon_backward, and compiled
for sm_90 on a CPU in test_gluon_forward."""

from __future__ import annotations

import pytest
import torch

import flashsys.ops as ops
from flashsys.ops.attention import determinism

from .attention_checks import make_qkv, run_reference

pytest.importorskip("triton")
import triton  # noqa: E402

from flashsys.ops.attention import eager_plans, flash_gluon, flash_triton  # noqa: E402

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
    eager_plans.backward_plans.remember(("a key",), "a plan")
    ops.set_deterministic_backward(True)  # no change
    assert eager_plans.backward_plans.get(("a key",)) == "a plan"
    ops.set_deterministic_backward(False)
    assert eager_plans.backward_plans.get(("a key",)) is None


@pytest.mark.parametrize("rank", [3, 4])
def test_prologue_writes_the_pairs_and_zeroes_dq_and_epilogue_scales_it(rank):
    """The prologue's (-L·log2 e, rowsum(dO·O)) pairs from O and dO with any strides (here (B, N, H, D) ones), L = -inf
    rows giving 0; every row of dQ's float32 sum zeroed (it held garbage); the epilogue's dQ = sum · scale, cast."""
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
    acc = torch.full(o4.shape, float("nan"), device=DEVICE)
    flash_triton._one_pass_prologue_kernel[(triton.cdiv(n, 64), batch * heads)](
        o4, do4, lse, pairs, acc, heads, n, *o4.stride(), *do4.stride(), HEAD_DIM=d, BLOCK_D=64, ROWS=64)
    want_neg = torch.where(torch.isinf(lse), torch.zeros_like(lse), -lse * flash_triton.LOG2E)
    torch.testing.assert_close(pairs[..., 0], want_neg)
    torch.testing.assert_close(pairs[..., 1], (o.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(acc, torch.zeros_like(acc))
    acc.normal_(generator=torch.Generator(DEVICE).manual_seed(12))
    dq = torch.full(o4.shape, float("nan"), device=DEVICE, dtype=torch.float16)
    rows = acc.numel() // d
    flash_triton._one_pass_epilogue_kernel[(triton.cdiv(rows, 64),)](acc, dq, rows, 0.3, HEAD_DIM=d, BLOCK_D=64,
                                                                     ROWS=64)
    assert torch.equal(dq, (acc * 0.3).to(torch.float16))


def test_one_pass_choice_hands_back_to_the_two_passes(monkeypatch):
    """The one-pass choice times the two passes beside its variants; where the two passes win (or the head dim has
    no one-pass kernel) the caller runs them, and the one pass runs only where a variant won."""
    monkeypatch.setattr(flash_gluon, "_chosen", {})
    timed = []

    def fake_choose(key, run):
        for var in key.candidates():
            run(var)
        return pick[0]

    monkeypatch.setattr(flash_gluon, "_choose", fake_choose)
    q = torch.randn(1, 2, 64, 128)
    for pick in ([flash_gluon.TL_KERNEL], [flash_gluon.ONE_PASS_VARIANTS[128][1]]):
        timed.clear()
        ran = flash_gluon.backward_one_pass(q, q, (-1, 0), timed.append, lambda: timed.append("two passes"))
        assert timed[:3] == ["two passes", *flash_gluon.ONE_PASS_VARIANTS[128][1:]]
        assert ran == (pick[0].kind == "one_pass")
        assert timed[3:] == ([pick[0]] if ran else [])  # the winner runs once more, for this call
    q96 = torch.randn(1, 2, 64, 96)
    assert not flash_gluon.backward_one_pass(q96, q96, (-1, 0), timed.append, lambda: None)
    key = flash_gluon.ChoiceKey.of(q, q, (-1, 0), "one_pass")  # what status lines call the two passes
    assert key.label(flash_gluon.TL_KERNEL) == "two passes"
    assert key._replace(kernel="dq").label(flash_gluon.TL_KERNEL) == "tl kernel"


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_backward_asks_for_the_one_pass_only_when_allowed(deterministic, monkeypatch):
    """With determinism off (and the Gluon path taking the call) the backward offers the one pass first; where it
    declines, the two passes give the reference gradients. With determinism on it is never asked."""
    monkeypatch.setattr(flash_gluon, "backward_dq", lambda *a: flash_gluon.Launched(False))
    monkeypatch.setattr(flash_gluon, "backward_dkdv", lambda *a: flash_gluon.Launched(False))
    asked = []
    monkeypatch.setattr(flash_gluon, "backward_one_pass", lambda q, k, window, one, two: asked.append(window))
    ops.set_deterministic_backward(deterministic)
    q, k, v, do = make_qkv(1, 2, 48, 48, 32, torch.float32, DEVICE, seed=5)
    scale = 32 ** -0.5
    o, lse = flash_triton.flash_forward_triton(q, k, v, (-1, 0), scale)
    g = flash_triton._geometry_of(q.shape, k.shape, q.dtype)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    pairs = torch.empty((*q.shape[:-1], 2), device=DEVICE)
    flash_triton._launch_backward(g, q, k, v, o, lse, do, *grads, pairs, q, k, (-1, 0), scale, False, True)
    assert asked == ([] if deterministic else [(-1, 0)])
    *_, dq_ref, dk_ref, dv_ref = run_reference(q, k, v, do, True, scale, torch.float64)
    for ours, ref in zip(grads, (dq_ref, dk_ref, dv_ref)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)
