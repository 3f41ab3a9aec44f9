"""Attention of a few new queries over a KV cache whose rows may start late (a left-padded batch): the forward that
generation runs at every step, as flash-attn's `flash_attn_with_kvcache(..., cache_leftpad=...)`.

`flash_attention` already sends a dense call of a few queries against a long cache to the split-key decode kernels;
what it cannot express is a batch whose rows hold different amounts of padding before their first real key. A
left-padded batch otherwise goes through the varlen kernels, gathering every row's real keys into a packed copy of
the whole cache at every step, one query per 128-row tile. Here the decode kernels skip each row's leading keys
instead (`cache_start`), reading the cache in place.

A key mask (`key_mask`, any pattern) hides keys without being read on the host: a static cache's empty slots and
padding, in a decoding step that torch.compile keeps in one graph (the op `flashsys::flash_attention_decode`).

Forward only: generation needs no gradients, and the backward kernels take no per-row start (training on padded
batches runs `flash_attention_varlen`).
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .backends import FLASH_ALIASES, Backend, flash_runs_triton
from .flash_torch import acc_dtype
from .layout import empty_output, laid_out
from .op_library import define_op
from .replay import plans
from .validation import (
    FLOAT_DTYPES,
    MAX_DECODE_GROUP_ROWS,
    MAX_DECODE_QUERIES,
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_cache_start,
    check_key_mask,
    decode_fits,
    normalize_window,
)

KEY_CHUNK = 4096  # keys per step of the PyTorch path's online softmax: bounds its fp32 scores


def flash_attention_decode(
    q: Float[Tensor, "*batch Nq D"],
    k: Float[Tensor, "*batch Nk D"],
    v: Float[Tensor, "*batch Nk D"],
    *,
    cache_start: Int[Tensor, " batch"] | None = None,
    key_mask: Bool[Tensor, "batch Nk"] | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "*batch Nq D"]:
    """softmax(q kᵀ · softmax_scale) v for at most 16 new queries per sequence against a KV cache, without gradients.

    Args:
        q: (batch, Nq, head_dim) or (batch, Hq, Nq, head_dim), Nq <= 16 and (Hq // Hkv) * Nq <= 64; the queries are
            the cache's last Nq positions (they are in k, v already). fp16, bf16 or fp32 (float64 too on the PyTorch
            path); any strides.
        k, v: the cache, (batch, Nk, head_dim) or (batch, Hkv, Nk, head_dim), Hq a multiple of Hkv (grouped-query
            attention reads each K/V head once for its group; nothing is copied).
        cache_start: int32/int64 (batch,): row b's keys before cache_start[b] are padding and never attended to
            (flash-attn's `cache_leftpad`); in [0, Nk]. None: every key is real. Read back on the host to check it:
            a compiled graph runs a call with it outside the graph.
        key_mask: bool (batch, Nk): row b attends to key j only where key_mask[b, j] (any pattern: a static cache's
            empty slots, padding anywhere). Never read on the host: a compiled graph keeps the call inside, as one
            op (and a CUDA graph captures it). None: every key is real.
        causal, softmax_scale, window_size: as in `flash_attention`, bottom-right aligned over the whole cache (the
            positions are cache indices, padding included, as transformers' masks count them). A query that sees no
            key outputs 0.
        backend: "auto" (the decode kernels on CUDA tensors, the PyTorch path elsewhere), "triton" or "torch", or
            the registry's names for them ("flash", "flash-triton", "flash-torch").

    Returns:
        The attention output, shaped and typed like q.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes, devices or cache starts, naming the argument.
        RuntimeError: where q, k or v requires grad with grad mode on (this op computes no gradients).
    """
    if torch.compiler.is_compiling() and cache_start is None:
        return _DECODE_OP(q, k, v, key_mask, bool(causal), softmax_scale, _window_list(window_size), backend)
    return _decode(q, k, v, cache_start, key_mask, causal, softmax_scale, window_size, backend)


@torch.compiler.disable  # the cache starts are read back on the host to check them
def _decode(q: Tensor, k: Tensor, v: Tensor, cache_start: Tensor | None, key_mask: Tensor | None, causal: bool,
            softmax_scale: float | None, window_size: tuple[int, int] | None, backend: str) -> Tensor:
    """`flash_attention_decode`'s eager call (and its op's body)."""
    op = "flash_attention_decode"
    if backend not in FLASH_ALIASES:
        raise ValueError(f"{op}: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
    # A signature seen before (every layer of every generation step) replays its plan: its shapes, dtypes and flags
    # were checked at its first call; what can change between calls with one signature is checked again.
    key = _plan_key(q, k, v, cache_start, key_mask, causal, softmax_scale, window_size, backend)
    plan = plans.decode_plans.get(key)
    if plan is not None and plans.on_current_device(q):
        _refuse_grad(q, k, v, op)
        starts = () if cache_start is None else (check_cache_start(cache_start, q.shape[0], k.shape[-2], q.device,
                                                                   op=op),)
        masks = () if key_mask is None else (key_mask.view(torch.uint8),)  # checked with the signature
        return plan.launch(q, k, v, *starts, *masks)[0]
    triton = flash_runs_triton(FLASH_ALIASES[backend], q)
    scale = check_attention_inputs(q, k, v, causal, softmax_scale, op=op,
                                   max_head_dim=MAX_HEAD_DIM if triton else None,
                                   allowed_dtypes=FLOAT_DTYPES if triton else FLOAT_DTYPES + (torch.float64,))
    n_q, n_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1] if q.dim() == 4 else 1
    if n_q and not decode_fits(n_q, group):
        raise ValueError(f"{op}: takes at most {MAX_DECODE_QUERIES} queries per sequence and {MAX_DECODE_GROUP_ROWS} "
                         f"rows per K/V head (query heads per K/V head x Nq), got Nq {n_q} with {group} query heads "
                         "per K/V head; longer query blocks take flash_attention or flash_attention_varlen")
    _refuse_grad(q, k, v, op)
    window = normalize_window(window_size, bool(causal), op, n_q, n_k)
    if cache_start is not None:
        cache_start = check_cache_start(cache_start, q.shape[0], n_k, q.device, op=op)
    if key_mask is not None:
        check_key_mask(key_mask, q.shape[0], n_k, q.device, op=op)
    if n_q == 0:  # no queries: nothing to read from the cache
        return empty_output(q)
    if triton:
        return _decode_triton(q, k, v, cache_start, key_mask, window, scale, op, key)
    return _decode_torch(q, k, v, cache_start, key_mask, window, scale)


def grad_requested(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a call asks for gradients (grad mode on and an input that requires grad), which this op refuses."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _refuse_grad(q: Tensor, k: Tensor, v: Tensor, op: str) -> None:
    if grad_requested(q, k, v):
        raise RuntimeError(f"{op} computes no gradients (a forward for generation); call it under torch.no_grad() "
                           "or torch.inference_mode(), or train with flash_attention / flash_attention_varlen")


def _plan_key(q, k, v, cache_start, key_mask, causal, softmax_scale, window_size, backend: str) -> tuple | None:
    """A call's signature as its arguments give it (before any check), or None where no plan applies."""
    key = plans.forward_key(q, k, v, causal, softmax_scale, window_size)
    if key is None:
        return None
    extra = []
    for t in (cache_start, key_mask):
        if t is not None and type(t) is not torch.Tensor:
            return None
        extra.append(None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()))
    return key, backend, *extra


