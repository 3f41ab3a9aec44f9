"""FlashAttention-2: reference math, the tiled PyTorch op, the Triton op, the backend registry and the
functional entry points (dense, varlen, and decoding from a left-padded cache)."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .backends import (
    ATTENTION_BACKENDS,
    CORE_BACKENDS,
    FLASH_ALIASES,
    FLASH_SHORT_NAMES,
    AttentionBackend,
    Backend,
    backend_report,
    flash_runs_triton,
    get_backend,
)
from .cache_decode import flash_attention_decode
from .determinism import deterministic_backward, set_deterministic_backward
from .flash_torch import FlashAttention2Torch, FlashAttentionVarlenTorch
from .packed_rows import PackedRows, find_plan, plan_sequences
from .reference import attention_reference, causal_mask, window_mask
from .triton_env import check_interpreter, interpreter_active
from .validation import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_index_vector,
    check_padding_mask,
    check_position_ids,
    normalize_window,
)


# Plain module state, not functools.cache: a compiled model traces `triton_op` on every flash call, and Dynamo
# warns about each functools cache it traces through.
_triton_ops: dict[str, type] = {}


def triton_op(name: str = "FlashAttention2Triton"):
    """A Triton autograd Function (`FlashAttention2Triton` or `FlashAttentionVarlenTriton`), importing Triton on
    first use (cached: `flash` calls it on every CUDA call).

    Raises:
        ImportError: naming what to install, where Triton is missing.
    """
    if name not in _triton_ops:
        try:
            from . import flash_triton
        except ImportError as e:
            raise ImportError(f"{name} needs Triton, which is not importable here ({e}). Install it "
                              "(pip install triton, on Linux), or use the tiled PyTorch op: "
                              "flash_attention(..., backend='torch') or FlashAttention2Torch") from e
        _triton_ops[name] = getattr(flash_triton, name)
    return _triton_ops[name]


def __getattr__(name: str):
    # `from flashsys.ops.attention import FlashAttention2Triton` imports Triton only when asked for.
    if name in ("FlashAttention2Triton", "FlashAttentionVarlenTriton"):
        return triton_op(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flash_attention(
    q: Float[Tensor, "*batch Nq D"],
    k: Float[Tensor, "*batch Nk D"],
    v: Float[Tensor, "*batch Nk D"],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "*batch Nq D"]:
    """FlashAttention-2: softmax(q kᵀ · softmax_scale) v without materialising the N×N scores.

    Args:
        q: queries, (batch, Nq, head_dim) or (batch, heads, Nq, head_dim); fp16, bf16 or fp32; any strides.
        k: keys, the same rank and batch as q, (…, Nk, head_dim). Nk may differ from Nq, and either may be 0 (as in
            SDPA: Nq = 0 gives an empty output, Nk = 0 zeros: no query sees a key). Rank-4 k may have fewer
            heads than q, Hq a multiple of Hkv (grouped-query / multi-query attention): query head h reads K/V head
            h // (Hq // Hkv), as in SDPA's enable_gqa and flash-attn. K/V are not copied per query head.
        v: values, shaped like k.
        causal: mask future keys. With Nq != Nk the mask is aligned to the bottom-right corner, as in
            FlashAttention-2: query i sees key j iff j <= i + (Nk - Nq). For Nq = 2, Nk = 5 (1 = visible)::

                keys   0 1 2 3 4
                q0     1 1 1 1 0
                q1     1 1 1 1 1

            and for Nq = 5, Nk = 2 the first three queries see no key: their output is 0::

                keys   0 1
                q0     0 0
                q1     0 0
                q2     0 0
                q3     1 0
                q4     1 1

        softmax_scale: multiplies the scores before the softmax; default 1/sqrt(head_dim).
        window_size: (left, right), flash-attn's sliding window: query i sees key j iff
            i + off - left <= j <= i + off + right, off = Nk - Nq; -1 leaves a side unbounded; causal=True sets
            right to 0. Key tiles wholly outside the window are skipped (cost grows with N * window, not N²).
            A query that sees no key outputs 0.
        backend: "auto" (Triton on CUDA tensors, the tiled PyTorch op elsewhere), "triton" or "torch";
            the short names of the registry's "flash", "flash-triton" and "flash-torch".

    Returns:
        The attention output, shaped and typed like q. It is differentiable in q, k and v; the backward
        recomputes the scores from the saved logsumexp.

    Raises:
        ValueError, TypeError: for mismatched shapes, dtypes or devices, naming the argument.
    """
    if backend not in FLASH_ALIASES:
        raise ValueError(f"flash_attention: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
    return get_backend(backend).fn(q, k, v, causal, softmax_scale, window_size)


@torch.compiler.disable  # the offsets are read on the host: the call runs outside a compiled graph
def flash_attention_varlen(
    q: Float[Tensor, "total_q Hq D"],
    k: Float[Tensor, "total_k Hkv D"],
    v: Float[Tensor, "total_k Hkv D"],
    cu_seqlens_q: Int[Tensor, "batch_plus_1"],
    cu_seqlens_k: Int[Tensor, "batch_plus_1"],
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "total_q Hq D"]:
    """FlashAttention-2 over packed variable-length sequences (flash-attn's `flash_attn_varlen_func`).

    Sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and cu_seqlens_k[i]:cu_seqlens_k[i+1] of k and v; it
    attends only within itself. causal and window_size apply per sequence, bottom-right aligned where its query and
    key lengths differ (as in `flash_attention`). No padding is computed: the Triton kernels run one grid over all
    sequences' tiles.

    Args:
        q: (total_q, Hq, head_dim); k, v: (total_k, Hkv, head_dim) with Hq a multiple of Hkv (grouped-query).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets: 0, non-decreasing, ending at the token counts.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (sizes the grid; a larger value only wastes programs).
        causal, softmax_scale, window_size, backend: as in `flash_attention`.

    Returns:
        (total_q, Hq, head_dim), typed like q; differentiable in q, k and v.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes or offsets, naming what is wrong. Checking the offsets reads them
            back (on a GPU, a wait for the device) once per offsets tensor while it is unchanged.
    """
    if backend not in FLASH_ALIASES:
        raise ValueError(f"flash_attention_varlen: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
    if flash_runs_triton(FLASH_ALIASES[backend], q):
        op = triton_op("FlashAttentionVarlenTriton")
    else:
        op = FlashAttentionVarlenTorch
    return op.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                    window_size)


def flash_attention_packed(
    q: Float[Tensor, "B Hq N D"],
    k: Float[Tensor, "B Hkv N D"],
    v: Float[Tensor, "B Hkv N D"],
    position_ids: Int[Tensor, "B_or_1 N"] | None = None,
    *,
    cu_seqlens_q: Int[Tensor, "docs_plus_1"] | None = None,
    cu_seqlens_k: Int[Tensor, "docs_plus_1"] | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "B Hq N D"]:
    """FlashAttention-2 over rows that may each pack several documents, each attending only within itself. The
    documents are told apart by their position ids (a document starts wherever a row's positions do not go on by
    one: 0 1 2 0 1 0 1 2 3 is three documents; transformers' `position_ids`), or given by flash-attn's offsets into
    the B * N flattened tokens (a collator's `cu_seq_lens_*`). Rows that hold one document each run the dense
    kernels; packed ones the varlen kernels (no padding computed).

    Under torch.compile the call stays in the graph (no graph break in each layer): which kernels run is decided when
    the graph runs, by an opaque op that reads the positions or offsets back then (a wait for the device once per
    tensor shared by the layers, as the eager call's). That op is not captured in CUDA graphs.

    Args:
        q, k, v: (B, Hq, N, D) and (B, Hkv, N, D), Hq a multiple of Hkv; queries and keys the same positions.
        position_ids: an integer (B, N) or (1, N) tensor (one row of positions for the whole batch), on q's device.
        cu_seqlens_q, cu_seqlens_k: instead of position_ids, integer (documents + 1,) offsets on q's device: 0,
            never decreasing, ending at B * N. Queries and keys are the same tokens, so the keys' offsets, where
            given, must equal the queries' (checked when they are read).
        causal, softmax_scale, window_size, backend: as in `flash_attention`; causality and the window apply within
            each document.

    Returns:
        The attention output, shaped and typed like q; differentiable in q, k and v.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes, devices or position ids, naming the argument.
    """
    op = "flash_attention_packed"
    scale, triton = _check_rows(q, k, v, causal, softmax_scale, backend, op)
    batch, n = q.shape[0], q.shape[2]
    if (position_ids is None) == (cu_seqlens_q is None and cu_seqlens_k is None):
        raise ValueError(f"{op}: pass position_ids or the offsets cu_seqlens_q (and cu_seqlens_k), one of the two")
    if position_ids is not None:
        check_position_ids(position_ids, batch, n, q.device, op=op)
        finding = ("find_documents", position_ids, f"documents of {batch} rows", batch)
    else:
        cu_q = cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_k
        cu_k = cu_seqlens_k if cu_seqlens_k is not None else cu_q
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            check_index_vector(cu, q.device, name=name, op=op)
        finding = ("find_offsets", cu_q, f"offsets of {batch} rows of {n}", cu_k, batch, n)
    return _over_plan(q, k, v, finding, causal, scale, window_size, backend, triton, op)


def flash_attention_padded(
    q: Float[Tensor, "B Hq N D"],
    k: Float[Tensor, "B Hkv N D"],
    v: Float[Tensor, "B Hkv N D"],
    padding_mask: Int[Tensor, "B N"],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: Backend = "auto",
) -> Float[Tensor, "B Hq N D"]:
    """FlashAttention-2 over padded rows: `padding_mask` marks each row's real tokens, one run of them per row (left
    or right padding). Real tokens attend only to their row's real tokens, causality and the window counted among
    them, as if each row held only those; pad tokens attend to nothing and output 0 (no gradient flows through them).
    The real tokens run through the varlen kernels (pad tokens are not computed); a batch with no padding runs the
    dense kernels. Under torch.compile the call stays in the graph, as `flash_attention_packed`'s does: the mask is
    read when the graph runs, once per mask tensor shared by the layers.

    Args:
        q, k, v: (B, Hq, N, D) and (B, Hkv, N, D), Hq a multiple of Hkv; queries and keys the same positions.
        padding_mask: a (B, N) bool or integer tensor on q's device, nonzero at real tokens (transformers'
            `attention_mask`).
        causal, softmax_scale, window_size, backend: as in `flash_attention`.

    Returns:
        The attention output, shaped and typed like q (0 at pad tokens); differentiable in q, k and v.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes or devices, naming the argument, and (when the mask is read) for
            a row with padding between real tokens.
    """
    op = "flash_attention_padded"
    scale, triton = _check_rows(q, k, v, causal, softmax_scale, backend, op)
    check_padding_mask(padding_mask, q.shape[0], q.shape[2], q.device, op=op)
    return _over_plan(q, k, v, ("find_padding", padding_mask, "padding"), causal, scale, window_size, backend, triton,
                      op)


def _check_rows(q, k, v, causal, softmax_scale, backend, op: str) -> tuple[float, bool]:
    """The checks of a call over rows of sequences; returns (the scale, whether the Triton kernels run)."""
    if backend not in FLASH_ALIASES:
        raise ValueError(f"{op}: backend must be one of {tuple(FLASH_ALIASES)}, got {backend!r}")
    triton = flash_runs_triton(FLASH_ALIASES[backend], q)
    allowed = FLOAT_DTYPES if triton else FLOAT_DTYPES + (torch.float64,)
    scale = check_attention_inputs(q, k, v, causal, softmax_scale, op=op, allowed_dtypes=allowed,
                                   max_head_dim=MAX_HEAD_DIM)
    if q.dim() != 4 or q.shape[2] != k.shape[2]:
        raise ValueError(f"{op}: q, k and v must be (B, H, N, D) with queries and keys the same N, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if triton and q.device.type != "cuda":
        if not interpreter_active():
            raise ValueError(f"{op}: backend {backend!r} runs the Triton kernels, which need CUDA tensors or "
                             f"TRITON_INTERPRET=1 on a CPU; q is on {q.device}")
        check_interpreter(op, "backend='torch'")
    return scale, triton


def _over_plan(q, k, v, finding: tuple, causal, scale, window_size, backend, triton: bool, op: str):
    """Attention over the sequences of the `packed_rows` plan that `find_plan(*finding)` gives: whole rows of an
    eager call through `flash_attention` (its replayed launches), the rest through the plan's ops. Rows of no tokens
    hold no sequences to find: `flash_attention`'s empty output."""
    plan = find_plan(*finding) if q.shape[2] else None
    if plan is None or (not torch.compiler.is_compiling() and plan_sequences(plan) is None):
        return flash_attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window_size, backend=backend)
    window = normalize_window(window_size, bool(causal), op, q.shape[2], k.shape[2])
    return PackedRows.apply(q, k, v, plan, window, scale, triton)


__all__ = [
    "ATTENTION_BACKENDS",
    "CORE_BACKENDS",
    "FLASH_SHORT_NAMES",
    "AttentionBackend",
    "Backend",
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "FlashAttentionVarlenTorch",
    "FlashAttentionVarlenTriton",
    "MAX_HEAD_DIM",
    "attention_reference",
    "backend_report",
    "causal_mask",
    "deterministic_backward",
    "flash_attention",
    "flash_attention_decode",
    "flash_attention_packed",
    "flash_attention_padded",
    "flash_attention_varlen",
    "get_backend",
    "interpreter_active",
    "set_deterministic_backward",
    "window_mask",
]
