"""FlashAttention-2 in plain PyTorch: tiled forward (Algorithm 1) and a recomputing backward.

Runs anywhere PyTorch runs. It exists to show the algorithm in readable form and as the CPU fallback
of `flash_attention`; the Triton twin in `flash_triton.py` is the fast one. Memory is O(N): only
q, k, v, O and the logsumexp L are kept between forward and backward; the N x N score matrix is
rebuilt tile by tile in the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import FLOAT_DTYPES, check_attention_inputs, refuse_double_backward

DEFAULT_TILE = 64  # at least 16 x 16, as the algorithm asks


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visible_key_end(q_end: int, n_q: int, n_k: int, causal: bool) -> int:
    """One past the last key any query in [.., q_end) may see."""
    return min(n_k, q_end + (n_k - n_q)) if causal else n_k


def _tile_scores(q_t: Tensor, k_t: Tensor, scale: float, q0: int, k0: int, n_q: int, n_k: int, causal: bool) -> Tensor:
    """Scaled scores of one (query tile, key tile), -inf where the causal mask hides a key."""
    s = torch.matmul(q_t, k_t.transpose(-2, -1)) * scale
    if causal and k0 + k_t.shape[-2] - 1 > q0 + (n_k - n_q):  # the tile crosses the diagonal
        i = torch.arange(q0, q0 + q_t.shape[-2], device=s.device)[:, None]
        j = torch.arange(k0, k0 + k_t.shape[-2], device=s.device)[None, :]
        s = s.masked_fill(j > i + (n_k - n_q), float("-inf"))
    return s


def flash_forward_torch(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, tile_q: int = DEFAULT_TILE, tile_k: int = DEFAULT_TILE
) -> tuple[Tensor, Tensor]:
    """Algorithm 1 over all leading dims at once. Returns (O in q.dtype, L in the accumulation dtype)."""
    acc = _acc_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    for q0 in range(0, n_q, tile_q):
        q_t = q[..., q0 : q0 + tile_q, :].to(acc)
        rows = q_t.shape[-2]
        m = torch.full(q_t.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(q_t.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
        for k0 in range(0, _visible_key_end(q0 + rows, n_q, n_k, causal), tile_k):
            k_t = k[..., k0 : k0 + tile_k, :].to(acc)
            v_t = v[..., k0 : k0 + tile_k, :].to(acc)
            s = _tile_scores(q_t, k_t, scale, q0, k0, n_q, n_k, causal)
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
    return out, lse


def flash_backward_torch(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, causal: bool, scale: float,
    tile_q: int = DEFAULT_TILE, tile_k: int = DEFAULT_TILE,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute P tile by tile from q, k and L; accumulate dQ, dK, dV in the accumulation dtype."""
    acc = _acc_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = (do.to(acc) * o.to(acc)).sum(dim=-1)  # D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    offset = n_k - n_q
    for k0 in range(0, n_k, tile_k):
        k_t = k[..., k0 : k0 + tile_k, :].to(acc)
        v_t = v[..., k0 : k0 + tile_k, :].to(acc)
        first_q = max(0, k0 - offset) // tile_q * tile_q if causal else 0  # earlier queries see none of these keys
        for q0 in range(first_q, n_q, tile_q):
            q_t = q[..., q0 : q0 + tile_q, :].to(acc)
            do_t = do[..., q0 : q0 + tile_q, :].to(acc)
            l_t = lse[..., q0 : q0 + tile_q]
            s = _tile_scores(q_t, k_t, scale, q0, k0, n_q, n_k, causal)
            # Rows that saw no key have L = -inf; their s is -inf too, so mask them to P = 0.
            p = torch.where(torch.isinf(s), 0.0, torch.exp(s - torch.where(torch.isinf(l_t), 0.0, l_t)[..., None]))
            dv[..., k0 : k0 + tile_k, :] += torch.matmul(p.transpose(-2, -1), do_t)
            dp = torch.matmul(do_t, v_t.transpose(-2, -1))
            ds = p * (dp - delta[..., q0 : q0 + tile_q, None]) * scale
            dq[..., q0 : q0 + tile_q, :] += torch.matmul(ds, k_t)
            dk[..., k0 : k0 + tile_k, :] += torch.matmul(ds.transpose(-2, -1), q_t)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention2Torch(torch.autograd.Function):
    """FlashAttention-2 as a tiled pure-PyTorch autograd.Function (CPU or GPU, fp16/bf16/fp32/fp64).

    `FlashAttention2Torch.apply(q, k, v, is_causal=False, softmax_scale=None)`; arguments, masks and errors as in
    `flashsys.ops.flash_attention`. Saves q, k, v, O and the float32 (float64 for float64 inputs) logsumexp L.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None) -> Tensor:
        """Returns O, shaped and typed like q."""
        scale = check_attention_inputs(
            q, k, v, is_causal, softmax_scale, op="FlashAttention2Torch", allowed_dtypes=FLOAT_DTYPES + (torch.float64,)
        )
        o, lse = flash_forward_torch(q, k, v, bool(is_causal), scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale = bool(is_causal), scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """(dQ, dK, dV, None, None): the scores are recomputed tile by tile from q, k and L."""
        refuse_double_backward("FlashAttention2Torch")
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_torch(q, k, v, o, lse, do, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None