def _decode_triton(q: Tensor, k: Tensor, v: Tensor, cache_start: Tensor | None, key_mask: Tensor | None,
                   window: tuple[int, int], scale: float, op: str, key: tuple | None) -> Tensor:
    """The decode kernels, recording their launches as the plan of `key` (a replay of later calls)."""
    from . import calls, launcher  # import Triton: only where the kernels run

    calls.check_device(q, op, f"{op}(..., backend='torch')")
    qk, kk, vk = calls.interpreter_upcast(q, k, v)
    with calls.on_device(q):
        o, _, plan = launcher.forward(qk, kk, vk, window, scale, key_start=cache_start,
                                      key_mask=None if key_mask is None else key_mask.view(torch.uint8))
    if qk is q:  # the interpreter's upcast copies: those calls are not replayed
        plans.decode_plans.remember(key, plan)
    return calls.same_dtype((o,), (q,))[0]


def _decode_torch(q: Tensor, k: Tensor, v: Tensor, cache_start: Tensor | None, key_mask: Tensor | None,
                  window: tuple[int, int], scale: float) -> Tensor:
    """The same result in PyTorch, in float32 (float64 for float64 inputs): an online softmax over KEY_CHUNK keys
    at a time, each query head group's rows against its one K/V head (no copy per query head)."""
    shape = q.shape
    if q.dim() == 3:
        q, k, v = q[:, None], k[:, None], v[:, None]
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    rows = heads // kv_heads * n_q  # row r of a group: query head r // n_q, query r % n_q
    acc_type = acc_dtype(q.dtype)
    qg = q.reshape(batch, kv_heads, rows, d).to(acc_type)
    position = torch.arange(rows, device=q.device) % n_q + (n_k - n_q)  # each row's query among the keys
    left, right = window
    m = torch.full((batch, kv_heads, rows), float("-inf"), dtype=acc_type, device=q.device)
    total = torch.zeros((batch, kv_heads, rows), dtype=acc_type, device=q.device)
    acc = torch.zeros((batch, kv_heads, rows, d), dtype=acc_type, device=q.device)
    for lo in range(0, n_k, KEY_CHUNK):
        kc, vc = k[:, :, lo:lo + KEY_CHUNK].to(acc_type), v[:, :, lo:lo + KEY_CHUNK].to(acc_type)
        j = torch.arange(lo, lo + kc.shape[2], device=q.device)
        seen = torch.ones((rows, j.numel()), dtype=torch.bool, device=q.device)
        if right >= 0:
            seen &= j[None, :] <= position[:, None] + right
        if left >= 0:
            seen &= j[None, :] >= position[:, None] - left
        seen = seen[None, None]
        if cache_start is not None:
            seen = seen & (j[None, :] >= cache_start[:, None])[:, None, None, :]
        if key_mask is not None:
            seen = seen & key_mask[:, None, None, lo:lo + kc.shape[2]]
        s = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale).masked_fill_(~seen, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vc)
        m = m_new
    out = acc / torch.where(total > 0, total, 1.0)[..., None]
    return out.reshape(shape).to(q.dtype)


def _window_list(window_size) -> list[int] | None:
    """`window_size` as the op's schema takes it (an int list); the op's body checks it."""
    return None if window_size is None else [int(w) for w in window_size]


def _decode_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, causal: bool, softmax_scale: float | None,
               window_size: list[int] | None, backend: str) -> Tensor:
    out = _decode(q, k, v, None, key_mask, causal, softmax_scale, None if window_size is None else tuple(window_size),
                  backend)
    return laid_out(out, q)


def _decode_fake(q, k, v, key_mask, causal, softmax_scale, window_size, backend):
    return empty_output(q)


# The op a compiled graph calls (one per layer and step, no host reading: a CUDA graph captures it), opaque as the
# attention ops are (`op_library.define_op`): no autograd kernel (the call computes no gradients, and refuses inputs
# that ask for them).
_DECODE_OP = define_op("flash_attention_decode", "(Tensor q, Tensor k, Tensor v, Tensor? key_mask, bool causal, "
                       "float? softmax_scale, int[]? window_size, str backend) -> Tensor", _decode_op, _decode_fake)
