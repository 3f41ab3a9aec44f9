"""FlashAttention-2 in plain PyTorch: tiled forward (Algorithm 1) and a recomputing backward.

Runs anywhere PyTorch runs. It exists to show the algorithm in readable form and as the CPU fallback
of `flash_attention`; the Triton twin in `flash_triton.py` is the fast one. Memory is O(N): only
q, k, v, O and the logsumexp L are kept between forward and backward; the N x N score matrix is
rebuilt tile by tile in the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import (
    FLOAT_DTYPES,
    check_attention_inputs,
    check_varlen_inputs,
    normalize_window,
    refuse_double_backward,
)

DEFAULT_TILE = 64  # at least 16 x 16, as the algorithm asks


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The PyTorch paths' accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_range(q0: int, q1: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """[first, end) of the keys any query in [q0, q1) may see under the (left, right) window (-1: unbounded)."""
    off = n_k - n_q
    first = max(0, q0 + off - left) if left >= 0 else 0
    end = min(n_k, q1 - 1 + off + right + 1) if right >= 0 else n_k
    return first, max(first, end)


def _query_range(k0: int, k1: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """[first, end) of the queries that may see any key in [k0, k1): the transpose of `_key_range`."""
    off = n_k - n_q
    first = max(0, k0 - off - right) if right >= 0 else 0
    end = min(n_q, k1 - 1 - off + left + 1) if left >= 0 else n_q
    return first, max(first, end)


def _tile_scores(q_t: Tensor, k_t: Tensor, scale: float, q0: int, k0: int, n_q: int, n_k: int,
                 left: int, right: int) -> Tensor:
    """Scaled scores of one (query tile, key tile), -inf where the window (or causal mask) hides a key."""
    s = torch.matmul(q_t, k_t.transpose(-2, -1)) * scale
    off = n_k - n_q
    q1, k1 = q0 + q_t.shape[-2], k0 + k_t.shape[-2]
    crosses_right = right >= 0 and k1 - 1 > q0 + off + right  # some key right of the first query's bound
    crosses_left = left >= 0 and k0 < q1 - 1 + off - left  # some key left of the last query's bound
    if crosses_right or crosses_left:
        i = torch.arange(q0, q1, device=s.device)[:, None] + off
        j = torch.arange(k0, k1, device=s.device)[None, :]
        hidden = torch.zeros(q1 - q0, k1 - k0, dtype=torch.bool, device=s.device)
        if right >= 0:
            hidden |= j > i + right
        if left >= 0:
            hidden |= j < i - left
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Views for grouped-query attention without copying K/V: q (B, Hkv, G, N, D) against k, v (B, Hkv, 1, N, D),
    so each K/V head broadcasts over its G query heads inside the matmuls."""
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1])), k.unsqueeze(2), v.unsqueeze(2)
    return q, k, v


