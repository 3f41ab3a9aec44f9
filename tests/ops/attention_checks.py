"""Shared checks: compare an attention op against float64 reference math with dtype-scaled tolerances.

Tolerance follows flash-attention's tests: our error against the float64 reference may be at most twice
the error of plain PyTorch attention computed in the same low precision, plus a small floor.
"""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import attention_reference, window_mask

FLOOR = {torch.float32: 5e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float64: 1e-12}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, with ||ref|| floored at unit RMS: a gradient that is exactly zero (one key,
    say) is then judged by its absolute rounding noise instead of dividing by zero."""
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in output"
    return ((x - ref).norm() / max(ref.norm().item(), ref.numel() ** 0.5)).item()


def make_qkv(batch, heads, n_q, n_k, d, dtype, device, seed=None, kv_heads=None):
    """Random q, k, v, dO; k and v get `kv_heads` heads (grouped-query) when given, else `heads`."""
    g = torch.Generator(device="cpu")
    if seed is not None:
        g.manual_seed(seed)
    lead = (batch, heads) if heads else (batch,)
    kv_lead = (batch, kv_heads) if heads and kv_heads else lead
    q = torch.randn(*lead, n_q, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(*kv_lead, n_k, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    v = torch.randn(*kv_lead, n_k, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    do = torch.randn(*lead, n_q, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return q, k, v, do


def run_op(op, q, k, v, do, causal, scale, window=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = op.apply(q, k, v, causal, scale) if window is None else op.apply(q, k, v, causal, scale, window)
    lse = o.grad_fn.saved_tensors[4]
    o.backward(do)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_reference(q, k, v, do, causal, scale, dtype, window=None):
    q, k, v = (x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v))
    o, lse = attention_reference(q, k, v, causal, scale, window)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def flash_algorithm_gradients(q, k, v, do, causal, scale, dtype, window=None):
    """(dQ, dK) of FlashAttention-2's backward done exactly in float64, except for what its contract fixes: the
    saved O is in the input dtype, and D = rowsum(dO * O) uses that rounded O.

    dS = P * (dP - D) cancels where P is nearly one-hot (few visible keys); D's rounding then dominates dQ and dK
    for every implementation that keeps the contract (flash-attn too), however exact the rest of its arithmetic.
    The error of these gradients is the floor such an implementation can reach."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    group = q.shape[1] // k.shape[1] if q.dim() == 4 else 1
    k, v = k.repeat_interleave(group, dim=1) if group > 1 else k, v.repeat_interleave(group, dim=1) if group > 1 else v
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    if left >= 0 or right >= 0:
        s = s.masked_fill(~window_mask(q.shape[-2], k.shape[-2], left, right, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: P = 0
    o_saved = (p @ v).to(dtype).double()
    ds = p * (do @ v.transpose(-2, -1) - (do * o_saved).sum(-1, keepdim=True))
    dk = ds.transpose(-2, -1) @ q * scale
    if group > 1:  # the query heads of a group share one K/V head: their gradients add up
        dk = dk.unflatten(1, (-1, group)).sum(2)
    return ds @ k * scale, dk


def eager_then_compiled(op, q, k, v, causal) -> list[tuple[torch.Tensor, ...]]:
    """[(O, dQ, dK, dV) of `op.apply` eager, the same of torch.compile(op.apply) with static shapes], each from
    o.sum().backward() on fresh leaves. Eager runs first, as the leaderboard does."""
    compiled = torch.compile(op.apply, dynamic=False)
    results = []
    for fn in (op.apply, compiled):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = fn(qq, kk, vv, causal)
        o.sum().backward()
        results.append((o.detach(), qq.grad, kk.grad, vv.grad))
    return results


def assert_matches_reference(op, q, k, v, do, causal, scale, window=None):
    """O, L, dQ, dK, dV of `op` against float64. The tolerance is twice the larger of plain PyTorch's error in the
    same precision and, for dQ and dK, the error the FlashAttention-2 contract itself implies (D from the saved,
    rounded O: `flash_algorithm_gradients`), plus a small floor."""
    ours = run_op(op, q, k, v, do, causal, scale, window)
    exact = run_reference(q, k, v, do, causal, scale, torch.float64, window)
    plain = run_reference(q, k, v, do, causal, scale, q.dtype, window)
    algorithm = dict(zip((2, 3), flash_algorithm_gradients(q, k, v, do, causal, scale, q.dtype, window)))
    assert ours[0].dtype == q.dtype and ours[0].shape == q.shape
    assert ours[1].dtype in (torch.float32, torch.float64) and ours[1].shape == q.shape[:-1]
    # The floor is for rounding noise where plain PyTorch is exact by structure: with one key, dK is exactly
    # zero there, while ours is the cancellation dP - D summed over the queries, noise that grows like the
    # square root of the terms (fp32: about 7e-5 at n_q = 301, d = 256). Scale the floor with it. Under GQA
    # dK sums over every query of the head group, so the group multiplies the terms. Measured on CPU with one key,
    # scale 1.5 (the largest drawn): up to 4.7e-5 * sqrt(terms) / 128 (n_q 200, group 2, d 128), so the floor is
    # twice that slope.
    group = q.shape[1] // k.shape[1] if q.dim() == 4 else 1
    terms = max(q.shape[-2] * group, k.shape[-2]) * q.shape[-1]
    floor = FLOOR[q.dtype] * max(1.0, terms ** 0.5 / 64)
    for name, i in (("O", 0), ("dQ", 2), ("dK", 3), ("dV", 4)):
        assert ours[i].shape == exact[i].shape, name
        err, base = rel_err(ours[i], exact[i]), rel_err(plain[i], exact[i])
        inherent = rel_err(algorithm[i], exact[i]) if i in algorithm else 0.0
        assert err <= 2 * max(base, inherent) + floor, (
            f"{name}: error {err:.3g} vs plain PyTorch {base:.3g}, contract floor {inherent:.3g} ({q.dtype})")
    # L: float32 in every case; rows that see no key are -inf in both.
    lse, lse_ref = ours[1].double(), exact[1]
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "L: -inf rows differ"
    finite = ~torch.isinf(lse_ref)
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() <= 1e-4 * (1 + lse_ref[finite].abs().max().item())



def select_launcher(name: str, request, monkeypatch) -> None:
    """Make eager Triton calls take one launcher for a test: "python" (the Python plans' replays, the native
    extension out of sight) or "native" (`replay.native`'s C++ node; built on first use, skipped where no C++ compiler exists;
    on a CPU it takes the interpreter's launches too). The native plan tables start empty."""
    import shutil

    from flashsys.ops.attention.replay import native as native_launch

    if name == "python":
        suspension = native_launch.suspended()
        suspension.__enter__()
        request.addfinalizer(lambda: suspension.__exit__(None, None, None))
        return
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the native launcher cannot be built here")
    assert native_launch.wait(), native_launch.status()  # a compiler is there: the build must work
    native_launch.clear()
    if not torch.cuda.is_available():
        native_launch.allow_interpreted(True)
        request.addfinalizer(lambda: native_launch.allow_interpreted(False))
    request.addfinalizer(native_launch.clear)


def refuse_calls(monkeypatch, target, *names: str) -> None:
    """Make each `target.<name>` fail the test when called: how a test says "from here on this call replays a plan,
    it does not take the full path" (the full path's validation, backward or Gluon launch)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the full path ran where a plan should have been replayed")

    for name in names:
        monkeypatch.setattr(target, name, refuse)


def compile_without_cache_warnings(fn, x: torch.Tensor, recwarn) -> torch.Tensor:
    """fn(x) compiled whole (Dynamo, eager backend), run twice with the same result, having warned nothing about a
    functools cache: Dynamo warns about every one it traces through, so a user's compiled model would show it."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    out = compiled(x)
    assert torch.equal(out, compiled(x))
    assert not [w for w in recwarn.list if "lru_cache" in str(w.message)]
    return out