def flash_forward_torch(
    q: Tensor, k: Tensor, v: Tensor, left: int, right: int, scale: float,
    tile_q: int = DEFAULT_TILE, tile_k: int = DEFAULT_TILE,
) -> tuple[Tensor, Tensor]:
    """Algorithm 1 over all leading dims at once; (left, right) is the key window (-1: unbounded; causal is (-1, 0)).
    Returns (O in q.dtype, L in the accumulation dtype), shaped like q."""
    shape = q.shape
    q, k, v = _grouped(q, k, v)
    acc = acc_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    for q0 in range(0, n_q, tile_q):
        q_t = q[..., q0 : q0 + tile_q, :].to(acc)
        rows = q_t.shape[-2]
        m = torch.full(q_t.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(q_t.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
        first, end = _key_range(q0, q0 + rows, n_q, n_k, left, right)
        for k0 in range(first // tile_k * tile_k, end, tile_k):
            k_t = k[..., k0 : k0 + tile_k, :].to(acc)
            v_t = v[..., k0 : k0 + tile_k, :].to(acc)
            s = _tile_scores(q_t, k_t, scale, q0, k0, n_q, n_k, left, right)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(dim=-1)
            o = alpha[..., None] * o + torch.matmul(p, v_t)
            m = m_new
        # Only a row that saw no key has l == 0 (a seen row's largest term is exp(0) = 1); NaN in q or k makes
        # l NaN, and NaN != 0, so NaN propagates to O and L as in the reference.
        seen = l != 0
        out[..., q0 : q0 + rows, :] = torch.where(seen[..., None], o / torch.where(seen, l, 1.0)[..., None], 0.0).to(q.dtype)
        lse[..., q0 : q0 + rows] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
    return out.reshape(shape), lse.reshape(shape[:-1])


def flash_backward_torch(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, left: int, right: int, scale: float,
    tile_q: int = DEFAULT_TILE, tile_k: int = DEFAULT_TILE,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute P tile by tile from q, k and L; accumulate dQ, dK, dV in the accumulation dtype. With grouped-query
    K/V, dK and dV sum over the query heads of each group."""
    q_shape, kv_shape = q.shape, k.shape
    q, k, v = _grouped(q, k, v)
    o, do, lse = o.reshape(q.shape), do.reshape(q.shape), lse.reshape(q.shape[:-1])
    acc = acc_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = (do.to(acc) * o.to(acc)).sum(dim=-1)  # D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for k0 in range(0, n_k, tile_k):
        k_t = k[..., k0 : k0 + tile_k, :].to(acc)
        v_t = v[..., k0 : k0 + tile_k, :].to(acc)
        first, end = _query_range(k0, k0 + k_t.shape[-2], n_q, n_k, left, right)  # the queries that see these keys
        for q0 in range(first // tile_q * tile_q, end, tile_q):
            q_t = q[..., q0 : q0 + tile_q, :].to(acc)
            do_t = do[..., q0 : q0 + tile_q, :].to(acc)
            l_t = lse[..., q0 : q0 + tile_q]
            s = _tile_scores(q_t, k_t, scale, q0, k0, n_q, n_k, left, right)
            # Rows that saw no key have L = -inf; their s is -inf too, so mask them to P = 0.
            p = torch.where(torch.isinf(s), 0.0, torch.exp(s - torch.where(torch.isinf(l_t), 0.0, l_t)[..., None]))
            dv_t = torch.matmul(p.transpose(-2, -1), do_t)
            dp = torch.matmul(do_t, v_t.transpose(-2, -1))
            ds = p * (dp - delta[..., q0 : q0 + tile_q, None]) * scale
            dq[..., q0 : q0 + tile_q, :] += torch.matmul(ds, k_t)
            dk_t = torch.matmul(ds.transpose(-2, -1), q_t)
            # sum_to_size folds the query heads of a group into their one K/V head (a no-op without groups)
            dk[..., k0 : k0 + tile_k, :] += dk_t.sum_to_size(dk[..., k0 : k0 + tile_k, :].shape)
            dv[..., k0 : k0 + tile_k, :] += dv_t.sum_to_size(dv[..., k0 : k0 + tile_k, :].shape)
    return dq.to(q.dtype).reshape(q_shape), dk.to(k.dtype).reshape(kv_shape), dv.to(v.dtype).reshape(kv_shape)


class FlashAttention2Torch(torch.autograd.Function):
    """FlashAttention-2 as a tiled pure-PyTorch autograd.Function (CPU or GPU, fp16/bf16/fp32/fp64).

    `FlashAttention2Torch.apply(q, k, v, is_causal=False, softmax_scale=None, window_size=None)`; arguments, masks,
    grouped-query K/V and errors as in `flashsys.ops.flash_attention`. Saves q, k, v, O and the float32 (float64
    for float64 inputs) logsumexp L.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O, shaped and typed like q."""
        op = "FlashAttention2Torch"
        scale = check_attention_inputs(q, k, v, is_causal, softmax_scale, op=op,
                                       allowed_dtypes=FLOAT_DTYPES + (torch.float64,))
        left, right = normalize_window(window_size, bool(is_causal), op, q.shape[-2], k.shape[-2])
        o, lse = flash_forward_torch(q, k, v, left, right, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.scale = (left, right), scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """(dQ, dK, dV, None, None, None): the scores are recomputed tile by tile from q, k and L."""
        refuse_double_backward("FlashAttention2Torch")
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_torch(q, k, v, o, lse, do, *ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None


def _segments(cu: Tensor) -> list[tuple[int, int]]:
    offsets = cu.tolist()
    return list(zip(offsets, offsets[1:]))


def _as_batch(t: Tensor) -> Tensor:
    """A (n, H, D) slice of a packed tensor as a (1, H, n, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def flash_varlen_forward_torch(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, left: int, right: int,
                               scale: float) -> tuple[Tensor, Tensor]:
    """Packed sequences one at a time through the tiled forward. Returns (O like q, L (Hq, total_q))."""
    o = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
        if q1 > q0:
            o_s, l_s = flash_forward_torch(_as_batch(q[q0:q1]), _as_batch(k[k0:k1]), _as_batch(v[k0:k1]), left, right,
                                           scale)
            o[q0:q1], lse[:, q0:q1] = o_s[0].transpose(0, 1), l_s[0]
    return o, lse


def flash_varlen_backward_torch(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, cu_q: Tensor,
                                cu_k: Tensor, left: int, right: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The packed twin of `flash_backward_torch`, one sequence at a time (sequences share no keys)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
        if q1 > q0 and k1 > k0:
            q_s, o_s, do_s = (_as_batch(t[q0:q1]) for t in (q, o, do))
            k_s, v_s = (_as_batch(t[k0:k1]) for t in (k, v))
            dq_s, dk_s, dv_s = flash_backward_torch(q_s, k_s, v_s, o_s, lse[:, q0:q1].unsqueeze(0), do_s, left, right,
                                                    scale)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0].transpose(0, 1) for g in (dq_s, dk_s, dv_s))
    return dq, dk, dv


class FlashAttentionVarlenTorch(torch.autograd.Function):
    """Packed variable-length FlashAttention-2 in tiled PyTorch, one sequence at a time.

    `FlashAttentionVarlenTorch.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False,
    softmax_scale=None, window_size=None)`, as `flashsys.ops.flash_attention_varlen`. Saves q, k, v, O, the
    logsumexp L (Hq, total_q) float32 (flash-attn's varlen layout) and the two offset tensors.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O (total_q, Hq, D), typed like q."""
        op = "FlashAttentionVarlenTorch"
        scale = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                    softmax_scale, op=op, allowed_dtypes=FLOAT_DTYPES + (torch.float64,))
        left, right = normalize_window(window_size, bool(is_causal), op, q.shape[0], k.shape[0])
        o, lse = flash_varlen_forward_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, left, right, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.window, ctx.scale = (left, right), scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """Gradients for q, k, v; None for the offsets, lengths and flags."""
        refuse_double_backward("FlashAttentionVarlenTorch")
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = flash_varlen_backward_torch(q, k, v, o, lse, do, cu_q, cu_k, *ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None
